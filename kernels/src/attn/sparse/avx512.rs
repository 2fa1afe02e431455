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

use super::tile::{Row512, flat, flat_mut, zeroed};
use super::{KvRow, LOGIT_SCALE, Partial, Prep};
use crate::attn::HEAD_DIM;
use crate::x86::avx512::{ld_ps, st_ps};

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
/// chain over the channels, as in AVX2. `false` (nothing computed) if the slices are too short
/// for the block, a bug [`attend`] reports.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[must_use]
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
) -> bool {
    let ok = j0 + QK_ROWS <= kt.len()
        && d0 + dc <= HEAD_DIM
        && h0 + 16 * V <= hp
        && qt.len() >= HEAD_DIM * hp
        && s.len() >= (j0 + QK_ROWS) * hp;
    debug_assert!(ok, "qk_12 bounds");
    if !ok {
        return false;
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
    true
}

/// `o[h][d0..d0+32] = alpha[h] * o[h][..] + sum_j p[j][h] * kt[j][d0..d0+32]` for heads
/// `h0..h0 + MR` (MR <= 12): 2 MR accumulators, two value vectors and broadcast weights.
/// `false` (nothing computed) if the slices are too short for the block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[must_use]
fn pv_kernel<const MR: usize>(
    kt: &[Row512],
    n: usize,
    p: &[f32],
    hp: usize,
    h0: usize,
    d0: usize,
    alpha: &[f32],
    o: &mut [f32],
) -> bool {
    let ok = n <= kt.len()
        && h0 + MR <= hp
        && d0 + 32 <= HEAD_DIM
        && p.len() >= n * hp
        && alpha.len() >= hp
        && o.len() >= hp * HEAD_DIM;
    debug_assert!(ok, "pv_kernel bounds");
    if !ok {
        return false;
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
    true
}

/// Online softmax step for one tile of `n` logit rows, 16 heads at a time; lane for lane the
/// AVX2 `softmax_tile` (`hp` is a multiple of 16). `false` if `m`, `l` or `alpha` has fewer
/// than `hp` values or `hp` is not a multiple of 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[must_use]
fn softmax_tile(
    s: &mut [f32],
    n: usize,
    hp: usize,
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
) -> bool {
    debug_assert!(
        m.len() >= hp && l.len() >= hp && alpha.len() >= hp && hp.is_multiple_of(16),
        "softmax_tile bounds"
    );
    let c = _mm512_set1_ps(LOGIT_SCALE);
    for hv in (0..hp).step_by(16) {
        let (Some(mv), Some(lv), Some(av)) = (
            m.get_mut(hv..hv + 16),
            l.get_mut(hv..hv + 16),
            alpha.get_mut(hv..hv + 16),
        ) else {
            return false;
        };
        let (Ok(mv), Ok(lv), Ok(av)) = (
            <&mut [f32; 16]>::try_from(mv),
            <&mut [f32; 16]>::try_from(lv),
            <&mut [f32; 16]>::try_from(av),
        ) else {
            return false;
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
    true
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

/// `P . V` of one tile for every head, heads in groups of up to 12; `false` if a group's
/// kernel found its slices too short.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[must_use]
fn pv_tile(kt: &[Row512], n: usize, s: &[f32], hp: usize, alpha: &[f32], o: &mut [f32]) -> bool {
    let mut ok = true;
    for d0 in (0..HEAD_DIM).step_by(32) {
        let mut h0 = 0;
        while h0 < hp {
            let left = hp - h0;
            ok &= match left {
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
            };
            h0 += left.min(12);
        }
    }
    ok
}

/// Attends `rows` into `st`, tile by tile: dequantize (once for all heads), logits, online
/// softmax, `P . V`. `false` if a micro-kernel found its slices too short (a bug, as in the
/// AVX2 `attend`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn attend(prep: &Prep<'_>, rows: &[KvRow<'_>], st: &mut Partial) -> bool {
    let hp = prep.hp;
    let qt = flat(&prep.qt);
    let mut kt = vec![Row512([0.0; HEAD_DIM]); TILE];
    let mut sv = zeroed(TILE * hp);
    let s = flat_mut(&mut sv);
    let mut alpha = vec![0f32; hp];
    let o = flat_mut(&mut st.o);
    let mut ok = true;
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
                        ok &= qk_12::<2>(&kt, j0, qt, hp, h0, d0, DC, d0 > 0, s);
                    } else {
                        ok &= qk_12::<1>(&kt, j0, qt, hp, h0, d0, DC, d0 > 0, s);
                    }
                }
            }
            h0 += if wide { 32 } else { 16 };
        }
        ok &= softmax_tile(s, n, hp, &mut st.m, &mut st.l, &mut alpha);
        ok &= pv_tile(&kt, n, s, hp, &alpha, o);
    }
    ok
}
