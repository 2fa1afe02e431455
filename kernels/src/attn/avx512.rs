//! AVX-512 sparse attention: the AVX2 kernel's algorithm ([`super::avx2::attend`]) with
//! 16-lane vectors and the 32 vector registers.
//!
//! Every lane computes exactly what the matching AVX2 lane computes, in the same order: a
//! logit is one FMA chain over the 512 channels, a `P . V` output one FMA chain over the tile's
//! entries after its rescale, and `e^x` the same operations lane by lane. Only the blocking
//! changes (12 entries x 32 or 16 heads per logit micro-kernel, up to 12 heads x 32 channels per
//! `P . V` micro-kernel), so the result is bit-identical to the AVX2 path (tested).
//!
//! Every `pub(crate)` function is a `#[target_feature]` fn that callers only reach while
//! holding a [`crate::level::Verified`] AVX-512 level.

use core::arch::x86_64::*;

use super::{HEAD_DIM, INDEX_HEADS};
use kvstack_firmware_interface::IndexMxfp4Entry;

use super::index::{FUSED_KEY_OFFSET, FUSED_SPAN, FastLimits, Prepared};
use super::sparse::{KvRow, LOGIT_SCALE, Partial, Prep};
use super::tile::{Row512, flat, flat_mut, zeroed};
use crate::SimdLevel;
use crate::level::Verified;
use crate::x86::avx512::{ld_ps, ld_si128, ld_si512, st_ps};
use kvstack_firmware_interface::element::E2M1_TIMES_TWO_I8;

/// Entries per tile, as in AVX2 (a multiple of the logit kernel's 12 rows).
const TILE: usize = 48;
/// Channels per pass of the logit kernel (its query slice and tile slice fit in L1).
const DC: usize = 64;
/// Rows of the logit micro-kernel.
const QK_ROWS: usize = 12;

/// `e^x` for 16 lanes, lane for lane the operations of the AVX2 `exp_ps` (same constants, same
/// order), so both give the same bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn exp_ps(x: __m512) -> __m512 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const C: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    // Operand order keeps NaN: `min_ps(a, b)` returns `b` when either is NaN.
    let x = _mm512_min_ps(_mm512_set1_ps(88.0), x);
    let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.3));
    let x = _mm512_max_ps(_mm512_set1_ps(-87.3), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut y = _mm512_set1_ps(C[0]);
    for &c in &C[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(
        y,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    let pow = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    let v = _mm512_mul_ps(y, _mm512_castsi512_ps(pow));
    // Lanes below the range are +0, as the AVX2 `andnot` makes them.
    _mm512_maskz_mov_ps(!tiny, v)
}

/// Dequantizes one attended entry into `out` (bit-identical on every level).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn dequantize_row(row: &KvRow<'_>, out: &mut Row512) {
    let out = std::slice::from_mut(&mut out.0);
    match row {
        KvRow::Fp8(e) => crate::x86::avx512::dequantize_fp8(std::slice::from_ref(*e), out),
        KvRow::Fp4(e) => crate::x86::avx512::dequantize_fp4(std::slice::from_ref(*e), out),
    }
}

/// Logits of 12 entries x `16 V` heads over channels `d0..d0 + dc`: `s[j][h0..h0+16V] (+)=
/// sum_d kt[j0 + j][d] * qt[d][h0..h0+16V]`, with `12 V` accumulators. Per channel `V` query
/// loads and twelve broadcasts feed `12 V` FMAs: `V = 2` (32 heads) is the main form; `V = 1`
/// (13 loads per 12 FMAs, load-bound) only serves a trailing 16 heads. Each lane is one FMA
/// chain over the channels, as in AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn qk_12<const V: usize>(
    kt: &[Row512],
    j0: usize,
    qt: &[f32],
    hp: usize,
    h0: usize,
    d0: usize,
    dc: usize,
    accumulate: bool,
    s: &mut [f32],
) {
    let ok = j0 + QK_ROWS <= kt.len()
        && d0 + dc <= HEAD_DIM
        && h0 + 16 * V <= hp
        && qt.len() >= HEAD_DIM * hp
        && s.len() >= (j0 + QK_ROWS) * hp;
    debug_assert!(ok, "qk_12 bounds");
    if !ok {
        return;
    }
    let mut acc = [[_mm512_setzero_ps(); V]; QK_ROWS];
    // SAFETY: checked above: rows j0..j0+12 exist (Row512 is exactly 512 f32 without padding,
    // so rows are contiguous at stride 512); channels d0..d0+dc are inside each row; qt holds
    // 512 rows of hp values and columns h0..h0+16V are inside a row; s holds rows j0..j0+12
    // of hp values. `loadu`/`storeu` accept any alignment.
    unsafe {
        let srow = s.as_mut_ptr().add(j0 * hp + h0);
        if accumulate {
            for (j, a) in acc.iter_mut().enumerate() {
                for (v, av) in a.iter_mut().enumerate() {
                    *av = _mm512_loadu_ps(srow.add(j * hp + 16 * v));
                }
            }
        }
        let mut kp = kt.as_ptr().add(j0).cast::<f32>().add(d0);
        let mut qp = qt.as_ptr().add(d0 * hp + h0);
        for _ in 0..dc {
            let q: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(qp.add(16 * v)));
            for (j, a) in acc.iter_mut().enumerate() {
                let k = _mm512_set1_ps(*kp.add(j * HEAD_DIM));
                for (av, qv) in a.iter_mut().zip(q) {
                    *av = _mm512_fmadd_ps(k, qv, *av);
                }
            }
            kp = kp.add(1);
            qp = qp.add(hp);
        }
        for (j, a) in acc.iter().enumerate() {
            for (v, av) in a.iter().enumerate() {
                _mm512_storeu_ps(srow.add(j * hp + 16 * v), *av);
            }
        }
    }
}

/// `o[h][d0..d0+32] = alpha[h] * o[h][..] + sum_j p[j][h] * kt[j][d0..d0+32]` for heads
/// `h0..h0 + MR` (MR <= 12): 2 MR accumulators, two value vectors and broadcast weights.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn pv_kernel<const MR: usize>(
    kt: &[Row512],
    n: usize,
    p: &[f32],
    hp: usize,
    h0: usize,
    d0: usize,
    alpha: &[f32],
    o: &mut [f32],
) {
    let ok = n <= kt.len()
        && h0 + MR <= hp
        && d0 + 32 <= HEAD_DIM
        && p.len() >= n * hp
        && alpha.len() >= hp
        && o.len() >= hp * HEAD_DIM;
    debug_assert!(ok, "pv_kernel bounds");
    if !ok {
        return;
    }
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // SAFETY: checked above: heads h0..h0+MR are rows of o (hp x 512) and entries of alpha;
    // channels d0..d0+32 are inside a row; rows 0..n of kt and of p (n x hp) exist.
    unsafe {
        let orow = o.as_mut_ptr().add(h0 * HEAD_DIM + d0);
        for (i, a) in acc.iter_mut().enumerate() {
            let al = _mm512_set1_ps(*alpha.as_ptr().add(h0 + i));
            a[0] = _mm512_mul_ps(_mm512_loadu_ps(orow.add(i * HEAD_DIM)), al);
            a[1] = _mm512_mul_ps(_mm512_loadu_ps(orow.add(i * HEAD_DIM + 16)), al);
        }
        let mut kp = kt.as_ptr().cast::<f32>().add(d0);
        let mut pp = p.as_ptr().add(h0);
        for _ in 0..n {
            let v0 = _mm512_loadu_ps(kp);
            let v1 = _mm512_loadu_ps(kp.add(16));
            for (i, a) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*pp.add(i));
                a[0] = _mm512_fmadd_ps(w, v0, a[0]);
                a[1] = _mm512_fmadd_ps(w, v1, a[1]);
            }
            kp = kp.add(HEAD_DIM);
            pp = pp.add(hp);
        }
        for (i, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(orow.add(i * HEAD_DIM), a[0]);
            _mm512_storeu_ps(orow.add(i * HEAD_DIM + 16), a[1]);
        }
    }
}

/// Online softmax step for one tile of `n` logit rows, 16 heads at a time; lane for lane the
/// AVX2 `softmax_tile` (`hp` is a multiple of 16).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn softmax_tile(
    s: &mut [f32],
    n: usize,
    hp: usize,
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
) {
    let c = _mm512_set1_ps(LOGIT_SCALE);
    for hv in (0..hp).step_by(16) {
        let (Some(mv), Some(lv), Some(av)) = (
            m.get_mut(hv..hv + 16),
            l.get_mut(hv..hv + 16),
            alpha.get_mut(hv..hv + 16),
        ) else {
            return;
        };
        let (Ok(mv), Ok(lv), Ok(av)) = (
            <&mut [f32; 16]>::try_from(mv),
            <&mut [f32; 16]>::try_from(lv),
            <&mut [f32; 16]>::try_from(av),
        ) else {
            return;
        };
        let mut mt = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in 0..n {
            if let Some(x) = row(s, hp, j, hv) {
                let v = _mm512_mul_ps(ld_ps(x), c);
                st_ps(x, v);
                mt = _mm512_max_ps(mt, v);
            }
        }
        let mo = ld_ps(mv);
        let mn = _mm512_max_ps(mo, mt);
        let a = exp_ps(_mm512_sub_ps(mo, mn));
        let mut sum = _mm512_setzero_ps();
        for j in 0..n {
            if let Some(x) = row(s, hp, j, hv) {
                let p = exp_ps(_mm512_sub_ps(ld_ps(x), mn));
                st_ps(x, p);
                sum = _mm512_add_ps(sum, p);
            }
        }
        st_ps(lv, _mm512_fmadd_ps(ld_ps(lv), a, sum));
        st_ps(mv, mn);
        st_ps(av, a);
    }
}

/// Lanes `hv..hv + 16` of logit row `j` (rows of `hp` values), if inside `s`.
#[inline]
fn row(s: &mut [f32], hp: usize, j: usize, hv: usize) -> Option<&mut [f32; 16]> {
    s.get_mut(j * hp + hv..j * hp + hv + 16)
        .and_then(|x| <&mut [f32; 16]>::try_from(x).ok())
}

/// Prefetches every cache line of an entry (into all levels).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn prefetch_row(row: &KvRow<'_>) {
    let (p, len) = row.bytes();
    for off in (0..len).step_by(64) {
        // A prefetch never faults and has no effect visible to Rust; the address is inside
        // the entry, computed with wrapping arithmetic and never dereferenced.
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast());
    }
}

/// `P . V` of one tile for every head, heads in groups of up to 12.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn pv_tile(kt: &[Row512], n: usize, s: &[f32], hp: usize, alpha: &[f32], o: &mut [f32]) {
    for d0 in (0..HEAD_DIM).step_by(32) {
        let mut h0 = 0;
        while h0 < hp {
            let left = hp - h0;
            match left {
                1 => pv_kernel::<1>(kt, n, s, hp, h0, d0, alpha, o),
                2 => pv_kernel::<2>(kt, n, s, hp, h0, d0, alpha, o),
                3 => pv_kernel::<3>(kt, n, s, hp, h0, d0, alpha, o),
                4 => pv_kernel::<4>(kt, n, s, hp, h0, d0, alpha, o),
                5 => pv_kernel::<5>(kt, n, s, hp, h0, d0, alpha, o),
                6 => pv_kernel::<6>(kt, n, s, hp, h0, d0, alpha, o),
                7 => pv_kernel::<7>(kt, n, s, hp, h0, d0, alpha, o),
                8 => pv_kernel::<8>(kt, n, s, hp, h0, d0, alpha, o),
                9 => pv_kernel::<9>(kt, n, s, hp, h0, d0, alpha, o),
                10 => pv_kernel::<10>(kt, n, s, hp, h0, d0, alpha, o),
                11 => pv_kernel::<11>(kt, n, s, hp, h0, d0, alpha, o),
                _ => pv_kernel::<12>(kt, n, s, hp, h0, d0, alpha, o),
            }
            h0 += left.min(12);
        }
    }
}

/// Attends `rows` into `st`, tile by tile: dequantize (once for all heads), logits, online
/// softmax, `P . V`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn attend(prep: &Prep<'_>, rows: &[KvRow<'_>], st: &mut Partial) {
    let hp = prep.hp;
    let qt = flat(&prep.qt);
    let mut kt = vec![Row512([0.0; HEAD_DIM]); TILE];
    let mut sv = zeroed(TILE * hp);
    let s = flat_mut(&mut sv);
    let mut alpha = vec![0f32; hp];
    let o = flat_mut(&mut st.o);
    let mut next = rows.chunks(TILE).skip(1);
    for tile in rows.chunks(TILE) {
        if let Some(nt) = next.next() {
            for r in nt {
                prefetch_row(r);
            }
        }
        let n = tile.len();
        let np = n.next_multiple_of(QK_ROWS);
        for (r, k) in tile.iter().zip(kt.iter_mut()) {
            dequantize_row(r, k);
        }
        // Padding rows are zero: their logits are computed but never used.
        for k in kt.iter_mut().take(np).skip(n) {
            k.0.fill(0.0);
        }
        let mut h0 = 0;
        while h0 < hp {
            let wide = h0 + 32 <= hp;
            for d0 in (0..HEAD_DIM).step_by(DC) {
                for j0 in (0..np).step_by(QK_ROWS) {
                    if wide {
                        qk_12::<2>(&kt, j0, qt, hp, h0, d0, DC, d0 > 0, s);
                    } else {
                        qk_12::<1>(&kt, j0, qt, hp, h0, d0, DC, d0 > 0, s);
                    }
                }
            }
            h0 += if wide { 32 } else { 16 };
        }
        softmax_tile(s, n, hp, &mut st.m, &mut st.l, &mut alpha);
        pv_tile(&kt, n, s, hp, &alpha, o);
    }
}

// ---------------------------------------------------------------------------------------------
// Indexer: sixteen keys at a time with AVX-512 VNNI.

/// Proof that this CPU has AVX-512 F/BW/VL and VNNI and that the AVX-512 level was chosen:
/// only [`Vnni::detect`] makes one, so holding it is what the `unsafe` call of
/// [`index_tile16`] from the AVX2 indexer's tile loop relies on; [`Vnni::vbmi`] says whether
/// [`index_tile16_fused`] may be called too.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Vnni {
    vbmi: bool,
}

impl Vnni {
    /// A token if `level` is the AVX-512 level and the CPU has VNNI.
    pub(crate) fn detect(level: Verified) -> Option<Vnni> {
        (level.level() == SimdLevel::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni"))
            .then(|| Vnni {
                vbmi: std::arch::is_x86_feature_detected!("avx512vbmi"),
            })
    }

    /// Whether the CPU also has AVX-512 VBMI (`vpermb`), which the fused kernel needs.
    pub(crate) fn vbmi(self) -> bool {
        self.vbmi
    }
}

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

/// Keys per tile of [`index_tile16`]: one per 32-bit lane.
pub(crate) const KEY_LANES: usize = 16;

/// Cache lines a tile's keys can span: two per key, as a 68-byte key at a 4-byte-aligned
/// offset spans two 64-byte lines.
pub(crate) const TILE_LINES: usize = 2 * KEY_LANES;

/// The fused kernel's prefetch points: after each half of the key groups of each pass of 16
/// heads.
const PREFETCH_POINTS: usize = 2 * (INDEX_HEADS / 16);

/// Lines prefetched at each of the fused kernel's prefetch points: a tile of two pool blocks
/// (8 consecutive keys, 9 or 10 lines each) fits in the first [`SPREAD_LINES`] of a
/// [`TileLines`] list.
const LINES_PER_POINT: usize = 5;

/// How many lines of a [`TileLines`] list [`index_tile16_fused`] prefetches.
pub(crate) const SPREAD_LINES: usize = PREFETCH_POINTS * LINES_PER_POINT;

/// Addresses of cache lines to prefetch (any address: a prefetch never faults); the fused
/// kernel takes the first [`SPREAD_LINES`].
pub(crate) type TileLines = [*const i8; TILE_LINES];

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
    // The table in every 128-bit lane (its 32 bytes are two copies of the 16-entry table).
    let lut = match super::avx2::KEY_LUT.first_chunk::<16>() {
        Some(t) => _mm512_broadcast_i32x4(ld_si128(t)),
        None => _mm512_setzero_si512(),
    };
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
/// key spanning more than [`FUSED_SPAN`] exponents, `ekmin` outside [`super::index::FusedLimits`])
/// or the fast path's, so the caller tries [`index_tile16`] next.
///
/// Each key block `b` is decoded with its shift `t_b = ek_b - ekmin` built in (a `vpermb` on
/// the 64-entry [`FUSED_LUT`], the shift in bits 4-5 of each index), and the query's bytes
/// carry their own shifts (`fq`), so `vpdpbusd` sums the whole head at one scale: 32 groups
/// into 16 accumulators per pass of 16 heads, and no per-block conversion or scaling. The
/// epilogue is `U = relu(f32(I)) * fw[h]` summed in head order, times `2^(ekmin - 129)`;
/// [`super::index::FusedLimits`] says why these are the reference's bits.
///
/// With `lines`, the kernel also prefetches the first [`SPREAD_LINES`] of them into L1,
/// [`LINES_PER_POINT`] at each of [`PREFETCH_POINTS`] points spread through its integer loop (a gathered
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
pub(crate) fn tile16_accepted(q: &super::IndexQuery, keys: &[&IndexMxfp4Entry; KEY_LANES]) -> bool {
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
    q: &super::IndexQuery,
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
