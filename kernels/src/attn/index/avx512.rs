//! AVX-512 VNNI kernels of the indexer scan: sixteen keys per tile, lanes = keys, one integer
//! sum per head and block ([`index_tile16`]) or, with VBMI, one per head ([`index_tile16_fused`]).
//! The AVX2 scan loops of [`super::avx2`] call them for each tile.
//!
//! Every `pub(crate)` function is a `#[target_feature]` fn that callers only reach while
//! holding a [`crate::level::Vnni`] token (AVX-512 level and VNNI; VBMI for the fused one).

use core::arch::x86_64::*;

use kvstack_firmware_interface::IndexMxfp4Entry;
use kvstack_firmware_interface::element::E2M1_TIMES_TWO_I8;

#[cfg(test)]
use super::IndexQuery;
use super::tiles::{KEY_LANES, KEY_LUT, LINES_PER_POINT, TileLines};
use super::{FUSED_KEY_OFFSET, FUSED_SPAN, FastLimits, Prepared};
use crate::attn::INDEX_HEADS;
#[cfg(test)]
use crate::level::Vnni;
use crate::x86::avx512::{ld_si128, ld_si512, st_ps};

/// Transposes a 16 x 16 block of 32-bit lanes: lane `e` of result `i` is lane `i` of `r[e]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // Rows in pairs, then quads: within each 128-bit lane `L`, `u[4i + k]` holds column
    // `4L + k` of rows `4i..4i+4`.
    let t: [__m512i; 16] = std::array::from_fn(|x| {
        let (a, b) = (r[x & !1], r[x | 1]);
        if x % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|x| {
        let (i, k) = (x / 4, x % 4);
        let (a, b) = (t[4 * i + k / 2], t[4 * i + 2 + k / 2]);
        if k % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Then the 128-bit lanes: column `4L + k` gathers lane `L` of `u[k]`, `u[4 + k]`,
    // `u[8 + k]`, `u[12 + k]`.
    let mut out = [_mm512_setzero_si512(); 16];
    for k in 0..4 {
        let s0 = _mm512_shuffle_i32x4::<0x44>(u[k], u[4 + k]);
        let s1 = _mm512_shuffle_i32x4::<0xEE>(u[k], u[4 + k]);
        let s2 = _mm512_shuffle_i32x4::<0x44>(u[8 + k], u[12 + k]);
        let s3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + k], u[12 + k]);
        out[k] = _mm512_shuffle_i32x4::<0x88>(s0, s2);
        out[4 + k] = _mm512_shuffle_i32x4::<0xDD>(s0, s2);
        out[8 + k] = _mm512_shuffle_i32x4::<0x88>(s1, s3);
        out[12 + k] = _mm512_shuffle_i32x4::<0xDD>(s1, s3);
    }
    out
}

/// The packed values of sixteen keys, one vector each. A loop rather than `keys.map(..)`:
/// rustc left that `map` out of line, with one call per key to a closure that loads a
/// vector (measured: about 15% of a 16-key tile's time).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn load_keys(keys: &[&IndexMxfp4Entry; KEY_LANES]) -> [__m512i; KEY_LANES] {
    let mut v = [_mm512_setzero_si512(); KEY_LANES];
    for (x, k) in v.iter_mut().zip(keys) {
        *x = ld_si512(&k.values);
    }
    v
}

/// The scale bytes of sixteen keys, lane = key: each block's byte, and their minimum and
/// maximum.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn key_exponents(keys: &[&IndexMxfp4Entry; KEY_LANES]) -> ([__m512i; 4], __m512i, __m512i) {
    // Lane e: key e's four scale bytes (little-endian u32).
    let mut sc = [0u8; 4 * KEY_LANES];
    for (d, k) in sc.chunks_exact_mut(4).zip(keys) {
        d.copy_from_slice(&k.scales);
    }
    let s = ld_si512(&sc);
    let m = _mm512_set1_epi32(0xFF);
    let e = [
        _mm512_and_si512(s, m),
        _mm512_and_si512(_mm512_srli_epi32::<8>(s), m),
        _mm512_and_si512(_mm512_srli_epi32::<16>(s), m),
        _mm512_srli_epi32::<24>(s),
    ];
    let emin = _mm512_min_epi32(_mm512_min_epi32(e[0], e[1]), _mm512_min_epi32(e[2], e[3]));
    let emax = _mm512_max_epi32(_mm512_max_epi32(e[0], e[1]), _mm512_max_epi32(e[2], e[3]));
    (e, emin, emax)
}

/// The lanes whose keys fall outside the fast path's scale window, or span more than `span`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn outside_fast_path(lim: FastLimits, emin: __m512i, emax: __m512i, span: i32) -> __mmask16 {
    _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(lim.kmin), emin)
        | _mm512_cmpgt_epi32_mask(emax, _mm512_set1_epi32(lim.kmax))
        | _mm512_cmpgt_epi32_mask(_mm512_sub_epi32(emax, emin), _mm512_set1_epi32(span))
}

/// Scores sixteen keys with VNNI, lanes = keys; `false` (and nothing written) when the tile's
/// scale exponents are outside the fast path's window (see [`super::IndexQuery`]), so the
/// caller must use the exact path.
///
/// The keys' packed bytes are transposed (vector `dw` holds bytes `4dw..4dw+4` of every key)
/// and decoded to `2k + 12` (unsigned bytes); each head's four-byte query groups are
/// broadcast against them, `vpdpbusd` summing each block's 32 products in i32 from a start
/// of `-12 * sum(2q)`, so the accumulator is the block's exact integer `I_b`. Then
/// `d = sum_b I_b * 2^(eq_b - 127) * 2^(ek_b - 129)` in f32: every product is exact and, under
/// the fast-path conditions, every partial sum is an integer below 2^24 times the smallest
/// term's power of two, so `d` is exact in any order and equals the AVX2 kernel's. The head
/// terms `w[h] * relu(d[h])` are then summed in head order (`s = T_0; s = s + T_h`), lane for
/// lane the operations of the other levels: the scores are bit-identical to theirs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(crate) fn index_tile16(
    p: &Prepared,
    keys: &[&IndexMxfp4Entry; KEY_LANES],
    out: &mut [f32; KEY_LANES],
) -> bool {
    let Some(lim) = p.fast else {
        return false;
    };
    let (e, emin, emax) = key_exponents(keys);
    let bad = outside_fast_path(lim, emin, emax, lim.kspan);
    if bad != 0 {
        return false;
    }
    // 2^(ek - 129): the key's scale and the 1/4 of `2k * 2q` (normal: ek >= kmin >= 3).
    let two = _mm512_set1_epi32(2);
    let sk = e.map(|x| _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(x, two))));

    // Decoded keys: kb[b][g] = group g of block b of all sixteen keys.
    let packed = transpose16(load_keys(keys));
    // The table in every 128-bit lane.
    let lut = _mm512_broadcast_i32x4(ld_si128(&KEY_LUT[0]));
    let nib = _mm512_set1_epi8(0x0F);
    let mut kb = [[_mm512_setzero_si512(); 8]; 4];
    for (dw, v) in packed.iter().enumerate() {
        let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(*v, nib));
        let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(*v), nib));
        let grp = &mut kb[dw / 4];
        grp[2 * (dw % 4)] = lo;
        grp[2 * (dw % 4) + 1] = hi;
    }

    let zero = _mm512_setzero_ps();
    let mut total = zero;
    for hc in 0..INDEX_HEADS / 16 {
        let heads = 16 * hc..16 * hc + 16;
        let (kq, koff, ksq, kw) = (
            &p.kq[heads.clone()],
            &p.koff[heads.clone()],
            &p.ksq[heads.clone()],
            &p.kw[heads],
        );
        let mut d = [zero; 16];
        for (b, kbb) in kb.iter().enumerate() {
            let mut acc: [__m512i; 16] = std::array::from_fn(|i| _mm512_set1_epi32(koff[i][b]));
            for (g, kg) in kbb.iter().enumerate() {
                for (a, q) in acc.iter_mut().zip(kq) {
                    *a = _mm512_dpbusd_epi32(*a, *kg, _mm512_set1_epi32(q[b][g] as i32));
                }
            }
            for ((di, a), sq) in d.iter_mut().zip(acc).zip(ksq) {
                let t = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(sq[b]));
                *di = if b == 0 {
                    _mm512_mul_ps(t, sk[b])
                } else {
                    _mm512_fmadd_ps(t, sk[b], *di)
                };
            }
        }
        for (i, (di, w)) in d.iter().zip(kw).enumerate() {
            let t = _mm512_mul_ps(_mm512_max_ps(*di, zero), _mm512_set1_ps(*w));
            total = if hc == 0 && i == 0 {
                t
            } else {
                _mm512_add_ps(total, t)
            };
        }
    }
    st_ps(out, total);
    true
}

/// The fused kernel's key decoding table: entry `16 t + c` is `(2 * e2m1(c) << t) + 96` for a
/// key block shifted by `t` (0..=3) exponents, an unsigned byte (at most 192).
const fn fused_lut() -> [u8; 64] {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let v = (E2M1_TIMES_TWO_I8[i % 16] as i32) << (i / 16);
        t[i] = (v + FUSED_KEY_OFFSET) as u8;
        i += 1;
    }
    t
}
static FUSED_LUT: [u8; 64] = fused_lut();

/// Scores sixteen keys like [`index_tile16`] with one integer sum per head instead of one per
/// head and block; `false` (nothing written) when the tile is outside the fused limits (a
/// key spanning more than [`FUSED_SPAN`] exponents, `ekmin` outside [`super::FusedLimits`])
/// or the fast path's, so the caller tries [`index_tile16`] next.
///
/// Each key block `b` is decoded with its shift `t_b = ek_b - ekmin` built in (a `vpermb` on
/// the 64-entry [`FUSED_LUT`], the shift in bits 4-5 of each index), and the query's bytes
/// carry their own shifts (`fq`), so `vpdpbusd` sums the whole head at one scale: 32 groups
/// into 16 accumulators per pass of 16 heads, and no per-block conversion or scaling. The
/// epilogue is `U = relu(f32(I)) * fw[h]` summed in head order, times `2^(ekmin - 129)`;
/// [`super::FusedLimits`] says why these are the reference's bits.
///
/// With `lines`, the kernel also prefetches the first
/// [`SPREAD_LINES`](super::tiles::SPREAD_LINES) of them into L1, [`LINES_PER_POINT`] at each
/// of [`PREFETCH_POINTS`](super::tiles::PREFETCH_POINTS) points spread through its integer loop (a gathered
/// scan passes the lines of a tile it scores a few tiles later). The prefetches change
/// nothing but timing.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
pub(crate) fn index_tile16_fused(
    p: &Prepared,
    keys: &[&IndexMxfp4Entry; KEY_LANES],
    out: &mut [f32; KEY_LANES],
    lines: Option<&TileLines>,
) -> bool {
    let (Some(lim), Some(fl)) = (p.fast, p.fused) else {
        return false;
    };
    let (e, emin, emax) = key_exponents(keys);
    let bad = outside_fast_path(lim, emin, emax, lim.kspan.min(FUSED_SPAN))
        | _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(fl.lo), emin)
        | _mm512_cmpgt_epi32_mask(emin, _mm512_set1_epi32(fl.hi));
    if bad != 0 {
        return false;
    }
    // Per block, the shift's table offset 16 t_b in all four bytes of each key's lane.
    let bytes = _mm512_set1_epi32(0x0101_0101);
    let shift =
        e.map(|x| _mm512_mullo_epi32(_mm512_slli_epi32::<4>(_mm512_sub_epi32(x, emin)), bytes));
    let packed = transpose16(load_keys(keys));
    let lut = ld_si512(&FUSED_LUT);
    let nib = _mm512_set1_epi8(0x0F);
    // kv[2 dw + n]: nibbles n (0 low, 1 high) of packed vector dw = group 8b + g.
    let mut kv = [_mm512_setzero_si512(); 32];
    for (dw, v) in packed.iter().enumerate() {
        let t = shift[dw / 4];
        // (x & 0x0F) | t: ternary-logic truth table 0xEA.
        let lo = _mm512_ternarylogic_epi32::<0xEA>(*v, nib, t);
        let hi = _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi16::<4>(*v), nib, t);
        kv[2 * dw] = _mm512_permutexvar_epi8(lo, lut);
        kv[2 * dw + 1] = _mm512_permutexvar_epi8(hi, lut);
    }
    let zero = _mm512_setzero_ps();
    let mut total = zero;
    for hc in 0..INDEX_HEADS / 16 {
        let heads = 16 * hc..16 * hc + 16;
        let (fq, foff, fw) = (&p.fq[heads.clone()], &p.foff[heads.clone()], &p.fw[heads]);
        let mut acc: [__m512i; 16] = std::array::from_fn(|i| _mm512_set1_epi32(foff[i]));
        // Two halves of the 32 key groups, each followed by a prefetch point.
        for (c, half) in kv.as_chunks::<16>().0.iter().enumerate() {
            for (gh, kg) in half.iter().enumerate() {
                let g = 16 * c + gh;
                for (a, q) in acc.iter_mut().zip(fq) {
                    *a = _mm512_dpbusd_epi32(*a, *kg, _mm512_set1_epi32(q[g] as i32));
                }
            }
            if let Some(l) = lines {
                let point = 2 * hc + c;
                for &a in l.iter().skip(LINES_PER_POINT * point).take(LINES_PER_POINT) {
                    // A prefetch never faults and has no effect visible to Rust.
                    _mm_prefetch::<_MM_HINT_T0>(a);
                }
            }
        }
        for (i, (a, w)) in acc.iter().zip(fw).enumerate() {
            let u = _mm512_mul_ps(
                _mm512_max_ps(_mm512_cvtepi32_ps(*a), zero),
                _mm512_set1_ps(*w),
            );
            total = if hc == 0 && i == 0 {
                u
            } else {
                _mm512_add_ps(total, u)
            };
        }
    }
    // 2^(ekmin - 129) (ekmin >= 3: a normal power of two).
    let unit = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(
        emin,
        _mm512_set1_epi32(2),
    )));
    st_ps(out, _mm512_mul_ps(total, unit));
    true
}

/// Whether the VNNI kernel accepts a tile (tests check that realistic keys never fall back to
/// the exact path, so the bit-identity tests exercise the kernel).
///
/// # Safety
///
/// The CPU must have AVX-512 F/BW/VL and VNNI.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(crate) fn tile16_accepted(q: &IndexQuery, keys: &[&IndexMxfp4Entry; KEY_LANES]) -> bool {
    let mut out = [0f32; KEY_LANES];
    index_tile16(&q.prep, keys, &mut out)
}

/// Whether the fused kernel accepts a tile (`None` without VBMI).
///
/// # Safety
///
/// The CPU must have AVX-512 F/BW/VL and VNNI.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(crate) fn tile16_fused_accepted(
    v: Vnni,
    q: &IndexQuery,
    keys: &[&IndexMxfp4Entry; KEY_LANES],
) -> Option<bool> {
    let mut out = [0f32; KEY_LANES];
    // SAFETY: `v.vbmi()` adds the VBMI the fused kernel needs to what the caller promises.
    v.vbmi()
        .then(|| unsafe { index_tile16_fused(&q.prep, keys, &mut out, None) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimdLevel;

    #[test]
    fn transpose16_swaps_rows_and_lanes() {
        if !std::arch::is_x86_feature_detected!("avx512vnni") || !SimdLevel::Avx512.is_available() {
            return;
        }
        let rows: [[i32; 16]; 16] =
            std::array::from_fn(|e| std::array::from_fn(|i| (100 * e + i) as i32));
        // SAFETY: AVX-512 F/BW/VL and VNNI were detected above; every load and store covers
        // exactly one 64-byte array.
        let got: [[i32; 16]; 16] = unsafe {
            let v = transpose16(rows.map(|r| _mm512_loadu_si512(r.as_ptr().cast())));
            v.map(|x| {
                let mut o = [0i32; 16];
                _mm512_storeu_si512(o.as_mut_ptr().cast(), x);
                o
            })
        };
        for (i, row) in got.iter().enumerate() {
            for (e, &x) in row.iter().enumerate() {
                assert_eq!(x, (100 * e + i) as i32, "result {i} lane {e}");
            }
        }
    }
}
