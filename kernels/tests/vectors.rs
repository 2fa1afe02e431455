//! Every available SIMD level reproduces `shared/vectors/codecs` (an independent ml_dtypes
//! implementation) byte for byte when encoding and bit for bit when decoding, and the fused dot
//! products agree with the decoded vectors.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvstack_kernels::*;

#[test]
fn every_level_matches_the_shared_vectors() {
    for level in available_levels() {
        for format in EntryFormat::ALL {
            let name = vector_name(format);
            let input = read_f32(&format!("{name}.input.f32"));
            let encoded = read_u8(&format!("{name}.encoded.u8"));
            let decoded = read_f32(&format!("{name}.decoded.f32"));
            assert_eq!(input.len(), 256 * format.dim());

            let mut out = vec![0u8; encoded.len()];
            quantize_with(level, format, &input, &mut out).unwrap();
            if let Some(d) = first_byte_diff(&out, &encoded, format.entry_bytes()) {
                panic!("{level} {format} quantize: {d}");
            }

            let mut out = vec![0xA5u8; encoded.len()];
            quantize_unchecked_with(level, format, &input, &mut out).unwrap();
            if let Some(d) = first_byte_diff(&out, &encoded, format.entry_bytes()) {
                panic!("{level} {format} quantize_unchecked: {d}");
            }

            let mut y = vec![f32::NAN; decoded.len()];
            dequantize_with(level, format, &encoded, &mut y).unwrap();
            // The vectors hold no NaN, so this is a strict bit comparison.
            assert!(decoded.iter().all(|x| !x.is_nan()));
            if let Some(d) = first_f32_diff(&y, &decoded, format.dim()) {
                panic!("{level} {format} dequantize: {d}");
            }
        }
    }
}

#[test]
fn default_level_entry_points_match_the_shared_vectors() {
    for format in EntryFormat::ALL {
        let name = vector_name(format);
        let input = read_f32(&format!("{name}.input.f32"));
        let encoded = read_u8(&format!("{name}.encoded.u8"));
        let mut out = vec![0u8; encoded.len()];
        quantize(format, &input, &mut out).unwrap();
        assert_eq!(out, encoded, "{format}");
        let mut y = vec![0f32; input.len()];
        dequantize(format, &encoded, &mut y).unwrap();
        assert_eq!(y, read_f32(&format!("{name}.decoded.f32")), "{format}");
    }
}

#[test]
fn dots_on_the_shared_vectors() {
    let fp4 = read_u8("fp4_global.encoded.u8");
    let fp4_dec = read_f32("fp4_global.decoded.f32");
    let fp4_in = read_f32("fp4_global.input.f32");
    let entries = fp4_entries(&fp4);
    let mx = read_u8("mxfp4_index.encoded.u8");
    let mx_dec = read_f32("mxfp4_index.decoded.f32");
    let mx_in = read_f32("mxfp4_index.input.f32");
    let keys = mxfp4_entries(&mx);

    for level in available_levels() {
        // Queries: a few input rows (realistic activations of many magnitudes).
        for qr in [0usize, 17, 101, 243] {
            let q: &[f32; 512] = fp4_in[qr * 512..][..512].try_into().unwrap();
            let mut out = vec![0f32; entries.len()];
            dot_fp4_many_with(level, q, &entries, &mut out).unwrap();
            for (i, &got) in out.iter().enumerate() {
                let (exact, abs) = ref_dot(q, &fp4_dec[i * 512..][..512]);
                assert!(
                    dot_within_bound(got, exact, abs, 512),
                    "{level} fp4 q{qr} e{i}: {got:e} vs {exact:e}"
                );
            }

            let q: &[f32; 128] = mx_in[qr * 128..][..128].try_into().unwrap();
            let mut out = vec![0f32; keys.len()];
            dot_mxfp4_many_with(level, q, &keys, &mut out).unwrap();
            for (i, &got) in out.iter().enumerate() {
                let (exact, abs) = ref_dot(q, &mx_dec[i * 128..][..128]);
                assert!(
                    dot_within_bound(got, exact, abs, 128),
                    "{level} mxfp4 q{qr} k{i}: {got:e} vs {exact:e}"
                );
            }

            // MXFP4 x MXFP4 is exact: the f64 sum of exact products in element order is exact
            // here too (the vectors' scales span far less than 2^38), so equality is required.
            let mut out = vec![0f32; keys.len()];
            dot_mxfp4_mxfp4_many_with(level, &keys[qr], &keys, &mut out).unwrap();
            for (i, &got) in out.iter().enumerate() {
                let (exact, _) = ref_dot(&mx_dec[qr * 128..][..128], &mx_dec[i * 128..][..128]);
                assert_eq!(
                    got.to_bits(),
                    (exact as f32).to_bits(),
                    "{level} q{qr} k{i}"
                );
            }
        }
    }
}
