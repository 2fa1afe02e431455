//! Reading segments back: the recovery scan that rebuilds the index on open, and the record
//! checks of `kvstack store fsck` and `inspect`.
//!
//! A segment is read front to back in large chunks (several in flight). At each 4 KiB
//! boundary the scanner tries a record header:
//! - valid, of this segment: the payload is checked against its CRC and the scanner moves past
//!   the whole record (a valid header's length is trusted: allocation is sequential, so the
//!   next record starts there even if this one's payload never reached the disk);
//! - valid but of another segment id (bytes a device slot held in an earlier life): skipped page
//!   by page, never trusted for a length;
//! - an all-zero page: unwritten space, skipped;
//! - anything else: damage, skipped page by page (consecutive pages are one report).
//!
//! Damage after the segment's last valid record is a **torn tail** (a write cut short by a
//! crash) and is discarded quietly; damage followed by valid records is reported with its
//! location.

use std::path::PathBuf;

use kvstack_driver::blockio::{BlockEngine, BufferPool, Completion, IoOp, IoTarget, OpKind};
use kvstack_firmware_interface::record::{
    ALIGN, Key, RecordHeader, RecordKind, SEGMENT_HEADER_PAGE, SegmentHeader, commit_keys,
};
use serde::Serialize;

use crate::key::key_hex;

/// A record that passed every check.
#[derive(Clone, Debug)]
pub struct ScannedRecord {
    /// Its header.
    pub header: RecordHeader,
    /// Offset of the record in its segment.
    pub offset: u64,
    /// A commit's keys, first block to last (empty for blocks).
    pub keys: Vec<Key>,
}

/// Bytes that failed a check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Damage {
    /// The segment file (or device).
    pub path: PathBuf,
    /// Segment id when its header was valid.
    pub segment: Option<u64>,
    /// Byte offset in `path`.
    pub offset: u64,
    /// Bytes affected.
    pub bytes: u64,
    /// The record's kind, when its header was readable.
    pub kind: Option<&'static str>,
    /// The first bytes of its key (hex), when its header was readable.
    pub key: Option<String>,
    /// What failed.
    pub reason: String,
    /// Whether it lies after the segment's last valid record (a write cut short by a crash).
    pub torn_tail: bool,
}

/// What a scan of one segment slot found.
#[derive(Debug)]
pub struct SegmentScan {
    /// The file (or device).
    pub path: PathBuf,
    /// Slot (device) or id from the file name (directory).
    pub slot: u64,
    /// The segment header, when valid.
    pub header: Option<SegmentHeader>,
    /// Why the header is not valid (None when it is, or when the slot is simply empty).
    pub header_error: Option<String>,
    /// Valid records in file order.
    pub records: Vec<ScannedRecord>,
    /// Damaged and torn ranges.
    pub damage: Vec<Damage>,
    /// End of the last valid record (relative to the segment).
    pub end: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

/// Sequential chunked reader over one byte range of a file, several chunks in flight.
struct ChunkReader<'a> {
    engine: &'a mut dyn BlockEngine,
    pool: &'a BufferPool,
    target: IoTarget,
    base: u64,
    len: u64,
    /// Next chunk offset to submit (relative).
    next_submit: u64,
    /// Completed chunks keyed by offset, waiting for their turn.
    ready: Vec<(u64, Completion)>,
    /// Contiguous bytes `[win_start, win_start + window.len())`.
    window: Vec<u8>,
    win_start: u64,
    /// The file ended (short read) at this relative offset.
    eof: Option<u64>,
    bytes_read: u64,
    error: Option<std::io::Error>,
}

impl<'a> ChunkReader<'a> {
    fn new(
        engine: &'a mut dyn BlockEngine,
        pool: &'a BufferPool,
        target: IoTarget,
        base: u64,
        len: u64,
        start: u64,
    ) -> Self {
        ChunkReader {
            engine,
            pool,
            target,
            base,
            len,
            next_submit: start,
            ready: Vec::new(),
            window: Vec::new(),
            win_start: start,
            eof: None,
            bytes_read: 0,
            error: None,
        }
    }

    fn chunk(&self) -> u64 {
        self.pool.slot_bytes() as u64
    }

    fn submit_more(&mut self) {
        while self.error.is_none()
            && self.eof.is_none()
            && self.next_submit < self.len
            && self.engine.in_flight() < self.engine.depth()
            && self.ready.len() + self.engine.in_flight() < self.pool.slots()
        {
            let Some(buf) = self.pool.try_get() else {
                return;
            };
            let n = self.chunk().min(self.len - self.next_submit);
            let op = IoOp {
                kind: OpKind::Read,
                target: self.target.clone(),
                offset: self.base + self.next_submit,
                len: n as usize,
                buf,
                tag: self.next_submit,
            };
            if let Err(e) = self.engine.submit(op) {
                self.error = Some(e.error);
                return;
            }
            self.next_submit += n;
        }
    }

    /// Makes `[off, off + n)` available in the window; returns false at the end of the data.
    fn fill(&mut self, off: u64, n: u64) -> bool {
        // Drop what lies before `off`, in large steps (draining the front of a Vec moves the
        // rest, so doing it per page would be quadratic).
        if off > self.win_start {
            let drop_n = ((off - self.win_start) as usize).min(self.window.len());
            if drop_n >= self.window.len() / 2 && drop_n > 0 {
                self.window.drain(..drop_n);
                self.win_start += drop_n as u64;
            }
        }
        if off < self.win_start {
            return false;
        }
        loop {
            let have_end = self.win_start + self.window.len() as u64;
            if have_end >= off + n {
                return true;
            }
            if self.eof.is_some_and(|e| e <= have_end) || have_end >= self.len {
                return false;
            }
            // The next chunk in order.
            if let Some(pos) = self.ready.iter().position(|(o, _)| *o == have_end) {
                let (_, c) = self.ready.swap_remove(pos);
                let got = match &c.result {
                    Ok(g) => *g,
                    Err(e) => {
                        self.error = Some(std::io::Error::new(e.kind(), e.to_string()));
                        0
                    }
                };
                self.bytes_read += got as u64;
                self.window
                    .extend_from_slice(c.op.buf.as_slice().get(..got).unwrap_or_default());
                if got < c.op.len {
                    self.eof = Some(have_end + got as u64);
                }
                continue;
            }
            self.submit_more();
            if self.engine.in_flight() == 0 {
                return false;
            }
            let mut out = Vec::new();
            if let Err(e) = self.engine.wait(1, &mut out) {
                self.error = Some(e);
                return false;
            }
            for c in out {
                let off = c.op.tag;
                self.ready.push((off, c));
            }
        }
    }

    fn get(&self, off: u64, n: u64) -> &[u8] {
        let s = (off - self.win_start) as usize;
        self.window.get(s..s + n as usize).unwrap_or_default()
    }

    /// Reaps everything still in flight (buffers return to the pool).
    fn finish(self) -> (u64, Option<std::io::Error>) {
        let mut out = Vec::new();
        while self.engine.in_flight() > 0 {
            if self.engine.wait(self.engine.in_flight(), &mut out).is_err() {
                break;
            }
            out.clear();
        }
        (self.bytes_read, self.error)
    }
}

/// Scans one segment slot (module docs). `bytes` is the slot's size on a device, or the file's
/// size (rounded up to 4 KiB) in a directory, where the header's segment size is what counts:
/// a shorter file is reported as truncated.
#[allow(clippy::too_many_arguments)]
pub(crate) fn scan_segment(
    engine: &mut dyn BlockEngine,
    pool: &BufferPool,
    path: PathBuf,
    target: IoTarget,
    slot: u64,
    base: u64,
    bytes: u64,
    store_id: Option<[u8; 16]>,
    device: bool,
) -> SegmentScan {
    let mut scan = SegmentScan {
        path: path.clone(),
        slot,
        header: None,
        header_error: None,
        records: Vec::new(),
        damage: Vec::new(),
        end: SEGMENT_HEADER_PAGE as u64,
        bytes_read: 0,
    };
    let page = ALIGN as u64;
    // A device slot's header page is read alone first: most slots of a large device are
    // free, and reading their whole segment would make recovery scale with the device
    // instead of the data. The rest is read once the header is valid.
    let first = if device { page.min(bytes) } else { bytes };
    let mut reader = ChunkReader::new(engine, pool, target, base, first, 0);
    if !reader.fill(0, page) {
        let (read, err) = reader.finish();
        scan.bytes_read = read;
        scan.header_error = match err {
            Some(e) => Some(format!("cannot read the segment header: {e}")),
            // An empty file is what a crash leaves between creating a segment file and
            // preallocating it (found by the crash campaign): like a zero header page, not
            // damage. A file of 1 to 4095 bytes is never left by a crash (preallocation
            // sizes it whole): it was truncated.
            None if read == 0 => None,
            None => Some("shorter than one page".to_owned()),
        };
        return scan;
    }
    let head = reader.get(0, page);
    let header = match SegmentHeader::decode(head) {
        Ok(h) => h,
        Err(e) => {
            if head.iter().any(|&b| b != 0) {
                scan.header_error = Some(format!("segment header: {e}"));
            } else if !device
                && reader.fill(page, page)
                && reader.get(page, page).iter().any(|&b| b != 0)
            {
                // A zero header page is what a crash leaves in a directory file created just
                // before it (the header is written before any record, into a file of zeros),
                // and such a file is removed. With bytes after it, the header was lost
                // (zeroed): report it, and keep the file, rather than drop its records
                // silently. Device slots are exempt: a freed slot is a zeroed header page in
                // front of its earlier life's records.
                scan.header_error = Some(
                    "the segment header page is zero but records follow (header lost)".to_owned(),
                );
            }
            let (read, _) = reader.finish();
            scan.bytes_read = read;
            return scan;
        }
    };
    if store_id.is_some_and(|s| s != header.store_id) {
        scan.header_error = Some("segment of another store (store id differs)".to_owned());
        let (read, _) = reader.finish();
        scan.bytes_read = read;
        return scan;
    }
    scan.header = Some(header);
    let seg_bytes = if device {
        header.segment_bytes.min(bytes)
    } else {
        header.segment_bytes
    };
    reader.len = seg_bytes;
    let mut pending: Vec<Damage> = Vec::new();
    let damage = |off: u64, n: u64, h: Option<&RecordHeader>, reason: String| Damage {
        path: path.clone(),
        segment: Some(header.segment),
        offset: base + off,
        bytes: n,
        kind: h.map(|h| h.kind.name()),
        key: h.map(|h| key_hex(&h.key, 8)),
        reason,
        torn_tail: false,
    };
    let mut p = page;
    while p + page <= seg_bytes {
        if !reader.fill(p, page) {
            if let Some(e) = reader.error.take() {
                pending.push(damage(p, seg_bytes - p, None, format!("read failed: {e}")));
            } else if reader.eof.is_some_and(|e| e < seg_bytes) {
                pending.push(damage(
                    p,
                    seg_bytes - p,
                    None,
                    "segment file is truncated".to_owned(),
                ));
            }
            break;
        }
        let head = reader.get(p, page);
        match RecordHeader::decode(head) {
            Ok(h) if h.segment == header.segment && h.seq > header.first_seq => {
                let len = h.record_len();
                if p + len > seg_bytes {
                    pending.push(damage(
                        p,
                        seg_bytes - p,
                        Some(&h),
                        format!("record of {len} bytes runs past the segment end"),
                    ));
                    break;
                }
                if !reader.fill(p, len) {
                    pending.push(damage(
                        p,
                        len,
                        Some(&h),
                        "record is cut off (segment file truncated)".to_owned(),
                    ));
                    break;
                }
                let rec = reader.get(p, len);
                let payload = rec
                    .get(ALIGN..ALIGN + h.payload_len as usize)
                    .unwrap_or_default();
                match h.verify_payload(payload) {
                    Ok(()) => {
                        let keys = if h.kind == RecordKind::Commit {
                            commit_keys(payload).collect()
                        } else {
                            Vec::new()
                        };
                        // Damage followed by a valid record is not a torn tail.
                        scan.damage.append(&mut pending);
                        scan.records.push(ScannedRecord {
                            header: h,
                            offset: p,
                            keys,
                        });
                        scan.end = p + len;
                    }
                    Err(e) => pending.push(damage(p, len, Some(&h), format!("payload: {e}"))),
                }
                p += len;
            }
            Ok(_) => {
                // A valid header from an earlier life of this slot: not ours, not damage.
                p += page;
            }
            Err(e) => {
                if head.iter().any(|&b| b != 0) {
                    match pending.last_mut() {
                        Some(d) if d.offset + d.bytes == base + p && d.kind.is_none() => {
                            d.bytes += page;
                        }
                        _ => pending.push(damage(p, page, None, format!("record header: {e}"))),
                    }
                }
                p += page;
            }
        }
    }
    for mut d in pending {
        d.torn_tail = true;
        scan.damage.push(d);
    }
    let (read, _) = reader.finish();
    scan.bytes_read = read;
    scan
}
