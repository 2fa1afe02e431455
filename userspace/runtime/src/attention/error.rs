//! Errors of the attention layer and of `verify attention`.

use crate::weights::WeightsError;

/// Errors of [`crate::attention`] and [`crate::verify`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The config lacks a field the attention layer needs, or it is unusable (the cause names
    /// the field).
    #[error("model config unusable for CSA2 attention")]
    Config(#[from] crate::Error),
    /// A weight or vector tensor is missing or malformed (the cause names file, tensor and
    /// expected shape or dtype).
    #[error(transparent)]
    Tensor(#[from] WeightsError),
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
    /// The paged cache refused an append (its message names the sequence and the shape).
    #[error("paged KV cache")]
    Cache(#[source] crate::cache::Error),
    /// A reference dump does not fit the config (wrong batch size, inconsistent lengths).
    #[error("{0}")]
    Vectors(String),
}

/// Wraps a kernel error with the layer and step.
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
