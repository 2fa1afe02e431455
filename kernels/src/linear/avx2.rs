//! AVX2 + FMA + F16C kernels of [`super::PackedLinear`]: a panel is two 8-lane halves,
//! decoded in registers (FP8 through `vcvtph2ps`, FP4 through two 8-entry `vpermps` tables
//! and a blend on the code's sign bit); up to 4 rows x 1 panel of accumulators (16 vector
//! registers), many rows over tiles decoded once, as in the AVX-512 kernels.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Codes, KC, PANEL, PackedLinear};

/// Rows from which the tile path pays.
const TILE_ROWS: usize = 16;

/// Half a panel: 8 lanes.
const HALF: usize = PANEL / 2;

trait Reader: Copy {
    /// The scale vector of half `h` of panel `p` in scale block `kb`.
    unsafe fn scale(self, p: usize, h: usize, kb: usize) -> __m256;
    /// Half `h` of panel `p`'s weights at `l`, times `s`.
    unsafe fn load(self, p: usize, h: usize, l: usize, s: __m256) -> __m256;
    /// Columns of `k` per scale block (`usize::MAX`: no scales).
    fn bc(self) -> usize;
}

#[derive(Clone, Copy)]
struct F32R {
    codes: *const f32,
    k: usize,
}

impl Reader for F32R {
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scale(self, _: usize, _: usize, _: usize) -> __m256 {
        _mm256_setzero_ps()
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(self, p: usize, h: usize, l: usize, _: __m256) -> __m256 {
        // SAFETY: p < panels, l < k, h < 2: inside the panel buffer.
        unsafe { _mm256_loadu_ps(self.codes.add((p * self.k + l) * PANEL + h * HALF)) }
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
    #[target_feature(enable = "avx2")]
    unsafe fn scale(self, _: usize, _: usize, _: usize) -> __m256 {
        _mm256_setzero_ps()
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(self, p: usize, h: usize, l: usize, _: __m256) -> __m256 {
        // SAFETY: p < panels, l < k, h < 2: 8 u16 inside the panel buffer.
        let v =
            unsafe { _mm_loadu_si128(self.codes.add((p * self.k + l) * PANEL + h * HALF).cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
    }

    fn bc(self) -> usize {
        usize::MAX
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
    #[target_feature(enable = "avx2")]
    unsafe fn scale(self, p: usize, h: usize, kb: usize) -> __m256 {
        // SAFETY: p < panels, kb < kblocks, h < 2: inside the expanded scales.
        unsafe { _mm256_loadu_ps(self.scales.add((p * self.kblocks + kb) * PANEL + h * HALF)) }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load(self, p: usize, h: usize, l: usize, s: __m256) -> __m256 {
        // SAFETY: p < panels, l < k, h < 2: 8 code bytes inside the panel buffer.
        let b =
            unsafe { _mm_loadl_epi64(self.codes.add((p * self.k + l) * PANEL + h * HALF).cast()) };
        // E4M3 as a half: the code's value / 256 (see the module documentation). Sign-extended
        // and shifted by 7, the sign lands on bit 15 and its copy on bit 14, which is cleared.
        let w = _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(b));
        let h = _mm_and_si128(w, _mm_set1_epi16(0xBFFF_u16 as i16));
        _mm256_mul_ps(_mm256_cvtph_ps(h), s)
    }

    fn bc(self) -> usize {
        self.bc
    }
}

#[derive(Clone, Copy)]
struct Fp4R {
    codes: *const u8,
    scales: *const f32,
    k: usize,
    kblocks: usize,
    bc: usize,
    /// Codes 0..8 (positive) and 8..16 (negative).
    pos: __m256,
    neg: __m256,
}

impl Reader for Fp4R {
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scale(self, p: usize, h: usize, kb: usize) -> __m256 {
        // SAFETY: p < panels, kb < kblocks, h < 2: inside the expanded scales.
        unsafe { _mm256_loadu_ps(self.scales.add((p * self.kblocks + kb) * PANEL + h * HALF)) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(self, p: usize, h: usize, l: usize, s: __m256) -> __m256 {
        // SAFETY: p < panels, l < k: 8 code bytes inside the panel buffer.
        let b = unsafe { _mm_loadl_epi64(self.codes.add((p * self.k + l) * PANEL / 2).cast()) };
        let mut idx = _mm256_cvtepu8_epi32(b);
        if h == 1 {
            idx = _mm256_srli_epi32::<4>(idx);
        }
        // `vpermps` reads an index's low 3 bits; bit 3 (the sign) picks the table.
        let lo = _mm256_permutevar8x32_ps(self.pos, idx);
        let hi = _mm256_permutevar8x32_ps(self.neg, idx);
        let v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)));
        _mm256_mul_ps(v, s)
    }

    fn bc(self) -> usize {
        self.bc
    }
}

/// `R` rows x one panel `p` over `l` in `l0..l1` (one [`KC`] block); as the AVX-512 `micro`.
///
/// # Safety
/// AVX2 + FMA + F16C; `p` and `l1` inside the reader's buffers; `x` readable at `i · ldx + l`
/// and `out` writable at `i · ldo + c` for `i < R`, `l < l1`, `c < min(cols, 16)`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro<const R: usize, D: Reader>(
    d: D,
    p: usize,
    (l0, l1): (usize, usize),
    x: *const f32,
    ldx: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
    first: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let bc = d.bc();
    let mut l = l0;
    while l < l1 {
        let kb = if bc == usize::MAX { 0 } else { l / bc };
        let end = if bc == usize::MAX {
            l1
        } else {
            ((kb + 1) * bc).min(l1)
        };
        // SAFETY: p < panels, kb < kblocks (the caller's ranges).
        let s = unsafe { [d.scale(p, 0, kb), d.scale(p, 1, kb)] };
        for ll in l..end {
            // SAFETY: as above, ll < l1 <= k.
            let w = unsafe { [d.load(p, 0, ll, s[0]), d.load(p, 1, ll, s[1])] };
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: x is readable at i · ldx + ll (the caller's contract).
                let xb = _mm256_set1_ps(unsafe { *x.add(i * ldx + ll) });
                acc[0] = _mm256_fmadd_ps(xb, w[0], acc[0]);
                acc[1] = _mm256_fmadd_ps(xb, w[1], acc[1]);
            }
        }
        l = end;
    }
    let valid = cols.min(PANEL);
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: row i, columns < valid, inside `out` (the caller's contract).
        let o = unsafe { out.add(i * ldo) };
        if valid == PANEL {
            // SAFETY: 16 valid columns at o.
            unsafe {
                for (h, &a) in acc.iter().enumerate() {
                    let prev = if first {
                        _mm256_setzero_ps()
                    } else {
                        _mm256_loadu_ps(o.add(h * HALF))
                    };
                    _mm256_storeu_ps(o.add(h * HALF), _mm256_add_ps(prev, a));
                }
            }
        } else {
            let mut buf = [0f32; PANEL];
            // SAFETY: buf holds 16 floats.
            unsafe {
                _mm256_storeu_ps(buf.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(buf.as_mut_ptr().add(HALF), acc[1]);
            }
            for (c, &v) in buf.iter().enumerate().take(valid) {
                // SAFETY: c < valid columns of row i.
                unsafe {
                    let prev = if first { 0.0 } else { *o.add(c) };
                    *o.add(c) = prev + v;
                }
            }
        }
    }
}

/// Rows `0..m` of one (panel, `k` block), 4 at a time with smaller tails.
///
/// # Safety
/// As [`micro`] for all `m` rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<D: Reader>(
    d: D,
    p: usize,
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
            i += if left >= 4 {
                micro::<4, D>(d, p, ls, xi, ldx, oi, ldo, cols, first);
                4
            } else if left == 3 {
                micro::<3, D>(d, p, ls, xi, ldx, oi, ldo, cols, first);
                3
            } else if left == 2 {
                micro::<2, D>(d, p, ls, xi, ldx, oi, ldo, cols, first);
                2
            } else {
                micro::<1, D>(d, p, ls, xi, ldx, oi, ldo, cols, first);
                1
            };
        }
    }
}

/// Every (`k` block, panel) over every row, straight from the codes, or (many rows, decoded
/// formats) through a tile decoded once.
///
/// # Safety
/// As [`columns`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn drive<D: Reader>(
    d: D,
    decode: bool,
    lin: &PackedLinear,
    x: &[f32],
    m: usize,
    panels: Range<usize>,
    out: *mut f32,
    ldo: usize,
) {
    let (n, k) = (lin.n, lin.k);
    let tiled = decode && m >= TILE_ROWS;
    let mut tile = if tiled {
        vec![0f32; KC * PANEL]
    } else {
        Vec::new()
    };
    let bc = d.bc();
    for p in panels.clone() {
        let col = (p - panels.start) * PANEL;
        let cols = n - p * PANEL;
        for kb0 in (0..k).step_by(KC) {
            let l1 = (kb0 + KC).min(k);
            // SAFETY: (both branches) panel p inside `panels`, l < k, kb < kblocks; the tile
            // holds KC x 16 floats; the caller's buffers.
            unsafe {
                let oo = (out.add(col), ldo);
                if tiled {
                    let mut l = kb0;
                    while l < l1 {
                        let kb = l / bc;
                        let end = ((kb + 1) * bc).min(l1);
                        let s = [d.scale(p, 0, kb), d.scale(p, 1, kb)];
                        for ll in l..end {
                            let t = tile.as_mut_ptr().add((ll - kb0) * PANEL);
                            _mm256_storeu_ps(t, d.load(p, 0, ll, s[0]));
                            _mm256_storeu_ps(t.add(HALF), d.load(p, 1, ll, s[1]));
                        }
                        l = end;
                    }
                    let t = F32R {
                        codes: tile.as_ptr(),
                        k: KC,
                    };
                    let xo = (x.as_ptr().add(kb0), k);
                    rows(t, 0, (0, l1 - kb0), xo, m, oo, cols, kb0 == 0);
                } else {
                    rows(d, p, (kb0, l1), (x.as_ptr(), k), m, oo, cols, kb0 == 0);
                }
            }
        }
    }
}

/// The AVX2 form of the AVX-512 `columns`.
///
/// # Safety
/// AVX2 + FMA + F16C available; `x` is `m` rows of `k`; `out` holds `m` rows of `ldo`
/// columns, `ldo` at least the columns of `panels`; `panels` inside the weight's panels.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn columns(
    lin: &PackedLinear,
    x: &[f32],
    m: usize,
    panels: Range<usize>,
    out: &mut [f32],
    ldo: usize,
) {
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
                drive(d, false, lin, x, m, panels, o, ldo);
            }
            Codes::Bf16(c) => {
                let d = Bf16R {
                    codes: c.as_ptr(),
                    k,
                };
                drive(d, true, lin, x, m, panels, o, ldo);
            }
            Codes::Fp8(c) => {
                let d = Fp8R {
                    codes: c.as_ptr(),
                    scales: lin.scales.as_ptr(),
                    k,
                    kblocks: lin.kblocks,
                    bc: lin.bc,
                };
                drive(d, true, lin, x, m, panels, o, ldo);
            }
            Codes::Fp4(c) => {
                let t = super::fp4_table();
                let d = Fp4R {
                    codes: c.as_ptr(),
                    scales: lin.scales.as_ptr(),
                    k,
                    kblocks: lin.kblocks,
                    bc: lin.bc,
                    pos: _mm256_loadu_ps(t.as_ptr()),
                    neg: _mm256_loadu_ps(t.as_ptr().add(8)),
                };
                drive(d, true, lin, x, m, panels, o, ldo);
            }
        }
    }
}
