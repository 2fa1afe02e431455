//! Opening a store: scanning every segment, rebuilding the index (recovery), starting the
//! writer.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvstack_driver::blockio::{
    BlockEngine, BufferPool, EngineChoice, EnginePreference, choose_engine,
};
use kvstack_firmware_interface::record::{ALIGN, Key, RecordHeader, RecordKind};

use super::SsdStore;
use super::index::{
    BlockMeta, BlockState, Counters, Loc, SegMeta, Shared, State, TombMeta, UnitMeta, add_seg,
};
use super::options::{RecoveryReport, StoreOptions};
use super::writer::{Purpose, Writer};
use crate::clock::Clock;
use crate::scan::{SegmentScan, scan_segment};
use crate::segment::{Media, NsMedia, SegmentFile, Space, StoreLocation};
use crate::{Error, Result};

pub(super) fn new_store_id(clock: &dyn Clock) -> [u8; 16] {
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

/// The first segment id of a new store on segment slots (a device, a preallocated file, a
/// namespace), drawn from its random store id into `[2^40, 2^61)`.
///
/// Freeing a slot zeroes only its header page, and a store whose every segment was freed is
/// started over with a new store id; the records of its earlier life stay behind in the slots
/// and are told apart from new ones only by their segment id (records carry no store id,
/// docs/ssd-format.md). Were ids to restart at 1, a new segment 1 in the slot of an old
/// segment 1 would take the old records after its tail as its own: deleted or evicted units
/// would come back. Two lives collide only if their id ranges overlap: a chance of about
/// (segments written) / 2^61. Directories need none of this: a freed segment's file is gone.
pub(super) fn first_slot_segment(store_id: &[u8; 16]) -> u64 {
    const LOW: u64 = 1 << 40;
    const HIGH: u64 = 1 << 61;
    let mut b = [0u8; 8];
    b.copy_from_slice(&store_id[..8]);
    LOW + u64::from_le_bytes(b) % (HIGH - LOW)
}

/// Chooses the engine and builds a buffer pool for it: on a namespace, an engine on its
/// controller, with the pool mapped for the controller so its buffers move zero copy
/// (docs/nvme.md, "Buffers"); otherwise as the preference and the probes say.
pub(super) fn engine_for(
    opts: &StoreOptions,
    namespace: Option<&NsMedia>,
    slots: usize,
    slot_bytes: usize,
    preference: EnginePreference,
) -> Result<(Box<dyn BlockEngine>, BufferPool, EngineChoice)> {
    let pool = BufferPool::new(slots, slot_bytes, opts.memory).map_err(Error::Memory)?;
    if let Some(ns) = namespace {
        let nvme_error = |source| Error::Nvme {
            location: opts.location.path().display().to_string(),
            source,
        };
        // Mapped before any buffer is taken; unmapped when the pool is dropped (or the
        // controller closed), so the engine may be dropped before or after the pool.
        ns.ns.map_pool(&pool).map_err(nvme_error)?;
        let engine = ns.ns.engine(slots, slot_bytes).map_err(nvme_error)?;
        let choice = EngineChoice {
            kind: engine.kind(),
            direct: engine.direct(),
            registered: engine.registered(),
            reason: format!(
                "configured: the userspace NVMe driver on {}",
                ns.ns.describe()
            ),
        };
        return Ok((engine, pool, choice));
    }
    let dir = opts.location.probe_dir();
    let (engine, choice) = choose_engine(&dir, slots, &pool, preference)
        .map_err(|e| Error::io("cannot set up block I/O for", &dir, e))?;
    Ok((engine, pool, choice))
}

/// The preference that reproduces `choice` (readers must use the same direct-I/O mode as the
/// files were opened with).
pub(super) fn preference_of(choice: &EngineChoice) -> EnginePreference {
    match (choice.kind, choice.direct) {
        (kvstack_driver::blockio::EngineKind::Uring, _) => EnginePreference::Uring,
        // The location decides (the namespace's engines).
        (kvstack_driver::blockio::EngineKind::Nvme, _) => EnginePreference::Auto,
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
    // Scans read large chunks; four in flight (on a namespace, of at most one command's
    // transfer).
    let chunk = (8usize << 20).max(opts.io_buffer_bytes());
    let (mut engine, pool, choice, mut space) = if let StoreLocation::Namespace(_) = &opts.location
    {
        // The namespace is brought up by the space, under the location's lock.
        let space = Space::open(
            &opts.location,
            opts.segment_bytes,
            opts.capacity_bytes,
            true,
            opts.read_only,
        )?;
        let ns = space.namespace();
        let max = ns.as_ref().map_or(chunk, |n| n.ns.max_bytes());
        if opts.io_buffer_bytes() > max {
            return Err(Error::InvalidOption {
                field: "max_block_payload",
                reason: format!(
                    "records of up to {} bytes do not fit one NVMe command of at most {max} \
                         bytes on {}",
                    opts.io_buffer_bytes(),
                    opts.location.path().display()
                ),
            });
        }
        let (engine, pool, choice) =
            engine_for(opts, ns.as_deref(), 4, chunk.min(max), opts.engine)?;
        (engine, pool, choice, space)
    } else {
        let (engine, pool, choice) = engine_for(opts, None, 4, chunk, opts.engine)?;
        let space = Space::open(
            &opts.location,
            opts.segment_bytes,
            opts.capacity_bytes,
            choice.direct,
            opts.read_only,
        )?;
        (engine, pool, choice, space)
    };
    let mut scans = Vec::new();
    for slot in space.existing()? {
        let mut scan = scan_segment(
            engine.as_mut(),
            &pool,
            slot.path.clone(),
            slot.media.target(),
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
        let mut report = RecoveryReport {
            live_writers: space.live_description(),
            ..RecoveryReport::default()
        };
        // The store's id: that of the oldest valid segment; segments of other stores are
        // reported and left alone.
        let oldest = scans
            .iter()
            .filter_map(|s| s.header)
            .min_by_key(|h| h.segment);
        let store_id = oldest.map_or_else(|| new_store_id(clock.as_ref()), |h| h.store_id);
        let mut max_seq = 0u64;
        let mut max_seg = 0u64;
        let mut segments: BTreeMap<u64, SegMeta> = BTreeMap::new();
        // Best (newest) record of every block key; every commit.
        let mut best: HashMap<Key, (RecordHeader, Loc)> = HashMap::new();
        let mut commits: HashMap<Key, Vec<(RecordHeader, Loc, Vec<Key>)>> = HashMap::new();
        let mut deletes: HashMap<Key, Vec<(RecordHeader, Loc)>> = HashMap::new();
        for scan in scans {
            report.bytes_read += scan.bytes_read;
            // A directory file name is never given to a new segment while a file of that name
            // may exist (an invalid one is kept for inspection): creating the segment would
            // reuse the file, whose old bytes are then read back as damage or, when they
            // carry that segment id, as records of the new segment.
            if matches!(opts.location, StoreLocation::Directory(_)) {
                max_seg = max_seg.max(scan.slot);
            }
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
                media: open_existing(&space, &scan)?,
                base: if !matches!(opts.location, StoreLocation::Directory(_)) {
                    space.slot_base(scan.slot)
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
                    tombs: HashSet::new(),
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
                    RecordKind::Delete => {
                        deletes.entry(hd.key).or_default().push((hd, loc));
                    }
                }
            }
        }
        let mut blocks: HashMap<Key, BlockMeta> = HashMap::new();
        let mut units: HashMap<Key, UnitMeta> = HashMap::new();
        let mut tenant_bytes: HashMap<u64, u64> = HashMap::new();
        let mut tombstones: HashMap<Key, TombMeta> = HashMap::new();
        let mut orphans: HashMap<Key, Vec<u64>> = HashMap::new();
        // Each key's newest delete: only commits after its horizon count.
        let horizons: HashMap<Key, u64> = deletes
            .iter()
            .map(|(k, d)| {
                let h = d.iter().filter_map(|(h, _)| h.delete_horizon()).max();
                (*k, h.unwrap_or(0))
            })
            .collect();
        for (end, dels) in deletes {
            let list = commits.get(&end).map(Vec::as_slice).unwrap_or_default();
            let Some((dh, dloc)) = dels
                .iter()
                .max_by_key(|(h, _)| (h.delete_horizon().unwrap_or(0), h.seq))
            else {
                continue;
            };
            let horizon = dh.delete_horizon().unwrap_or(0);
            if list.iter().any(|(h, _, _)| h.seq > horizon) {
                // Put again after the delete: the commits decide (below).
                continue;
            }
            if !list.is_empty() {
                report.units_deleted += 1;
            }
            let mut deps = Vec::new();
            for (_, l, _) in list {
                add_seg(&mut deps, l.seg);
            }
            // Kept only while an older commit lies in another segment (dependencies on
            // segments missing now are moot: they are gone).
            if deps
                .iter()
                .any(|s| *s != dloc.seg && segments.contains_key(s))
            {
                tombstones.insert(
                    end,
                    TombMeta {
                        loc: *dloc,
                        horizon,
                        deps,
                        tokens: dh.tokens,
                        tenant_id: dh.tenant,
                        model: dh.model,
                        created: dh.created_ms,
                    },
                );
            }
            commits.remove(&end);
        }
        for (end, all) in commits {
            let mut commit_segs = Vec::new();
            for (_, l, _) in &all {
                add_seg(&mut commit_segs, l.seg);
            }
            // Only commits after the key's newest delete count (all of them, if none).
            let horizon = horizons.get(&end).copied().unwrap_or(0);
            let list: Vec<_> = all
                .into_iter()
                .filter(|(h, _, _)| h.seq > horizon)
                .collect();
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
                // Its commits stay on disk: a delete of the key must outlive them.
                orphans.insert(end, commit_segs);
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
                        tenant: bh.tenant,
                        charged: 0,
                    });
                    super::quota::cover(b, &mut tenant_bytes);
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
                    commit_segs,
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
        for (k, t) in &tombstones {
            if let Some(s) = segments.get_mut(&t.loc.seg) {
                s.live += t.loc.len;
                s.tombs.insert(*k);
            }
        }
        report.blocks = blocks.len() as u64;
        report.units = units.len() as u64;
        report.tombstones = tombstones.len() as u64;
        report.seconds = start.elapsed().as_secs_f64();
        log::info!(
            "store {}: recovered {} units, {} blocks from {} segments ({} records, {} bytes \
             read) in {:.3} s; {} torn tails discarded, {} damaged ranges, {} units discarded, \
             {} units deleted ({} deletes kept)",
            opts.location.path().display(),
            report.units,
            report.blocks,
            report.segments,
            report.records,
            report.bytes_read,
            report.seconds,
            report.torn_tail_ranges,
            report.damaged.len(),
            report.units_discarded,
            report.units_deleted,
            report.tombstones
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
        // New records and segments are numbered above every one seen. A number at the top of
        // the range (a damaged header whose CRC matches, or a store that used them all up)
        // leaves none: writes are refused rather than numbers wrapped around, which recovery
        // would rank below the old ones (found by fuzzing, fuzz/ store_recovery).
        let exhausted = (max_seq == u64::MAX || max_seg == u64::MAX).then(|| {
            format!(
                "no sequence number or segment id is left above the largest found \
                 (seq {max_seq}, segment {max_seg})"
            )
        });
        if let Some(reason) = &exhausted {
            log::error!("store {}: {reason}", opts.location.path().display());
        }
        if oldest.is_none() && !matches!(opts.location, StoreLocation::Directory(_)) {
            // A new store on segment slots: its ids start where no earlier life's did.
            max_seg = first_slot_segment(&store_id) - 1;
        }
        let namespace = space.namespace();
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
            next_seq: max_seq.saturating_add(1),
            next_segment: max_seg.saturating_add(1),
            store_id,
            queued_bytes: 0,
            poisoned: exhausted,
            tombstones,
            deleting: HashMap::new(),
            orphans,
            unsynced_frees: HashSet::new(),
            pins: HashMap::new(),
            tenant_bytes,
            quotas: HashMap::new(),
            hooks: opts.hooks.clone(),
        };
        let read_only = opts.read_only;
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            read_preference: preference_of(&choice),
            namespace,
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
                shared.namespace.as_deref(),
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
}

pub(super) fn open_existing(space: &Space, scan: &SegmentScan) -> Result<Media> {
    use kvstack_driver::blockio::{OpenMode, open_file};
    if let Some(ns) = space.namespace() {
        return Ok(Media::Namespace(ns));
    }
    let f = open_file(
        &scan.path,
        OpenMode {
            write: !space.read_only,
            create: false,
            direct: space.direct,
        },
    )
    .map_err(|e| Error::io("cannot open segment", &scan.path, e))?;
    Ok(Media::File(Arc::new(f)))
}
