//! Store options, and the reports and counters the store gives back.

use kvstack_driver::blockio::{CopyStats, EngineChoice, EnginePreference};
use kvstack_driver::pinned::PinnedOptions;
use kvstack_firmware_interface::record::{KEY_BYTES, Key, SEGMENT_HEADER_PAGE, record_len};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry};
use serde::Serialize;
use std::sync::Arc;

use crate::clock::HOUR_MS;
use crate::scan::Damage;
use crate::segment::{NamespaceLocation, StoreLocation};
use crate::{Error, Result};

/// Default retention after last use: 72 hours (spec §7).
pub const DEFAULT_RETENTION_MS: u64 = 72 * HOUR_MS;

/// Tokens of a block at the paged cache's default page size.
const V41_BLOCK_TOKENS: usize = 256;

/// Entries of one full V4.1-Flash block: three ratio-2 KV sources (layers 2, 8, 14) hold one
/// entry per 2 tokens, the ratio-1 source (layer 20) one per token (spec §4).
const V41_BLOCK_ENTRIES: usize = 3 * (V41_BLOCK_TOKENS / 2) + V41_BLOCK_TOKENS;

/// Bytes of one full V4.1-Flash block payload with its token ids: every entry's FP4 global
/// entry and MXFP4 index key, then the block's token ids (u32 each). The default
/// [`StoreOptions::max_block_payload`]; `Tiers::open` raises it to its model's block size.
pub const V41_BLOCK_PAYLOAD: usize = V41_BLOCK_ENTRIES
    * (GlobalFp4Entry::BYTES + IndexMxfp4Entry::BYTES)
    + V41_BLOCK_TOKENS * size_of::<u32>();

/// Options of [`SsdStore::open`](super::SsdStore::open).
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
    /// Points where a test or a fault-injection harness acts on the store's threads; `None`
    /// (the default) in production.
    pub hooks: Option<Arc<dyn StoreHooks>>,
}

/// Points in the store's threads where a test or a fault-injection harness may act (delay,
/// record, fail), as a slow or failing disk would, and where the shared prefix index learns
/// which units this store holds (`Tiers` installs hooks for that when it has one,
/// `docs/cluster.md`).
pub trait StoreHooks: Send + Sync + std::fmt::Debug {
    /// On the syncer thread, before each batch's sync: a delay here makes the writer run ahead
    /// of publication, as it does on a slow disk.
    fn before_sync(&self) {}

    /// A unit's commit (or a touch commit recording a newer use) is durable and the unit
    /// visible. Called on the syncer thread with the store's lock held: it must not block nor
    /// call into the store (hand the event to another thread).
    fn unit_durable(&self, _unit: &UnitEvent) {}

    /// A unit left the store (evicted past retention or for its tenant's quota, or deleted);
    /// [`UnitEvent::keys`] names its blocks no other unit holds any more. Called with the
    /// store's lock held, on whichever thread removed it: must not block.
    fn unit_removed(&self, _unit: &UnitEvent) {}
}

/// A unit as [`StoreHooks::unit_durable`] and [`StoreHooks::unit_removed`] report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitEvent {
    /// The unit's key (its last block's).
    pub end: Key,
    /// `Tenant::id` of its tenant.
    pub tenant: u64,
    /// The first 16 bytes of its model fingerprint.
    pub model: [u8; 16],
    /// Tokens of the unit.
    pub tokens: u64,
    /// Durable: every block key of the unit, first to last. Removed: the keys of its blocks
    /// that no unit of the store covers any more (blocks shared with a longer unit stay).
    pub keys: Vec<Key>,
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
            hooks: None,
        }
    }

    /// Applies an `--io-engine` value (also the appliance's `io_engine` key): `auto`,
    /// `io_uring`, `sync` (buffered), `sync-direct` choose the file engine for the configured
    /// location; `vfio:<pci-address>` makes the location namespace 1 of that NVMe controller
    /// (bound to `vfio-pci`), driven by the userspace driver, in place of the directory or
    /// device.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] (field `io_engine`) naming the value.
    pub fn set_io_engine(&mut self, value: &str) -> Result<()> {
        let bad = |reason: String| Error::InvalidOption {
            field: "io_engine",
            reason,
        };
        self.engine = match value {
            "auto" => EnginePreference::Auto,
            "io_uring" => EnginePreference::Uring,
            "sync" => EnginePreference::SyncBuffered,
            "sync-direct" => EnginePreference::SyncDirect,
            v => {
                let Some(address) = v.strip_prefix("vfio:") else {
                    return Err(bad(format!(
                        "`{v}` is none of auto, io_uring, sync, sync-direct, vfio:<pci-address>"
                    )));
                };
                let opener = kvstack_driver::nvme::vfio::VfioOpener::new(address)
                    .map_err(|e| bad(format!("`{v}`: {e}")))?;
                self.location = StoreLocation::Namespace(NamespaceLocation::new(Arc::new(opener)));
                EnginePreference::Auto
            }
        };
        Ok(())
    }

    /// Bytes of one I/O buffer: the largest record (a full block, or a commit of the longest
    /// unit), page aligned.
    pub fn io_buffer_bytes(&self) -> usize {
        let block = record_len(self.max_block_payload as u64);
        let commit = record_len((self.max_unit_blocks * KEY_BYTES) as u64);
        block.max(commit) as usize
    }

    pub(super) fn validate(&self) -> Result<()> {
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

/// What [`SsdStore::open`](super::SsdStore::open) found and how long it took.
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
    /// Units not restored because their newest record is a delete.
    pub units_deleted: u64,
    /// Delete records kept (an older commit of their key is still on disk).
    pub tombstones: u64,
    /// Records cut short by a crash (after the last valid record of their segment).
    pub torn_tail_ranges: u64,
    /// Damage found before valid records (reported with its location).
    pub damaged: Vec<Damage>,
    /// Slots whose header is damaged or belongs elsewhere, with the reason.
    pub invalid_segments: Vec<String>,
    /// Bytes read.
    pub bytes_read: u64,
    /// Set when the store was read while another process writes it (a read-only open that
    /// found the location's write lock held): who writes it. Such a read is a snapshot of a
    /// moving store: units written meanwhile may be missing or end in torn tails.
    pub live_writers: Option<String>,
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
    /// Units (and deletes) refused because nothing could be reclaimed.
    pub refused_full: u64,
    /// Units refused because the write-behind queue was full.
    pub refused_queue: u64,
    /// Unit writes that failed with an I/O error.
    pub failed_writes: u64,
    /// Units evicted past retention.
    pub units_evicted: u64,
    /// Units removed by acknowledged deletes.
    pub units_deleted: u64,
    /// Deletes acknowledged (durable), whether or not they found a unit.
    pub deletes: u64,
    /// Delete records kept (an older commit of their key is still on disk).
    pub tombstones: u64,
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
    /// Units evicted to keep their tenant within its SSD quota (any age).
    pub quota_evicted: u64,
    /// Unit writes refused by their tenant's SSD quota.
    pub refused_quota: u64,
    /// Why writes are disabled, if they are.
    pub poisoned: Option<String>,
    /// What the last open found.
    pub recovery: RecoveryReport,
    /// On an NVMe namespace: how the controller's engines moved data (zero copy for the
    /// store's buffer pools, which are mapped for the controller; bounced otherwise).
    pub nvme_copies: Option<CopyStats>,
}

/// What [`SsdStore::reclaim`](super::SsdStore::reclaim) did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReclaimReport {
    /// Units evicted past retention.
    pub units_evicted: u64,
    /// Segments compacted.
    pub segments_compacted: u64,
    /// Segments freed.
    pub segments_freed: u64,
}
