//! The hierarchical candidate pool of the candidate source layer (spec §4), per query:
//!
//! 1. pad the (causally masked) scores to a multiple of the block size with `-inf` and take
//!    each block's maximum;
//! 2. force `+inf` on the block of the newest visible position, `(visible - 1) / block`
//!    (no block when nothing is visible);
//! 3. keep the `top_blocks` best blocks and drop those whose score is `-inf`;
//! 4. expand them to positions, crop to the scores' length and keep the visible ones.
//!
//! Later Reindex layers of the same token mask their scores outside the pool
//! ([`mask_to_candidates`]) before their top-k. Block ties break towards the lower block
//! (the reference leaves them undefined; the vectors have none).

use std::cmp::Ordering;

use super::Error;

/// Pool parameters (`candidate_block_size`, `candidate_topk_blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CandidateParams {
    /// Compressed positions per block (8).
    pub block: usize,
    /// Blocks kept (2048 in V4.1-Flash, 4 in the test model).
    pub top_blocks: usize,
}

impl CandidateParams {
    fn check(&self) -> Result<(), Error> {
        if self.block == 0 {
            return Err(Error::Param {
                what: "candidate_block_size",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// Step 1-2: the block scores of one query's masked `scores` with `visible` visible positions.
pub fn block_scores(
    scores: &[f32],
    visible: usize,
    params: CandidateParams,
    out: &mut Vec<f32>,
) -> Result<(), Error> {
    params.check()?;
    out.clear();
    out.extend(
        scores
            .chunks(params.block)
            .map(|b| b.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s))),
    );
    if visible > 0
        && let Some(b) = out.get_mut((visible - 1) / params.block)
    {
        *b = f32::INFINITY;
    }
    Ok(())
}

fn expand(
    blocks: &[usize],
    block_scores: &[f32],
    len: usize,
    visible: usize,
    params: CandidateParams,
    out: &mut Vec<u32>,
) {
    out.clear();
    for &b in blocks {
        if block_scores[b] == f32::NEG_INFINITY || block_scores[b].is_nan() {
            continue;
        }
        let end = ((b + 1) * params.block).min(len).min(visible);
        out.extend((b * params.block..end).map(|j| j as u32));
    }
}

fn desc(scores: &[f32]) -> impl Fn(&usize, &usize) -> Ordering + '_ {
    move |&a, &b| {
        let key = |i: usize| {
            if scores[i].is_nan() {
                f32::NEG_INFINITY
            } else {
                scores[i]
            }
        };
        key(b).total_cmp(&key(a)).then(a.cmp(&b))
    }
}

/// Reference: block scores, a full sort of the blocks, the first `top_blocks`, expansion;
/// `out` gets the candidate positions in ascending order.
pub fn candidate_pool_ref(
    scores: &[f32],
    visible: usize,
    params: CandidateParams,
    out: &mut Vec<u32>,
) -> Result<(), Error> {
    let mut bs = Vec::new();
    block_scores(scores, visible, params, &mut bs)?;
    let mut order: Vec<usize> = (0..bs.len()).collect();
    order.sort_by(desc(&bs));
    order.truncate(params.top_blocks.min(bs.len()));
    order.sort_unstable();
    expand(&order, &bs, scores.len(), visible, params, out);
    Ok(())
}

/// Fast: partial selection of the blocks with a score above `-inf`; same set as
/// [`candidate_pool_ref`], ascending. `block_scores` receives the block scores (reused
/// buffer; also what the vectors record as `candidate_block_scores`).
pub fn candidate_pool(
    scores: &[f32],
    visible: usize,
    params: CandidateParams,
    block_scores_out: &mut Vec<f32>,
    out: &mut Vec<u32>,
) -> Result<(), Error> {
    block_scores(scores, visible, params, block_scores_out)?;
    let bs = &block_scores_out[..];
    let mut live: Vec<usize> = (0..bs.len())
        .filter(|&b| bs[b] > f32::NEG_INFINITY)
        .collect();
    if live.len() > params.top_blocks {
        if params.top_blocks == 0 {
            live.clear();
        } else {
            live.select_nth_unstable_by(params.top_blocks - 1, desc(bs));
            live.truncate(params.top_blocks);
        }
    }
    live.sort_unstable();
    expand(&live, bs, scores.len(), visible, params, out);
    Ok(())
}

/// Sets every score outside `candidates` (ascending or not) to `-inf`.
pub fn mask_to_candidates(scores: &mut [f32], candidates: &[u32]) {
    let mut keep = vec![false; scores.len()];
    for &c in candidates {
        if let Some(k) = keep.get_mut(c as usize) {
            *k = true;
        }
    }
    for (s, k) in scores.iter_mut().zip(keep) {
        if !k {
            *s = f32::NEG_INFINITY;
        }
    }
}
