//! Property tests: on random rows of many magnitudes (exact ties, zeros, -0, huge, tiny and
//! subnormal values, tiles pinned to scale boundaries) every level encodes exactly like the
//! scalar reference; on random bytes every level decodes exactly like it; and the unchecked
//! quantizer matches the reference on NaN and infinities too.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvstack_firmware_interface::element::{E2M1_MAGNITUDES, e4m3_to_f32};
use kvstack_kernels::*;
use proptest::prelude::*;

/// Exact E2M1 midpoints (the tie points of E2M1 rounding).
const E2M1_MIDS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

fn pow2(k: i32) -> f32 {
    2f32.powi(k)
}

/// One element, relative to a row exponent `e`.
fn element(e: i32) -> impl Strategy<Value = f32> {
    let sign = any::<bool>();
    prop_oneof![
        // Ordinary values around the row's magnitude.
        6 => (any::<u32>(), -12i32..3, sign).prop_map(move |(m, d, s)| {
            let x = (1.0 + (m >> 9) as f32 / (1u32 << 23) as f32) * pow2(e + d);
            if s { -x } else { x }
        }),
        // E2M1 ties and values for power-of-two scales (mxfp4, and fp8 via E4M3 midpoints).
        2 => (0usize..7, -3i32..3, sign).prop_map(move |(i, d, s)| {
            let x = E2M1_MIDS[i] * pow2(e + d);
            if s { -x } else { x }
        }),
        1 => (0u8..0x7E, sign).prop_map(move |(c, s)| {
            // An E4M3 midpoint times 2^e: a tie for fp8-window tiles with scale 2^e.
            let x = (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0 * pow2(e);
            if s { -x } else { x }
        }),
        // Tile maxima pinned to the boundaries of the scale rules.
        1 => (0usize..8, sign).prop_map(move |(i, s)| {
            let x = [6.0, 448.0, 6.0 * 448.0, 6.0 / 512.0, 3.0, 12.0, 1e-4, 0.0448][i] * pow2(e);
            if s { -x } else { x }
        }),
        // fp4-global ties: an E2M1 midpoint or magnitude times an E4M3 scale value.
        1 => (0usize..7, 1u8..0x7F, sign).prop_map(|(i, c, s)| {
            let x = E2M1_MIDS[i] * e4m3_to_f32(c);
            if s { -x } else { x }
        }),
        1 => (0usize..8, 1u8..0x7F).prop_map(|(i, c)| E2M1_MAGNITUDES[i] * e4m3_to_f32(c)),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        // Huge and tiny, including subnormals.
        1 => prop_oneof![
            Just(f32::MAX),
            Just(-f32::MAX),
            Just(1e30f32),
            Just(-1e30f32),
            Just(f32::MIN_POSITIVE),
            Just(-f32::MIN_POSITIVE),
            (1u32..0x0080_0000).prop_map(f32::from_bits),
            (1u32..0x0080_0000).prop_map(|b| -f32::from_bits(b)),
        ],
    ]
}

/// `rows` rows of `dim` finite values, each row around its own exponent.
fn rows(dim: usize, max_rows: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        (-140i32..110).prop_flat_map(move |e| prop::collection::vec(element(e), dim)),
        1..=max_rows,
    )
    .prop_map(|r| r.concat())
}

/// Like [`rows`], with some NaN and infinities mixed in.
fn rows_with_non_finite(dim: usize) -> impl Strategy<Value = Vec<f32>> {
    (
        rows(dim, 2),
        prop::collection::vec(
            (
                any::<prop::sample::Index>(),
                prop_oneof![
                    Just(f32::NAN),
                    Just(-f32::NAN),
                    Just(f32::from_bits(0x7F80_0001)),
                    Just(f32::INFINITY),
                    Just(f32::NEG_INFINITY),
                ],
            ),
            1..6,
        ),
    )
        .prop_map(|(mut x, bad)| {
            for (i, v) in bad {
                let n = x.len();
                x[i.index(n)] = v;
            }
            x
        })
}

fn check_encode(format: EntryFormat, input: &[f32]) -> Result<(), TestCaseError> {
    let want = ref_quantize(format, input);
    for level in available_levels() {
        let mut out = vec![0u8; want.len()];
        quantize_with(level, format, input, &mut out).unwrap();
        if let Some(d) = first_byte_diff(&out, &want, format.entry_bytes()) {
            return Err(TestCaseError::fail(format!("{level} {format}: {d}")));
        }
    }
    Ok(())
}

fn check_decode(format: EntryFormat, bytes: &[u8]) -> Result<(), TestCaseError> {
    let want = ref_dequantize(format, bytes);
    for level in available_levels() {
        let mut y = vec![0f32; want.len()];
        dequantize_with(level, format, bytes, &mut y).unwrap();
        if let Some(d) = first_f32_diff(&y, &want, format.dim()) {
            return Err(TestCaseError::fail(format!("{level} {format}: {d}")));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn fp8_window_encode_matches_reference(x in rows(512, 3)) {
        check_encode(EntryFormat::WindowFp8, &x)?;
    }

    #[test]
    fn fp4_global_encode_matches_reference(x in rows(512, 3)) {
        check_encode(EntryFormat::GlobalFp4, &x)?;
    }

    #[test]
    fn mxfp4_index_encode_matches_reference(x in rows(128, 6)) {
        check_encode(EntryFormat::IndexMxfp4, &x)?;
    }

    #[test]
    fn unchecked_encode_matches_reference_on_non_finite(
        x512 in rows_with_non_finite(512),
        x128 in rows_with_non_finite(128),
    ) {
        for (format, x) in [
            (EntryFormat::WindowFp8, &x512),
            (EntryFormat::GlobalFp4, &x512),
            (EntryFormat::IndexMxfp4, &x128),
        ] {
            let want = ref_quantize(format, x);
            for level in available_levels() {
                let mut out = vec![0u8; want.len()];
                quantize_unchecked_with(level, format, x, &mut out).unwrap();
                if let Some(d) = first_byte_diff(&out, &want, format.entry_bytes()) {
                    return Err(TestCaseError::fail(format!("{level} {format}: {d}")));
                }
                // The checked form rejects the same input.
                let err = quantize_with(level, format, x, &mut out).unwrap_err();
                prop_assert!(matches!(err, Error::NonFinite { .. }), "{err}");
            }
        }
    }

    #[test]
    fn decode_of_random_bytes_matches_reference(
        n in 1usize..5,
        seed in prop::collection::vec(any::<u8>(), 528 * 4),
    ) {
        for format in EntryFormat::ALL {
            check_decode(format, &seed[..n * format.entry_bytes()])?;
        }
    }
}

/// Every byte value in every position, deterministic (decode is a pure byte function).
#[test]
fn decode_of_every_byte_value_matches_reference() {
    for format in EntryFormat::ALL {
        let eb = format.entry_bytes();
        // Entry i has value bytes (i + j) mod 256 and scale bytes (7 i + j) mod 256, so over 256
        // entries every value and scale position sees every byte.
        let value_bytes = eb - format.dim() / format.tile();
        let bytes: Vec<u8> = (0..256usize)
            .flat_map(|i| {
                (0..eb).map(move |j| {
                    if j < value_bytes {
                        ((i + j) % 256) as u8
                    } else {
                        ((7 * i + j) % 256) as u8
                    }
                })
            })
            .collect();
        check_decode(format, &bytes).unwrap();
    }
}

/// Exact ties with each tile's maximum pinned so the scale is known, for every scale exponent
/// the formats allow: the cases where a reciprocal instead of a division, or a wrong tie rule,
/// would show.
#[test]
fn pinned_tiles_with_exact_ties_match_reference() {
    // mxfp4-index and fp8-window: power-of-two scales.
    for k in -126..=125 {
        let s = pow2(k);
        let mut x = vec![0f32; 128];
        for (t, tile) in x.chunks_exact_mut(32).enumerate() {
            tile[0] = if t % 2 == 0 { 6.0 * s } else { -6.0 * s };
            for (i, v) in tile.iter_mut().enumerate().skip(1) {
                let m = E2M1_MIDS[i % 7] * s;
                *v = if i % 3 == 0 { -m } else { m };
            }
        }
        check_encode(EntryFormat::IndexMxfp4, &x).unwrap();
    }
    for k in -124..=118 {
        let s = pow2(k);
        let mut x = vec![0f32; 512];
        for tile in x.chunks_exact_mut(32) {
            tile[0] = 448.0 * s;
            for (i, v) in tile.iter_mut().enumerate().skip(1) {
                let c = ((i * 5) % 0x7E) as u8;
                let mid = (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0;
                *v = if i % 2 == 0 { -mid * s } else { mid * s };
            }
        }
        check_encode(EntryFormat::WindowFp8, &x).unwrap();
    }
    // fp4-global: every E4M3 scale value, ties at E2M1 midpoints times it.
    for c in 1u8..=0x7E {
        let s = e4m3_to_f32(c);
        let mut x = vec![0f32; 512];
        for tile in x.chunks_exact_mut(16) {
            tile[0] = 6.0 * s;
            for (i, v) in tile.iter_mut().enumerate().skip(1) {
                let m = E2M1_MIDS[i % 7] * s;
                *v = if i % 2 == 0 { -m } else { m };
            }
        }
        check_encode(EntryFormat::GlobalFp4, &x).unwrap();
    }
}
