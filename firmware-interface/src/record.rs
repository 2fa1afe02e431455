//! On-disk formats of the SSD tier: segment headers and records (`docs/ssd-format.md`).
//!
//! A store is a set of **segments** (one file each, or fixed-size slots of one preallocated file
//! or block device). A segment starts with a 4 KiB page holding a [`SegmentHeader`], followed by
//! **records** back to back. A record is a 4 KiB page holding a [`RecordHeader`], then its
//! payload, zero-padded to a multiple of 4 KiB, so every record and every payload starts on a
//! 4 KiB boundary and can be moved with direct I/O.
//!
//! Each format has two forms, as in a qcow2 reader: a raw `zerocopy` struct whose fields are
//! explicitly little-endian (`Raw*`, exactly the bytes on disk, no padding) and a validated
//! domain struct with native fields. Decoding checks, in this order and before any arithmetic
//! on a value read from disk: the length of the input, the magic number, the format version,
//! the header length, the header CRC-32C, then each field (known kind, supported flags, zero
//! reserved bytes, bounded lengths). Only then are lengths combined into offsets, with checked
//! arithmetic.
//!
//! Checksums are CRC-32C (Castagnoli), the polynomial that SSE4.2 and ARMv8 compute in
//! hardware; the `crc32c` crate picks the hardware path at run time.

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::Error;

/// Alignment of records, payloads and segment headers: direct I/O needs offsets and lengths in
/// whole logical blocks, and 4 KiB covers every NVMe and SATA device in use.
pub const ALIGN: usize = 4096;

/// Bytes of the page that holds a record header; the payload starts right after it.
pub const RECORD_HEADER_PAGE: usize = ALIGN;

/// Bytes of the page that holds a segment header; the first record starts right after it.
pub const SEGMENT_HEADER_PAGE: usize = ALIGN;

/// Magic number of a record header: the ASCII bytes `KVSTKREC`.
pub const RECORD_MAGIC: [u8; 8] = *b"KVSTKREC";

/// Magic number of a segment header: the ASCII bytes `KVSTKSEG`.
pub const SEGMENT_MAGIC: [u8; 8] = *b"KVSTKSEG";

/// The one format version this code reads and writes (records and segment headers).
pub const FORMAT_VERSION: u16 = 1;

/// Largest payload a record may declare (1 GiB). A bound on a value read from disk, so a
/// damaged length can never make a reader allocate or seek absurdly.
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// Bytes of a block key, a unit key and a parent key (a BLAKE3-256 digest).
pub const KEY_BYTES: usize = 32;

/// Bytes of the model fingerprint kept in every record.
pub const MODEL_BYTES: usize = 16;

/// A content key: BLAKE3-256 of a block's parent key, token ids, model and tenant.
pub type Key = [u8; KEY_BYTES];

/// Rounds `n` up to a multiple of [`ALIGN`]; `None` on overflow.
pub const fn align_up(n: u64) -> Option<u64> {
    match n.checked_add(ALIGN as u64 - 1) {
        Some(v) => Some(v / ALIGN as u64 * ALIGN as u64),
        None => None,
    }
}

/// CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

// ---------------------------------------------------------------------------------------------
// Record header

/// What a record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// One block of global KV: every KV source's FP4 entries and MXFP4 keys for up to one page
    /// of tokens (`docs/ssd-format.md`, "Block payload").
    Block,
    /// The commit of a unit: the keys of its blocks, first to last. A unit is visible only
    /// when its commit and every block it names are present and valid.
    Commit,
    /// The delete of a unit (a tombstone): every commit of its key older than the delete's
    /// horizon ([`RecordHeader::delete_horizon`]) no longer counts. No payload.
    Delete,
}

impl RecordKind {
    /// The byte that encodes the kind.
    pub const fn code(self) -> u8 {
        match self {
            RecordKind::Block => 1,
            RecordKind::Commit => 2,
            RecordKind::Delete => 3,
        }
    }

    /// The kind a byte encodes, if any.
    pub const fn from_code(code: u8) -> Option<RecordKind> {
        match code {
            1 => Some(RecordKind::Block),
            2 => Some(RecordKind::Commit),
            3 => Some(RecordKind::Delete),
            _ => None,
        }
    }

    /// Lower-case name, for reports.
    pub const fn name(self) -> &'static str {
        match self {
            RecordKind::Block => "block",
            RecordKind::Commit => "commit",
            RecordKind::Delete => "delete",
        }
    }
}

bitflags::bitflags! {
    /// Feature bits of a record header. A reader refuses a record with a bit outside
    /// [`RecordFlags::SUPPORTED`] ([`RecordFlags::from_bits`] returns `None`): an unknown bit
    /// may change how the payload must be read.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct RecordFlags: u32 {
        /// Block: the payload ends with the block's token ids (`tokens` x u32 little-endian),
        /// after the KV data, so `fsck` can recompute the key.
        const TOKEN_IDS = 1 << 0;
        /// Written by compaction (a copy of a record from an older segment). Informational.
        const RELOCATED = 1 << 1;
        /// Commit: written to record a later last use of an existing prefix rather than by a
        /// new unit. Informational.
        const TOUCH = 1 << 2;
    }
}

impl RecordFlags {
    /// No flags.
    pub const EMPTY: RecordFlags = RecordFlags::empty();
    /// Every bit this version understands (all the flags above).
    pub const SUPPORTED: RecordFlags = RecordFlags::all();
}

/// The first 256 bytes of a record's header page, exactly as on disk (little-endian, no
/// padding). See `docs/ssd-format.md` for every field.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned)]
#[repr(C)]
pub struct RawRecordHeader {
    /// [`RECORD_MAGIC`].
    pub magic: [u8; 8],
    /// [`FORMAT_VERSION`].
    pub version: U16,
    /// Bytes of this header, [`RecordHeader::BYTES`].
    pub header_len: U16,
    /// [`RecordFlags`] bits.
    pub flags: U32,
    /// [`RecordKind`] code.
    pub kind: u8,
    /// Zero.
    pub reserved0: [u8; 7],
    /// Store-wide sequence number, increasing in write order.
    pub seq: U64,
    /// Id of the segment the record was written into.
    pub segment: U64,
    /// Block key, or for a commit the unit key (the key of its last block).
    pub key: [u8; KEY_BYTES],
    /// Block: the parent's key (the root key of model and tenant for a first block). Commit:
    /// zero. Delete: the horizon (u64 little-endian) in the first 8 bytes, then zero.
    pub parent: [u8; KEY_BYTES],
    /// Model fingerprint (first 16 bytes).
    pub model: [u8; MODEL_BYTES],
    /// Tenant id (first 8 bytes of BLAKE3 of the tenant name, little-endian).
    pub tenant: U64,
    /// Block: tokens it covers. Commit and delete: tokens of the whole unit.
    pub tokens: U32,
    /// Block: its depth in the chain (1 for a first block). Commit: number of keys. Delete:
    /// zero.
    pub count: U32,
    /// Bytes of payload that follow the header page (before padding).
    pub payload_len: U64,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_ms: U64,
    /// Last use known when the record was written, milliseconds since the Unix epoch.
    pub last_used_ms: U64,
    /// CRC-32C of the `payload_len` payload bytes.
    pub payload_crc: U32,
    /// Zero.
    pub reserved1: [u8; 88],
    /// CRC-32C of bytes `0..252` of this header.
    pub header_crc: U32,
}

const _: () = assert!(size_of::<RawRecordHeader>() == RecordHeader::BYTES);

/// A validated record header (native values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecordHeader {
    /// What the record holds.
    pub kind: RecordKind,
    /// Feature bits.
    pub flags: RecordFlags,
    /// Store-wide sequence number.
    pub seq: u64,
    /// Segment the record was written into.
    pub segment: u64,
    /// Block key or unit key.
    pub key: Key,
    /// Parent key (blocks), zero (commits), or the horizon followed by zeros (deletes; read it
    /// with [`RecordHeader::delete_horizon`], write it with [`horizon_bytes`]).
    pub parent: Key,
    /// Model fingerprint.
    pub model: [u8; MODEL_BYTES],
    /// Tenant id.
    pub tenant: u64,
    /// Tokens of the block (blocks) or of the unit (commits, deletes).
    pub tokens: u32,
    /// Depth of the block (blocks), number of keys (commits) or zero (deletes).
    pub count: u32,
    /// Payload bytes.
    pub payload_len: u64,
    /// Creation time (ms since the epoch).
    pub created_ms: u64,
    /// Last use at write time (ms since the epoch).
    pub last_used_ms: u64,
    /// CRC-32C of the payload.
    pub payload_crc: u32,
}

impl RecordHeader {
    /// Bytes of the encoded header.
    pub const BYTES: usize = 256;
    /// Offset of the header CRC (it covers the bytes before it).
    pub const CRC_OFFSET: usize = 252;

    /// The encoded header with its CRC.
    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut raw = RawRecordHeader {
            magic: RECORD_MAGIC,
            version: U16::new(FORMAT_VERSION),
            header_len: U16::new(Self::BYTES as u16),
            flags: U32::new(self.flags.bits()),
            kind: self.kind.code(),
            reserved0: [0; 7],
            seq: U64::new(self.seq),
            segment: U64::new(self.segment),
            key: self.key,
            parent: self.parent,
            model: self.model,
            tenant: U64::new(self.tenant),
            tokens: U32::new(self.tokens),
            count: U32::new(self.count),
            payload_len: U64::new(self.payload_len),
            created_ms: U64::new(self.created_ms),
            last_used_ms: U64::new(self.last_used_ms),
            payload_crc: U32::new(self.payload_crc),
            reserved1: [0; 88],
            header_crc: U32::new(0),
        };
        let crc = crc32c(&raw.as_bytes()[..Self::CRC_OFFSET]);
        raw.header_crc = U32::new(crc);
        let mut out = [0u8; Self::BYTES];
        out.copy_from_slice(raw.as_bytes());
        out
    }

    /// Validates and decodes the header at the start of `bytes` (at least [`Self::BYTES`]
    /// long). Checks run before any arithmetic on a value read from disk (module docs).
    ///
    /// # Errors
    /// [`Error::RecordTruncated`], [`Error::RecordMagic`], [`Error::RecordVersion`],
    /// [`Error::RecordHeaderLength`], [`Error::RecordHeaderChecksum`], [`Error::RecordKind`],
    /// [`Error::RecordFlags`], [`Error::RecordReserved`], [`Error::RecordPayloadLength`].
    pub fn decode(bytes: &[u8]) -> Result<RecordHeader, Error> {
        let Some(head) = bytes.get(..Self::BYTES) else {
            return Err(Error::RecordTruncated {
                what: "record header",
                needed: Self::BYTES as u64,
                available: bytes.len() as u64,
            });
        };
        let raw = RawRecordHeader::read_from_bytes(head).map_err(|_| Error::RecordTruncated {
            what: "record header",
            needed: Self::BYTES as u64,
            available: head.len() as u64,
        })?;
        if raw.magic != RECORD_MAGIC {
            return Err(Error::RecordMagic {
                what: "record",
                found: raw.magic,
            });
        }
        if raw.version.get() != FORMAT_VERSION {
            return Err(Error::RecordVersion {
                found: raw.version.get(),
                supported: FORMAT_VERSION,
            });
        }
        if usize::from(raw.header_len.get()) != Self::BYTES {
            return Err(Error::RecordHeaderLength {
                found: raw.header_len.get(),
                expected: Self::BYTES as u16,
            });
        }
        let computed = crc32c(&head[..Self::CRC_OFFSET]);
        if raw.header_crc.get() != computed {
            return Err(Error::RecordHeaderChecksum {
                stored: raw.header_crc.get(),
                computed,
            });
        }
        let kind = RecordKind::from_code(raw.kind).ok_or(Error::RecordKind { code: raw.kind })?;
        let flags = RecordFlags::from_bits(raw.flags.get()).ok_or(Error::RecordFlags {
            bits: raw.flags.get(),
            supported: RecordFlags::SUPPORTED.bits(),
        })?;
        if raw.reserved0.iter().chain(&raw.reserved1).any(|&b| b != 0) {
            return Err(Error::RecordReserved);
        }
        let payload_len = raw.payload_len.get();
        if payload_len > MAX_PAYLOAD {
            return Err(Error::RecordPayloadLength {
                len: payload_len,
                reason: "exceeds the 1 GiB limit",
            });
        }
        let h = RecordHeader {
            kind,
            flags,
            seq: raw.seq.get(),
            segment: raw.segment.get(),
            key: raw.key,
            parent: raw.parent,
            model: raw.model,
            tenant: raw.tenant.get(),
            tokens: raw.tokens.get(),
            count: raw.count.get(),
            payload_len,
            created_ms: raw.created_ms.get(),
            last_used_ms: raw.last_used_ms.get(),
            payload_crc: raw.payload_crc.get(),
        };
        if kind == RecordKind::Commit {
            // The payload is exactly `count` keys; anything else is damage.
            if u64::from(h.count) == 0 || u64::from(h.count) * KEY_BYTES as u64 != payload_len {
                return Err(Error::RecordPayloadLength {
                    len: payload_len,
                    reason: "a commit's payload must be `count` (> 0) keys of 32 bytes",
                });
            }
        }
        if kind == RecordKind::Delete {
            if payload_len != 0 {
                return Err(Error::RecordPayloadLength {
                    len: payload_len,
                    reason: "a delete has no payload",
                });
            }
            if h.count != 0 || h.parent[8..].iter().any(|&b| b != 0) {
                return Err(Error::RecordReserved);
            }
            // The horizon is the sequence number of the original delete; a copy written by
            // compaction has a larger sequence number of its own, never a smaller one.
            let horizon = horizon_of(&h.parent);
            if horizon == 0 || horizon > h.seq {
                return Err(Error::RecordField {
                    field: "horizon",
                    reason: "a delete's horizon must be in 1..=seq",
                });
            }
        }
        Ok(h)
    }

    /// A delete's horizon: commits of its key with a smaller sequence number are deleted.
    /// `None` for other kinds.
    pub fn delete_horizon(&self) -> Option<u64> {
        (self.kind == RecordKind::Delete).then(|| horizon_of(&self.parent))
    }

    /// Bytes of the whole record on disk: the header page plus the payload rounded up to
    /// [`ALIGN`]. Checked: `payload_len` is bounded by [`MAX_PAYLOAD`] after [`Self::decode`].
    pub fn record_len(&self) -> u64 {
        record_len(self.payload_len)
    }

    /// Checks `payload` (exactly `payload_len` bytes) against the header's CRC.
    ///
    /// # Errors
    /// [`Error::RecordPayloadLength`], [`Error::RecordPayloadChecksum`].
    pub fn verify_payload(&self, payload: &[u8]) -> Result<(), Error> {
        if payload.len() as u64 != self.payload_len {
            return Err(Error::RecordPayloadLength {
                len: payload.len() as u64,
                reason: "differs from the header's payload length",
            });
        }
        let computed = crc32c(payload);
        if computed != self.payload_crc {
            return Err(Error::RecordPayloadChecksum {
                stored: self.payload_crc,
                computed,
            });
        }
        Ok(())
    }
}

/// The `parent` field of a delete whose horizon is `horizon` (the sequence number of the
/// original delete record; a copy made by compaction keeps it).
pub fn horizon_bytes(horizon: u64) -> Key {
    let mut k = [0u8; KEY_BYTES];
    k[..8].copy_from_slice(&horizon.to_le_bytes());
    k
}

fn horizon_of(parent: &Key) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&parent[..8]);
    u64::from_le_bytes(b)
}

/// Bytes on disk of a record with `payload_len` bytes of payload (header page + padded
/// payload). Saturates for lengths no valid header can declare.
pub const fn record_len(payload_len: u64) -> u64 {
    if payload_len > MAX_PAYLOAD {
        return u64::MAX;
    }
    // Cannot overflow: payload_len <= 2^30.
    RECORD_HEADER_PAGE as u64 + payload_len.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// Writes one whole record into `out` (at least [`record_len`] bytes): the header (with
/// `payload_len` and `payload_crc` filled in from `payload`), zeroes to the end of the header
/// page, the payload and zero padding. Returns the record's length.
///
/// # Errors
/// [`Error::RecordPayloadLength`] for a payload over [`MAX_PAYLOAD`] or an `out` too short.
pub fn encode_record(
    header: &RecordHeader,
    payload: &[u8],
    out: &mut [u8],
) -> Result<usize, Error> {
    encode_record_with_crc(header, payload, crc32c(payload), out)
}

/// [`encode_record`] with the payload's checksum already computed (`payload_crc` must be
/// [`crc32c()`]`(payload)`), so that a writer can take it from whoever produced the payload
/// while the bytes were in cache. A wrong value is not trusted blindly: readers verify the
/// payload against it, so such a record reads as damaged. Debug builds check it here.
///
/// # Errors
/// As [`encode_record`].
pub fn encode_record_with_crc(
    header: &RecordHeader,
    payload: &[u8],
    payload_crc: u32,
    out: &mut [u8],
) -> Result<usize, Error> {
    debug_assert_eq!(
        payload_crc,
        crc32c(payload),
        "encode_record_with_crc: wrong CRC"
    );
    let payload_len = payload.len() as u64;
    if payload_len > MAX_PAYLOAD {
        return Err(Error::RecordPayloadLength {
            len: payload_len,
            reason: "exceeds the 1 GiB limit",
        });
    }
    let len = record_len(payload_len) as usize;
    let Some(out) = out.get_mut(..len) else {
        return Err(Error::RecordPayloadLength {
            len: payload_len,
            reason: "the output buffer is shorter than the record",
        });
    };
    let h = RecordHeader {
        payload_len,
        payload_crc,
        ..*header
    };
    let (page, body) = out.split_at_mut(RECORD_HEADER_PAGE);
    let (head, rest) = page.split_at_mut(RecordHeader::BYTES);
    head.copy_from_slice(&h.encode());
    rest.fill(0);
    let (data, pad) = body.split_at_mut(payload.len());
    data.copy_from_slice(payload);
    pad.fill(0);
    Ok(len)
}

/// Splits a commit payload into its keys. Only valid for a payload whose length
/// [`RecordHeader::decode`] and [`RecordHeader::verify_payload`] accepted.
pub fn commit_keys(payload: &[u8]) -> impl Iterator<Item = Key> + '_ {
    payload
        .chunks_exact(KEY_BYTES)
        .filter_map(|c| <Key>::try_from(c).ok())
}

// ---------------------------------------------------------------------------------------------
// Segment header

/// The first 128 bytes of a segment, exactly as on disk.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned)]
#[repr(C)]
pub struct RawSegmentHeader {
    /// [`SEGMENT_MAGIC`].
    pub magic: [u8; 8],
    /// [`FORMAT_VERSION`].
    pub version: U16,
    /// Bytes of this header, [`SegmentHeader::BYTES`].
    pub header_len: U16,
    /// Zero (no segment flags are defined).
    pub flags: U32,
    /// Segment id, unique for the life of the store.
    pub segment: U64,
    /// Bytes of the segment, header page included.
    pub segment_bytes: U64,
    /// Creation time, ms since the epoch.
    pub created_ms: U64,
    /// Sequence number of the store when the segment was opened: every record in it has a
    /// larger one.
    pub first_seq: U64,
    /// Random id shared by every segment of one store, so segments of two stores never mix.
    pub store_id: [u8; 16],
    /// Zero.
    pub reserved: [u8; 60],
    /// CRC-32C of bytes `0..124`.
    pub header_crc: U32,
}

const _: () = assert!(size_of::<RawSegmentHeader>() == SegmentHeader::BYTES);

/// A validated segment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentHeader {
    /// Segment id.
    pub segment: u64,
    /// Bytes of the segment.
    pub segment_bytes: u64,
    /// Creation time (ms since the epoch).
    pub created_ms: u64,
    /// Every record in the segment has a larger sequence number.
    pub first_seq: u64,
    /// The store's id.
    pub store_id: [u8; 16],
}

impl SegmentHeader {
    /// Bytes of the encoded header.
    pub const BYTES: usize = 128;
    /// Offset of the header CRC.
    pub const CRC_OFFSET: usize = 124;

    /// The encoded header with its CRC.
    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut raw = RawSegmentHeader {
            magic: SEGMENT_MAGIC,
            version: U16::new(FORMAT_VERSION),
            header_len: U16::new(Self::BYTES as u16),
            flags: U32::new(0),
            segment: U64::new(self.segment),
            segment_bytes: U64::new(self.segment_bytes),
            created_ms: U64::new(self.created_ms),
            first_seq: U64::new(self.first_seq),
            store_id: self.store_id,
            reserved: [0; 60],
            header_crc: U32::new(0),
        };
        raw.header_crc = U32::new(crc32c(&raw.as_bytes()[..Self::CRC_OFFSET]));
        let mut out = [0u8; Self::BYTES];
        out.copy_from_slice(raw.as_bytes());
        out
    }

    /// Validates and decodes a segment header.
    ///
    /// # Errors
    /// [`Error::RecordTruncated`], [`Error::RecordMagic`], [`Error::RecordVersion`],
    /// [`Error::RecordHeaderLength`], [`Error::RecordHeaderChecksum`], [`Error::RecordFlags`],
    /// [`Error::RecordReserved`], [`Error::SegmentSize`].
    pub fn decode(bytes: &[u8]) -> Result<SegmentHeader, Error> {
        let truncated = || Error::RecordTruncated {
            what: "segment header",
            needed: Self::BYTES as u64,
            available: bytes.len() as u64,
        };
        let head = bytes.get(..Self::BYTES).ok_or_else(truncated)?;
        let raw = RawSegmentHeader::read_from_bytes(head).map_err(|_| truncated())?;
        if raw.magic != SEGMENT_MAGIC {
            return Err(Error::RecordMagic {
                what: "segment",
                found: raw.magic,
            });
        }
        if raw.version.get() != FORMAT_VERSION {
            return Err(Error::RecordVersion {
                found: raw.version.get(),
                supported: FORMAT_VERSION,
            });
        }
        if usize::from(raw.header_len.get()) != Self::BYTES {
            return Err(Error::RecordHeaderLength {
                found: raw.header_len.get(),
                expected: Self::BYTES as u16,
            });
        }
        let computed = crc32c(&head[..Self::CRC_OFFSET]);
        if raw.header_crc.get() != computed {
            return Err(Error::RecordHeaderChecksum {
                stored: raw.header_crc.get(),
                computed,
            });
        }
        if raw.flags.get() != 0 {
            return Err(Error::RecordFlags {
                bits: raw.flags.get(),
                supported: 0,
            });
        }
        if raw.reserved.iter().any(|&b| b != 0) {
            return Err(Error::RecordReserved);
        }
        let segment_bytes = raw.segment_bytes.get();
        if segment_bytes < 2 * ALIGN as u64 || !segment_bytes.is_multiple_of(ALIGN as u64) {
            return Err(Error::SegmentSize {
                bytes: segment_bytes,
            });
        }
        Ok(SegmentHeader {
            segment: raw.segment.get(),
            segment_bytes,
            created_ms: raw.created_ms.get(),
            first_seq: raw.first_seq.get(),
            store_id: raw.store_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> RecordHeader {
        RecordHeader {
            kind: RecordKind::Block,
            flags: RecordFlags::TOKEN_IDS,
            seq: 7,
            segment: 3,
            key: [1; 32],
            parent: [2; 32],
            model: [3; 16],
            tenant: 0xDEAD_BEEF,
            tokens: 256,
            count: 4,
            payload_len: 0,
            created_ms: 1_700_000_000_000,
            last_used_ms: 1_700_000_000_500,
            payload_crc: 0,
        }
    }

    #[test]
    fn record_roundtrips_and_is_aligned() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut buf = vec![0xFFu8; 5 * ALIGN];
        let len = encode_record(&header(), &payload, &mut buf).unwrap();
        assert_eq!(len, ALIGN + 12_288);
        let h = RecordHeader::decode(&buf).unwrap();
        assert_eq!(h.payload_len, 10_000);
        assert_eq!(h.record_len(), len as u64);
        assert_eq!(
            RecordHeader {
                payload_len: 0,
                payload_crc: 0,
                ..h
            },
            header()
        );
        h.verify_payload(&buf[ALIGN..ALIGN + 10_000]).unwrap();
        // Header page and payload padding are zero.
        assert!(buf[RecordHeader::BYTES..ALIGN].iter().all(|&b| b == 0));
        assert!(buf[ALIGN + 10_000..len].iter().all(|&b| b == 0));
        // With the checksum computed elsewhere: the same bytes.
        let mut other = vec![0x55u8; 5 * ALIGN];
        let n = encode_record_with_crc(&header(), &payload, crc32c(&payload), &mut other).unwrap();
        assert_eq!(n, len);
        assert_eq!(other[..len], buf[..len]);
    }

    #[test]
    fn flag_bits_are_the_on_disk_values() {
        assert_eq!(RecordFlags::EMPTY.bits(), 0);
        assert_eq!(RecordFlags::TOKEN_IDS.bits(), 1);
        assert_eq!(RecordFlags::RELOCATED.bits(), 2);
        assert_eq!(RecordFlags::TOUCH.bits(), 4);
        assert_eq!(RecordFlags::SUPPORTED.bits(), 0b111);
        assert_eq!(
            RecordFlags::from_bits(0b101),
            Some(RecordFlags::TOKEN_IDS.union(RecordFlags::TOUCH))
        );
        assert_eq!(RecordFlags::from_bits(0b1000), None);
        assert_eq!(RecordFlags::from_bits(1 << 31 | 1), None);
        let h = RecordHeader {
            flags: RecordFlags::SUPPORTED,
            ..header()
        };
        assert_eq!(h.encode()[12..16], [0b111, 0, 0, 0]);
    }

    #[test]
    fn every_header_byte_is_covered_by_the_crc() {
        let enc = header().encode();
        for i in 0..RecordHeader::BYTES {
            let mut bad = enc;
            bad[i] ^= 0x10;
            assert!(RecordHeader::decode(&bad).is_err(), "flip at byte {i}");
        }
    }

    #[test]
    fn specific_rejections() {
        let enc = header().encode();
        assert!(matches!(
            RecordHeader::decode(&enc[..100]),
            Err(Error::RecordTruncated { .. })
        ));
        let mut bad = enc;
        bad[0] = b'X';
        assert!(matches!(
            RecordHeader::decode(&bad),
            Err(Error::RecordMagic { .. })
        ));
        // Unknown flag bit with a valid CRC: refused by the SUPPORTED mask.
        let mut raw = RawRecordHeader::read_from_bytes(&enc[..]).unwrap();
        raw.flags = U32::new(1 << 9);
        let crc = crc32c(&raw.as_bytes()[..RecordHeader::CRC_OFFSET]);
        raw.header_crc = U32::new(crc);
        assert!(matches!(
            RecordHeader::decode(raw.as_bytes()),
            Err(Error::RecordFlags { bits: 512, .. })
        ));
        // A huge payload length with a valid CRC: refused before any arithmetic.
        raw.flags = U32::new(0);
        raw.payload_len = U64::new(u64::MAX);
        raw.header_crc = U32::new(crc32c(&raw.as_bytes()[..RecordHeader::CRC_OFFSET]));
        assert!(matches!(
            RecordHeader::decode(raw.as_bytes()),
            Err(Error::RecordPayloadLength { .. })
        ));
        // A commit whose payload is not `count` keys.
        let c = RecordHeader {
            kind: RecordKind::Commit,
            count: 2,
            payload_len: 63,
            ..header()
        };
        assert!(matches!(
            RecordHeader::decode(&c.encode()),
            Err(Error::RecordPayloadLength { .. })
        ));
    }

    fn delete() -> RecordHeader {
        RecordHeader {
            kind: RecordKind::Delete,
            flags: RecordFlags::EMPTY,
            parent: horizon_bytes(7),
            count: 0,
            payload_len: 0,
            payload_crc: crc32c(&[]),
            ..header()
        }
    }

    #[test]
    fn delete_records_roundtrip_and_reject_what_they_cannot_hold() {
        let mut buf = vec![0xFFu8; ALIGN];
        assert_eq!(encode_record(&delete(), &[], &mut buf).unwrap(), ALIGN);
        let h = RecordHeader::decode(&buf).unwrap();
        assert_eq!(h, delete());
        assert_eq!(h.delete_horizon(), Some(7));
        assert_eq!(h.record_len(), ALIGN as u64);
        assert_eq!(buf[16], 3, "kind byte");
        assert_eq!(buf[72..80], 7u64.to_le_bytes());
        assert_eq!(header().delete_horizon(), None);
        // A copy by compaction keeps the horizon below its own sequence number.
        let copy = RecordHeader {
            seq: 90,
            flags: RecordFlags::RELOCATED,
            ..delete()
        };
        assert_eq!(
            RecordHeader::decode(&copy.encode())
                .unwrap()
                .delete_horizon(),
            Some(7)
        );
        for bad in [
            RecordHeader {
                payload_len: 32,
                ..delete()
            },
            RecordHeader {
                count: 1,
                ..delete()
            },
            RecordHeader {
                parent: [1; 32],
                ..delete()
            },
            RecordHeader {
                parent: horizon_bytes(0),
                ..delete()
            },
            RecordHeader {
                parent: horizon_bytes(8),
                ..delete()
            },
        ] {
            assert!(RecordHeader::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        // Kinds after `Delete` are still refused.
        let mut raw = RawRecordHeader::read_from_bytes(&delete().encode()[..]).unwrap();
        raw.kind = 4;
        raw.header_crc = U32::new(crc32c(&raw.as_bytes()[..RecordHeader::CRC_OFFSET]));
        assert!(matches!(
            RecordHeader::decode(raw.as_bytes()),
            Err(Error::RecordKind { code: 4 })
        ));
    }

    #[test]
    fn payload_damage_is_detected() {
        let payload = vec![9u8; 300];
        let mut buf = vec![0u8; 2 * ALIGN];
        encode_record(&header(), &payload, &mut buf).unwrap();
        let h = RecordHeader::decode(&buf).unwrap();
        buf[ALIGN + 299] ^= 1;
        assert!(matches!(
            h.verify_payload(&buf[ALIGN..ALIGN + 300]),
            Err(Error::RecordPayloadChecksum { .. })
        ));
    }

    #[test]
    fn segment_header_roundtrips_and_rejects() {
        let s = SegmentHeader {
            segment: 5,
            segment_bytes: 1 << 20,
            created_ms: 9,
            first_seq: 100,
            store_id: [7; 16],
        };
        let enc = s.encode();
        assert_eq!(SegmentHeader::decode(&enc).unwrap(), s);
        for i in 0..SegmentHeader::BYTES {
            let mut bad = enc;
            bad[i] ^= 1;
            assert!(SegmentHeader::decode(&bad).is_err(), "flip at byte {i}");
        }
    }

    proptest! {
        // The parsers never panic and never accept arbitrary bytes.
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = RecordHeader::decode(&bytes);
            let _ = SegmentHeader::decode(&bytes);
        }

        #[test]
        fn decode_of_mutated_header_never_panics(i in 0usize..256, x in 1u8..=255) {
            let mut enc = header().encode();
            enc[i] ^= x;
            prop_assert!(RecordHeader::decode(&enc).is_err());
        }
    }
}
