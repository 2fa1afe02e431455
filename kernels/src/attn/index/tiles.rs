//! What the x86 indexer kernels share: the tile of sixteen keys of the VNNI kernels, the
//! cache lines of a tile the AVX2 scan loop lists for the fused kernel to prefetch, and the
//! table that decodes keys for both widths.

use kvstack_firmware_interface::element::E2M1_TIMES_TWO_I8;

use crate::attn::INDEX_HEADS;

/// `2 * e2m1(code) + 12` (0..=24, as unsigned bytes) by 4-bit code, once per 128-bit lane of
/// a 256-bit vector: keys become the unsigned operand of `vpmaddubsw` (`vpdpbusd`); the `+ 12`
/// is removed with [`super::Prepared::offsq`] (`koff`).
const fn key_lut() -> [[u8; 16]; 2] {
    let mut t = [[0u8; 16]; 2];
    let mut i = 0;
    while i < 32 {
        t[i / 16][i % 16] = (E2M1_TIMES_TWO_I8[i % 16] + 12) as u8;
        i += 1;
    }
    t
}
pub(crate) static KEY_LUT: [[u8; 16]; 2] = key_lut();

/// Keys per tile of [`super::avx512::index_tile16`]: one per 32-bit lane.
pub(crate) const KEY_LANES: usize = 16;

/// Cache lines a tile's keys can span: two per key, as a 68-byte key at a 4-byte-aligned
/// offset spans two 64-byte lines.
pub(crate) const TILE_LINES: usize = 2 * KEY_LANES;

/// The fused kernel's prefetch points: after each half of the key groups of each pass of 16
/// heads.
pub(crate) const PREFETCH_POINTS: usize = 2 * (INDEX_HEADS / 16);

/// Lines prefetched at each of the fused kernel's prefetch points: a tile of two pool blocks
/// (8 consecutive keys, 9 or 10 lines each) fits in the first [`SPREAD_LINES`] of a
/// [`TileLines`] list.
pub(crate) const LINES_PER_POINT: usize = 5;

/// How many lines of a [`TileLines`] list [`super::avx512::index_tile16_fused`] prefetches.
pub(crate) const SPREAD_LINES: usize = PREFETCH_POINTS * LINES_PER_POINT;

/// Addresses of cache lines to prefetch (any address: a prefetch never faults); the fused
/// kernel takes the first [`SPREAD_LINES`].
pub(crate) type TileLines = [*const i8; TILE_LINES];
