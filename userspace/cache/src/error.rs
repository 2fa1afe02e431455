//! The paged cache's errors. None of them leaves the cache half-changed: an operation that
//! fails has changed nothing.

use crate::{PoolName, SequenceId};

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the paged KV cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model's config or layer plan cannot be read for the cache (the source names the
    /// field or the layer).
    #[error("model config unusable for the paged cache")]
    Config(#[from] kvstack_spec::Error),

    /// No live sequence has this id (never created, or dropped).
    #[error("unknown {seq}")]
    UnknownSequence {
        /// The id that was given.
        seq: SequenceId,
    },

    /// An append would take a sequence past the configured context limit.
    #[error("{seq}: appending {appended} tokens to {len} exceeds the context limit of {limit}")]
    ContextLimit {
        /// The sequence.
        seq: SequenceId,
        /// Its length before the append.
        len: u64,
        /// Tokens in the append.
        appended: u64,
        /// `CacheOptions::context_limit`.
        limit: u64,
    },

    /// A pool has no free page left and cannot grow (after evicting every cached prefix block
    /// that no sequence uses).
    #[error(
        "{pool} exhausted: {requested} more page(s) of {page_bytes} bytes needed, {in_use} of \
         {capacity} in use ({free} free)"
    )]
    PoolExhausted {
        /// The pool.
        pool: PoolName,
        /// Pages the operation still needed.
        requested: u64,
        /// Pages referenced by sequences or the prefix index.
        in_use: u64,
        /// Free pages (committed but unreferenced).
        free: u64,
        /// The most pages the pool may hold.
        capacity: u64,
        /// Bytes per page.
        page_bytes: u64,
    },

    /// A page would not hold a whole number of entries.
    #[error(
        "{pool}: a page of {page_tokens} tokens is {page_bytes} bytes, not a multiple of the \
         {entry_bytes}-byte entry (page_tokens must be a multiple of every compress ratio)"
    )]
    PageSize {
        /// The pool.
        pool: PoolName,
        /// Tokens per page (`CacheOptions::page_tokens`).
        page_tokens: u64,
        /// Bytes per page (`page_tokens * entry_bytes / ratio`, rounded down).
        page_bytes: u64,
        /// Bytes per entry.
        entry_bytes: u64,
    },

    /// A cache option is unusable.
    #[error("cache option `{field}` is invalid: {reason}")]
    InvalidOption {
        /// The `CacheOptions` field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The model's plan or dimensions are not what this cache stores.
    #[error("unsupported model for the paged cache: {reason}")]
    UnsupportedModel {
        /// Why.
        reason: String,
    },

    /// The data of an append (or a window rebuild) has the wrong shape.
    #[error("{seq}: {what}: expected {expected}, got {got}")]
    Shape {
        /// The sequence.
        seq: SequenceId,
        /// Which part of the data, with the layer when it is per layer.
        what: String,
        /// Expected count.
        expected: u64,
        /// Count given.
        got: u64,
    },

    /// A layer index outside the model.
    #[error("layer {layer} does not exist (the model has {layers} layers)")]
    UnknownLayer {
        /// The layer asked for.
        layer: usize,
        /// Layers in the plan.
        layers: usize,
    },

    /// A window-only layer has no compressed KV and no indexer keys.
    #[error("layer {layer} is window-only: it has no compressed KV or indexer keys")]
    NoCompressedKv {
        /// The layer asked for.
        layer: usize,
    },

    /// A layer that is not a KV source with ratio > 1 has no pending compressor state.
    #[error("layer {layer} keeps no pending compressor state (not a KV source with ratio > 1)")]
    NoPendingState {
        /// The layer asked for.
        layer: usize,
    },

    /// Truncation to a length beyond the sequence's end.
    #[error("{seq}: cannot truncate {len} tokens to {to}")]
    TruncateBeyondEnd {
        /// The sequence.
        seq: SequenceId,
        /// Its length.
        len: u64,
        /// The length asked for.
        to: u64,
    },

    /// The window rows given do not end at the sequence's end or reach further back than the
    /// window.
    #[error(
        "{seq}: window rows for positions {first}..{end} must end at {len} and start at or after {oldest}"
    )]
    WindowRange {
        /// The sequence.
        seq: SequenceId,
        /// First position of the rows.
        first: u64,
        /// One past their last position.
        end: u64,
        /// The sequence's length.
        len: u64,
        /// The oldest position the window can hold.
        oldest: u64,
    },

    /// `CacheOptions::max_sequences` sequences are live.
    #[error("cannot start another sequence: {limit} are live (the max_sequences limit)")]
    TooManySequences {
        /// `CacheOptions::max_sequences`.
        limit: usize,
    },

    /// The memory layer refused to reserve or commit pool memory.
    #[error("{pool}: cannot reserve or commit memory")]
    Memory {
        /// The pool.
        pool: PoolName,
        /// The driver's error.
        #[source]
        source: kvstack_driver::Error,
    },

    /// The codec refused values it was asked to encode.
    #[error("encoding {what}")]
    Codec {
        /// What was being encoded.
        what: &'static str,
        /// The codec's error.
        #[source]
        source: kvstack_kernels::Error,
    },

    /// The cache's own bookkeeping is inconsistent (a bug; the operation was refused).
    #[error("internal cache invariant violated: {what}")]
    Internal {
        /// Which invariant.
        what: &'static str,
    },
}

impl Error {
    /// The sequence an error is about, when it is about one.
    pub fn sequence(&self) -> Option<SequenceId> {
        match self {
            Error::UnknownSequence { seq }
            | Error::ContextLimit { seq, .. }
            | Error::Shape { seq, .. }
            | Error::TruncateBeyondEnd { seq, .. }
            | Error::WindowRange { seq, .. } => Some(*seq),
            _ => None,
        }
    }
}
