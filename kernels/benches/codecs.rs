//! Criterion micro-benchmarks: per-format codec and dot throughput on cache-resident buffers,
//! for every SIMD level this CPU runs. (`kvstack bench codecs`, built on
//! `kvstack_bench::codecs`, compares against memcpy and memory bandwidth instead.)

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use kvstack_kernels::*;
use zerocopy::FromBytes;

/// Rows per iteration: small enough to stay in L2 for every format.
const ROWS: usize = 128;

fn activations(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32) * 0.618).sin() * 2f32.powi((i / 64 % 12) as i32 - 6))
        .collect()
}

fn codecs(c: &mut Criterion) {
    for format in EntryFormat::ALL {
        let x = activations(ROWS * format.dim());
        let mut enc = vec![0u8; ROWS * format.entry_bytes()];
        quantize(format, &x, &mut enc).unwrap();
        let mut y = vec![0f32; x.len()];

        let mut g = c.benchmark_group(format!("{format}"));
        g.throughput(Throughput::Bytes((x.len() * 4) as u64));
        for level in available_levels() {
            g.bench_with_input(BenchmarkId::new("quantize", level), &level, |b, &l| {
                b.iter(|| quantize_with(l, format, black_box(&x), black_box(&mut enc)))
            });
            g.bench_with_input(BenchmarkId::new("dequantize", level), &level, |b, &l| {
                b.iter(|| dequantize_with(l, format, black_box(&enc), black_box(&mut y)))
            });
        }
        g.finish();
    }
}

fn dots(c: &mut Criterion) {
    let x = activations(4 * ROWS * 512);
    let q = activations(512);

    let mut enc = vec![0u8; 4 * ROWS * GlobalFp4Entry::BYTES];
    quantize(EntryFormat::GlobalFp4, &x, &mut enc).unwrap();
    let entries = <[GlobalFp4Entry]>::ref_from_bytes(&enc).unwrap();
    let q512: &[f32; 512] = q[..].try_into().unwrap();
    let mut out = vec![0f32; entries.len()];
    let mut g = c.benchmark_group("dot fp4-global");
    g.throughput(Throughput::Bytes(enc.len() as u64));
    for level in available_levels() {
        g.bench_with_input(BenchmarkId::new("f32 query", level), &level, |b, &l| {
            b.iter(|| dot_fp4_many_with(l, black_box(q512), entries, black_box(&mut out)))
        });
    }
    g.finish();

    let x = activations(16 * ROWS * 128);
    let mut enc = vec![0u8; 16 * ROWS * IndexMxfp4Entry::BYTES];
    quantize(EntryFormat::IndexMxfp4, &x, &mut enc).unwrap();
    let keys = <[IndexMxfp4Entry]>::ref_from_bytes(&enc).unwrap();
    let q128: &[f32; 128] = q[..128].try_into().unwrap();
    let mut out = vec![0f32; keys.len()];
    let mut g = c.benchmark_group("dot mxfp4-index");
    g.throughput(Throughput::Bytes(enc.len() as u64));
    for level in available_levels() {
        g.bench_with_input(BenchmarkId::new("f32 query", level), &level, |b, &l| {
            b.iter(|| dot_mxfp4_many_with(l, black_box(q128), keys, black_box(&mut out)))
        });
        g.bench_with_input(BenchmarkId::new("mxfp4 query", level), &level, |b, &l| {
            b.iter(|| dot_mxfp4_mxfp4_many_with(l, black_box(&keys[3]), keys, black_box(&mut out)))
        });
    }
    g.finish();
}

mod groups {
    // `criterion_group!` defines an undocumented `pub fn`; a private module keeps it internal.
    criterion::criterion_group!(benches, super::codecs, super::dots);
}
criterion_main!(groups::benches);
