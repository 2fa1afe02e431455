//! AVX-512 kernels (512-bit vectors, F + BW + VL, with AVX2 + FMA).
//!
//! Same contract as [`super::avx2`]: every `pub(crate)` function is a safe
//! `#[target_feature]` fn that the dispatchers in `codec` and `dot` only call while holding a
//! [`crate::level::Verified`] AVX-512 level; the only `unsafe` blocks are loads and stores
//! whose bounds come from array types.
//!
//! What the wider ISA changes, beyond 16 lanes:
//! - Element decoding is a register lookup: `vpermps` indexes a 16-entry f32 table with the low
//!   four bits of each lane, so a lane holding a whole packed byte yields its even element, and
//!   the byte shifted right by 4 its odd element (no byte-table splicing as in AVX2).
//! - Selects are mask registers instead of blend vectors, and `vpmovdb`/`vpmovqb` narrow codes
//!   to bytes without pack-and-permute sequences.
//! - A row's 16 tile maxima (fp8-window), or 16 dot-product accumulators, are reduced by one
//!   transposing tree ([`reduce16x16`]) into one vector.
//!
//! Codec results are bit-identical to the scalar reference (the element encoders are lane-wise
//! copies of `crate::scalar`, exactly as in AVX2). The f32 dots sum in their own fixed order
//! (see [`crate::dot`]); the MXFP4 x MXFP4 dot computes the exact per-block integer sums and
//! combines them with `scalar::combine_mxfp4_blocks`, so it is identical on every level.

use core::arch::x86_64::*;

use kvstack_firmware_interface::element::{
    E2M1_TIMES_TWO_I8, E2M1_TO_F32, E4M3_MAX, E4M3_MIN_SUBNORMAL, ue8m0_to_f32,
};
use kvstack_firmware_interface::entry::{INV_6, INV_448};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use zerocopy::{FromZeros, transmute_mut, transmute_ref};

use crate::scalar::{ABS_MASK, E4M3_SUB_BIAS, INF_BITS, QNAN_BITS, combine_mxfp4_blocks};

// ---------------------------------------------------------------------------------------------
// Loads and stores. The array types prove the bounds; none of these needs alignment.

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn ld_ps(a: &[f32; 16]) -> __m512 {
    // SAFETY: `a` is 16 initialized f32 (64 readable bytes); `loadu` accepts any alignment.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn st_ps(a: &mut [f32; 16], v: __m512) {
    // SAFETY: `a` is 16 writable f32 (64 bytes) borrowed mutably; `storeu` accepts any
    // alignment.
    unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn ld_si512(a: &[u8; 64]) -> __m512i {
    // SAFETY: `a` is 64 readable bytes; `loadu` accepts any alignment.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn ld_si128(a: &[u8; 16]) -> __m128i {
    // SAFETY: `a` is 16 readable bytes; `loadu` accepts any alignment.
    unsafe { _mm_loadu_si128(a.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn st_si128(a: &mut [u8; 16], v: __m128i) {
    // SAFETY: `a` is 16 writable bytes borrowed mutably; `storeu` accepts any alignment.
    unsafe { _mm_storeu_si128(a.as_mut_ptr().cast(), v) }
}

/// Stores the low 8 bytes of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn st_lo64(a: &mut [u8; 8], v: __m128i) {
    // SAFETY: `a` is 8 writable bytes borrowed mutably, exactly what `storel_epi64` writes;
    // any alignment.
    unsafe { _mm_storel_epi64(a.as_mut_ptr().cast(), v) }
}

/// Loads 16 bytes zero-extended to 16 i32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn ld_u8x16(a: &[u8; 16]) -> __m512i {
    _mm512_cvtepu8_epi32(ld_si128(a))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn ld_idx(a: &[i32; 16]) -> __m512i {
    // SAFETY: `a` is 16 readable i32 (64 bytes); `loadu` accepts any alignment.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn to_array_ps(v: __m512) -> [f32; 16] {
    let mut a = [0f32; 16];
    st_ps(&mut a, v);
    a
}

/// Prefetches (into all cache levels) the cache lines of `len` bytes starting `ahead` bytes
/// after the start of `block` (see `avx2::prefetch_ahead`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn prefetch_ahead<T>(block: &[T], ahead: usize, len: usize) {
    let p = block.as_ptr().cast::<i8>().wrapping_add(ahead);
    for off in (0..len).step_by(64) {
        // A prefetch never faults and has no effect visible to Rust, so any address is fine
        // (this one is computed with wrapping arithmetic and never dereferenced).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn set1_u32(x: u32) -> __m512i {
    _mm512_set1_epi32(x as i32)
}

// ---------------------------------------------------------------------------------------------
// Element codecs, lane-wise (see `crate::scalar` for the derivations).

/// E4M3 "fn" encode of 16 lanes; codes (0..=255) in i32 lanes. `cvtps_epi32` rounds to nearest
/// even (Rust always runs with the default MXCSR).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e4m3_encode(x: __m512) -> __m512i {
    let bits = _mm512_castps_si512(x);
    let a = _mm512_and_si512(bits, set1_u32(ABS_MASK));
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<20>(a), set1_u32(1));
    let biased = _mm512_add_epi32(
        _mm512_add_epi32(a, lsb),
        set1_u32(0x7_FFFFu32.wrapping_sub(0x3C00_0000)),
    );
    let normal = _mm512_min_epi32(_mm512_srli_epi32::<20>(biased), set1_u32(0x7E));
    let sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0)));
    let is_sub = _mm512_cmplt_epu32_mask(a, set1_u32(0x3C80_0000));
    let code = _mm512_mask_blend_epi32(is_sub, normal, sub);
    let is_nan = _mm512_cmpgt_epu32_mask(a, set1_u32(INF_BITS));
    let code = _mm512_mask_blend_epi32(is_nan, code, set1_u32(0x7F));
    let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(bits), set1_u32(0x80));
    _mm512_or_si512(code, sign)
}

/// E2M1 encode of 16 lanes (ties to even code, saturating, NaN to +0); codes (0..=15) in i32
/// lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e2m1_encode(x: __m512) -> __m512i {
    let bits = _mm512_castps_si512(x);
    let a = _mm512_and_si512(bits, set1_u32(ABS_MASK));
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<22>(a), set1_u32(1));
    let biased = _mm512_add_epi32(
        _mm512_add_epi32(a, lsb),
        set1_u32(0x1F_FFFFu32.wrapping_sub(0x3F00_0000)),
    );
    let normal = _mm512_min_epi32(_mm512_srli_epi32::<22>(biased), set1_u32(7));
    let sub = _mm512_cvtps_epi32(_mm512_add_ps(
        _mm512_castsi512_ps(a),
        _mm512_castsi512_ps(a),
    ));
    let is_sub = _mm512_cmplt_epu32_mask(a, set1_u32(0x3F80_0000));
    let code = _mm512_mask_blend_epi32(is_sub, normal, sub);
    let sign = _mm512_and_si512(_mm512_srli_epi32::<28>(bits), set1_u32(8));
    let not_nan = _mm512_cmple_epu32_mask(a, set1_u32(INF_BITS));
    _mm512_maskz_or_epi32(not_nan, code, sign)
}

/// E4M3 "fn" decode of codes in i32 lanes (upper bits zero), bit-identical to the reference
/// table; the construction of `scalar::e4m3_decode` (no lane ever holds an f32 subnormal).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e4m3_decode(c: __m512i) -> __m512 {
    let o = _mm512_srli_epi32::<5>(_mm512_slli_epi32::<25>(c));
    let normal = _mm512_castsi512_ps(_mm512_add_epi32(o, set1_u32(120 << 23)));
    let sub = _mm512_sub_ps(
        _mm512_castsi512_ps(_mm512_add_epi32(o, set1_u32(121 << 23))),
        _mm512_set1_ps(E4M3_SUB_BIAS),
    );
    let v = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(o, set1_u32(1 << 23)), normal, sub);
    let nan = _mm512_cmpeq_epi32_mask(o, set1_u32(0x7F << 20));
    let v = _mm512_mask_blend_ps(nan, v, _mm512_castsi512_ps(set1_u32(QNAN_BITS)));
    let sign = _mm512_and_si512(_mm512_slli_epi32::<24>(c), set1_u32(0x8000_0000));
    // Integer `or`: the float form needs AVX-512 DQ, which this level does not require.
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign))
}

/// The 16 E2M1 values as an f32 vector, for `vpermps` lookups.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e2m1_table() -> __m512 {
    ld_ps(&E2M1_TO_F32)
}

/// The even (low nibble) and odd (high nibble) elements of the packed bytes held one per i32
/// lane (upper bits zero): `vpermps` only reads the low four bits of each index.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e2m1_even_odd(bytes: __m512i, table: __m512) -> (__m512, __m512) {
    (
        _mm512_permutexvar_ps(bytes, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table),
    )
}

/// `vpshufb` controls that put, in every i32 lane `j` of 16, the packed byte holding element
/// `j` (byte `j / 2`) of the first 16 elements (`[0]`) or of the last 16 (`[1]`) in the lane's
/// low byte, the rest zero (`0x80`); `vpshufb` indexes each 128-bit block of the 16 bytes
/// broadcast to all four.
const fn e2m1_spread() -> [[u8; 64]; 2] {
    let mut t = [[0x80u8; 64]; 2];
    let mut j = 0;
    while j < 16 {
        t[0][4 * j] = (j / 2) as u8;
        t[1][4 * j] = (8 + j / 2) as u8;
        j += 1;
    }
    t
}
static E2M1_SPREAD: [[u8; 64]; 2] = e2m1_spread();

/// Per-lane right shifts bringing an odd element's code (the high nibble) to the low four
/// bits, the only bits `vpermps` reads of an index.
static E2M1_NIBBLE_SHIFT: [i32; 16] = [0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4];

/// Decodes 16 packed bytes into 32 E2M1 values in element order: per 16 elements, one byte
/// shuffle puts each element's byte in its own lane, a per-lane shift its nibble at the
/// bottom, and one `vpermps` looks it up (two shuffle-port operations per 16 elements; an
/// even/odd split then interleaving the halves took five per 32).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e2m1_decode32(v: &[u8; 16], table: __m512) -> [__m512; 2] {
    let bytes = _mm512_broadcast_i32x4(ld_si128(v));
    let shift = ld_idx(&E2M1_NIBBLE_SHIFT);
    // (Not `map` with a closure: a closure does not inherit the target features.)
    let lo = _mm512_shuffle_epi8(bytes, ld_si512(&E2M1_SPREAD[0]));
    let hi = _mm512_shuffle_epi8(bytes, ld_si512(&E2M1_SPREAD[1]));
    [
        _mm512_permutexvar_ps(_mm512_srlv_epi32(lo, shift), table),
        _mm512_permutexvar_ps(_mm512_srlv_epi32(hi, shift), table),
    ]
}

/// `2 * e2m1(code)` as i8, in all four 128-bit lanes (`vpshufb` looks up per lane).
const fn e2m1_x2_lut() -> [i8; 64] {
    let mut t = [0i8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = E2M1_TIMES_TWO_I8[i % 16];
        i += 1;
    }
    t
}
static E2M1_X2_LUT: [i8; 64] = e2m1_x2_lut();

// ---------------------------------------------------------------------------------------------
// Packing and reductions.

/// 16 E2M1 codes (0..=15, in i32 lanes) to 8 packed bytes (even element in the low nibble):
/// each 64-bit lane holds an (even, odd) pair, `x | x >> 28` puts the odd code above the even
/// one, and `vpmovqb` keeps each lane's low byte.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn pack_nibbles16(c: __m512i) -> __m128i {
    _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64::<28>(c)))
}

/// Lane `4j + i` of the result is `op` folded over the 16 lanes of `v[4j + i]`, always in the
/// same order: within each 128-bit chunk lanes `(0, 2)` and `(1, 3)` first, then the two
/// halves, then chunks `(0, 2)` and `(1, 3)`, then the two pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn reduce16x16(v: &[__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    let pair = |a, b| op(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let quad = |x, y| {
        op(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    };
    // y[j]: per 128-bit chunk c, lane i is chunk c of v[4j + i] reduced.
    let y: [__m512; 4] = std::array::from_fn(|j| {
        let v = &v[4 * j..4 * j + 4];
        quad(pair(v[0], v[1]), pair(v[2], v[3]))
    });
    // Chunks (0 with 2, 1 with 3) of y[0], y[1] (and y[2], y[3]), then the remaining pairs.
    let fold = |a, b| {
        op(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    };
    let (u01, u23) = (fold(y[0], y[1]), fold(y[2], y[3]));
    op(
        _mm512_shuffle_f32x4::<0x88>(u01, u23),
        _mm512_shuffle_f32x4::<0xDD>(u01, u23),
    )
}

/// Lane `t` is the maximum of the lanes of `m[t]` (inputs must not hold NaN).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn hmax16x16(m: &[__m512; 16]) -> __m512 {
    reduce16x16(m, |a, b| _mm512_max_ps(a, b))
}

/// Lane `t` is the sum of the lanes of `v[t]`, in the fixed order of [`reduce16x16`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn hsum16x16(v: &[__m512; 16]) -> __m512 {
    reduce16x16(v, |a, b| _mm512_add_ps(a, b))
}

/// Running maximum of magnitude bits (NaN included) for the finiteness flag, and the float
/// magnitude for the tile maximum.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn abs_track(x: __m512, raw: &mut __m512i) -> __m512 {
    let a = _mm512_and_si512(_mm512_castps_si512(x), set1_u32(ABS_MASK));
    *raw = _mm512_max_epu32(*raw, a);
    _mm512_castsi512_ps(a)
}

/// Whether every lane of the magnitude-bits maximum is below infinity.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn all_finite(raw: __m512i) -> bool {
    _mm512_cmplt_epu32_mask(raw, set1_u32(INF_BITS)) == 0xFFFF
}

/// `pow2ceil` of spec §5.1/§5.3 on positive lanes: the UE8M0 byte (biased exponent rounded up
/// when the mantissa is non-zero, clamped to 1..=254) and the scale's exact reciprocal.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn ue8m0_scale_and_recip(t: __m512) -> (__m512i, __m512) {
    let bits = _mm512_castps_si512(t);
    let exp = _mm512_srli_epi32::<23>(bits);
    let mant_nonzero = _mm512_test_epi32_mask(bits, set1_u32(0x007F_FFFF));
    let e = _mm512_mask_add_epi32(exp, mant_nonzero, exp, set1_u32(1));
    let e = _mm512_max_epi32(_mm512_min_epi32(e, set1_u32(254)), set1_u32(1));
    // 1 / 2^(e - 127) = 2^(127 - e): biased exponent 254 - e, or the subnormal 2^-127 at 254.
    let inv = _mm512_slli_epi32::<23>(_mm512_sub_epi32(set1_u32(254), e));
    let inv = _mm512_mask_blend_epi32(
        _mm512_cmpeq_epi32_mask(e, set1_u32(254)),
        inv,
        set1_u32(0x0040_0000),
    );
    (e, _mm512_castsi512_ps(inv))
}

// ---------------------------------------------------------------------------------------------
// Quantizers. Each returns whether every input value was finite.

/// Spec §5.1: a row's sixteen 32-element tiles reduce to one vector of maxima.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn quantize_fp8(rows: &[[f32; 512]], out: &mut [WindowFp8Entry]) -> bool {
    let mut raw = _mm512_setzero_si512();
    for (x, e) in rows.iter().zip(out) {
        let xv: &[[[f32; 16]; 2]; 16] = transmute_ref!(x);
        let vals: &mut [[[u8; 16]; 2]; 16] = transmute_mut!(&mut e.values);
        let mut m = [_mm512_setzero_ps(); 16];
        for (mt, [x0, x1]) in m.iter_mut().zip(xv) {
            // NaN-skipping maximum: `max_ps` returns its second operand on NaN.
            let a0 = _mm512_max_ps(abs_track(ld_ps(x0), &mut raw), _mm512_setzero_ps());
            *mt = _mm512_max_ps(abs_track(ld_ps(x1), &mut raw), a0);
        }
        let amax = hmax16x16(&m);
        let t = _mm512_mul_ps(
            _mm512_max_ps(amax, _mm512_set1_ps(1e-4)),
            _mm512_set1_ps(INV_448),
        );
        let (sb, inv) = ue8m0_scale_and_recip(t);
        st_si128(&mut e.scales, _mm512_cvtepi32_epi8(sb));
        for ((tile, dst), iv) in xv.iter().zip(vals).zip(to_array_ps(inv)) {
            let iv = _mm512_set1_ps(iv);
            for (v, d) in tile.iter().zip(dst) {
                let c = e4m3_encode(_mm512_mul_ps(ld_ps(v), iv));
                st_si128(d, _mm512_cvtepi32_epi8(c));
            }
        }
    }
    all_finite(raw)
}

/// Spec §5.2: two halves of sixteen 16-element tiles per row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn quantize_fp4(rows: &[[f32; 512]], out: &mut [GlobalFp4Entry]) -> bool {
    let mut raw = _mm512_setzero_si512();
    for (x, e) in rows.iter().zip(out) {
        let xv: &[[[f32; 16]; 16]; 2] = transmute_ref!(x);
        let vals: &mut [[[u8; 8]; 16]; 2] = transmute_mut!(&mut e.values);
        let scales: &mut [[u8; 16]; 2] = transmute_mut!(&mut e.scales);
        for ((xh, vh), sh) in xv.iter().zip(vals).zip(scales) {
            let mut m = [_mm512_setzero_ps(); 16];
            for (mt, v) in m.iter_mut().zip(xh) {
                *mt = _mm512_max_ps(abs_track(ld_ps(v), &mut raw), _mm512_setzero_ps());
            }
            let amax = hmax16x16(&m);
            // E4M3(clamp(amax / 6, 2^-9, 448)), correctly rounded division (spec §5.2).
            let t = _mm512_div_ps(amax, _mm512_set1_ps(6.0));
            let t = _mm512_min_ps(
                _mm512_max_ps(t, _mm512_set1_ps(E4M3_MIN_SUBNORMAL)),
                _mm512_set1_ps(E4M3_MAX),
            );
            let sb = e4m3_encode(t);
            st_si128(sh, _mm512_cvtepi32_epi8(sb));
            let s = to_array_ps(e4m3_decode(sb));
            for ((v, d), s) in xh.iter().zip(vh).zip(s) {
                // IEEE division: a rounded reciprocal misplaces exact E2M1 ties (spec §5.2).
                let c = e2m1_encode(_mm512_div_ps(ld_ps(v), _mm512_set1_ps(s)));
                st_lo64(d, pack_nibbles16(c));
            }
        }
    }
    all_finite(raw)
}

/// Spec §5.3 on four rows (sixteen 32-element blocks) at a time.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn quantize_mxfp4_x4(x: &[[f32; 128]; 4], out: &mut [IndexMxfp4Entry; 4], raw: &mut __m512i) {
    const FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;
    let xv: &[[[f32; 16]; 2]; 16] = transmute_ref!(x);
    let mut m = [_mm512_setzero_ps(); 16];
    for (mt, [x0, x1]) in m.iter_mut().zip(xv) {
        let a0 = _mm512_max_ps(abs_track(ld_ps(x0), raw), _mm512_setzero_ps());
        *mt = _mm512_max_ps(abs_track(ld_ps(x1), raw), a0);
    }
    let amax = hmax16x16(&m);
    let t = _mm512_mul_ps(
        _mm512_max_ps(amax, _mm512_set1_ps(FLOOR)),
        _mm512_set1_ps(INV_6),
    );
    let (sb, inv) = ue8m0_scale_and_recip(t);
    let mut sbytes = [0u8; 16];
    st_si128(&mut sbytes, _mm512_cvtepi32_epi8(sb));
    let inv = to_array_ps(inv);
    let xr: &[[[[f32; 16]; 2]; 4]; 4] = transmute_ref!(x);
    for (((e, xr), s4), i4) in out
        .iter_mut()
        .zip(xr)
        .zip(sbytes.as_chunks::<4>().0)
        .zip(inv.as_chunks::<4>().0)
    {
        e.scales = *s4;
        let vals: &mut [[[u8; 8]; 2]; 4] = transmute_mut!(&mut e.values);
        for ((block, dst), &iv) in xr.iter().zip(vals).zip(i4) {
            let iv = _mm512_set1_ps(iv);
            for (v, d) in block.iter().zip(dst) {
                st_lo64(d, pack_nibbles16(e2m1_encode(_mm512_mul_ps(ld_ps(v), iv))));
            }
        }
    }
}

/// Spec §5.3; a partial group of rows goes through zero-padded copies.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn quantize_mxfp4(rows: &[[f32; 128]], out: &mut [IndexMxfp4Entry]) -> bool {
    let mut raw = _mm512_setzero_si512();
    let (r4, r_rest) = rows.as_chunks::<4>();
    let (o4, o_rest) = out.as_chunks_mut::<4>();
    for (x, e) in r4.iter().zip(o4) {
        quantize_mxfp4_x4(x, e, &mut raw);
    }
    if !r_rest.is_empty() {
        let mut x = [[0f32; 128]; 4];
        x[..r_rest.len()].copy_from_slice(r_rest);
        let mut e = [IndexMxfp4Entry::new_zeroed(); 4];
        quantize_mxfp4_x4(&x, &mut e, &mut raw);
        o_rest.copy_from_slice(&e[..o_rest.len()]);
    }
    all_finite(raw)
}

// ---------------------------------------------------------------------------------------------
// Dequantizers.

/// 32 E4M3 codes, sign-extended to 16-bit lanes (`vpmovsxbw`), as the IEEE halves of
/// `code / 256`: `code << 7` puts the magnitude `eeee mmm` at bits 7..13 (exponent bias 15
/// instead of 7, so the value divided by 256 exactly, subnormals included), the sign at bit 14
/// and a copy of it (the extension) at bit 15; clearing bit 14 leaves the half. `vcvtph2ps`
/// then widens each half exactly. (Two operations on the widened codes, where zero extension
/// needs a third to move the sign.) The two NaN codes come out as a normal half: callers that
/// can meet them patch them.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) fn e4m3_halves(codes: __m512i) -> __m512i {
    _mm512_and_si512(
        _mm512_slli_epi16::<7>(codes),
        _mm512_set1_epi16(0xBFFF_u16 as i16),
    )
}

/// A tile's 32 codes at once through [`e4m3_halves`], the two NaN codes replaced by
/// [`e4m3_decode`]'s NaN. Same bits as `e4m3_decode(c) * s`: the tile's value is
/// `half * 256` (exact) times `s` with one rounding, done as one product with `256 s` where
/// that is a finite power of two.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn dequantize_fp8(entries: &[WindowFp8Entry], out: &mut [[f32; 512]]) {
    let magnitude = _mm512_set1_epi16(0x7F);
    let (qnan, sign) = (set1_u32(QNAN_BITS), set1_u32(0x8000_0000));
    for (e, y) in entries.iter().zip(out) {
        let vals: &[[u8; 32]; 16] = transmute_ref!(&e.values);
        let ys: &mut [[[f32; 16]; 2]; 16] = transmute_mut!(y);
        for ((v, &sb), [y0, y1]) in vals.iter().zip(&e.scales).zip(ys) {
            // SAFETY: `v` is 32 readable bytes; `loadu` accepts any alignment.
            let c = _mm512_cvtepi8_epi16(unsafe { _mm256_loadu_si256(v.as_ptr().cast()) });
            let h = e4m3_halves(c);
            // The codes whose magnitude bits are all ones (the extension is above bit 7).
            let nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(c, magnitude), magnitude);
            let halves = [
                (_mm512_castsi512_si256(h), nan as __mmask16),
                (_mm512_extracti64x4_epi64::<1>(h), (nan >> 16) as __mmask16),
            ];
            // 2^(sb - 127) · 256 is a finite power of two below byte 247; above, the
            // product is taken in two steps (an infinite `256 s` would turn finite results
            // into infinities).
            let s = ue8m0_to_f32(sb);
            let one_step = sb < 247;
            // (Both broadcasts in each arm: a branch, predicted per entry, measured ~5 %
            // faster here than a select of the factor.)
            let (k, s) = if one_step {
                (_mm512_set1_ps(s * 256.0), _mm512_set1_ps(s))
            } else {
                (_mm512_set1_ps(256.0), _mm512_set1_ps(s))
            };
            for ((hv, nan), o) in halves.into_iter().zip([y0, y1]) {
                let mut x = _mm512_cvtph_ps(hv);
                // NaN codes: the quiet NaN with the code's sign, as `e4m3_decode` gives. (A
                // branch: stored entries rarely hold one, and the patch costs two of the
                // loop's dozen operations.)
                if nan != 0 {
                    let xi = _mm512_castps_si512(x);
                    x = _mm512_castsi512_ps(_mm512_mask_or_epi32(
                        xi,
                        nan,
                        _mm512_and_si512(xi, sign),
                        qnan,
                    ));
                }
                let v = _mm512_mul_ps(x, k);
                st_ps(o, if one_step { v } else { _mm512_mul_ps(v, s) });
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn dequantize_fp4(entries: &[GlobalFp4Entry], out: &mut [[f32; 512]]) {
    let table = e2m1_table();
    for (e, y) in entries.iter().zip(out) {
        let sc: &[[u8; 16]; 2] = transmute_ref!(&e.scales);
        let s: [[f32; 16]; 2] = std::array::from_fn(|h| to_array_ps(e4m3_decode(ld_u8x16(&sc[h]))));
        let s: &[[f32; 2]; 16] = transmute_ref!(&s);
        let vals: &[[u8; 16]; 16] = transmute_ref!(&e.values);
        let ys: &mut [[[f32; 16]; 2]; 16] = transmute_mut!(y);
        for ((v, [sa, sb]), [y0, y1]) in vals.iter().zip(s).zip(ys) {
            let [f0, f1] = e2m1_decode32(v, table);
            st_ps(y0, _mm512_mul_ps(f0, _mm512_set1_ps(*sa)));
            st_ps(y1, _mm512_mul_ps(f1, _mm512_set1_ps(*sb)));
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn dequantize_mxfp4(entries: &[IndexMxfp4Entry], out: &mut [[f32; 128]]) {
    let table = e2m1_table();
    for (e, y) in entries.iter().zip(out) {
        let vals: &[[u8; 16]; 4] = transmute_ref!(&e.values);
        let ys: &mut [[[f32; 16]; 2]; 4] = transmute_mut!(y);
        for ((v, &sb), [y0, y1]) in vals.iter().zip(&e.scales).zip(ys) {
            let s = _mm512_set1_ps(ue8m0_to_f32(sb));
            let [f0, f1] = e2m1_decode32(v, table);
            st_ps(y0, _mm512_mul_ps(f0, s));
            st_ps(y1, _mm512_mul_ps(f1, s));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products.

/// How far ahead of the current batch of entries the dot products prefetch, in bytes.
const PREFETCH_AHEAD: usize = 4096;

/// A 64-byte aligned `[f32; N]`, so that no vector load of it splits a cache line.
#[repr(C, align(64))]
struct Aligned<const N: usize>([f32; N]);

impl<const N: usize> Aligned<N> {
    /// `q` split per 32-element group into its even and its odd elements (16 each), the order
    /// [`e2m1_even_odd`] decodes a group's 16 packed bytes in.
    #[inline]
    fn even_odd(q: &[f32; N]) -> Self {
        let mut p = Aligned([0f32; N]);
        for (d, g) in
            p.0.as_chunks_mut::<32>()
                .0
                .iter_mut()
                .zip(q.as_chunks::<32>().0)
        {
            for (i, pair) in g.as_chunks::<2>().0.iter().enumerate() {
                d[i] = pair[0];
                d[16 + i] = pair[1];
            }
        }
        p
    }
}

/// `vpermps` indices broadcasting fp4 tile scales: for group `g` (32 elements, tiles `2g` and
/// `2g + 1`) lanes 0..8 take scale `2g mod 16` and lanes 8..16 scale `2g + 1 mod 16` of the
/// half (tiles 0..16 or 16..32) that holds them.
const fn scale_idx() -> [[i32; 16]; 8] {
    let mut t = [[0i32; 16]; 8];
    let mut g = 0;
    while g < 8 {
        let mut l = 0;
        while l < 16 {
            t[g][l] = (2 * g + l / 8) as i32;
            l += 1;
        }
        g += 1;
    }
    t
}
static SCALE_IDX: [[i32; 16]; 8] = scale_idx();

/// One FP4 entry against the even/odd-split query, before the final reduction.
///
/// Per 32-element group `g`, `x_even q_even + x_odd q_odd` (lanes 0..8 tile `2g`, 8..16 tile
/// `2g + 1`) is multiplied by the matching tile scales into one of four accumulators (per half
/// `h` of the entry, `2h + g mod 2`), which are added as `(a0 + a1) + (a2 + a3)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn dot_fp4_acc(qp: &[[[f32; 16]; 2]; 16], e: &GlobalFp4Entry, table: __m512) -> __m512 {
    let sc: &[[u8; 16]; 2] = transmute_ref!(&e.scales);
    let vals: &[[[u8; 16]; 8]; 2] = transmute_ref!(&e.values);
    let qp: &[[[[f32; 16]; 2]; 8]; 2] = transmute_ref!(qp);
    let mut acc = [_mm512_setzero_ps(); 4];
    for (h, ((sh, vh), qh)) in sc.iter().zip(vals).zip(qp).enumerate() {
        let s = e4m3_decode(ld_u8x16(sh));
        for (g, ((v, [qe, qo]), idx)) in vh.iter().zip(qh).zip(&SCALE_IDX).enumerate() {
            let (xe, xo) = e2m1_even_odd(ld_u8x16(v), table);
            let p = _mm512_fmadd_ps(xo, ld_ps(qo), _mm512_mul_ps(xe, ld_ps(qe)));
            let a = &mut acc[2 * h + g % 2];
            *a = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(ld_idx(idx), s), *a);
        }
    }
    _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))
}

/// Runs `acc` over `entries` 16 at a time and reduces each batch with [`hsum16x16`]; a partial
/// batch is padded with zero vectors, so one entry alone sums exactly as inside a batch.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn dot_batches<E>(entries: &[E], out: &mut [f32], acc: impl Fn(&E) -> __m512) {
    let (e16, e_rest) = entries.as_chunks::<16>();
    let (o16, o_rest) = out.as_chunks_mut::<16>();
    for (e, o) in e16.iter().zip(o16) {
        let mut v = [_mm512_setzero_ps(); 16];
        for (v, e) in v.iter_mut().zip(e) {
            // One entry's lines per entry scored, `PREFETCH_AHEAD` bytes ahead: spread out, the
            // requests never queue up behind each other in the fill buffers.
            prefetch_ahead(std::slice::from_ref(e), PREFETCH_AHEAD, size_of::<E>());
            *v = acc(e);
        }
        st_ps(o, hsum16x16(&v));
    }
    if !e_rest.is_empty() {
        let mut v = [_mm512_setzero_ps(); 16];
        for (v, e) in v.iter_mut().zip(e_rest) {
            *v = acc(e);
        }
        let s = to_array_ps(hsum16x16(&v));
        o_rest.copy_from_slice(&s[..o_rest.len()]);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn dot_fp4(q: &[f32; 512], entries: &[GlobalFp4Entry], out: &mut [f32]) {
    let qp = Aligned::even_odd(q);
    let qp: &[[[f32; 16]; 2]; 16] = transmute_ref!(&qp.0);
    let table = e2m1_table();
    dot_batches(entries, out, |e| dot_fp4_acc(qp, e, table));
}

/// One MXFP4 entry against the even/odd-split f32 query, before the final reduction: per
/// 32-element block, `x_even q_even + x_odd q_odd` times the block's scale into one of two
/// accumulators (block index mod 2), then their sum.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn dot_mxfp4_acc(qp: &[[[f32; 16]; 2]; 4], e: &IndexMxfp4Entry, table: __m512) -> __m512 {
    let vals: &[[u8; 16]; 4] = transmute_ref!(&e.values);
    let mut acc = [_mm512_setzero_ps(); 2];
    for (b, ((v, [qe, qo]), &sb)) in vals.iter().zip(qp).zip(&e.scales).enumerate() {
        let (xe, xo) = e2m1_even_odd(ld_u8x16(v), table);
        let p = _mm512_fmadd_ps(xo, ld_ps(qo), _mm512_mul_ps(xe, ld_ps(qe)));
        let a = &mut acc[b % 2];
        *a = _mm512_fmadd_ps(p, _mm512_set1_ps(ue8m0_to_f32(sb)), *a);
    }
    _mm512_add_ps(acc[0], acc[1])
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn dot_mxfp4(q: &[f32; 128], entries: &[IndexMxfp4Entry], out: &mut [f32]) {
    let qp = Aligned::even_odd(q);
    let qp: &[[[f32; 16]; 2]; 4] = transmute_ref!(&qp.0);
    let table = e2m1_table();
    dot_batches(entries, out, |e| dot_mxfp4_acc(qp, e, table));
}

/// An MXFP4 query prepared for integer dots: `|2 q|` as u8 for the low nibbles (even elements)
/// and the high nibbles (odd elements), and the masks of the negative ones.
#[derive(Clone, Copy)]
struct MxQuery {
    abs: [__m512i; 2],
    neg: [__mmask64; 2],
}

/// `2 * e2m1` as i8 for the low and the high nibbles of 64 packed bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn e2m1_x2_nibbles(p: __m512i) -> [__m512i; 2] {
    let m = _mm512_set1_epi8(0x0F);
    // SAFETY: `E2M1_X2_LUT` is 64 readable bytes; `loadu` accepts any alignment.
    let lut = unsafe { _mm512_loadu_si512(E2M1_X2_LUT.as_ptr().cast()) };
    [
        _mm512_shuffle_epi8(lut, _mm512_and_si512(p, m)),
        _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(p), m)),
    ]
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn mx_query(q: &IndexMxfp4Entry) -> MxQuery {
    let [lo, hi] = e2m1_x2_nibbles(ld_si512(&q.values));
    MxQuery {
        abs: [_mm512_abs_epi8(lo), _mm512_abs_epi8(hi)],
        neg: [_mm512_movepi8_mask(lo), _mm512_movepi8_mask(hi)],
    }
}

/// Exact per-block integer sums `sum(2 q_i * 2 k_i)` of one key: `maddubs(|2q|, 2k * sign(q))`
/// gives exact i16 pair sums (at most 2 * 144 each, and the low and high nibble sums added are
/// at most 576), `madd` with ones widens them to i32; 128-bit chunk `b` is block `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn mx_block_sums(q: &MxQuery, k: &IndexMxfp4Entry) -> [i32; 4] {
    let [klo, khi] = e2m1_x2_nibbles(ld_si512(&k.values));
    let z = _mm512_setzero_si512();
    let slo = _mm512_mask_sub_epi8(klo, q.neg[0], z, klo);
    let shi = _mm512_mask_sub_epi8(khi, q.neg[1], z, khi);
    let p = _mm512_add_epi16(
        _mm512_maddubs_epi16(q.abs[0], slo),
        _mm512_maddubs_epi16(q.abs[1], shi),
    );
    let s = _mm512_madd_epi16(p, _mm512_set1_epi16(1));
    // Sum the four lanes of each chunk (integer adds: exact in any order).
    let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0b10_11_00_01>(s));
    let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0b01_00_11_10>(s));
    let mut out = [0i32; 4];
    let packed = _mm512_maskz_compress_epi32(0x1111, s);
    // SAFETY: `out` is 16 writable bytes borrowed mutably; `storeu` accepts any alignment.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), _mm512_castsi512_si128(packed)) };
    out
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn dot_mxfp4_mxfp4(q: &IndexMxfp4Entry, keys: &[IndexMxfp4Entry], out: &mut [f32]) {
    let mq = mx_query(q);
    let (k16, k_rest) = keys.as_chunks::<16>();
    let (o16, o_rest) = out.as_chunks_mut::<16>();
    for (k, o) in k16.iter().zip(o16) {
        for (k, o) in k.iter().zip(o) {
            prefetch_ahead(std::slice::from_ref(k), PREFETCH_AHEAD, size_of_val(k));
            *o = combine_mxfp4_blocks(mx_block_sums(&mq, k), &q.scales, &k.scales);
        }
    }
    for (k, o) in k_rest.iter().zip(o_rest) {
        *o = combine_mxfp4_blocks(mx_block_sums(&mq, k), &q.scales, &k.scales);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scalar::tests::probe_bits;
    use kvstack_firmware_interface::element::{
        e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32,
    };

    fn have_avx512() -> bool {
        crate::SimdLevel::Avx512.is_available()
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    fn encode_both(x: &[f32; 16]) -> ([u8; 16], [u8; 16]) {
        let v = ld_ps(x);
        let (mut a, mut b) = ([0u8; 16], [0u8; 16]);
        st_si128(&mut a, _mm512_cvtepi32_epi8(e4m3_encode(v)));
        st_si128(&mut b, _mm512_cvtepi32_epi8(e2m1_encode(v)));
        (a, b)
    }

    #[test]
    fn element_encoders_match_reference() {
        if !have_avx512() {
            return;
        }
        let bits = probe_bits();
        for chunk in bits.chunks_exact(16) {
            let x: [f32; 16] = std::array::from_fn(|i| f32::from_bits(chunk[i]));
            // SAFETY: AVX-512 F/BW/VL, AVX2 and FMA were detected above.
            let (c8, c4) = unsafe { encode_both(&x) };
            for i in 0..16 {
                assert_eq!(c8[i], e4m3_from_f32(x[i]), "e4m3 {:#010x}", chunk[i]);
                assert_eq!(c4[i], e2m1_from_f32(x[i]), "e2m1 {:#010x}", chunk[i]);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    fn decode_all() -> ([f32; 256], [f32; 32]) {
        let mut e4 = [0f32; 256];
        let codes: [u8; 256] = std::array::from_fn(|i| i as u8);
        for (o, c) in e4
            .as_chunks_mut::<16>()
            .0
            .iter_mut()
            .zip(codes.as_chunks::<16>().0)
        {
            st_ps(o, e4m3_decode(ld_u8x16(c)));
        }
        // 16 bytes with code pairs (i, 15 - i) cover every code in both nibble positions.
        let packed: [u8; 16] = std::array::from_fn(|i| (i as u8) | ((15 - i as u8) << 4));
        let mut e2 = [[0f32; 16]; 2];
        for (o, v) in e2.iter_mut().zip(e2m1_decode32(&packed, e2m1_table())) {
            st_ps(o, v);
        }
        (e4, *transmute_ref!(&e2))
    }

    #[test]
    fn element_decoders_match_reference() {
        if !have_avx512() {
            return;
        }
        // SAFETY: AVX-512 F/BW/VL, AVX2 and FMA were detected above.
        let (e4, e2) = unsafe { decode_all() };
        for (c, v) in e4.iter().enumerate() {
            assert_eq!(v.to_bits(), e4m3_to_f32(c as u8).to_bits(), "{c:#04x}");
        }
        for i in 0..16u8 {
            assert_eq!(e2[2 * i as usize].to_bits(), e2m1_to_f32(i).to_bits());
            assert_eq!(
                e2[2 * i as usize + 1].to_bits(),
                e2m1_to_f32(15 - i).to_bits()
            );
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    fn reduce_lanes(v: &[[f32; 16]; 16]) -> ([f32; 16], [f32; 16]) {
        let x: [__m512; 16] = std::array::from_fn(|i| ld_ps(&v[i]));
        (to_array_ps(hmax16x16(&x)), to_array_ps(hsum16x16(&x)))
    }

    #[test]
    fn reductions_put_vector_t_in_lane_t() {
        if !have_avx512() {
            return;
        }
        // Integers, so every summation order gives the exact sum.
        let v: [[f32; 16]; 16] =
            std::array::from_fn(|t| std::array::from_fn(|l| ((t * 37 + l * 11) % 97) as f32));
        // SAFETY: AVX-512 F/BW/VL, AVX2 and FMA were detected above.
        let (max, sum) = unsafe { reduce_lanes(&v) };
        for t in 0..16 {
            let m = v[t].iter().copied().fold(0f32, f32::max);
            assert_eq!(max[t], m, "max of vector {t}");
            assert_eq!(sum[t], v[t].iter().sum::<f32>(), "sum of vector {t}");
        }
    }

    #[test]
    fn scale_indices_pick_each_groups_two_tiles() {
        for (g, idx) in SCALE_IDX.iter().enumerate() {
            assert!(idx[..8].iter().all(|&i| i == 2 * g as i32));
            assert!(idx[8..].iter().all(|&i| i == 2 * g as i32 + 1));
        }
    }
}
