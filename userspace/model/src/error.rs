//! The model's errors: tensor files, checkpoints, the CSA2 attention layer, the forward pass
//! and the verifiers.
//!
//! Every variant points at the offending input: the file, tensor and expected shape or dtype
//! for tensors, the layer and step for attention, the config field (through the source) for
//! configs the model cannot use.

use std::path::PathBuf;

use crate::weights::{DtypeMismatch, MissingTensor, Shape, ShapeMismatch};

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the model crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The config lacks a field the model needs or holds an unusable value (the source names
    /// the field).
    #[error("model config unusable for the V4.1 forward pass")]
    ModelConfig(#[source] kvstack_spec::Error),

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

    /// A thread running part of a step panicked (a bug); the stores of the sequences it ran
    /// may hold part of the step.
    #[error("{0} panicked (a bug)")]
    Panicked(String),

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

    /// The config lacks a field the attention layer needs, or it is unusable (the cause names
    /// the field).
    #[error("model config unusable for CSA2 attention")]
    AttentionConfig(#[source] kvstack_spec::Error),

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
    Cache(#[source] kvstack_cache::Error),

    /// A reference dump does not fit the config (wrong batch size, inconsistent lengths).
    #[error("{0}")]
    Vectors(String),

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
}

impl Error {
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
