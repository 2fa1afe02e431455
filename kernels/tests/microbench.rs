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

/// Linear layers of the built-in model's shapes, weights as stored (FP8, FP4, BF16) and as
/// f32, through `kvstack_kernels::linear` and through `matrixmultiply` (`csa2::gemm::linear`,
/// what the model used before): decode rows (1 and 4, where the weight bytes bind) and a
/// prefill chunk (256 rows, where the FMA rate binds), with ratios to the read-stream and FMA
/// ceilings measured in the same run (one thread).
#[test]
#[ignore = "benchmark; run explicitly in release"]
fn linear_timings() {
    use kvstack_kernels::csa2::gemm::linear;
    use kvstack_kernels::linear::PackedLinear;
    use kvstack_kernels::peak::Peaks;

    let p = Peaks::detected();
    let iters = 2_000_000u64;
    let fma_ns = min_ns(20, || {
        black_box(p.fma(black_box(iters), 0.5));
    });
    let fma_peak = (p.fma_flops_per_iter() * iters) as f64 / (fma_ns * 1e-9);
    let buf = vec![1u8; 512 << 20];
    let read_ns = min_ns(5, || {
        black_box(p.read_sum(black_box(&buf)));
    });
    let read_bw = buf.len() as f64 / read_ns * 1e9;
    println!(
        "ceilings ({}): FMA {:.1} GFLOP/s, read stream {:.1} GB/s",
        p.level(),
        fma_peak / 1e9,
        read_bw / 1e9
    );
    // (n, k): wq_b, the indexer's wq_b, wkv, an expert's w1, the head.
    for (name, n, k) in [
        ("wq_b", 2048, 128),
        ("indexer.wq_b", 4096, 128),
        ("wkv", 512, 256),
        ("expert w1", 128, 256),
        ("head", 1024, 256),
    ] {
        let w = activations(n * k)
            .iter()
            .map(|v| v * 0.05)
            .collect::<Vec<f32>>();
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 37 % 126) as u8).collect();
        let s8 = vec![2f32.powi(-8); n.div_ceil(128) * k.div_ceil(128)];
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 91 % 256) as u8).collect();
        let s4 = vec![2f32.powi(-4); n * k.div_ceil(32)];
        let bf: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let ws = [
            PackedLinear::from_f32(&w, n, k).unwrap(),
            PackedLinear::from_bf16(&bf, n, k).unwrap(),
            PackedLinear::from_fp8(&codes, n, k, &s8, n.div_ceil(128), k.div_ceil(128)).unwrap(),
            PackedLinear::from_fp4(&packed, n, k, &s4, n, k.div_ceil(32)).unwrap(),
        ];
        for m in [1usize, 4, 256] {
            let x = activations(m * k);
            let mut out = vec![0f32; m * n];
            let reps = if m == 256 { 20 } else { 400 };
            let flops = (2 * m * n * k) as f64;
            let mm = min_ns(reps, || {
                linear(black_box(&x), black_box(&w), m, k, n, &mut out).unwrap();
            });
            let mut line = format!(
                "{name} [{n}, {k}] m {m:>3}: matrixmultiply f32 {:>8.1} us",
                mm / 1e3
            );
            for lin in &ws {
                let ns = min_ns(reps, || {
                    lin.forward(black_box(&x), m, &mut out).unwrap();
                });
                let bytes = lin.resident_bytes() as f64;
                line += &format!(
                    "; {} {:.1} us ({:.2}x, {:.2} of FMA peak, weights at {:.2} of read stream)",
                    lin.format().name(),
                    ns / 1e3,
                    mm / ns,
                    flops / (ns * 1e-9) / fma_peak,
                    bytes / (ns * 1e-9) / read_bw
                );
            }
            println!("{line}");
        }
    }
}

/// `SparseAttention::run` of one query at the built-in model's shape (4 heads of 512, 128
/// FP8 window rows and 72 selected FP4 entries), at every level this CPU has: over quantized
/// keys (decode: each key decoded in the call) and over decoded ones (prefill: keys decoded
/// once per step), with the speed-up over the portable level measured in the same run.
#[test]
#[ignore = "benchmark; run explicitly in release"]
fn attention_timings() {
    use kvstack_kernels::csa2::attention::{AttentionShape, KeyRow, SparseAttention};

    let (heads, d, window, entries) = (4, 512, 128, 72);
    let shape = AttentionShape::new(heads, d).unwrap();
    let (wc, ec) = (shape.window_codec(), shape.compressed_codec());
    // Uniform in [-1, 1): logits of a few units, as in the model, so that most keys take the
    // accumulate step (with `activations`' wide range most would underflow to weight zero).
    let mut seed = 0x2545_f491_u64;
    let mut uniform = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let x: Vec<f32> = (0..(window + entries) * d).map(|_| uniform()).collect();
    let mut wrows = vec![0u8; window * wc.bytes()];
    let mut erows = vec![0u8; entries * ec.bytes()];
    wc.quantize(&x[..window * d], &mut wrows).unwrap();
    ec.quantize(&x[window * d..], &mut erows).unwrap();
    let quantized: Vec<KeyRow<'_>> = wrows
        .chunks_exact(wc.bytes())
        .map(KeyRow::Window)
        .chain(erows.chunks_exact(ec.bytes()).map(KeyRow::Compressed))
        .collect();
    // Cache-line aligned, as prefill's decoded rows are.
    let mut dec = kvstack_kernels::aligned::AlignedF32::zeroed(x.len());
    for (k, row) in quantized.iter().zip(dec.as_mut_slice().chunks_exact_mut(d)) {
        shape.decode_row(*k, row).unwrap();
    }
    let decoded: Vec<KeyRow<'_>> = dec
        .as_slice()
        .chunks_exact(d)
        .map(KeyRow::Decoded)
        .collect();
    let q: Vec<f32> = (0..heads * d).map(|_| uniform()).collect();
    let sinks = vec![0.25f32; heads];
    let mut out = vec![0f32; heads * d];
    let keys = quantized.len() as f64;
    let mut base = [0f64; 2];
    for level in available_levels() {
        let mut attn = SparseAttention::with_level(shape, level).unwrap();
        let mut line = format!("{:8} attention {heads}x{d}, {keys} keys:", level.name());
        for (i, (name, rows)) in [("quantized", &quantized), ("decoded", &decoded)]
            .into_iter()
            .enumerate()
        {
            let ns = min_ns(300, || {
                attn.run(black_box(&q), &sinks, rows.iter().copied(), &mut out)
                    .unwrap();
            });
            if level == SimdLevel::Portable {
                base[i] = ns;
            }
            line += &format!(
                "  {name} {:7.1} us ({:5.1} ns/key, {:.2}x portable)",
                ns / 1e3,
                ns / keys,
                base[i] / ns
            );
        }
        println!("{line}");
    }
}
