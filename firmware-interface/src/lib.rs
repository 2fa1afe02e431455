//! Byte-exact formats that kvstack shares with devices and disks.
//!
//! This crate holds layouts and pure conversions only: no I/O, no allocation on hot paths, no
//! `unsafe`. Everything here is specified in `shared/spec/dsv41-kv.md` §5 and documented byte by
//! byte in `docs/formats.md`.
//!
//! - [`element`]: the scalar element codecs E2M1, E4M3 "fn" and UE8M0.
//! - [`entry`]: the three KV entry types ([`WindowFp8Entry`], [`GlobalFp4Entry`],
//!   [`IndexMxfp4Entry`]) as zerocopy structs with compile-time size checks, and their scalar
//!   reference quantizers, which every fast path in `kvstack-kernels` is tested against.
//! - [`rows`]: the same formats at any width that is a whole number of tiles (small models).
//! - [`record`]: the SSD tier's segment and record headers (`docs/ssd-format.md`), with
//!   CRC-32C checksums and validation before any arithmetic on values read from disk.
//! - [`nvme`]: NVMe controller registers, queue entries, Identify data, commands and PRPs
//!   (`docs/nvme.md`), for the userspace NVMe driver in `kvstack-driver`.
#![forbid(unsafe_code)]

pub mod element;
pub mod entry;
pub mod nvme;
pub mod record;
pub mod rows;

pub use entry::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};

use std::fmt;
use std::str::FromStr;

/// Errors of this crate.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A format name that is not one of [`EntryFormat::ALL`].
    #[error("unknown entry format {name:?} (expected one of: fp8-window, fp4-global, mxfp4-index)")]
    UnknownFormat {
        /// The name that was given.
        name: String,
    },
    /// A row width that is not a positive whole number of the format's scale tiles.
    #[error("{format} rows must be a positive multiple of {tile} values wide, not {dim}")]
    RowWidth {
        /// The format.
        format: EntryFormat,
        /// The width asked for.
        dim: usize,
        /// The format's tile size.
        tile: usize,
    },
    /// A row buffer of the wrong length.
    #[error("{format} row: expected {expected} {what}, got {actual}")]
    RowLength {
        /// The format.
        format: EntryFormat,
        /// `values` or `bytes`.
        what: &'static str,
        /// The length the layout needs.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// Fewer bytes than a header needs.
    #[error("{what} truncated: {needed} bytes needed, {available} available")]
    RecordTruncated {
        /// `record header` or `segment header`.
        what: &'static str,
        /// Bytes the header needs.
        needed: u64,
        /// Bytes there were.
        available: u64,
    },
    /// The magic number is wrong: not a header of this format (or overwritten).
    #[error("bad {what} magic {found:02x?}")]
    RecordMagic {
        /// `record` or `segment`.
        what: &'static str,
        /// The bytes found.
        found: [u8; 8],
    },
    /// A format version this code does not read.
    #[error("format version {found} is not supported (this build reads version {supported})")]
    RecordVersion {
        /// The version found.
        found: u16,
        /// The version supported.
        supported: u16,
    },
    /// The header-length field does not match the version's header size.
    #[error("header length {found} differs from the expected {expected}")]
    RecordHeaderLength {
        /// The length found.
        found: u16,
        /// The length of this version's header.
        expected: u16,
    },
    /// The header's CRC-32C does not match its bytes.
    #[error("header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    RecordHeaderChecksum {
        /// The CRC stored in the header.
        stored: u32,
        /// The CRC of the bytes read.
        computed: u32,
    },
    /// A record kind this version does not know.
    #[error("unknown record kind {code}")]
    RecordKind {
        /// The kind byte.
        code: u8,
    },
    /// Flag bits outside the supported mask.
    #[error("unsupported flags {bits:#x} (supported {supported:#x})")]
    RecordFlags {
        /// The flags found.
        bits: u32,
        /// The supported mask.
        supported: u32,
    },
    /// Reserved bytes are not zero.
    #[error("reserved header bytes are not zero")]
    RecordReserved,
    /// A header field whose value the record's kind does not allow.
    #[error("header field `{field}`: {reason}")]
    RecordField {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A payload length that is out of range or inconsistent with the header.
    #[error("payload length {len}: {reason}")]
    RecordPayloadLength {
        /// The length.
        len: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The payload's CRC-32C does not match its bytes.
    #[error("payload checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    RecordPayloadChecksum {
        /// The CRC stored in the header.
        stored: u32,
        /// The CRC of the bytes read.
        computed: u32,
    },
    /// An NVMe structure read from a device holds a value this code does not accept.
    #[error("NVMe {structure} field {field} = {value:#x}: {reason}")]
    NvmeField {
        /// The structure (`CAP`, `Identify Controller`, ...).
        structure: &'static str,
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Fewer bytes than an NVMe structure needs.
    #[error("NVMe {structure} truncated: {needed} bytes needed, {available} available")]
    NvmeLength {
        /// The structure.
        structure: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes there were.
        available: usize,
    },
    /// A data pointer that cannot be built (NVMe PRPs, base specification §4.3).
    #[error("NVMe PRP: {reason}")]
    NvmePrp {
        /// What is wrong.
        reason: String,
    },
    /// A segment size that is not a multiple of 4 KiB of at least two pages.
    #[error("segment size {bytes} is not a multiple of 4096 of at least 8192 bytes")]
    SegmentSize {
        /// The size found.
        bytes: u64,
    },
}

/// One of the three KV entry formats of spec §5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryFormat {
    /// Sliding-window KV, FP8 E4M3 with UE8M0 tile scales (spec §5.1), 528 bytes.
    WindowFp8,
    /// Compressed (global) KV, FP4 E2M1 with E4M3 tile scales (spec §5.2), 288 bytes.
    GlobalFp4,
    /// Indexer keys, MXFP4 (spec §5.3), 68 bytes.
    IndexMxfp4,
}

impl EntryFormat {
    /// Every format, in spec order.
    pub const ALL: [EntryFormat; 3] = [
        EntryFormat::WindowFp8,
        EntryFormat::GlobalFp4,
        EntryFormat::IndexMxfp4,
    ];

    /// The command-line and file name of the format (`fp8-window`, `fp4-global`, `mxfp4-index`).
    pub const fn name(self) -> &'static str {
        match self {
            EntryFormat::WindowFp8 => "fp8-window",
            EntryFormat::GlobalFp4 => "fp4-global",
            EntryFormat::IndexMxfp4 => "mxfp4-index",
        }
    }

    /// Elements (f32 values) per entry.
    pub const fn dim(self) -> usize {
        match self {
            EntryFormat::WindowFp8 => WindowFp8Entry::DIM,
            EntryFormat::GlobalFp4 => GlobalFp4Entry::DIM,
            EntryFormat::IndexMxfp4 => IndexMxfp4Entry::DIM,
        }
    }

    /// Bytes per encoded entry.
    pub const fn entry_bytes(self) -> usize {
        match self {
            EntryFormat::WindowFp8 => WindowFp8Entry::BYTES,
            EntryFormat::GlobalFp4 => GlobalFp4Entry::BYTES,
            EntryFormat::IndexMxfp4 => IndexMxfp4Entry::BYTES,
        }
    }

    /// Elements per scale tile.
    pub const fn tile(self) -> usize {
        match self {
            EntryFormat::WindowFp8 => WindowFp8Entry::TILE,
            EntryFormat::GlobalFp4 => GlobalFp4Entry::TILE,
            EntryFormat::IndexMxfp4 => IndexMxfp4Entry::TILE,
        }
    }
}

impl fmt::Display for EntryFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EntryFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        EntryFormat::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| Error::UnknownFormat { name: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_roundtrip_and_unknown_is_rejected() {
        for f in EntryFormat::ALL {
            assert_eq!(f.name().parse::<EntryFormat>(), Ok(f));
        }
        let err = "fp4".parse::<EntryFormat>().unwrap_err();
        assert!(err.to_string().contains("\"fp4\""));
    }
}
