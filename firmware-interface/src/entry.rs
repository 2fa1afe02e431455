//! The three KV entry formats of spec §5 as byte-exact types, and their scalar reference
//! quantizers.
//!
//! Layout of every entry: the value bytes, then the scale bytes (as in `shared/vectors/codecs`).
//! Packed E2M1 bytes hold the EVEN element in the low nibble.

use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::element::{
    E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32,
    pow2ceil_exponent, ue8m0_to_f32,
};

/// Sliding-window KV entry (spec §5.1): 512 E4M3 values in 16 tiles of 32, one UE8M0 scale per
/// tile. 528 bytes.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned,
)]
#[repr(C)]
pub struct WindowFp8Entry {
    /// E4M3 "fn" codes, element order.
    pub values: [u8; WindowFp8Entry::DIM],
    /// UE8M0 scale bytes, one per 32-element tile.
    pub scales: [u8; WindowFp8Entry::TILES],
}

/// Compressed (global) KV entry (spec §5.2): 512 E2M1 values in 32 tiles of 16, one E4M3
/// scale per tile. 288 bytes.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned,
)]
#[repr(C)]
pub struct GlobalFp4Entry {
    /// Packed E2M1 codes, element `2i` in the low nibble of byte `i`.
    pub values: [u8; GlobalFp4Entry::DIM / 2],
    /// E4M3 "fn" scale bytes, one per 16-element tile.
    pub scales: [u8; GlobalFp4Entry::TILES],
}

/// Indexer key entry (spec §5.3): 128 E2M1 values in 4 blocks of 32 with UE8M0 scales (MXFP4).
/// 68 bytes. Indexer queries use the same layout at compute time.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned,
)]
#[repr(C)]
pub struct IndexMxfp4Entry {
    /// Packed E2M1 codes, element `2i` in the low nibble of byte `i`.
    pub values: [u8; IndexMxfp4Entry::DIM / 2],
    /// UE8M0 scale bytes, one per 32-element block.
    pub scales: [u8; IndexMxfp4Entry::TILES],
}

impl WindowFp8Entry {
    /// Elements per entry.
    pub const DIM: usize = 512;
    /// Elements per scale tile.
    pub const TILE: usize = 32;
    /// Scale tiles per entry.
    pub const TILES: usize = Self::DIM / Self::TILE;
    /// Bytes per entry.
    pub const BYTES: usize = 528;
}

impl GlobalFp4Entry {
    /// Elements per entry.
    pub const DIM: usize = 512;
    /// Elements per scale tile.
    pub const TILE: usize = 16;
    /// Scale tiles per entry.
    pub const TILES: usize = Self::DIM / Self::TILE;
    /// Bytes per entry.
    pub const BYTES: usize = 288;
}

impl IndexMxfp4Entry {
    /// Elements per entry.
    pub const DIM: usize = 128;
    /// Elements per scale block.
    pub const TILE: usize = 32;
    /// Scale blocks per entry.
    pub const TILES: usize = Self::DIM / Self::TILE;
    /// Bytes per entry.
    pub const BYTES: usize = 68;
}

// Compile-time layout checks: the derives already refuse padding; these pin the sizes the spec
// and the on-disk formats depend on.
const _: () = assert!(size_of::<WindowFp8Entry>() == WindowFp8Entry::BYTES);
const _: () = assert!(size_of::<GlobalFp4Entry>() == GlobalFp4Entry::BYTES);
const _: () = assert!(size_of::<IndexMxfp4Entry>() == IndexMxfp4Entry::BYTES);
const _: () = assert!(WindowFp8Entry::DIM.is_multiple_of(WindowFp8Entry::TILE));
const _: () = assert!(GlobalFp4Entry::DIM.is_multiple_of(GlobalFp4Entry::TILE));
const _: () = assert!(IndexMxfp4Entry::DIM.is_multiple_of(IndexMxfp4Entry::TILE));

/// `f32(1/448)`, the rounded reciprocal spec §5.1 multiplies by.
pub const INV_448: f32 = 1.0 / 448.0;
/// `f32(1/6)`, the rounded reciprocal spec §5.3 multiplies by.
pub const INV_6: f32 = 1.0 / 6.0;

/// Largest absolute value of a tile. NaN elements are skipped (`f32::max` semantics); checked
/// callers reject non-finite input before this point.
#[inline]
pub fn amax(tile: &[f32]) -> f32 {
    tile.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// UE8M0 scale byte of an FP8 window tile with absolute maximum `amax` (spec §5.1):
/// `pow2ceil(max(amax, 1e-4) * f32(1/448))`.
#[inline]
pub fn fp8_window_scale(amax: f32) -> u8 {
    pow2ceil_exponent(amax.max(1e-4) * INV_448)
}

/// E4M3 scale byte of an FP4 global tile with absolute maximum `amax` (spec §5.2):
/// `E4M3(clamp(amax / 6, 2^-9, 448))`.
#[inline]
pub fn fp4_global_scale(amax: f32) -> u8 {
    e4m3_from_f32((amax / 6.0).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
}

/// UE8M0 scale byte of an MXFP4 block with absolute maximum `amax` (spec §5.3):
/// `pow2ceil(max(amax, 6 * 2^-126) * f32(1/6))`.
#[inline]
pub fn mxfp4_scale(amax: f32) -> u8 {
    const FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;
    pow2ceil_exponent(amax.max(FLOOR) * INV_6)
}

/// Packs two E2M1 codes into one byte, the even element in the low nibble.
#[inline]
pub fn pack_e2m1(even: u8, odd: u8) -> u8 {
    (even & 0x0F) | (odd << 4)
}

// The tile loops below work on any row width that is a whole number of tiles; the fixed-size
// entry functions and the width-generic row functions of [`crate::rows`] share them. Zipped
// chunk iterators keep them free of index arithmetic (and of panics).

pub(crate) fn fp8_quantize_tiles(x: &[f32], values: &mut [u8], scales: &mut [u8]) {
    let tiles = x
        .chunks_exact(WindowFp8Entry::TILE)
        .zip(values.chunks_exact_mut(WindowFp8Entry::TILE));
    for ((tile, out), scale) in tiles.zip(scales.iter_mut()) {
        let sb = fp8_window_scale(amax(tile));
        *scale = sb;
        let s = ue8m0_to_f32(sb);
        for (o, &v) in out.iter_mut().zip(tile) {
            *o = e4m3_from_f32((v / s).clamp(-E4M3_MAX, E4M3_MAX));
        }
    }
}

pub(crate) fn fp8_dequantize_tiles(values: &[u8], scales: &[u8], out: &mut [f32]) {
    let tiles = out
        .chunks_exact_mut(WindowFp8Entry::TILE)
        .zip(values.chunks_exact(WindowFp8Entry::TILE));
    for ((tile, codes), &sb) in tiles.zip(scales) {
        let s = ue8m0_to_f32(sb);
        for (o, &c) in tile.iter_mut().zip(codes) {
            *o = e4m3_to_f32(c) * s;
        }
    }
}

pub(crate) fn fp4_quantize_tiles(x: &[f32], values: &mut [u8], scales: &mut [u8]) {
    const T: usize = GlobalFp4Entry::TILE;
    for ((tile, out), scale) in x
        .chunks_exact(T)
        .zip(values.chunks_exact_mut(T / 2))
        .zip(scales.iter_mut())
    {
        let sb = fp4_global_scale(amax(tile));
        *scale = sb;
        let s = e4m3_to_f32(sb);
        for (o, pair) in out.iter_mut().zip(tile.chunks_exact(2)) {
            // IEEE division, not a multiply by a rounded reciprocal: the reciprocal misplaces
            // exact E2M1 ties (spec §5.2).
            let lo = e2m1_from_f32((pair[0] / s).clamp(-E2M1_MAX, E2M1_MAX));
            let hi = e2m1_from_f32((pair[1] / s).clamp(-E2M1_MAX, E2M1_MAX));
            *o = pack_e2m1(lo, hi);
        }
    }
}

pub(crate) fn mxfp4_quantize_tiles(x: &[f32], values: &mut [u8], scales: &mut [u8]) {
    const T: usize = IndexMxfp4Entry::TILE;
    for ((tile, out), scale) in x
        .chunks_exact(T)
        .zip(values.chunks_exact_mut(T / 2))
        .zip(scales.iter_mut())
    {
        let sb = mxfp4_scale(amax(tile));
        *scale = sb;
        // The scale is a power of two well inside f32's normal range, so dividing by it and
        // multiplying by its exact reciprocal give identical results.
        let s = ue8m0_to_f32(sb);
        for (o, pair) in out.iter_mut().zip(tile.chunks_exact(2)) {
            *o = pack_e2m1(e2m1_from_f32(pair[0] / s), e2m1_from_f32(pair[1] / s));
        }
    }
}

/// Decodes packed E2M1 tiles of `tile` elements, each tile scaled by `scale(byte)`.
pub(crate) fn e2m1_dequantize_tiles(
    values: &[u8],
    scales: &[u8],
    tile: usize,
    scale: fn(u8) -> f32,
    out: &mut [f32],
) {
    for ((t, packed), &sb) in out
        .chunks_exact_mut(tile)
        .zip(values.chunks_exact(tile / 2))
        .zip(scales)
    {
        let s = scale(sb);
        for (pair, &b) in t.chunks_exact_mut(2).zip(packed) {
            pair[0] = e2m1_to_f32(b & 0x0F) * s;
            pair[1] = e2m1_to_f32(b >> 4) * s;
        }
    }
}

/// Quantizes one 512-wide row into a window FP8 entry (scalar reference, spec §5.1).
pub fn quantize_window_fp8(x: &[f32; WindowFp8Entry::DIM]) -> WindowFp8Entry {
    let mut e = WindowFp8Entry::new_zeroed();
    fp8_quantize_tiles(x, &mut e.values, &mut e.scales);
    e
}

/// Dequantizes a window FP8 entry (scalar reference).
pub fn dequantize_window_fp8(e: &WindowFp8Entry, out: &mut [f32; WindowFp8Entry::DIM]) {
    fp8_dequantize_tiles(&e.values, &e.scales, out);
}

/// Quantizes one 512-wide row into a global FP4 entry (scalar reference, spec §5.2).
pub fn quantize_global_fp4(x: &[f32; GlobalFp4Entry::DIM]) -> GlobalFp4Entry {
    let mut e = GlobalFp4Entry::new_zeroed();
    fp4_quantize_tiles(x, &mut e.values, &mut e.scales);
    e
}

/// Dequantizes a global FP4 entry (scalar reference).
pub fn dequantize_global_fp4(e: &GlobalFp4Entry, out: &mut [f32; GlobalFp4Entry::DIM]) {
    e2m1_dequantize_tiles(&e.values, &e.scales, GlobalFp4Entry::TILE, e4m3_to_f32, out);
}

/// Quantizes one 128-wide row into an MXFP4 index entry (scalar reference, spec §5.3).
pub fn quantize_index_mxfp4(x: &[f32; IndexMxfp4Entry::DIM]) -> IndexMxfp4Entry {
    let mut e = IndexMxfp4Entry::new_zeroed();
    mxfp4_quantize_tiles(x, &mut e.values, &mut e.scales);
    e
}

/// Dequantizes an MXFP4 index entry (scalar reference).
pub fn dequantize_index_mxfp4(e: &IndexMxfp4Entry, out: &mut [f32; IndexMxfp4Entry::DIM]) {
    e2m1_dequantize_tiles(
        &e.values,
        &e.scales,
        IndexMxfp4Entry::TILE,
        ue8m0_to_f32,
        out,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_scale_examples() {
        // amax 448 -> 448 * f32(1/448) rounds to exactly 1.0 -> scale 2^0.
        assert_eq!(fp8_window_scale(448.0), 127);
        // Tiny tiles use the 1e-4 floor.
        assert_eq!(fp8_window_scale(0.0), fp8_window_scale(1e-4));
    }

    #[test]
    fn fp4_scale_examples() {
        assert_eq!(e4m3_to_f32(fp4_global_scale(6.0)), 1.0);
        assert_eq!(e4m3_to_f32(fp4_global_scale(0.0)), E4M3_MIN_SUBNORMAL);
        assert_eq!(e4m3_to_f32(fp4_global_scale(1e30)), 448.0);
    }

    #[test]
    fn window_roundtrip_error_is_bounded() {
        let mut x = [0f32; 512];
        for (i, v) in x.iter_mut().enumerate() {
            *v = ((i as f32) * 0.37).sin() * 10.0;
        }
        let e = quantize_window_fp8(&x);
        let mut y = [0f32; 512];
        dequantize_window_fp8(&e, &mut y);
        for (a, b) in x.iter().zip(&y) {
            // E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normal codes.
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-3, "{a} vs {b}");
        }
    }
}
