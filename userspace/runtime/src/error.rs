//! The crate's error type: one enum for every subsystem of the runtime.
//!
//! Every variant carries enough structure for a caller to point at the offending input: the file
//! (for I/O and JSON errors), the config field as written in the file (`text_config.` prefixed
//! when the text model is nested), for layer-plan violations the layer index, for the paged cache
//! the sequence, layer or pool, for tensors the file, tensor and expected shape or dtype.
//!
//! Where one subsystem reports another's error with context (the tiers restoring into the paged
//! cache, the forward pass reading the config), the inner error is this type again, boxed, as the
//! `#[source]` of a variant that says what was being done.

use std::path::PathBuf;

use crate::cache::{PoolName, SequenceId};
use crate::config::Generation;
use crate::weights::{DtypeMismatch, MissingTensor, Shape, ShapeMismatch};

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- Config, layer plan and cache arithmetic -------------------------------------------------
    /// The config file could not be read.
    #[error("{}: cannot read config", path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// The config text is not valid JSON.
    #[error("{}: invalid JSON", path.display())]
    Json {
        /// The file the text came from (`<string>` for text passed in memory).
        path: PathBuf,
        /// The parser's error, with line and column.
        #[source]
        source: serde_json::Error,
    },

    /// A field the requested computation needs is absent (or JSON `null`).
    #[error("config field `{field}` is missing")]
    MissingField {
        /// The field, as written in the file (e.g. `text_config.head_dim`).
        field: String,
    },

    /// A field is present but has the wrong type or an unusable value.
    #[error("config field `{field}` is invalid: {reason}")]
    InvalidField {
        /// The field, as written in the file.
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The layer plan described by the config violates a rule of spec §4.
    #[error("layer {layer}: `{field}`: {reason}")]
    Plan {
        /// The layer the violation is about.
        layer: usize,
        /// The config field that has to change to fix it.
        field: String,
        /// Which rule is violated, and how.
        reason: String,
    },

    /// A storage-format name that is not known.
    #[error("unknown {kind} format {name:?} (expected one of: {expected})")]
    UnknownFormat {
        /// `global` or `index`.
        kind: &'static str,
        /// The name that was given.
        name: String,
        /// The accepted names, comma separated.
        expected: String,
    },

    /// A storage format that cannot describe this generation's cache entries.
    #[error("{kind} format `{format}` does not apply to {generation}: {reason}")]
    FormatNotApplicable {
        /// `global` or `index`.
        kind: &'static str,
        /// The format's name.
        format: &'static str,
        /// The generation of the model.
        generation: Generation,
        /// Why it does not apply.
        reason: String,
    },

    // --- Paged KV cache (`crate::cache`) ---------------------------------------------------------
    // None of these leaves the cache half-changed: an operation that fails has changed nothing.
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

    // --- Tiers: SSD store, DRAM window pool, prefix units (`crate::tiers`) -----------------------
    /// A file operation of the tiers failed.
    #[error("{what} {}", path.display())]
    TiersIo {
        /// What was being done (`cannot open segment`, ...).
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error (errno kept).
        #[source]
        source: std::io::Error,
    },

    /// Pinned memory or a buffer pool of the tiers could not be set up.
    #[error("cannot set up pinned memory")]
    TiersMemory(#[source] kvstack_driver::Error),

    /// An option of the tiers is out of range.
    #[error("invalid option `{field}`: {reason}")]
    TiersInvalidOption {
        /// The option.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// The store was opened read-only.
    #[error("the store is open read-only")]
    ReadOnly,

    /// A write was refused: no space is free and nothing may be reclaimed (every block is
    /// younger than the retention period, or too live to compact). Counted in the stats.
    #[error(
        "store full: {needed} bytes needed and nothing may be reclaimed (every block is within \
         its retention period)"
    )]
    StoreFull {
        /// Bytes the write needed.
        needed: u64,
    },

    /// The write-behind queue is full: persisting was refused rather than block the caller.
    /// Counted in the stats.
    #[error("write-behind queue full ({queued} bytes queued, limit {limit})")]
    QueueFull {
        /// Bytes queued.
        queued: u64,
        /// The limit.
        limit: u64,
    },

    /// An earlier write or `fdatasync` failed; the store no longer trusts its files for
    /// writing (reads of data made durable before continue).
    #[error("writes disabled after an I/O failure: {reason}")]
    Poisoned {
        /// The failure.
        reason: String,
    },

    /// A unit write failed.
    #[error("unit write failed: {reason}")]
    WriteFailed {
        /// Why.
        reason: String,
    },

    /// A unit is longer than the store's records can describe.
    #[error("unit of {blocks} blocks exceeds the limit of {max}")]
    UnitTooLong {
        /// Blocks of the unit.
        blocks: usize,
        /// The configured limit.
        max: usize,
    },

    /// A block payload larger than the store's I/O buffers.
    #[error("block payload of {bytes} bytes exceeds the limit of {max}")]
    BlockTooLarge {
        /// The payload size.
        bytes: usize,
        /// The configured limit.
        max: usize,
    },

    /// A unit whose length is not a multiple of the largest compress ratio (spec §8).
    #[error("unit of {tokens} tokens is not a multiple of {align} tokens")]
    Unaligned {
        /// Tokens of the unit.
        tokens: u64,
        /// The required multiple.
        align: u64,
    },

    /// The store has shut down.
    #[error("the store is closed")]
    Closed,

    /// A location that is not a store or cannot hold one.
    #[error("{}: {reason}", path.display())]
    Location {
        /// The directory or device.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A block payload does not match the model's geometry.
    #[error("block {block} of {tokens} tokens: {reason}")]
    Payload {
        /// Block index in the unit.
        block: usize,
        /// Tokens of the block.
        tokens: u64,
        /// What does not match.
        reason: String,
    },

    /// A paged-cache operation failed during persist or restore (the source is the cache's
    /// error).
    #[error("paged cache")]
    TiersCache(#[source] Box<Error>),

    /// The tiers cannot use the model's config (the source is the config or plan error).
    #[error("model config")]
    TiersConfig(#[source] Box<Error>),

    /// An external tool (fio) failed.
    #[error("{tool}: {reason}")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// What happened.
        reason: String,
    },

    // --- Forward pass, checkpoints and `verify model` (`crate::model`) ---------------------------
    /// The config lacks a field the model needs or holds an unusable value (the source names
    /// the field).
    #[error("model config unusable for the V4.1 forward pass")]
    ModelConfig(#[source] Box<Error>),

    /// A stored tensor cannot be decoded (scale shape, packing, dtype).
    #[error("{}: tensor `{name}`: {reason}", path.display())]
    Storage {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },

    /// A building block of the forward pass rejected its arguments.
    #[error("{what}")]
    ModelKernel {
        /// The step that failed.
        what: String,
        /// The kernel's error.
        #[source]
        source: kvstack_kernels::csa2::Error,
    },

    /// An input of the forward pass is out of range (a token id beyond the vocabulary, an
    /// empty step).
    #[error("{0}")]
    ModelInput(String),

    /// A file could not be written.
    #[error("{}: cannot write", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// A reference dump does not fit the model.
    #[error("{0}")]
    ModelVectors(String),

    // --- CSA2 attention and `verify attention` (`crate::attention`, `crate::verify`) -------------
    /// The config lacks a field the attention layer needs, or it is unusable (the cause names
    /// the field).
    #[error("model config unusable for CSA2 attention")]
    AttentionConfig(#[source] Box<Error>),

    /// A building block rejected its arguments (an internal inconsistency or a bad dimension).
    #[error("layer {layer}: {what}")]
    Kernel {
        /// The layer.
        layer: usize,
        /// The step that failed.
        what: &'static str,
        /// The kernel's error.
        #[source]
        source: kvstack_kernels::csa2::Error,
    },

    /// The KV state does not hold what the layer needs (a missing row, a top-k from a layer
    /// that did not run, a position that is not the next one).
    #[error("layer {layer}: {reason}")]
    State {
        /// The layer.
        layer: usize,
        /// What is missing or inconsistent.
        reason: String,
    },

    /// An input buffer has the wrong size.
    #[error("layer {layer}: {what}: expected {expected} values, got {actual}")]
    Input {
        /// The layer.
        layer: usize,
        /// Which input.
        what: &'static str,
        /// The size the shapes imply.
        expected: usize,
        /// The size given.
        actual: usize,
    },

    /// The paged cache refused an append of the attention layer (the source, the cache's error,
    /// names the sequence and the shape).
    #[error("paged KV cache")]
    AttentionCache(#[source] Box<Error>),

    /// A reference dump does not fit the config (wrong batch size, inconsistent lengths).
    #[error("{0}")]
    Vectors(String),

    // --- Tensor files: weights and reference dumps (`crate::weights`) ----------------------------
    /// The file could not be opened or mapped.
    #[error("{}: cannot open tensor file", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// The file is not a valid safetensors file.
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },

    /// A tensor the caller needs is absent (boxed: the details are large).
    #[error(
        "{}: tensor `{}` is missing (expected {} {})",
        .0.path.display(), .0.name, .0.dtype, Shape(&.0.expected)
    )]
    Missing(Box<MissingTensor>),

    /// A tensor has another shape than the caller expects (boxed likewise).
    #[error(
        "{}: tensor `{}` has shape {}, expected {}",
        .0.path.display(), .0.name, Shape(&.0.actual), Shape(&.0.expected)
    )]
    WeightsShape(Box<ShapeMismatch>),

    /// A tensor has another dtype than the caller expects (boxed likewise).
    #[error(
        "{}: tensor `{}` has dtype {}, expected {} (shape {})",
        .0.path.display(), .0.name, .0.actual, .0.expected, Shape(&.0.shape)
    )]
    Dtype(Box<DtypeMismatch>),

    // --- Serving engine (`crate::engine`) --------------------------------------------------------
    /// A request the engine cannot take.
    #[error("session {session}: {reason}")]
    Request {
        /// The session it was submitted to.
        session: u64,
        /// What is wrong with it.
        reason: String,
    },
}

impl Error {
    /// The config field an error is about, when it is a config or plan error about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::MissingField { field }
            | Error::InvalidField { field, .. }
            | Error::Plan { field, .. } => Some(field),
            _ => None,
        }
    }

    /// The layer a layer-plan error is about.
    pub fn layer(&self) -> Option<usize> {
        match self {
            Error::Plan { layer, .. } => Some(*layer),
            _ => None,
        }
    }

    /// The sequence a paged-cache error is about, when it is about one.
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

    /// [`Error::TiersIo`]: a file operation of the tiers failed.
    pub(crate) fn tiers_io(
        what: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Error {
        Error::TiersIo {
            what,
            path: path.into(),
            source,
        }
    }

    /// [`Error::TiersCache`]: a cache error during persist or restore.
    pub(crate) fn tiers_cache(e: Error) -> Error {
        Error::TiersCache(Box::new(e))
    }

    /// [`Error::TiersConfig`]: a config or plan error of the tiers.
    pub(crate) fn tiers_config(e: Error) -> Error {
        Error::TiersConfig(Box::new(e))
    }

    /// [`Error::ModelConfig`]: a config error of the forward pass.
    pub(crate) fn model_config(e: Error) -> Error {
        Error::ModelConfig(Box::new(e))
    }

    /// [`Error::AttentionConfig`]: a config or plan error of the attention layer.
    pub(crate) fn attention_config(e: Error) -> Error {
        Error::AttentionConfig(Box::new(e))
    }

    /// [`Error::AttentionCache`]: the paged cache refused an append of the attention layer.
    pub(crate) fn attention_cache(e: Error) -> Error {
        Error::AttentionCache(Box::new(e))
    }

    /// Wraps a kernel error of the forward pass with what was being done
    /// ([`Error::ModelKernel`]).
    pub(crate) fn model_kernel(
        what: impl Into<String>,
    ) -> impl FnOnce(kvstack_kernels::csa2::Error) -> Error {
        let what = what.into();
        move |source| Error::ModelKernel { what, source }
    }

    /// Wraps a kernel error of the attention layer with the layer and step ([`Error::Kernel`]).
    pub(crate) fn kernel(
        layer: usize,
        what: &'static str,
    ) -> impl FnOnce(kvstack_kernels::csa2::Error) -> Error {
        move |source| Error::Kernel {
            layer,
            what,
            source,
        }
    }
}
