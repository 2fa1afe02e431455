//! The benchmarks' errors: those of the crates they measure, passed on unchanged, and their own
//! (files of the bench directory, the external tools they compare with).

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the benchmark harnesses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config or plan error.
    #[error(transparent)]
    Spec(#[from] kvstack_spec::Error),

    /// A paged-cache error.
    #[error(transparent)]
    Cache(#[from] kvstack_cache::Error),

    /// An error of the SSD store, the window pool or the prefix units.
    #[error(transparent)]
    Tiers(#[from] kvstack_tiers::Error),

    /// An error of the model.
    #[error(transparent)]
    Model(#[from] kvstack_model::Error),

    /// An error of the engine.
    #[error(transparent)]
    Engine(#[from] kvstack_engine::Error),

    /// A kernel refused a call: while building the synthetic inputs or in a measured call.
    /// The harness builds valid inputs, so this is a bug in it or in the kernel.
    #[error("a kernel call failed")]
    Kernel(#[from] kvstack_kernels::Error),

    /// The codec refused values it was asked to encode.
    #[error("encoding {what}")]
    Codec {
        /// What was being encoded.
        what: &'static str,
        /// The codec's error.
        #[source]
        source: kvstack_kernels::Error,
    },

    /// A file operation of a benchmark failed.
    #[error("{what} {}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// An external tool (fio) failed.
    #[error("{tool}: {reason}")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// What happened.
        reason: String,
    },

    /// A measured run did not complete as it must (a request failed, a result differs).
    #[error("{0}")]
    Run(String),
}

impl Error {
    /// [`Error::Io`].
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Error {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
