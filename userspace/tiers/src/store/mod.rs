//! The SSD store of global KV (spec §7: at least 72 hours of residency after last use).
//!
//! What is stored (`docs/ssd-format.md` for the bytes, `docs/tiers.md` for the rules):
//! - **blocks**, content-addressed by a chained key ([`crate::key`]): one page of tokens of
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
//! Deletes ([`SsdStore::delete_unit`]) take the same path as commits: a delete record written
//! by the write-behind thread, synced before the delete is acknowledged ([`DeleteTicket`]);
//! recovery restores a unit only from a commit newer than its newest delete.
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

mod delete;
mod index;
mod open;
mod options;
mod pin;
mod put;
mod quota;
mod read;
mod reclaim;
mod writer;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use kvstack_driver::blockio::EngineChoice;
use kvstack_firmware_interface::record::Key;

use crate::{Error, Result};
use index::Shared;
use put::Job;

pub use delete::{DeleteOutcome, DeleteTicket};
pub(crate) use open::scan_location;
pub use options::{
    DEFAULT_RETENTION_MS, ReclaimReport, RecoveryReport, StoreHooks, StoreOptions, StoreStats,
    UnitEvent, V41_BLOCK_PAYLOAD,
};
pub use put::{BlockSource, UnitTicket, UnitWrite};
pub use read::{ReadOutcome, StoreHit};

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

impl SsdStore {
    /// The I/O engine in use and why.
    pub fn engine(&self) -> &EngineChoice {
        &self.shared.choice
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.shared.opts
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
            units_deleted: get(&c.units_deleted),
            deletes: get(&c.deletes),
            tombstones: st.tombstones.len() as u64,
            segments_compacted: get(&c.segments_compacted),
            segments_freed: get(&c.segments_freed),
            records_relocated: get(&c.records_relocated),
            damaged_reads: get(&c.damaged_reads),
            lookups: get(&c.lookups),
            hits: get(&c.hits),
            quota_evicted: get(&c.quota_evicted),
            refused_quota: get(&c.refused_quota),
            poisoned: st.poisoned.clone(),
            recovery: sh.recovery.clone(),
            nvme_copies: sh.namespace.as_ref().map(|n| n.ns.copy_stats()),
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

    /// Up to `max` durable units as [`StoreHooks::unit_durable`] reports them (tenant, model,
    /// chain keys), most recently used first: what recovery found, for an index of them.
    pub fn durable_units(&self, max: usize) -> Vec<UnitEvent> {
        let st = self.shared.lock();
        st.by_age
            .iter()
            .rev()
            .filter_map(|(_, end)| {
                let u = st.units.get(end).filter(|u| u.loc.is_some())?;
                let keys = index::chain_of(&st, end);
                let tenant = match u.tenant_id {
                    0 => st.blocks.get(keys.first()?)?.tenant,
                    t => t,
                };
                Some(UnitEvent {
                    end: *end,
                    tenant,
                    model: u.model,
                    tokens: u.tokens,
                    keys,
                })
            })
            .take(max)
            .collect()
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
