//! `kvstack store fsck` and `inspect`: every record of a store checked and listed, without
//! opening it for writing.

use std::collections::HashMap;

use kvstack_driver::blockio::EngineChoice;
use kvstack_firmware_interface::record::{Key, RecordKind};
use serde::Serialize;

use crate::Result;
use crate::key::key_hex;
use crate::scan::Damage;
use crate::segment::StoreLocation;
use crate::store::{StoreOptions, scan_location};

/// What `fsck` found.
#[derive(Clone, Debug, Serialize)]
pub struct FsckReport {
    /// The store.
    pub location: StoreLocation,
    /// The engine used to read it.
    pub engine: EngineChoice,
    /// Segments with a valid header.
    pub segments: u64,
    /// Valid records.
    pub records: u64,
    /// Valid block records.
    pub blocks: u64,
    /// Valid commit records.
    pub commits: u64,
    /// Valid delete records.
    pub deletes: u64,
    /// Units whose newest record is a delete (not restored by an open).
    pub units_deleted: u64,
    /// Units whose commit names only present, valid, correctly chained blocks.
    pub units_complete: u64,
    /// Their keys, sorted (the units an open of the store serves). Left out of the JSON
    /// output: a large store has millions.
    #[serde(skip)]
    pub complete_keys: Vec<Key>,
    /// Units that are not complete (a block missing, damaged or mis-chained), with the
    /// location of their newest commit. After a crash these are units whose data never
    /// reached the disk; otherwise they point at damage.
    pub units_incomplete: Vec<String>,
    /// Damage before valid records: real damage, with its location.
    pub damaged: Vec<Damage>,
    /// Records cut short after the last valid record of a segment (a crash during a write).
    pub torn: Vec<Damage>,
    /// Slots whose header is damaged or belongs elsewhere.
    pub invalid_segments: Vec<String>,
    /// Bytes read.
    pub bytes_read: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Set when the store was read while another process writes it (a read-only open that
    /// found the location's write lock held): who writes it. Such a read is a snapshot of a
    /// moving store: units written meanwhile may be missing or end in torn tails.
    pub live_writers: Option<String>,
}

impl FsckReport {
    /// Whether no damage was found (torn tails and incomplete units after a crash are not
    /// damage).
    pub fn clean(&self) -> bool {
        self.damaged.is_empty() && self.invalid_segments.is_empty()
    }
}

/// One segment in `inspect`.
#[derive(Clone, Debug, Serialize)]
pub struct SegmentSummary {
    /// The file (or device).
    pub path: String,
    /// Slot (device) or id from the file name.
    pub slot: u64,
    /// Segment id.
    pub id: Option<u64>,
    /// Creation time (ms since the epoch).
    pub created_ms: Option<u64>,
    /// Valid records.
    pub records: u64,
    /// End of the last valid record.
    pub written_bytes: u64,
    /// Damaged or torn ranges.
    pub damaged_ranges: u64,
    /// Why its header is invalid, if it is.
    pub header_error: Option<String>,
}

/// One record in `inspect`.
#[derive(Clone, Debug, Serialize)]
pub struct RecordSummary {
    /// Segment id.
    pub segment: u64,
    /// Offset in the segment.
    pub offset: u64,
    /// `block`, `commit` or `delete`.
    pub kind: &'static str,
    /// Sequence number.
    pub seq: u64,
    /// Key (hex).
    pub key: String,
    /// Parent key of a block (hex, first 8 bytes).
    pub parent: Option<String>,
    /// Tenant id.
    pub tenant: u64,
    /// Tokens of the block or unit.
    pub tokens: u32,
    /// Depth (block) or number of keys (commit).
    pub count: u32,
    /// Payload bytes.
    pub payload_len: u64,
    /// Flag bits.
    pub flags: u32,
    /// A delete's horizon: commits of its key with a smaller sequence number are deleted.
    pub horizon: Option<u64>,
    /// Creation time (ms).
    pub created_ms: u64,
    /// Last use recorded (ms).
    pub last_used_ms: u64,
}

/// What `inspect` lists.
#[derive(Clone, Debug, Serialize)]
pub struct InspectReport {
    /// The store.
    pub location: StoreLocation,
    /// Every segment slot.
    pub segments: Vec<SegmentSummary>,
    /// Every valid record (when asked for).
    pub records: Vec<RecordSummary>,
    /// Set when the store was read while another process writes it (a read-only open that
    /// found the location's write lock held): who writes it. Such a read is a snapshot of a
    /// moving store: units written meanwhile may be missing or end in torn tails.
    pub live_writers: Option<String>,
}

fn read_only(opts: &StoreOptions) -> StoreOptions {
    StoreOptions {
        read_only: true,
        ..opts.clone()
    }
}

/// Checks every record of the store at `opts.location` (read-only).
///
/// # Errors
/// An unusable location or I/O set-up failures.
pub fn fsck(opts: &StoreOptions) -> Result<FsckReport> {
    let scan = scan_location(&read_only(opts))?;
    let mut r = FsckReport {
        location: opts.location.clone(),
        engine: scan.choice.clone(),
        segments: 0,
        records: 0,
        blocks: 0,
        commits: 0,
        deletes: 0,
        units_deleted: 0,
        units_complete: 0,
        complete_keys: Vec::new(),
        units_incomplete: Vec::new(),
        damaged: Vec::new(),
        torn: Vec::new(),
        invalid_segments: Vec::new(),
        bytes_read: 0,
        seconds: scan.seconds,
        live_writers: scan.space.live_description(),
    };
    // key -> (depth, parent) of every valid block; commits with their location.
    let mut blocks: HashMap<Key, (u32, Key)> = HashMap::new();
    let mut commits: HashMap<Key, (u64, String, Vec<Key>)> = HashMap::new();
    // key -> the horizon of its newest delete.
    let mut horizons: HashMap<Key, u64> = HashMap::new();
    for s in &scan.scans {
        r.bytes_read += s.bytes_read;
        for d in &s.damage {
            if d.torn_tail {
                r.torn.push(d.clone());
            } else {
                r.damaged.push(d.clone());
            }
        }
        let Some(h) = s.header else {
            if let Some(e) = &s.header_error {
                r.invalid_segments
                    .push(format!("{} (slot {}): {e}", s.path.display(), s.slot));
            }
            continue;
        };
        r.segments += 1;
        for rec in &s.records {
            r.records += 1;
            match rec.header.kind {
                RecordKind::Block => {
                    r.blocks += 1;
                    blocks.insert(rec.header.key, (rec.header.count, rec.header.parent));
                }
                RecordKind::Commit => {
                    r.commits += 1;
                    let at = format!(
                        "{} segment {} offset {}",
                        s.path.display(),
                        h.segment,
                        rec.offset
                    );
                    let newer = commits
                        .get(&rec.header.key)
                        .is_none_or(|(seq, _, _)| *seq < rec.header.seq);
                    if newer {
                        commits.insert(rec.header.key, (rec.header.seq, at, rec.keys.clone()));
                    }
                }
                RecordKind::Delete => {
                    r.deletes += 1;
                    let h = horizons.entry(rec.header.key).or_default();
                    *h = (*h).max(rec.header.delete_horizon().unwrap_or(0));
                }
            }
        }
    }
    for (end, (seq, at, keys)) in &commits {
        // As an open does: a unit whose newest commit is older than a delete of it is deleted.
        if horizons.get(end).is_some_and(|h| h > seq) {
            r.units_deleted += 1;
            continue;
        }
        let mut problem = None;
        if keys.last() != Some(end) {
            problem = Some("its last key is not the unit key".to_owned());
        }
        for (i, k) in keys.iter().enumerate() {
            if problem.is_some() {
                break;
            }
            match blocks.get(k) {
                None => problem = Some(format!("block {i} ({}) is missing", key_hex(k, 8))),
                Some((depth, parent)) => {
                    if *depth as usize != i + 1 || (i > 0 && keys.get(i - 1) != Some(parent)) {
                        problem = Some(format!("block {i} ({}) is mis-chained", key_hex(k, 8)));
                    }
                }
            }
        }
        match problem {
            None => r.complete_keys.push(*end),
            Some(p) => r
                .units_incomplete
                .push(format!("unit {} at {at}: {p}", key_hex(end, 8))),
        }
    }
    r.complete_keys.sort_unstable();
    r.units_complete = r.complete_keys.len() as u64;
    r.units_incomplete.sort();
    Ok(r)
}

/// Lists the segments (and, with `records`, every valid record) of a store (read-only).
///
/// # Errors
/// As [`fsck`].
pub fn inspect(opts: &StoreOptions, records: bool) -> Result<InspectReport> {
    let scan = scan_location(&read_only(opts))?;
    let mut out = InspectReport {
        location: opts.location.clone(),
        segments: Vec::new(),
        records: Vec::new(),
        live_writers: scan.space.live_description(),
    };
    for s in &scan.scans {
        if s.header.is_none() && s.header_error.is_none() {
            continue; // an empty device slot
        }
        out.segments.push(SegmentSummary {
            path: s.path.display().to_string(),
            slot: s.slot,
            id: s.header.map(|h| h.segment),
            created_ms: s.header.map(|h| h.created_ms),
            records: s.records.len() as u64,
            written_bytes: s.end,
            damaged_ranges: s.damage.len() as u64,
            header_error: s.header_error.clone(),
        });
        if records && let Some(h) = s.header {
            for rec in &s.records {
                let rh = &rec.header;
                out.records.push(RecordSummary {
                    segment: h.segment,
                    offset: rec.offset,
                    kind: rh.kind.name(),
                    seq: rh.seq,
                    key: key_hex(&rh.key, 32),
                    parent: (rh.kind == RecordKind::Block).then(|| key_hex(&rh.parent, 8)),
                    tenant: rh.tenant,
                    tokens: rh.tokens,
                    count: rh.count,
                    payload_len: rh.payload_len,
                    flags: rh.flags.bits(),
                    horizon: rh.delete_horizon(),
                    created_ms: rh.created_ms,
                    last_used_ms: rh.last_used_ms,
                });
            }
        }
    }
    Ok(out)
}
