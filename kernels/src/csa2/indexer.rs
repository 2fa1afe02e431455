//! Indexer scores (spec §4): `I(t, s) = Σ_h w[t, h] · relu(q[t, h] · k[s])`, on the MXFP4
//! query heads and MXFP4 keys.
//!
//! Head weights are `w = weights_proj(h) · index_head_dim^-1/2 · index_n_heads^-1/2`
//! ([`scale_head_weights`], two f32 multiplies in that order, as the reference writes it).
//! The heads are summed in head order in f32, starting from the first head's term; the verify
//! test checks this order bit for bit against the recorded `index_scores`. Visibility masking
//! (`-inf` for entries a query cannot see) is the caller's.

use kvstack_firmware_interface::rows::RowLayout;

use super::quant::Mxfp4Query;
use super::{Error, check_len};

/// Scales raw `weights_proj` outputs in place: `w · f32(d^-1/2) · f32(H^-1/2)`.
pub fn scale_head_weights(w: &mut [f32], index_head_dim: usize, index_heads: usize) {
    let a = (index_head_dim as f64).powf(-0.5) as f32;
    let b = (index_heads as f64).powf(-0.5) as f32;
    for v in w {
        *v = *v * a * b;
    }
}

/// Reference score of one key: each head's query and the key dequantized, dotted in f32 in
/// element order, `relu`, times the head weight, summed over heads in order.
pub fn index_score_ref(
    layout: RowLayout,
    q_heads: &[u8],
    weights: &[f32],
    key: &[u8],
) -> Result<f32, Error> {
    check_len(
        "index query heads [heads, row bytes]",
        weights.len() * layout.bytes(),
        q_heads.len(),
    )?;
    let mut k = vec![0f32; layout.dim];
    layout.dequantize(key, &mut k)?;
    let mut q = vec![0f32; layout.dim];
    let mut total = 0f32;
    for (h, (qb, &w)) in q_heads
        .chunks_exact(layout.bytes())
        .zip(weights)
        .enumerate()
    {
        layout.dequantize(qb, &mut q)?;
        let mut dot = 0f32;
        for (a, b) in q.iter().zip(&k) {
            dot += a * b;
        }
        let term = dot.max(0.0) * w;
        total = if h == 0 { term } else { total + term };
    }
    Ok(total)
}

/// One query token's indexer heads, prepared for scoring many keys (fast path: exact
/// integer dots, see [`super::quant`]).
#[derive(Clone, Debug)]
pub struct IndexQuery {
    heads: Vec<Mxfp4Query>,
    weights: Vec<f32>,
}

impl IndexQuery {
    /// `q_heads`: `weights.len()` MXFP4 rows of `layout`; `weights`: the scaled head weights.
    pub fn new(layout: RowLayout, q_heads: &[u8], weights: &[f32]) -> Result<IndexQuery, Error> {
        check_len(
            "index query heads [heads, row bytes]",
            weights.len() * layout.bytes(),
            q_heads.len(),
        )?;
        let heads = q_heads
            .chunks_exact(layout.bytes())
            .map(|q| Mxfp4Query::new(layout, q))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(IndexQuery {
            heads,
            weights: weights.to_vec(),
        })
    }

    /// The score of one key row.
    pub fn score(&self, key: &[u8]) -> Result<f32, Error> {
        let mut total = 0f32;
        for (h, (q, &w)) in self.heads.iter().zip(&self.weights).enumerate() {
            let term = q.dot(key)?.max(0.0) * w;
            total = if h == 0 { term } else { total + term };
        }
        Ok(total)
    }
}
