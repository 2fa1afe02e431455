//! The crate's error type.

/// Errors of the benchmark harnesses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A kernel refused a call: while building the synthetic inputs or in a measured call.
    /// The harness builds valid inputs, so this is a bug in it or in the kernel.
    #[error("a kernel call failed")]
    Kernel(#[from] kvstack_kernels::Error),
}

/// A result of the benchmark harnesses.
pub type Result<T, E = Error> = std::result::Result<T, E>;
