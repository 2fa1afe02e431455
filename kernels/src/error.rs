//! The crate's error type: one enum for the codecs, the dot products, the CSA2 building
//! blocks ([`crate::csa2`]) and the attention kernels ([`crate::attn`]).

use crate::SimdLevel;

/// Errors of every kernel entry point.
///
/// Every variant names what was wrong and where, so a caller can print it without context.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer has the wrong length.
    #[error("{what}: expected {expected}, got {actual}")]
    LengthMismatch {
        /// Which buffer, with its unit (for example `fp4-global output bytes`).
        what: &'static str,
        /// The length the other arguments imply.
        expected: usize,
        /// The length that was passed.
        actual: usize,
    },
    /// A buffer's length is not a whole number of rows or entries.
    #[error("{what}: length {actual} is not a multiple of {multiple}")]
    NotAMultiple {
        /// Which buffer, with its unit (for example `fp8-window input f32 values`).
        what: &'static str,
        /// The row or entry size the length must be a multiple of.
        multiple: usize,
        /// The length that was passed.
        actual: usize,
    },
    /// The checked quantizer found a NaN or an infinity (the formats cannot represent them).
    #[error("non-finite input value {value} at row {row}, column {column}")]
    NonFinite {
        /// Row (entry index) of the first non-finite value.
        row: usize,
        /// Column (element index within the row) of that value.
        column: usize,
        /// The value itself.
        value: f32,
    },
    /// A `*_with` function was asked for a SIMD level this CPU (or this build) cannot run.
    #[error("SIMD level {level} is not available on this CPU (available: {available})")]
    UnsupportedLevel {
        /// The level that was requested.
        level: SimdLevel,
        /// The levels that are available, comma-separated.
        available: String,
    },
    /// A SIMD level name that is not one of [`SimdLevel::ALL`].
    #[error("unknown SIMD level {name:?} (expected one of: portable, avx2, avx512)")]
    UnknownLevel {
        /// The name that was given.
        name: String,
    },
    /// A position refers past the entries that exist (attention kernels).
    #[error("{what}: position {position} is out of range (have {len} entries)")]
    PositionOutOfRange {
        /// Which list held the position.
        what: &'static str,
        /// The offending position.
        position: i64,
        /// How many entries exist.
        len: usize,
    },
    /// A page list does not have the fixed page geometry [`crate::attn::Paged::pages`]
    /// requires.
    #[error(
        "page {page} holds {len} entries; pages hold {page_entries} (only the last may hold fewer)"
    )]
    PageLayout {
        /// Index of the offending page.
        page: usize,
        /// Its length.
        len: usize,
        /// The page size.
        page_entries: usize,
    },
    /// A dimension or parameter that a CSA2 block cannot work with.
    #[error("{what}: {reason}")]
    Param {
        /// The parameter.
        what: &'static str,
        /// Why it is unusable.
        reason: String,
    },
    /// A kernel found one of its own invariants broken: a bug in this crate, whatever the
    /// input; the output buffer is not meaningful.
    #[error("internal error: {what}")]
    Internal {
        /// What did not hold.
        what: &'static str,
    },
    /// A row layout the entry formats reject (width not a whole number of tiles, or a row
    /// buffer of the wrong size).
    #[error(transparent)]
    Row(#[from] kvstack_firmware_interface::Error),
}
