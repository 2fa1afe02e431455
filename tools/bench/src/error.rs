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

    /// A line of a request trace is malformed.
    #[error("{}", trace_message(*line, *field, reason))]
    Trace {
        /// The line number, from 1.
        line: usize,
        /// The field at fault (`None`: the line as a whole).
        field: Option<&'static str>,
        /// What is wrong.
        reason: String,
    },

    /// A request trace file could not be read.
    #[error("cannot read trace {}", path.display())]
    TraceFile {
        /// The file.
        path: PathBuf,
        /// An I/O error, not a regular file, or too large.
        #[source]
        source: kvstack_spec::files::FileError,
    },

    /// A plot could not be drawn or written.
    #[error("plot {}: {reason}", path.display())]
    Plot {
        /// The file being written.
        path: PathBuf,
        /// What failed.
        reason: String,
    },

    /// An option of a harness is out of its range or does not fit the others.
    #[error("option `{field}`: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

fn trace_message(line: usize, field: Option<&str>, reason: &str) -> String {
    match field {
        Some(f) => format!("trace line {line}: field `{f}`: {reason}"),
        None => format!("trace line {line}: {reason}"),
    }
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
