//! The in-memory index of the store: blocks, units and segments, the state shared by the
//! callers and the writer thread, and the rules that change it (publish, pin, drop).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use kvstack_driver::blockio::{BlockEngine, BufferPool, EngineChoice, EnginePreference};
use kvstack_firmware_interface::record::Key;

use super::SsdStore;
use super::options::{RecoveryReport, StoreHooks, StoreOptions, UnitEvent};
use super::put::{Job, UnitJob};
use crate::clock::Clock;
use crate::segment::{NsMedia, SegmentFile, Space};
use crate::{Error, Result};

/// Where a record lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) seg: u64,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BlockState {
    /// Queued or being written by the job that created it.
    Pending,
    Written(Loc),
    /// Its write failed or its job was abandoned.
    Failed,
}

#[derive(Debug)]
pub(super) struct BlockMeta {
    pub(super) parent: Key,
    pub(super) depth: u32,
    pub(super) tokens: u32,
    pub(super) state: BlockState,
    /// Visible units containing it.
    pub(super) covered: u32,
    /// Queued jobs relying on it.
    pub(super) pinned: u32,
    pub(super) damaged: bool,
    /// The tenant whose chain it belongs to (its record header's tenant id; chained keys are
    /// salted by tenant, so a block is never shared across tenants).
    pub(super) tenant: u64,
    /// Bytes charged to its tenant's SSD usage: its record length from the moment a unit
    /// first covers it until none does (`quota.rs`).
    pub(super) charged: u64,
}

impl BlockMeta {
    pub(super) fn loc(&self) -> Option<Loc> {
        match self.state {
            BlockState::Written(l) => Some(l),
            _ => None,
        }
    }

    pub(super) fn visible(&self) -> bool {
        self.covered > 0 && !self.damaged && self.loc().is_some()
    }
}

#[derive(Debug)]
pub(super) struct UnitMeta {
    pub(super) tokens: u64,
    pub(super) created: u64,
    pub(super) last_used: u64,
    /// Last use recorded on disk.
    pub(super) persisted_used: u64,
    /// Its newest commit record (None for a prefix unit created by a lookup and not yet
    /// written).
    pub(super) loc: Option<Loc>,
    pub(super) touch_queued: bool,
    pub(super) tenant_id: u64,
    pub(super) model: [u8; 16],
    /// Segments that hold a commit record of its key, superseded ones included: each of them
    /// would bring the unit back at a restart if a delete of it were forgotten.
    pub(super) commit_segs: Vec<u64>,
}

/// A delete record (tombstone) the store keeps: while any segment holding an older commit of
/// its key is on disk, forgetting the delete would bring the unit back at a restart.
#[derive(Clone, Debug)]
pub(super) struct TombMeta {
    pub(super) loc: Loc,
    /// Commits of the key with a smaller sequence number are deleted (the original record's
    /// sequence number; a copy made by compaction keeps it).
    pub(super) horizon: u64,
    /// Segments that held a commit of the key when it was deleted.
    pub(super) deps: Vec<u64>,
    pub(super) tokens: u32,
    pub(super) tenant_id: u64,
    pub(super) model: [u8; 16],
    pub(super) created: u64,
}

#[derive(Debug)]
pub(super) struct SegMeta {
    pub(super) file: Arc<SegmentFile>,
    /// Bytes of live records.
    pub(super) live: u64,
    /// End of the written area.
    pub(super) written: u64,
    /// Next free offset (only meaningful for the active segment).
    pub(super) next: u64,
    pub(super) blocks: HashSet<Key>,
    pub(super) units: HashSet<Key>,
    /// Keys whose kept delete record lies here.
    pub(super) tombs: HashSet<Key>,
    /// Commits written into it and not yet published (or failed) by the syncer. Such a
    /// segment holds records the index does not know of yet, so it is never retired or
    /// compacted meanwhile (a retired one would take them with it, and publishing would then
    /// move the unit's only live commit into a deleted segment).
    pub(super) unpublished: u32,
}

pub(super) struct State {
    pub(super) blocks: HashMap<Key, BlockMeta>,
    pub(super) units: HashMap<Key, UnitMeta>,
    pub(super) by_age: BTreeSet<(u64, Key)>,
    /// Blocks by parent (for finding a unit's shorter last block).
    pub(super) children: HashMap<Key, Vec<(u32, Key)>>,
    pub(super) segments: BTreeMap<u64, SegMeta>,
    pub(super) retired: Vec<Arc<SegmentFile>>,
    pub(super) space: Space,
    /// The segment data is appended to.
    pub(super) active: Option<u64>,
    /// The segment touch commits and compaction copies are appended to.
    pub(super) system_active: Option<u64>,
    pub(super) next_seq: u64,
    pub(super) next_segment: u64,
    pub(super) store_id: [u8; 16],
    pub(super) queued_bytes: u64,
    pub(super) poisoned: Option<String>,
    /// Delete records kept, by unit key.
    pub(super) tombstones: HashMap<Key, TombMeta>,
    /// Deletes queued and not yet settled, by unit key: meanwhile the unit gets no touch
    /// commit and compaction does not copy its commit (either would be a commit newer than the
    /// delete), and a put of it writes a commit rather than only touching it.
    pub(super) deleting: HashMap<Key, u32>,
    /// Keys that are not units but may still have commits on disk (evicted units, units
    /// recovery found incomplete), with those commits' segments: a delete of such a key must
    /// outlive them too, or a restart could bring the unit back.
    pub(super) orphans: HashMap<Key, Vec<u64>>,
    /// Segments freed whose removal could not be made durable (see `free_retired`): they may
    /// still come back at a restart.
    pub(super) unsynced_frees: HashSet<u64>,
    /// Pinned units and the end of their pins (`pin.rs`).
    pub(super) pins: HashMap<Key, u64>,
    /// Bytes of covered blocks by tenant id (`quota.rs`).
    pub(super) tenant_bytes: HashMap<u64, u64>,
    /// SSD byte quotas by tenant id; a tenant absent has none (`quota.rs`).
    pub(super) quotas: HashMap<u64, u64>,
    /// The options' hooks, here so that whatever removes a unit reports it
    /// ([`StoreHooks::unit_removed`]).
    pub(super) hooks: Option<Arc<dyn StoreHooks>>,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) units_written: AtomicU64,
    pub(super) blocks_written: AtomicU64,
    pub(super) blocks_shared: AtomicU64,
    pub(super) bytes_written: AtomicU64,
    pub(super) refused_full: AtomicU64,
    pub(super) refused_queue: AtomicU64,
    pub(super) failed_writes: AtomicU64,
    pub(super) units_evicted: AtomicU64,
    pub(super) units_deleted: AtomicU64,
    pub(super) deletes: AtomicU64,
    pub(super) segments_compacted: AtomicU64,
    pub(super) segments_freed: AtomicU64,
    pub(super) records_relocated: AtomicU64,
    pub(super) damaged_reads: AtomicU64,
    pub(super) lookups: AtomicU64,
    pub(super) hits: AtomicU64,
    pub(super) quota_evicted: AtomicU64,
    pub(super) refused_quota: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(super) struct ReadCtx {
    pub(super) engine: Box<dyn BlockEngine>,
    pub(super) pool: BufferPool,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) opts: StoreOptions,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) jobs: Mutex<Option<mpsc::Sender<Job>>>,
    pub(super) choice: EngineChoice,
    pub(super) read_preference: EnginePreference,
    /// The namespace of a namespace location: every engine is made on its controller.
    pub(super) namespace: Option<Arc<NsMedia>>,
    pub(super) readers: Mutex<Vec<ReadCtx>>,
    /// Payload buffers the writer has finished with, reused by `put_unit`: a fresh 230 KB
    /// allocation per block is a fresh mapping whose pages fault in one by one (and whose
    /// release shoots down TLBs), which cost more than the copy into it.
    pub(super) payloads: Mutex<Vec<Vec<u8>>>,
    pub(super) counters: Counters,
    pub(super) recovery: RecoveryReport,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the index half-updated in a way that
        // matters more than stopping: keep serving with whatever state there is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty payload buffer with room for one block.
    pub(super) fn payload_buffer(&self) -> Vec<u8> {
        let reused = self
            .payloads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        reused.unwrap_or_else(|| Vec::with_capacity(self.opts.max_block_payload))
    }

    /// Keeps `buf` for reuse, up to [`PAYLOAD_CACHE_BYTES`] of buffers.
    pub(super) fn recycle_payload(&self, mut buf: Vec<u8>) {
        if buf.capacity() < self.opts.max_block_payload {
            return;
        }
        buf.clear();
        let mut cache = self.payloads.lock().unwrap_or_else(|e| e.into_inner());
        if (cache.len() + 1) * self.opts.max_block_payload <= PAYLOAD_CACHE_BYTES {
            cache.push(buf);
        }
    }

    pub(super) fn send(&self, job: Job) -> Result<()> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.as_ref() {
            Some(tx) => tx.send(job).map_err(|_| Error::Closed),
            None => Err(Error::Closed),
        }
    }
}

/// Payload buffers kept for reuse between the writer and `put_unit` (at V4.1 dimensions about
/// 140 blocks: four parts of a long unit).
pub(super) const PAYLOAD_CACHE_BYTES: usize = 32 << 20;

impl SsdStore {
    /// Checks the in-memory index against itself: every unit's commit and every written
    /// block lies in a segment the store holds and is counted there, and every segment's
    /// live bytes are the sum of what it holds. For tests and `fsck`-style tools.
    ///
    /// # Errors
    /// [`Error::Internal`] naming the first inconsistency.
    pub fn check_index(&self) -> Result<()> {
        self.first_inconsistency()
            .map_err(|what| Error::Internal { what })
    }

    /// The first inconsistency of the index, described.
    fn first_inconsistency(&self) -> std::result::Result<(), String> {
        let st = self.shared.lock();
        let mut live: HashMap<u64, u64> = HashMap::new();
        for (k, u) in &st.units {
            let Some(l) = u.loc else { continue };
            let seg = st.segments.get(&l.seg).ok_or_else(|| {
                format!(
                    "unit {} has its commit in segment {}, which the store does not hold",
                    crate::key::key_hex(k, 8),
                    l.seg
                )
            })?;
            if !seg.units.contains(k) {
                return Err(format!(
                    "unit {} is not counted in its segment {}",
                    crate::key::key_hex(k, 8),
                    l.seg
                ));
            }
            *live.entry(l.seg).or_default() += l.len;
        }
        for (k, t) in &st.tombstones {
            let seg = st.segments.get(&t.loc.seg).ok_or_else(|| {
                format!(
                    "the delete of {} lies in segment {}, which the store does not hold",
                    crate::key::key_hex(k, 8),
                    t.loc.seg
                )
            })?;
            if !seg.tombs.contains(k) {
                return Err(format!(
                    "the delete of {} is not counted in its segment {}",
                    crate::key::key_hex(k, 8),
                    t.loc.seg
                ));
            }
            // A unit a read created there is not written yet; its commit will supersede the
            // delete. A written unit never coexists with a kept delete.
            if st.units.get(k).is_some_and(|u| u.loc.is_some()) {
                return Err(format!(
                    "{} is both a unit and deleted",
                    crate::key::key_hex(k, 8)
                ));
            }
            *live.entry(t.loc.seg).or_default() += t.loc.len;
        }
        for (k, b) in &st.blocks {
            let Some(l) = b.loc() else { continue };
            let Some(seg) = st.segments.get(&l.seg) else {
                if b.covered > 0 {
                    return Err(format!(
                        "block {} of a unit lies in segment {}, which the store does not hold",
                        crate::key::key_hex(k, 8),
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
                    crate::key::key_hex(k, 8),
                    l.seg
                ));
            }
        }
        // Tenants' usage is what their covered blocks were charged, and a written block was
        // charged its record.
        let mut charged: HashMap<u64, u64> = HashMap::new();
        for (k, b) in &st.blocks {
            if b.covered == 0 {
                if b.charged != 0 {
                    return Err(format!(
                        "block {} is covered by no unit and still charged {} bytes",
                        crate::key::key_hex(k, 8),
                        b.charged
                    ));
                }
                continue;
            }
            if let Some(l) = b.loc()
                && l.len != b.charged
            {
                return Err(format!(
                    "block {} takes {} bytes and is charged {}",
                    crate::key::key_hex(k, 8),
                    l.len,
                    b.charged
                ));
            }
            *charged.entry(b.tenant).or_default() += b.charged;
        }
        charged.retain(|_, b| *b > 0);
        if charged != st.tenant_bytes {
            return Err(format!(
                "tenants' SSD bytes are counted as {:?}, their blocks hold {charged:?}",
                st.tenant_bytes
            ));
        }
        for (id, seg) in &st.segments {
            if let Some(k) = seg
                .tombs
                .iter()
                .find(|k| st.tombstones.get(*k).is_none_or(|t| t.loc.seg != *id))
            {
                return Err(format!(
                    "segment {id} counts a delete of {} that the store does not keep there",
                    crate::key::key_hex(k, 8)
                ));
            }
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
}

/// The chain of keys ending at `end`, first to last (walking parent links).
pub(super) fn chain_of(st: &State, end: &Key) -> Vec<Key> {
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
pub(super) fn unpin(st: &mut State, keys: &[Key]) {
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

/// Removes a block nobody covers or pins: its record becomes dead space.
pub(super) fn drop_block(st: &mut State, k: &Key) {
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

/// Makes a durable unit visible (or records a touch), moving its job's pins to coverage.
pub(super) fn publish(st: &mut State, job: &UnitJob, loc: Option<Loc>, shared: &Shared) {
    let Some(loc) = loc else { return };
    let end = job.end;
    if job.touch && !st.units.contains_key(&end) {
        // Evicted after its touch was written: the commit is on disk all the same, and a later
        // delete of the key must outlive it.
        add_seg(st.orphans.entry(end).or_default(), loc.seg);
        return;
    }
    // A prefix unit a lookup created records no tenant in its touch; its blocks do.
    let tenant = match job.tenant_id {
        0 => job
            .keys
            .first()
            .and_then(|k| st.blocks.get(k))
            .map_or(0, |b| b.tenant),
        t => t,
    };
    // A commit newer than a delete of its key (the unit put again, or a prefix of a longer
    // unit read and so given a unit here): the delete no longer counts, and the older commits
    // it covered are the unit's to answer for (a later delete must outlive them too).
    let mut inherited = super::delete::supersede_delete(st, &end);
    if let Some(segs) = st.orphans.remove(&end) {
        inherited.extend(segs);
    }
    let State {
        units,
        by_age,
        blocks,
        segments,
        children,
        tenant_bytes,
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
            for seg in inherited.iter().copied().chain([loc.seg]) {
                add_seg(&mut u.commit_segs, seg);
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
        if count_commit(units) {
            durable(shared, job, tenant);
        }
        return;
    }
    if count_commit(units) {
        durable(shared, job, tenant);
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
            super::quota::cover(b, tenant_bytes);
            if b.covered == 1 {
                let kids = children.entry(b.parent).or_default();
                if !kids.iter().any(|(_, c)| c == k) {
                    kids.push((b.tokens, *k));
                }
            }
        }
    }
    let mut commit_segs = Vec::new();
    for seg in inherited.into_iter().chain([loc.seg]) {
        add_seg(&mut commit_segs, seg);
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
            commit_segs,
        },
    );
    by_age.insert((job.created, end));
    if let Some(s) = segments.get_mut(&loc.seg) {
        s.live += loc.len;
        s.units.insert(end);
    }
    durable(shared, job, tenant);
    // Puts in flight together (or shared blocks its own put evicted) may take the tenant
    // past its quota: its other least recently used units make way, never this one.
    super::quota::settle(st, job.tenant_id, &end, shared);
}

/// Reports `job`'s unit durable to the hooks, if any.
fn durable(shared: &Shared, job: &UnitJob, tenant: u64) {
    if let Some(h) = &shared.opts.hooks {
        h.unit_durable(&UnitEvent {
            end: job.end,
            tenant,
            model: job.model,
            tokens: job.tokens,
            keys: job.keys.clone(),
        });
    }
}

/// Adds `seg` to a set of segment ids kept as a short vector.
pub(super) fn add_seg(segs: &mut Vec<u64>, seg: u64) {
    if !segs.contains(&seg) {
        segs.push(seg);
    }
}

/// Removes a unit from the index: its commit becomes dead space, and so does every block no
/// other unit (or queued job) needs. Returns what it was.
pub(super) fn remove_unit(st: &mut State, end: &Key) -> Option<UnitMeta> {
    let keys = chain_of(st, end);
    let u = st.units.remove(end)?;
    st.by_age.remove(&(u.last_used, *end));
    st.pins.remove(end);
    if let Some(l) = u.loc
        && let Some(s) = st.segments.get_mut(&l.seg)
        && s.units.remove(end)
    {
        s.live = s.live.saturating_sub(l.len);
    }
    let mut uncovered = Vec::new();
    for k in &keys {
        let dead = match st.blocks.get_mut(k) {
            Some(b) => {
                super::quota::uncover(b, &mut st.tenant_bytes);
                if b.covered == 0 {
                    uncovered.push((*k, b.tenant));
                }
                b.covered == 0 && b.pinned == 0
            }
            None => false,
        };
        if dead {
            drop_block(st, k);
        }
    }
    if let Some(h) = &st.hooks
        && !uncovered.is_empty()
    {
        h.unit_removed(&UnitEvent {
            end: *end,
            // A prefix unit a lookup created records no tenant; its blocks do.
            tenant: match u.tenant_id {
                0 => uncovered[0].1,
                t => t,
            },
            model: u.model,
            tokens: u.tokens,
            keys: uncovered.into_iter().map(|(k, _)| k).collect(),
        });
    }
    Some(u)
}
