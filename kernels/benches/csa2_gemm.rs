//! Criterion benchmark of the f32 GEMM behind every attention projection
//! (`kvstack_kernels::csa2::gemm`, `matrixmultiply`), against the plain triple loop, at the
//! projection shapes of V4.1-Flash (hidden 5120, q_lora_rank 1280, head_dim 512) for one
//! decoded token and a 64-token prefill chunk. Throughput is in FLOP/s (2 m n k per product).

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use kvstack_kernels::csa2::gemm::{linear, linear_ref};

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32) - 0.5)
        .collect()
}

fn gemm(c: &mut Criterion) {
    // (name, m, k, n): wq_a (hidden -> q_lora), wkv (hidden -> head_dim), one group's wo_a.
    let shapes = [
        ("wq_a", 5120, 1280),
        ("wkv", 5120, 512),
        ("wo_a_group", 4096, 1024),
    ];
    for (name, k, n) in shapes {
        let w = data(n * k, 7);
        let mut g = c.benchmark_group(format!("linear_{name}"));
        g.sample_size(10);
        for m in [1usize, 64] {
            let x = data(m * k, 3);
            let mut out = vec![0f32; m * n];
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            g.bench_with_input(BenchmarkId::new("matrixmultiply", m), &m, |b, &m| {
                b.iter(|| linear(black_box(&x), black_box(&w), m, k, n, &mut out).unwrap())
            });
            if m == 1 {
                g.bench_with_input(BenchmarkId::new("naive", m), &m, |b, &m| {
                    b.iter(|| linear_ref(black_box(&x), black_box(&w), m, k, n, &mut out).unwrap())
                });
            }
        }
        g.finish();
    }
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    gemm(&mut c);
}

criterion_main!(benches);
