//! Selection state threaded from layer to layer within one forward step (spec §4).
//!
//! The reference threads one state object through the layers: a Full layer replaces the
//! top-k (and resets the candidates unless it is the candidate source, which publishes
//! them), a Reindex layer replaces the top-k, a Reuse layer takes both unchanged. Both are
//! per query token, so they live for one step (a prefill chunk or one decoded token) and are
//! never stored in the cache.

/// The top-k of the latest index source, one row of `k` slots per token of the step
/// (canonical layout: valid compressed positions ascending, then `-1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopK {
    /// The layer that selected it.
    pub source: usize,
    /// Slots per token (`index_topk`).
    pub k: usize,
    /// `[tokens, k]`.
    pub rows: Vec<i32>,
}

impl TopK {
    /// The row of token `i` of the step.
    pub fn row(&self, i: usize) -> Option<&[i32]> {
        self.rows.get(i * self.k..(i + 1) * self.k)
    }
}

/// The candidate pool of the candidate source: per token of the step, the visible compressed
/// positions of its best blocks, ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidates {
    /// The candidate source layer.
    pub source: usize,
    /// One list per token.
    pub rows: Vec<Vec<u32>>,
}

/// The per-step selection state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepState {
    tokens: usize,
    pub(crate) topk: Option<TopK>,
    pub(crate) candidates: Option<Candidates>,
}

impl StepState {
    /// The state at the start of a step of `tokens` tokens: no top-k, no candidates.
    pub fn new(tokens: usize) -> StepState {
        StepState {
            tokens,
            topk: None,
            candidates: None,
        }
    }

    /// Tokens in the step.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The current top-k, if an index source ran in this step.
    pub fn topk(&self) -> Option<&TopK> {
        self.topk.as_ref()
    }

    /// The current candidate pool, if the candidate source ran and no Full layer reset it.
    pub fn candidates(&self) -> Option<&Candidates> {
        self.candidates.as_ref()
    }
}
