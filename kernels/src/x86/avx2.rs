//! AVX2 + FMA kernels (256-bit vectors).
//!
//! Every `pub(crate)` function here is a safe `#[target_feature(enable = "avx2,fma")]` fn:
//! calling it from code without those features is `unsafe`, and the dispatchers only do so
//! while holding a [`crate::level::Verified`] AVX2 level. Inside, the intrinsics are safe;
//! the only `unsafe` blocks are loads and stores, whose bounds come from array types.
//!
//! Codec results are bit-identical to the scalar reference (spec §5): the element encoders are
//! lane-wise copies of `crate::scalar` (RNE on the bit pattern, see there), scales are computed
//! in SIMD with the reference's exact f32 operations, and power-of-two scales are applied by
//! multiplying with their exact reciprocal.

use core::arch::x86_64::*;

use kvstack_firmware_interface::element::{
    E2M1_TIMES_TWO_I8, E2M1_TO_F32, E4M3_MAX, E4M3_MIN_SUBNORMAL, ue8m0_to_f32,
};
use kvstack_firmware_interface::entry::{INV_6, INV_448};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use zerocopy::{transmute_mut, transmute_ref};

use crate::scalar::{ABS_MASK, E4M3_SUB_BIAS, INF_BITS, QNAN_BITS};

// ---------------------------------------------------------------------------------------------
// Loads and stores. The array types prove the bounds; none of these needs alignment.

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn ld_ps(a: &[f32; 8]) -> __m256 {
    // SAFETY: `a` is 8 initialized f32 (32 readable bytes); `loadu` accepts any alignment.
    unsafe { _mm256_loadu_ps(a.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn st_ps(a: &mut [f32; 8], v: __m256) {
    // SAFETY: `a` is 8 writable f32 (32 bytes) borrowed mutably; `storeu` accepts any alignment.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn ld_si256(a: &[u8; 32]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes; `loadu` accepts any alignment.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn ld_const(a: &[i8; 32]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes; `loadu` accepts any alignment.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn st_si256(a: &mut [u8; 32], v: __m256i) {
    // SAFETY: `a` is 32 writable bytes borrowed mutably; `storeu` accepts any alignment.
    unsafe { _mm256_storeu_si256(a.as_mut_ptr().cast(), v) }
}

/// Loads 16 bytes into both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn ld_bcast128(a: &[u8; 16]) -> __m256i {
    // SAFETY: `a` is 16 readable bytes; `loadu` accepts any alignment.
    let x = unsafe { _mm_loadu_si128(a.as_ptr().cast()) };
    _mm256_broadcastsi128_si256(x)
}

/// Loads 8 bytes zero-extended to 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn ld_u8x8(a: &[u8; 8]) -> __m256i {
    // SAFETY: `a` is 8 readable bytes, exactly what `loadl_epi64` reads; any alignment.
    let x = unsafe { _mm_loadl_epi64(a.as_ptr().cast()) };
    _mm256_cvtepu8_epi32(x)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn to_array_ps(v: __m256) -> [f32; 8] {
    let mut a = [0f32; 8];
    st_ps(&mut a, v);
    a
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn to_array_epi32(v: __m256i) -> [i32; 8] {
    let mut a = [0i32; 8];
    // SAFETY: `a` is 8 writable i32 (32 bytes) borrowed mutably; `storeu` accepts any alignment.
    unsafe { _mm256_storeu_si256(a.as_mut_ptr().cast(), v) };
    a
}

/// Prefetches (into all cache levels) the cache lines of `len` bytes starting `ahead` bytes
/// after the start of `block`. Dot products stream entries once; prefetching a few KiB ahead
/// hides DRAM latency that the hardware prefetcher alone leaves exposed.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_ahead<T>(block: &[T], ahead: usize, len: usize) {
    let p = block.as_ptr().cast::<i8>().wrapping_add(ahead);
    for off in (0..len).step_by(64) {
        // A prefetch never faults and has no effect visible to Rust, so any address is fine
        // (this one is computed with wrapping arithmetic and never dereferenced).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn set1_u32(x: u32) -> __m256i {
    _mm256_set1_epi32(x as i32)
}

// ---------------------------------------------------------------------------------------------
// Element codecs, lane-wise (see `crate::scalar` for the derivations).

/// E4M3 "fn" encode of 8 lanes; codes (0..=255) in i32 lanes.
///
/// The subnormal branch uses `cvtps_epi32`, which rounds to nearest even: Rust code always runs
/// with the default MXCSR (changing it is undefined behaviour in Rust).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e4m3_encode(x: __m256) -> __m256i {
    let bits = _mm256_castps_si256(x);
    let a = _mm256_and_si256(bits, set1_u32(ABS_MASK));
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<20>(a), set1_u32(1));
    let biased = _mm256_add_epi32(
        _mm256_add_epi32(a, lsb),
        set1_u32(0x7_FFFFu32.wrapping_sub(0x3C00_0000)),
    );
    let normal = _mm256_min_epi32(_mm256_srli_epi32::<20>(biased), set1_u32(0x7E));
    let sub = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0)));
    let is_sub = _mm256_cmpgt_epi32(set1_u32(0x3C80_0000), a);
    let code = _mm256_blendv_epi8(normal, sub, is_sub);
    // NaN: normal <= 0x7E, so or-ing 0x7F gives exactly 0x7F.
    let is_nan = _mm256_cmpgt_epi32(a, set1_u32(INF_BITS));
    let code = _mm256_or_si256(code, _mm256_and_si256(is_nan, set1_u32(0x7F)));
    let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), set1_u32(0x80));
    _mm256_or_si256(code, sign)
}

/// E2M1 encode of 8 lanes (ties to even code, saturating, NaN to +0); codes (0..=15) in i32
/// lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e2m1_encode(x: __m256) -> __m256i {
    let bits = _mm256_castps_si256(x);
    let a = _mm256_and_si256(bits, set1_u32(ABS_MASK));
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<22>(a), set1_u32(1));
    let biased = _mm256_add_epi32(
        _mm256_add_epi32(a, lsb),
        set1_u32(0x1F_FFFFu32.wrapping_sub(0x3F00_0000)),
    );
    let normal = _mm256_min_epi32(_mm256_srli_epi32::<22>(biased), set1_u32(7));
    let sub = _mm256_cvtps_epi32(_mm256_add_ps(
        _mm256_castsi256_ps(a),
        _mm256_castsi256_ps(a),
    ));
    let is_sub = _mm256_cmpgt_epi32(set1_u32(0x3F80_0000), a);
    let code = _mm256_blendv_epi8(normal, sub, is_sub);
    let sign = _mm256_and_si256(_mm256_srli_epi32::<28>(bits), set1_u32(8));
    let not_nan = _mm256_cmpgt_epi32(set1_u32(INF_BITS + 1), a);
    _mm256_and_si256(_mm256_or_si256(code, sign), not_nan)
}

/// E4M3 "fn" decode of codes in i32 lanes (upper bits zero), bit-identical to the reference
/// table (0x7F/0xFF give the canonical quiet NaN with the code's sign). Same construction as
/// `scalar::e4m3_decode`: no lane ever holds an f32 subnormal (those cost a microcode assist).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e4m3_decode(c: __m256i) -> __m256 {
    // o = (code & 0x7F) << 20, via a shift up to bit 31 and back down.
    let o = _mm256_srli_epi32::<5>(_mm256_slli_epi32::<25>(c));
    let normal = _mm256_castsi256_ps(_mm256_add_epi32(o, set1_u32(120 << 23)));
    let sub = _mm256_sub_ps(
        _mm256_castsi256_ps(_mm256_add_epi32(o, set1_u32(121 << 23))),
        _mm256_set1_ps(E4M3_SUB_BIAS),
    );
    let is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(set1_u32(1 << 23), o));
    let v = _mm256_blendv_ps(normal, sub, is_sub);
    let nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(o, set1_u32(0x7F << 20)));
    let v = _mm256_blendv_ps(v, _mm256_castsi256_ps(set1_u32(QNAN_BITS)), nan);
    let sign = _mm256_and_si256(_mm256_slli_epi32::<24>(c), set1_u32(0x8000_0000));
    _mm256_or_ps(v, _mm256_castsi256_ps(sign))
}

/// High and low bytes of each E2M1 value's f32 bit pattern (its low 16 bits are zero), indexed
/// by the 4-bit code, repeated for both 128-bit lanes (`pshufb` looks up per lane).
const fn e2m1_byte_lut(shift: u32) -> [i8; 32] {
    let mut t = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = (E2M1_TO_F32[i % 16].to_bits() >> shift) as u8 as i8;
        i += 1;
    }
    t
}
static E2M1_LUT_HI: [i8; 32] = e2m1_byte_lut(24);
static E2M1_LUT_LO: [i8; 32] = e2m1_byte_lut(16);

/// `2 * e2m1(code)` as i8, both lanes.
const fn e2m1_x2_lut() -> [i8; 32] {
    let mut t = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = E2M1_TIMES_TWO_I8[i % 16];
        i += 1;
    }
    t
}
static E2M1_X2_LUT: [i8; 32] = e2m1_x2_lut();

/// `pshufb` control for [`e2m1_decode32`]: lane 0 takes packed bytes 0,1,4,5,8,9,12,13 and
/// lane 1 bytes 2,3,6,7,10,11,14,15, each twice (once per nibble).
static DUP_CTRL: [i8; 32] = [
    0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13, //
    2, 2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14, 15, 15,
];

/// Decodes 16 packed bytes (broadcast to both lanes) into 32 E2M1 values in element order.
///
/// The bytes are arranged so that, after two nibble lookups into the bf16 halves and two rounds
/// of unpacking with zero, the four result vectors come out in order with no lane crossing.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e2m1_decode32(b: __m256i) -> [__m256; 4] {
    let dup = _mm256_shuffle_epi8(b, ld_const(&DUP_CTRL));
    // Each 16-bit word now holds one byte twice: keep its low nibble in the low byte and its
    // high nibble in the high byte (even element, odd element).
    let idx = _mm256_or_si256(
        _mm256_and_si256(dup, _mm256_set1_epi16(0x000F)),
        _mm256_and_si256(_mm256_srli_epi16::<4>(dup), _mm256_set1_epi16(0x0F00)),
    );
    let hi = _mm256_shuffle_epi8(ld_const(&E2M1_LUT_HI), idx);
    let lo = _mm256_shuffle_epi8(ld_const(&E2M1_LUT_LO), idx);
    let w0 = _mm256_unpacklo_epi8(lo, hi);
    let w1 = _mm256_unpackhi_epi8(lo, hi);
    let z = _mm256_setzero_si256();
    [
        _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w0)),
        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w0)),
        _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w1)),
        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w1)),
    ]
}

/// Decodes 16 packed bytes (broadcast to both lanes) into 32 E2M1 values in the tile-major
/// order [`dot_perm`] describes: vectors 0 and 1 hold elements 0..16 (one fp4-global tile),
/// vectors 2 and 3 elements 16..32.
///
/// Lane 0 looks up the low nibbles (even elements) and lane 1 the high nibbles (odd elements);
/// `unpacklo/hi_epi8` of the two bf16 byte tables give packed bytes 0..8 and 8..16, and the
/// even/odd 16-bit words of each 32-bit lane become two f32 vectors (shift up, or mask). Cheaper
/// than [`e2m1_decode32`] because the dot products permute the query once instead.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e2m1_decode32_tiles(b: __m256i) -> [__m256; 4] {
    let idx = _mm256_and_si256(
        _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
        _mm256_set1_epi8(0x0F),
    );
    let hi = _mm256_shuffle_epi8(ld_const(&E2M1_LUT_HI), idx);
    let lo = _mm256_shuffle_epi8(ld_const(&E2M1_LUT_LO), idx);
    let w0 = _mm256_unpacklo_epi8(lo, hi);
    let w1 = _mm256_unpackhi_epi8(lo, hi);
    let hm = set1_u32(0xFFFF_0000);
    let even = |w| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
    let odd = |w| _mm256_castsi256_ps(_mm256_and_si256(w, hm));
    [even(w0), odd(w0), even(w1), odd(w1)]
}

/// Element index of lane `l` of vector `v` of [`e2m1_decode32_tiles`] applied to packed group
/// `g` (16 bytes, 32 elements): lane half `l / 4` is the nibble (even or odd element), `l % 4`
/// the 32-bit lane `d` holding words `2d` (even vectors) and `2d + 1` (odd vectors), and vectors
/// 2 and 3 take bytes 8..16.
const fn dot_perm<const N: usize>() -> [u16; N] {
    let mut t = [0u16; N];
    let mut i = 0;
    while i < N {
        let (g, v, l) = (i / 32, (i % 32) / 8, i % 8);
        t[i] = (32 * g + 16 * (v / 2) + 4 * (l % 4) + 2 * (v % 2) + l / 4) as u16;
        i += 1;
    }
    t
}
static DOT_PERM_512: [u16; 512] = dot_perm::<512>();
static DOT_PERM_128: [u16; 128] = dot_perm::<128>();

// ---------------------------------------------------------------------------------------------
// Packing and reductions.

/// 32 codes (0..=255) in four i32 vectors to 32 bytes in order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pack_bytes32(c0: __m256i, c1: __m256i, c2: __m256i, c3: __m256i) -> __m256i {
    let ab = _mm256_packus_epi32(c0, c1);
    let cd = _mm256_packus_epi32(c2, c3);
    let b = _mm256_packus_epi16(ab, cd);
    // packs work per 128-bit lane; this puts the 4-byte groups back in order.
    _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// 64 E2M1 codes in eight i32 vectors to 32 packed bytes (even element in the low nibble).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pack_nibbles64(c: &[__m256i; 8]) -> __m256i {
    let [c0, c1, c2, c3, c4, c5, c6, c7] = *c;
    let b0 = pack_bytes32(c0, c1, c2, c3);
    let b1 = pack_bytes32(c4, c5, c6, c7);
    // Unsigned bytes times (1, 16), pairwise summed: even | odd << 4 in each 16-bit word.
    let k = _mm256_set1_epi16(0x1001);
    let w0 = _mm256_maddubs_epi16(b0, k);
    let w1 = _mm256_maddubs_epi16(b1, k);
    _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(w0, w1))
}

/// Lane `t` of the result is the maximum of the lanes of `m[t]` (inputs must not hold NaN).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hmax8x8(m: &[__m256; 8]) -> __m256 {
    let [m0, m1, m2, m3, m4, m5, m6, m7] = *m;
    let pair = |a, b| _mm256_max_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    let quad = |x, y| {
        _mm256_max_ps(
            _mm256_shuffle_ps::<0x44>(x, y),
            _mm256_shuffle_ps::<0xEE>(x, y),
        )
    };
    let y0 = quad(pair(m0, m1), pair(m2, m3));
    let y1 = quad(pair(m4, m5), pair(m6, m7));
    _mm256_max_ps(
        _mm256_permute2f128_ps::<0x20>(y0, y1),
        _mm256_permute2f128_ps::<0x31>(y0, y1),
    )
}

/// Lanes `t` and `t + 4` of the result are the maximum of the lanes of `m[t]` (no NaN inputs).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hmax4x8(m: &[__m256; 4]) -> __m256 {
    let [m0, m1, m2, m3] = *m;
    let pair = |a, b| _mm256_max_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    let (x, y) = (pair(m0, m1), pair(m2, m3));
    let b = _mm256_max_ps(
        _mm256_shuffle_ps::<0x44>(x, y),
        _mm256_shuffle_ps::<0xEE>(x, y),
    );
    _mm256_max_ps(b, _mm256_permute2f128_ps::<0x01>(b, b))
}

/// Sum of the 8 lanes as `((x0 + x2) + (x1 + x3)) + ((x4 + x6) + (x5 + x7))`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let h = _mm256_add_ps(v, _mm256_permute_ps::<0b01_00_11_10>(v));
    let h = _mm256_add_ps(h, _mm256_permute_ps::<0b10_11_00_01>(h));
    let s = _mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    _mm_cvtss_f32(s)
}

/// Running maximum of magnitude bits (NaN included) for the finiteness flag, and the float
/// magnitude for the tile maximum.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn abs_track(x: __m256, raw: &mut __m256i) -> __m256 {
    let a = _mm256_and_si256(_mm256_castps_si256(x), set1_u32(ABS_MASK));
    *raw = _mm256_max_epi32(*raw, a);
    _mm256_castsi256_ps(a)
}

/// Whether every lane of the magnitude-bits maximum is below infinity.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn all_finite(raw: __m256i) -> bool {
    _mm256_movemask_epi8(_mm256_cmpgt_epi32(set1_u32(INF_BITS), raw)) == -1
}

/// `pow2ceil` of spec §5.1/§5.3 on positive lanes: the biased exponent rounded up when the
/// mantissa is non-zero, clamped to 1..=254 (the UE8M0 byte), and the scale's exact reciprocal.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn ue8m0_scale_and_recip(t: __m256) -> (__m256i, __m256) {
    let bits = _mm256_castps_si256(t);
    let exp = _mm256_srli_epi32::<23>(bits);
    let mant_zero = _mm256_cmpeq_epi32(
        _mm256_and_si256(bits, set1_u32(0x007F_FFFF)),
        _mm256_setzero_si256(),
    );
    // exp + 1, minus one again (mask is -1) when the mantissa is zero.
    let e = _mm256_add_epi32(_mm256_add_epi32(exp, set1_u32(1)), mant_zero);
    let e = _mm256_max_epi32(_mm256_min_epi32(e, set1_u32(254)), set1_u32(1));
    // 1 / 2^(e - 127) = 2^(127 - e): biased exponent 254 - e, or the subnormal 2^-127 at e = 254.
    let inv = _mm256_slli_epi32::<23>(_mm256_sub_epi32(set1_u32(254), e));
    let inv = _mm256_blendv_epi8(
        inv,
        set1_u32(0x0040_0000),
        _mm256_cmpeq_epi32(e, set1_u32(254)),
    );
    (e, _mm256_castsi256_ps(inv))
}

// ---------------------------------------------------------------------------------------------
// Quantizers. Each returns whether every input value was finite.

/// Spec §5.1, eight 32-element tiles per step.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_fp8(rows: &[[f32; 512]], out: &mut [WindowFp8Entry]) -> bool {
    let mut raw = _mm256_setzero_si256();
    for (x, e) in rows.iter().zip(out) {
        let xv: &[[[[f32; 8]; 4]; 8]; 2] = transmute_ref!(x);
        let vals: &mut [[[u8; 32]; 8]; 2] = transmute_mut!(&mut e.values);
        let scales: &mut [[u8; 8]; 2] = transmute_mut!(&mut e.scales);
        for ((xg, vg), sg) in xv.iter().zip(vals).zip(scales) {
            let mut m = [_mm256_setzero_ps(); 8];
            for (mt, tile) in m.iter_mut().zip(xg) {
                for v in tile {
                    // NaN-skipping maximum: `max_ps` returns its second operand on NaN.
                    *mt = _mm256_max_ps(abs_track(ld_ps(v), &mut raw), *mt);
                }
            }
            let amax = hmax8x8(&m);
            let t = _mm256_mul_ps(
                _mm256_max_ps(amax, _mm256_set1_ps(1e-4)),
                _mm256_set1_ps(INV_448),
            );
            let (sb, inv) = ue8m0_scale_and_recip(t);
            for (s, b) in sg.iter_mut().zip(to_array_epi32(sb)) {
                *s = b as u8;
            }
            for ((tile, dst), iv) in xg.iter().zip(vg).zip(to_array_ps(inv)) {
                let iv = _mm256_set1_ps(iv);
                let [x0, x1, x2, x3] = tile;
                let c = |v| e4m3_encode(_mm256_mul_ps(ld_ps(v), iv));
                st_si256(dst, pack_bytes32(c(x0), c(x1), c(x2), c(x3)));
            }
        }
    }
    all_finite(raw)
}

/// Spec §5.2, eight 16-element tiles per step.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_fp4(rows: &[[f32; 512]], out: &mut [GlobalFp4Entry]) -> bool {
    let mut raw = _mm256_setzero_si256();
    for (x, e) in rows.iter().zip(out) {
        let xv: &[[[[f32; 8]; 2]; 8]; 4] = transmute_ref!(x);
        let vals: &mut [[[u8; 32]; 2]; 4] = transmute_mut!(&mut e.values);
        let scales: &mut [[u8; 8]; 4] = transmute_mut!(&mut e.scales);
        for ((xg, vg), sg) in xv.iter().zip(vals).zip(scales) {
            let mut m = [_mm256_setzero_ps(); 8];
            for (mt, [x0, x1]) in m.iter_mut().zip(xg) {
                let a0 = _mm256_max_ps(abs_track(ld_ps(x0), &mut raw), _mm256_setzero_ps());
                *mt = _mm256_max_ps(abs_track(ld_ps(x1), &mut raw), a0);
            }
            let amax = hmax8x8(&m);
            // E4M3(clamp(amax / 6, 2^-9, 448)), correctly rounded division (spec §5.2).
            let t = _mm256_div_ps(amax, _mm256_set1_ps(6.0));
            let t = _mm256_min_ps(
                _mm256_max_ps(t, _mm256_set1_ps(E4M3_MIN_SUBNORMAL)),
                _mm256_set1_ps(E4M3_MAX),
            );
            let sb = e4m3_encode(t);
            let s = to_array_ps(e4m3_decode(sb));
            for (d, b) in sg.iter_mut().zip(to_array_epi32(sb)) {
                *d = b as u8;
            }
            let mut codes = [_mm256_setzero_si256(); 16];
            for ((c, [x0, x1]), s) in codes.as_chunks_mut::<2>().0.iter_mut().zip(xg).zip(s) {
                let s = _mm256_set1_ps(s);
                // IEEE division: a rounded reciprocal misplaces exact E2M1 ties (spec §5.2).
                c[0] = e2m1_encode(_mm256_div_ps(ld_ps(x0), s));
                c[1] = e2m1_encode(_mm256_div_ps(ld_ps(x1), s));
            }
            for (dst, c) in vg.iter_mut().zip(codes.as_chunks::<8>().0) {
                st_si256(dst, pack_nibbles64(c));
            }
        }
    }
    all_finite(raw)
}

/// Spec §5.3, one row (four 32-element blocks) per step.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_mxfp4(rows: &[[f32; 128]], out: &mut [IndexMxfp4Entry]) -> bool {
    const FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;
    let mut raw = _mm256_setzero_si256();
    for (x, e) in rows.iter().zip(out) {
        let xv: &[[[f32; 8]; 4]; 4] = transmute_ref!(x);
        let vals: &mut [[u8; 32]; 2] = transmute_mut!(&mut e.values);
        let mut m = [_mm256_setzero_ps(); 4];
        for (mt, tile) in m.iter_mut().zip(xv) {
            for v in tile {
                *mt = _mm256_max_ps(abs_track(ld_ps(v), &mut raw), *mt);
            }
        }
        let amax = hmax4x8(&m);
        let t = _mm256_mul_ps(
            _mm256_max_ps(amax, _mm256_set1_ps(FLOOR)),
            _mm256_set1_ps(INV_6),
        );
        let (sb, inv) = ue8m0_scale_and_recip(t);
        for (d, b) in e.scales.iter_mut().zip(to_array_epi32(sb)) {
            *d = b as u8;
        }
        let mut codes = [_mm256_setzero_si256(); 16];
        for ((c, tile), iv) in codes
            .as_chunks_mut::<4>()
            .0
            .iter_mut()
            .zip(xv)
            .zip(to_array_ps(inv))
        {
            let iv = _mm256_set1_ps(iv);
            for (ci, v) in c.iter_mut().zip(tile) {
                *ci = e2m1_encode(_mm256_mul_ps(ld_ps(v), iv));
            }
        }
        for (dst, c) in vals.iter_mut().zip(codes.as_chunks::<8>().0) {
            st_si256(dst, pack_nibbles64(c));
        }
    }
    all_finite(raw)
}

// ---------------------------------------------------------------------------------------------
// Dequantizers.

#[target_feature(enable = "avx2,fma")]
pub(crate) fn dequantize_fp8(entries: &[WindowFp8Entry], out: &mut [[f32; 512]]) {
    for (e, y) in entries.iter().zip(out) {
        let vals: &[[[u8; 8]; 4]; 16] = transmute_ref!(&e.values);
        let ys: &mut [[[f32; 8]; 4]; 16] = transmute_mut!(y);
        for ((v, &sb), yt) in vals.iter().zip(&e.scales).zip(ys) {
            let s = _mm256_set1_ps(ue8m0_to_f32(sb));
            for (c, o) in v.iter().zip(yt) {
                st_ps(o, _mm256_mul_ps(e4m3_decode(ld_u8x8(c)), s));
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn dequantize_fp4(entries: &[GlobalFp4Entry], out: &mut [[f32; 512]]) {
    for (e, y) in entries.iter().zip(out) {
        let sc: &[[u8; 8]; 4] = transmute_ref!(&e.scales);
        let mut s = [[0f32; 8]; 4];
        for (d, c) in s.iter_mut().zip(sc) {
            st_ps(d, e4m3_decode(ld_u8x8(c)));
        }
        let s: &[[f32; 2]; 16] = transmute_ref!(&s);
        let vals: &[[u8; 16]; 16] = transmute_ref!(&e.values);
        let ys: &mut [[[f32; 8]; 4]; 16] = transmute_mut!(y);
        for ((v, [sa, sb]), [y0, y1, y2, y3]) in vals.iter().zip(s).zip(ys) {
            let [f0, f1, f2, f3] = e2m1_decode32(ld_bcast128(v));
            let (sa, sb) = (_mm256_set1_ps(*sa), _mm256_set1_ps(*sb));
            st_ps(y0, _mm256_mul_ps(f0, sa));
            st_ps(y1, _mm256_mul_ps(f1, sa));
            st_ps(y2, _mm256_mul_ps(f2, sb));
            st_ps(y3, _mm256_mul_ps(f3, sb));
        }
    }
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn dequantize_mxfp4(entries: &[IndexMxfp4Entry], out: &mut [[f32; 128]]) {
    for (e, y) in entries.iter().zip(out) {
        let vals: &[[u8; 16]; 4] = transmute_ref!(&e.values);
        let ys: &mut [[[f32; 8]; 4]; 4] = transmute_mut!(y);
        for ((v, &sb), yt) in vals.iter().zip(&e.scales).zip(ys) {
            let s = _mm256_set1_ps(ue8m0_to_f32(sb));
            for (f, o) in e2m1_decode32(ld_bcast128(v)).into_iter().zip(yt) {
                st_ps(o, _mm256_mul_ps(f, s));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products.

/// `q_i * e2m1_i` summed per tile for one decoded group: `(x0 q0 + x1 q1, x2 q2 + x3 q3)`,
/// the first 16 and the last 16 elements of the group.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn tile_products(x: &[__m256; 4], q: &[[f32; 8]; 4]) -> (__m256, __m256) {
    let a = _mm256_fmadd_ps(x[1], ld_ps(&q[1]), _mm256_mul_ps(x[0], ld_ps(&q[0])));
    let b = _mm256_fmadd_ps(x[3], ld_ps(&q[3]), _mm256_mul_ps(x[2], ld_ps(&q[2])));
    (a, b)
}

/// Lane `t` of the result is the sum of the lanes of `v[t]`, each summed in the same order as
/// [`hsum`] (so a batch reduced here equals single entries reduced there, bit for bit).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum8x8(v: &[__m256; 8]) -> __m256 {
    let [v0, v1, v2, v3, v4, v5, v6, v7] = *v;
    let pair = |a, b| _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    let quad = |x, y| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0x44>(x, y),
            _mm256_shuffle_ps::<0xEE>(x, y),
        )
    };
    let y0 = quad(pair(v0, v1), pair(v2, v3));
    let y1 = quad(pair(v4, v5), pair(v6, v7));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(y0, y1),
        _mm256_permute2f128_ps::<0x31>(y0, y1),
    )
}

/// How far ahead of the current batch of entries the dot products prefetch, in bytes.
const PREFETCH_AHEAD: usize = 4096;

/// A 32-byte aligned `[f32; N]`, so that no vector load of it splits a cache line.
#[repr(C, align(32))]
struct Aligned<const N: usize>([f32; N]);

impl<const N: usize> Aligned<N> {
    /// `q` permuted into the order [`e2m1_decode32_tiles`] produces values in.
    #[inline]
    fn permuted(q: &[f32; N], perm: &[u16; N]) -> Self {
        let mut p = Aligned([0f32; N]);
        for (d, &i) in p.0.iter_mut().zip(perm) {
            *d = q[usize::from(i)];
        }
        p
    }
}

/// One FP4 entry against a permuted query, before the final [`hsum`].
///
/// Per 16-element tile, `(x0 q0 + x1 q1)` (see [`tile_products`]) is multiplied by the tile's
/// scale (a broadcast of the decoded scale) into one of four accumulators, by tile index mod 4;
/// they are added as `(a0 + a1) + (a2 + a3)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot_fp4_acc(qp: &[[[f32; 8]; 4]; 16], e: &GlobalFp4Entry) -> __m256 {
    let sc: &[[u8; 8]; 4] = transmute_ref!(&e.scales);
    let mut s = Aligned([0f32; 32]);
    for (d, c) in s.0.as_chunks_mut::<8>().0.iter_mut().zip(sc) {
        st_ps(d, e4m3_decode(ld_u8x8(c)));
    }
    let s: &[[f32; 4]; 8] = transmute_ref!(&s.0);
    let vals: &[[[u8; 16]; 2]; 8] = transmute_ref!(&e.values);
    let qp: &[[[[f32; 8]; 4]; 2]; 8] = transmute_ref!(qp);
    let mut acc = [_mm256_setzero_ps(); 4];
    for ((v2, q2), s4) in vals.iter().zip(qp).zip(s) {
        let (t0, t1) = tile_products(&e2m1_decode32_tiles(ld_bcast128(&v2[0])), &q2[0]);
        let (t2, t3) = tile_products(&e2m1_decode32_tiles(ld_bcast128(&v2[1])), &q2[1]);
        for ((a, t), &sc) in acc.iter_mut().zip([t0, t1, t2, t3]).zip(s4) {
            *a = _mm256_fmadd_ps(t, _mm256_set1_ps(sc), *a);
        }
    }
    let [a0, a1, a2, a3] = acc;
    _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn dot_fp4(q: &[f32; 512], entries: &[GlobalFp4Entry], out: &mut [f32]) {
    let qp = Aligned::permuted(q, &DOT_PERM_512);
    let qp: &[[[f32; 8]; 4]; 16] = transmute_ref!(&qp.0);
    let (e8, e_rest) = entries.as_chunks::<8>();
    let (o8, o_rest) = out.as_chunks_mut::<8>();
    for (e, o) in e8.iter().zip(o8) {
        let mut v = [_mm256_setzero_ps(); 8];
        for (v, e) in v.iter_mut().zip(e) {
            // One entry's lines per entry scored: spread out, the requests never queue up
            // behind each other in the fill buffers.
            prefetch_ahead(std::slice::from_ref(e), PREFETCH_AHEAD, size_of_val(e));
            *v = dot_fp4_acc(qp, e);
        }
        st_ps(o, hsum8x8(&v));
    }
    for (e, o) in e_rest.iter().zip(o_rest) {
        *o = hsum(dot_fp4_acc(qp, e));
    }
}

/// One MXFP4 entry against a permuted f32 query, before the final [`hsum`]: per 32-element
/// block, `(x0 q0 + x1 q1) + (x2 q2 + x3 q3)` times the block's scale into one of two
/// accumulators (block index mod 2), then their sum.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot_mxfp4_acc(qp: &[[[f32; 8]; 4]; 4], e: &IndexMxfp4Entry) -> __m256 {
    let vals: &[[[u8; 16]; 2]; 2] = transmute_ref!(&e.values);
    let qp: &[[[[f32; 8]; 4]; 2]; 2] = transmute_ref!(qp);
    let s: &[[u8; 2]; 2] = transmute_ref!(&e.scales);
    let mut acc = [_mm256_setzero_ps(); 2];
    for ((v2, q2), s2) in vals.iter().zip(qp).zip(s) {
        for (((v, q), &sb), a) in v2.iter().zip(q2).zip(s2).zip(&mut acc) {
            let (t0, t1) = tile_products(&e2m1_decode32_tiles(ld_bcast128(v)), q);
            let sc = _mm256_set1_ps(ue8m0_to_f32(sb));
            *a = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), sc, *a);
        }
    }
    let [a0, a1] = acc;
    _mm256_add_ps(a0, a1)
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn dot_mxfp4(q: &[f32; 128], entries: &[IndexMxfp4Entry], out: &mut [f32]) {
    let qp = Aligned::permuted(q, &DOT_PERM_128);
    let qp: &[[[f32; 8]; 4]; 4] = transmute_ref!(&qp.0);
    let (e8, e_rest) = entries.as_chunks::<8>();
    let (o8, o_rest) = out.as_chunks_mut::<8>();
    for (e, o) in e8.iter().zip(o8) {
        let mut v = [_mm256_setzero_ps(); 8];
        for (v, e) in v.iter_mut().zip(e) {
            prefetch_ahead(std::slice::from_ref(e), PREFETCH_AHEAD, size_of_val(e));
            *v = dot_mxfp4_acc(qp, e);
        }
        st_ps(o, hsum8x8(&v));
    }
    for (e, o) in e_rest.iter().zip(o_rest) {
        *o = hsum(dot_mxfp4_acc(qp, e));
    }
}

/// An MXFP4 query prepared for integer dots: per 32-byte chunk, `|2 q|` and `2 q` as i8 for the
/// low nibbles (even elements) and the high nibbles (odd elements), and per block the f64
/// exponent bias `eq + 1023 - 256` and whether the scale byte is the MX NaN.
#[derive(Clone, Copy)]
struct MxQuery {
    abs: [[__m256i; 2]; 2],
    val: [[__m256i; 2]; 2],
    exp: __m256i,
    nan: __m256i,
}

/// `2 * e2m1` as i8 for the low and the high nibbles of 32 packed bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e2m1_x2_nibbles(p: __m256i) -> [__m256i; 2] {
    let m = _mm256_set1_epi8(0x0F);
    let lut = ld_const(&E2M1_X2_LUT);
    [
        _mm256_shuffle_epi8(lut, _mm256_and_si256(p, m)),
        _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(p), m)),
    ]
}

/// The four scale bytes zero-extended to i64 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn scales_epi64(s: &[u8; 4]) -> __m256i {
    _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(i32::from_le_bytes(*s)))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn mx_query(q: &IndexMxfp4Entry) -> MxQuery {
    let vals: &[[u8; 32]; 2] = transmute_ref!(&q.values);
    let qs = scales_epi64(&q.scales);
    let mut mq = MxQuery {
        abs: [[_mm256_setzero_si256(); 2]; 2],
        val: [[_mm256_setzero_si256(); 2]; 2],
        exp: _mm256_add_epi64(qs, _mm256_set1_epi64x(1023 - 256)),
        nan: _mm256_cmpeq_epi64(qs, _mm256_set1_epi64x(255)),
    };
    for ((v, a), s) in vals.iter().zip(&mut mq.abs).zip(&mut mq.val) {
        *s = e2m1_x2_nibbles(ld_si256(v));
        *a = [_mm256_abs_epi8(s[0]), _mm256_abs_epi8(s[1])];
    }
    mq
}

/// Exact MXFP4 x MXFP4 dot of one key: `maddubs(|2q|, sign(2k, 2q))` gives exact i16 pair sums
/// (at most 2 * 144), `madd` with ones widens them to i32; lanes 0..4 of chunk c belong to block
/// 2c and lanes 4..8 to block 2c + 1. The combine is `scalar::combine_mxfp4_blocks` in f64
/// lanes: `t_b = I_b * 2^(eq + ek - 256)` (exact), `(t0 + t1) + (t2 + t3)`, rounded once to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot_mxfp4_mxfp4_entry(q: &MxQuery, k: &IndexMxfp4Entry) -> f32 {
    let vals: &[[u8; 32]; 2] = transmute_ref!(&k.values);
    let ones = _mm256_set1_epi16(1);
    let mut s32 = [_mm256_setzero_si256(); 2];
    for (((v, a), qv), s) in vals.iter().zip(&q.abs).zip(&q.val).zip(&mut s32) {
        let [klo, khi] = e2m1_x2_nibbles(ld_si256(v));
        let plo = _mm256_maddubs_epi16(a[0], _mm256_sign_epi8(klo, qv[0]));
        let phi = _mm256_maddubs_epi16(a[1], _mm256_sign_epi8(khi, qv[1]));
        *s = _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones);
    }
    let [s0, s1] = s32;
    // [b0, b0, b2, b2 | b1, b1, b3, b3] partials, then [b0, b2, .. | b1, b3, ..], then in order.
    let h = _mm256_hadd_epi32(s0, s1);
    let h = _mm256_hadd_epi32(h, h);
    let isum = _mm_unpacklo_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let ks = scales_epi64(&k.scales);
    let pow = _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(ks, q.exp)));
    let nan = _mm256_or_si256(q.nan, _mm256_cmpeq_epi64(ks, _mm256_set1_epi64x(255)));
    let pow = _mm256_blendv_pd(pow, _mm256_set1_pd(f64::NAN), _mm256_castsi256_pd(nan));
    let t = _mm256_mul_pd(_mm256_cvtepi32_pd(isum), pow);
    let h = _mm256_hadd_pd(t, t);
    let sum = _mm_add_sd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd::<1>(h));
    _mm_cvtss_f32(_mm_cvtsd_ss(_mm_setzero_ps(), sum))
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn dot_mxfp4_mxfp4(q: &IndexMxfp4Entry, keys: &[IndexMxfp4Entry], out: &mut [f32]) {
    let mq = mx_query(q);
    let (k8, k_rest) = keys.as_chunks::<8>();
    let (o8, o_rest) = out.as_chunks_mut::<8>();
    for (k, o) in k8.iter().zip(o8) {
        for (k, o) in k.iter().zip(o) {
            prefetch_ahead(std::slice::from_ref(k), PREFETCH_AHEAD, size_of_val(k));
            *o = dot_mxfp4_mxfp4_entry(&mq, k);
        }
    }
    for (k, o) in k_rest.iter().zip(o_rest) {
        *o = dot_mxfp4_mxfp4_entry(&mq, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scalar::tests::probe_bits;
    use kvstack_firmware_interface::element::{
        e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32,
    };

    fn have_avx2() -> bool {
        crate::SimdLevel::Avx2.is_available()
    }

    #[test]
    fn element_encoders_match_reference() {
        if !have_avx2() {
            return;
        }
        let bits = probe_bits();
        for chunk in bits.chunks_exact(8) {
            let x: [f32; 8] = std::array::from_fn(|i| f32::from_bits(chunk[i]));
            // SAFETY: AVX2 and FMA were detected above.
            let (c8, c4) = unsafe { encode_both(&x) };
            for i in 0..8 {
                assert_eq!(c8[i] as u8, e4m3_from_f32(x[i]), "e4m3 {:#010x}", chunk[i]);
                assert_eq!(c4[i] as u8, e2m1_from_f32(x[i]), "e2m1 {:#010x}", chunk[i]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn encode_both(x: &[f32; 8]) -> ([i32; 8], [i32; 8]) {
        let v = ld_ps(x);
        (
            to_array_epi32(e4m3_encode(v)),
            to_array_epi32(e2m1_encode(v)),
        )
    }

    #[target_feature(enable = "avx2,fma")]
    fn decode_all() -> ([f32; 256], [f32; 32]) {
        let mut e4 = [0f32; 256];
        let codes: [u8; 256] = std::array::from_fn(|i| i as u8);
        for (o, c) in e4
            .as_chunks_mut::<8>()
            .0
            .iter_mut()
            .zip(codes.as_chunks::<8>().0)
        {
            st_ps(o, e4m3_decode(ld_u8x8(c)));
        }
        // Packed bytes 0x10 * hi + lo for all 16 x 16 code pairs would be 256 bytes; 16 bytes
        // with pairs (i, 15 - i) cover every code in both nibble positions.
        let packed: [u8; 16] = std::array::from_fn(|i| (i as u8) | ((15 - i as u8) << 4));
        let mut e2 = [[0f32; 8]; 4];
        for (o, v) in e2.iter_mut().zip(e2m1_decode32(ld_bcast128(&packed))) {
            st_ps(o, v);
        }
        (e4, *transmute_ref!(&e2))
    }

    #[test]
    fn element_decoders_match_reference() {
        if !have_avx2() {
            return;
        }
        // SAFETY: AVX2 and FMA were detected above.
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

    #[test]
    fn dot_perm_is_a_permutation() {
        // Group 0, vector 1 (odd words of the low bytes), lane 5 (odd nibble, 32-bit lane 1):
        // packed byte 3's high nibble, element 7.
        assert_eq!(DOT_PERM_512[8 + 5], 7);
        let mut seen = [false; 512];
        for &i in DOT_PERM_512.iter() {
            assert!(!seen[usize::from(i)]);
            seen[usize::from(i)] = true;
        }
        assert_eq!(&DOT_PERM_512[..128], &DOT_PERM_128[..]);
    }
}
