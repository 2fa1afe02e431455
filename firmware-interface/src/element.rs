//! Scalar element codecs: E2M1 (FP4), E4M3 "fn" (FP8) and UE8M0 (power-of-two scale), spec §5.
//!
//! These are the reference conversions every fast path in `kvstack-kernels` is tested against.
//! They are written for clarity and exactness, not speed.

/// Largest finite E4M3 "fn" magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest positive E4M3 value (a subnormal): 2^-9.
pub const E4M3_MIN_SUBNORMAL: f32 = 1.0 / 512.0;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// The eight non-negative E2M1 magnitudes, indexed by the low three bits of a code (spec §5).
pub const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Twice every E2M1 code's value, as an exact `i8`, indexed by the 4-bit code (bit 3 = sign).
///
/// Fast dot products multiply these in integer arithmetic: `2 * e2m1` is always an integer in
/// `-12..=12`.
pub const E2M1_TIMES_TWO_I8: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Every E2M1 code decoded to `f32` (index = 4-bit code). Code 0x8 is negative zero.
pub const E2M1_TO_F32: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Encodes one value as E2M1: round to nearest, ties to even code, saturating at +-6.
///
/// The sign is always kept, so negative values that round to zero give code 0x8 (negative
/// zero), as `ml_dtypes` does. NaN is not representable; this function maps it to +0
/// (callers that must not see NaN check for it first).
#[inline]
pub fn e2m1_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x8 } else { 0x0 };
    let a = x.abs();
    // Midpoints between neighbouring magnitudes; at a tie the even code wins, which means the
    // comparison is `<=` below midpoints whose lower neighbour has an even code and `<` else.
    let code = if a.is_nan() || a <= 0.25 {
        0 // 0.25 ties to 0 (code 0, even)
    } else if a < 0.75 {
        1 // 0.75 ties to 1.0 (code 2)
    } else if a <= 1.25 {
        2 // 1.25 ties to 1.0 (code 2)
    } else if a < 1.75 {
        3 // 1.75 ties to 2.0 (code 4)
    } else if a <= 2.5 {
        4 // 2.5 ties to 2.0 (code 4)
    } else if a < 3.5 {
        5 // 3.5 ties to 4.0 (code 6)
    } else if a <= 5.0 {
        6 // 5.0 ties to 4.0 (code 6)
    } else {
        7 // everything above 5, including +inf, saturates to 6
    };
    if a.is_nan() { 0 } else { sign | code }
}

/// Decodes a 4-bit E2M1 code (the high nibble of `code` is ignored).
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_TO_F32[usize::from(code & 0x0F)]
}

/// Encodes one value as E4M3 "fn": round to nearest even, saturating at +-448.
///
/// Finite values beyond 448 (and infinities) saturate to +-448 rather than becoming NaN: every
/// caller in spec §5 clamps first, so saturation only matters for misuse, where it is the safe
/// choice. NaN maps to the canonical NaN code 0x7F (with the input's sign).
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0x00 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    let code: u8 = if a < 1.0 / 64.0 {
        // Subnormal range (below 2^-6): multiples of 2^-9. `a * 512` is exact (power-of-two
        // scaling of a value far from the f32 limits), so one RNE rounding gives the code.
        // A result of 8 is the smallest normal, whose code is also 8 (exponent 1, mantissa 0).
        (a * 512.0).round_ties_even() as u8
    } else if a >= E4M3_MAX {
        0x7E
    } else {
        // Normal range: keep 3 of f32's 23 mantissa bits with round-to-nearest-even on the bit
        // pattern; a carry out of the mantissa correctly bumps the exponent.
        let bits = a.to_bits();
        let lsb = (bits >> 20) & 1;
        let rounded = (bits + 0x7FFFF + lsb) >> 20;
        // Rebias the exponent from 127 to 7: subtract (127 - 7) << 3 from (exp << 3 | mant).
        let c = rounded - ((127 - 7) << 3);
        // Rounding can carry up to 480 (code 0x7F), which E4M3fn lacks: saturate.
        c.min(0x7E) as u8
    };
    sign | code
}

/// Every E4M3 "fn" code decoded to `f32`; 0x7F and 0xFF are NaN.
pub static E4M3_TO_F32: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_decode_const(i as u8);
        i += 1;
    }
    t
}

const fn e4m3_decode_const(code: u8) -> f32 {
    let negative = code & 0x80 != 0;
    let exp = ((code >> 3) & 0x0F) as u32;
    let mant = (code & 0x07) as u32;
    let bits = if exp == 0x0F && mant == 0x07 {
        0x7FC0_0000 // NaN
    } else if exp == 0 {
        if mant == 0 {
            0
        } else {
            // Subnormal: mant * 2^-9. Normalise into an f32 bit pattern: the leading one of
            // `mant` sits at bit p (0..=2), so the value is 2^(p-9) * (1 + rest / 2^p).
            let p = 31 - mant.leading_zeros();
            let rest = mant & !(1 << p);
            let f32_exp = (p + 127) - 9;
            (f32_exp << 23) | (rest << (23 - p))
        }
    } else {
        ((exp + 127 - 7) << 23) | (mant << 20)
    };
    let bits = if negative { bits | 0x8000_0000 } else { bits };
    f32::from_bits(bits)
}

/// Decodes an E4M3 "fn" byte.
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TO_F32[usize::from(code)]
}

/// Decodes a UE8M0 scale byte `e` to `2^(e - 127)`.
///
/// Byte 0 is `2^-127` (an f32 subnormal); byte 255 is the OCP MX NaN encoding. kvstack's
/// quantizers never produce either (spec §5.1 and §5.3 bound the scales well inside).
#[inline]
pub fn ue8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        _ => f32::from_bits(u32::from(e) << 23),
    }
}

/// Rounds a positive normal `f32` up to a power of two from its bits: keep the exponent if the
/// mantissa is zero, else add one (spec §5.1). Returns the power of two's biased exponent, which
/// is exactly its UE8M0 byte.
///
/// Inputs outside the positive normal range are not produced by the spec's formulas (they clamp
/// first); for them the result saturates to the byte range `1..=254`.
#[inline]
pub fn pow2ceil_exponent(x: f32) -> u8 {
    let bits = x.to_bits();
    let exp = (bits >> 23) & 0xFF;
    let mant = bits & 0x007F_FFFF;
    let e = if mant == 0 { exp } else { exp + 1 };
    e.clamp(1, 254) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent E4M3 rounding: exhaustive search for the nearest code (ties to even code).
    fn e4m3_nearest(x: f32) -> u8 {
        let a = x.abs().min(E4M3_MAX);
        let mut best = 0u8;
        let mut best_err = f64::INFINITY;
        for c in 0u8..=0x7E {
            let err = (f64::from(e4m3_to_f32(c)) - f64::from(a)).abs();
            if err < best_err || (err == best_err && c % 2 == 0) {
                best = c;
                best_err = err;
            }
        }
        best | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn e4m3_table_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x07), 7.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
        assert!(e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn e4m3_encode_roundtrips_every_code() {
        for c in 0u8..=255 {
            if c & 0x7F == 0x7F {
                continue;
            }
            assert_eq!(e4m3_from_f32(e4m3_to_f32(c)), c, "code {c:#04x}");
        }
    }

    #[test]
    fn e4m3_encode_matches_nearest_search_on_midpoints_and_neighbours() {
        for c in 0u8..0x7E {
            let lo = e4m3_to_f32(c);
            let hi = e4m3_to_f32(c + 1);
            let mid = (lo + hi) / 2.0;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                assert_eq!(e4m3_from_f32(x), e4m3_nearest(x), "x = {x:e}");
                assert_eq!(e4m3_from_f32(-x), e4m3_nearest(-x), "x = {:e}", -x);
            }
        }
    }

    #[test]
    fn e4m3_saturates() {
        assert_eq!(e4m3_from_f32(464.0), 0x7E);
        assert_eq!(e4m3_from_f32(1e30), 0x7E);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
    }

    #[test]
    fn e2m1_ties_go_to_even_codes() {
        let cases = [
            (0.25, 0),
            (0.2500001, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.0001, 7),
            (100.0, 7),
            (f32::INFINITY, 7),
        ];
        for (x, code) in cases {
            assert_eq!(e2m1_from_f32(x), code, "x = {x}");
            assert_eq!(e2m1_from_f32(-x), code | 0x8, "x = -{x}");
        }
        assert_eq!(e2m1_from_f32(-0.0), 0x8);
        assert_eq!(e2m1_from_f32(-0.1), 0x8);
    }

    #[test]
    fn e2m1_roundtrips_and_doubles_are_exact() {
        for c in 0u8..16 {
            assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), c);
            assert_eq!(
                f32::from(E2M1_TIMES_TWO_I8[usize::from(c)]),
                2.0 * e2m1_to_f32(c)
            );
        }
    }

    #[test]
    fn ue8m0_and_pow2ceil() {
        assert_eq!(ue8m0_to_f32(127), 1.0);
        assert_eq!(ue8m0_to_f32(128), 2.0);
        assert_eq!(ue8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(pow2ceil_exponent(1.0), 127);
        assert_eq!(pow2ceil_exponent(1.0000001), 128);
        assert_eq!(pow2ceil_exponent(0.75), 127);
        assert_eq!(pow2ceil_exponent(0.5), 126);
    }
}
