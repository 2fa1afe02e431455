//! Quantize and dequantize many rows at once (spec §5), dispatched to a SIMD level.

use kvstack_firmware_interface::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::level::Verified;
use crate::{Error, SimdLevel, portable};

/// Buffer names for error messages, per format.
#[derive(Clone, Copy)]
enum Buf {
    F32In,
    BytesOut,
    BytesIn,
    F32Out,
}

fn what(format: EntryFormat, buf: Buf) -> &'static str {
    use EntryFormat::*;
    match (format, buf) {
        (WindowFp8, Buf::F32In) => "fp8-window input f32 values",
        (WindowFp8, Buf::BytesOut) => "fp8-window output bytes",
        (WindowFp8, Buf::BytesIn) => "fp8-window input bytes",
        (WindowFp8, Buf::F32Out) => "fp8-window output f32 values",
        (GlobalFp4, Buf::F32In) => "fp4-global input f32 values",
        (GlobalFp4, Buf::BytesOut) => "fp4-global output bytes",
        (GlobalFp4, Buf::BytesIn) => "fp4-global input bytes",
        (GlobalFp4, Buf::F32Out) => "fp4-global output f32 values",
        (IndexMxfp4, Buf::F32In) => "mxfp4-index input f32 values",
        (IndexMxfp4, Buf::BytesOut) => "mxfp4-index output bytes",
        (IndexMxfp4, Buf::BytesIn) => "mxfp4-index input bytes",
        (IndexMxfp4, Buf::F32Out) => "mxfp4-index output f32 values",
    }
}

/// Checks that `input` is whole rows and `out` exactly their entries; returns the row count.
fn check_quantize_lengths(format: EntryFormat, input: &[f32], out: &[u8]) -> Result<usize, Error> {
    let dim = format.dim();
    if !input.len().is_multiple_of(dim) {
        return Err(Error::NotAMultiple {
            what: what(format, Buf::F32In),
            multiple: dim,
            actual: input.len(),
        });
    }
    let rows = input.len() / dim;
    let expected = rows * format.entry_bytes();
    if out.len() != expected {
        return Err(Error::LengthMismatch {
            what: what(format, Buf::BytesOut),
            expected,
            actual: out.len(),
        });
    }
    Ok(rows)
}

fn check_dequantize_lengths(format: EntryFormat, input: &[u8], out: &[f32]) -> Result<(), Error> {
    let eb = format.entry_bytes();
    if !input.len().is_multiple_of(eb) {
        return Err(Error::NotAMultiple {
            what: what(format, Buf::BytesIn),
            multiple: eb,
            actual: input.len(),
        });
    }
    let expected = input.len() / eb * format.dim();
    if out.len() != expected {
        return Err(Error::LengthMismatch {
            what: what(format, Buf::F32Out),
            expected,
            actual: out.len(),
        });
    }
    Ok(())
}

/// Views checked bytes as entries (cannot fail after the length checks; entries are `u8`
/// arrays, so there is no alignment requirement).
fn entries<'a, T: FromBytes + KnownLayout + Immutable>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<&'a [T], Error> {
    <[T]>::ref_from_bytes(bytes).map_err(|_| Error::NotAMultiple {
        what,
        multiple: size_of::<T>(),
        actual: bytes.len(),
    })
}

fn entries_mut<'a, T: FromBytes + IntoBytes + KnownLayout>(
    bytes: &'a mut [u8],
    what: &'static str,
) -> Result<&'a mut [T], Error> {
    let len = bytes.len();
    <[T]>::mut_from_bytes(bytes).map_err(|_| Error::NotAMultiple {
        what,
        multiple: size_of::<T>(),
        actual: len,
    })
}

/// Runs the level's quantizer; returns whether all input was finite.
fn run_quantize(
    level: Verified,
    format: EntryFormat,
    input: &[f32],
    out: &mut [u8],
) -> Result<bool, Error> {
    check_quantize_lengths(format, input, out)?;
    let o = what(format, Buf::BytesOut);
    Ok(match format {
        EntryFormat::WindowFp8 => {
            let rows = input.as_chunks::<{ WindowFp8Entry::DIM }>().0;
            let out = entries_mut::<WindowFp8Entry>(out, o)?;
            match level.level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
                SimdLevel::Avx2 => unsafe { crate::x86::avx2::quantize_fp8(rows, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
                SimdLevel::Avx512 => unsafe { crate::x86::avx512::quantize_fp8(rows, out) },
                // Portable, and levels without kernels on this target (never `Verified`).
                _ => portable::quantize_fp8(rows, out),
            }
        }
        EntryFormat::GlobalFp4 => {
            let rows = input.as_chunks::<{ GlobalFp4Entry::DIM }>().0;
            let out = entries_mut::<GlobalFp4Entry>(out, o)?;
            match level.level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
                SimdLevel::Avx2 => unsafe { crate::x86::avx2::quantize_fp4(rows, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
                SimdLevel::Avx512 => unsafe { crate::x86::avx512::quantize_fp4(rows, out) },
                _ => portable::quantize_fp4(rows, out),
            }
        }
        EntryFormat::IndexMxfp4 => {
            let rows = input.as_chunks::<{ IndexMxfp4Entry::DIM }>().0;
            let out = entries_mut::<IndexMxfp4Entry>(out, o)?;
            match level.level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
                SimdLevel::Avx2 => unsafe { crate::x86::avx2::quantize_mxfp4(rows, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
                SimdLevel::Avx512 => unsafe { crate::x86::avx512::quantize_mxfp4(rows, out) },
                _ => portable::quantize_mxfp4(rows, out),
            }
        }
    })
}

/// The first NaN or infinity in row-major `input`, as an error (the scan, not the kernels' flag,
/// is the source of truth, so a flag can never invent an error).
fn check_finite(input: &[f32], dim: usize) -> Result<(), Error> {
    match input.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::NonFinite {
            row: i / dim,
            column: i % dim,
            value: input[i],
        }),
        None => Ok(()),
    }
}

/// Quantizes row-major `input` (`format.dim()` values per row) into `out` (one entry of
/// `format.entry_bytes()` bytes per row, value bytes then scale bytes, as in
/// `shared/vectors/codecs`), with the process-wide [`crate::detected_level`].
///
/// The result is byte-identical to the scalar reference quantizers of
/// `kvstack_firmware_interface::entry` on every level.
///
/// # Errors
///
/// - [`Error::NotAMultiple`] if `input.len()` is not a multiple of `format.dim()`,
///   [`Error::LengthMismatch`] if `out.len()` is not `rows * format.entry_bytes()`; `out` is
///   untouched.
/// - [`Error::NonFinite`] naming the first NaN or infinity (row-major). Finiteness is checked
///   in the same pass that encodes, so on this error **`out` has been fully written** (with
///   what [`quantize_unchecked`] produces) and must be discarded.
pub fn quantize(format: EntryFormat, input: &[f32], out: &mut [u8]) -> Result<(), Error> {
    quantize_at(Verified::detected(), format, input, out)
}

/// [`quantize`] on a given level.
///
/// # Errors
///
/// As [`quantize`], plus [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
pub fn quantize_with(
    level: SimdLevel,
    format: EntryFormat,
    input: &[f32],
    out: &mut [u8],
) -> Result<(), Error> {
    quantize_at(Verified::new(level)?, format, input, out)
}

pub(crate) fn quantize_at(
    level: Verified,
    format: EntryFormat,
    input: &[f32],
    out: &mut [u8],
) -> Result<(), Error> {
    if run_quantize(level, format, input, out)? {
        Ok(())
    } else {
        check_finite(input, format.dim())
    }
}

/// [`quantize`] without the finiteness check (lengths are still checked).
///
/// Non-finite input is memory-safe, never panics, and only changes the tile (scale group) that
/// contains it; the bytes are deterministic and identical on every level and to the scalar
/// reference quantizers:
///
/// - NaN is skipped when the tile's absolute maximum is taken, so the other values of its tile
///   encode as if it were absent. The NaN itself encodes as the E4M3 NaN code 0x7F (0xFF if its
///   sign bit is set) in fp8-window, and as E2M1 +0 (code 0) in fp4-global and mxfp4-index.
/// - +-Inf makes the tile maximum infinite, which saturates the tile's scale: UE8M0 byte 254
///   (2^127) in fp8-window and mxfp4-index, E4M3 448 (0x7E) in fp4-global. The infinity encodes
///   as the largest magnitude with its sign (E4M3 +-448, E2M1 +-6); the tile's finite values are
///   encoded against that saturated scale as usual (so most become signed zero).
///
/// # Errors
///
/// The length errors of [`quantize`].
pub fn quantize_unchecked(format: EntryFormat, input: &[f32], out: &mut [u8]) -> Result<(), Error> {
    run_quantize(Verified::detected(), format, input, out).map(|_| ())
}

/// [`quantize_unchecked`] on a given level.
///
/// # Errors
///
/// As [`quantize_unchecked`], plus [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
pub fn quantize_unchecked_with(
    level: SimdLevel,
    format: EntryFormat,
    input: &[f32],
    out: &mut [u8],
) -> Result<(), Error> {
    run_quantize(Verified::new(level)?, format, input, out).map(|_| ())
}

/// Dequantizes entries (`format.entry_bytes()` bytes each) into row-major f32 values
/// (`format.dim()` per entry), with the process-wide [`crate::detected_level`].
///
/// Every byte value is accepted and the output is bit-identical to the scalar reference
/// dequantizers (`element::e4m3_to_f32`, `e2m1_to_f32`, `ue8m0_to_f32` times each other) on every
/// level: E2M1 code 0x8 is -0; E4M3 0x7F/0xFF and UE8M0 255 are NaN (the NaN's sign and payload
/// are what x86 multiplication gives; Rust does not pin NaN bits, so tests compare NaN-ness);
/// UE8M0 0 is 2^-127.
///
/// # Errors
///
/// [`Error::NotAMultiple`] if `input.len()` is not a multiple of `format.entry_bytes()`,
/// [`Error::LengthMismatch`] if `out.len()` is not `entries * format.dim()`; `out` is untouched.
pub fn dequantize(format: EntryFormat, input: &[u8], out: &mut [f32]) -> Result<(), Error> {
    dequantize_at(Verified::detected(), format, input, out)
}

/// [`dequantize`] on a given level.
///
/// # Errors
///
/// As [`dequantize`], plus [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
pub fn dequantize_with(
    level: SimdLevel,
    format: EntryFormat,
    input: &[u8],
    out: &mut [f32],
) -> Result<(), Error> {
    dequantize_at(Verified::new(level)?, format, input, out)
}

pub(crate) fn dequantize_at(
    level: Verified,
    format: EntryFormat,
    input: &[u8],
    out: &mut [f32],
) -> Result<(), Error> {
    check_dequantize_lengths(format, input, out)?;
    let i = what(format, Buf::BytesIn);
    match format {
        EntryFormat::WindowFp8 => {
            let e = entries::<WindowFp8Entry>(input, i)?;
            let out = out.as_chunks_mut::<{ WindowFp8Entry::DIM }>().0;
            match level.level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
                SimdLevel::Avx2 => unsafe { crate::x86::avx2::dequantize_fp8(e, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
                SimdLevel::Avx512 => unsafe { crate::x86::avx512::dequantize_fp8(e, out) },
                _ => portable::dequantize_fp8(e, out),
            }
        }
        EntryFormat::GlobalFp4 => {
            let e = entries::<GlobalFp4Entry>(input, i)?;
            let out = out.as_chunks_mut::<{ GlobalFp4Entry::DIM }>().0;
            match level.level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
                SimdLevel::Avx2 => unsafe { crate::x86::avx2::dequantize_fp4(e, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
                SimdLevel::Avx512 => unsafe { crate::x86::avx512::dequantize_fp4(e, out) },
                _ => portable::dequantize_fp4(e, out),
            }
        }
        EntryFormat::IndexMxfp4 => {
            let e = entries::<IndexMxfp4Entry>(input, i)?;
            let out = out.as_chunks_mut::<{ IndexMxfp4Entry::DIM }>().0;
            match level.level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
                SimdLevel::Avx2 => unsafe { crate::x86::avx2::dequantize_mxfp4(e, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
                SimdLevel::Avx512 => unsafe { crate::x86::avx512::dequantize_mxfp4(e, out) },
                _ => portable::dequantize_mxfp4(e, out),
            }
        }
    }
    Ok(())
}
