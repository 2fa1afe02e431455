//! The SSD store: durability and visibility, sharing, tenants, damage, retention and
//! refusal at their boundaries, compaction, readers racing writers and reclamation, device
//! mode and the synchronous engine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod tiers_common;

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvstack_driver::blockio::EnginePreference;
use kvstack_firmware_interface::record::ALIGN;
use kvstack_tiers::Error;
use kvstack_tiers::fsck::fsck;
use kvstack_tiers::{
    Clock, DeleteOutcome, HOUR_MS, ManualClock, ReadOutcome, SsdStore, StoreHooks, StoreLocation,
    StoreOptions, SystemClock, Tenant,
};
use tiers_common::*;

/// The syncer waits this many milliseconds before each batch's sync (a slow disk).
#[derive(Debug)]
struct SyncDelay(u64);

impl StoreHooks for SyncDelay {
    fn before_sync(&self) {
        if self.0 > 0 {
            std::thread::sleep(std::time::Duration::from_millis(self.0));
        }
    }
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(1_700_000_000_000))
}

#[test]
fn units_are_durable_shared_and_recovered() {
    let dir = TempDir::new("roundtrip");
    let t = Tenant::new("acme");
    let c = clock();
    let units: Vec<Vec<u32>> = (0..6)
        .map(|u| unit_tokens(1, u, 40, 40 + 2 * u as usize + 10))
        .collect();
    {
        let store = open(small_opts(dir.path()), c.clone());
        let mut tickets = Vec::new();
        for u in &units {
            tickets.push(put(&store, &t, u).unwrap());
        }
        let shared: usize = tickets.iter().map(|t| t.shared_blocks).sum();
        for tk in tickets {
            tk.wait().unwrap();
        }
        // Units after the first share the 40-token prefix (2 whole blocks of 16).
        assert!(shared >= 2, "shared {shared}");
        for u in &units {
            let (n, o) = read_and_check(&store, &t, u);
            assert_eq!((n, o), (u.len() as u64, ReadOutcome::Complete));
        }
        // A longer request matches the whole unit; the stored prefix ends at the unit end.
        let mut longer = units[2].clone();
        longer.extend([9, 9, 9]);
        assert_eq!(
            store.lookup(&model(), &t, &longer, P).tokens,
            units[2].len() as u64
        );
        // A request that stops inside a unit's last (short) block matches whole blocks only.
        let cut = &units[3][..units[3].len() - 1];
        assert_eq!(store.lookup(&model(), &t, cut, P).tokens, 48);
        store.close().unwrap();
    }
    let store = open(small_opts(dir.path()), c.clone());
    let r = store.recovery();
    assert_eq!(r.units, units.len() as u64);
    assert!(r.damaged.is_empty(), "{:?}", r.damaged);
    assert!(r.seconds >= 0.0);
    for u in &units {
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
    // On a namespace every engine's buffer pool is mapped for the controller: recovery, the
    // writer and the readers moved their data zero copy, and nothing bounced.
    let copies = store.stats().nvme_copies;
    if on_namespace() {
        let c = copies.unwrap();
        assert!(c.zero_copy_ops > 0, "{c:?}");
        assert_eq!((c.bounced_ops, c.bounce_bytes), (0, 0), "{c:?}");
    } else {
        assert!(copies.is_none());
    }
    let report = fsck(&small_opts(dir.path())).unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!(report.units_complete, units.len() as u64);
}

#[test]
fn tenants_never_see_each_other() {
    let dir = TempDir::new("tenants");
    let store = open(small_opts(dir.path()), clock());
    let (a, b) = (Tenant::new("a"), Tenant::new("b"));
    let tokens = unit_tokens(2, 0, 0, 64);
    put(&store, &a, &tokens).unwrap().wait().unwrap();
    assert_eq!(store.lookup(&model(), &b, &tokens, P).tokens, 0);
    put(&store, &b, &tokens).unwrap().wait().unwrap();
    // Same tokens, two tenants: each reads its own bytes (the salt differs by tenant).
    assert_eq!(read_and_check(&store, &a, &tokens).0, 64);
    assert_eq!(read_and_check(&store, &b, &tokens).0, 64);
    assert_eq!(store.stats().blocks, 8);
}

#[test]
fn unaligned_and_oversized_units_are_refused() {
    let dir = TempDir::new("refuse");
    let store = open(small_opts(dir.path()), clock());
    let t = Tenant::new("t");
    assert!(matches!(
        put(&store, &t, &[1, 2, 3]),
        Err(Error::Unaligned { .. })
    ));
    let long = vec![5u32; P * 65];
    assert!(matches!(
        put(&store, &t, &long),
        Err(Error::UnitTooLong { .. })
    ));
}

/// Fills the store with units of one family; returns the acknowledged ones.
fn fill(store: &kvstack_tiers::SsdStore, t: &Tenant, family: u32, n: u32) -> Vec<Vec<u32>> {
    let mut ok = Vec::new();
    for u in 0..n {
        let tokens = unit_tokens(family, u, 0, 8 * P);
        match put(store, t, &tokens).and_then(|tk| tk.wait()) {
            Ok(()) => ok.push(tokens),
            Err(Error::StoreFull { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    ok
}

#[test]
fn retention_holds_at_its_boundary_and_full_stores_refuse() {
    let dir = TempDir::new("retention");
    let c = clock();
    let mut opts = small_opts(dir.path());
    opts.retention_ms = 72 * HOUR_MS;
    let store = open(opts, c.clone());
    let t = Tenant::new("t");
    let old = fill(&store, &t, 3, 1000);
    assert!(old.len() > 10, "{}", old.len());
    assert_eq!(store.stats().refused_full, 1);
    // One millisecond before the retention ends, nothing may be reclaimed.
    c.advance(72 * HOUR_MS - 1);
    let extra = unit_tokens(4, 0, 0, 8 * P);
    assert!(matches!(
        put(&store, &t, &extra).unwrap().wait(),
        Err(Error::StoreFull { .. })
    ));
    assert_eq!(store.stats().refused_full, 2);
    for u in &old {
        // A lookup is not a use, so this leaves every unit as idle as it was.
        assert_eq!(
            store.lookup(&model(), &t, u, P).tokens,
            u.len() as u64,
            "young data kept"
        );
    }
    // Use one old unit now: it becomes young again.
    let kept = old[0].clone();
    assert_eq!(read_and_check(&store, &t, &kept).0, kept.len() as u64);
    // At the boundary, the oldest idle units may go; the write succeeds.
    c.advance(1);
    let r = put(&store, &t, &extra).unwrap().wait();
    assert!(r.is_ok(), "{r:?} {:#?}", store.stats());
    let s = store.stats();
    assert!(s.units_evicted > 0 && s.segments_freed > 0, "{s:?}");
    assert_eq!(read_and_check(&store, &t, &extra).0, extra.len() as u64);
    assert_eq!(
        read_and_check(&store, &t, &kept).0,
        kept.len() as u64,
        "used unit kept"
    );
    // Evicted: idle units (all equally old), never the used one.
    assert!(
        old[1..]
            .iter()
            .any(|u| store.lookup(&model(), &t, u, P).tokens == 0)
    );
}

#[test]
fn last_use_survives_a_restart() {
    let dir = TempDir::new("touch");
    let c = clock();
    let t = Tenant::new("t");
    let old;
    {
        let store = open(small_opts(dir.path()), c.clone());
        old = fill(&store, &t, 5, 1000);
        c.advance(70 * HOUR_MS);
        // A use 70 h later (recorded on disk at close).
        assert_eq!(read_and_check(&store, &t, &old[0]).0, old[0].len() as u64);
        store.close().unwrap();
    }
    c.advance(3 * HOUR_MS); // 73 h after the write, 3 h after the use.
    let store = open(small_opts(dir.path()), c.clone());
    let extra = unit_tokens(6, 0, 0, 8 * P);
    put(&store, &t, &extra).unwrap().wait().unwrap();
    assert_eq!(read_and_check(&store, &t, &old[0]).0, old[0].len() as u64);
}

#[test]
fn compaction_rewrites_mostly_dead_segments_and_keeps_data() {
    let dir = TempDir::new("compact");
    let c = clock();
    let t = Tenant::new("t");
    let (old, young);
    {
        let store = open(small_opts(dir.path()), c.clone());
        old = fill(&store, &t, 7, 6 * 8);
        // Keep every fourth unit young.
        c.advance(73 * HOUR_MS);
        young = old.iter().step_by(4).cloned().collect::<Vec<_>>();
        for u in &young {
            assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
        }
        let r = store.reclaim().unwrap();
        eprintln!("{r:?} {:#?}", store.stats());
        assert!(r.units_evicted > 0, "{r:?}");
        assert!(r.segments_compacted > 0, "{r:?}");
        assert!(store.stats().records_relocated > 0);
        for u in &young {
            assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
        }
        store.close().unwrap();
    }
    let store = open(small_opts(dir.path()), c.clone());
    for u in &young {
        assert_eq!(
            read_and_check(&store, &t, u).0,
            u.len() as u64,
            "after reopen"
        );
    }
    assert!(fsck(&small_opts(dir.path())).unwrap().clean());
}

/// Segment files of a directory store, oldest first.
/// Tests that damage segment files by name: nothing to do when the stores are on an NVMe
/// namespace (`KVSTACK_TIERS_IO`; tiers_damage damages namespaces).
fn skip_on_namespace() -> bool {
    let skip = on_namespace();
    if skip {
        eprintln!("skipped: a segment-file test, and the stores are on an NVMe namespace");
    }
    skip
}

fn segment_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs"))
        .collect();
    v.sort();
    v
}

#[test]
fn damaged_records_are_detected_reported_and_served_as_misses() {
    if skip_on_namespace() {
        return;
    }
    let dir = TempDir::new("damage");
    let c = clock();
    let t = Tenant::new("t");
    let units: Vec<Vec<u32>> = (0..12).map(|u| unit_tokens(8, u, 0, 4 * P)).collect();
    {
        let store = open(small_opts(dir.path()), c.clone());
        for u in &units {
            put(&store, &t, u).unwrap().wait().unwrap();
        }
        store.close().unwrap();
    }
    let files = segment_files(dir.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&files[0])
        .unwrap();
    // Record layout: segment header page, then records; flip a payload byte of the first
    // record and a header byte of a later one.
    let mut page = vec![0u8; ALIGN];
    f.read_exact_at(&mut page, ALIGN as u64).unwrap();
    let h = kvstack_firmware_interface::record::RecordHeader::decode(&page).unwrap();
    let second = ALIGN as u64 + h.record_len();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, ALIGN as u64 * 2 + 10).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], ALIGN as u64 * 2 + 10)
        .unwrap();
    f.read_exact_at(&mut b, second + 40).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], second + 40).unwrap();
    drop(f);

    let report = fsck(&small_opts(dir.path())).unwrap();
    assert!(!report.clean());
    assert_eq!(report.damaged.len(), 2, "{:?}", report.damaged);
    assert!(report.damaged.iter().any(|d| d.reason.contains("payload")));
    assert!(report.damaged.iter().any(|d| d.reason.contains("header")));
    assert!(report.damaged.iter().all(|d| d.path == files[0]));
    assert_eq!(report.damaged[0].offset, 2 * ALIGN as u64 - ALIGN as u64);

    let store = open(small_opts(dir.path()), c.clone());
    assert_eq!(store.recovery().damaged.len(), 2);
    // The first unit's first block and the second record are gone: those units miss (or
    // match less); every other unit reads back intact.
    assert_eq!(store.lookup(&model(), &t, &units[0], P).tokens, 0);
    let mut intact = 0;
    for u in &units {
        let (n, o) = read_and_check(&store, &t, u);
        if n == u.len() as u64 {
            intact += 1;
        } else {
            assert_eq!(
                o,
                ReadOutcome::Complete,
                "lookups never offer damaged blocks"
            );
        }
    }
    assert!(intact >= 10, "{intact}");
    // The store keeps working: the damaged unit can be written again.
    put(&store, &t, &units[0]).unwrap().wait().unwrap();
    assert_eq!(
        read_and_check(&store, &t, &units[0]).0,
        units[0].len() as u64
    );
}

#[test]
fn damage_after_open_is_caught_on_read() {
    if skip_on_namespace() {
        return;
    }
    let dir = TempDir::new("damage-read");
    let c = clock();
    let t = Tenant::new("t");
    let store = open(small_opts(dir.path()), c.clone());
    let u = unit_tokens(9, 0, 0, 4 * P);
    put(&store, &t, &u).unwrap().wait().unwrap();
    // Flip a payload byte of the third block behind the store's back.
    let files = segment_files(dir.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&files[0])
        .unwrap();
    let mut off = ALIGN as u64;
    for _ in 0..2 {
        let mut page = vec![0u8; ALIGN];
        f.read_exact_at(&mut page, off).unwrap();
        off += kvstack_firmware_interface::record::RecordHeader::decode(&page)
            .unwrap()
            .record_len();
    }
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off + ALIGN as u64 + 5).unwrap();
    f.write_all_at(&[!b[0]], off + ALIGN as u64 + 5).unwrap();
    f.sync_all().unwrap();
    drop(f);
    // Direct I/O reads the disk, buffered I/O the page cache: both see the flip.
    let (n, o) = read_and_check(&store, &t, &u);
    assert_eq!((n, o), (2 * P as u64, ReadOutcome::Damaged { at: 2 }));
    assert_eq!(store.stats().damaged_reads, 1);
    // Now served as a shorter prefix.
    assert_eq!(store.lookup(&model(), &t, &u, P).tokens, 2 * P as u64);
    // Writing the unit again rewrites only the damaged block; then it reads back whole, also
    // after a restart.
    let tk = put(&store, &t, &u).unwrap();
    assert_eq!(tk.new_blocks, 1);
    tk.wait().unwrap();
    assert_eq!(read_and_check(&store, &t, &u).0, u.len() as u64);
    store.close().unwrap();
    let store = open(small_opts(dir.path()), c.clone());
    assert_eq!(read_and_check(&store, &t, &u).0, u.len() as u64);
}

#[test]
fn truncated_segments_are_detected() {
    if skip_on_namespace() {
        return;
    }
    let dir = TempDir::new("truncate");
    let c = clock();
    let t = Tenant::new("t");
    let units: Vec<Vec<u32>> = (0..10).map(|u| unit_tokens(10, u, 0, 4 * P)).collect();
    {
        let store = open(small_opts(dir.path()), c.clone());
        for u in &units {
            put(&store, &t, u).unwrap().wait().unwrap();
        }
        store.close().unwrap();
    }
    let files = segment_files(dir.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap();
    // Cut in the middle of the written area.
    let len = 20 * ALIGN as u64 + 123;
    f.set_len(len).unwrap();
    drop(f);
    let report = fsck(&small_opts(dir.path())).unwrap();
    assert!(
        report
            .torn
            .iter()
            .chain(&report.damaged)
            .any(|d| d.reason.contains("truncated") || d.reason.contains("cut off")),
        "{report:?}"
    );
    let store = open(small_opts(dir.path()), c.clone());
    let mut complete = 0;
    for u in &units {
        if read_and_check(&store, &t, u).0 == u.len() as u64 {
            complete += 1;
        }
    }
    assert!(complete >= 1 && complete < units.len(), "{complete}");
    // Still writable.
    let extra = unit_tokens(11, 0, 0, 4 * P);
    put(&store, &t, &extra).unwrap().wait().unwrap();
    assert_eq!(read_and_check(&store, &t, &extra).0, extra.len() as u64);
}

#[test]
fn readers_racing_writers_eviction_and_compaction_see_right_bytes() {
    let dir = TempDir::new("race");
    let c = clock();
    let t = Tenant::new("t");
    let store = Arc::new(open(small_opts(dir.path()), c.clone()));
    let seed: Vec<Vec<u32>> = fill(&store, &t, 12, 20);
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..2 {
        let (store, stop, seed, t) = (store.clone(), stop.clone(), seed.clone(), t.clone());
        readers.push(std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for u in seed.iter().skip(r) {
                    // read_and_check asserts every delivered byte.
                    let _ = read_and_check(&store, &t, u);
                    reads += 1;
                }
            }
            reads
        }));
    }
    // Writers fill past capacity while the clock moves, forcing eviction and compaction.
    let mut written = Vec::new();
    for round in 0..6u32 {
        c.advance(80 * HOUR_MS);
        for u in 0..25 {
            let tokens = unit_tokens(13 + round, u, 2 * P, 6 * P);
            if put(&store, &t, &tokens).and_then(|tk| tk.wait()).is_ok() {
                written.push(tokens);
            }
        }
        store.reclaim().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(reads > 0);
    let s = store.stats();
    assert!(s.units_evicted > 0 && s.segments_freed > 0, "{s:?}");
    // Whatever is still visible reads back exactly.
    for u in written.iter().rev().take(10) {
        let _ = read_and_check(&store, &t, u);
    }
}

#[test]
fn device_mode_and_sync_engine_roundtrip() {
    for (device, engine) in [
        (true, EnginePreference::Auto),
        (false, EnginePreference::SyncBuffered),
        (true, EnginePreference::SyncDirect),
    ] {
        let dir = TempDir::new("device");
        if engine == EnginePreference::SyncDirect {
            let probe = kvstack_driver::probe::probe_o_direct(dir.path());
            if !probe.available {
                // Refusing is right there (tested in the driver); the QEMU rig's /tmp is tmpfs.
                eprintln!(
                    "skipped: direct I/O in {}: {}",
                    dir.path().display(),
                    probe.detail
                );
                continue;
            }
        }
        let c = clock();
        let t = Tenant::new("t");
        let mut opts = small_opts(dir.path());
        opts.engine = engine;
        if device {
            let path = dir.path().join("store.img");
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(6 * opts.segment_bytes + 1000).unwrap();
            opts.location = StoreLocation::Device(path);
        }
        let units: Vec<Vec<u32>> = (0..30).map(|u| unit_tokens(20, u, P, 6 * P)).collect();
        {
            let store = open(opts.clone(), c.clone());
            for u in &units {
                let _ = put(&store, &t, u).unwrap().wait();
            }
            c.advance(100 * HOUR_MS);
            store.reclaim().unwrap();
            for u in &units[..5] {
                let _ = put(&store, &t, u).unwrap().wait();
            }
            store.close().unwrap();
        }
        let store = open(opts.clone(), c.clone());
        assert!(
            store.recovery().damaged.is_empty(),
            "{:?}",
            store.recovery().damaged
        );
        for u in &units[..5] {
            assert_eq!(
                read_and_check(&store, &t, u).0,
                u.len() as u64,
                "{device} {engine:?}"
            );
        }
        drop(store);
        assert!(fsck(&opts).unwrap().clean());
    }
}

#[test]
fn real_clock_store_opens_with_defaults() {
    let dir = TempDir::new("defaults");
    let mut opts =
        kvstack_tiers::StoreOptions::new(StoreLocation::Directory(dir.path().to_path_buf()));
    opts.capacity_bytes = 4 * opts.segment_bytes;
    opts.memory = MEM;
    let store = open(opts, Arc::new(SystemClock));
    let t = Tenant::new("t");
    let u = unit_tokens(30, 0, 0, 4 * P);
    put(&store, &t, &u).unwrap().wait().unwrap();
    store.flush().unwrap();
    assert_eq!(read_and_check(&store, &t, &u).0, u.len() as u64);
}

#[test]
fn long_units_are_queued_in_parts_and_refused_whole() {
    let dir = TempDir::new("parts");
    let c = clock();
    let t = Tenant::new("t");
    let mut opts = small_opts(dir.path());
    // Three data segments (one more is the reserve) hold 93 records of 8 KiB: one unit of 60
    // blocks and its commit, not two.
    opts.capacity_bytes = 4 * opts.segment_bytes;
    let store = open(opts.clone(), c.clone());
    // 60 blocks: two parts of 32 and 28 blocks, over several segments.
    let long = unit_tokens(40, 0, 0, 60 * P);
    let tk = put(&store, &t, &long).unwrap();
    assert_eq!(tk.new_blocks, 60);
    tk.wait().unwrap();
    assert_eq!(read_and_check(&store, &t, &long).0, long.len() as u64);
    // A second long unit does not fit: refused as a whole, counted, nothing of it visible.
    let other = unit_tokens(41, 0, 0, 60 * P);
    let r = put(&store, &t, &other).unwrap().wait();
    assert!(matches!(r, Err(Error::StoreFull { .. })), "{r:?}");
    assert_eq!(store.stats().refused_full, 1);
    assert_eq!(store.lookup(&model(), &t, &other, P).tokens, 0);
    assert_eq!(read_and_check(&store, &t, &long).0, long.len() as u64);
    store.close().unwrap();
    let store = open(opts, c);
    assert_eq!(store.lookup(&model(), &t, &other, P).tokens, 0);
    assert_eq!(read_and_check(&store, &t, &long).0, long.len() as u64);
}

/// Tokens of unit `u` of round `round` (families 200-202).
fn mixed_tokens(round: u32, u: u32) -> Vec<u32> {
    mixed_unit_tokens(200, 2_000_000, 100_000, 30, round, u)
}

/// A store kept at capacity for many rounds (writes refused, mostly-dead segments compacted,
/// units evicted past retention when `retention_ms` allows it, prefixes read and so given
/// units of their own, every use recorded at close by touch commits that themselves need
/// room), reopened after every round: every unit used within its retention is still there,
/// byte for byte. Returns (evicted, compacted, refused).
fn full_store_cycles(
    seed: u64,
    retention: u64,
    max_step_ms: u64,
    sync_delay_ms: u64,
) -> (u64, u64, u64) {
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;
    let dir = TempDir::new("full-cycles");
    let c = clock();
    let t = Tenant::new("t");
    let opts = || {
        let mut o = small_opts(dir.path());
        o.capacity_bytes = 12 * o.segment_bytes;
        o.retention_ms = retention;
        o.hooks = Some(Arc::new(SyncDelay(sync_delay_ms)));
        o
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Unit -> last use the store has been told of.
    let mut used: HashMap<(u32, u32), u64> = HashMap::new();
    let mut totals = (0u64, 0u64, 0u64);
    // Units the index held at the last close (whole units only: a prefix unit whose first
    // commit was refused for lack of room is rightly forgotten).
    let mut held: Vec<([u8; 32], u64)> = Vec::new();
    for round in 0..10u32 {
        let store = open(opts(), c.clone());
        // Every unit read below is then due for a touch commit: a burst of them.
        c.advance(HOUR_MS / 2);
        let now = c.now_ms();
        let recovered: std::collections::HashSet<[u8; 32]> =
            store.units().into_iter().map(|(k, _, _)| k).collect();
        for (k, last) in held.drain(..) {
            // Only units past retention may be evicted, by the close's own writes.
            if last + retention > now {
                assert!(
                    recovered.contains(&k),
                    "seed {seed} round {round}: a unit held at close did not survive the restart"
                );
            }
        }
        let mut ids: Vec<(u32, u32)> = used.keys().copied().collect();
        ids.sort_unstable();
        for &(r, u) in &ids {
            // A use is recorded on disk at most one touch interval late.
            if used[&(r, u)] + retention > now + HOUR_MS / 2 {
                let tok = mixed_tokens(r, u);
                let (n, _) = read_and_check(&store, &t, &tok);
                assert_eq!(
                    n,
                    tok.len() as u64,
                    "seed {seed} round {round}: young unit {r}/{u} lost"
                );
                used.insert((r, u), c.now_ms());
            }
        }
        // The burst of uses, written now rather than at close so its effect can be checked.
        store.persist_uses().unwrap();
        store.flush().unwrap();
        store
            .check_index()
            .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
        assert_eq!(store.stats().failed_writes, 0, "seed {seed} round {round}");
        for u in 0..160u32 {
            c.advance(rng.random_range(0..max_step_ms));
            let roll = rng.random_range(0..10);
            if roll < 6 || ids.is_empty() {
                let tok = mixed_tokens(round, u);
                match put(&store, &t, &tok).and_then(|tk| tk.wait()) {
                    Ok(()) => {
                        used.insert((round, u), c.now_ms());
                    }
                    Err(Error::StoreFull { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            } else {
                let id = ids[rng.random_range(0..ids.len())];
                let tok = mixed_tokens(id.0, id.1);
                // A whole unit, or a prefix of it (which gets a unit of its own).
                let cut = if roll < 9 {
                    tok.len()
                } else {
                    P * rng.random_range(1..=tok.len() / P)
                };
                let (n, _) = read_and_check(&store, &t, &tok[..cut]);
                if n == tok.len() as u64 {
                    used.insert(id, c.now_ms());
                }
            }
        }
        store.persist_uses().unwrap();
        store.flush().unwrap();
        store
            .check_index()
            .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
        let s = store.stats();
        assert_eq!(s.failed_writes, 0, "seed {seed} round {round}");
        totals.0 += s.units_evicted;
        totals.1 += s.segments_compacted;
        totals.2 += s.refused_full;
        held = store
            .units()
            .into_iter()
            .filter(|&(_, tokens, _)| tokens % P as u64 != 0)
            .map(|(k, _, last)| (k, last))
            .collect();
        if round % 2 == 0 {
            store.close().unwrap();
        } else {
            drop(store);
        }
    }
    assert!(fsck(&opts()).unwrap().clean());
    totals
}

#[test]
fn a_full_store_through_eviction_and_compaction_loses_nothing_young() {
    let seeds: u64 = std::env::var("KVSTACK_FULL_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for seed in 0..seeds {
        // Retention short enough for eviction to take part.
        let (evicted, compacted, refused) = full_store_cycles(seed, 6 * HOUR_MS, 20 * 60_000, 5);
        eprintln!("seed {seed}: evicted {evicted}, compacted {compacted}, refused {refused}");
        assert!(evicted > 0 && compacted > 0 && refused > 0);
        // Nothing may be evicted: room comes from compaction alone, and the uses recorded
        // at close compete with data for it.
        let (evicted, compacted, refused) = full_store_cycles(seed, 72 * HOUR_MS, 60_000, 5);
        eprintln!(
            "seed {seed}, long retention: evicted {evicted}, compacted {compacted}, refused {refused}"
        );
        assert!(evicted == 0 && refused > 0);
    }
}

/// A burst of uses written at capacity while the disk is slow to sync: the segment holding
/// one batch's touch commits is full and sealed, not yet published, when the next batch needs
/// room. It must not be reclaimed (it holds the only record of those uses, and publishing
/// into it would move each unit's live commit into a deleted file).
#[test]
fn touch_bursts_at_capacity_never_publish_into_reclaimed_segments() {
    let dir = TempDir::new("touch-burst");
    let c = clock();
    let t = Tenant::new("t");
    let mut opts = small_opts(dir.path());
    // Room for the data and a part of the burst only.
    opts.capacity_bytes = 48 * opts.segment_bytes;
    // Reads are not written as they happen: the burst comes from persist_uses.
    opts.touch_interval_ms = 1000 * HOUR_MS;
    let store = open(opts.clone(), c.clone());
    let units: Vec<Vec<u32>> = (0..700u32).map(|u| unit_tokens(9, u, 0, P)).collect();
    let mut written = Vec::new();
    for tok in &units {
        match put(&store, &t, tok).and_then(|tk| tk.wait()) {
            Ok(()) => written.push(tok.clone()),
            Err(Error::StoreFull { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(written.len() > 600, "{}", written.len());
    store.close().unwrap();
    // Now the disk is slow to sync.
    opts.hooks = Some(Arc::new(SyncDelay(30)));
    let store = open(opts.clone(), c.clone());
    c.advance(HOUR_MS);
    for tok in &written {
        assert_eq!(read_and_check(&store, &t, tok).0, tok.len() as u64);
    }
    store.persist_uses().unwrap();
    store.flush().unwrap();
    store.check_index().unwrap();
    let s = store.stats();
    assert_eq!(s.failed_writes, 0, "{s:#?}");
    store.close().unwrap();
    let store = open(opts, c.clone());
    for tok in &written {
        assert_eq!(read_and_check(&store, &t, tok).0, tok.len() as u64);
    }
}

#[test]
fn one_writer_per_location_and_readers_share_or_read_live() {
    let dir = TempDir::new("lock");
    let rw = || small_opts(dir.path());
    let ro = || StoreOptions {
        read_only: true,
        ..small_opts(dir.path())
    };
    let me = format!("pid {}", std::process::id());
    let writer = SsdStore::open(rw(), clock()).unwrap();
    // A second writer (even in this process: flock belongs to the open file) is refused.
    match SsdStore::open(rw(), clock()) {
        Err(Error::InUse { what, holders, .. }) => {
            let want = if on_namespace() {
                "NVMe namespace"
            } else {
                "data directory"
            };
            assert_eq!(what, want);
            assert!(holders.starts_with(&me), "{holders}");
        }
        other => panic!("a second writer must be refused: {other:?}"),
    }
    // A reader goes on, and the report says the store is live.
    let live = SsdStore::open(ro(), clock()).unwrap();
    let w = live.recovery().live_writers.clone().unwrap();
    assert!(w.starts_with(&me), "{w}");
    let report = fsck(&ro()).unwrap();
    assert!(report.live_writers.is_some());
    drop(live);
    writer.close().unwrap();
    // With the writer gone, readers share the lock, see a quiet store, and keep writers out.
    let a = SsdStore::open(ro(), clock()).unwrap();
    let b = SsdStore::open(ro(), clock()).unwrap();
    assert!(a.recovery().live_writers.is_none());
    match SsdStore::open(rw(), clock()) {
        Err(e @ Error::InUse { .. }) => assert!(e.to_string().contains("reading"), "{e}"),
        other => panic!("a writer must wait for readers: {other:?}"),
    }
    drop((a, b));
    SsdStore::open(rw(), clock()).unwrap().close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Deletes

#[test]
fn deleted_units_miss_before_and_after_a_restart() {
    let dir = TempDir::new("delete");
    let c = clock();
    let t = Tenant::new("t");
    let opts = small_opts(dir.path());
    let a = unit_tokens(50, 0, 0, 3 * P + 4);
    let b = unit_tokens(51, 0, 0, 2 * P + 6);
    {
        let store = open(opts.clone(), c.clone());
        put(&store, &t, &a).unwrap().wait().unwrap();
        put(&store, &t, &b).unwrap().wait().unwrap();
        let blocks = store.stats().blocks;
        let tk = del(&store, &t, &a).unwrap();
        assert_eq!(tk.key, unit_key(&t, &a));
        assert_eq!(tk.wait().unwrap(), DeleteOutcome::Deleted);
        assert_eq!(store.lookup(&model(), &t, &a, P).tokens, 0);
        assert!(!is_unit(&store, &t, &a));
        assert_eq!(read_and_check(&store, &t, &b).0, b.len() as u64);
        let s = store.stats();
        assert_eq!((s.units, s.units_deleted, s.deletes), (1, 1, 1), "{s:#?}");
        assert_eq!(
            s.blocks,
            blocks - 4,
            "the deleted unit's blocks are dead space"
        );
        store.check_index().unwrap();
        store.close().unwrap();
    }
    let report = fsck(&opts).unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!((report.deletes, report.units_deleted), (1, 1));
    assert_eq!(report.units_complete, 1);
    let listed = kvstack_tiers::fsck::inspect(&opts, true).unwrap();
    let d: Vec<_> = listed
        .records
        .iter()
        .filter(|r| r.kind == "delete")
        .collect();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].horizon, Some(d[0].seq));
    assert_eq!(d[0].key, kvstack_tiers::key::key_hex(&unit_key(&t, &a), 32));
    {
        let store = open(opts.clone(), c.clone());
        assert_eq!(store.recovery().units_deleted, 1);
        assert_eq!(store.lookup(&model(), &t, &a, P).tokens, 0);
        assert!(!is_unit(&store, &t, &a));
        assert_eq!(read_and_check(&store, &t, &b).0, b.len() as u64);
        // Put again: stored again, and a restart keeps it (its commit is newer than the
        // delete).
        put(&store, &t, &a).unwrap().wait().unwrap();
        assert_eq!(read_and_check(&store, &t, &a).0, a.len() as u64);
        store.check_index().unwrap();
        store.close().unwrap();
    }
    let store = open(opts.clone(), c.clone());
    assert_eq!(store.recovery().units_deleted, 0);
    assert_eq!(read_and_check(&store, &t, &a).0, a.len() as u64);
    drop(store);
    assert_eq!(fsck(&opts).unwrap().units_deleted, 0);
}

#[test]
fn deleting_a_prefix_unit_keeps_the_longer_units_blocks() {
    let dir = TempDir::new("delete-prefix");
    let c = clock();
    let t = Tenant::new("t");
    let long = unit_tokens(52, 0, 0, 4 * P + 6);
    // Ends inside the third block (its own short block), and at a block boundary.
    let short = long[..2 * P + 4].to_vec();
    let aligned = long[..2 * P].to_vec();
    let store = open(small_opts(dir.path()), c.clone());
    for u in [&long, &short, &aligned] {
        put(&store, &t, u).unwrap().wait().unwrap();
    }
    for u in [&short, &aligned] {
        assert_eq!(
            del(&store, &t, u).unwrap().wait().unwrap(),
            DeleteOutcome::Deleted
        );
        assert!(!is_unit(&store, &t, u));
    }
    // The short unit's own block is gone; the shared ones are the long unit's.
    assert_eq!(store.lookup(&model(), &t, &short, P).tokens, 2 * P as u64);
    assert_eq!(read_and_check(&store, &t, &long).0, long.len() as u64);
    store.check_index().unwrap();
    store.close().unwrap();
    let store = open(small_opts(dir.path()), c.clone());
    assert_eq!(store.lookup(&model(), &t, &short, P).tokens, 2 * P as u64);
    assert!(!is_unit(&store, &t, &short) && !is_unit(&store, &t, &aligned));
    assert_eq!(read_and_check(&store, &t, &long).0, long.len() as u64);
    assert_eq!(store.recovery().units_deleted, 2);
}

#[test]
fn deleting_an_unknown_unit_is_a_clear_result() {
    let dir = TempDir::new("delete-unknown");
    let c = clock();
    let t = Tenant::new("t");
    let u = unit_tokens(53, 0, 0, 2 * P + 2);
    let store = open(small_opts(dir.path()), c.clone());
    assert_eq!(
        del(&store, &t, &u).unwrap().wait().unwrap(),
        DeleteOutcome::NotStored
    );
    assert_eq!(
        del(&store, &t, &[]).unwrap().wait().unwrap(),
        DeleteOutcome::NotStored
    );
    put(&store, &t, &u).unwrap().wait().unwrap();
    // Another tenant's delete names another key: nothing of this tenant's is touched.
    let other = Tenant::new("other");
    assert_eq!(
        del(&store, &other, &u).unwrap().wait().unwrap(),
        DeleteOutcome::NotStored
    );
    assert_eq!(read_and_check(&store, &t, &u).0, u.len() as u64);
    assert_eq!(
        del(&store, &t, &u).unwrap().wait().unwrap(),
        DeleteOutcome::Deleted
    );
    assert_eq!(
        del(&store, &t, &u).unwrap().wait().unwrap(),
        DeleteOutcome::NotStored
    );
    let s = store.stats();
    assert_eq!(
        (s.deletes, s.units_deleted, s.failed_writes),
        (4, 1, 0),
        "{s:#?}"
    );
    store.check_index().unwrap();
    store.close().unwrap();
    let mut ro = small_opts(dir.path());
    ro.read_only = true;
    let store = open(ro, c);
    assert!(matches!(del(&store, &t, &u), Err(Error::ReadOnly)));
    assert_eq!(store.lookup(&model(), &t, &u, P).tokens, 0);
}

/// A slow disk keeps a delete written but unacknowledged while uses, a put of the same unit
/// and compaction come along: none of them may write a commit of the unit that is newer than
/// the delete unless it is a put made after it.
#[test]
fn a_pending_delete_races_neither_touches_nor_compaction_and_loses_to_a_later_put() {
    let dir = TempDir::new("delete-race");
    let c = clock();
    let t = Tenant::new("t");
    let mut opts = small_opts(dir.path());
    opts.hooks = Some(Arc::new(SyncDelay(300)));
    // Old units fill most of the first segment; `doomed` and `kept` are young.
    let old: Vec<Vec<u32>> = (0..4).map(|u| unit_tokens(54, u, 0, 4 * P)).collect();
    let doomed = unit_tokens(55, 0, 0, 4 * P);
    let kept = unit_tokens(55, 1, 0, 4 * P);
    let again = unit_tokens(55, 2, 0, 2 * P + 2);
    {
        let store = open(opts.clone(), c.clone());
        for u in &old {
            put(&store, &t, u).unwrap().wait().unwrap();
        }
        c.advance(100 * HOUR_MS);
        for u in [&doomed, &again, &kept] {
            put(&store, &t, u).unwrap().wait().unwrap();
        }
        c.advance(HOUR_MS);
        let tk = del(&store, &t, &doomed).unwrap();
        // A use now would be due for a touch commit.
        assert_eq!(read_and_check(&store, &t, &doomed).0, doomed.len() as u64);
        // Evicts the old units, then compacts the mostly dead first segment, which holds the
        // commit of `doomed`, while the delete waits for its sync.
        let r = store.reclaim().unwrap();
        assert!(r.units_evicted >= 4 && r.segments_compacted >= 1, "{r:?}");
        // Delete, then put again before the delete is acknowledged: the put wins.
        let tk2 = del(&store, &t, &again).unwrap();
        let put_again = put(&store, &t, &again).unwrap();
        assert_eq!(tk.wait().unwrap(), DeleteOutcome::Deleted);
        assert_eq!(tk2.wait().unwrap(), DeleteOutcome::Deleted);
        put_again.wait().unwrap();
        assert_eq!(store.lookup(&model(), &t, &doomed, P).tokens, 0);
        assert_eq!(read_and_check(&store, &t, &again).0, again.len() as u64);
        store.check_index().unwrap();
        assert_eq!(store.stats().failed_writes, 0);
        store.close().unwrap();
    }
    let store = open(opts, c);
    assert_eq!(
        store.lookup(&model(), &t, &doomed, P).tokens,
        0,
        "the delete came undone"
    );
    assert!(!is_unit(&store, &t, &doomed));
    assert_eq!(read_and_check(&store, &t, &again).0, again.len() as u64);
    assert_eq!(read_and_check(&store, &t, &kept).0, kept.len() as u64);
}

/// A delete is kept while an older commit of its unit is on disk, copied when its own segment
/// is compacted (horizon and all), and dropped once those commits' segments are freed; this
/// holds for a unit evicted before it was deleted too.
#[test]
fn deletes_outlive_older_commits_through_compaction_and_are_dropped_after() {
    let dir = TempDir::new("delete-lifetime");
    let c = clock();
    let t = Tenant::new("t");
    let mut opts = small_opts(dir.path());
    // 16 pages of records a segment: four one-block units (block and commit, 2 pages each);
    // a delete takes one page. Only nearly dead segments are compacted.
    opts.segment_bytes = 17 * ALIGN as u64;
    opts.capacity_bytes = 64 * opts.segment_bytes;
    opts.compact_live_fraction = 0.15;
    let one = |u: u32| unit_tokens(56, u, 0, P);
    // The first segment: `evicted` (old), `doomed`, `young`, `young2`.
    let (evicted, doomed, young, young2) = (one(0), one(1), one(2), one(3));
    // Two more segments of four, then `last` and `last2` with room to spare.
    let others: Vec<Vec<u32>> = (4..12).map(one).collect();
    let (last, last2, filler, after) = (one(12), one(13), one(14), one(15));
    let store = open(opts.clone(), c.clone());
    put(&store, &t, &evicted).unwrap().wait().unwrap();
    c.advance(100 * HOUR_MS);
    for u in [&doomed, &young, &young2].into_iter().chain(&others) {
        put(&store, &t, u).unwrap().wait().unwrap();
    }
    for u in [&last, &last2] {
        put(&store, &t, u).unwrap().wait().unwrap();
    }
    assert_eq!(store.reclaim().unwrap().units_evicted, 1);
    // Both deletes land after `last` and `last2`, and must outlive the first segment, which
    // holds the evicted unit's commit still, and the deleted one's.
    assert_eq!(
        del(&store, &t, &doomed).unwrap().wait().unwrap(),
        DeleteOutcome::Deleted
    );
    assert_eq!(
        del(&store, &t, &evicted).unwrap().wait().unwrap(),
        DeleteOutcome::NotStored
    );
    assert_eq!(store.stats().tombstones, 2);
    // Empty their segment of everything else: `last` and `last2` deleted (those deletes
    // lie with the commits they delete, so they are not kept), then a unit that seals it,
    // deleted too.
    for u in [&last, &last2] {
        assert_eq!(
            del(&store, &t, u).unwrap().wait().unwrap(),
            DeleteOutcome::Deleted
        );
    }
    assert_eq!(store.stats().tombstones, 2);
    put(&store, &t, &filler).unwrap().wait().unwrap();
    assert_eq!(
        del(&store, &t, &filler).unwrap().wait().unwrap(),
        DeleteOutcome::Deleted
    );
    assert_eq!(store.stats().tombstones, 3);
    // The next data goes to a new segment (the full one stops being written to).
    put(&store, &t, &after).unwrap().wait().unwrap();
    // Compacting it copies the two deletes, frees it, and with it drops the filler's delete.
    let r = store.reclaim().unwrap();
    let s = store.stats();
    assert_eq!(r.segments_compacted, 1, "{r:?} {s:#?}");
    assert_eq!(s.tombstones, 2, "{s:#?}");
    store.check_index().unwrap();
    store.close().unwrap();
    let listed = kvstack_tiers::fsck::inspect(&opts, true).unwrap();
    let copies: Vec<_> = listed
        .records
        .iter()
        .filter(|r| r.kind == "delete" && r.flags & 2 != 0)
        .collect();
    assert_eq!(copies.len(), 2, "{:?}", listed.records);
    assert!(copies.iter().all(|r| r.horizon.is_some_and(|h| h < r.seq)));
    let store = open(opts.clone(), c.clone());
    assert_eq!(store.recovery().tombstones, 2);
    for u in [&doomed, &evicted, &last, &last2, &filler] {
        assert_eq!(
            store.lookup(&model(), &t, u, P).tokens,
            0,
            "a deleted unit came back"
        );
    }
    assert_eq!(read_and_check(&store, &t, &young).0, young.len() as u64);
    // Deleting the rest of the first segment empties it: it is freed, and every delete that
    // had its commits to outlive is dropped.
    for u in [&young, &young2] {
        assert_eq!(
            del(&store, &t, u).unwrap().wait().unwrap(),
            DeleteOutcome::Deleted
        );
    }
    assert_eq!(store.stats().tombstones, 4);
    let freed = store.stats().segments_freed;
    store.reclaim().unwrap();
    let s = store.stats();
    assert!(s.segments_freed > freed, "{s:#?}");
    assert_eq!(s.tombstones, 0, "{s:#?}");
    store.check_index().unwrap();
    store.close().unwrap();
    let store = open(opts, c);
    assert_eq!(store.recovery().tombstones, 0);
    for u in [&doomed, &evicted, &young, &young2, &last, &last2, &filler] {
        assert_eq!(
            store.lookup(&model(), &t, u, P).tokens,
            0,
            "a deleted unit came back"
        );
    }
    for u in others.iter().chain([&after]) {
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
}

/// A store full of young data, restarted between deletes (each restart seals the segments
/// written, so each session's first delete needs a segment of its own): deletes still go
/// through, and the room they free takes new units. Found by the crash campaign, where the
/// store ended up with every slot in use and compaction with nowhere to copy to.
#[test]
fn deletes_make_room_in_a_full_store_across_restarts() {
    let dir = TempDir::new("delete-full");
    let c = clock();
    let t = Tenant::new("t");
    let opts = small_opts(dir.path());
    let units = {
        let store = open(opts.clone(), c.clone());
        let units = fill(&store, &t, 57, 1000);
        assert!(store.stats().refused_full > 0);
        units
    };
    assert!(units.len() >= 15, "{}", units.len());
    for (i, u) in units.iter().enumerate() {
        let store = open(opts.clone(), c.clone());
        let r = del(&store, &t, u).unwrap().wait();
        assert_eq!(r.unwrap(), DeleteOutcome::Deleted, "delete {i}");
        store.check_index().unwrap();
        store.close().unwrap();
    }
    // The room the deletes freed takes as much new data again.
    let store = open(opts.clone(), c.clone());
    let fresh = fill(&store, &t, 58, units.len() as u32);
    assert_eq!(fresh.len(), units.len());
    store.close().unwrap();
    let store = open(opts, c);
    for u in &units {
        assert_eq!(store.lookup(&model(), &t, u, P).tokens, 0);
    }
    for u in &fresh {
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
}

/// A store full of live young data, where no segment is dead enough to compact: deletes keep
/// going through once their own segment is full (a segment with any dead page is compacted to
/// make room for them).
#[test]
fn deletes_go_through_in_a_store_full_of_live_data() {
    let dir = TempDir::new("delete-live");
    let c = clock();
    let t = Tenant::new("t");
    let mut opts = small_opts(dir.path());
    // 15 pages a segment: a delete segment holds 15 deletes.
    opts.segment_bytes = 16 * ALIGN as u64;
    opts.capacity_bytes = 64 * opts.segment_bytes;
    let store = open(opts, c.clone());
    // Units of four blocks (10 pages), each with two prefix units (a commit of 2 pages each,
    // sharing its blocks), until the store refuses.
    let mut longs = Vec::new();
    let mut prefixes = Vec::new();
    'fill: for u in 0..1000 {
        let long = unit_tokens(59, u, 0, 4 * P);
        let family = [long.clone(), long[..P].to_vec(), long[..2 * P].to_vec()];
        for tok in &family {
            match put(&store, &t, tok).and_then(|tk| tk.wait()) {
                Ok(()) => {}
                Err(Error::StoreFull { .. }) => break 'fill,
                Err(e) => panic!("{e}"),
            }
        }
        longs.push(family[0].clone());
        prefixes.extend(family[1..].iter().cloned());
    }
    assert!(prefixes.len() > 60, "{}", prefixes.len());
    // Deleting the prefixes frees 2 pages in 14 and keeps every delete (the older commits
    // stay behind, in the long units' segments): far more deletes than one segment holds.
    for (i, u) in prefixes.iter().enumerate() {
        let r = del(&store, &t, u).unwrap().wait();
        assert_eq!(r.unwrap(), DeleteOutcome::Deleted, "delete {i}");
    }
    let s = store.stats();
    assert!(s.segments_compacted > 0 && s.tombstones > 15, "{s:#?}");
    store.check_index().unwrap();
    for u in &longs {
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
}

/// Found by fuzzing (fuzz/corpus/store_recovery/crash-seq-max and crash-segment-id-max): a
/// record whose sequence number is u64::MAX (a header damaged with a matching CRC) made open
/// compute `max + 1` and panic with overflow checks, or wrap to 0 without them, so that new
/// records would rank below old ones after a restart. The same for a segment id of u64::MAX.
/// Such a store opens, serves what it holds, and refuses writes.
#[test]
fn exhausted_sequence_numbers_and_segment_ids_refuse_writes_not_wrap() {
    if skip_on_namespace() {
        return;
    }
    use kvstack_firmware_interface::record::{RecordHeader, SegmentHeader};
    let c = clock();
    let t = Tenant::new("t");
    let units: Vec<Vec<u32>> = (0..2).map(|u| unit_tokens(9, u, 0, 2 * P)).collect();
    let write_store = |dir: &std::path::Path| {
        let store = open(small_opts(dir), c.clone());
        for u in &units {
            put(&store, &t, u).unwrap().wait().unwrap();
        }
        store.close().unwrap();
    };

    // The first record's sequence number at the top of the range, its CRC recomputed.
    let dir = TempDir::new("seq-max");
    write_store(dir.path());
    let files = segment_files(dir.path());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&files[0])
        .unwrap();
    let mut page = vec![0u8; ALIGN];
    f.read_exact_at(&mut page, ALIGN as u64).unwrap();
    let h = RecordHeader::decode(&page).unwrap();
    let forged = RecordHeader { seq: u64::MAX, ..h };
    f.write_all_at(&forged.encode(), ALIGN as u64).unwrap();
    drop(f);
    let store = open(small_opts(dir.path()), c.clone());
    let poisoned = store.stats().poisoned.expect("writes refused");
    assert!(poisoned.contains("sequence number"), "{poisoned}");
    assert!(matches!(
        put(&store, &t, &unit_tokens(9, 7, 0, 2 * P)),
        Err(Error::Poisoned { .. })
    ));
    // What it holds is still served, checked byte for byte (the forged record is newest for
    // its key, and its payload is intact).
    for u in &units {
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
    store.close().unwrap();

    // A segment file named and headed u64::MAX (a copy of a real segment).
    let dir = TempDir::new("seg-max");
    write_store(dir.path());
    let files = segment_files(dir.path());
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let s = SegmentHeader::decode(&bytes).unwrap();
    let top = SegmentHeader {
        segment: u64::MAX,
        ..s
    };
    bytes[..SegmentHeader::BYTES].copy_from_slice(&top.encode());
    std::fs::write(dir.path().join("seg-ffffffffffffffff.kvs"), &bytes).unwrap();
    let store = open(small_opts(dir.path()), c.clone());
    assert!(store.stats().poisoned.is_some());
    for u in &units {
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
    store.close().unwrap();
}

#[test]
fn pinned_units_outlive_retention_until_the_pin_ends() {
    let dir = TempDir::new("pins");
    let c = clock();
    let mut opts = small_opts(dir.path());
    opts.retention_ms = 72 * HOUR_MS;
    let store = open(opts, c.clone());
    let t = Tenant::new("t");
    let old = fill(&store, &t, 5, 1000);
    assert!(old.len() > 10, "{}", old.len());
    let (pinned, free) = old.split_at(old.len() / 2);
    let pin_end = store.now_ms() + 80 * HOUR_MS;
    for u in pinned {
        assert!(store.pin(&unit_key(&t, u), pin_end));
    }
    // A unit that is not stored is not pinned.
    assert!(!store.pin(&unit_key(&t, &unit_tokens(6, 0, 0, 8 * P)), pin_end));
    assert_eq!(store.pins(), pinned.len());

    // Past retention, before the pin ends: eviction takes only unpinned units.
    c.advance(72 * HOUR_MS);
    let r = store.reclaim().unwrap();
    assert_eq!(r.units_evicted, free.len() as u64, "{r:?}");
    for u in pinned {
        assert!(is_unit(&store, &t, u), "a pinned unit was evicted");
        assert_eq!(read_and_check(&store, &t, u).0, u.len() as u64);
    }
    assert!(free.iter().all(|u| !is_unit(&store, &t, u)));
    // Reads made the pinned units young: age them past retention again, still pinned.
    c.advance(7 * HOUR_MS);
    // A full store evicts around the pins too: new units fit only in the unpinned room.
    let newer = fill(&store, &t, 7, 1000);
    assert!(!newer.is_empty());
    assert!(pinned.iter().all(|u| is_unit(&store, &t, u)));

    // Unpinning one ends its pin (a second unpin finds none).
    assert!(store.unpin(&unit_key(&t, &pinned[0])));
    assert!(!store.unpin(&unit_key(&t, &pinned[0])));
    // After the pins end, the units are evictable again.
    c.advance(73 * HOUR_MS);
    assert_eq!(store.pins(), 0);
    let r = store.reclaim().unwrap();
    assert!(r.units_evicted >= pinned.len() as u64, "{r:?}");
    assert!(pinned.iter().all(|u| !is_unit(&store, &t, u)));
    // A delete of a pinned unit still removes it, and its pin with it.
    let last = fill(&store, &t, 8, 2);
    assert!(store.pin(&unit_key(&t, &last[0]), store.now_ms() + HOUR_MS));
    assert_eq!(
        del(&store, &t, &last[0]).unwrap().wait().unwrap(),
        DeleteOutcome::Deleted
    );
    assert_eq!(store.pins(), 0);
    assert!(!is_unit(&store, &t, &last[0]));
}

#[test]
fn ssd_quotas_bound_a_tenant_by_its_own_oldest_units_and_survive_a_restart() {
    let dir = TempDir::new("quotas");
    let c = clock();
    let mut opts = small_opts(dir.path());
    opts.capacity_bytes = 32 * (256 << 10);
    let store = open(opts.clone(), c.clone());
    let (a, b) = (Tenant::new("a"), Tenant::new("b"));
    let quota = 300 << 10;
    store.set_quotas([(a.id(), quota)].into());
    assert_eq!(store.quota(a.id()), Some(quota));
    assert_eq!(store.quota(b.id()), None);

    // Tenant b, without a quota, stores as much as a will.
    let mut bs = Vec::new();
    for u in 0..8 {
        let tokens = unit_tokens(2, u, 0, 8 * P);
        put(&store, &b, &tokens).unwrap().wait().unwrap();
        bs.push(tokens);
    }
    let b_bytes = store.tenant_bytes(b.id());
    assert!(b_bytes > quota, "{b_bytes}");

    // Tenant a, one unit at a time: never over its quota; its oldest units make way.
    let mut us = Vec::new();
    for u in 0..8 {
        c.advance(1000);
        let tokens = unit_tokens(1, u, 0, 8 * P);
        put(&store, &a, &tokens).unwrap().wait().unwrap();
        us.push(tokens);
        let used = store.tenant_bytes(a.id());
        assert!(
            used <= quota,
            "unit {u}: {used} bytes over the quota {quota}"
        );
        store.check_index().unwrap();
    }
    let st = store.stats();
    assert!(st.quota_evicted >= 3, "{st:?}");
    assert_eq!(st.units_evicted, st.quota_evicted);
    // The newest units are kept, oldest first made way, and b lost nothing.
    let kept: Vec<bool> = us.iter().map(|u| is_unit(&store, &a, u)).collect();
    assert!(kept[7] && kept[6] && !kept[0], "{kept:?}");
    assert!(
        kept.windows(2).all(|w| w[0] <= w[1]),
        "not oldest first: {kept:?}"
    );
    assert_eq!(read_and_check(&store, &a, &us[7]).0, us[7].len() as u64);
    assert!(bs.iter().all(|u| is_unit(&store, &b, u)));
    assert_eq!(store.tenant_bytes(b.id()), b_bytes);

    // Puts in flight together are settled once durable.
    for u in 8..14 {
        put(&store, &a, &unit_tokens(1, u, 0, 8 * P)).unwrap();
    }
    store.flush().unwrap();
    assert!(store.tenant_bytes(a.id()) <= quota);
    assert!(is_unit(&store, &a, &unit_tokens(1, 13, 0, 8 * P)));
    store.check_index().unwrap();

    // A unit bigger than the quota alone is refused, evicting nothing.
    let before = store.units().len();
    let e = put(&store, &a, &unit_tokens(1, 20, 0, 48 * P)).unwrap_err();
    assert!(
        matches!(e, Error::QuotaExceeded { quota: q, .. } if q == quota),
        "{e}"
    );
    assert_eq!(store.units().len(), before);

    // With every unit of a pinned, there is no room to make: refused, nothing evicted.
    let used = store.tenant_bytes(a.id());
    store.set_quotas([(a.id(), used)].into());
    let mine: Vec<_> = (0..14)
        .map(|u| unit_tokens(1, u, 0, 8 * P))
        .filter(|u| is_unit(&store, &a, u))
        .collect();
    for u in &mine {
        assert!(store.pin(&unit_key(&a, u), store.now_ms() + HOUR_MS));
    }
    let e = put(&store, &a, &unit_tokens(1, 21, 0, 8 * P)).unwrap_err();
    assert!(matches!(e, Error::QuotaExceeded { .. }), "{e}");
    assert!(mine.iter().all(|u| is_unit(&store, &a, u)));
    assert!(store.stats().refused_quota >= 2);
    store.check_index().unwrap();

    // Usage is rebuilt from the records at a restart. Eviction writes nothing, so units a
    // quota evicted come back while their segments are not reused; setting the quotas brings
    // the tenant under at once, oldest first, and the pins are gone with the restart.
    let (ua, ub) = (store.tenant_bytes(a.id()), store.tenant_bytes(b.id()));
    store.close().unwrap();
    let store = open(opts, c.clone());
    assert!(store.tenant_bytes(a.id()) >= ua);
    assert_eq!(store.tenant_bytes(b.id()), ub);
    store.check_index().unwrap();
    store.set_quotas([(a.id(), ua)].into());
    assert!(store.tenant_bytes(a.id()) <= ua);
    assert!(is_unit(&store, &a, mine.last().unwrap()));
    assert!(!is_unit(&store, &a, &us[0]));
    store.check_index().unwrap();
    // Deleting a unit releases its bytes.
    let gone = &mine[0];
    let ua = store.tenant_bytes(a.id());
    del(&store, &a, gone).unwrap().wait().unwrap();
    assert!(store.tenant_bytes(a.id()) < ua);
    store.check_index().unwrap();
}

/// A slot-based store whose every segment was freed (each slot's header page zeroed: what
/// freeing does) still holds its records' bytes. A store started over on it gets a new store
/// id, and its segment ids must never repeat the earlier life's, or the old records behind the
/// new segments' tails would read back as new ones (deleted or evicted units resurrected).
#[test]
fn a_store_started_over_on_used_slots_serves_nothing_of_the_earlier_one() {
    for device_file in [true, false] {
        if !device_file && !on_namespace() {
            continue;
        }
        let dir = TempDir::new("started-over");
        let c = clock();
        let t = Tenant::new("t");
        let mut opts = small_opts(dir.path());
        if device_file {
            let path = dir.path().join("store.img");
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(8 * opts.segment_bytes).unwrap();
            opts.location = StoreLocation::Device(path);
        }
        let old: Vec<Vec<u32>> = (0..12).map(|u| unit_tokens(50, u, 0, 6 * P)).collect();
        {
            let store = open(opts.clone(), c.clone());
            for u in &old {
                put(&store, &t, u).unwrap().wait().unwrap();
            }
            store.close().unwrap();
        }
        // Every slot freed.
        for slot in 0..8u64 {
            let at = slot * opts.segment_bytes;
            if device_file {
                let StoreLocation::Device(path) = &opts.location else {
                    unreachable!()
                };
                let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
                f.write_all_at(&[0u8; ALIGN], at).unwrap();
            } else {
                raw_write(dir.path(), at, &[0u8; ALIGN]);
            }
        }
        let new = unit_tokens(51, 0, 0, 2 * P);
        {
            let store = open(opts.clone(), c.clone());
            assert!(
                old.iter()
                    .all(|u| store.lookup(&model(), &t, u, P).tokens == 0),
                "the freed store's units are visible"
            );
            put(&store, &t, &new).unwrap().wait().unwrap();
            store.close().unwrap();
        }
        let report = fsck(&opts).unwrap();
        assert!(
            report.units_incomplete.is_empty() && report.units_complete == 1,
            "device file {device_file}: records of the earlier life read as new: {report:?}"
        );
        let store = open(opts.clone(), c.clone());
        let back: Vec<usize> = (0..old.len())
            .filter(|&i| store.lookup(&model(), &t, &old[i], P).tokens > 0)
            .collect();
        assert!(
            back.is_empty(),
            "device file {device_file}: units of the earlier life came back: {back:?}"
        );
        assert_eq!(read_and_check(&store, &t, &new).0, new.len() as u64);
        assert!(
            store.recovery().damaged.is_empty(),
            "{:?}",
            store.recovery().damaged
        );
    }
}
