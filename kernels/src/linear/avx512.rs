//! AVX-512 kernels of [`super::PackedLinear`]: one 16-lane vector per panel and `l`, decoded
//! in registers (FP8 through `vcvtph2ps`, FP4 through a 16-entry `vpermps` table), f32 FMA
//! chains in the module's fixed order.
//!
//! Few rows (decode): up to 4 rows x 4 panels of accumulators over the packed codes, the next
//! panel group's codes prefetched meanwhile (the weights stream from memory). Many
//! rows (prefill): each 2-panel x [`KC`] tile is decoded once into an f32 buffer and up to 8
//! rows x 2 panels run over it, so decoding costs once per tile, not once per row.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Codes, KC, PANEL, PackedLinear};

/// Rows from which the tile path pays (decoding a tile once for many rows).
const TILE_ROWS: usize = 16;

/// Reads one panel vector of a format.
trait Reader: Copy {
    /// The scale vector of panel `p` in scale block `kb` (ignored by formats without).
    unsafe fn scale(self, p: usize, kb: usize) -> __m512;
    /// Panel `p`'s 16 weights at `l`, times `s`.
    unsafe fn load(self, p: usize, l: usize, s: __m512) -> __m512;
    /// Panel `p`'s weights at `l` and `l + 1` (one scale block), times `s`: the same vectors
    /// as two [`Reader::load`]s, for formats that decode a pair more cheaply than two singles.
    #[inline(always)]
    unsafe fn load2(self, p: usize, l: usize, s: __m512) -> (__m512, __m512) {
        // SAFETY: the caller's contract (l + 1 < k).
        unsafe { (self.load(p, l, s), self.load(p, l + 1, s)) }
    }
    /// Columns of `k` per scale block.
    fn bc(self) -> usize;
    /// Hints the cache at panel `p`'s codes at `l` and `l + 1` (the few-row kernel asks for
    /// the next panel group's while it decodes this one's; formats whose weights stream from
    /// beyond the caches implement it).
    #[inline(always)]
    fn prefetch(self, _p: usize, _l: usize) {}
}

/// `_mm_prefetch` into all levels, for any address: a prefetch never faults, so the pointer
/// is formed with `wrapping_add` and may point past the buffer (the last panel group's
/// "next" one), where the hint is simply wasted.
#[inline(always)]
fn prefetch_at<T>(base: *const T, elements: usize) {
    // SAFETY: prefetching reads nothing architecturally and never faults.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(elements).cast()) };
}

#[derive(Clone, Copy)]
struct F32R {
    codes: *const f32,
    k: usize,
}

impl Reader for F32R {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scale(self, _: usize, _: usize) -> __m512 {
        _mm512_setzero_ps()
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(self, p: usize, l: usize, _: __m512) -> __m512 {
        // SAFETY: the caller keeps p < panels and l < k: inside the panel buffer.
        unsafe { _mm512_loadu_ps(self.codes.add((p * self.k + l) * PANEL)) }
    }

    fn bc(self) -> usize {
        usize::MAX
    }
}

#[derive(Clone, Copy)]
struct Bf16R {
    codes: *const u16,
    k: usize,
}

impl Reader for Bf16R {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scale(self, _: usize, _: usize) -> __m512 {
        _mm512_setzero_ps()
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn load(self, p: usize, l: usize, _: __m512) -> __m512 {
        // SAFETY: p < panels and l < k: 16 u16 inside the panel buffer.
        let v = unsafe { _mm256_loadu_si256(self.codes.add((p * self.k + l) * PANEL).cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
    }

    fn bc(self) -> usize {
        usize::MAX
    }

    #[inline(always)]
    fn prefetch(self, p: usize, l: usize) {
        // 32 bytes an `l`: `l` and `l + 1` share a line.
        prefetch_at(self.codes, (p * self.k + l) * PANEL);
    }
}

#[derive(Clone, Copy)]
struct Fp8R {
    codes: *const u8,
    scales: *const f32,
    k: usize,
    kblocks: usize,
    bc: usize,
}

impl Reader for Fp8R {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scale(self, p: usize, kb: usize) -> __m512 {
        // SAFETY: p < panels, kb < kblocks: inside the expanded scales.
        unsafe { _mm512_loadu_ps(self.scales.add((p * self.kblocks + kb) * PANEL)) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    unsafe fn load(self, p: usize, l: usize, s: __m512) -> __m512 {
        // SAFETY: p < panels and l < k: 16 code bytes inside the panel buffer.
        let b = unsafe { _mm_loadu_si128(self.codes.add((p * self.k + l) * PANEL).cast()) };
        // E4M3 `s eeee mmm` as the half `s 0eeee mmm 0000000`: the code's value / 256 (as
        // `e4m3_halves`: sign-extended, shifted, the extension's bit 14 cleared).
        let w = _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b));
        let h = _mm256_and_si256(w, _mm256_set1_epi16(0xBFFF_u16 as i16));
        _mm512_mul_ps(_mm512_cvtph_ps(h), s)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
    unsafe fn load2(self, p: usize, l: usize, s: __m512) -> (__m512, __m512) {
        // SAFETY: p < panels and l + 1 < k: the 32 code bytes of `l` and `l + 1` are
        // consecutive inside the panel buffer.
        let b = unsafe { _mm256_loadu_si256(self.codes.add((p * self.k + l) * PANEL).cast()) };
        // The same halves as `load`, 32 at once (packing refused the NaN codes).
        let h = crate::x86::avx512::e4m3_halves(_mm512_cvtepi8_epi16(b));
        let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h));
        (_mm512_mul_ps(lo, s), _mm512_mul_ps(hi, s))
    }

    fn bc(self) -> usize {
        self.bc
    }

    #[inline(always)]
    fn prefetch(self, p: usize, l: usize) {
        // 16 bytes an `l`: one line every fourth.
        if l.is_multiple_of(4) {
            prefetch_at(self.codes, (p * self.k + l) * PANEL);
        }
    }
}

#[derive(Clone, Copy)]
struct Fp4R {
    codes: *const u8,
    scales: *const f32,
    k: usize,
    kblocks: usize,
    bc: usize,
    table: __m512,
    shifts: __m512i,
}

impl Reader for Fp4R {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scale(self, p: usize, kb: usize) -> __m512 {
        // SAFETY: p < panels, kb < kblocks: inside the expanded scales.
        unsafe { _mm512_loadu_ps(self.scales.add((p * self.kblocks + kb) * PANEL)) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(self, p: usize, l: usize, s: __m512) -> __m512 {
        // SAFETY: p < panels and l < k: 8 code bytes inside the panel buffer.
        let b = unsafe {
            self.codes
                .add((p * self.k + l) * PANEL / 2)
                .cast::<i64>()
                .read_unaligned()
        };
        // Lanes 0..8 take the bytes' low nibbles, lanes 8..16 their high ones; `vpermps`
        // reads only an index's low 4 bits.
        let idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(b)), self.shifts);
        _mm512_mul_ps(_mm512_permutexvar_ps(idx, self.table), s)
    }

    fn bc(self) -> usize {
        self.bc
    }

    #[inline(always)]
    fn prefetch(self, p: usize, l: usize) {
        // 8 bytes an `l`: one line every eighth.
        if l.is_multiple_of(8) {
            prefetch_at(self.codes, (p * self.k + l) * PANEL / 2);
        }
    }
}

/// `R` rows x `P` panels (from `p0`) over `l` in `l0..l1` (one [`KC`] block): `out = (first ?
/// 0 : out) + chain`. `x` is row 0 at `l = 0` (row stride `ldx`), `out` row 0 at panel `p0`'s
/// first column (row stride `ldo`), `cols` the valid columns from there.
///
/// # Safety
/// AVX-512 F + AVX2 + FMA + F16C; `p0 + P` panels and `l1` inside the reader's buffers; `x`
/// readable at `i · ldx + l` and `out` writable at `i · ldo + c` for `i < R`, `l < l1`,
/// `c < min(cols, 16 P)`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn micro<const R: usize, const P: usize, D: Reader>(
    d: D,
    p0: usize,
    (l0, l1): (usize, usize),
    x: *const f32,
    ldx: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
    first: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let bc = d.bc();
    let mut l = l0;
    while l < l1 {
        let kb = if bc == usize::MAX { 0 } else { l / bc };
        let end = if bc == usize::MAX {
            l1
        } else {
            ((kb + 1) * bc).min(l1)
        };
        let mut s = [_mm512_setzero_ps(); P];
        for (q, s) in s.iter_mut().enumerate() {
            // SAFETY: p0 + q < panels and kb < kblocks (the caller's ranges).
            *s = unsafe { d.scale(p0 + q, kb) };
        }
        // Pairs of `l` (each accumulator still takes `l`, then `l + 1`: the same chain).
        let mut ll = l;
        while ll + 1 < end {
            // The next group's panels at the same `l`, so that their lines are on the way
            // while this group decodes (the FP8, FP4 and BF16 readers; f32 weights and the
            // tile path's decoded tile, in cache already, do not prefetch). A group's
            // panels are contiguous, each its own run of lines, and with the hardware
            // prefetcher alone (it starts over at every page) weights streamed from beyond
            // the caches ran ~18 % slower (FP8, m = 1 and 4: 7.6 and 6.4 GB/s against 9.4
            // and 7.4).
            for q in 0..P {
                d.prefetch(p0 + q + P, ll);
            }
            let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); P];
            for (q, w) in w.iter_mut().enumerate() {
                // SAFETY: as above, ll + 1 < l1 <= k.
                *w = unsafe { d.load2(p0 + q, ll, s[q]) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: x is readable at i · ldx + ll and + 1 (the caller's contract).
                let (x0, x1) = unsafe { (*x.add(i * ldx + ll), *x.add(i * ldx + ll + 1)) };
                let (x0, x1) = (_mm512_set1_ps(x0), _mm512_set1_ps(x1));
                for (a, &(w0, w1)) in acc.iter_mut().zip(&w) {
                    *a = _mm512_fmadd_ps(x1, w1, _mm512_fmadd_ps(x0, w0, *a));
                }
            }
            ll += 2;
        }
        if ll < end {
            let mut w = [_mm512_setzero_ps(); P];
            for (q, w) in w.iter_mut().enumerate() {
                // SAFETY: as above, ll < l1 <= k.
                *w = unsafe { d.load(p0 + q, ll, s[q]) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: x is readable at i · ldx + ll (the caller's contract).
                let xb = _mm512_set1_ps(unsafe { *x.add(i * ldx + ll) });
                for (a, &w) in acc.iter_mut().zip(&w) {
                    *a = _mm512_fmadd_ps(xb, w, *a);
                }
            }
        }
        l = end;
    }
    for (i, acc) in acc.iter().enumerate() {
        for (q, &a) in acc.iter().enumerate() {
            let valid = cols.saturating_sub(q * PANEL).min(PANEL);
            let mask: __mmask16 = if valid >= PANEL {
                0xFFFF
            } else {
                (1u16 << valid) - 1
            };
            // SAFETY: the masked lanes are valid columns of row i (the caller's contract).
            unsafe {
                let o = out.add(i * ldo + q * PANEL);
                let prev = if first {
                    _mm512_setzero_ps()
                } else {
                    _mm512_maskz_loadu_ps(mask, o)
                };
                _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(prev, a));
            }
        }
    }
}

/// Runs rows `0..m` of one (panel group, `k` block) through `micro`, `rows` at a time with
/// smaller tails.
///
/// # Safety
/// As [`micro`] for all `m` rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows<const P: usize, D: Reader>(
    d: D,
    big: bool,
    p0: usize,
    ls: (usize, usize),
    (x, ldx): (*const f32, usize),
    m: usize,
    (out, ldo): (*mut f32, usize),
    cols: usize,
    first: bool,
) {
    let mut i = 0;
    while i < m {
        let left = m - i;
        // SAFETY: rows i .. i + r are inside the caller's m rows.
        unsafe {
            let (xi, oi) = (x.add(i * ldx), out.add(i * ldo));
            let r = if big && left >= 8 {
                micro::<8, P, D>(d, p0, ls, xi, ldx, oi, ldo, cols, first);
                8
            } else if left >= 4 {
                micro::<4, P, D>(d, p0, ls, xi, ldx, oi, ldo, cols, first);
                4
            } else if left == 3 {
                micro::<3, P, D>(d, p0, ls, xi, ldx, oi, ldo, cols, first);
                3
            } else if left == 2 {
                micro::<2, P, D>(d, p0, ls, xi, ldx, oi, ldo, cols, first);
                2
            } else {
                micro::<1, P, D>(d, p0, ls, xi, ldx, oi, ldo, cols, first);
                1
            };
            i += r;
        }
    }
}

/// Few rows: every `k` block, every row group, panels 4 at a time, straight from the codes.
///
/// # Safety
/// As [`columns`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn direct<D: Reader>(
    d: D,
    lin: &PackedLinear,
    x: &[f32],
    m: usize,
    panels: Range<usize>,
    out: *mut f32,
    ldo: usize,
) {
    let (n, k) = (lin.n, lin.k);
    for kb0 in (0..k).step_by(KC) {
        let ls = (kb0, (kb0 + KC).min(k));
        let mut p = panels.start;
        while p < panels.end {
            let col = (p - panels.start) * PANEL;
            let cols = n - p * PANEL;
            // SAFETY: panels p .. p + 4 (or p) are inside `panels`; x is m rows of k; out
            // holds m rows of ldo from column `col` (the caller's contract).
            unsafe {
                let (xo, oo) = ((x.as_ptr(), k), (out.add(col), ldo));
                if panels.end - p >= 4 {
                    rows::<4, D>(d, false, p, ls, xo, m, oo, cols, kb0 == 0);
                    p += 4;
                } else {
                    rows::<1, D>(d, false, p, ls, xo, m, oo, cols, kb0 == 0);
                    p += 1;
                }
            }
        }
    }
}

/// Many rows: per 2-panel group and `k` block, decode the tile once, then run every row.
///
/// # Safety
/// As [`columns`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tiled<D: Reader>(
    d: D,
    lin: &PackedLinear,
    x: &[f32],
    m: usize,
    panels: Range<usize>,
    out: *mut f32,
    ldo: usize,
) {
    let (n, k) = (lin.n, lin.k);
    let mut tile = vec![0f32; 2 * KC * PANEL];
    let bc = d.bc();
    let mut p = panels.start;
    while p < panels.end {
        let q = (panels.end - p).min(2);
        let col = (p - panels.start) * PANEL;
        let cols = n - p * PANEL;
        for kb0 in (0..k).step_by(KC) {
            let len = (kb0 + KC).min(k) - kb0;
            for j in 0..q {
                let mut l = kb0;
                while l < kb0 + len {
                    let kb = l / bc;
                    let end = ((kb + 1) * bc).min(kb0 + len);
                    // SAFETY: panel p + j < panels.end, kb < kblocks, l < k; the tile holds
                    // 2 x KC x 16 floats and (j · KC + l - kb0) < 2 KC.
                    unsafe {
                        let s = d.scale(p + j, kb);
                        let t = tile.as_mut_ptr();
                        let at = |ll: usize| t.add((j * KC + ll - kb0) * PANEL);
                        let mut ll = l;
                        while ll + 1 < end {
                            let (v0, v1) = d.load2(p + j, ll, s);
                            _mm512_storeu_ps(at(ll), v0);
                            _mm512_storeu_ps(at(ll + 1), v1);
                            ll += 2;
                        }
                        if ll < end {
                            _mm512_storeu_ps(at(ll), d.load(p + j, ll, s));
                        }
                    }
                    l = end;
                }
            }
            let t = F32R {
                codes: tile.as_ptr(),
                k: KC,
            };
            // SAFETY: the tile reader sees panels 0..q at l < len <= KC; x rows start at
            // column kb0 (< k), out at the group's first column.
            unsafe {
                let xo = (x.as_ptr().add(kb0), k);
                let oo = (out.add(col), ldo);
                if q == 2 {
                    rows::<2, F32R>(t, true, 0, (0, len), xo, m, oo, cols, kb0 == 0);
                } else {
                    rows::<1, F32R>(t, true, 0, (0, len), xo, m, oo, cols, kb0 == 0);
                }
            }
        }
        p += q;
    }
}

/// Few rows straight from the codes, many rows through decoded tiles (f32 weights need no
/// decoding: they run the many-row kernel on the codes themselves).
///
/// # Safety
/// AVX-512 F/BW/VL + AVX2 + FMA + F16C available; `x` is `m` rows of `k`; `out` holds `m`
/// rows of `ldo` columns, `ldo` at least the columns of `panels`; `panels` inside the
/// weight's panels.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn columns(
    lin: &PackedLinear,
    x: &[f32],
    m: usize,
    panels: Range<usize>,
    out: &mut [f32],
    ldo: usize,
) {
    let big = m >= TILE_ROWS;
    let o = out.as_mut_ptr();
    let k = lin.k;
    // SAFETY: (all arms) the caller's contract, passed on.
    unsafe {
        match &lin.codes {
            Codes::F32(c) => {
                let d = F32R {
                    codes: c.as_ptr(),
                    k,
                };
                if big {
                    f32_big(d, lin, x, m, panels, o, ldo);
                } else {
                    direct(d, lin, x, m, panels, o, ldo);
                }
            }
            Codes::Bf16(c) => {
                let d = Bf16R {
                    codes: c.as_ptr(),
                    k,
                };
                if big {
                    tiled(d, lin, x, m, panels, o, ldo);
                } else {
                    direct(d, lin, x, m, panels, o, ldo);
                }
            }
            Codes::Fp8(c) => {
                let d = Fp8R {
                    codes: c.as_ptr(),
                    scales: lin.scales.as_ptr(),
                    k,
                    kblocks: lin.kblocks,
                    bc: lin.bc,
                };
                if big {
                    tiled(d, lin, x, m, panels, o, ldo);
                } else {
                    direct(d, lin, x, m, panels, o, ldo);
                }
            }
            Codes::Fp4(c) => {
                let table = super::fp4_table();
                let d = Fp4R {
                    codes: c.as_ptr(),
                    scales: lin.scales.as_ptr(),
                    k,
                    kblocks: lin.kblocks,
                    bc: lin.bc,
                    table: _mm512_loadu_ps(table.as_ptr()),
                    shifts: _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
                };
                if big {
                    tiled(d, lin, x, m, panels, o, ldo);
                } else {
                    direct(d, lin, x, m, panels, o, ldo);
                }
            }
        }
    }
}

/// f32 weights, many rows: 8 rows x 2 panels straight over the codes.
///
/// # Safety
/// As [`columns`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f32_big(
    d: F32R,
    lin: &PackedLinear,
    x: &[f32],
    m: usize,
    panels: Range<usize>,
    out: *mut f32,
    ldo: usize,
) {
    let (n, k) = (lin.n, lin.k);
    let mut p = panels.start;
    while p < panels.end {
        let q = (panels.end - p).min(2);
        let col = (p - panels.start) * PANEL;
        let cols = n - p * PANEL;
        for kb0 in (0..k).step_by(KC) {
            let ls = (kb0, (kb0 + KC).min(k));
            // SAFETY: panels p .. p + q inside `panels`; the caller's buffers.
            unsafe {
                let (xo, oo) = ((x.as_ptr(), k), (out.add(col), ldo));
                if q == 2 {
                    rows::<2, F32R>(d, true, p, ls, xo, m, oo, cols, kb0 == 0);
                } else {
                    rows::<1, F32R>(d, true, p, ls, xo, m, oo, cols, kb0 == 0);
                }
            }
        }
        p += q;
    }
}
