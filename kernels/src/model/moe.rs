//! Mixture of experts (spec §9): the `sqrtsoftplus` router with a selection-only correction
//! bias, renormalized top-k weights times the routed scale, clamped SwiGLU experts and one
//! shared expert.

use crate::csa2::Error;
use crate::linear::PackedLinear;

/// One SwiGLU expert's weights (`nn.Linear` layout, in their stored formats): `w1` gate
/// `[inter, hidden]`, `w3` up `[inter, hidden]`, `w2` down `[hidden, inter]`.
#[derive(Clone, Copy, Debug)]
pub struct Expert<'a> {
    /// Gate projection.
    pub w1: &'a PackedLinear,
    /// Down projection.
    pub w2: &'a PackedLinear,
    /// Up projection.
    pub w3: &'a PackedLinear,
}

/// Checks that `w` is `[n, k]`.
fn check_shape(what: &'static str, w: &PackedLinear, n: usize, k: usize) -> Result<(), Error> {
    if w.n() == n && w.k() == k {
        Ok(())
    } else {
        Err(Error::Param {
            what,
            reason: format!("weight is [{}, {}], expected [{n}, {k}]", w.n(), w.k()),
        })
    }
}

/// Router and expert shapes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeShape {
    /// Hidden size.
    pub hidden: usize,
    /// Expert FFN width (`moe_intermediate_size`).
    pub inter: usize,
    /// Routed experts.
    pub experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// `routed_scaling_factor`.
    pub routed_scale: f32,
    /// `swiglu_limit`: gate clamped above, up clamped both sides.
    pub swiglu_limit: f32,
}

/// The routing decision of one token.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// Selected experts, in descending order of biased score.
    pub experts: Vec<usize>,
    /// Their weights: unbiased scores renormalized over the selection, times the routed scale.
    pub weights: Vec<f32>,
}

/// `sqrt(softplus(z))`, with softplus computed stably.
fn sqrt_softplus(z: f32) -> f32 {
    (z.max(0.0) + (-z.abs()).exp().ln_1p()).sqrt()
}

impl MoeShape {
    /// Routes `tokens` tokens of `x` (`[tokens, hidden]`) with gate `[experts, hidden]` and the
    /// correction `bias` (`[experts]`, used for selection only).
    pub fn route(
        &self,
        x: &[f32],
        gate: &PackedLinear,
        bias: &[f32],
        tokens: usize,
    ) -> Result<Vec<Route>, Error> {
        if bias.len() != self.experts {
            return Err(Error::LengthMismatch {
                what: "router bias [experts]",
                expected: self.experts,
                actual: bias.len(),
            });
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(Error::Param {
                what: "num_experts_per_tok",
                reason: format!("{} is not in 1..={}", self.top_k, self.experts),
            });
        }
        check_shape(
            "router gate [experts, hidden]",
            gate,
            self.experts,
            self.hidden,
        )?;
        let mut logits = vec![0f32; tokens * self.experts];
        gate.forward(x, tokens, &mut logits)?;
        let mut routes = Vec::with_capacity(tokens);
        let mut order: Vec<usize> = (0..self.experts).collect();
        for l in logits.chunks_exact(self.experts) {
            let scores: Vec<f32> = l.iter().map(|&z| sqrt_softplus(z)).collect();
            let biased = |e: usize| scores[e] + bias[e];
            // Highest biased score first; equal scores keep the lower expert id first.
            order.sort_by(|&a, &b| biased(b).total_cmp(&biased(a)).then(a.cmp(&b)));
            let experts: Vec<usize> = order[..self.top_k].to_vec();
            let sum: f32 = experts.iter().map(|&e| scores[e]).sum();
            let weights = experts
                .iter()
                .map(|&e| scores[e] / sum * self.routed_scale)
                .collect();
            routes.push(Route { experts, weights });
        }
        Ok(routes)
    }

    /// `w2 · (silu(min(w1 x, limit)) ⊙ clamp(w3 x, ±limit))` for `tokens` rows of `x`, scaled per
    /// row by `scale[t]` and added into `out` (`[tokens, hidden]`).
    pub fn expert_add(
        &self,
        e: &Expert<'_>,
        x: &[f32],
        tokens: usize,
        scale: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error> {
        let (h, i) = (e.w2.n(), e.w2.k());
        if h != self.hidden {
            return Err(Error::Param {
                what: "expert w2 [hidden, inter]",
                reason: format!("{h} outputs, expected hidden {}", self.hidden),
            });
        }
        check_shape("expert w1 [inter, hidden]", e.w1, i, h)?;
        check_shape("expert w3 [inter, hidden]", e.w3, i, h)?;
        let mut gate = vec![0f32; tokens * i];
        let mut up = vec![0f32; tokens * i];
        e.w1.forward(x, tokens, &mut gate)?;
        e.w3.forward(x, tokens, &mut up)?;
        let lim = self.swiglu_limit;
        for (g, u) in gate.iter_mut().zip(&up) {
            let a = g.min(lim);
            *g = a / (1.0 + (-a).exp()) * u.clamp(-lim, lim);
        }
        let mut y = vec![0f32; tokens * h];
        e.w2.forward(&gate, tokens, &mut y)?;
        if scale.len() != tokens || out.len() != tokens * h {
            return Err(Error::LengthMismatch {
                what: "expert out [tokens, hidden]",
                expected: tokens * h,
                actual: out.len(),
            });
        }
        for ((o, y), &s) in out.chunks_exact_mut(h).zip(y.chunks_exact(h)).zip(scale) {
            o.iter_mut().zip(y).for_each(|(o, &v)| *o += s * v);
        }
        Ok(())
    }

    /// The whole MoE for `tokens` rows of `x`: routed experts (each run once over the tokens
    /// routed to it) plus the shared expert. `experts[e]` are the routed experts' weights.
    pub fn forward(
        &self,
        x: &[f32],
        tokens: usize,
        routes: &[Route],
        experts: &[Expert<'_>],
        shared: &Expert<'_>,
        out: &mut [f32],
    ) -> Result<(), Error> {
        let h = self.hidden;
        if experts.len() != self.experts || routes.len() != tokens || x.len() != tokens * h {
            return Err(Error::LengthMismatch {
                what: "moe experts / routes / x",
                expected: self.experts,
                actual: experts.len(),
            });
        }
        out.fill(0.0);
        self.expert_add(shared, x, tokens, &vec![1.0; tokens], out)?;
        // Gather each expert's tokens so every expert runs one batched product.
        let mut rows: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts];
        for (t, r) in routes.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                if let Some(list) = rows.get_mut(e) {
                    list.push((t, w));
                }
            }
        }
        let mut xs = Vec::new();
        let mut ys = Vec::new();
        for (e, list) in rows.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            xs.clear();
            for &(t, _) in list {
                xs.extend_from_slice(&x[t * h..(t + 1) * h]);
            }
            ys.clear();
            ys.resize(list.len() * h, 0.0);
            let w: Vec<f32> = list.iter().map(|&(_, w)| w).collect();
            self.expert_add(&experts[e], &xs, list.len(), &w, &mut ys)?;
            for (&(t, _), y) in list.iter().zip(ys.chunks_exact(h)) {
                out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(y)
                    .for_each(|(o, &v)| *o += v);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_selects_by_biased_score_and_weights_by_unbiased() {
        let shape = MoeShape {
            hidden: 1,
            inter: 1,
            experts: 3,
            top_k: 2,
            routed_scale: 1.5,
            swiglu_limit: 10.0,
        };
        // x = 1, so logits equal the gate weights.
        let gate = PackedLinear::from_f32(&[2.0, 1.0, 0.0], 3, 1).unwrap();
        let bias = [0.0, 0.0, 5.0];
        let r = shape.route(&[1.0], &gate, &bias, 1).unwrap();
        assert_eq!(r[0].experts, vec![2, 0]);
        let (s2, s0) = (sqrt_softplus(0.0), sqrt_softplus(2.0));
        assert!((r[0].weights[0] - s2 / (s0 + s2) * 1.5).abs() < 1e-6);
        assert!((r[0].weights.iter().sum::<f32>() - 1.5).abs() < 1e-6);
    }

    #[test]
    fn swiglu_clamps_gate_above_and_up_both_sides() {
        let shape = MoeShape {
            hidden: 1,
            inter: 1,
            experts: 1,
            top_k: 1,
            routed_scale: 1.0,
            swiglu_limit: 10.0,
        };
        let lin = |v: f32| PackedLinear::from_f32(&[v], 1, 1).unwrap();
        let (w1, w2, w3) = (lin(100.0), lin(1.0), lin(-100.0));
        let e = Expert {
            w1: &w1,
            w2: &w2,
            w3: &w3,
        };
        let mut out = [0.0];
        shape.expert_add(&e, &[1.0], 1, &[1.0], &mut out).unwrap();
        let silu10 = 10.0 / (1.0 + (-10f32).exp());
        assert!((out[0] - silu10 * -10.0).abs() < 1e-4, "{}", out[0]);
    }

    #[test]
    fn softplus_is_stable() {
        assert!((sqrt_softplus(100.0) - 10.0).abs() < 1e-5);
        assert!(sqrt_softplus(-100.0) >= 0.0);
        assert!((sqrt_softplus(0.0) - 2f32.ln().sqrt()).abs() < 1e-6);
    }
}
