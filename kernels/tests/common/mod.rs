//! Helpers shared by the integration tests: the scalar reference over many rows, the shared
//! vectors, and the f64 dot references.
#![allow(dead_code)]

use std::path::PathBuf;

use kvstack_firmware_interface::entry::*;
use kvstack_kernels::EntryFormat;
use zerocopy::{FromBytes, IntoBytes};

/// `testdata/vectors/codecs` (the repository's copy of `shared/vectors/codecs`).
pub fn vectors_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/vectors/codecs"
    ))
}

pub fn read_u8(name: &str) -> Vec<u8> {
    let path = vectors_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn read_f32(name: &str) -> Vec<f32> {
    read_u8(name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// File stem of a format in `shared/vectors/codecs`.
pub fn vector_name(format: EntryFormat) -> &'static str {
    match format {
        EntryFormat::WindowFp8 => "fp8_window",
        EntryFormat::GlobalFp4 => "fp4_global",
        EntryFormat::IndexMxfp4 => "mxfp4_index",
    }
}

/// The scalar reference quantizer over row-major `input`.
pub fn ref_quantize(format: EntryFormat, input: &[f32]) -> Vec<u8> {
    let dim = format.dim();
    let mut out = Vec::with_capacity(input.len() / dim * format.entry_bytes());
    for row in input.chunks_exact(dim) {
        match format {
            EntryFormat::WindowFp8 => {
                out.extend_from_slice(quantize_window_fp8(row.try_into().unwrap()).as_bytes())
            }
            EntryFormat::GlobalFp4 => {
                out.extend_from_slice(quantize_global_fp4(row.try_into().unwrap()).as_bytes())
            }
            EntryFormat::IndexMxfp4 => {
                out.extend_from_slice(quantize_index_mxfp4(row.try_into().unwrap()).as_bytes())
            }
        }
    }
    out
}

/// The scalar reference dequantizer over many entries.
pub fn ref_dequantize(format: EntryFormat, bytes: &[u8]) -> Vec<f32> {
    let dim = format.dim();
    let mut out = vec![0f32; bytes.len() / format.entry_bytes() * dim];
    for (e, y) in bytes
        .chunks_exact(format.entry_bytes())
        .zip(out.chunks_exact_mut(dim))
    {
        match format {
            EntryFormat::WindowFp8 => dequantize_window_fp8(
                &WindowFp8Entry::read_from_bytes(e).unwrap(),
                y.try_into().unwrap(),
            ),
            EntryFormat::GlobalFp4 => dequantize_global_fp4(
                &GlobalFp4Entry::read_from_bytes(e).unwrap(),
                y.try_into().unwrap(),
            ),
            EntryFormat::IndexMxfp4 => dequantize_index_mxfp4(
                &IndexMxfp4Entry::read_from_bytes(e).unwrap(),
                y.try_into().unwrap(),
            ),
        }
    }
    out
}

/// Bit-identical, or both NaN (Rust does not pin the bits of a NaN produced by arithmetic,
/// so neither the reference nor a kernel has a defined NaN payload to compare).
pub fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Index and description of the first byte difference, if any.
pub fn first_byte_diff(got: &[u8], want: &[u8], entry_bytes: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} vs {}", got.len(), want.len()));
    }
    got.iter().zip(want).position(|(a, b)| a != b).map(|i| {
        format!(
            "entry {} byte {}: got {:#04x} want {:#04x}",
            i / entry_bytes,
            i % entry_bytes,
            got[i],
            want[i]
        )
    })
}

/// Index and description of the first value that is not [`same_f32`].
pub fn first_f32_diff(got: &[f32], want: &[f32], dim: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} vs {}", got.len(), want.len()));
    }
    got.iter()
        .zip(want)
        .position(|(&a, &b)| !same_f32(a, b))
        .map(|i| {
            format!(
                "row {} col {}: got {:e} ({:#010x}) want {:e} ({:#010x})",
                i / dim,
                i % dim,
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            )
        })
}

/// Dequantized values in f64: the scalar element decoders' values multiplied in f64, so that
/// values beyond f32's range (6 x 2^127) stay finite. Equal to [`ref_dequantize`] wherever that
/// does not overflow.
pub fn ref_values_f64(format: EntryFormat, bytes: &[u8]) -> Vec<f64> {
    use kvstack_firmware_interface::element::{e2m1_to_f32, e4m3_to_f32, ue8m0_to_f32};
    let mut out = Vec::new();
    for e in bytes.chunks_exact(format.entry_bytes()) {
        let nvals = format.entry_bytes() - format.dim() / format.tile();
        let (vals, scales) = e.split_at(nvals);
        for i in 0..format.dim() {
            let sb = scales[i / format.tile()];
            let (v, s) = match format {
                EntryFormat::WindowFp8 => (e4m3_to_f32(vals[i]), ue8m0_to_f32(sb)),
                EntryFormat::GlobalFp4 => {
                    (e2m1_to_f32(vals[i / 2] >> (4 * (i % 2))), e4m3_to_f32(sb))
                }
                EntryFormat::IndexMxfp4 => {
                    (e2m1_to_f32(vals[i / 2] >> (4 * (i % 2))), ue8m0_to_f32(sb))
                }
            };
            out.push(f64::from(v) * f64::from(s));
        }
    }
    out
}

/// `sum(q_i * v_i)` and `sum(|q_i * v_i|)` in f64.
pub fn ref_dot<Q: Copy + Into<f64>, V: Copy + Into<f64>>(q: &[Q], v: &[V]) -> (f64, f64) {
    let mut s = 0f64;
    let mut a = 0f64;
    for (&x, &y) in q.iter().zip(v) {
        let p = x.into() * y.into();
        s += p;
        a += p.abs();
    }
    (s, a)
}

/// The documented bound of the f32 dots: `(n + 8) * 2^-24 * sum|q v|`, plus `n * 2^-149` of
/// slack for products that underflow in f32.
pub fn dot_within_bound(got: f32, exact: f64, abs_sum: f64, n: usize) -> bool {
    if exact.is_nan() {
        return got.is_nan();
    }
    let tol = (n as f64 + 8.0) * 2f64.powi(-24) * abs_sum + n as f64 * 2f64.powi(-149);
    (f64::from(got) - exact).abs() <= tol
}

pub fn fp4_entries(bytes: &[u8]) -> Vec<GlobalFp4Entry> {
    bytes
        .chunks_exact(GlobalFp4Entry::BYTES)
        .map(|c| GlobalFp4Entry::read_from_bytes(c).unwrap())
        .collect()
}

pub fn mxfp4_entries(bytes: &[u8]) -> Vec<IndexMxfp4Entry> {
    bytes
        .chunks_exact(IndexMxfp4Entry::BYTES)
        .map(|c| IndexMxfp4Entry::read_from_bytes(c).unwrap())
        .collect()
}
