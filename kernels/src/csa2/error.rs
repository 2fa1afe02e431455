//! Errors of the CSA2 building blocks.

/// Errors of [`crate::csa2`]: every variant names the buffer or parameter that is wrong.
#[derive(Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer has the wrong number of elements.
    #[error("{what}: expected {expected} elements, got {actual}")]
    Length {
        /// Which buffer, with its shape in words (for example `x [m, k]`).
        what: &'static str,
        /// The length the other arguments imply.
        expected: usize,
        /// The length passed.
        actual: usize,
    },
    /// A dimension or parameter that the block cannot work with.
    #[error("{what}: {reason}")]
    Param {
        /// The parameter.
        what: &'static str,
        /// Why it is unusable.
        reason: String,
    },
    /// A row layout the entry formats reject (width not a whole number of tiles, or a row
    /// buffer of the wrong size).
    #[error(transparent)]
    Row(#[from] kvstack_firmware_interface::Error),
}
