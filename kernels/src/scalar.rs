//! Branch-free scalar element codecs and helpers shared by every level.
//!
//! These compute exactly what `kvstack_firmware_interface::element` computes, but with selects
//! instead of branches so that LLVM can vectorize loops over them (the portable path), and they
//! spell out the bit tricks the SIMD paths use lane-wise. Unit tests below compare them with the
//! reference on about a million bit patterns each.

/// Mask of the magnitude bits of an `f32`.
pub(crate) const ABS_MASK: u32 = 0x7FFF_FFFF;
/// Bits of `+inf`; magnitudes above it are NaN.
pub(crate) const INF_BITS: u32 = 0x7F80_0000;
/// The canonical quiet NaN the reference tables use.
pub(crate) const QNAN_BITS: u32 = 0x7FC0_0000;
/// `2^23`: adding it to a value in `[0, 2^23)` rounds that value to an integer (nearest, ties
/// to even, the default mode) and leaves the integer in the low mantissa bits.
pub(crate) const MAGIC_RNE: f32 = 8_388_608.0;
/// `2^-6`, the implicit leading one subtracted when decoding E4M3 subnormals.
pub(crate) const E4M3_SUB_BIAS: f32 = f32::from_bits(121 << 23);

/// Largest-magnitude bits of a tile with NaN skipped (the reference `amax`), and the largest
/// magnitude bits with NaN included (above [`INF_BITS`] - 1 means the tile is not all finite).
///
/// For non-negative floats, integer order of the bits is numeric order, so both are integer
/// maxima, which LLVM vectorizes (a float `max` fold it does not).
#[inline(always)]
pub(crate) fn tile_amax(tile: &[f32]) -> (f32, u32) {
    let mut amax = 0u32;
    let mut raw = 0u32;
    for &x in tile {
        let a = x.to_bits() & ABS_MASK;
        raw = raw.max(a);
        amax = amax.max(if a > INF_BITS { 0 } else { a });
    }
    (f32::from_bits(amax), raw)
}

/// E4M3 "fn" encode, equal to `element::e4m3_from_f32` for every input.
///
/// Normal range: round to nearest even on the bit pattern, keeping 3 mantissa bits, with the
/// exponent rebias (`-(127 - 7) << 23`) folded into the same add; saturate at 0x7E (448).
/// Below 2^-6: `RNE(|x| * 512)` via the `2^23` trick. NaN: 0x7F with the input's sign.
#[inline(always)]
pub(crate) fn e4m3_encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & ABS_MASK;
    let lsb = (a >> 20) & 1;
    let normal = (a.wrapping_add(0x7_FFFF + lsb).wrapping_sub(0x3C00_0000) >> 20).min(0x7E);
    let sub = (f32::from_bits(a) * 512.0 + MAGIC_RNE)
        .to_bits()
        .wrapping_sub(MAGIC_RNE.to_bits());
    let code = if a > INF_BITS {
        0x7F
    } else if a < 0x3C80_0000 {
        sub
    } else {
        normal
    };
    (code | ((bits >> 24) & 0x80)) as u8
}

/// E2M1 encode (ties to even code, saturating at 6), equal to `element::e2m1_from_f32` for
/// every input: the same construction as [`e4m3_encode`] with 1 mantissa bit, bias 1, normal
/// range from 1.0, and NaN mapped to +0.
#[inline(always)]
pub(crate) fn e2m1_encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & ABS_MASK;
    let lsb = (a >> 22) & 1;
    let normal = (a.wrapping_add(0x1F_FFFF + lsb).wrapping_sub(0x3F00_0000) >> 22).min(7);
    let sub = (f32::from_bits(a) * 2.0 + MAGIC_RNE)
        .to_bits()
        .wrapping_sub(MAGIC_RNE.to_bits());
    let code = if a < 0x3F80_0000 { sub } else { normal } | ((bits >> 28) & 8);
    if a > INF_BITS { 0 } else { code as u8 }
}

/// E4M3 "fn" decode, bit-identical to `element::e4m3_to_f32` (0x7F and 0xFF are the canonical
/// quiet NaN with the code's sign).
///
/// `o = (code & 0x7F) << 20` puts E4M3's exponent and mantissa into f32's fields. Normal codes
/// only need the exponent rebiased (`+ 120 << 23`). Subnormal codes `M * 2^-9` are built as
/// `(2^-6 + M * 2^-9) - 2^-6` (rebias by one more, then subtract the implicit one), so no
/// operation ever sees an f32 subnormal: x86 cores take a slow microcode assist on those.
#[inline(always)]
pub(crate) fn e4m3_decode(code: u8) -> f32 {
    let c = u32::from(code);
    let o = (c & 0x7F) << 20;
    let normal = o + (120 << 23);
    let sub = (f32::from_bits(o + (121 << 23)) - E4M3_SUB_BIAS).to_bits();
    let mag = if o == 0x7F << 20 {
        QNAN_BITS
    } else if o < 1 << 23 {
        sub
    } else {
        normal
    };
    f32::from_bits(mag | ((c & 0x80) << 24))
}

/// `2^k` as f64 for `k` in `-1022..=1023`.
#[inline(always)]
fn pow2_f64(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// Combines the four exact per-block integer sums of an MXFP4 x MXFP4 dot product.
///
/// `isum[b]` is `sum(2 q_i * 2 k_i)` over block `b`, so the block's value is
/// `isum[b] * 2^(eq + ek - 254) / 4`: an integer of at most 14 bits times a power of two in
/// `2^-256..=2^252`, exact in f64. The four terms are added as `(t0 + t1) + (t2 + t3)` in f64
/// and rounded once to f32; see [`crate::dot_mxfp4_mxfp4`] for when that is exact. A scale byte
/// of 255 (the MX NaN) makes its block, and so the result, NaN.
#[inline(always)]
pub(crate) fn combine_mxfp4_blocks(isum: [i32; 4], qs: &[u8; 4], ks: &[u8; 4]) -> f32 {
    let term = |b: usize| -> f64 {
        if qs[b] == 255 || ks[b] == 255 {
            f64::NAN
        } else {
            f64::from(isum[b]) * pow2_f64(i32::from(qs[b]) + i32::from(ks[b]) - 256)
        }
    };
    ((term(0) + term(1)) + (term(2) + term(3))) as f32
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvstack_firmware_interface::element::{
        e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32,
    };

    /// f32 bit patterns that exercise the encoders: a stride over all 2^32 patterns, every
    /// pattern with zero low 12 bits near the interesting exponents, and +-1 ulp around every
    /// E4M3/E2M1 value and midpoint.
    pub(crate) fn probe_bits() -> Vec<u32> {
        let mut v: Vec<u32> = (0..=u32::MAX).step_by(4099).collect();
        for e in (0x3A00_0000u32..0x4480_0000).step_by(1 << 12) {
            v.push(e);
            v.push(e | 0x8000_0000);
        }
        let mut anchors: Vec<f32> = Vec::new();
        for c in 0u8..0x7F {
            let lo = e4m3_to_f32(c);
            let hi = e4m3_to_f32(c + 1);
            anchors.extend([lo, (lo + hi) / 2.0]);
        }
        for c in 0u8..8 {
            let lo = e2m1_to_f32(c);
            let hi = e2m1_to_f32(c + 1);
            anchors.extend([lo, (lo + hi) / 2.0]);
        }
        for a in anchors {
            for d in [-2i32, -1, 0, 1, 2] {
                let b = a.to_bits().wrapping_add_signed(d);
                v.push(b);
                v.push(b ^ 0x8000_0000);
            }
        }
        v.extend([
            0,
            0x8000_0000,
            INF_BITS,
            INF_BITS | 0x8000_0000,
            QNAN_BITS,
            0xFFC0_0001,
        ]);
        v
    }

    #[test]
    fn encoders_match_reference() {
        for b in probe_bits() {
            let x = f32::from_bits(b);
            assert_eq!(e4m3_encode(x), e4m3_from_f32(x), "e4m3 {b:#010x}");
            assert_eq!(e2m1_encode(x), e2m1_from_f32(x), "e2m1 {b:#010x}");
        }
    }

    #[test]
    fn decoders_match_reference() {
        for c in 0u8..=255 {
            assert_eq!(
                e4m3_decode(c).to_bits(),
                e4m3_to_f32(c).to_bits(),
                "e4m3 {c:#04x}"
            );
        }
    }

    #[test]
    fn amax_skips_nan_and_flags_non_finite() {
        let (m, raw) = tile_amax(&[1.0, -3.0, f32::NAN, 2.0]);
        assert_eq!(m, 3.0);
        assert!(raw > INF_BITS);
        let (m, raw) = tile_amax(&[-0.0, 0.5]);
        assert_eq!(m, 0.5);
        assert!(raw < INF_BITS);
        let (m, _) = tile_amax(&[f32::NEG_INFINITY, 1.0]);
        assert_eq!(m, f32::INFINITY);
    }
}
