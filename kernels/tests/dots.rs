//! Fused dot products against f64 references computed from scalar-dequantized values, with
//! the documented tolerance; MXFP4 x MXFP4 exactly. Batch forms equal the single forms bit for
//! bit on each level.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvstack_kernels::*;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Realistic activations: normal-ish values scaled per row, a few outliers.
fn activations(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let u: f32 = rng.random_range(-1.0..1.0);
            let v: f32 = rng.random_range(-1.0..1.0);
            let x = (u + v) * scale;
            if i % 97 == 13 { x * 40.0 } else { x }
        })
        .collect()
}

fn encode(format: EntryFormat, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; x.len() / format.dim() * format.entry_bytes()];
    quantize(format, x, &mut out).unwrap();
    out
}

#[test]
fn fp4_dots_are_within_the_bound_and_batch_equals_single() {
    let mut rng = StdRng::seed_from_u64(7);
    for (round, scale) in [1e-3f32, 0.5, 3.0, 300.0].into_iter().enumerate() {
        // 67 entries: eight batches of 8 and a remainder of 3.
        let x = activations(&mut rng, 67 * 512, scale);
        let bytes = encode(EntryFormat::GlobalFp4, &x);
        let dec = ref_dequantize(EntryFormat::GlobalFp4, &bytes);
        let entries = fp4_entries(&bytes);
        let q: [f32; 512] = activations(&mut rng, 512, 1.0 + round as f32)
            .try_into()
            .unwrap();
        for level in available_levels() {
            let mut out = vec![0f32; entries.len()];
            dot_fp4_many_with(level, &q, &entries, &mut out).unwrap();
            for (i, (e, &got)) in entries.iter().zip(&out).enumerate() {
                let (exact, abs) = ref_dot(&q, &dec[i * 512..][..512]);
                assert!(
                    dot_within_bound(got, exact, abs, 512),
                    "{level} entry {i}: {got:e} vs {exact:e}"
                );
                let single = dot_fp4_with(level, &q, e).unwrap();
                assert_eq!(single.to_bits(), got.to_bits(), "{level} entry {i}");
            }
        }
    }
}

#[test]
fn mxfp4_dots_are_within_the_bound_and_batch_equals_single() {
    let mut rng = StdRng::seed_from_u64(8);
    for (round, scale) in [1e-6f32, 0.02, 1.0, 1e4].into_iter().enumerate() {
        // 203 keys: batches of 8 and a remainder of 3.
        let x = activations(&mut rng, 203 * 128, scale);
        let bytes = encode(EntryFormat::IndexMxfp4, &x);
        let dec = ref_dequantize(EntryFormat::IndexMxfp4, &bytes);
        let keys = mxfp4_entries(&bytes);
        let q: [f32; 128] = activations(&mut rng, 128, 0.1 + round as f32)
            .try_into()
            .unwrap();
        for level in available_levels() {
            let mut out = vec![0f32; keys.len()];
            dot_mxfp4_many_with(level, &q, &keys, &mut out).unwrap();
            for (i, (k, &got)) in keys.iter().zip(&out).enumerate() {
                let (exact, abs) = ref_dot(&q, &dec[i * 128..][..128]);
                assert!(
                    dot_within_bound(got, exact, abs, 128),
                    "{level} key {i}: {got:e} vs {exact:e}"
                );
                let single = dot_mxfp4_with(level, &q, k).unwrap();
                assert_eq!(single.to_bits(), got.to_bits(), "{level} key {i}");
            }
        }
    }
}

/// Exponent span of `eq_b + ek_b` over blocks with a non-zero value in both entries.
fn scale_span(q: &IndexMxfp4Entry, k: &IndexMxfp4Entry) -> i32 {
    let sums: Vec<i32> = (0..4)
        .filter(|&b| {
            q.values[b * 16..][..16].iter().any(|&x| x & 0x77 != 0)
                && k.values[b * 16..][..16].iter().any(|&x| x & 0x77 != 0)
        })
        .map(|b| i32::from(q.scales[b]) + i32::from(k.scales[b]))
        .collect();
    sums.iter().max().unwrap_or(&0) - sums.iter().min().unwrap_or(&0)
}

fn check_mx_mx(q: &IndexMxfp4Entry, keys: &[IndexMxfp4Entry]) -> Result<(), TestCaseError> {
    let qd = ref_values_f64(EntryFormat::IndexMxfp4, zerocopy::IntoBytes::as_bytes(q));
    let mut first: Option<Vec<f32>> = None;
    for level in available_levels() {
        let mut out = vec![0f32; keys.len()];
        dot_mxfp4_mxfp4_many_with(level, q, keys, &mut out).unwrap();
        for (i, (k, &got)) in keys.iter().zip(&out).enumerate() {
            let single = dot_mxfp4_mxfp4_with(level, q, k).unwrap();
            prop_assert!(same_f32(single, got), "{} key {}", level, i);
            let kd = ref_values_f64(EntryFormat::IndexMxfp4, zerocopy::IntoBytes::as_bytes(k));
            let (exact, _) = ref_dot(&qd, &kd);
            if exact.is_nan() {
                prop_assert!(got.is_nan(), "{} key {}: {:e} should be NaN", level, i, got);
            } else if scale_span(q, k) <= 38 {
                // The element-order f64 reference is exact here, and so is the kernel.
                prop_assert_eq!(
                    got.to_bits(),
                    (exact as f32).to_bits(),
                    "{} key {}",
                    level,
                    i
                );
            }
        }
        // Identical on every level, always (NaN compared as NaN).
        match &first {
            None => first = Some(out),
            Some(f) => prop_assert!(
                f.iter().zip(&out).all(|(&a, &b)| same_f32(a, b)),
                "{} differs from portable",
                level
            ),
        }
    }
    Ok(())
}

#[test]
fn mxfp4_mxfp4_is_exact_on_realistic_entries() {
    let mut rng = StdRng::seed_from_u64(9);
    for scale in [1e-30f32, 1e-3, 1.0, 1e3, 1e30] {
        let x = activations(&mut rng, 100 * 128, scale);
        let keys = mxfp4_entries(&encode(EntryFormat::IndexMxfp4, &x));
        for q in keys.iter().step_by(9) {
            check_mx_mx(q, &keys).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Arbitrary bytes: every scale byte (0 and 255 included) and every code.
    #[test]
    fn mxfp4_mxfp4_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 68 * 9)) {
        let e = mxfp4_entries(&bytes);
        check_mx_mx(&e[0], &e[1..])?;
    }

    /// Arbitrary entry bytes against a random query: within the bound whenever the result
    /// cannot overflow f32, NaN when a scale is NaN.
    #[test]
    fn f32_dots_on_random_bytes(
        fp4 in prop::collection::vec(any::<u8>(), 288 * 3),
        mx in prop::collection::vec(any::<u8>(), 68 * 3),
        q in prop::collection::vec(-4.0f32..4.0, 512),
    ) {
        let q512: [f32; 512] = q.clone().try_into().unwrap();
        let q128: [f32; 128] = q[..128].try_into().unwrap();
        let fd = ref_values_f64(EntryFormat::GlobalFp4, &fp4);
        let md = ref_values_f64(EntryFormat::IndexMxfp4, &mx);
        for level in available_levels() {
            for (i, e) in fp4_entries(&fp4).iter().enumerate() {
                let got = dot_fp4_with(level, &q512, e).unwrap();
                let (exact, abs) = ref_dot(&q512, &fd[i * 512..][..512]);
                if exact.is_nan() || abs < 1e37 {
                    prop_assert!(dot_within_bound(got, exact, abs, 512),
                        "{} fp4 {}: {:e} vs {:e}", level, i, got, exact);
                }
            }
            for (i, k) in mxfp4_entries(&mx).iter().enumerate() {
                let got = dot_mxfp4_with(level, &q128, k).unwrap();
                let (exact, abs) = ref_dot(&q128, &md[i * 128..][..128]);
                if exact.is_nan() || abs < 1e37 {
                    prop_assert!(dot_within_bound(got, exact, abs, 128),
                        "{} mxfp4 {}: {:e} vs {:e}", level, i, got, exact);
                }
            }
        }
    }
}
