//! The KV entry codecs on arbitrary bytes: `kvstack_kernels::dequantize_with` on every SIMD
//! level this CPU has must agree bit for bit with the scalar reference decoders of
//! `kvstack_firmware_interface::entry` (and with `rows::RowLayout` at the entry width), NaN
//! compared as NaN-ness, as in kernels/tests (Rust does not pin the bits of a NaN that
//! arithmetic produces). The same bytes read as f32 rows go through the quantizers: every
//! level byte-identical to the reference quantizers, NaN and infinities included, and the
//! checked form fails exactly when a value is not finite.
//!
//! Byte 0: the format (modulo 3); the rest: entries (whole ones, at most 32).
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::entry::{
    dequantize_global_fp4, dequantize_index_mxfp4, dequantize_window_fp8, quantize_global_fp4,
    quantize_index_mxfp4, quantize_window_fp8,
};
use kvstack_firmware_interface::rows::RowLayout;
use kvstack_kernels::{
    EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry, available_levels,
    dequantize_with, quantize_unchecked_with, quantize_with,
};
use libfuzzer_sys::fuzz_target;
use zerocopy::{FromBytes, IntoBytes};

/// Bit-identical, or both NaN (kernels/tests/common `same_f32`).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn ref_decode(format: EntryFormat, e: &[u8], y: &mut [f32]) {
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

fn ref_encode(format: EntryFormat, x: &[f32], out: &mut Vec<u8>) {
    match format {
        EntryFormat::WindowFp8 => {
            out.extend_from_slice(quantize_window_fp8(x.try_into().unwrap()).as_bytes())
        }
        EntryFormat::GlobalFp4 => {
            out.extend_from_slice(quantize_global_fp4(x.try_into().unwrap()).as_bytes())
        }
        EntryFormat::IndexMxfp4 => {
            out.extend_from_slice(quantize_index_mxfp4(x.try_into().unwrap()).as_bytes())
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let format = EntryFormat::ALL[usize::from(mode) % 3];
    let (eb, dim) = (format.entry_bytes(), format.dim());
    let levels = available_levels();

    // Decode.
    let n = (rest.len() / eb).min(32);
    let bytes = &rest[..n * eb];
    let mut want = vec![0f32; n * dim];
    let layout = RowLayout::new(format, dim).unwrap();
    let mut row = vec![0f32; dim];
    for (e, y) in bytes.chunks_exact(eb).zip(want.chunks_exact_mut(dim)) {
        ref_decode(format, e, y);
        layout.dequantize(e, &mut row).unwrap();
        for (j, (a, b)) in row.iter().zip(y.iter()).enumerate() {
            assert!(
                same(*a, *b),
                "{format} RowLayout differs at {j}: {a:e} vs {b:e}"
            );
        }
    }
    for &level in &levels {
        let mut got = vec![0f32; n * dim];
        dequantize_with(level, format, bytes, &mut got).unwrap();
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                same(*a, *b),
                "{level} {format} decode differs at entry {} col {}: {a:e} ({:#010x}) vs {b:e} ({:#010x})",
                j / dim,
                j % dim,
                a.to_bits(),
                b.to_bits()
            );
        }
        // Lengths that do not fit are refused, never read past.
        if !rest.is_empty() && rest.len() % eb != 0 {
            let mut y = vec![0f32; rest.len() / eb * dim];
            assert!(dequantize_with(level, format, rest, &mut y).is_err());
        }
        if n > 0 {
            let mut short = vec![0f32; n * dim - 1];
            assert!(dequantize_with(level, format, bytes, &mut short).is_err());
        }
    }

    // Encode: the bytes as f32 rows.
    let rows = (rest.len() / 4 / dim).min(8);
    let x: Vec<f32> = rest
        .as_chunks::<4>()
        .0
        .iter()
        .take(rows * dim)
        .map(|b| f32::from_le_bytes(*b))
        .collect();
    let mut want = Vec::with_capacity(rows * eb);
    for r in x.chunks_exact(dim) {
        ref_encode(format, r, &mut want);
    }
    let finite = x.iter().all(|v| v.is_finite());
    for &level in &levels {
        let mut got = vec![0u8; rows * eb];
        quantize_unchecked_with(level, format, &x, &mut got).unwrap();
        assert!(
            got == want,
            "{level} {format} encode differs from the reference"
        );
        let mut checked = vec![0u8; rows * eb];
        assert_eq!(
            quantize_with(level, format, &x, &mut checked).is_ok(),
            finite
        );
        if finite {
            assert!(checked == want);
        }
    }
});
