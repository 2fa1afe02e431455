use super::*;
use crate::csa2::gemm::linear;

/// Deterministic pseudo-random stream.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// Power-of-two scales from 2^-127 (subnormal, the smallest UE8M0) to 2^2.
fn scale(g: &mut Gen) -> f32 {
    let e = (g.next() % 20) as i32;
    if e == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        2f32.powi(2 - e)
    }
}

/// One weight of every format for `[n, k]`, with odd block shapes.
fn weights(n: usize, k: usize, seed: u64) -> Vec<PackedLinear> {
    let mut g = Gen(seed);
    let f: Vec<f32> = (0..n * k).map(|_| g.f32()).collect();
    let bf: Vec<u16> = (0..n * k)
        .map(|_| (g.f32().to_bits() >> 16) as u16)
        .collect();
    let codes: Vec<u8> = (0..n * k)
        .map(|_| {
            let c = g.next() as u8;
            if c & 0x7F == 0x7F { 0x7E } else { c }
        })
        .collect();
    // FP8: 128 x 128 blocks like the release, and 5 x 48 blocks that split panels and KC.
    let fp8 = |br: usize, bc: usize, g: &mut Gen| {
        let (sr, sc) = (n.div_ceil(br), k.div_ceil(bc));
        let s: Vec<f32> = (0..sr * sc).map(|_| scale(g)).collect();
        PackedLinear::from_fp8(&codes, n, k, &s, sr, sc).unwrap()
    };
    let packed: Vec<u8> = (0..n * k / 2).map(|_| g.next() as u8).collect();
    let sc = k.div_ceil(32);
    let s4: Vec<f32> = (0..n * sc).map(|_| scale(&mut g)).collect();
    let mut all = vec![
        PackedLinear::from_f32(&f, n, k).unwrap(),
        PackedLinear::from_bf16(&bf, n, k).unwrap(),
        fp8(128, 128, &mut g),
        fp8(5, 48, &mut g),
    ];
    // (Packed FP4 has two codes a byte: even widths only.)
    if k.is_multiple_of(2) {
        all.push(PackedLinear::from_fp4(&packed, n, k, &s4, n, sc).unwrap());
    }
    all
}

const SHAPES: [(usize, usize); 7] = [
    (1, 2),
    (16, 64),
    (37, 300),
    (70, 512),
    (129, 130),
    (8, 1030),
    // Odd scale blocks and `KC` blocks (the pair loops' single tails).
    (24, 301),
];

#[test]
fn every_level_is_bit_identical_to_the_scalar_reference() {
    for (si, &(n, k)) in SHAPES.iter().enumerate() {
        for w in weights(n, k, si as u64) {
            for m in [1, 2, 3, 4, 5, 9, 16, 17, 35] {
                let mut g = Gen(m as u64 * 7 + 1);
                let x: Vec<f32> = (0..m * k).map(|_| g.f32() * 4.0).collect();
                let mut want = vec![0f32; m * n];
                w.forward_ref(&x, m, &mut want).unwrap();
                for level in crate::available_levels() {
                    let mut got = vec![f32::NAN; m * n];
                    w.forward_with(level, &x, m, &mut got).unwrap();
                    let bad = got
                        .iter()
                        .zip(&want)
                        .position(|(a, b)| a.to_bits() != b.to_bits());
                    assert!(
                        bad.is_none(),
                        "{} [{n}, {k}] m {m} at {level}: element {bad:?}: {} vs {}",
                        w.format().name(),
                        got[bad.unwrap_or(0)],
                        want[bad.unwrap_or(0)]
                    );
                }
            }
        }
    }
}

#[test]
fn the_reference_is_matrixmultiply_on_the_dequantized_weights() {
    // matrixmultiply sums with FMA only where the CPU has it.
    if !cfg!(target_arch = "x86_64") || !crate::SimdLevel::Avx2.is_available() {
        return;
    }
    for (si, &(n, k)) in SHAPES.iter().enumerate() {
        for w in weights(n, k, 100 + si as u64) {
            let d = w.dequantize();
            for m in [1, 4, 33] {
                let mut g = Gen(m as u64);
                let x: Vec<f32> = (0..m * k).map(|_| g.f32()).collect();
                let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                w.forward_ref(&x, m, &mut a).unwrap();
                linear(&x, &d, m, k, n, &mut b).unwrap();
                assert!(
                    a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} [{n}, {k}] m {m}",
                    w.format().name()
                );
            }
        }
    }
}

#[test]
fn dequantize_is_the_storage_arithmetic() {
    let (n, k) = (20, 70);
    let mut g = Gen(5);
    let codes: Vec<u8> = (0..n * k).map(|i| (i * 37 % 127) as u8).collect();
    let s: Vec<f32> = (0..2 * 3).map(|_| scale(&mut g)).collect();
    let w = PackedLinear::from_fp8(&codes, n, k, &s, 2, 3).unwrap();
    let d = w.dequantize();
    for j in 0..n {
        for l in 0..k {
            let want = e4m3_to_f32(codes[j * k + l]) * s[(j / 10) * 3 + l / 24];
            assert_eq!(d[j * k + l].to_bits(), want.to_bits(), "fp8 [{j}, {l}]");
        }
    }
    let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 91 % 256) as u8).collect();
    let s4: Vec<f32> = (0..n * 3).map(|_| scale(&mut g)).collect();
    let w = PackedLinear::from_fp4(&packed, n, k, &s4, n, 3).unwrap();
    let d = w.dequantize();
    for j in 0..n {
        for l in 0..k {
            let c = (packed[j * k / 2 + l / 2] >> (4 * (l % 2))) & 0xF;
            let want = e2m1_to_f32(c) * s4[j * 3 + l / 24];
            assert_eq!(d[j * k + l].to_bits(), want.to_bits(), "fp4 [{j}, {l}]");
        }
    }
    assert_eq!(w.resident_bytes(), 2 * k * PANEL / 2 + 2 * 3 * PANEL * 4);
}

#[test]
fn threads_give_the_bits_of_one_thread() {
    for &(n, k) in &[(700, 300), (2048, 128), (129, 1030)] {
        for w in weights(n, k, 9) {
            for m in [1, 3, 40] {
                let mut g = Gen(m as u64);
                let x: Vec<f32> = (0..m * k).map(|_| g.f32()).collect();
                let mut want = vec![0f32; m * n];
                w.forward(&x, m, &mut want).unwrap();
                for t in [2, 3, 8] {
                    let mut got = vec![f32::NAN; m * n];
                    w.forward_threads(&x, m, &mut got, t).unwrap();
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} [{n}, {k}] m {m} t {t}",
                        w.format().name()
                    );
                }
            }
        }
    }
}

#[test]
fn bad_weights_are_refused_with_their_place() {
    let mut codes = vec![0u8; 4 * 8];
    codes[13] = 0xFF;
    let e = PackedLinear::from_fp8(&codes, 4, 8, &[1.0], 1, 1).unwrap_err();
    assert!(e.to_string().contains("[1, 5]"), "{e}");
    let e = PackedLinear::from_fp8(&[0; 32], 4, 8, &[1.0; 5], 1, 5).unwrap_err();
    assert!(e.to_string().contains("does not tile"), "{e}");
    let e = PackedLinear::from_fp8(&[0; 32], 4, 8, &[f32::NAN], 1, 1).unwrap_err();
    assert!(e.to_string().contains("scale"), "{e}");
    let e = PackedLinear::from_fp8(&[0; 32], 4, 8, &[2f32.powi(125)], 1, 1).unwrap_err();
    assert!(e.to_string().contains("scale"), "{e}");
    let e = PackedLinear::from_fp4(&[0; 6], 4, 3, &[1.0; 4], 4, 1).unwrap_err();
    assert!(e.to_string().contains("even"), "{e}");
    let e = PackedLinear::from_f32(&[0.0; 5], 2, 3).unwrap_err();
    assert!(e.to_string().contains("[n, k]"), "{e}");
    let w = PackedLinear::from_f32(&[0.0; 6], 2, 3).unwrap();
    let e = w.forward(&[0.0; 5], 2, &mut [0.0; 4]).unwrap_err();
    assert!(e.to_string().contains("x [m, k]"), "{e}");
}
