//! The compressor of a KV source (spec §4): one compressed entry per `ratio` tokens.
//!
//! - ratio ≥ 2: with `v = wkv(h)` and `z = wgate(h)` per token, each complete group of
//!   `ratio` tokens pools to `pooled[c] = Σ_t v[t, c] · softmax_t(z[t, c])` (a softmax per
//!   channel over the group's tokens; no overlap, no positional bias).
//! - ratio 1: the entry is `wkv(h)` itself.
//!
//! The caller then applies RMSNorm (the compressor's `norm`), RoPE at the group's first
//! position `j · ratio` with the layer's compressed rotation, and FP4 quantization, in that
//! order ([`super::norm`], [`super::rope`], [`super::quant`]). An incomplete trailing group
//! yields no entry; its tokens' projections wait in [`CompressorState`] (the "pending"
//! per-sequence state of spec §6: at most `ratio - 1` tokens).

use super::{Error, check_len};

fn check_group(kv: &[f32], gate: &[f32], ratio: usize, out: &[f32]) -> Result<usize, Error> {
    if ratio == 0 {
        return Err(Error::Param {
            what: "compress ratio",
            reason: "must be at least 1".into(),
        });
    }
    let dim = out.len();
    check_len("compressor kv [ratio, dim]", ratio * dim, kv.len())?;
    check_len("compressor gate [ratio, dim]", ratio * dim, gate.len())?;
    Ok(dim)
}

/// Reference: pools one complete group (`kv`, `gate`: `ratio` token rows of `out.len()`
/// channels), channel by channel: `m = max_t z_t`, `e_t = exp(z_t - m)`, `s = Σ_t e_t`,
/// `out = Σ_t v_t · (e_t / s)`, sums in token order.
pub fn pool_group_ref(
    kv: &[f32],
    gate: &[f32],
    ratio: usize,
    out: &mut [f32],
) -> Result<(), Error> {
    let dim = check_group(kv, gate, ratio, out)?;
    for (c, o) in out.iter_mut().enumerate() {
        let z = |t: usize| gate[t * dim + c];
        let m = (0..ratio).map(z).fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0f32;
        for t in 0..ratio {
            s += (z(t) - m).exp();
        }
        let mut acc = 0f32;
        for t in 0..ratio {
            acc += kv[t * dim + c] * ((z(t) - m).exp() / s);
        }
        *o = acc;
    }
    Ok(())
}

/// Fast: pools `out.len() / dim` consecutive complete groups, channels in the inner loops
/// (contiguous, vectorizable). Same operations in the same order per channel as
/// [`pool_group_ref`], so the results are bit-identical to it.
pub fn pool_groups(
    kv: &[f32],
    gate: &[f32],
    ratio: usize,
    dim: usize,
    out: &mut [f32],
) -> Result<(), Error> {
    if ratio == 0 || dim == 0 || !out.len().is_multiple_of(dim) {
        return Err(Error::Param {
            what: "pool_groups",
            reason: format!("ratio {ratio}, dim {dim}, output of {} values", out.len()),
        });
    }
    let groups = out.len() / dim;
    check_len(
        "compressor kv [groups * ratio, dim]",
        groups * ratio * dim,
        kv.len(),
    )?;
    check_len(
        "compressor gate [groups * ratio, dim]",
        groups * ratio * dim,
        gate.len(),
    )?;
    let g = ratio * dim;
    let mut m = vec![0f32; dim];
    let mut s = vec![0f32; dim];
    for ((v, z), o) in kv
        .chunks_exact(g)
        .zip(gate.chunks_exact(g))
        .zip(out.chunks_exact_mut(dim))
    {
        m.fill(f32::NEG_INFINITY);
        for zt in z.chunks_exact(dim) {
            for (m, &x) in m.iter_mut().zip(zt) {
                *m = m.max(x);
            }
        }
        s.fill(0.0);
        for zt in z.chunks_exact(dim) {
            for ((s, &x), &m) in s.iter_mut().zip(zt).zip(&m) {
                *s += (x - m).exp();
            }
        }
        o.fill(0.0);
        for (vt, zt) in v.chunks_exact(dim).zip(z.chunks_exact(dim)) {
            for ((((o, &v), &x), &m), &s) in o.iter_mut().zip(vt).zip(zt).zip(&m).zip(&s) {
                *o += v * ((x - m).exp() / s);
            }
        }
    }
    Ok(())
}

/// The compressor's pending tokens of one sequence: the `wkv` then `wgate` projections
/// (`2 · dim` f32 per token, the layout of the paged cache's pending state) of the tokens of
/// the incomplete trailing group. Always empty at ratio 1.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressorState {
    ratio: usize,
    dim: usize,
    pending: Vec<f32>,
}

impl CompressorState {
    /// An empty state for `ratio` tokens per entry and `dim`-wide entries.
    pub fn new(ratio: usize, dim: usize) -> Result<CompressorState, Error> {
        if ratio == 0 || dim == 0 {
            return Err(Error::Param {
                what: "compressor",
                reason: format!("ratio {ratio} and dim {dim} must be positive"),
            });
        }
        Ok(CompressorState {
            ratio,
            dim,
            pending: Vec::new(),
        })
    }

    /// A state resumed from stored pending projections ([`CompressorState::pending`]).
    pub fn with_pending(
        ratio: usize,
        dim: usize,
        pending: &[f32],
    ) -> Result<CompressorState, Error> {
        let mut s = CompressorState::new(ratio, dim)?;
        if !pending.len().is_multiple_of(2 * dim) || pending.len() / (2 * dim) >= ratio {
            return Err(Error::Param {
                what: "compressor pending state",
                reason: format!(
                    "{} values are not fewer than {ratio} tokens of 2 x {dim}",
                    pending.len()
                ),
            });
        }
        s.pending.extend_from_slice(pending);
        Ok(s)
    }

    /// The pending projections (`kv` then `gate` per token).
    pub fn pending(&self) -> &[f32] {
        &self.pending
    }

    /// Tokens waiting for their group to complete.
    pub fn pending_tokens(&self) -> usize {
        self.pending.len() / (2 * self.dim)
    }

    /// Feeds the projections of `n` new tokens (`kv`, `gate`: `[n, dim]`; `gate` is ignored
    /// at ratio 1 and required above) and appends the pooled row of every group that
    /// completes to `pooled`. Returns the number of completed groups.
    pub fn push(
        &mut self,
        kv: &[f32],
        gate: Option<&[f32]>,
        pooled: &mut Vec<f32>,
    ) -> Result<usize, Error> {
        let d = self.dim;
        if !kv.len().is_multiple_of(d) {
            return Err(Error::Param {
                what: "compressor kv",
                reason: format!("{} values are not whole rows of {d}", kv.len()),
            });
        }
        let n = kv.len() / d;
        if self.ratio == 1 {
            pooled.extend_from_slice(kv);
            return Ok(n);
        }
        let Some(gate) = gate else {
            return Err(Error::Param {
                what: "compressor gate",
                reason: format!("ratio {} needs the wgate projections", self.ratio),
            });
        };
        check_len("compressor gate [n, dim]", kv.len(), gate.len())?;
        let mut groups = 0;
        let mut gkv = vec![0f32; self.ratio * d];
        let mut ggate = vec![0f32; self.ratio * d];
        let mut out = vec![0f32; d];
        for (v, z) in kv.chunks_exact(d).zip(gate.chunks_exact(d)) {
            self.pending.extend_from_slice(v);
            self.pending.extend_from_slice(z);
            if self.pending_tokens() == self.ratio {
                for (t, tok) in self.pending.chunks_exact(2 * d).enumerate() {
                    gkv[t * d..(t + 1) * d].copy_from_slice(&tok[..d]);
                    ggate[t * d..(t + 1) * d].copy_from_slice(&tok[d..]);
                }
                pool_groups(&gkv, &ggate, self.ratio, d, &mut out)?;
                pooled.extend_from_slice(&out);
                self.pending.clear();
                groups += 1;
            }
        }
        Ok(groups)
    }
}
