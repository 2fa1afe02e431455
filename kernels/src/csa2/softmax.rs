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
    acc: Vec<f32>,
}

impl OnlineSoftmax {
    /// An accumulator for `dim`-wide values whose first column is the sink (logit `sink`,
    /// value zero).
    pub fn new(dim: usize, sink: f32) -> OnlineSoftmax {
        OnlineSoftmax {
            max: sink,
            denom: 1.0,
            acc: vec![0.0; dim],
        }
    }

    /// Restarts with a new sink, keeping the allocation.
    pub fn reset(&mut self, sink: f32) {
        self.max = sink;
        self.denom = 1.0;
        self.acc.fill(0.0);
    }

    /// Adds a column with `logit` and `value` (`value.len()` is the accumulator's width).
    /// A `-inf` logit (a masked key) contributes nothing.
    #[inline(always)]
    pub fn push(&mut self, logit: f32, value: &[f32]) {
        match self.advance(logit) {
            PushStep::Rescale(scale) => {
                for (a, &v) in self.acc.iter_mut().zip(value) {
                    *a = a.mul_add(scale, v);
                }
            }
            PushStep::Accumulate(e) => {
                for (a, &v) in self.acc.iter_mut().zip(value) {
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
        if logit > self.max {
            let scale = (self.max - logit).exp();
            self.denom = self.denom * scale + 1.0;
            self.max = logit;
            PushStep::Rescale(scale)
        } else {
            let e = (logit - self.max).exp();
            if e == 0.0 {
                return PushStep::Skip;
            }
            self.denom += e;
            PushStep::Accumulate(e)
        }
    }

    /// The running weighted sum `Σ_i w_i v_i` (not yet divided by the denominator), for the
    /// kernels that apply [`OnlineSoftmax::advance`]'s steps themselves.
    pub(crate) fn acc_mut(&mut self) -> &mut [f32] {
        &mut self.acc
    }

    /// Writes `Σ_i p_i v_i` into `out`.
    pub fn finish(&self, out: &mut [f32]) -> Result<(), Error> {
        check_len("online softmax output", self.acc.len(), out.len())?;
        let inv = 1.0 / self.denom;
        for (o, &a) in out.iter_mut().zip(&self.acc) {
            *o = a * inv;
        }
        Ok(())
    }
}
