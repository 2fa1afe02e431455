//! The scalar reference quantizers reproduce `shared/vectors/codecs` byte for byte (encode) and
//! bit for bit (decode). The vectors come from an independent implementation (ml_dtypes).

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kvstack_firmware_interface::entry::*;
use zerocopy::{FromBytes, IntoBytes};

fn vectors_dir() -> PathBuf {
    // `testdata/` at the repository root (the workspace root is this crate's parent).
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/vectors/codecs")
}

fn read_f32(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(vectors_dir().join(name))
        .map_err(|e| format!("{name}: {e}"))
        .unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_u8(name: &str) -> Vec<u8> {
    std::fs::read(vectors_dir().join(name))
        .map_err(|e| format!("{name}: {e}"))
        .unwrap()
}

macro_rules! check_format {
    ($name:literal, $entry:ty, $quant:ident, $dequant:ident) => {{
        let input = read_f32(concat!($name, ".input.f32"));
        let encoded = read_u8(concat!($name, ".encoded.u8"));
        let decoded = read_f32(concat!($name, ".decoded.f32"));
        let dim = <$entry>::DIM;
        let rows = input.len() / dim;
        assert_eq!(rows, 256);
        assert_eq!(encoded.len(), rows * <$entry>::BYTES);
        let mut bad_bytes = 0usize;
        let mut bad_values = 0usize;
        for r in 0..rows {
            let x: &[f32; <$entry>::DIM] = input[r * dim..(r + 1) * dim].try_into().unwrap();
            let e = $quant(x);
            let want = &encoded[r * <$entry>::BYTES..(r + 1) * <$entry>::BYTES];
            for (c, (a, b)) in e.as_bytes().iter().zip(want).enumerate() {
                if a != b {
                    if bad_bytes < 10 {
                        eprintln!("{} row {r} byte {c}: got {a:#04x} want {b:#04x}", $name);
                    }
                    bad_bytes += 1;
                }
            }
            let stored = <$entry>::read_from_bytes(want).unwrap();
            let mut y = [0f32; <$entry>::DIM];
            $dequant(&stored, &mut y);
            for (c, (a, b)) in y.iter().zip(&decoded[r * dim..(r + 1) * dim]).enumerate() {
                if a.to_bits() != b.to_bits() {
                    if bad_values < 10 {
                        eprintln!("{} row {r} col {c}: got {a:e} want {b:e}", $name);
                    }
                    bad_values += 1;
                }
            }
        }
        assert_eq!((bad_bytes, bad_values), (0, 0), "{} mismatches", $name);
    }};
}

#[test]
fn fp8_window_matches_vectors() {
    check_format!(
        "fp8_window",
        WindowFp8Entry,
        quantize_window_fp8,
        dequantize_window_fp8
    );
}

#[test]
fn fp4_global_matches_vectors() {
    check_format!(
        "fp4_global",
        GlobalFp4Entry,
        quantize_global_fp4,
        dequantize_global_fp4
    );
}

#[test]
fn mxfp4_index_matches_vectors() {
    check_format!(
        "mxfp4_index",
        IndexMxfp4Entry,
        quantize_index_mxfp4,
        dequantize_index_mxfp4
    );
}
