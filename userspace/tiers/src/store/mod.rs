//! The SSD store of global KV (spec §7: at least 72 hours of residency after last use).
//!
//! What is stored (`docs/ssd-format.md` for the bytes, `docs/tiers.md` for the rules):
//! - **blocks**, content-addressed by a chained key ([`super::key`]): one page of tokens of
//!   every KV source's FP4 entries and MXFP4 keys (the last block of a unit may be shorter);
//! - **units**: a chain of blocks plus a **commit** record naming every block key. Units that
//!   share a prefix share its blocks (a block already stored is not written again).
//!
//! Durability: a unit is written in two phases by the write-behind thread: its new blocks
//! first, then (once every block write of the batch has completed) its commit; one
//! `fdatasync` of every file written makes the batch durable, and only then is the unit
//! acknowledged ([`UnitTicket::wait`]) and made visible to lookups. Recovery trusts a commit
//! only if every block it names is present and valid, so a commit that reached the disk before
//! its data (a crash before the sync) is discarded: no partial unit is ever visible. Once a
//! write or sync fails, the store stops writing (`Error::Poisoned`).
//!
//! Persisting never blocks the caller: [`SsdStore::put_unit`] copies the new blocks' payloads
//! into the queue and returns; a full queue refuses (and counts) rather than wait.
//!
//! Retention: every unit has a last-use time (its write, or a lookup that used its prefix); a
//! block lives as long as any unit that contains it, so it lives at least `retention` after
//! its last use. Space is reclaimed only when a segment is needed and none is free: units past
//! retention are evicted oldest idle first until a segment holds nothing live; failing that,
//! the most-dead segment whose live bytes are at most `compact_live_fraction` of it is
//! compacted (its live records rewritten elsewhere). If neither frees a segment the write is
//! refused and counted; young data is never evicted.
//!
//! Reads hold a **lease** (a reference to the segment's file) for their duration; a segment
//! that eviction or compaction retires is deleted or reused only once every lease is gone, so
//! a reader never sees bytes change under it. Every block read is checked (header, key,
//! location, payload CRC) before its bytes are handed out; a damaged block is reported,
//! counted and served as a miss.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvstack_driver::blockio::{
    BlockEngine, BufferPool, Completion, EngineChoice, EnginePreference, IoOp, OpKind,
    choose_engine,
};
use kvstack_driver::pinned::PinnedOptions;
use kvstack_firmware_interface::record::{
    ALIGN, KEY_BYTES, Key, RecordFlags, RecordHeader, RecordKind, SEGMENT_HEADER_PAGE,
    SegmentHeader, crc32c, encode_record_with_crc, record_len,
};
use serde::Serialize;

use crate::clock::{Clock, HOUR_MS};
use crate::key::{ModelFingerprint, Tenant, block_key, chain_keys, root_key};
use crate::scan::{Damage, SegmentScan, scan_segment};
use crate::segment::{SegmentFile, Space, StoreLocation};
use crate::{Error, Result};

/// Default retention after last use: 72 hours (spec §7).
pub const DEFAULT_RETENTION_MS: u64 = 72 * HOUR_MS;

/// Bytes of one full V4.1-Flash block payload with its token ids: 3 ratio-2 sources x 128
/// entries + 1 ratio-1 source x 256 entries, each 288 + 68 bytes, plus 256 token ids.
pub const V41_BLOCK_PAYLOAD: usize = (3 * 128 + 256) * (288 + 68) + 256 * 4;

/// Options of [`SsdStore::open`].
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Where the segments live.
    pub location: StoreLocation,
    /// Most bytes of segments in a directory store (a device's size is its capacity).
    pub capacity_bytes: u64,
    /// Bytes per segment (a multiple of 4 KiB).
    pub segment_bytes: u64,
    /// A unit is kept at least this long after its last use (ms).
    pub retention_ms: u64,
    /// A later use is written to disk (a touch commit) once it is this much newer than the
    /// last one written (ms); a clean close writes every newer use.
    pub touch_interval_ms: u64,
    /// I/O operations in flight (writes of the write-behind thread; reads of one reader).
    /// Each of them holds twice this many pinned record buffers (`2 x queue_depth x` one
    /// record, 7.5 MB at the default 16 and V4.1 dimensions), so that the next records are
    /// encoded, or completed reads wait for in-order delivery, while the queue stays full.
    pub queue_depth: usize,
    /// Largest block payload (KV bytes plus token ids); sizes the I/O buffers.
    pub max_block_payload: usize,
    /// Most blocks in one unit (a commit names each with 32 bytes).
    pub max_unit_blocks: usize,
    /// Most payload bytes waiting in the write-behind queue; more is refused.
    pub write_queue_bytes: u64,
    /// A segment is compacted only when at most this fraction of it is live.
    pub compact_live_fraction: f64,
    /// Which I/O engine.
    pub engine: EnginePreference,
    /// Open without writing anything (stats, fsck).
    pub read_only: bool,
    /// Memory policy of the I/O buffers.
    pub memory: PinnedOptions,
    /// Fault injection for tests: the syncer sleeps this long before each batch's sync, so
    /// the writer runs ahead of publication as it does on a slow disk. Zero in production.
    #[doc(hidden)]
    pub test_sync_delay_ms: u64,
}

impl StoreOptions {
    /// Defaults for a directory store: 64 GiB of 64 MiB segments, 72 h retention, queue depth
    /// 16, buffers sized for V4.1-Flash blocks.
    pub fn new(location: StoreLocation) -> StoreOptions {
        StoreOptions {
            location,
            capacity_bytes: 64 << 30,
            segment_bytes: 64 << 20,
            retention_ms: DEFAULT_RETENTION_MS,
            touch_interval_ms: HOUR_MS / 4,
            queue_depth: 16,
            max_block_payload: V41_BLOCK_PAYLOAD,
            max_unit_blocks: 4096,
            write_queue_bytes: 1 << 30,
            compact_live_fraction: 0.5,
            engine: EnginePreference::Auto,
            read_only: false,
            memory: PinnedOptions::default(),
            test_sync_delay_ms: 0,
        }
    }

    /// Bytes of one I/O buffer: the largest record (a full block, or a commit of the longest
    /// unit), page aligned.
    pub fn io_buffer_bytes(&self) -> usize {
        let block = record_len(self.max_block_payload as u64);
        let commit = record_len((self.max_unit_blocks * KEY_BYTES) as u64);
        block.max(commit) as usize
    }

    fn validate(&self) -> Result<()> {
        let bad = |field, reason: &str| {
            Err(Error::InvalidOption {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.queue_depth == 0 || self.queue_depth > 1024 {
            return bad("queue_depth", "must be 1..=1024");
        }
        if self.max_block_payload == 0 || self.max_block_payload as u64 > (256 << 20) {
            return bad("max_block_payload", "must be 1..=256 MiB");
        }
        if self.max_unit_blocks == 0 || self.max_unit_blocks > (1 << 20) {
            return bad("max_unit_blocks", "must be 1..=2^20");
        }
        if !(0.0..1.0).contains(&self.compact_live_fraction) {
            return bad("compact_live_fraction", "must be in [0, 1)");
        }
        let per_segment = self
            .segment_bytes
            .saturating_sub(SEGMENT_HEADER_PAGE as u64);
        if (self.io_buffer_bytes() as u64) > per_segment {
            return bad(
                "segment_bytes",
                "a segment must hold at least one record of the largest size",
            );
        }
        Ok(())
    }
}

/// What [`SsdStore::open`] found and how long it took.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RecoveryReport {
    /// Wall time of the whole recovery (listing, scanning, index building), seconds.
    pub seconds: f64,
    /// Segments with a valid header.
    pub segments: u64,
    /// Valid records read.
    pub records: u64,
    /// Blocks in the index (covered by a valid unit).
    pub blocks: u64,
    /// Visible units.
    pub units: u64,
    /// Commits discarded because a block they name is missing or invalid (torn or damaged
    /// units).
    pub units_discarded: u64,
    /// Records cut short by a crash (after the last valid record of their segment).
    pub torn_tail_ranges: u64,
    /// Damage found before valid records (reported with its location).
    pub damaged: Vec<Damage>,
    /// Slots whose header is damaged or belongs elsewhere, with the reason.
    pub invalid_segments: Vec<String>,
    /// Bytes read.
    pub bytes_read: u64,
}

/// Counters and sizes of a store.
#[derive(Clone, Debug, Serialize)]
pub struct StoreStats {
    /// The location.
    pub location: StoreLocation,
    /// The I/O engine in use.
    pub engine: EngineChoice,
    /// Bytes per segment.
    pub segment_bytes: u64,
    /// Segments at most.
    pub segment_slots: u64,
    /// Segments in use (including retired ones still leased).
    pub segments: u64,
    /// Visible blocks.
    pub blocks: u64,
    /// Visible units.
    pub units: u64,
    /// Bytes of live records.
    pub live_bytes: u64,
    /// Bytes written into segments in use (live or dead).
    pub written_bytes: u64,
    /// Payload bytes waiting in the write-behind queue.
    pub queued_bytes: u64,
    /// Units made durable.
    pub units_written: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// Blocks a unit shared with stored ones instead of writing them.
    pub blocks_shared: u64,
    /// Record bytes written (blocks, commits, relocations, segment headers).
    pub bytes_written: u64,
    /// Units refused because nothing could be reclaimed.
    pub refused_full: u64,
    /// Units refused because the write-behind queue was full.
    pub refused_queue: u64,
    /// Unit writes that failed with an I/O error.
    pub failed_writes: u64,
    /// Units evicted past retention.
    pub units_evicted: u64,
    /// Segments compacted.
    pub segments_compacted: u64,
    /// Segments freed.
    pub segments_freed: u64,
    /// Records rewritten by compaction.
    pub records_relocated: u64,
    /// Block reads that found damage (served as misses).
    pub damaged_reads: u64,
    /// Lookups.
    pub lookups: u64,
    /// Lookups that found at least one block.
    pub hits: u64,
    /// Why writes are disabled, if they are.
    pub poisoned: Option<String>,
    /// What the last open found.
    pub recovery: RecoveryReport,
}

/// Where a record lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    seg: u64,
    offset: u64,
    len: u64,
    seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockState {
    /// Queued or being written by the job that created it.
    Pending,
    Written(Loc),
    /// Its write failed or its job was abandoned.
    Failed,
}

#[derive(Debug)]
struct BlockMeta {
    parent: Key,
    depth: u32,
    tokens: u32,
    state: BlockState,
    /// Visible units containing it.
    covered: u32,
    /// Queued jobs relying on it.
    pinned: u32,
    damaged: bool,
}

impl BlockMeta {
    fn loc(&self) -> Option<Loc> {
        match self.state {
            BlockState::Written(l) => Some(l),
            _ => None,
        }
    }

    fn visible(&self) -> bool {
        self.covered > 0 && !self.damaged && self.loc().is_some()
    }
}

#[derive(Debug)]
struct UnitMeta {
    tokens: u64,
    created: u64,
    last_used: u64,
    /// Last use recorded on disk.
    persisted_used: u64,
    /// Its newest commit record (None for a prefix unit created by a lookup and not yet
    /// written).
    loc: Option<Loc>,
    touch_queued: bool,
    tenant_id: u64,
    model: [u8; 16],
}

#[derive(Debug)]
struct SegMeta {
    file: Arc<SegmentFile>,
    /// Bytes of live records.
    live: u64,
    /// End of the written area.
    written: u64,
    /// Next free offset (only meaningful for the active segment).
    next: u64,
    blocks: HashSet<Key>,
    units: HashSet<Key>,
    /// Commits written into it and not yet published (or failed) by the syncer. Such a
    /// segment holds records the index does not know of yet, so it is never retired or
    /// compacted meanwhile (a retired one would take them with it, and publishing would then
    /// move the unit's only live commit into a deleted segment).
    unpublished: u32,
}

struct State {
    blocks: HashMap<Key, BlockMeta>,
    units: HashMap<Key, UnitMeta>,
    by_age: BTreeSet<(u64, Key)>,
    /// Blocks by parent (for finding a unit's shorter last block).
    children: HashMap<Key, Vec<(u32, Key)>>,
    segments: BTreeMap<u64, SegMeta>,
    retired: Vec<Arc<SegmentFile>>,
    space: Space,
    /// The segment data is appended to.
    active: Option<u64>,
    /// The segment touch commits and compaction copies are appended to.
    system_active: Option<u64>,
    next_seq: u64,
    next_segment: u64,
    store_id: [u8; 16],
    queued_bytes: u64,
    poisoned: Option<String>,
}

#[derive(Default)]
struct Counters {
    units_written: AtomicU64,
    blocks_written: AtomicU64,
    blocks_shared: AtomicU64,
    bytes_written: AtomicU64,
    refused_full: AtomicU64,
    refused_queue: AtomicU64,
    failed_writes: AtomicU64,
    units_evicted: AtomicU64,
    segments_compacted: AtomicU64,
    segments_freed: AtomicU64,
    records_relocated: AtomicU64,
    damaged_reads: AtomicU64,
    lookups: AtomicU64,
    hits: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct ReadCtx {
    engine: Box<dyn BlockEngine>,
    pool: BufferPool,
}

struct Shared {
    state: Mutex<State>,
    opts: StoreOptions,
    clock: Arc<dyn Clock>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    choice: EngineChoice,
    read_preference: EnginePreference,
    readers: Mutex<Vec<ReadCtx>>,
    /// Payload buffers the writer has finished with, reused by `put_unit`: a fresh 230 KB
    /// allocation per block is a fresh mapping whose pages fault in one by one (and whose
    /// release shoots down TLBs), which cost more than the copy into it.
    payloads: Mutex<Vec<Vec<u8>>>,
    counters: Counters,
    recovery: RecoveryReport,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the index half-updated in a way that
        // matters more than stopping: keep serving with whatever state there is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty payload buffer with room for one block.
    fn payload_buffer(&self) -> Vec<u8> {
        let reused = self
            .payloads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        reused.unwrap_or_else(|| Vec::with_capacity(self.opts.max_block_payload))
    }

    /// Keeps `buf` for reuse, up to [`PAYLOAD_CACHE_BYTES`] of buffers.
    fn recycle_payload(&self, mut buf: Vec<u8>) {
        if buf.capacity() < self.opts.max_block_payload {
            return;
        }
        buf.clear();
        let mut cache = self.payloads.lock().unwrap_or_else(|e| e.into_inner());
        if (cache.len() + 1) * self.opts.max_block_payload <= PAYLOAD_CACHE_BYTES {
            cache.push(buf);
        }
    }

    fn send(&self, job: Job) -> Result<()> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.as_ref() {
            Some(tx) => tx.send(job).map_err(|_| Error::Closed),
            None => Err(Error::Closed),
        }
    }
}

/// Blocks per queued part of a long unit.
const PART_BLOCKS: usize = 32;

/// Payload buffers kept for reuse between the writer and `put_unit` (at V4.1 dimensions about
/// 140 blocks: four parts of a long unit).
const PAYLOAD_CACHE_BYTES: usize = 32 << 20;

/// A block a job must write.
struct NewBlock {
    key: Key,
    parent: Key,
    depth: u32,
    tokens: u32,
    /// KV bytes followed by the token ids.
    payload: Vec<u8>,
    /// CRC-32C of `payload`, computed by `put_unit` right after filling it (so the writer
    /// thread, which keeps the disk's queue full, only copies it).
    crc: u32,
}

struct UnitJob {
    end: Key,
    keys: Vec<Key>,
    tokens: u64,
    tenant_id: u64,
    model: [u8; 16],
    created: u64,
    touch: bool,
    /// Blocks only: an earlier part of a long unit, whose last part commits it.
    part: bool,
    new_blocks: Vec<NewBlock>,
    queued: u64,
    reply: Option<mpsc::Sender<Result<()>>>,
    /// The last use its commit records (set by the writer).
    last_used: u64,
}

enum Job {
    Unit(Box<UnitJob>),
    Flush(mpsc::Sender<()>),
    Reclaim(mpsc::Sender<Result<ReclaimReport>>),
    Shutdown,
}

/// The outcome of a unit write; [`UnitTicket::wait`] blocks until it is durable.
#[derive(Debug)]
pub struct UnitTicket {
    /// The unit's key (the key of its last block).
    pub key: Key,
    /// Tokens of the unit.
    pub tokens: u64,
    /// Blocks the unit shares with stored ones (not written again).
    pub shared_blocks: usize,
    /// Blocks queued for writing.
    pub new_blocks: usize,
    rx: Option<mpsc::Receiver<Result<()>>>,
}

impl UnitTicket {
    /// Waits until the unit is durable (its commit is on stable storage) or failed.
    ///
    /// # Errors
    /// The write's error ([`Error::StoreFull`], [`Error::Poisoned`], [`Error::WriteFailed`]),
    /// or [`Error::Closed`].
    pub fn wait(self) -> Result<()> {
        match self.rx {
            None => Ok(()),
            Some(rx) => rx.recv().unwrap_or(Err(Error::Closed)),
        }
    }
}

/// Produces the KV payload of a unit's blocks on demand (only for blocks not yet stored).
pub trait BlockSource {
    /// Appends the KV bytes of block `index` (tokens `[first_token, first_token + tokens)`)
    /// to `out`.
    ///
    /// # Errors
    /// Whatever prevents building it; the unit is then not queued.
    fn block_payload(
        &self,
        index: usize,
        first_token: u64,
        tokens: usize,
        out: &mut Vec<u8>,
    ) -> Result<()>;
}

/// A unit to persist.
pub struct UnitWrite<'a> {
    /// The model whose KV it is.
    pub model: &'a ModelFingerprint,
    /// Its tenant.
    pub tenant: &'a Tenant,
    /// Every token of the unit (the prefix it covers).
    pub tokens: &'a [u32],
    /// Tokens per block.
    pub page_tokens: usize,
    /// The unit length must be a multiple of this (the largest compress ratio).
    pub align: usize,
    /// Block payloads.
    pub source: &'a dyn BlockSource,
}

/// The longest stored prefix of a token sequence.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreHit {
    /// Keys of the matched blocks, first to last.
    pub keys: Vec<Key>,
    /// Tokens of each matched block.
    pub block_tokens: Vec<u32>,
    /// Tokens matched.
    pub tokens: u64,
}

impl StoreHit {
    /// The key of the last matched block (the unit key of the prefix), if any.
    pub fn end(&self) -> Option<Key> {
        self.keys.last().copied()
    }
}

/// How a read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Every block was delivered.
    Complete,
    /// Blocks before `at` were delivered; block `at` is not (or no longer) stored.
    Miss {
        /// First block not delivered.
        at: usize,
    },
    /// Blocks before `at` were delivered; block `at` failed its checks (reported, counted,
    /// and no longer visible).
    Damaged {
        /// First block not delivered.
        at: usize,
    },
}

/// What [`SsdStore::reclaim`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReclaimReport {
    /// Units evicted past retention.
    pub units_evicted: u64,
    /// Segments compacted.
    pub segments_compacted: u64,
    /// Segments freed.
    pub segments_freed: u64,
}

/// The SSD store. See the module docs.
pub struct SsdStore {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SsdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdStore")
            .field("location", &self.shared.opts.location)
            .field("engine", &self.shared.choice.kind)
            .finish_non_exhaustive()
    }
}

fn new_store_id(clock: &dyn Clock) -> [u8; 16] {
    let mut h = blake3::Hasher::new_derive_key("kvstack store id v1");
    h.update(&clock.now_ms().to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    let t = Instant::now();
    h.update(format!("{t:?}").as_bytes());
    let local = 0u8;
    h.update(&(&raw const local as usize).to_le_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

/// Chooses the engine and builds a buffer pool for it.
fn engine_for(
    opts: &StoreOptions,
    slots: usize,
    slot_bytes: usize,
    preference: EnginePreference,
) -> Result<(Box<dyn BlockEngine>, BufferPool, EngineChoice)> {
    let pool = BufferPool::new(slots, slot_bytes, opts.memory).map_err(Error::Memory)?;
    let dir = opts.location.probe_dir();
    let (engine, choice) = choose_engine(&dir, slots, &pool, preference)
        .map_err(|e| Error::io("cannot set up block I/O for", &dir, e))?;
    Ok((engine, pool, choice))
}

/// The preference that reproduces `choice` (readers must use the same direct-I/O mode as the
/// files were opened with).
fn preference_of(choice: &EngineChoice) -> EnginePreference {
    match (choice.kind, choice.direct) {
        (kvstack_driver::blockio::EngineKind::Uring, _) => EnginePreference::Uring,
        (_, true) => EnginePreference::SyncDirect,
        (_, false) => EnginePreference::SyncBuffered,
    }
}

/// Everything the scans of a location found (used by open, fsck and inspect).
pub(crate) struct LocationScan {
    pub space: Space,
    pub scans: Vec<SegmentScan>,
    pub choice: EngineChoice,
    pub seconds: f64,
}

/// Scans every segment slot of `opts.location` (read-only unless `opts.read_only` is false,
/// in which case directory files without a valid segment header are removed).
pub(crate) fn scan_location(opts: &StoreOptions) -> Result<LocationScan> {
    let start = Instant::now();
    // Scans read large chunks; four in flight.
    let chunk = (8usize << 20).max(opts.io_buffer_bytes());
    let (mut engine, pool, choice) = engine_for(opts, 4, chunk, opts.engine)?;
    let mut space = Space::open(
        &opts.location,
        opts.segment_bytes,
        opts.capacity_bytes,
        choice.direct,
        opts.read_only,
    )?;
    let mut scans = Vec::new();
    for slot in space.existing()? {
        let mut scan = scan_segment(
            engine.as_mut(),
            &pool,
            slot.path.clone(),
            Arc::clone(&slot.file),
            slot.slot,
            slot.base,
            slot.bytes.next_multiple_of(ALIGN as u64),
            None,
            slot.named_id.is_none(),
        );
        if let (Some(h), Some(named)) = (&scan.header, slot.named_id)
            && h.segment != named
        {
            scan.header_error = Some(format!(
                "header names segment {} but the file is segment {named}",
                h.segment
            ));
            scan.header = None;
            scan.records.clear();
        }
        if scan.header.is_none() && slot.named_id.is_some() && scan.header_error.is_none() {
            // A directory file with an empty header: created just before a crash.
            space.remove_invalid(&slot)?;
        }
        scans.push(scan);
    }
    Ok(LocationScan {
        space,
        scans,
        choice,
        seconds: start.elapsed().as_secs_f64(),
    })
}

impl SsdStore {
    /// Opens (or creates) a store: scans every segment, rebuilds the index (torn tails
    /// discarded, damaged records reported), and starts the write-behind thread (unless
    /// read-only). [`SsdStore::recovery`] says what was found and how long it took.
    ///
    /// # Errors
    /// Invalid options, an unusable location, I/O set-up failures.
    pub fn open(opts: StoreOptions, clock: Arc<dyn Clock>) -> Result<SsdStore> {
        opts.validate()?;
        let start = Instant::now();
        let LocationScan {
            mut space,
            scans,
            choice,
            ..
        } = scan_location(&opts)?;
        let mut report = RecoveryReport::default();
        // The store's id: that of the oldest valid segment; segments of other stores are
        // reported and left alone.
        let store_id = scans
            .iter()
            .filter_map(|s| s.header)
            .min_by_key(|h| h.segment)
            .map_or_else(|| new_store_id(clock.as_ref()), |h| h.store_id);
        let mut max_seq = 0u64;
        let mut max_seg = 0u64;
        let mut segments: BTreeMap<u64, SegMeta> = BTreeMap::new();
        // Best (newest) record of every block key; every commit.
        let mut best: HashMap<Key, (RecordHeader, Loc)> = HashMap::new();
        let mut commits: HashMap<Key, Vec<(RecordHeader, Loc, Vec<Key>)>> = HashMap::new();
        for scan in scans {
            report.bytes_read += scan.bytes_read;
            for d in &scan.damage {
                if d.torn_tail {
                    report.torn_tail_ranges += 1;
                } else {
                    report.damaged.push(d.clone());
                }
            }
            let Some(h) = scan.header else {
                if let Some(e) = scan.header_error {
                    report.invalid_segments.push(format!(
                        "{} (slot {}): {e}",
                        scan.path.display(),
                        scan.slot
                    ));
                }
                continue;
            };
            if h.store_id != store_id {
                report.invalid_segments.push(format!(
                    "{} (slot {}): segment of another store",
                    scan.path.display(),
                    scan.slot
                ));
                continue;
            }
            report.segments += 1;
            max_seq = max_seq.max(h.first_seq);
            max_seg = max_seg.max(h.segment);
            space.mark_used(scan.slot);
            let file = Arc::new(SegmentFile {
                id: h.segment,
                slot: scan.slot,
                path: scan.path.clone(),
                file: open_existing(&space, &scan)?,
                base: if matches!(opts.location, StoreLocation::Device(_)) {
                    scan.slot * opts.segment_bytes
                } else {
                    0
                },
                bytes: h.segment_bytes,
            });
            segments.insert(
                h.segment,
                SegMeta {
                    file,
                    live: 0,
                    written: scan.end,
                    next: h.segment_bytes, // recovered segments are sealed
                    blocks: HashSet::new(),
                    units: HashSet::new(),
                    unpublished: 0,
                },
            );
            for r in scan.records {
                report.records += 1;
                let hd = r.header;
                max_seq = max_seq.max(hd.seq);
                let loc = Loc {
                    seg: h.segment,
                    offset: r.offset,
                    len: hd.record_len(),
                    seq: hd.seq,
                };
                match hd.kind {
                    RecordKind::Block => {
                        let newer = best.get(&hd.key).is_none_or(|(o, _)| o.seq < hd.seq);
                        if newer {
                            best.insert(hd.key, (hd, loc));
                        }
                    }
                    RecordKind::Commit => {
                        commits.entry(hd.key).or_default().push((hd, loc, r.keys));
                    }
                }
            }
        }
        let mut blocks: HashMap<Key, BlockMeta> = HashMap::new();
        let mut units: HashMap<Key, UnitMeta> = HashMap::new();
        for (end, list) in commits {
            // Every commit of one end key names the same chain (the key chains the tokens).
            let Some((_, _, keys)) = list.iter().max_by_key(|(h, _, _)| h.seq) else {
                continue;
            };
            let complete = keys.last() == Some(&end)
                && keys.iter().enumerate().all(|(i, k)| {
                    best.get(k).is_some_and(|(b, _)| {
                        b.count as usize == i + 1 && (i == 0 || keys.get(i - 1) == Some(&b.parent))
                    })
                });
            if !complete {
                report.units_discarded += 1;
                continue;
            }
            let newest = list.iter().max_by_key(|(h, _, _)| h.seq);
            let Some((nh, nloc, _)) = newest else {
                continue;
            };
            let last_used = list
                .iter()
                .map(|(h, _, _)| h.last_used_ms)
                .max()
                .unwrap_or(nh.last_used_ms);
            let created = list
                .iter()
                .map(|(h, _, _)| h.created_ms)
                .min()
                .unwrap_or(nh.created_ms);
            for k in keys {
                if let Some((bh, bloc)) = best.get(k) {
                    let b = blocks.entry(*k).or_insert_with(|| BlockMeta {
                        parent: bh.parent,
                        depth: bh.count,
                        tokens: bh.tokens,
                        state: BlockState::Written(*bloc),
                        covered: 0,
                        pinned: 0,
                        damaged: false,
                    });
                    b.covered += 1;
                }
            }
            units.insert(
                end,
                UnitMeta {
                    tokens: u64::from(nh.tokens),
                    created,
                    last_used,
                    persisted_used: last_used,
                    loc: Some(*nloc),
                    touch_queued: false,
                    tenant_id: nh.tenant,
                    model: nh.model,
                },
            );
        }
        let mut children: HashMap<Key, Vec<(u32, Key)>> = HashMap::new();
        for (k, b) in &blocks {
            if let Some(l) = b.loc()
                && let Some(s) = segments.get_mut(&l.seg)
            {
                s.live += l.len;
                s.blocks.insert(*k);
            }
            children.entry(b.parent).or_default().push((b.tokens, *k));
        }
        let mut by_age = BTreeSet::new();
        for (k, u) in &units {
            by_age.insert((u.last_used, *k));
            if let Some(l) = u.loc
                && let Some(s) = segments.get_mut(&l.seg)
            {
                s.live += l.len;
                s.units.insert(*k);
            }
        }
        report.blocks = blocks.len() as u64;
        report.units = units.len() as u64;
        report.seconds = start.elapsed().as_secs_f64();
        log::info!(
            "store {}: recovered {} units, {} blocks from {} segments ({} records, {} bytes \
             read) in {:.3} s; {} torn tails discarded, {} damaged ranges, {} units discarded",
            opts.location.path().display(),
            report.units,
            report.blocks,
            report.segments,
            report.records,
            report.bytes_read,
            report.seconds,
            report.torn_tail_ranges,
            report.damaged.len(),
            report.units_discarded
        );
        for d in &report.damaged {
            log::warn!(
                "damaged bytes in {} at offset {} ({} bytes): {}",
                d.path.display(),
                d.offset,
                d.bytes,
                d.reason
            );
        }
        let state = State {
            blocks,
            units,
            by_age,
            children,
            segments,
            retired: Vec::new(),
            space,
            active: None,
            system_active: None,
            next_seq: max_seq + 1,
            next_segment: max_seg + 1,
            store_id,
            queued_bytes: 0,
            poisoned: None,
        };
        let read_only = opts.read_only;
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            read_preference: preference_of(&choice),
            choice,
            clock,
            jobs: Mutex::new(None),
            readers: Mutex::new(Vec::new()),
            payloads: Mutex::new(Vec::new()),
            counters: Counters::default(),
            recovery: report,
            opts,
        });
        let writer = if read_only {
            None
        } else {
            let (tx, rx) = mpsc::channel();
            *shared.jobs.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
            // Twice the queue depth in buffers: the next records are encoded while
            // `queue_depth` writes are in flight, so a completion is refilled at once.
            let (engine, pool, _) = engine_for(
                &shared.opts,
                2 * shared.opts.queue_depth,
                shared.opts.io_buffer_bytes(),
                shared.read_preference,
            )?;
            let w = Writer {
                shared: Arc::clone(&shared),
                engine,
                pool,
                inflight: HashMap::new(),
                next_tag: 0,
                dirty: BTreeMap::new(),
                created: false,
                batch_error: None,
                commits_done: Vec::new(),
                relocated: Vec::new(),
                lost: Vec::new(),
                read_done: None,
                full_parts: HashSet::new(),
                purpose: Purpose::Data,
            };
            Some(
                std::thread::Builder::new()
                    .name("kvstack-ssd-writer".into())
                    .spawn(move || w.run(rx))
                    .map_err(|e| Error::io("cannot start the writer thread for", "store", e))?,
            )
        };
        Ok(SsdStore { shared, writer })
    }

    /// What the last open found, and how long recovery took.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.shared.recovery
    }

    /// The I/O engine in use and why.
    pub fn engine(&self) -> &EngineChoice {
        &self.shared.choice
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.shared.opts
    }

    /// Queues a unit for writing and returns at once (module docs). Blocks already stored (or
    /// queued) are shared, not written again; a unit that is already stored is only touched.
    ///
    /// # Errors
    /// [`Error::Unaligned`], [`Error::UnitTooLong`], [`Error::BlockTooLarge`],
    /// [`Error::QueueFull`] (counted), [`Error::ReadOnly`], [`Error::Poisoned`],
    /// [`Error::Closed`], and the source's errors.
    pub fn put_unit(&self, unit: &UnitWrite<'_>) -> Result<UnitTicket> {
        let sh = &self.shared;
        if sh.opts.read_only {
            return Err(Error::ReadOnly);
        }
        let n = unit.tokens.len() as u64;
        let align = unit.align.max(1) as u64;
        if n == 0 || !n.is_multiple_of(align) {
            return Err(Error::Unaligned { tokens: n, align });
        }
        let p = unit.page_tokens.max(1);
        let keys = chain_keys(unit.tokens, p, unit.model, unit.tenant);
        if keys.len() > sh.opts.max_unit_blocks {
            return Err(Error::UnitTooLong {
                blocks: keys.len(),
                max: sh.opts.max_unit_blocks,
            });
        }
        let Some(&end) = keys.last() else {
            return Err(Error::Unaligned { tokens: n, align });
        };
        let now = sh.clock.now_ms();
        let root = root_key(unit.model, unit.tenant);
        // Phase 1 (locked): share what exists, claim what does not.
        let mut missing = Vec::new();
        {
            let mut st = sh.lock();
            if let Some(reason) = &st.poisoned {
                return Err(Error::Poisoned {
                    reason: reason.clone(),
                });
            }
            let intact = st.units.contains_key(&end)
                && keys
                    .iter()
                    .all(|k| st.blocks.get(k).is_some_and(BlockMeta::visible));
            if intact {
                drop(st);
                self.touch_end(end, now);
                return Ok(UnitTicket {
                    key: end,
                    tokens: n,
                    shared_blocks: keys.len(),
                    new_blocks: 0,
                    rx: None,
                });
            }
            for (i, k) in keys.iter().enumerate() {
                let State {
                    blocks, segments, ..
                } = &mut *st;
                match blocks.get_mut(k) {
                    Some(b) if b.state != BlockState::Failed && !b.damaged => b.pinned += 1,
                    Some(b) => {
                        // Damaged or never written: write it again under the same key (the
                        // units that cover it become readable again once it is). Its old
                        // record, if any, is dead space.
                        if let Some(l) = b.loc()
                            && let Some(s) = segments.get_mut(&l.seg)
                            && s.blocks.remove(k)
                        {
                            s.live = s.live.saturating_sub(l.len);
                        }
                        b.state = BlockState::Pending;
                        b.damaged = false;
                        b.pinned += 1;
                        missing.push(i);
                    }
                    None => {
                        let first = (i * p) as u64;
                        let tokens = (n - first).min(p as u64) as u32;
                        let parent = if i == 0 { root } else { keys[i - 1] };
                        blocks.insert(
                            *k,
                            BlockMeta {
                                parent,
                                depth: i as u32 + 1,
                                tokens,
                                state: BlockState::Pending,
                                covered: 0,
                                pinned: 1,
                                damaged: false,
                            },
                        );
                        missing.push(i);
                    }
                }
            }
        }
        // Phase 2 (unlocked): build the new blocks' payloads, and queue them in parts of
        // `PART_BLOCKS` so the writer starts on a long unit while the rest is being copied.
        // Parts carry blocks only; the last one carries the commit and the reply.
        let mut part = Vec::new();
        let mut part_bytes = 0u64;
        let mut new_count = 0usize;
        let job =
            |blocks: Vec<NewBlock>, queued: u64, reply: Option<mpsc::Sender<Result<()>>>| UnitJob {
                end,
                tokens: n,
                tenant_id: unit.tenant.id(),
                model: unit.model.short(),
                created: now,
                touch: false,
                part: reply.is_none(),
                new_blocks: blocks,
                queued,
                reply,
                keys: keys.clone(),
                last_used: now,
            };
        // Reserves queue room for `bytes`, or explains why not.
        let reserve = |bytes: u64| -> Result<()> {
            let mut st = sh.lock();
            if bytes > 0 && st.queued_bytes + bytes > sh.opts.write_queue_bytes {
                bump(&sh.counters.refused_queue, 1);
                return Err(Error::QueueFull {
                    queued: st.queued_bytes,
                    limit: sh.opts.write_queue_bytes,
                });
            }
            st.queued_bytes += bytes;
            Ok(())
        };
        let undo = |e: Error| -> Error {
            // Parts already queued still write their blocks; with the pins gone those
            // records are dead space.
            let mut st = sh.lock();
            unpin(&mut st, &keys);
            e
        };
        for &i in &missing {
            let first = (i * p) as u64;
            let count = (n - first).min(p as u64) as usize;
            let mut payload = sh.payload_buffer();
            unit.source
                .block_payload(i, first, count, &mut payload)
                .map_err(undo)?;
            for t in &unit.tokens[first as usize..first as usize + count] {
                payload.extend_from_slice(&t.to_le_bytes());
            }
            if payload.len() > sh.opts.max_block_payload {
                return Err(undo(Error::BlockTooLarge {
                    bytes: payload.len(),
                    max: sh.opts.max_block_payload,
                }));
            }
            part_bytes += payload.len() as u64;
            part.push(NewBlock {
                key: keys[i],
                parent: if i == 0 { root } else { keys[i - 1] },
                depth: i as u32 + 1,
                tokens: count as u32,
                crc: crc32c(&payload),
                payload,
            });
            new_count += 1;
            if part.len() == PART_BLOCKS && new_count < missing.len() {
                reserve(part_bytes).map_err(undo)?;
                if let Err(e) = sh.send(Job::Unit(Box::new(job(
                    std::mem::take(&mut part),
                    part_bytes,
                    None,
                )))) {
                    return Err(undo(e));
                }
                part_bytes = 0;
            }
        }
        // Phase 3: the last part, with the commit.
        reserve(part_bytes).map_err(undo)?;
        bump(&sh.counters.blocks_shared, (keys.len() - new_count) as u64);
        let (tx, rx) = mpsc::channel();
        if let Err(e) = sh.send(Job::Unit(Box::new(job(part, part_bytes, Some(tx))))) {
            let mut st = sh.lock();
            st.queued_bytes = st.queued_bytes.saturating_sub(part_bytes);
            drop(st);
            return Err(undo(e));
        }
        Ok(UnitTicket {
            key: end,
            tokens: n,
            shared_blocks: keys.len() - new_count,
            new_blocks: new_count,
            rx: Some(rx),
        })
    }

    /// The longest stored prefix of `tokens` for `model` and `tenant`: whole blocks of
    /// `page_tokens`, then possibly one shorter block that ends a stored unit. Does not count
    /// as a use; reading the blocks does.
    pub fn lookup(
        &self,
        model: &ModelFingerprint,
        tenant: &Tenant,
        tokens: &[u32],
        page_tokens: usize,
    ) -> StoreHit {
        let sh = &self.shared;
        bump(&sh.counters.lookups, 1);
        let p = page_tokens.max(1);
        let full = tokens.len() / p;
        // Hash outside the lock.
        let keys = chain_keys(&tokens[..full * p], p, model, tenant);
        let root = root_key(model, tenant);
        let st = sh.lock();
        let mut hit = StoreHit::default();
        for k in keys {
            if !st.blocks.get(&k).is_some_and(BlockMeta::visible) {
                break;
            }
            hit.keys.push(k);
            hit.block_tokens.push(p as u32);
        }
        let matched = hit.keys.len() * p;
        let parent = hit.keys.last().copied().unwrap_or(root);
        let rest = &tokens[matched..];
        if let Some(kids) = st.children.get(&parent) {
            let mut cands: Vec<(u32, Key)> = kids
                .iter()
                .filter(|(t, _)| (*t as usize) < p && (*t as usize) <= rest.len())
                .copied()
                .collect();
            cands.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
            for (t, k) in cands {
                if st.blocks.get(&k).is_some_and(BlockMeta::visible)
                    && block_key(&parent, &rest[..t as usize], model, tenant) == k
                {
                    hit.keys.push(k);
                    hit.block_tokens.push(t);
                    break;
                }
            }
        }
        drop(st);
        hit.tokens = hit.block_tokens.iter().map(|&t| u64::from(t)).sum();
        if hit.tokens > 0 {
            bump(&sh.counters.hits, 1);
        }
        hit
    }

    /// Reads the blocks `keys` (a prefix chain from [`SsdStore::lookup`]) and hands each
    /// block's KV bytes, in order, to `sink(index, header, kv_bytes)`. Every block is checked
    /// before it is handed out. Reading counts as a use of the prefix (its last-use time is
    /// refreshed). Several reads are in flight at once; segments are leased meanwhile.
    ///
    /// # Errors
    /// I/O set-up failures and the sink's errors. Missing or damaged blocks are not errors:
    /// they end the read with [`ReadOutcome::Miss`] or [`ReadOutcome::Damaged`].
    pub fn read_blocks(
        &self,
        keys: &[Key],
        mut sink: impl FnMut(usize, &RecordHeader, &[u8]) -> Result<()>,
    ) -> Result<ReadOutcome> {
        let sh = &self.shared;
        // Locations and leases, under the lock.
        let mut plan = Vec::with_capacity(keys.len());
        let mut outcome = ReadOutcome::Complete;
        {
            let st = sh.lock();
            for (i, k) in keys.iter().enumerate() {
                let found = st.blocks.get(k).filter(|b| b.visible()).and_then(|b| {
                    let l = b.loc()?;
                    let seg = st.segments.get(&l.seg)?;
                    Some((l, Arc::clone(&seg.file), b.tokens))
                });
                match found {
                    Some(f) => plan.push(f),
                    None => {
                        outcome = ReadOutcome::Miss { at: i };
                        break;
                    }
                }
            }
        }
        let mut ctx = self.reader()?;
        // At most `queue_depth` reads in flight, up to the pool's slots delivered-or-pending.
        let depth = self.shared.opts.queue_depth.min(ctx.engine.depth()).max(1);
        let window = ctx.pool.slots().max(depth);
        let mut next_submit = 0usize;
        let mut next_deliver = 0usize;
        let mut ready: HashMap<usize, Completion> = HashMap::new();
        let mut result = Ok(());
        let mut stop_at: Option<(usize, bool)> = None;
        while next_deliver < plan.len() && stop_at.is_none() {
            let submitted = next_submit;
            while next_submit < plan.len()
                && next_submit < next_deliver + window
                && ctx.engine.in_flight() < depth
            {
                let Some(buf) = ctx.pool.try_get() else {
                    break;
                };
                let (l, seg, _) = &plan[next_submit];
                let op = IoOp {
                    kind: OpKind::Read,
                    file: Arc::clone(&seg.file),
                    offset: seg.base + l.offset,
                    len: l.len as usize,
                    buf,
                    tag: next_submit as u64,
                };
                if let Err(e) = ctx.engine.submit(op) {
                    result = Err(Error::io("cannot read from", seg.path.clone(), e.error));
                    break;
                }
                next_submit += 1;
            }
            if result.is_err() {
                break;
            }
            // Hand the new reads to the kernel before checking and delivering a block (about
            // 50 us each): `submit` only queues them. `wait(0)` never blocks.
            if next_submit > submitted
                && let Err(e) = collect_reads(ctx.engine.as_mut(), 0, &mut ready)
            {
                result = Err(e);
                break;
            }
            if let Some(c) = ready.remove(&next_deliver) {
                let (l, seg, tokens) = &plan[next_deliver];
                let checked = check_block(&c, &keys[next_deliver], l, *tokens);
                match checked {
                    Ok(h) => {
                        let kv_len = h.payload_len as usize - 4 * h.tokens as usize;
                        let kv =
                            c.op.buf
                                .as_slice()
                                .get(ALIGN..ALIGN + kv_len)
                                .unwrap_or_default();
                        if let Err(e) = sink(next_deliver, &h, kv) {
                            result = Err(e);
                            break;
                        }
                        next_deliver += 1;
                    }
                    Err(reason) => {
                        log::warn!(
                            "damaged block in {} at offset {}: {reason}; served as a miss",
                            seg.path.display(),
                            seg.base + l.offset
                        );
                        bump(&sh.counters.damaged_reads, 1);
                        let mut st = sh.lock();
                        if let Some(b) = st.blocks.get_mut(&keys[next_deliver]) {
                            b.damaged = true;
                        }
                        stop_at = Some((next_deliver, true));
                    }
                }
                continue;
            }
            if let Err(e) = collect_reads(ctx.engine.as_mut(), 1, &mut ready) {
                result = Err(e);
                break;
            }
        }
        // Reap what is still in flight before the buffers and engine are reused.
        let mut out = Vec::new();
        while ctx.engine.in_flight() > 0 {
            if ctx.engine.wait(ctx.engine.in_flight(), &mut out).is_err() {
                // The ring is broken: do not return this context to the cache.
                return result.and(Err(Error::Closed));
            }
            out.clear();
        }
        drop(ready);
        drop(plan);
        self.return_reader(ctx);
        result?;
        if let Some((at, damaged)) = stop_at {
            return Ok(if damaged {
                ReadOutcome::Damaged { at }
            } else {
                ReadOutcome::Miss { at }
            });
        }
        let delivered = match outcome {
            ReadOutcome::Miss { at } => at,
            _ => keys.len(),
        };
        if let Some(&end) = keys.get(..delivered).and_then(<[Key]>::last) {
            self.touch_end(end, sh.clock.now_ms());
        }
        Ok(outcome)
    }

    fn reader(&self) -> Result<ReadCtx> {
        let cached = self
            .shared
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        if let Some(c) = cached {
            return Ok(c);
        }
        // Twice the queue depth in buffers: blocks are delivered in order, so completions that
        // overtake the oldest read wait in their buffers while the queue stays full.
        let (engine, pool, _) = engine_for(
            &self.shared.opts,
            2 * self.shared.opts.queue_depth,
            self.shared.opts.io_buffer_bytes(),
            self.shared.read_preference,
        )?;
        Ok(ReadCtx { engine, pool })
    }

    fn return_reader(&self, ctx: ReadCtx) {
        let mut r = self
            .shared
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if r.len() < 4 {
            r.push(ctx);
        }
    }

    /// Records a use of the prefix that ends with block `end` (its chain is found through the
    /// blocks' parent links). Creates a prefix unit there when none ends there, so the use is
    /// remembered across restarts; writes a touch commit when the use is `touch_interval_ms`
    /// newer than the one on disk.
    fn touch_end(&self, end: Key, now: u64) {
        let sh = &self.shared;
        let mut st = sh.lock();
        let keys = chain_of(&st, &end);
        let State {
            units,
            by_age,
            blocks,
            ..
        } = &mut *st;
        let job = match units.get_mut(&end) {
            Some(u) => {
                by_age.remove(&(u.last_used, end));
                u.last_used = u.last_used.max(now);
                by_age.insert((u.last_used, end));
                let due = u.last_used.saturating_sub(u.persisted_used) >= sh.opts.touch_interval_ms;
                if due && !u.touch_queued && !sh.opts.read_only {
                    u.touch_queued = true;
                    Some((u.tokens, u.tenant_id, u.model, u.created))
                } else {
                    None
                }
            }
            None => {
                // A prefix that ends inside a longer unit: give it a unit of its own.
                let complete = keys
                    .first()
                    .and_then(|k| blocks.get(k))
                    .is_some_and(|b| b.depth == 1)
                    && keys
                        .iter()
                        .all(|k| blocks.get(k).is_some_and(BlockMeta::visible));
                if !complete {
                    return;
                }
                let tokens: u64 = keys
                    .iter()
                    .filter_map(|k| blocks.get(k))
                    .map(|b| u64::from(b.tokens))
                    .sum();
                for k in &keys {
                    if let Some(b) = blocks.get_mut(k) {
                        b.covered += 1;
                    }
                }
                units.insert(
                    end,
                    UnitMeta {
                        tokens,
                        created: now,
                        last_used: now,
                        persisted_used: 0,
                        loc: None,
                        touch_queued: !sh.opts.read_only,
                        tenant_id: 0,
                        model: [0; 16],
                    },
                );
                by_age.insert((now, end));
                (!sh.opts.read_only).then_some((tokens, 0, [0; 16], now))
            }
        };
        drop(st);
        if let Some((tokens, tenant_id, model, created)) = job {
            let j = UnitJob {
                end,
                keys,
                tokens,
                tenant_id,
                model,
                created,
                touch: true,
                part: false,
                new_blocks: Vec::new(),
                queued: 0,
                reply: None,
                last_used: now,
            };
            // A closed store simply forgets the touch.
            let _ = sh.send(Job::Unit(Box::new(j)));
        }
    }

    /// Waits until every unit queued before this call is durable (or failed).
    ///
    /// # Errors
    /// [`Error::Closed`] when the writer has stopped; [`Error::ReadOnly`].
    pub fn flush(&self) -> Result<()> {
        if self.shared.opts.read_only {
            return Err(Error::ReadOnly);
        }
        let (tx, rx) = mpsc::channel();
        self.shared.send(Job::Flush(tx))?;
        rx.recv().map_err(|_| Error::Closed)
    }

    /// Evicts every unit past retention and compacts every segment that qualifies, now
    /// (normally this happens only when space is needed).
    ///
    /// # Errors
    /// I/O errors of compaction; [`Error::Closed`]; [`Error::ReadOnly`].
    pub fn reclaim(&self) -> Result<ReclaimReport> {
        if self.shared.opts.read_only {
            return Err(Error::ReadOnly);
        }
        let (tx, rx) = mpsc::channel();
        self.shared.send(Job::Reclaim(tx))?;
        rx.recv().map_err(|_| Error::Closed)?
    }

    /// Counters and sizes.
    pub fn stats(&self) -> StoreStats {
        let sh = &self.shared;
        let st = sh.lock();
        let c = &sh.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            location: sh.opts.location.clone(),
            engine: sh.choice.clone(),
            segment_bytes: sh.opts.segment_bytes,
            segment_slots: st.space.slots,
            segments: st.space.used(),
            blocks: st.blocks.values().filter(|b| b.visible()).count() as u64,
            units: st.units.len() as u64,
            live_bytes: st.segments.values().map(|s| s.live).sum(),
            written_bytes: st.segments.values().map(|s| s.written).sum(),
            queued_bytes: st.queued_bytes,
            units_written: get(&c.units_written),
            blocks_written: get(&c.blocks_written),
            blocks_shared: get(&c.blocks_shared),
            bytes_written: get(&c.bytes_written),
            refused_full: get(&c.refused_full),
            refused_queue: get(&c.refused_queue),
            failed_writes: get(&c.failed_writes),
            units_evicted: get(&c.units_evicted),
            segments_compacted: get(&c.segments_compacted),
            segments_freed: get(&c.segments_freed),
            records_relocated: get(&c.records_relocated),
            damaged_reads: get(&c.damaged_reads),
            lookups: get(&c.lookups),
            hits: get(&c.hits),
            poisoned: st.poisoned.clone(),
            recovery: sh.recovery.clone(),
        }
    }

    /// Writes every use newer than the one on disk, waits for the queue to drain and stops
    /// the writer. Dropping the store does the same.
    ///
    /// # Errors
    /// [`Error::Closed`] if the writer had already stopped.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    /// Queues a touch commit for every use not yet on disk (what a clean close does), so a
    /// restart keeps every unit's last use; [`SsdStore::flush`] waits for them.
    ///
    /// # Errors
    /// [`Error::ReadOnly`]; [`Error::Closed`] when the writer has stopped.
    pub fn persist_uses(&self) -> Result<()> {
        if self.shared.opts.read_only {
            return Err(Error::ReadOnly);
        }
        if self.writer.is_none() {
            return Err(Error::Closed);
        }
        self.queue_uses();
        Ok(())
    }

    fn queue_uses(&self) {
        let due: Vec<(Key, Vec<Key>)> = {
            let st = self.shared.lock();
            st.units
                .iter()
                .filter(|(_, u)| u.last_used > u.persisted_used && !u.touch_queued)
                .map(|(k, _)| (*k, chain_of(&st, k)))
                .collect()
        };
        for (_, keys) in due {
            let mut st = self.shared.lock();
            let Some(end) = keys.last() else { continue };
            let Some(u) = st.units.get_mut(end) else {
                continue;
            };
            u.touch_queued = true;
            let j = UnitJob {
                end: *end,
                tokens: u.tokens,
                tenant_id: u.tenant_id,
                model: u.model,
                created: u.created,
                touch: true,
                part: false,
                new_blocks: Vec::new(),
                queued: 0,
                reply: None,
                last_used: 0,
                keys,
            };
            drop(st);
            let _ = self.shared.send(Job::Unit(Box::new(j)));
        }
    }

    /// Checks the in-memory index against itself: every unit's commit and every written
    /// block lies in a segment the store holds and is counted there, and every segment's
    /// live bytes are the sum of what it holds. For tests and `fsck`-style tools.
    ///
    /// # Errors
    /// A description of the first inconsistency.
    #[doc(hidden)]
    pub fn check_index(&self) -> std::result::Result<(), String> {
        let st = self.shared.lock();
        let mut live: HashMap<u64, u64> = HashMap::new();
        for (k, u) in &st.units {
            let Some(l) = u.loc else { continue };
            let seg = st.segments.get(&l.seg).ok_or_else(|| {
                format!(
                    "unit {} has its commit in segment {}, which the store does not hold",
                    super::key::key_hex(k, 8),
                    l.seg
                )
            })?;
            if !seg.units.contains(k) {
                return Err(format!(
                    "unit {} is not counted in its segment {}",
                    super::key::key_hex(k, 8),
                    l.seg
                ));
            }
            *live.entry(l.seg).or_default() += l.len;
        }
        for (k, b) in &st.blocks {
            let Some(l) = b.loc() else { continue };
            let Some(seg) = st.segments.get(&l.seg) else {
                if b.covered > 0 {
                    return Err(format!(
                        "block {} of a unit lies in segment {}, which the store does not hold",
                        super::key::key_hex(k, 8),
                        l.seg
                    ));
                }
                continue;
            };
            if seg.blocks.contains(k) {
                *live.entry(l.seg).or_default() += l.len;
            } else if b.covered > 0 {
                return Err(format!(
                    "block {} of a unit is not counted in its segment {}",
                    super::key::key_hex(k, 8),
                    l.seg
                ));
            }
        }
        for (id, seg) in &st.segments {
            let want = live.get(id).copied().unwrap_or(0);
            if seg.live != want {
                return Err(format!(
                    "segment {id} counts {} live bytes, holds {want}",
                    seg.live
                ));
            }
        }
        Ok(())
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(handle) = self.writer.take() else {
            return Ok(());
        };
        // Touch commits for every use not yet on disk.
        self.queue_uses();
        let sent = self.shared.send(Job::Shutdown);
        *self.shared.jobs.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if handle.join().is_err() {
            log::error!("the store's writer thread panicked");
        }
        sent
    }

    /// Every unit: `(key, tokens, last use)` (for tests and tools).
    pub fn units(&self) -> Vec<(Key, u64, u64)> {
        let st = self.shared.lock();
        st.units
            .iter()
            .map(|(k, u)| (*k, u.tokens, u.last_used))
            .collect()
    }
}

impl Drop for SsdStore {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            log::debug!("store shutdown: {e}");
        }
    }
}

fn open_existing(space: &Space, scan: &SegmentScan) -> Result<Arc<std::fs::File>> {
    use kvstack_driver::blockio::{OpenMode, open_file};
    let f = open_file(
        &scan.path,
        OpenMode {
            write: !space.read_only,
            create: false,
            direct: space.direct,
        },
    )
    .map_err(|e| Error::io("cannot open segment", &scan.path, e))?;
    Ok(Arc::new(f))
}

/// The chain of keys ending at `end`, first to last (walking parent links).
fn chain_of(st: &State, end: &Key) -> Vec<Key> {
    let mut out = vec![*end];
    let mut at = *end;
    while let Some(b) = st.blocks.get(&at) {
        if b.depth <= 1 {
            break;
        }
        at = b.parent;
        out.push(at);
    }
    out.reverse();
    out
}

/// Releases a job's pins on `keys`; blocks nobody needs any more are dropped.
fn unpin(st: &mut State, keys: &[Key]) {
    for k in keys {
        let dead = match st.blocks.get_mut(k) {
            Some(b) => {
                b.pinned = b.pinned.saturating_sub(1);
                if b.pinned == 0 && b.covered == 0 && b.state == BlockState::Pending {
                    // Claimed by this job and never written.
                    b.state = BlockState::Failed;
                }
                b.pinned == 0 && b.covered == 0
            }
            None => false,
        };
        if dead {
            drop_block(st, k);
        }
    }
}

/// Marks blocks a job will not write as failed (their pins are released with the job's).
fn fail_blocks(shared: &Shared, blocks: &[NewBlock]) {
    let mut st = shared.lock();
    for b in blocks {
        if let Some(m) = st.blocks.get_mut(&b.key)
            && m.state == BlockState::Pending
        {
            m.state = BlockState::Failed;
        }
    }
}

/// Removes a block nobody covers or pins: its record becomes dead space.
fn drop_block(st: &mut State, k: &Key) {
    let Some(b) = st.blocks.remove(k) else {
        return;
    };
    if let Some(l) = b.loc()
        && let Some(s) = st.segments.get_mut(&l.seg)
        && s.blocks.remove(k)
    {
        s.live = s.live.saturating_sub(l.len);
    }
    if let Some(kids) = st.children.get_mut(&b.parent) {
        kids.retain(|(_, c)| c != k);
        if kids.is_empty() {
            st.children.remove(&b.parent);
        }
    }
}

/// Waits for at least `min` reads (0: only pushes queued ones to the kernel) and files every
/// completed one under its plan index.
fn collect_reads(
    engine: &mut dyn BlockEngine,
    min: usize,
    ready: &mut HashMap<usize, Completion>,
) -> Result<()> {
    let mut out = Vec::new();
    engine
        .wait(min, &mut out)
        .map_err(|e| Error::io("block I/O failed on", "store", e))?;
    for c in out {
        ready.insert(c.op.tag as usize, c);
    }
    Ok(())
}

/// Checks a completed block read: transfer, header, identity, location and payload CRC.
fn check_block(
    c: &Completion,
    key: &Key,
    loc: &Loc,
    tokens: u32,
) -> std::result::Result<RecordHeader, String> {
    let got = c.result.as_ref().map_err(|e| format!("read failed: {e}"))?;
    if (*got as u64) < loc.len {
        return Err(format!("short read: {got} of {} bytes", loc.len));
    }
    let bytes = c.op.buf.as_slice();
    let h = RecordHeader::decode(bytes).map_err(|e| e.to_string())?;
    if h.kind != RecordKind::Block
        || h.key != *key
        || h.segment != loc.seg
        || h.seq != loc.seq
        || h.tokens != tokens
    {
        return Err("record at the block's location is a different record".to_owned());
    }
    if h.record_len() != loc.len || !h.flags.contains(RecordFlags::TOKEN_IDS) {
        return Err("record length or flags differ from the index".to_owned());
    }
    if h.payload_len < 4 * u64::from(h.tokens) {
        return Err("payload shorter than its token ids".to_owned());
    }
    let payload = bytes
        .get(ALIGN..ALIGN + h.payload_len as usize)
        .ok_or("payload outside the buffer")?;
    h.verify_payload(payload).map_err(|e| e.to_string())?;
    Ok(h)
}

// ---------------------------------------------------------------------------------------------
// The write-behind thread

enum Pending {
    Block {
        key: Key,
        loc: Loc,
    },
    Commit {
        job: usize,
        loc: Loc,
    },
    Relocated {
        key: Key,
        loc: Loc,
        unit: bool,
    },
    /// Compaction's read of a record it copies: the completion is kept in `read_done`.
    Read,
}

struct Writer {
    shared: Arc<Shared>,
    engine: Box<dyn BlockEngine>,
    pool: BufferPool,
    inflight: HashMap<u64, Pending>,
    next_tag: u64,
    /// Segments written since the last sync.
    dirty: BTreeMap<u64, Arc<SegmentFile>>,
    /// A segment file was created since the last sync (its name must be synced too).
    created: bool,
    /// The first write error of the current batch.
    batch_error: Option<String>,
    /// Commits whose writes completed: (job index in the batch, location).
    commits_done: Vec<(usize, Loc)>,
    /// Relocated copies whose writes completed: (key, location, is a unit's commit).
    relocated: Vec<(Key, Loc, bool)>,
    /// Blocks compaction found damaged (not copied).
    lost: Vec<Key>,
    /// The completed read of compaction (reads share the ring with the copies' writes, whose
    /// completions must reach `reap`, so the read is reaped like them).
    read_done: Option<Completion>,
    /// Units an earlier part of which was refused for lack of space.
    full_parts: HashSet<Key>,
    /// What the record being allocated is for: data may not use the last free segment (kept
    /// for compaction and for recording uses); compaction may not reclaim (it is reclaiming).
    purpose: Purpose,
}

/// What an allocation is for (see [`Writer::purpose`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purpose {
    Data,
    Touch,
    Compaction,
}

/// Outcome of a job within a batch.
struct JobRun {
    job: Box<UnitJob>,
    /// Its commit completed.
    committed: Option<Loc>,
    /// Where its commit was submitted (counted in that segment's `unpublished`).
    written: Option<Loc>,
    error: Option<Error>,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        // One batch may wait for its sync while the next is written.
        let (syncer, sync_rx) = mpsc::sync_channel::<SyncWork>(1);
        let shared = Arc::clone(&self.shared);
        let sync_thread = std::thread::spawn(move || sync_loop(&shared, &sync_rx));
        let mut shutdown = false;
        while !shutdown {
            let Ok(first) = rx.recv() else { break };
            let mut batch = vec![first];
            let mut bytes = 0u64;
            // Batch what is already queued (one sync for all of it), within reason.
            while batch.len() < 256 && bytes < (256 << 20) {
                match rx.try_recv() {
                    Ok(j) => {
                        if let Job::Unit(u) = &j {
                            bytes += u.queued;
                        }
                        batch.push(j);
                    }
                    Err(_) => break,
                }
            }
            let mut units = Vec::new();
            let mut flushes = Vec::new();
            let mut reclaims = Vec::new();
            for job in batch {
                match job {
                    Job::Unit(u) => units.push(JobRun {
                        job: u,
                        committed: None,
                        written: None,
                        error: None,
                    }),
                    Job::Flush(tx) => flushes.push(tx),
                    Job::Reclaim(tx) => reclaims.push(tx),
                    Job::Shutdown => shutdown = true,
                }
            }
            // A batch of nothing but early parts of long units commits nothing: its writes
            // stay in flight (no barrier) and are synced with the batch of their last part.
            let settle = shutdown
                || !flushes.is_empty()
                || !reclaims.is_empty()
                || units.iter().any(|r| !r.job.part);
            let Some(mut work) = self.write_batch(units, settle) else {
                continue;
            };
            for tx in reclaims {
                let r = self.reclaim_all();
                let _ = tx.send(r);
            }
            work.flushes = flushes;
            // The sync and the acknowledgements run on the syncer thread while this one goes
            // on writing the next batch. A sync failure poisons the store; later batches then
            // fail without being synced.
            if syncer.send(work).is_err() {
                break;
            }
        }
        self.drain();
        drop(syncer);
        if sync_thread.join().is_err() {
            log::error!("the store's sync thread panicked");
        }
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    /// Writes a batch of unit jobs: blocks, then (once all have completed) commits. Returns
    /// the work of the syncer: one sync of every file written, then publication.
    fn write_batch(&mut self, mut runs: Vec<JobRun>, settle: bool) -> Option<SyncWork> {
        let poisoned = self.st().poisoned.clone();
        // Phase 1: blocks.
        for r in runs.iter_mut() {
            {
                let mut st = self.st();
                st.queued_bytes = st.queued_bytes.saturating_sub(r.job.queued);
            }
            let blocks = std::mem::take(&mut r.job.new_blocks);
            if let Some(reason) = &poisoned {
                r.error = Some(Error::Poisoned {
                    reason: reason.clone(),
                });
                fail_blocks(&self.shared, &blocks);
                continue;
            }
            let mut blocks = blocks.into_iter();
            while let Some(mut b) = blocks.next() {
                let (tenant, model, created) = (r.job.tenant_id, r.job.model, r.job.created);
                let header = RecordHeader {
                    kind: RecordKind::Block,
                    flags: RecordFlags::TOKEN_IDS,
                    seq: 0,
                    segment: 0,
                    key: b.key,
                    parent: b.parent,
                    model,
                    tenant,
                    tokens: b.tokens,
                    count: b.depth,
                    payload_len: 0,
                    created_ms: created,
                    last_used_ms: created,
                    payload_crc: 0,
                };
                let written = self.write_record(header, &b.payload, Some(b.crc), |loc| {
                    Pending::Block { key: b.key, loc }
                });
                // Encoded into the I/O buffer (or failed): the payload is no longer needed.
                self.shared.recycle_payload(std::mem::take(&mut b.payload));
                match written {
                    Ok(_) => {}
                    Err(e) => {
                        if r.job.part && matches!(e, Error::StoreFull { .. }) {
                            self.full_parts.insert(r.job.end);
                        }
                        // Neither this block nor the job's remaining ones will be written:
                        // jobs sharing them must not wait for them.
                        fail_blocks(&self.shared, std::slice::from_ref(&b));
                        fail_blocks(&self.shared, &blocks.collect::<Vec<_>>());
                        r.error = Some(e);
                        break;
                    }
                }
            }
        }
        if !settle {
            // Early parts only: their blocks are in flight; failures are recorded on the
            // blocks and in `batch_error`, both seen by the batch that commits the unit.
            return None;
        }
        self.drain();
        // Phase 2: commits, once every block write of the batch has completed.
        for (i, r) in runs.iter_mut().enumerate() {
            if r.error.is_some() || r.job.part {
                continue;
            }
            let ready = {
                let st = self.st();
                r.job.keys.iter().all(|k| {
                    st.blocks
                        .get(k)
                        .is_some_and(|b| b.loc().is_some() && !b.damaged)
                })
            };
            let refused = self.full_parts.remove(&r.job.end);
            if !ready {
                r.error = Some(if refused {
                    Error::StoreFull { needed: 0 }
                } else {
                    Error::WriteFailed {
                        reason: "a block of the unit could not be written".into(),
                    }
                });
                continue;
            }
            let last_used = if r.job.touch {
                match self.st().units.get(&r.job.end) {
                    Some(u) => u.last_used,
                    // Evicted since the touch was queued: nothing to record.
                    None => {
                        r.error = Some(Error::WriteFailed {
                            reason: "unit evicted".into(),
                        });
                        continue;
                    }
                }
            } else {
                r.job.created
            };
            r.job.last_used = last_used;
            let payload: Vec<u8> = r.job.keys.iter().flatten().copied().collect();
            let header = RecordHeader {
                kind: RecordKind::Commit,
                flags: if r.job.touch {
                    RecordFlags::TOUCH
                } else {
                    RecordFlags::EMPTY
                },
                seq: 0,
                segment: 0,
                key: r.job.end,
                parent: [0; KEY_BYTES],
                model: r.job.model,
                tenant: r.job.tenant_id,
                tokens: r.job.tokens as u32,
                count: r.job.keys.len() as u32,
                payload_len: 0,
                created_ms: r.job.created,
                last_used_ms: last_used,
                payload_crc: 0,
            };
            self.purpose = if r.job.touch {
                Purpose::Touch
            } else {
                Purpose::Data
            };
            let written = self.write_record(header, &payload, None, |loc| Pending::Commit {
                job: i,
                loc,
            });
            self.purpose = Purpose::Data;
            match written {
                Ok(loc) => {
                    r.written = Some(loc);
                    if let Some(seg) = self.st().segments.get_mut(&loc.seg) {
                        seg.unpublished += 1;
                    }
                }
                Err(e) => r.error = Some(e),
            }
        }
        self.drain();
        for (i, loc) in std::mem::take(&mut self.commits_done) {
            if let Some(r) = runs.get_mut(i) {
                r.committed = Some(loc);
            }
        }
        // Phases 3 and 4 (sync, publish, acknowledge) are the syncer's.
        Some(SyncWork {
            runs,
            files: std::mem::take(&mut self.dirty).into_values().collect(),
            dir: std::mem::take(&mut self.created).then(|| self.shared.opts.location.clone()),
            error: self.batch_error.take(),
            flushes: Vec::new(),
        })
    }

    /// Encodes a record into a buffer, allocates its place and submits the write; `crc` is
    /// the payload's CRC-32C when already known.
    fn write_record(
        &mut self,
        mut header: RecordHeader,
        payload: &[u8],
        crc: Option<u32>,
        pending: impl FnOnce(Loc) -> Pending,
    ) -> Result<Loc> {
        let len = record_len(payload.len() as u64);
        let mut buf = self.buffer()?;
        let (file, loc) = self.allocate(len)?;
        header.seq = loc.seq;
        header.segment = loc.seg;
        let crc = crc.unwrap_or_else(|| crc32c(payload));
        encode_record_with_crc(&header, payload, crc, buf.as_mut_slice()).map_err(|e| {
            Error::WriteFailed {
                reason: e.to_string(),
            }
        })?;
        self.submit(buf, &file, loc.offset, len, pending(loc))?;
        Ok(loc)
    }

    fn submit(
        &mut self,
        buf: kvstack_driver::blockio::IoBuf,
        file: &Arc<SegmentFile>,
        offset: u64,
        len: u64,
        pending: Pending,
    ) -> Result<()> {
        let tag = self.next_tag;
        self.next_tag += 1;
        let op = IoOp {
            kind: OpKind::Write,
            file: Arc::clone(&file.file),
            offset: file.base + offset,
            len: len as usize,
            buf,
            tag,
        };
        self.dirty.insert(file.id, Arc::clone(file));
        while self.engine.in_flight() >= self.depth() && !self.ring_failed() {
            self.reap(1);
        }
        self.engine
            .submit(op)
            .map_err(|e| Error::io("cannot write to", file.path.clone(), e.error))?;
        self.inflight.insert(tag, pending);
        bump(&self.shared.counters.bytes_written, len);
        // Hand it to the kernel now: `submit` only queues it, and the next wait would come
        // after encoding the next record (about 35 us), a write's worth of queue depth lost
        // all the time. Collects whatever has completed meanwhile, without blocking.
        self.reap(0);
        Ok(())
    }

    /// At most this many writes in flight (the configured queue depth; the pool holds twice
    /// as many buffers so the next ones are encoded meanwhile).
    fn depth(&self) -> usize {
        self.shared.opts.queue_depth.min(self.engine.depth()).max(1)
    }

    /// Whether the I/O ring itself failed (its completions can no longer be waited for).
    fn ring_failed(&self) -> bool {
        self.batch_error
            .as_deref()
            .is_some_and(|e| e.starts_with("I/O ring"))
    }

    /// A free I/O buffer, reaping completions until one is returned.
    fn buffer(&mut self) -> Result<kvstack_driver::blockio::IoBuf> {
        loop {
            if let Some(b) = self.pool.try_get() {
                return Ok(b);
            }
            if self.ring_failed() {
                // Keep the ring's own error as the cause, not a bare "closed".
                return Err(Error::WriteFailed {
                    reason: self.batch_error.clone().unwrap_or_default(),
                });
            }
            if self.engine.in_flight() == 0 {
                // Every buffer is free when nothing is in flight; this is unreachable unless
                // a completion was lost.
                return self.pool.try_get().ok_or(Error::Closed);
            }
            self.reap(1);
        }
    }

    /// Reaps at least `min` completions and applies them.
    fn reap(&mut self, min: usize) {
        let mut out = Vec::new();
        if let Err(e) = self.engine.wait(min, &mut out) {
            self.batch_error
                .get_or_insert(format!("I/O ring failed: {e}"));
        }
        for c in out {
            let Some(p) = self.inflight.remove(&c.op.tag) else {
                continue;
            };
            if matches!(p, Pending::Read) {
                self.read_done = Some(c);
                continue;
            }
            let ok = match &c.result {
                Ok(n) if *n == c.op.len => true,
                Ok(n) => {
                    self.batch_error
                        .get_or_insert(format!("short write: {n} of {} bytes", c.op.len));
                    false
                }
                Err(e) => {
                    self.batch_error.get_or_insert(format!("write failed: {e}"));
                    false
                }
            };
            match p {
                Pending::Block { key, loc } => {
                    let mut st = self.shared.lock();
                    let State {
                        blocks, segments, ..
                    } = &mut *st;
                    if let Some(b) = blocks.get_mut(&key) {
                        if ok {
                            b.state = BlockState::Written(loc);
                            if let Some(s) = segments.get_mut(&loc.seg) {
                                s.live += loc.len;
                                s.blocks.insert(key);
                            }
                        } else {
                            b.state = BlockState::Failed;
                        }
                    }
                    drop(st);
                    if ok {
                        bump(&self.shared.counters.blocks_written, 1);
                    }
                }
                Pending::Commit { job, loc } => {
                    if ok {
                        self.commits_done.push((job, loc));
                    }
                }
                Pending::Relocated { key, loc, unit } => {
                    // Applied after the sync (compact), recorded here.
                    if ok {
                        self.relocated.push((key, loc, unit));
                    }
                }
                Pending::Read => {}
            }
        }
    }

    /// Waits for everything in flight.
    fn drain(&mut self) {
        while self.engine.in_flight() > 0 {
            let n = self.engine.in_flight();
            self.reap(n);
            if self
                .batch_error
                .as_deref()
                .is_some_and(|e| e.starts_with("I/O ring"))
            {
                break;
            }
        }
    }

    /// `fdatasync` of every segment written since the last sync (and of the directory when a
    /// segment was created since). Returns the error, if any.
    fn sync(&mut self) -> Option<String> {
        if std::mem::take(&mut self.created)
            && let Err(e) = sync_location_dir(&self.shared.opts.location)
        {
            return Some(e);
        }
        let dirty = std::mem::take(&mut self.dirty);
        let mut seen_files = HashSet::new();
        for (_, seg) in dirty {
            // Device slots share one file: sync it once.
            if !seen_files.insert(Arc::as_ptr(&seg.file) as usize) {
                continue;
            }
            if let Err(e) = seg.file.sync_data() {
                return Some(format!("fdatasync of {} failed: {e}", seg.path.display()));
            }
        }
        None
    }
}

/// A written batch waiting for its sync.
struct SyncWork {
    runs: Vec<JobRun>,
    /// Every segment written by the batch.
    files: Vec<Arc<SegmentFile>>,
    /// The directory to sync when the batch created segment files.
    dir: Option<StoreLocation>,
    /// A write error of the batch.
    error: Option<String>,
    /// Flushes to answer once the batch is settled.
    flushes: Vec<mpsc::Sender<()>>,
}

fn sync_location_dir(location: &StoreLocation) -> std::result::Result<(), String> {
    match location {
        StoreLocation::Directory(dir) => kvstack_driver::blockio::sync_dir(dir)
            .map_err(|e| format!("fsync of directory {} failed: {e}", dir.display())),
        StoreLocation::Device(_) => Ok(()),
    }
}

/// The syncer thread: makes each written batch durable (one `fdatasync` per file, the
/// directory when segments were created), then publishes and acknowledges its units, in
/// batch order. After a failure every later batch fails unsynced: a file whose sync failed is
/// not trusted again (a later sync could succeed without the lost writes).
fn sync_loop(shared: &Shared, rx: &mpsc::Receiver<SyncWork>) {
    for mut work in rx {
        if shared.opts.test_sync_delay_ms > 0 {
            std::thread::sleep(Duration::from_millis(shared.opts.test_sync_delay_ms));
        }
        let poisoned = shared.lock().poisoned.clone();
        let mut failure = poisoned.or(work.error.take());
        if failure.is_none()
            && let Some(loc) = &work.dir
            && let Err(e) = sync_location_dir(loc)
        {
            failure = Some(e);
        }
        if failure.is_none() {
            let mut seen = HashSet::new();
            for seg in &work.files {
                if !seen.insert(Arc::as_ptr(&seg.file) as usize) {
                    continue;
                }
                if let Err(e) = seg.file.sync_data() {
                    failure = Some(format!("fdatasync of {} failed: {e}", seg.path.display()));
                    break;
                }
            }
        }
        drop(std::mem::take(&mut work.files));
        let mut st = shared.lock();
        if let Some(reason) = &failure
            && st.poisoned.is_none()
        {
            log::error!("store write failed, disabling writes: {reason}");
            st.poisoned = Some(reason.clone());
        }
        for r in work.runs.iter_mut() {
            if let Some(l) = r.written
                && let Some(seg) = st.segments.get_mut(&l.seg)
            {
                seg.unpublished = seg.unpublished.saturating_sub(1);
            }
            if r.job.part {
                // Blocks only: their unit's last part publishes (or unpins) them.
                continue;
            }
            let mut ok = r.error.is_none() && r.committed.is_some() && failure.is_none();
            // The commit's segment must still be there: publishing into a reclaimed one
            // would leave the unit without a commit on disk (never expected; checked because
            // the cost of being wrong is silent loss at the next restart).
            if ok
                && let Some(l) = r.committed
                && !st.segments.contains_key(&l.seg)
            {
                log::error!(
                    "the commit of a unit was written into segment {}, reclaimed before it \
                     was published; the write is failed",
                    l.seg
                );
                r.error = Some(Error::WriteFailed {
                    reason: format!("segment {} was reclaimed before publication", l.seg),
                });
                if r.job.touch {
                    bump(&shared.counters.failed_writes, 1);
                }
                ok = false;
            }
            if ok {
                publish(&mut st, &r.job, r.committed, shared);
            } else if !r.job.touch {
                unpin(&mut st, &r.job.keys);
            } else if let Some(u) = st.units.get_mut(&r.job.end) {
                u.touch_queued = false;
            }
            if !r.job.touch {
                if ok {
                    bump(&shared.counters.units_written, 1);
                } else if matches!(r.error, Some(Error::StoreFull { .. })) {
                    bump(&shared.counters.refused_full, 1);
                } else {
                    bump(&shared.counters.failed_writes, 1);
                }
            }
            let reply = if ok {
                Ok(())
            } else {
                Err(r.error.take().unwrap_or_else(|| Error::WriteFailed {
                    reason: failure
                        .clone()
                        .unwrap_or_else(|| "commit not written".into()),
                }))
            };
            if let Some(tx) = r.job.reply.take() {
                let _ = tx.send(reply);
            }
        }
        drop(st);
        for tx in work.flushes {
            let _ = tx.send(());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Space: allocation, eviction, compaction (all on the writer thread)

impl Writer {
    /// A place for a record of `len` bytes: in the active segment, or a new one (reclaiming
    /// space if none is free). Data goes to the data segment and may not take the last free
    /// slot; uses (touch commits) and compaction go to the system segment, which may take it,
    /// so data can never use up the room compaction needs.
    fn allocate(&mut self, len: u64) -> Result<(Arc<SegmentFile>, Loc)> {
        let shared = Arc::clone(&self.shared);
        let system = self.purpose != Purpose::Data;
        let mut waited = Duration::ZERO;
        loop {
            {
                let mut st = shared.lock();
                let seq = st.next_seq;
                let candidates = if system {
                    [st.system_active, st.active]
                } else {
                    [st.active, None]
                };
                for id in candidates.into_iter().flatten() {
                    if let Some(seg) = st.segments.get_mut(&id)
                        && seg.next + len <= seg.file.bytes
                    {
                        let loc = Loc {
                            seg: id,
                            offset: seg.next,
                            len,
                            seq,
                        };
                        seg.next += len;
                        seg.written = seg.next;
                        let file = Arc::clone(&seg.file);
                        st.next_seq += 1;
                        return Ok((file, loc));
                    }
                }
                // The segment is full: seal it.
                if system {
                    st.system_active = None;
                } else {
                    st.active = None;
                }
                free_retired(&mut st, &self.shared);
                let reserve = if system { 0 } else { 1 };
                if st.space.free() > reserve {
                    let id = st.next_segment;
                    st.next_segment += 1;
                    let file = Arc::new(st.space.create(id)?);
                    let header = SegmentHeader {
                        segment: id,
                        segment_bytes: file.bytes,
                        created_ms: self.shared.clock.now_ms(),
                        first_seq: st.next_seq - 1,
                        store_id: st.store_id,
                    };
                    write_segment_header(&file, &header)?;
                    bump(
                        &self.shared.counters.bytes_written,
                        SEGMENT_HEADER_PAGE as u64,
                    );
                    self.dirty.insert(id, Arc::clone(&file));
                    self.created = true;
                    st.segments.insert(
                        id,
                        SegMeta {
                            file,
                            live: 0,
                            written: SEGMENT_HEADER_PAGE as u64,
                            next: SEGMENT_HEADER_PAGE as u64,
                            blocks: HashSet::new(),
                            units: HashSet::new(),
                            unpublished: 0,
                        },
                    );
                    if system {
                        st.system_active = Some(id);
                    } else {
                        st.active = Some(id);
                    }
                    continue;
                }
            }
            if self.purpose == Purpose::Compaction {
                return Err(Error::StoreFull { needed: len });
            }
            if self.make_room()? {
                continue;
            }
            // Retired segments still leased by readers free up as soon as the reads end.
            let leased = !self.st().retired.is_empty();
            if leased && waited < Duration::from_millis(500) {
                std::thread::sleep(Duration::from_millis(2));
                waited += Duration::from_millis(2);
                continue;
            }
            return Err(Error::StoreFull { needed: len });
        }
    }

    /// Frees a segment if anything may be reclaimed: units past retention are evicted oldest
    /// idle first until a segment holds nothing live; failing that, one mostly-dead segment is
    /// compacted. Returns whether a segment slot was freed.
    fn make_room(&mut self) -> Result<bool> {
        let now = self.shared.clock.now_ms();
        let retention = self.shared.opts.retention_ms;
        {
            let mut st = self.st();
            let before = st.space.free();
            loop {
                retire_empty(&mut st, &self.dirty);
                free_retired(&mut st, &self.shared);
                if st.space.free() > before {
                    return Ok(true);
                }
                let Some(&(used, end)) = st.by_age.first() else {
                    break;
                };
                if used.saturating_add(retention) > now {
                    break;
                }
                evict_unit(&mut st, &end, &self.shared);
            }
            retire_empty(&mut st, &self.dirty);
            free_retired(&mut st, &self.shared);
            if st.space.free() > before {
                return Ok(true);
            }
        }
        let Some(victim) = self.compaction_victim() else {
            return Ok(false);
        };
        match self.compact(victim) {
            Ok(()) => {}
            // No room to copy into: nothing may be reclaimed now.
            Err(Error::StoreFull { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        let mut st = self.st();
        free_retired(&mut st, &self.shared);
        Ok(st.space.free() > 1)
    }

    /// The segment with the fewest live bytes, if at most `compact_live_fraction` of it is
    /// live and it is neither being written nor awaiting a sync.
    fn compaction_victim(&self) -> Option<u64> {
        let st = self.st();
        let limit = (self.shared.opts.compact_live_fraction * st.space.segment_bytes as f64) as u64;
        st.segments
            .iter()
            .filter(|(id, s)| {
                Some(**id) != st.active
                    && Some(**id) != st.system_active
                    && !self.dirty.contains_key(id)
                    && s.unpublished == 0
                    && s.live <= limit
            })
            .min_by_key(|(_, s)| s.live)
            .map(|(id, _)| *id)
    }

    /// Rewrites the live records of segment `victim` elsewhere, syncs them, points the index
    /// at the copies and retires the segment.
    fn compact(&mut self, victim: u64) -> Result<()> {
        self.drain();
        let (blocks, units, file) = {
            let st = self.st();
            let Some(seg) = st.segments.get(&victim) else {
                return Ok(());
            };
            let blocks: Vec<(Key, Loc, u32)> = seg
                .blocks
                .iter()
                .filter_map(|k| {
                    let b = st.blocks.get(k)?;
                    Some((*k, b.loc()?, b.tokens))
                })
                .collect();
            let units: Vec<(Key, Vec<Key>)> =
                seg.units.iter().map(|k| (*k, chain_of(&st, k))).collect();
            (blocks, units, Arc::clone(&seg.file))
        };
        log::debug!(
            "compacting segment {victim}: {} blocks, {} commits",
            blocks.len(),
            units.len()
        );
        let purpose = std::mem::replace(&mut self.purpose, Purpose::Compaction);
        self.relocated.clear();
        self.lost.clear();
        let result = self.relocate(&file, &blocks, &units);
        self.drain();
        let synced = self.sync();
        self.purpose = purpose;
        let relocated = std::mem::take(&mut self.relocated);
        if let Some(reason) = synced.or_else(|| self.batch_error.take()) {
            self.st().poisoned = Some(reason.clone());
            return Err(Error::Poisoned { reason });
        }
        result?;
        let lost = std::mem::take(&mut self.lost);
        let mut st = self.st();
        let mut moved = 0u64;
        for (key, loc, unit) in relocated {
            let State {
                blocks,
                units,
                segments,
                ..
            } = &mut *st;
            let old = if unit {
                units.get_mut(&key).and_then(|u| {
                    let old = u.loc.filter(|l| l.seg == victim)?;
                    u.loc = Some(loc);
                    Some(old)
                })
            } else {
                blocks.get_mut(&key).and_then(|b| {
                    let old = b.loc().filter(|l| l.seg == victim)?;
                    b.state = BlockState::Written(loc);
                    Some(old)
                })
            };
            // The copy is live only if the index now points at it.
            if let Some(old) = old {
                if let Some(s) = segments.get_mut(&victim) {
                    s.live = s.live.saturating_sub(old.len);
                    if unit {
                        s.units.remove(&key);
                    } else {
                        s.blocks.remove(&key);
                    }
                }
                if let Some(s) = segments.get_mut(&loc.seg) {
                    s.live += loc.len;
                    if unit {
                        s.units.insert(key);
                    } else {
                        s.blocks.insert(key);
                    }
                }
                moved += 1;
            }
        }
        // Damaged blocks are not copied: they stay in the index, invisible, until a unit
        // writes them again; their bytes die with the segment.
        for key in lost {
            let State {
                blocks, segments, ..
            } = &mut *st;
            if let Some(b) = blocks.get_mut(&key)
                && let Some(old) = b.loc().filter(|l| l.seg == victim)
            {
                b.state = BlockState::Failed;
                b.damaged = true;
                if let Some(s) = segments.get_mut(&victim)
                    && s.blocks.remove(&key)
                {
                    s.live = s.live.saturating_sub(old.len);
                }
            }
        }
        bump(&self.shared.counters.records_relocated, moved);
        bump(&self.shared.counters.segments_compacted, 1);
        retire_empty(&mut st, &self.dirty);
        Ok(())
    }

    /// Reads the record at `loc` of `file` through the writer's ring. Completions of the
    /// copies' writes that arrive meanwhile are applied as usual (not dropped: a dropped one
    /// would leave its copy unindexed and its victim unreclaimable).
    fn read_record(&mut self, file: &Arc<SegmentFile>, loc: &Loc) -> Result<Completion> {
        let buf = self.buffer()?;
        let tag = self.next_tag;
        self.next_tag += 1;
        let op = IoOp {
            kind: OpKind::Read,
            file: Arc::clone(&file.file),
            offset: file.base + loc.offset,
            len: loc.len as usize,
            buf,
            tag,
        };
        self.engine
            .submit(op)
            .map_err(|e| Error::io("cannot read from", file.path.clone(), e.error))?;
        self.inflight.insert(tag, Pending::Read);
        self.read_done = None;
        while self.read_done.is_none() {
            if self.engine.in_flight() == 0 {
                return Err(Error::io(
                    "block I/O ring lost a read of",
                    file.path.clone(),
                    std::io::Error::other("no completion"),
                ));
            }
            self.reap(1);
            if let Some(e) = self.batch_error.as_deref()
                && e.starts_with("I/O ring")
                && self.read_done.is_none()
            {
                return Err(Error::io(
                    "block I/O ring failed reading",
                    file.path.clone(),
                    std::io::Error::other(e.to_owned()),
                ));
            }
        }
        self.read_done.take().ok_or(Error::Closed)
    }

    fn relocate(
        &mut self,
        file: &Arc<SegmentFile>,
        blocks: &[(Key, Loc, u32)],
        units: &[(Key, Vec<Key>)],
    ) -> Result<()> {
        for (key, loc, tokens) in blocks {
            let c = self.read_record(file, loc)?;
            match check_block(&c, key, loc, *tokens) {
                Ok(h) => {
                    let mut buf = c.op.buf;
                    let (nfile, nloc) = self.allocate(loc.len)?;
                    let nh = RecordHeader {
                        seq: nloc.seq,
                        segment: nloc.seg,
                        flags: h.flags.union(RecordFlags::RELOCATED),
                        ..h
                    };
                    if let Some(head) = buf.as_mut_slice().get_mut(..RecordHeader::BYTES) {
                        head.copy_from_slice(&nh.encode());
                    }
                    self.submit(
                        buf,
                        &nfile,
                        nloc.offset,
                        nloc.len,
                        Pending::Relocated {
                            key: *key,
                            loc: nloc,
                            unit: false,
                        },
                    )?;
                }
                Err(reason) => {
                    log::warn!(
                        "compaction found a damaged block in {} at offset {}: {reason}",
                        file.path.display(),
                        file.base + loc.offset
                    );
                    bump(&self.shared.counters.damaged_reads, 1);
                    self.lost.push(*key);
                }
            }
        }
        for (end, keys) in units {
            let meta = {
                let st = self.st();
                st.units
                    .get(end)
                    .map(|u| (u.tokens, u.tenant_id, u.model, u.created, u.last_used))
            };
            let Some((tokens, tenant, model, created, last_used)) = meta else {
                continue;
            };
            let payload: Vec<u8> = keys.iter().flatten().copied().collect();
            let header = RecordHeader {
                kind: RecordKind::Commit,
                flags: RecordFlags::RELOCATED,
                seq: 0,
                segment: 0,
                key: *end,
                parent: [0; KEY_BYTES],
                model,
                tenant,
                tokens: tokens as u32,
                count: keys.len() as u32,
                payload_len: 0,
                created_ms: created,
                last_used_ms: last_used,
                payload_crc: 0,
            };
            self.write_record(header, &payload, None, |loc| Pending::Relocated {
                key: *end,
                loc,
                unit: true,
            })?;
        }
        Ok(())
    }

    /// Evicts every unit past retention and compacts every qualifying segment.
    fn reclaim_all(&mut self) -> Result<ReclaimReport> {
        let c = &self.shared.counters;
        let before = (
            c.units_evicted.load(Ordering::Relaxed),
            c.segments_compacted.load(Ordering::Relaxed),
            c.segments_freed.load(Ordering::Relaxed),
        );
        let now = self.shared.clock.now_ms();
        {
            let mut st = self.st();
            while let Some(&(used, end)) = st.by_age.first() {
                if used.saturating_add(self.shared.opts.retention_ms) > now {
                    break;
                }
                evict_unit(&mut st, &end, &self.shared);
            }
        }
        self.drain();
        if let Some(reason) = self.sync() {
            self.st().poisoned = Some(reason.clone());
            return Err(Error::Poisoned { reason });
        }
        {
            let mut st = self.st();
            retire_empty(&mut st, &self.dirty);
            free_retired(&mut st, &self.shared);
        }
        let mut tried = HashSet::new();
        while let Some(victim) = self.compaction_victim() {
            if !tried.insert(victim) {
                break;
            }
            match self.compact(victim) {
                Ok(()) => {}
                Err(Error::StoreFull { .. }) => break,
                Err(e) => return Err(e),
            }
            let mut st = self.st();
            free_retired(&mut st, &self.shared);
        }
        let c = &self.shared.counters;
        Ok(ReclaimReport {
            units_evicted: c.units_evicted.load(Ordering::Relaxed) - before.0,
            segments_compacted: c.segments_compacted.load(Ordering::Relaxed) - before.1,
            segments_freed: c.segments_freed.load(Ordering::Relaxed) - before.2,
        })
    }
}

/// Writes a segment header page synchronously (segment creation is rare).
fn write_segment_header(file: &SegmentFile, header: &SegmentHeader) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let mut page = kvstack_driver::pinned::PinnedRegion::new(
        SEGMENT_HEADER_PAGE,
        PinnedOptions {
            huge_pages: kvstack_driver::pinned::HugePages::Never,
            locking: kvstack_driver::pinned::Locking::Never,
        },
    )
    .map_err(Error::Memory)?;
    let bytes = page.as_mut_slice();
    bytes.fill(0);
    bytes[..SegmentHeader::BYTES].copy_from_slice(&header.encode());
    file.file
        .write_all_at(&page.as_slice()[..SEGMENT_HEADER_PAGE], file.base)
        .map_err(|e| Error::io("cannot write the header of segment", file.path.clone(), e))
}

/// Makes a durable unit visible (or records a touch), moving its job's pins to coverage.
fn publish(st: &mut State, job: &UnitJob, loc: Option<Loc>, shared: &Shared) {
    let Some(loc) = loc else { return };
    let end = job.end;
    let State {
        units,
        by_age,
        blocks,
        segments,
        children,
        ..
    } = st;
    let mut count_commit = |units_in_seg: &mut HashMap<Key, UnitMeta>| {
        if let Some(u) = units_in_seg.get_mut(&end) {
            if let Some(old) = u.loc.replace(loc)
                && let Some(s) = segments.get_mut(&old.seg)
                && s.units.remove(&end)
            {
                s.live = s.live.saturating_sub(old.len);
            }
            if let Some(s) = segments.get_mut(&loc.seg) {
                s.live += loc.len;
                s.units.insert(end);
            }
            u.persisted_used = u.persisted_used.max(job.last_used);
            u.touch_queued = false;
            if u.tenant_id == 0 {
                u.tenant_id = job.tenant_id;
                u.model = job.model;
            }
            true
        } else {
            false
        }
    };
    if job.touch {
        count_commit(units);
        return;
    }
    if count_commit(units) {
        // The same unit was committed twice (two identical puts in flight): one coverage.
        for k in &job.keys {
            if let Some(b) = blocks.get_mut(k) {
                b.pinned = b.pinned.saturating_sub(1);
            }
        }
        if let Some(u) = units.get_mut(&end) {
            by_age.remove(&(u.last_used, end));
            u.last_used = u.last_used.max(job.created);
            by_age.insert((u.last_used, end));
        }
        return;
    }
    for k in &job.keys {
        if let Some(b) = blocks.get_mut(k) {
            b.pinned = b.pinned.saturating_sub(1);
            b.covered += 1;
            if b.covered == 1 {
                let kids = children.entry(b.parent).or_default();
                if !kids.iter().any(|(_, c)| c == k) {
                    kids.push((b.tokens, *k));
                }
            }
        }
    }
    units.insert(
        end,
        UnitMeta {
            tokens: job.tokens,
            created: job.created,
            last_used: job.created,
            persisted_used: job.created,
            loc: Some(loc),
            touch_queued: false,
            tenant_id: job.tenant_id,
            model: job.model,
        },
    );
    by_age.insert((job.created, end));
    if let Some(s) = segments.get_mut(&loc.seg) {
        s.live += loc.len;
        s.units.insert(end);
    }
    let _ = shared;
}

/// Removes a unit; blocks no other unit (or queued job) needs become dead space.
fn evict_unit(st: &mut State, end: &Key, shared: &Shared) {
    let keys = chain_of(st, end);
    let Some(u) = st.units.remove(end) else {
        return;
    };
    st.by_age.remove(&(u.last_used, *end));
    if let Some(l) = u.loc
        && let Some(s) = st.segments.get_mut(&l.seg)
        && s.units.remove(end)
    {
        s.live = s.live.saturating_sub(l.len);
    }
    for k in &keys {
        let dead = match st.blocks.get_mut(k) {
            Some(b) => {
                b.covered = b.covered.saturating_sub(1);
                b.covered == 0 && b.pinned == 0
            }
            None => false,
        };
        if dead {
            drop_block(st, k);
        }
    }
    bump(&shared.counters.units_evicted, 1);
}

/// Retires every segment that holds nothing live and is neither active nor awaiting a sync.
fn retire_empty(st: &mut State, dirty: &BTreeMap<u64, Arc<SegmentFile>>) {
    let empty: Vec<u64> = st
        .segments
        .iter()
        .filter(|(id, s)| {
            Some(**id) != st.active
                && Some(**id) != st.system_active
                && !dirty.contains_key(id)
                && s.unpublished == 0
                && s.blocks.is_empty()
                && s.units.is_empty()
        })
        .map(|(id, _)| *id)
        .collect();
    for id in empty {
        if let Some(s) = st.segments.remove(&id) {
            st.retired.push(s.file);
        }
    }
}

/// Frees retired segments that no reader holds a lease on any more.
fn free_retired(st: &mut State, shared: &Shared) {
    let retired = std::mem::take(&mut st.retired);
    for seg in retired {
        if Arc::strong_count(&seg) > 1 {
            st.retired.push(seg);
            continue;
        }
        if let Err(e) = st.space.release(&seg) {
            log::warn!("freeing segment {}: {e}", seg.id);
        }
        bump(&shared.counters.segments_freed, 1);
    }
}

/// Removes every store file under a directory store (for tools and benches that clean up).
pub fn remove_directory_store(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(|n| n.starts_with("seg-") && n.ends_with(".kvs"))
        {
            std::fs::remove_file(entry.path())?;
        }
    }
    std::fs::remove_dir(dir)
}
