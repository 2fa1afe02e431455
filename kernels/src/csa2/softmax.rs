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
        if logit > self.max {
            let scale = (self.max - logit).exp();
            self.denom = self.denom * scale + 1.0;
            for (a, &v) in self.acc.iter_mut().zip(value) {
                *a = *a * scale + v;
            }
            self.max = logit;
        } else {
            let e = (logit - self.max).exp();
            if e == 0.0 {
                return;
            }
            self.denom += e;
            for (a, &v) in self.acc.iter_mut().zip(value) {
                *a += e * v;
            }
        }
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
