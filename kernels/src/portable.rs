//! The portable level: plain Rust over fixed-size tiles, written so that LLVM vectorizes the
//! per-element loops for whatever baseline the build targets (SSE2 on x86-64, NEON on
//! aarch64). Results are bit-identical to the scalar reference (spec §5).

use kvstack_firmware_interface::element::{E2M1_TIMES_TWO_I8, E2M1_TO_F32, ue8m0_to_f32};
use kvstack_firmware_interface::entry::{fp4_global_scale, fp8_window_scale, mxfp4_scale};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};

use crate::scalar::{
    INF_BITS, combine_mxfp4_blocks, e2m1_encode, e4m3_decode, e4m3_encode, tile_amax,
};

/// Both E2M1 values of every packed byte (even element first): one 8-byte load decodes two
/// elements, which beats nibble arithmetic on baselines without byte shuffles (x86-64 SSE2).
static E2M1_PAIRS: [[f32; 2]; 256] = e2m1_pairs();

const fn e2m1_pairs() -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [E2M1_TO_F32[b & 0x0F], E2M1_TO_F32[b >> 4]];
        b += 1;
    }
    t
}

/// Both `2 * e2m1` values of every packed byte, as exact small integers.
static E2M1_X2_PAIRS: [[i8; 2]; 256] = e2m1_x2_pairs();

const fn e2m1_x2_pairs() -> [[i8; 2]; 256] {
    let mut t = [[0i8; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [E2M1_TIMES_TWO_I8[b & 0x0F], E2M1_TIMES_TWO_I8[b >> 4]];
        b += 1;
    }
    t
}

/// Spec §5.1. Returns whether every input value was finite.
pub(crate) fn quantize_fp8(rows: &[[f32; 512]], out: &mut [WindowFp8Entry]) -> bool {
    let mut raw = 0u32;
    for (x, e) in rows.iter().zip(out) {
        let tiles = x.as_chunks::<32>().0;
        let vals = e.values.as_chunks_mut::<32>().0;
        for ((tile, v), sb) in tiles.iter().zip(vals).zip(e.scales.iter_mut()) {
            let (amax, r) = tile_amax(tile);
            raw = raw.max(r);
            *sb = fp8_window_scale(amax);
            // The scale is a power of two in 2^-126..=2^127, so its reciprocal is exact and
            // multiplying by it equals the reference's division.
            let inv = 1.0 / ue8m0_to_f32(*sb);
            for (c, &xi) in v.iter_mut().zip(tile) {
                // The reference clamps to +-448 first; the encoder saturates identically.
                *c = e4m3_encode(xi * inv);
            }
        }
    }
    raw < INF_BITS
}

/// Spec §5.2. Returns whether every input value was finite.
pub(crate) fn quantize_fp4(rows: &[[f32; 512]], out: &mut [GlobalFp4Entry]) -> bool {
    let mut raw = 0u32;
    for (x, e) in rows.iter().zip(out) {
        let tiles = x.as_chunks::<16>().0;
        let vals = e.values.as_chunks_mut::<8>().0;
        for ((tile, v), sb) in tiles.iter().zip(vals).zip(e.scales.iter_mut()) {
            let (amax, r) = tile_amax(tile);
            raw = raw.max(r);
            *sb = fp4_global_scale(amax);
            let s = e4m3_decode(*sb);
            let mut codes = [0u8; 16];
            for (c, &xi) in codes.iter_mut().zip(tile) {
                // IEEE division: a rounded reciprocal misplaces exact E2M1 ties (spec §5.2).
                *c = e2m1_encode(xi / s);
            }
            for (b, pair) in v.iter_mut().zip(codes.as_chunks::<2>().0) {
                *b = pair[0] | (pair[1] << 4);
            }
        }
    }
    raw < INF_BITS
}

/// Spec §5.3. Returns whether every input value was finite.
pub(crate) fn quantize_mxfp4(rows: &[[f32; 128]], out: &mut [IndexMxfp4Entry]) -> bool {
    let mut raw = 0u32;
    for (x, e) in rows.iter().zip(out) {
        let tiles = x.as_chunks::<32>().0;
        let vals = e.values.as_chunks_mut::<16>().0;
        for ((tile, v), sb) in tiles.iter().zip(vals).zip(e.scales.iter_mut()) {
            let (amax, r) = tile_amax(tile);
            raw = raw.max(r);
            *sb = mxfp4_scale(amax);
            // Power-of-two scale: multiplying by the exact reciprocal is the reference division.
            let inv = 1.0 / ue8m0_to_f32(*sb);
            let mut codes = [0u8; 32];
            for (c, &xi) in codes.iter_mut().zip(tile) {
                *c = e2m1_encode(xi * inv);
            }
            for (b, pair) in v.iter_mut().zip(codes.as_chunks::<2>().0) {
                *b = pair[0] | (pair[1] << 4);
            }
        }
    }
    raw < INF_BITS
}

pub(crate) fn dequantize_fp8(entries: &[WindowFp8Entry], out: &mut [[f32; 512]]) {
    for (e, y) in entries.iter().zip(out) {
        let vals = e.values.as_chunks::<32>().0;
        for ((v, &sb), ys) in vals.iter().zip(&e.scales).zip(y.as_chunks_mut::<32>().0) {
            let s = ue8m0_to_f32(sb);
            for (o, &c) in ys.iter_mut().zip(v) {
                *o = e4m3_decode(c) * s;
            }
        }
    }
}

/// Decodes 8 packed bytes (16 E2M1 codes, even element in the low nibble) times `s`.
#[inline(always)]
fn e2m1_tile16(v: &[u8; 8], s: f32) -> [f32; 16] {
    let mut y = [0f32; 16];
    for (pair, &b) in y.as_chunks_mut::<2>().0.iter_mut().zip(v) {
        let [a, c] = E2M1_PAIRS[usize::from(b)];
        *pair = [a * s, c * s];
    }
    y
}

/// Decodes 16 packed bytes (one 32-element MXFP4 block) times `s`.
#[inline(always)]
fn e2m1_tile32(v: &[u8; 16], s: f32) -> [f32; 32] {
    let mut y = [0f32; 32];
    for (pair, &b) in y.as_chunks_mut::<2>().0.iter_mut().zip(v) {
        let [a, c] = E2M1_PAIRS[usize::from(b)];
        *pair = [a * s, c * s];
    }
    y
}

pub(crate) fn dequantize_fp4(entries: &[GlobalFp4Entry], out: &mut [[f32; 512]]) {
    for (e, y) in entries.iter().zip(out) {
        let vals = e.values.as_chunks::<8>().0;
        for ((v, &sb), ys) in vals.iter().zip(&e.scales).zip(y.as_chunks_mut::<16>().0) {
            *ys = e2m1_tile16(v, e4m3_decode(sb));
        }
    }
}

pub(crate) fn dequantize_mxfp4(entries: &[IndexMxfp4Entry], out: &mut [[f32; 128]]) {
    for (e, y) in entries.iter().zip(out) {
        let vals = e.values.as_chunks::<16>().0;
        for ((v, &sb), ys) in vals.iter().zip(&e.scales).zip(y.as_chunks_mut::<32>().0) {
            *ys = e2m1_tile32(v, ue8m0_to_f32(sb));
        }
    }
}

/// Sums 16 lanes as `sum8(lanes 0..8) + sum8(lanes 8..16)`, each a balanced tree.
#[inline(always)]
fn tree_sum16(a: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for (i, x) in h.iter_mut().enumerate() {
        *x = a[i] + a[i + 8];
    }
    let q = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// Spec §5.2 entries against an f32 query: 16 lane accumulators of `q_i * v_i` (v_i the exact
/// dequantized value), then a tree sum.
pub(crate) fn dot_fp4(q: &[f32; 512], entries: &[GlobalFp4Entry], out: &mut [f32]) {
    let qt = q.as_chunks::<16>().0;
    for (e, o) in entries.iter().zip(out) {
        let mut acc = [0f32; 16];
        let vals = e.values.as_chunks::<8>().0;
        for ((v, &sb), qs) in vals.iter().zip(&e.scales).zip(qt) {
            let y = e2m1_tile16(v, e4m3_decode(sb));
            for ((a, &qi), &yi) in acc.iter_mut().zip(qs).zip(&y) {
                *a += qi * yi;
            }
        }
        *o = tree_sum16(&acc);
    }
}

/// Spec §5.3 entries against an f32 query, summed like [`dot_fp4`].
pub(crate) fn dot_mxfp4(q: &[f32; 128], entries: &[IndexMxfp4Entry], out: &mut [f32]) {
    let qt = q.as_chunks::<32>().0;
    for (e, o) in entries.iter().zip(out) {
        let mut acc = [0f32; 16];
        let vals = e.values.as_chunks::<16>().0;
        for ((v, &sb), qs) in vals.iter().zip(&e.scales).zip(qt) {
            let y = e2m1_tile32(v, ue8m0_to_f32(sb));
            for (y16, q16) in y.as_chunks::<16>().0.iter().zip(qs.as_chunks::<16>().0) {
                for ((a, &qi), &yi) in acc.iter_mut().zip(q16).zip(y16) {
                    *a += qi * yi;
                }
            }
        }
        *o = tree_sum16(&acc);
    }
}

/// Twice each E2M1 value of a packed row, as exact small integers, in element order.
#[inline(always)]
fn e2m1_times_two(values: &[u8; 64]) -> [i16; 128] {
    let mut y = [0i16; 128];
    for (pair, &b) in y.as_chunks_mut::<2>().0.iter_mut().zip(values) {
        let [a, c] = E2M1_X2_PAIRS[usize::from(b)];
        *pair = [i16::from(a), i16::from(c)];
    }
    y
}

/// Spec §5.3 x §5.3, exact: integer block sums, then [`combine_mxfp4_blocks`].
pub(crate) fn dot_mxfp4_mxfp4(q: &IndexMxfp4Entry, keys: &[IndexMxfp4Entry], out: &mut [f32]) {
    let qv = e2m1_times_two(&q.values);
    for (k, o) in keys.iter().zip(out) {
        let kv = e2m1_times_two(&k.values);
        let mut isum = [0i32; 4];
        let qb = qv.as_chunks::<32>().0;
        let kb = kv.as_chunks::<32>().0;
        for ((s, a), b) in isum.iter_mut().zip(qb).zip(kb) {
            // |2q * 2k| <= 144 and 32 of them fit easily in i32 (in i16 products even).
            *s = a
                .iter()
                .zip(b)
                .map(|(&x, &y)| i32::from(x * y))
                .sum::<i32>();
        }
        *o = combine_mxfp4_blocks(isum, &q.scales, &k.scales);
    }
}
