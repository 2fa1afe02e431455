//! Errors of the forward pass, its weights and `verify model`.

use std::path::PathBuf;

use crate::weights::WeightsError;

/// Errors of [`crate::model`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The attention layer failed (the cause names the layer).
    #[error(transparent)]
    Attention(#[from] crate::attention::Error),
    /// A tensor is missing or has the wrong shape or dtype (the cause names file and tensor).
    #[error(transparent)]
    Tensor(#[from] WeightsError),
    /// The config lacks a field the model needs or holds an unusable value.
    #[error("model config unusable for the V4.1 forward pass")]
    Config(#[from] crate::Error),
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
    /// A building block rejected its arguments.
    #[error("{what}")]
    Kernel {
        /// The step that failed.
        what: String,
        /// The kernel's error.
        #[source]
        source: kvstack_kernels::csa2::Error,
    },
    /// An input is out of range (a token id beyond the vocabulary, an empty step).
    #[error("{0}")]
    Input(String),
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
    Vectors(String),
}

/// Wraps a kernel error with what was being done.
pub(crate) fn kernel(
    what: impl Into<String>,
) -> impl FnOnce(kvstack_kernels::csa2::Error) -> Error {
    let what = what.into();
    move |source| Error::Kernel { what, source }
}
