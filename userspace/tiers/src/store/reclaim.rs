//! Space on the writer thread: allocation of record space, eviction of units past retention,
//! compaction of mostly dead segments, and freeing retired segments once no lease holds them.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use kvstack_driver::blockio::{Completion, IoOp, OpKind};
use kvstack_firmware_interface::record::{
    KEY_BYTES, Key, RecordFlags, RecordHeader, RecordKind, SEGMENT_HEADER_PAGE, SegmentHeader,
};

use super::SsdStore;
use super::index::{BlockState, Loc, SegMeta, Shared, State, bump, chain_of, drop_block};
use super::options::ReclaimReport;
use super::put::Job;
use super::read::check_block;
use super::writer::{Pending, Purpose, Writer, write_segment_header};

use crate::segment::SegmentFile;
use crate::{Error, Result};

impl SsdStore {
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
}

fn exhausted(what: &str) -> Error {
    Error::Poisoned {
        reason: format!("{what} exhausted"),
    }
}

impl Writer {
    /// A place for a record of `len` bytes: in the active segment, or a new one (reclaiming
    /// space if none is free). Data goes to the data segment and may not take the last free
    /// slot; uses (touch commits) and compaction go to the system segment, which may take it,
    /// so data can never use up the room compaction needs.
    pub(super) fn allocate(&mut self, len: u64) -> Result<(Arc<SegmentFile>, Loc)> {
        let shared = Arc::clone(&self.shared);
        let system = self.purpose != Purpose::Data;
        let mut waited = Duration::ZERO;
        loop {
            {
                let mut st = shared.lock();
                let seq = st.next_seq;
                // Numbers are never reused: at the top of the range the store cannot write
                // (open poisons such a store; this also covers compaction and touches).
                let Some(after_seq) = seq.checked_add(1) else {
                    return Err(exhausted("sequence numbers"));
                };
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
                        st.next_seq = after_seq;
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
                    let Some(after_seg) = id.checked_add(1) else {
                        return Err(exhausted("segment ids"));
                    };
                    st.next_segment = after_seg;
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
    pub(super) fn reclaim_all(&mut self) -> Result<ReclaimReport> {
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

/// Removes a unit; blocks no other unit (or queued job) needs become dead space.
pub(super) fn evict_unit(st: &mut State, end: &Key, shared: &Shared) {
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
pub(super) fn retire_empty(st: &mut State, dirty: &BTreeMap<u64, Arc<SegmentFile>>) {
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
pub(super) fn free_retired(st: &mut State, shared: &Shared) {
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
