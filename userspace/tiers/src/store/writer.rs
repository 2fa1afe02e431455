//! The write path: `put_unit` queues a unit's new blocks, the write-behind thread writes them
//! and then the commit, and the syncer makes each batch durable before the unit is
//! acknowledged and published.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::mpsc;
use std::sync::{Arc, MutexGuard};

use kvstack_driver::blockio::{BlockEngine, BufferPool, Completion, IoOp, OpKind};
use kvstack_driver::pinned::PinnedOptions;
use kvstack_firmware_interface::record::{
    KEY_BYTES, Key, RecordFlags, RecordHeader, RecordKind, SEGMENT_HEADER_PAGE, SegmentHeader,
    crc32c, encode_record_with_crc, horizon_bytes, record_len,
};

use super::index::{BlockState, Loc, Shared, State, bump, publish, unpin};

use super::delete::{DeleteOutcome, apply_delete, end_deleting};
use super::put::{Job, UnitJob, fail_blocks};
use crate::segment::{Media, SegmentFile, StoreLocation};
use crate::{Error, Result};
pub(super) enum Pending {
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
        what: Reloc,
    },
    /// Compaction's read of a record it copies: the completion is kept in `read_done`.
    Read,
}

pub(super) struct Writer {
    pub(super) shared: Arc<Shared>,
    pub(super) engine: Box<dyn BlockEngine>,
    pub(super) pool: BufferPool,
    pub(super) inflight: HashMap<u64, Pending>,
    pub(super) next_tag: u64,
    /// Segments written since the last sync.
    pub(super) dirty: BTreeMap<u64, Arc<SegmentFile>>,
    /// A segment file was created since the last sync (its name must be synced too).
    pub(super) created: bool,
    /// The first write error of the current batch.
    pub(super) batch_error: Option<String>,
    /// Commits whose writes completed: (job index in the batch, location).
    pub(super) commits_done: Vec<(usize, Loc)>,
    /// Relocated copies whose writes completed: (key, location, what was copied).
    pub(super) relocated: Vec<(Key, Loc, Reloc)>,
    /// Blocks compaction found damaged (not copied).
    pub(super) lost: Vec<Key>,
    /// The completed read of compaction (reads share the ring with the copies' writes, whose
    /// completions must reach `reap`, so the read is reaped like them).
    pub(super) read_done: Option<Completion>,
    /// Units an earlier part of which was refused for lack of space.
    pub(super) full_parts: HashSet<Key>,
    /// What the record being allocated is for: data may not use the last free segment (kept
    /// for compaction and for recording uses); compaction may not reclaim (it is reclaiming).
    pub(super) purpose: Purpose,
}

/// What an allocation is for (see [`Writer::purpose`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Purpose {
    Data,
    Touch,
    /// Deletes go where touches go: a full store must still be able to delete.
    Delete,
    Compaction,
}

/// What a record copied by compaction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reloc {
    Block,
    Commit,
    Delete,
}

/// Outcome of a job within a batch.
pub(super) struct JobRun {
    pub(super) job: Box<UnitJob>,
    /// Its commit completed.
    pub(super) committed: Option<Loc>,
    /// Where its commit was submitted (counted in that segment's `unpublished`).
    pub(super) written: Option<Loc>,
    pub(super) error: Option<Error>,
}

impl Writer {
    pub(super) fn run(mut self, rx: mpsc::Receiver<Job>) {
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

    pub(super) fn st(&self) -> MutexGuard<'_, State> {
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
            if r.job.is_delete() {
                // A delete is written in the commits' phase, so it is ordered after every
                // commit queued before it, and synced with them before it is acknowledged.
                let header = RecordHeader {
                    kind: RecordKind::Delete,
                    flags: RecordFlags::EMPTY,
                    seq: 0,
                    segment: 0,
                    key: r.job.end,
                    parent: [0; KEY_BYTES],
                    model: r.job.model,
                    tenant: r.job.tenant_id,
                    tokens: r.job.tokens as u32,
                    count: 0,
                    payload_len: 0,
                    created_ms: r.job.created,
                    last_used_ms: r.job.created,
                    payload_crc: 0,
                };
                self.purpose = Purpose::Delete;
                let written =
                    self.write_record(header, &[], None, |loc| Pending::Commit { job: i, loc });
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
                let st = self.st();
                match st.units.get(&r.job.end) {
                    // A delete of it is queued or written: a touch commit now would be newer
                    // than the delete and bring the unit back at a restart.
                    Some(_) if st.deleting.contains_key(&r.job.end) => {
                        r.error = Some(Error::WriteFailed {
                            reason: "unit being deleted".into(),
                        });
                        continue;
                    }
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
    pub(super) fn write_record(
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
        if header.kind == RecordKind::Delete && header.parent == [0; KEY_BYTES] {
            // A new delete: its horizon is its own sequence number.
            header.parent = horizon_bytes(loc.seq);
        }
        let crc = crc.unwrap_or_else(|| crc32c(payload));
        encode_record_with_crc(&header, payload, crc, buf.as_mut_slice()).map_err(|e| {
            Error::WriteFailed {
                reason: e.to_string(),
            }
        })?;
        self.submit(buf, &file, loc.offset, len, pending(loc))?;
        Ok(loc)
    }

    pub(super) fn submit(
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
            target: file.media.target(),
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
    pub(super) fn buffer(&mut self) -> Result<kvstack_driver::blockio::IoBuf> {
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
    pub(super) fn reap(&mut self, min: usize) {
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
                Pending::Relocated { key, loc, what } => {
                    // Applied after the sync (compact), recorded here.
                    if ok {
                        self.relocated.push((key, loc, what));
                    }
                }
                Pending::Read => {}
            }
        }
    }

    /// Waits for everything in flight.
    pub(super) fn drain(&mut self) {
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
    pub(super) fn sync(&mut self) -> Option<String> {
        if std::mem::take(&mut self.created)
            && let Err(e) = sync_location_dir(&self.shared.opts.location)
        {
            return Some(e);
        }
        let dirty = std::mem::take(&mut self.dirty);
        let mut seen_files = HashSet::new();
        for (_, seg) in dirty {
            // Device slots share one file: sync it once.
            if !seen_files.insert(seg.media.identity()) {
                continue;
            }
            if let Err(e) = seg.media.sync() {
                return Some(format!(
                    "{} of {} failed: {e}",
                    sync_name(&seg),
                    seg.path.display()
                ));
            }
        }
        None
    }
}

/// A written batch waiting for its sync.
pub(super) struct SyncWork {
    pub(super) runs: Vec<JobRun>,
    /// Every segment written by the batch.
    pub(super) files: Vec<Arc<SegmentFile>>,
    /// The directory to sync when the batch created segment files.
    pub(super) dir: Option<StoreLocation>,
    /// A write error of the batch.
    pub(super) error: Option<String>,
    /// Flushes to answer once the batch is settled.
    pub(super) flushes: Vec<mpsc::Sender<()>>,
}

/// What makes a segment's writes durable, for messages.
fn sync_name(seg: &SegmentFile) -> &'static str {
    match seg.media {
        Media::File(_) => "fdatasync",
        Media::Namespace(_) => "NVMe Flush",
    }
}

pub(super) fn sync_location_dir(location: &StoreLocation) -> std::result::Result<(), String> {
    match location {
        StoreLocation::Directory(dir) => kvstack_driver::blockio::sync_dir(dir)
            .map_err(|e| format!("fsync of directory {} failed: {e}", dir.display())),
        StoreLocation::Device(_) | StoreLocation::Namespace(_) => Ok(()),
    }
}

/// The syncer thread: makes each written batch durable (one `fdatasync` per file, the
/// directory when segments were created), then publishes and acknowledges its units, in
/// batch order. After a failure every later batch fails unsynced: a file whose sync failed is
/// not trusted again (a later sync could succeed without the lost writes).
pub(super) fn sync_loop(shared: &Shared, rx: &mpsc::Receiver<SyncWork>) {
    for mut work in rx {
        if let Some(h) = &shared.opts.hooks {
            h.before_sync();
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
                if !seen.insert(seg.media.identity()) {
                    continue;
                }
                if let Err(e) = seg.media.sync() {
                    failure = Some(format!(
                        "{} of {} failed: {e}",
                        sync_name(seg),
                        seg.path.display()
                    ));
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
            if let Some(tx) = r.job.delete.take() {
                let reply = match r.committed {
                    Some(loc) if ok => {
                        let outcome = apply_delete(&mut st, &r.job, loc);
                        bump(&shared.counters.deletes, 1);
                        if outcome == DeleteOutcome::Deleted {
                            bump(&shared.counters.units_deleted, 1);
                        }
                        Ok(outcome)
                    }
                    _ => {
                        let full = matches!(r.error, Some(Error::StoreFull { .. }));
                        bump(
                            if full {
                                &shared.counters.refused_full
                            } else {
                                &shared.counters.failed_writes
                            },
                            1,
                        );
                        Err(r.error.take().unwrap_or_else(|| Error::WriteFailed {
                            reason: failure
                                .clone()
                                .unwrap_or_else(|| "delete not written".into()),
                        }))
                    }
                };
                end_deleting(&mut st, &r.job.end);
                let _ = tx.send(reply);
                continue;
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

/// Writes a segment header page synchronously (segment creation is rare).
pub(super) fn write_segment_header(file: &SegmentFile, header: &SegmentHeader) -> Result<()> {
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
    file.media
        .write_page(&page.as_slice()[..SEGMENT_HEADER_PAGE], file.base)
        .map_err(|e| Error::io("cannot write the header of segment", file.path.clone(), e))
}
