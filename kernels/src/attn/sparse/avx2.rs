//! AVX2 + FMA sparse attention: f32 tiles of dequantized entries shared by all heads,
//! register-blocked logit and `P . V` micro-kernels, and an online softmax between them.
//!
//! Every `pub(crate)` function is a `#[target_feature(enable = "avx2,fma")]` fn: callers hold
//! a [`crate::level::Verified`] AVX2 level before calling. The micro-kernels over the f32 tiles
//! use raw pointers whose bounds are checked once per call (see each SAFETY comment).

use core::arch::x86_64::*;

use super::tile::{Row512, flat, flat_mut, zeroed};
use super::{KvRow, LOGIT_SCALE, Partial, Prep};
use crate::attn::HEAD_DIM;
use crate::x86::avx2::{ld_ps, st_ps};
/// Entries per tile: a multiple of the logit kernel's 6 rows; 48 rows of 2 KiB stay in L2
/// together with the queries and the output.
const TILE: usize = 48;
/// Channels per pass of the logit kernel: its slice of the transposed queries (16 heads x
/// `DC` x 4 B) and of the tile (48 x `DC` x 4 B) fit in L1 together.
const DC: usize = 64;

/// `e^x` for 8 lanes: `x = n ln2 + r` with `|r| <= ln2 / 2` (`ln2` split in two for an exact
/// `n ln2`), a degree-7 polynomial for `e^r` (relative error about 1e-7), times `2^n` built in
/// the exponent bits. Below -87.3 (including `-inf`) the result is 0; NaN propagates.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_ps(x: __m256) -> __m256 {
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
    let x = _mm256_min_ps(_mm256_set1_ps(88.0), x);
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
    let x = _mm256_max_ps(_mm256_set1_ps(-87.3), x);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut y = _mm256_set1_ps(C[0]);
    for &c in &C[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let v = _mm256_mul_ps(y, _mm256_castsi256_ps(pow));
    _mm256_andnot_ps(tiny, v)
}

/// Dequantizes one attended entry into `out`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dequantize_row(row: &KvRow<'_>, out: &mut Row512) {
    let out = std::slice::from_mut(&mut out.0);
    match row {
        KvRow::Fp8(e) => crate::x86::avx2::dequantize_fp8(std::slice::from_ref(*e), out),
        KvRow::Fp4(e) => crate::x86::avx2::dequantize_fp4(std::slice::from_ref(*e), out),
    }
}

/// Logits of 6 entries x 16 heads over channels `d0..d0 + dc`: `s[j][h0..h0+16] (+)=
/// sum_d kt[j0 + j][d] * qt[d][h0..h0+16]`. Twelve accumulators, two query vectors and one
/// broadcast key value live in the 16 registers; per channel 2 vector loads and 6 broadcasts
/// feed 12 FMAs. `false` (nothing computed) if the slices are too short for the block, a bug
/// [`attend`] reports.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[must_use]
fn qk_6x16(
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
    let ok = j0 + 6 <= kt.len()
        && d0 + dc <= HEAD_DIM
        && h0 + 16 <= hp
        && qt.len() >= HEAD_DIM * hp
        && s.len() >= (j0 + 6) * hp;
    debug_assert!(ok, "qk_6x16 bounds");
    if !ok {
        return false;
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
    // SAFETY: checked above: rows j0..j0+6 exist (Row512 is exactly 512 f32 without padding,
    // so rows are contiguous at stride 512); channels d0..d0+dc are inside each row; qt holds
    // 512 rows of hp values and columns h0..h0+16 are inside a row; s holds rows j0..j0+6 of
    // hp values. `loadu`/`storeu` accept any alignment.
    unsafe {
        let srow = s.as_mut_ptr().add(j0 * hp + h0);
        if accumulate {
            for (j, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_loadu_ps(srow.add(j * hp));
                a[1] = _mm256_loadu_ps(srow.add(j * hp + 8));
            }
        }
        let mut kp = kt.as_ptr().add(j0).cast::<f32>().add(d0);
        let mut qp = qt.as_ptr().add(d0 * hp + h0);
        for _ in 0..dc {
            let q0 = _mm256_loadu_ps(qp);
            let q1 = _mm256_loadu_ps(qp.add(8));
            for (j, a) in acc.iter_mut().enumerate() {
                let k = _mm256_broadcast_ss(&*kp.add(j * HEAD_DIM));
                a[0] = _mm256_fmadd_ps(k, q0, a[0]);
                a[1] = _mm256_fmadd_ps(k, q1, a[1]);
            }
            kp = kp.add(1);
            qp = qp.add(hp);
        }
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(srow.add(j * hp), a[0]);
            _mm256_storeu_ps(srow.add(j * hp + 8), a[1]);
        }
    }
    true
}

/// `o[h][d0..d0+16] = alpha[h] * o[h][..] + sum_j p[j][h] * kt[j][d0..d0+16]` for heads
/// `h0..h0 + MR` (MR <= 6): 2 MR accumulators, two value vectors and one broadcast weight.
/// `false` (nothing computed) if the slices are too short for the block.
#[inline]
#[target_feature(enable = "avx2,fma")]
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
        && d0 + 16 <= HEAD_DIM
        && p.len() >= n * hp
        && alpha.len() >= hp
        && o.len() >= hp * HEAD_DIM;
    debug_assert!(ok, "pv_kernel bounds");
    if !ok {
        return false;
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    // SAFETY: checked above: heads h0..h0+MR are rows of o (hp x 512) and entries of alpha;
    // channels d0..d0+16 are inside a row; rows 0..n of kt and of p (n x hp) exist.
    unsafe {
        let orow = o.as_mut_ptr().add(h0 * HEAD_DIM + d0);
        for (i, a) in acc.iter_mut().enumerate() {
            let al = _mm256_broadcast_ss(&*alpha.as_ptr().add(h0 + i));
            a[0] = _mm256_mul_ps(_mm256_loadu_ps(orow.add(i * HEAD_DIM)), al);
            a[1] = _mm256_mul_ps(_mm256_loadu_ps(orow.add(i * HEAD_DIM + 8)), al);
        }
        let mut kp = kt.as_ptr().cast::<f32>().add(d0);
        let mut pp = p.as_ptr().add(h0);
        for _ in 0..n {
            let v0 = _mm256_loadu_ps(kp);
            let v1 = _mm256_loadu_ps(kp.add(8));
            for (i, a) in acc.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*pp.add(i));
                a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                a[1] = _mm256_fmadd_ps(w, v1, a[1]);
            }
            kp = kp.add(HEAD_DIM);
            pp = pp.add(hp);
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(orow.add(i * HEAD_DIM), a[0]);
            _mm256_storeu_ps(orow.add(i * HEAD_DIM + 8), a[1]);
        }
    }
    true
}

/// Online softmax step for one tile of `n` logit rows (`s`, `n x hp`, overwritten with the
/// weights `p = e^(s * 512^-0.5 - m_new)`): new running maxima, rescale factors
/// `alpha = e^(m_old - m_new)` (0 for the empty initial state) and denominators. `false` if
/// `m`, `l` or `alpha` has fewer than `hp` values or `hp` is not a multiple of 8 (then heads
/// from the first short group on are left as they were).
#[inline]
#[target_feature(enable = "avx2,fma")]
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
        m.len() >= hp && l.len() >= hp && alpha.len() >= hp && hp.is_multiple_of(8),
        "softmax_tile bounds"
    );
    let c = _mm256_set1_ps(LOGIT_SCALE);
    for hv in (0..hp).step_by(8) {
        let (Some(mv), Some(lv), Some(av)) = (
            m.get_mut(hv..hv + 8),
            l.get_mut(hv..hv + 8),
            alpha.get_mut(hv..hv + 8),
        ) else {
            return false;
        };
        let (Ok(mv), Ok(lv), Ok(av)) = (
            <&mut [f32; 8]>::try_from(mv),
            <&mut [f32; 8]>::try_from(lv),
            <&mut [f32; 8]>::try_from(av),
        ) else {
            return false;
        };
        let mut mt = _mm256_set1_ps(f32::NEG_INFINITY);
        for j in 0..n {
            if let Some(x) = s.get_mut(j * hp + hv..j * hp + hv + 8)
                && let Ok(x) = <&mut [f32; 8]>::try_from(x)
            {
                let v = _mm256_mul_ps(ld_ps(x), c);
                st_ps(x, v);
                mt = _mm256_max_ps(mt, v);
            }
        }
        let mo = ld_ps(mv);
        let mn = _mm256_max_ps(mo, mt);
        let a = exp_ps(_mm256_sub_ps(mo, mn));
        let mut sum = _mm256_setzero_ps();
        for j in 0..n {
            if let Some(x) = s.get_mut(j * hp + hv..j * hp + hv + 8)
                && let Ok(x) = <&mut [f32; 8]>::try_from(x)
            {
                let p = exp_ps(_mm256_sub_ps(ld_ps(x), mn));
                st_ps(x, p);
                sum = _mm256_add_ps(sum, p);
            }
        }
        st_ps(lv, _mm256_fmadd_ps(ld_ps(lv), a, sum));
        st_ps(mv, mn);
        st_ps(av, a);
    }
    true
}

/// Prefetches every cache line of an entry (into all levels).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_row(row: &KvRow<'_>) {
    let (p, len) = row.bytes();
    for off in (0..len).step_by(64) {
        // A prefetch never faults and has no effect visible to Rust; the address is inside
        // the entry, computed with wrapping arithmetic and never dereferenced.
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast());
    }
}

/// Attends `rows` into `st`, tile by tile: dequantize (once for all heads), logits, online
/// softmax, `P . V`. `false` if a micro-kernel found its slices too short: `prep` and `st`
/// were not made for the same heads (a bug; `st` is then not meaningful).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn attend(prep: &Prep<'_>, rows: &[KvRow<'_>], st: &mut Partial) -> bool {
    let hp = prep.hp;
    let qt = flat(&prep.qt);
    let mut kt = vec![Row512([0.0; HEAD_DIM]); TILE];
    let mut sv = zeroed(TILE * hp);
    let s = flat_mut(&mut sv);
    let mut alpha = vec![0f32; hp];
    let o = flat_mut(&mut st.o);
    let mut ok = true;
    let tiles = rows.chunks(TILE);
    let mut next = rows.chunks(TILE).skip(1);
    for tile in tiles {
        if let Some(nt) = next.next() {
            for r in nt {
                prefetch_row(r);
            }
        }
        let n = tile.len();
        let np = n.next_multiple_of(6);
        for (r, k) in tile.iter().zip(kt.iter_mut()) {
            dequantize_row(r, k);
        }
        // Padding rows are zero: their logits are computed but never used.
        for k in kt.iter_mut().take(np).skip(n) {
            k.0.fill(0.0);
        }
        for h0 in (0..hp).step_by(16) {
            for d0 in (0..HEAD_DIM).step_by(DC) {
                for j0 in (0..np).step_by(6) {
                    ok &= qk_6x16(&kt, j0, qt, hp, h0, d0, DC, d0 > 0, s);
                }
            }
        }
        ok &= softmax_tile(s, n, hp, &mut st.m, &mut st.l, &mut alpha);
        for d0 in (0..HEAD_DIM).step_by(16) {
            let mut h0 = 0;
            while h0 < hp {
                ok &= match hp - h0 {
                    1 => pv_kernel::<1>(&kt, n, s, hp, h0, d0, &alpha, o),
                    2 => pv_kernel::<2>(&kt, n, s, hp, h0, d0, &alpha, o),
                    3 => pv_kernel::<3>(&kt, n, s, hp, h0, d0, &alpha, o),
                    4 => pv_kernel::<4>(&kt, n, s, hp, h0, d0, &alpha, o),
                    5 => pv_kernel::<5>(&kt, n, s, hp, h0, d0, &alpha, o),
                    _ => pv_kernel::<6>(&kt, n, s, hp, h0, d0, &alpha, o),
                };
                h0 += 6;
            }
        }
    }
    ok
}
