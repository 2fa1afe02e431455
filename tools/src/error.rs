//! The CLI's error type and the one place that prints an error chain.

use std::path::PathBuf;

/// Errors of the `kvstack` command-line tool.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause: an I/O error, not a regular file, or too large.
        #[source]
        source: kvstack_spec::files::FileError,
    },
    /// A file could not be written.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An input file's size does not fit the format.
    #[error("{path}: {size} bytes is not a whole number of {unit} ({unit_bytes} bytes each)")]
    FileSize {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// What one unit is (e.g. "fp4-global entries").
        unit: String,
        /// Bytes per unit.
        unit_bytes: usize,
    },
    /// An input file is empty.
    #[error("{path}: file is empty")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The codec rejected the data.
    #[error("{path}: codec failed")]
    Codec {
        /// The input file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: kvstack_kernels::Error,
    },
    /// A model config could not be loaded (the cause names the file and field).
    #[error("cannot load the model config")]
    ConfigLoad(#[source] kvstack_spec::Error),
    /// A loaded config failed planning or the cache arithmetic.
    #[error("{config}: cannot derive the cache arithmetic")]
    Calc {
        /// The config's file name (or the built-in name).
        config: String,
        /// The cause, naming the field and layer.
        #[source]
        source: kvstack_spec::Error,
    },
    /// The service (model, cache, tiers, engine) failed.
    #[error("the service failed")]
    Runtime(#[source] kvstack_engine::Error),
    /// An SSD-store or tiers operation failed.
    #[error("store operation failed")]
    Store(#[source] kvstack_tiers::Error),
    /// A benchmark could not run (the cause names what failed).
    #[error("benchmark failed")]
    Bench(#[source] kvstack_bench::Error),
    /// `kvstack profile` failed (the cause names the trace line, file or option).
    #[error("profile failed")]
    Profile(#[source] kvstack_bench::Error),
    /// `kvstack store fsck` found damage (listed on standard output).
    #[error("{0} damaged ranges or segments found")]
    Damaged(usize),
    /// The attention benchmark failed (a kernel refused a call; the cause says which).
    #[error("attention benchmark failed")]
    Attention(#[source] kvstack_bench::Error),
    /// A benchmark ran but missed one of its targets.
    #[error("benchmark targets missed: {0}")]
    TargetsMissed(String),
    /// Flags that are each in range but do not go together (exit 2, as clap's own usage
    /// errors).
    #[error("invalid value for '{flag}': {reason}")]
    Usage {
        /// The flag to change.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// Writing to standard output failed.
    #[error("cannot write to standard output")]
    Stdout(#[source] std::io::Error),
    /// `verify attention` could not run (the cause names the file, tensor or config field).
    #[error("cannot run the attention verification")]
    Verify(#[source] kvstack_model::Error),
    /// `verify attention` ran and some stages are out of tolerance.
    #[error("verify attention: {failed} of {total} stage comparisons out of tolerance")]
    VerifyFailed {
        /// Failed comparisons.
        failed: usize,
        /// All comparisons.
        total: usize,
    },
    /// The forward pass, a checkpoint or `verify model` failed (the cause names the tensor,
    /// file or config field).
    #[error("model operation failed")]
    Model(#[source] kvstack_model::Error),
    /// `verify model` ran and some tensors are out of tolerance.
    #[error("verify model: {failed} of {total} comparisons out of tolerance")]
    ModelVerifyFailed {
        /// Failed comparisons.
        failed: usize,
        /// All comparisons.
        total: usize,
    },
    /// JSON serialisation failed.
    #[error("cannot serialise the report as JSON")]
    Json(#[source] serde_json::Error),
    /// `kvstack run` finished but some requests failed (each was logged).
    #[error("{failed} requests failed")]
    RunFailed {
        /// How many.
        failed: usize,
    },
}

/// Prints `err` and each of its causes once, outermost first.
pub fn print_chain(err: &dyn std::error::Error) {
    eprintln!("error: {err}");
    let mut cause = err.source();
    while let Some(c) = cause {
        eprintln!("  caused by: {c}");
        cause = c.source();
    }
}

/// Whether the error is a broken pipe on standard output (e.g. `kvstack calc | head`), which is
/// not a failure.
pub fn is_broken_pipe(err: &CliError) -> bool {
    matches!(err, CliError::Stdout(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}
