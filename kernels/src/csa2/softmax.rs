//! Softmax with a per-head sink logit (spec §4 core attention).
//!
//! The sink is an extra column with logit `sink_h` (not scaled) and value zero: it only adds
//! `exp(sink_h - m)` to the denominator. Masked keys have logit `-inf` and weight zero.
//!
//! - [`softmax_with_sink_ref`]: the two-pass form of the reference (max over all columns
//!   including the sink, exponentials, sum, divide).
//! - [`OnlineSoftmax`]: the one-pass (streaming) form the fast attention uses to accumulate
//!   `Σ_i p_i v_i` while each key is decoded only once. It rescales its running sums when a
//!   larger logit arrives, so it differs from the two-pass form only by rounding (tested).

use super::{Error, check_len};

/// Below this, [`exp_nonpositive`] is 0 (`e^-87` is about `1.6e-38`, near the smallest
/// normal f32): a weight that small is lost against the running maximum's, which is 1.
pub(crate) const EXP_FLOOR: f32 = -87.0;

/// `ln 2` split for [`exp_nonpositive`]'s argument reduction (fdlibm's `ln2_hi`, about
/// 0.6931471803691, whose low 21 bits are zero so that `n · LN2_HI` is exact, and `ln2_lo`,
/// about 1.9082149e-10).
pub(crate) const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
/// `ln 2 - LN2_HI`.
pub(crate) const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// `1/k!` for `k = 10, 9, .., 2`, then `1`, `1`: the Taylor polynomial of `e^r` in Horner
/// order (truncation below `3e-13` relative for `|r| <= ln 2 / 2`).
pub(crate) const EXP_POLY: [f64; 11] = [
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `e^x` for `x <= 0` (0 below -87 and for NaN), the exponential of the fast attention's
/// softmax, by one fixed sequence of IEEE operations in f64: `n = round_even(x · log2 e)`,
/// `r = x - n · ln 2` in two fused steps (`LN2_HI`, `LN2_LO`), the degree-10 Taylor
/// polynomial (`EXP_POLY`) in Horner form with fused multiply-adds, times `2^n` (exact),
/// rounded once to f32. The f64 result is within `1e-12` of `e^x`, so the f32 is the correctly
/// rounded `e^x` but for values within that distance of a rounding tie (as a good libm
/// `expf`); unlike a libm, each step is one correctly rounded operation, so the SIMD kernels'
/// vector form of the same steps gives the same bits on every CPU. `exp_nonpositive(0) == 1`.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    // Below the floor, and NaN (incomparable), give 0.
    if x.partial_cmp(&EXP_FLOOR).is_none_or(|o| o.is_lt()) {
        return 0.0;
    }
    let x = f64::from(x);
    let n = (x * std::f64::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    // `x` in [-87, 0]: `n` in [-126, 0], `2^n` a normal f64 and the product exact.
    (p * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

/// The argument of the exponential [`OnlineSoftmax::advance`] takes for `logit` when the
/// running maximum is `max` (`max - logit` for a new maximum, else `logit - max`; never
/// positive), and whether `logit` is a new maximum. A kernel computes the exponentials of
/// several keys at once from these (running the maximum ahead from [`OnlineSoftmax::max`]) and
/// hands each to [`OnlineSoftmax::advance_with`].
#[inline(always)]
pub(crate) fn exp_argument(max: f32, logit: f32) -> (f32, bool) {
    if logit > max {
        (max - logit, true)
    } else {
        (logit - max, false)
    }
}

/// Reference: `out[i] = exp(l_i - m) / (Σ_j exp(l_j - m) + exp(sink - m))` with
/// `m = max(max_j l_j, sink)`, summing in column order with the sink last.
pub fn softmax_with_sink_ref(logits: &[f32], sink: f32, out: &mut [f32]) -> Result<(), Error> {
    check_len("softmax output", logits.len(), out.len())?;
    let m = logits.iter().fold(sink, |m, &l| m.max(l));
    let mut sum = 0f32;
    for (o, &l) in out.iter_mut().zip(logits) {
        *o = (l - m).exp();
        sum += *o;
    }
    sum += (sink - m).exp();
    for o in out.iter_mut() {
        *o /= sum;
    }
    Ok(())
}

/// What one [`OnlineSoftmax::push`] does to each accumulator element `a` with the value `v`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum PushStep {
    /// A new maximum: `a = a * scale + v` (multiply, then add).
    Rescale(f32),
    /// `a = a + e * v` (multiply, then add).
    Accumulate(f32),
    /// The weight underflowed to zero (or the key is masked): nothing.
    Skip,
}

/// Streaming softmax-weighted sum of value rows, started from the sink column.
#[derive(Clone, Debug)]
pub struct OnlineSoftmax {
    max: f32,
    denom: f32,
    acc: crate::aligned::AlignedF32,
}

impl OnlineSoftmax {
    /// An accumulator for `dim`-wide values whose first column is the sink (logit `sink`,
    /// value zero).
    pub fn new(dim: usize, sink: f32) -> OnlineSoftmax {
        OnlineSoftmax {
            max: sink,
            denom: 1.0,
            acc: crate::aligned::AlignedF32::zeroed(dim),
        }
    }

    /// Restarts with a new sink, keeping the allocation.
    pub fn reset(&mut self, sink: f32) {
        self.max = sink;
        self.denom = 1.0;
        self.acc.as_mut_slice().fill(0.0);
    }

    /// Adds a column with `logit` and `value` (`value.len()` is the accumulator's width).
    /// A `-inf` logit (a masked key) contributes nothing.
    #[inline(always)]
    pub fn push(&mut self, logit: f32, value: &[f32]) {
        match self.advance(logit) {
            PushStep::Rescale(scale) => {
                for (a, &v) in self.acc.as_mut_slice().iter_mut().zip(value) {
                    *a = a.mul_add(scale, v);
                }
            }
            PushStep::Accumulate(e) => {
                for (a, &v) in self.acc.as_mut_slice().iter_mut().zip(value) {
                    *a = e.mul_add(v, *a);
                }
            }
            PushStep::Skip => {}
        }
    }

    /// The scalar half of [`OnlineSoftmax::push`]: updates the running maximum and
    /// denominator for a column with `logit` and says what the push does to each accumulator
    /// element, so that SIMD kernels can apply several columns' updates in one pass over the
    /// accumulator (per element the same operations in the same order, so the same bits).
    #[inline(always)]
    pub(crate) fn advance(&mut self, logit: f32) -> PushStep {
        let (x, new_max) = exp_argument(self.max, logit);
        self.advance_with(logit, new_max, exp_nonpositive(x))
    }

    /// The running maximum (the sink's logit at the start).
    #[inline(always)]
    pub(crate) fn max(&self) -> f32 {
        self.max
    }

    /// [`OnlineSoftmax::advance`] with its exponential `e = exp_nonpositive(x)` computed by
    /// the caller (`x`, `new_max` from [`exp_argument`] with this state's maximum).
    #[inline(always)]
    pub(crate) fn advance_with(&mut self, logit: f32, new_max: bool, e: f32) -> PushStep {
        if new_max {
            self.denom = self.denom * e + 1.0;
            self.max = logit;
            PushStep::Rescale(e)
        } else {
            if e == 0.0 {
                return PushStep::Skip;
            }
            self.denom += e;
            PushStep::Accumulate(e)
        }
    }

    /// [`OnlineSoftmax::advance_with`] for keys that each accumulate with weight `e` (none a
    /// new maximum, no weight zero): the denominator's additions in order.
    #[inline(always)]
    pub(crate) fn accumulate_all(&mut self, es: &[f32]) {
        for &e in es {
            self.denom += e;
        }
    }

    /// The running denominator (tests compare kernels' states).
    #[cfg(test)]
    pub(crate) fn denom(&self) -> f32 {
        self.denom
    }

    /// The running weighted sum `Σ_i w_i v_i` (not yet divided by the denominator), for the
    /// kernels that apply [`OnlineSoftmax::advance`]'s steps themselves.
    pub(crate) fn acc_mut(&mut self) -> &mut [f32] {
        self.acc.as_mut_slice()
    }

    /// Writes `Σ_i p_i v_i` into `out`.
    pub fn finish(&self, out: &mut [f32]) -> Result<(), Error> {
        check_len("online softmax output", self.acc.len(), out.len())?;
        let inv = 1.0 / self.denom;
        for (o, &a) in out.iter_mut().zip(self.acc.as_slice()) {
            *o = a * inv;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_nonpositive_is_the_correctly_rounded_exp() {
        assert_eq!(exp_nonpositive(0.0).to_bits(), 1f32.to_bits());
        assert_eq!(exp_nonpositive(-0.0).to_bits(), 1f32.to_bits());
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
        let (mut points, mut off) = (0u32, 0u32);
        let mut x = 0f32;
        // About 1.5 million points, denser near 0 where attention weights live; the reference
        // is f64's `exp` rounded to f32 (itself within an f64 ulp).
        while x >= EXP_FLOOR {
            let want = (f64::from(x)).exp() as f32;
            let got = exp_nonpositive(x);
            let u = got.to_bits().abs_diff(want.to_bits());
            assert!(u <= 1, "exp({x}) = {got}, want {want} ({u} ulp)");
            off += u;
            points += 1;
            x -= if x > -1.0 {
                1.0 / 65_536.0
            } else {
                1.0 / 16_384.0
            };
        }
        assert!(points > 1_000_000);
        // Near-ties only: none expected at this density, a handful tolerated.
        assert!(off <= points / 100_000, "{off} of {points} off by an ulp");
    }
}
