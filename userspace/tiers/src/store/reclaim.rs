//! Space on the writer thread: allocation of record space, eviction of units past retention,
//! compaction of mostly dead segments, and freeing retired segments once no lease holds them.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use kvstack_driver::blockio::{Completion, IoOp, OpKind};
use kvstack_firmware_interface::record::{
    ALIGN, KEY_BYTES, Key, RecordFlags, RecordHeader, RecordKind, SEGMENT_HEADER_PAGE,
    SegmentHeader, horizon_bytes,
};

use super::SsdStore;
use super::delete::settle_deletes;
use super::index::{
    BlockState, Loc, SegMeta, Shared, State, TombMeta, add_seg, bump, chain_of, remove_unit,
};
use super::options::ReclaimReport;
use super::pin::first_evictable;
use super::put::Job;
use super::read::check_block;
use super::writer::{Pending, Purpose, Reloc, Writer, sync_location_dir, write_segment_header};

use crate::segment::{SegmentFile, StoreLocation};
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

/// What [`Writer::make_room`] achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Room {
    /// A slot beyond the reserve is free.
    Freed,
    /// A segment was compacted but no slot beyond the reserve freed.
    Compacted,
    /// Nothing could be reclaimed.
    None,
}

fn exhausted(what: &str) -> Error {
    Error::Poisoned {
        reason: format!("{what} exhausted"),
    }
}

impl Writer {
    /// A place for a record of `len` bytes: in the active segment, or a new one (reclaiming
    /// space if none is free). Data goes to the data segment; uses (touch commits), deletes
    /// and compaction go to the system segment. Data may not take the last two free slots,
    /// touches and deletes not the last one: nothing but compaction can use up the room
    /// compaction needs.
    pub(super) fn allocate(&mut self, len: u64) -> Result<(Arc<SegmentFile>, Loc)> {
        let shared = Arc::clone(&self.shared);
        let system = self.purpose != Purpose::Data;
        let mut waited = Duration::ZERO;
        let mut compacted = 0;
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
                // Two slots are kept back from data: touches and deletes may take the first
                // (a use must be recordable, a delete writable, in a store full of young data),
                // only compaction the last. Found by the crash campaign: when touches and
                // deletes could take the last slot too, their segment filled it and a restart
                // sealed it; with every slot in use, compaction had nowhere to copy even one
                // page to, and the store stayed full although most of its segments were
                // nearly dead.
                let reserve = match self.purpose {
                    Purpose::Data => 2,
                    Purpose::Touch | Purpose::Delete => 1,
                    Purpose::Compaction => 0,
                };
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
                            tombs: HashSet::new(),
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
            match self.make_room()? {
                Room::Freed => continue,
                // What compaction copied went to the system segment, and may have left room
                // there for a touch or a delete (a few tries: compaction may free nothing).
                Room::Compacted if system && compacted < 4 => {
                    compacted += 1;
                    continue;
                }
                Room::Compacted | Room::None => {}
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
    /// compacted (for a delete, any segment with a dead page: a delete frees space, and
    /// refusing it would keep a full store full).
    fn make_room(&mut self) -> Result<Room> {
        let now = self.shared.clock.now_ms();
        let retention = self.shared.opts.retention_ms;
        {
            let mut st = self.st();
            let before = st.space.free();
            loop {
                retire_empty(&mut st, &self.dirty);
                free_retired(&mut st, &self.shared);
                if st.space.free() > before {
                    return Ok(Room::Freed);
                }
                let Some((_, end)) = first_evictable(&st, now, retention) else {
                    break;
                };
                evict_unit(&mut st, &end, &self.shared);
            }
            retire_empty(&mut st, &self.dirty);
            free_retired(&mut st, &self.shared);
            if st.space.free() > before {
                return Ok(Room::Freed);
            }
        }
        let limit = if self.purpose == Purpose::Delete {
            self.st().space.segment_bytes - ALIGN as u64
        } else {
            self.live_limit()
        };
        let Some(victim) = self.compaction_victim(limit) else {
            return Ok(Room::None);
        };
        match self.compact(victim) {
            Ok(()) => {}
            // No room to copy into: nothing may be reclaimed now.
            Err(Error::StoreFull { .. }) => return Ok(Room::None),
            Err(e) => return Err(e),
        }
        let mut st = self.st();
        free_retired(&mut st, &self.shared);
        Ok(if st.space.free() > 2 {
            Room::Freed
        } else {
            Room::Compacted
        })
    }

    /// Live bytes at most of a segment that is compacted (`compact_live_fraction`).
    fn live_limit(&self) -> u64 {
        let bytes = self.st().space.segment_bytes;
        (self.shared.opts.compact_live_fraction * bytes as f64) as u64
    }

    /// The segment with the fewest live bytes, if at most `limit` of it are live and it is
    /// neither being written nor awaiting a sync.
    fn compaction_victim(&self, limit: u64) -> Option<u64> {
        let st = self.st();
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
        let (blocks, units, tombs, file) = {
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
            // A unit with a delete queued keeps its commit where it is: a copy would be a
            // commit newer than the delete, and bring the unit back at a restart. The segment
            // is then not freed this time.
            let units: Vec<(Key, Vec<Key>)> = seg
                .units
                .iter()
                .filter(|k| !st.deleting.contains_key(*k))
                .map(|k| (*k, chain_of(&st, k)))
                .collect();
            let tombs: Vec<(Key, TombMeta)> = seg
                .tombs
                .iter()
                .filter_map(|k| Some((*k, st.tombstones.get(k)?.clone())))
                .collect();
            (blocks, units, tombs, Arc::clone(&seg.file))
        };
        log::debug!(
            "compacting segment {victim}: {} blocks, {} commits",
            blocks.len(),
            units.len()
        );
        let purpose = std::mem::replace(&mut self.purpose, Purpose::Compaction);
        self.relocated.clear();
        self.lost.clear();
        let result = self
            .relocate(&file, &blocks, &units)
            .and_then(|()| self.relocate_deletes(&tombs));
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
        for (key, loc, what) in relocated {
            let State {
                blocks,
                units,
                tombstones,
                segments,
                ..
            } = &mut *st;
            let old = match what {
                Reloc::Commit => units.get_mut(&key).and_then(|u| {
                    let old = u.loc.filter(|l| l.seg == victim)?;
                    u.loc = Some(loc);
                    add_seg(&mut u.commit_segs, loc.seg);
                    Some(old)
                }),
                Reloc::Block => blocks.get_mut(&key).and_then(|b| {
                    let old = b.loc().filter(|l| l.seg == victim)?;
                    b.state = BlockState::Written(loc);
                    Some(old)
                }),
                Reloc::Delete => tombstones.get_mut(&key).and_then(|t| {
                    let old = Some(t.loc).filter(|l| l.seg == victim)?;
                    t.loc = loc;
                    Some(old)
                }),
            };
            // The copy is live only if the index now points at it.
            if let Some(old) = old {
                if let Some(s) = segments.get_mut(&victim) {
                    s.live = s.live.saturating_sub(old.len);
                    keys_of(s, what).remove(&key);
                }
                if let Some(s) = segments.get_mut(&loc.seg) {
                    s.live += loc.len;
                    keys_of(s, what).insert(key);
                }
                moved += 1;
            } else if what == Reloc::Commit
                && let Some(u) = units.get_mut(&key)
            {
                // A newer commit was published meanwhile; this copy is on disk all the same.
                add_seg(&mut u.commit_segs, loc.seg);
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
            target: file.media.target(),
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
                            what: Reloc::Block,
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
                what: Reloc::Commit,
            })?;
        }
        Ok(())
    }

    /// Copies kept delete records (they have no payload: each is rebuilt from the index, its
    /// horizon kept, so the copy deletes exactly what the original did).
    fn relocate_deletes(&mut self, tombs: &[(Key, TombMeta)]) -> Result<()> {
        for (key, t) in tombs {
            let header = RecordHeader {
                kind: RecordKind::Delete,
                flags: RecordFlags::RELOCATED,
                seq: 0,
                segment: 0,
                key: *key,
                parent: horizon_bytes(t.horizon),
                model: t.model,
                tenant: t.tenant_id,
                tokens: t.tokens,
                count: 0,
                payload_len: 0,
                created_ms: t.created,
                last_used_ms: t.created,
                payload_crc: 0,
            };
            self.write_record(header, &[], None, |loc| Pending::Relocated {
                key: *key,
                loc,
                what: Reloc::Delete,
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
            while let Some((_, end)) = first_evictable(&st, now, self.shared.opts.retention_ms) {
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
        let limit = self.live_limit();
        while let Some(victim) = self.compaction_victim(limit) {
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

/// The keys of a segment's live records of one kind.
fn keys_of(s: &mut SegMeta, what: Reloc) -> &mut HashSet<Key> {
    match what {
        Reloc::Commit => &mut s.units,
        Reloc::Block => &mut s.blocks,
        Reloc::Delete => &mut s.tombs,
    }
}

/// Evicts a unit past retention; blocks no other unit (or queued job) needs become dead
/// space. Its commits stay on disk until their segments are freed, so the key is kept as an
/// orphan with them (a delete of it must outlive them).
pub(super) fn evict_unit(st: &mut State, end: &Key, shared: &Shared) {
    let Some(u) = remove_unit(st, end) else {
        return;
    };
    let segs = st.orphans.entry(*end).or_default();
    for seg in u.commit_segs {
        add_seg(segs, seg);
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
                && s.tombs.is_empty()
        })
        .map(|(id, _)| *id)
        .collect();
    for id in empty {
        if let Some(s) = st.segments.remove(&id) {
            st.retired.push(s.file);
        }
    }
}

/// Frees retired segments that no reader holds a lease on any more. Deletes that only had
/// to outlive them are then dropped, once the frees are durable.
pub(super) fn free_retired(st: &mut State, shared: &Shared) {
    let retired = std::mem::take(&mut st.retired);
    let mut freed = Vec::new();
    for seg in retired {
        if Arc::strong_count(&seg) > 1 {
            st.retired.push(seg);
            continue;
        }
        if let Err(e) = st.space.release(&seg) {
            log::warn!("freeing segment {}: {e}", seg.id);
        }
        bump(&shared.counters.segments_freed, 1);
        freed.push(seg);
    }
    if freed.is_empty() {
        return;
    }
    let ids: Vec<u64> = freed.iter().map(|s| s.id).collect();
    st.orphans.retain(|_, segs| {
        segs.retain(|s| !ids.contains(s));
        !segs.is_empty()
    });
    let depended = st
        .tombstones
        .values()
        .any(|t| t.deps.iter().any(|d| ids.contains(d)));
    if !depended {
        return;
    }
    // Frees are not synced (a freed segment that comes back holds only reclaimable records),
    // except where a delete depended on one: dropping the delete, and then freeing its own
    // segment, must not become durable before the free, or a crash could keep the old commit
    // and lose the delete.
    let synced = match &shared.opts.location {
        StoreLocation::Directory(_) => sync_location_dir(&shared.opts.location),
        StoreLocation::Device(_) | StoreLocation::Namespace(_) => freed.iter().try_for_each(|s| {
            s.media
                .sync()
                .map_err(|e| format!("fdatasync of {} failed: {e}", s.path.display()))
        }),
    };
    if let Err(reason) = synced {
        log::error!("store write failed, disabling writes: {reason}");
        st.poisoned.get_or_insert(reason);
        st.unsynced_frees.extend(ids);
    }
    settle_deletes(st);
}
