//! Cache-resident kernel timings, min over many repetitions (robust to a noisy machine).
//! Ignored by default: `cargo test --release -p kvstack-kernels --test microbench -- --ignored
//! --nocapture`.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::time::Instant;

use kvstack_kernels::*;
use zerocopy::FromBytes;

fn min_ns(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_nanos() as f64);
    }
    best
}

fn activations(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32) * 0.618).sin() * 2f32.powi((i / 64 % 12) as i32 - 6))
        .collect()
}

#[test]
#[ignore = "benchmark; run explicitly in release"]
fn kernel_timings() {
    let reps = 400;
    for level in available_levels() {
        for format in EntryFormat::ALL {
            let rows = 256;
            let x = activations(rows * format.dim());
            let mut enc = vec![0u8; rows * format.entry_bytes()];
            let mut y = vec![0f32; x.len()];
            let tq = min_ns(reps, || {
                quantize_with(level, format, black_box(&x), &mut enc).unwrap()
            });
            let td = min_ns(reps, || {
                dequantize_with(level, format, black_box(&enc), &mut y).unwrap()
            });
            let gb = (x.len() * 4) as f64;
            println!(
                "{level:8} {format:12} quantize {:6.2} GB/s  dequantize {:6.2} GB/s (f32 bytes)",
                gb / tq,
                gb / td
            );
        }
        let n = 512;
        let x = activations(n * 512);
        let mut enc = vec![0u8; n * GlobalFp4Entry::BYTES];
        quantize(EntryFormat::GlobalFp4, &x, &mut enc).unwrap();
        let e = <[GlobalFp4Entry]>::ref_from_bytes(&enc).unwrap();
        let q: [f32; 512] = activations(512).try_into().unwrap();
        let mut out = vec![0f32; n];
        let t = min_ns(reps, || {
            dot_fp4_many_with(level, black_box(&q), e, &mut out).unwrap()
        });
        println!(
            "{level:8} dot fp4     {:6.2} GB/s  {:6.1} ns/entry",
            enc.len() as f64 / t,
            t / n as f64
        );

        let n = 2048;
        let x = activations(n * 128);
        let mut enc = vec![0u8; n * IndexMxfp4Entry::BYTES];
        quantize(EntryFormat::IndexMxfp4, &x, &mut enc).unwrap();
        let k = <[IndexMxfp4Entry]>::ref_from_bytes(&enc).unwrap();
        let q: [f32; 128] = activations(128).try_into().unwrap();
        let mut out = vec![0f32; n];
        let t = min_ns(reps, || {
            dot_mxfp4_many_with(level, black_box(&q), k, &mut out).unwrap()
        });
        println!(
            "{level:8} dot mxfp4   {:6.2} GB/s  {:6.1} ns/entry",
            enc.len() as f64 / t,
            t / n as f64
        );
        let t = min_ns(reps, || {
            dot_mxfp4_mxfp4_many_with(level, black_box(&k[5]), k, &mut out).unwrap()
        });
        println!(
            "{level:8} dot mx.mx   {:6.2} GB/s  {:6.1} ns/entry",
            enc.len() as f64 / t,
            t / n as f64
        );
    }
}
