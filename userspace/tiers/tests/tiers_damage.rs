//! Damage campaign: a store of small segments is written with `put_unit` (some units used
//! again, so they also have touch commits), closed, and its directory damaged at random: bit
//! flips anywhere (segment headers, record headers, payloads, commits), truncated files,
//! deleted files, a file copied under another segment's name, zeroed 4 KiB pages. Then:
//!
//! - opened read-only, then read-write: every unit is served intact (every byte equal to what
//!   was put; the store checks CRC, key and location) or is a miss; never wrong bytes, never a
//!   panic; both opens serve the same units, and the index checks out;
//! - `fsck` calls complete exactly the units the opens serve, and counts what recovery counts;
//! - a missing unit is never silent unless a whole file was deleted (nothing on disk can say a
//!   deleted file existed): `fsck` reports damage, a torn tail, an invalid segment or an
//!   incomplete unit;
//! - writing every unit again heals the store (also across a restart), and those writes never
//!   make old bytes reappear as new damage.
//!
//! With `KVSTACK_TIERS_IO=nvme-fake` (or `vfio:<pci-address>`) the stores live on an NVMe
//! namespace through the userspace NVMe engine, and the damage is done to the namespace's
//! bytes: bit flips as above, zeroed pages, a zeroed segment header page (a slot that looks
//! free: the namespace's "deleted file"), and the tail of a slot zeroed from a record on (its
//! "truncation"). Copies under another name and short files have no namespace equivalent; the
//! three named tests of the directory layout are skipped there (and say so).
//!
//! `KVSTACK_DAMAGE_CASES=N` runs N cases (default 24; each case is one seed, printed on
//! failure), e.g.
//! `KVSTACK_DAMAGE_CASES=500 cargo test -p kvstack-tiers --test tiers_damage -- --nocapture`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod tiers_common;

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvstack_firmware_interface::record::{ALIGN, Key, RecordHeader, RecordKind};
use kvstack_tiers::fsck::{FsckReport, fsck};
use kvstack_tiers::key::chain_keys;
use kvstack_tiers::{HOUR_MS, ManualClock, ReadOutcome, SsdStore, StoreOptions, Tenant};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tiers_common::*;

const DEFAULT_CASES: u64 = 24;

/// Segments of 64 KiB: a few dozen units spread over several of them.
fn damage_opts(dir: &Path) -> StoreOptions {
    let mut o = small_opts(dir);
    o.segment_bytes = 64 << 10;
    o.capacity_bytes = 64 * o.segment_bytes;
    o
}

/// Units of three families that share one or two whole blocks; every unit ends with a
/// partial block of its own (its length is never a multiple of `P`), so no unit is a prefix
/// of another and a unit is served whole exactly when its own commit is intact and complete.
fn campaign_units(rng: &mut StdRng, case: u64, n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|u| {
            let family = rng.random_range(0..3u32);
            let shared_blocks = 1 + family as usize % 2;
            let blocks = rng.random_range(shared_blocks..6);
            let len = blocks * P + 2 * rng.random_range(1..(P / 2));
            (0..len)
                .map(|i| {
                    if i < shared_blocks * P {
                        family * 1000 + i as u32
                    } else {
                        1_000_000 + (case as u32 % 1000) * 100_000 + u as u32 * 256 + i as u32
                    }
                })
                .collect()
        })
        .collect()
}

fn end_key(t: &Tenant, tokens: &[u32]) -> Key {
    *chain_keys(tokens, P, &model(), t).last().unwrap()
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs"))
        .collect();
    v.sort();
    v
}

/// Records of a segment file as written: (offset, kind, length), walking valid headers from
/// the first record.
fn records_of(path: &Path) -> Vec<(u64, RecordKind, u64)> {
    records_in(&std::fs::read(path).unwrap())
}

/// Records of a segment's bytes (see [`records_of`]).
fn records_in(bytes: &[u8]) -> Vec<(u64, RecordKind, u64)> {
    let mut out = Vec::new();
    let mut off = ALIGN;
    while off + ALIGN <= bytes.len() {
        let Ok(h) = RecordHeader::decode(&bytes[off..]) else {
            break;
        };
        out.push((off as u64, h.kind, h.record_len()));
        off += h.record_len() as usize;
    }
    out
}

/// An empty file, or one whose first two pages are zero (or absent): no header and no
/// record, what a crash leaves of a segment being created.
fn is_empty_segment(path: &Path) -> bool {
    let bytes = std::fs::read(path).unwrap();
    bytes.is_empty() || (bytes.len() >= ALIGN && bytes.iter().take(2 * ALIGN).all(|&b| b == 0))
}

fn segment_name(id: u64) -> String {
    format!("seg-{id:016x}.kvs")
}

fn flip(path: &Path, offset: u64, bit: u8) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    if f.read_exact_at(&mut b, offset).is_ok() {
        f.write_all_at(&[b[0] ^ (1 << bit)], offset).unwrap();
    }
}

/// Segment slots of a namespace store of `opts`: (slot, bytes) of every slot whose header
/// page is not zero.
fn used_slots(dir: &Path, opts: &StoreOptions) -> Vec<(u64, Vec<u8>)> {
    let seg = opts.segment_bytes;
    let slots = opts.capacity_bytes / seg;
    let all = raw_read(dir, 0, (slots * seg) as usize);
    (0..slots)
        .filter_map(|k| {
            let bytes = &all[(k * seg) as usize..((k + 1) * seg) as usize];
            bytes[..ALIGN]
                .iter()
                .any(|&b| b != 0)
                .then(|| (k, bytes.to_vec()))
        })
        .collect()
}

/// One random act of damage to a namespace store; returns its description and whether it
/// made a segment's slot look free (the namespace's deleted file).
fn damage_namespace_once(rng: &mut StdRng, dir: &Path, opts: &StoreOptions) -> (String, bool) {
    let used = used_slots(dir, opts);
    if used.is_empty() {
        return ("no segments left".into(), false);
    }
    let (slot, bytes) = &used[rng.random_range(0..used.len())];
    let base = slot * opts.segment_bytes;
    let size = bytes.len() as u64;
    let records = records_in(bytes);
    let written = records
        .last()
        .map_or(ALIGN as u64, |(off, _, len)| off + len);
    let flip = |off: u64, bit: u8| {
        raw_write(dir, base + off, &[bytes[off as usize] ^ (1 << bit)]);
    };
    match rng.random_range(0..8u32) {
        0 | 1 => {
            let off = rng.random_range(0..written.min(size).max(1));
            flip(off, rng.random_range(0..8));
            (format!("flip slot {slot} byte {off}"), false)
        }
        2 => {
            let (at, span) = match records.is_empty() || rng.random_bool(0.2) {
                true => (0, 128),
                false => (records[rng.random_range(0..records.len())].0, 256),
            };
            let off = at + rng.random_range(0..span);
            flip(off, rng.random_range(0..8));
            (format!("flip slot {slot} header byte {off}"), false)
        }
        3 => {
            let commits: Vec<_> = records
                .iter()
                .filter(|r| r.1 == RecordKind::Commit)
                .collect();
            if commits.is_empty() {
                return ("no commit to flip".into(), false);
            }
            let (off, _, len) = commits[rng.random_range(0..commits.len())];
            let at = if rng.random_bool(0.5) {
                off + rng.random_range(0..256)
            } else {
                off + ALIGN as u64 + rng.random_range(0..(len - ALIGN as u64).min(64))
            };
            flip(at, rng.random_range(0..8));
            (format!("flip slot {slot} commit byte {at}"), false)
        }
        // The slot's tail zeroed from a page on (a truncated file). Zeros are unwritten space
        // on a namespace, so records lost this way can vanish silently, as a deleted file's.
        4 => {
            let from = rng.random_range(1..size / ALIGN as u64) * ALIGN as u64;
            raw_write(dir, base + from, &vec![0u8; (size - from) as usize]);
            (format!("zero slot {slot} from byte {from}"), from < written)
        }
        // The header page zeroed: the slot looks free.
        5 => {
            raw_write(dir, base, &[0u8; ALIGN]);
            (format!("free slot {slot}"), true)
        }
        // A zeroed 4 KiB page (often a record header, sometimes the segment header).
        _ => {
            let pages = size.div_ceil(ALIGN as u64).max(1);
            let page = if !records.is_empty() && rng.random_bool(0.5) {
                records[rng.random_range(0..records.len())].0 / ALIGN as u64
            } else {
                rng.random_range(0..pages.min(written.div_ceil(ALIGN as u64) + 1))
            };
            raw_write(dir, base + page * ALIGN as u64, &[0u8; ALIGN]);
            (format!("zero slot {slot} page {page}"), page == 0)
        }
    }
}

/// One random act of damage; returns its description and whether it deleted a file.
fn damage_once(rng: &mut StdRng, dir: &Path) -> (String, bool) {
    if on_namespace() {
        return damage_namespace_once(rng, dir, &damage_opts(dir));
    }
    let files = segment_files(dir);
    if files.is_empty() {
        return ("no files left".into(), false);
    }
    let path = files[rng.random_range(0..files.len())].clone();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let size = std::fs::metadata(&path).unwrap().len();
    let records = records_of(&path);
    let written = records
        .last()
        .map_or(ALIGN as u64, |(off, _, len)| off + len);
    match rng.random_range(0..9u32) {
        // A bit anywhere in the written area (segment header, record headers, payloads).
        0 | 1 => {
            let off = rng.random_range(0..written.min(size).max(1));
            flip(&path, off, rng.random_range(0..8));
            (format!("flip {name} byte {off}"), false)
        }
        // A bit of a record header, or of the segment header.
        2 => {
            let (base, span) = match records.is_empty() || rng.random_bool(0.2) {
                true => (0, 128),
                false => (records[rng.random_range(0..records.len())].0, 256),
            };
            let off = base + rng.random_range(0..span);
            flip(&path, off, rng.random_range(0..8));
            (format!("flip {name} header byte {off}"), false)
        }
        // A bit of a commit (header or keys).
        3 => {
            let commits: Vec<_> = records
                .iter()
                .filter(|r| r.1 == RecordKind::Commit)
                .collect();
            if commits.is_empty() {
                return ("no commit to flip".into(), false);
            }
            let (off, _, len) = commits[rng.random_range(0..commits.len())];
            let at = if rng.random_bool(0.5) {
                off + rng.random_range(0..256)
            } else {
                off + ALIGN as u64 + rng.random_range(0..(len - ALIGN as u64).min(64))
            };
            flip(&path, at, rng.random_range(0..8));
            (format!("flip {name} commit byte {at}"), false)
        }
        // Truncation anywhere (page-aligned or not).
        4 => {
            let len = if rng.random_bool(0.5) {
                rng.random_range(0..=size / ALIGN as u64) * ALIGN as u64
            } else {
                rng.random_range(0..size)
            };
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(len).unwrap();
            (format!("truncate {name} to {len}"), false)
        }
        // A deleted file.
        5 => {
            std::fs::remove_file(&path).unwrap();
            (format!("delete {name}"), true)
        }
        // A copy under another segment's name: a new id, or over another file.
        6 => {
            let ids: Vec<u64> = files
                .iter()
                .filter_map(|p| {
                    let n = p.file_name()?.to_str()?;
                    u64::from_str_radix(n.strip_prefix("seg-")?.strip_suffix(".kvs")?, 16).ok()
                })
                .collect();
            let max = ids.iter().copied().max().unwrap_or(0);
            let target = match rng.random_range(0..3u32) {
                0 => max + rng.random_range(1..4),
                1 => (0..=max + 1).find(|i| !ids.contains(i)).unwrap_or(max + 1),
                _ => ids[rng.random_range(0..ids.len())],
            };
            let to = dir.join(segment_name(target));
            if to != path {
                std::fs::copy(&path, &to).unwrap();
            }
            // Overwriting another file loses that file's records: like a deletion.
            (
                format!("copy {name} to {}", segment_name(target)),
                ids.contains(&target) && to != path,
            )
        }
        // A zeroed 4 KiB page (often a record header, sometimes the segment header).
        _ => {
            let pages = size.div_ceil(ALIGN as u64).max(1);
            let page = if !records.is_empty() && rng.random_bool(0.5) {
                records[rng.random_range(0..records.len())].0 / ALIGN as u64
            } else {
                rng.random_range(0..pages.min(written.div_ceil(ALIGN as u64) + 1))
            };
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.write_all_at(&[0u8; ALIGN], page * ALIGN as u64).unwrap();
            f.set_len(size).unwrap();
            (format!("zero {name} page {page}"), false)
        }
    }
}

/// Which units `store` serves whole; asserts every delivered byte and that a lookup never
/// offers a block that then fails its checks (nothing changes on disk while it is open).
fn served(store: &SsdStore, t: &Tenant, units: &[Vec<u32>], what: &str) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for (i, u) in units.iter().enumerate() {
        let hit = store.lookup(&model(), t, u, P).tokens;
        let (n, outcome) = read_and_check(store, t, u);
        assert_eq!(
            outcome,
            ReadOutcome::Complete,
            "{what}: unit {i}: {outcome:?}"
        );
        assert_eq!(n, hit, "{what}: unit {i}");
        if n == u.len() as u64 {
            out.insert(i);
        }
    }
    out
}

fn unit_keys(store: &SsdStore) -> BTreeSet<Key> {
    store.units().into_iter().map(|(k, _, _)| k).collect()
}

/// Damage ranges of a report, by place.
fn places(r: &FsckReport) -> BTreeSet<(PathBuf, u64)> {
    r.damaged
        .iter()
        .chain(&r.torn)
        .map(|d| (d.path.clone(), d.offset))
        .collect()
}

fn run_case(case: u64) {
    let seed = 0xDA3A_6E00 ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = TempDir::new("damage-campaign");
    let opts = damage_opts(dir.path());
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let t = Tenant::new("damage");
    let n = rng.random_range(12..40);
    let units = campaign_units(&mut rng, case, n);
    let keys: Vec<Key> = units.iter().map(|u| end_key(&t, u)).collect();
    {
        let store = open(opts.clone(), clock.clone());
        for u in &units {
            put(&store, &t, u).unwrap().wait().unwrap();
        }
        // Some units are used again later: the close records those uses as touch commits, so
        // they have two commits (damage to one leaves the other).
        clock.advance(HOUR_MS);
        for u in units.iter().filter(|_| rng.random_bool(0.3)) {
            read_and_check(&store, &t, u);
        }
        store.close().unwrap();
    }
    let mut log = Vec::new();
    let mut deleted = false;
    for _ in 0..rng.random_range(1..=4) {
        let (what, del) = damage_once(&mut rng, dir.path());
        log.push(what);
        deleted |= del;
    }
    let ctx = format!("case {case} (seed {seed:#x}): {log:?}");

    // Read-only first: it must change nothing on disk.
    let before = fsck(&opts).unwrap();
    let ro_opts = StoreOptions {
        read_only: true,
        ..opts.clone()
    };
    let ro = open(ro_opts, clock.clone());
    ro.check_index().unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let ro_units = unit_keys(&ro);
    let ro_served = served(&ro, &t, &units, &format!("{ctx}, read-only"));
    drop(ro);
    let report = fsck(&opts).unwrap();
    assert_eq!(
        places(&before),
        places(&report),
        "{ctx}: the read-only open changed the store"
    );
    // Every segment file is accounted for: a valid segment, an invalid one (reported), or an
    // empty file (a segment created just before a crash, before its header was written). On a
    // namespace: every slot whose header page is not zero.
    let (listed, empty) = if on_namespace() {
        (used_slots(dir.path(), &opts).len() as u64, 0)
    } else {
        let files = segment_files(dir.path());
        let empty = files.iter().filter(|p| is_empty_segment(p)).count() as u64;
        (files.len() as u64, empty)
    };
    assert_eq!(
        listed - empty,
        report.segments + report.invalid_segments.len() as u64,
        "{ctx}: segment files unaccounted for (invalid: {:?})",
        report.invalid_segments
    );
    let complete: BTreeSet<Key> = report.complete_keys.iter().copied().collect();
    assert_eq!(ro_units, complete, "{ctx}: read-only open vs fsck");
    let served_keys: BTreeSet<Key> = ro_served.iter().map(|&i| keys[i]).collect();
    assert_eq!(served_keys, complete, "{ctx}: served vs fsck complete");
    if ro_served.len() < units.len() && !deleted {
        assert!(
            !report.clean() || !report.torn.is_empty() || !report.units_incomplete.is_empty(),
            "{ctx}: {} units missing and fsck reports nothing",
            units.len() - ro_served.len()
        );
    }

    // Read-write: the same units, and the same findings as fsck.
    let rw = open(opts.clone(), clock.clone());
    rw.check_index().unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let r = rw.recovery().clone();
    assert_eq!(unit_keys(&rw), complete, "{ctx}: read-write open vs fsck");
    assert_eq!(r.units, report.units_complete, "{ctx}");
    assert_eq!(
        r.units_discarded,
        report.units_incomplete.len() as u64,
        "{ctx}"
    );
    assert_eq!(r.damaged.len(), report.damaged.len(), "{ctx}");
    assert_eq!(r.torn_tail_ranges, report.torn.len() as u64, "{ctx}");
    assert_eq!(
        r.invalid_segments.len(),
        report.invalid_segments.len(),
        "{ctx}"
    );
    let rw_served = served(&rw, &t, &units, &format!("{ctx}, read-write"));
    assert_eq!(rw_served, ro_served, "{ctx}: read-write vs read-only");

    // Heal: every unit written again is served whole, also after a restart, and the new
    // writes add no damage of their own.
    for u in &units {
        put(&rw, &t, u).unwrap().wait().unwrap();
    }
    let all: BTreeSet<usize> = (0..units.len()).collect();
    assert_eq!(
        served(&rw, &t, &units, &format!("{ctx}, healed")),
        all,
        "{ctx}"
    );
    rw.check_index().unwrap_or_else(|e| panic!("{ctx}: {e}"));
    rw.close().unwrap();
    let healed = fsck(&opts).unwrap();
    // On a namespace, a freed slot that the healing writes reuse keeps its earlier life's
    // bytes after the new records, which the scan reports as a torn tail (discarded quietly,
    // never served): only damage counts there.
    let seen = |r: &FsckReport| {
        if on_namespace() {
            r.damaged
                .iter()
                .map(|d| (d.path.clone(), d.offset))
                .collect()
        } else {
            places(r)
        }
    };
    let new_damage: Vec<_> = seen(&healed).difference(&seen(&report)).cloned().collect();
    assert!(
        new_damage.is_empty(),
        "{ctx}: new damage after healing: {new_damage:?}"
    );
    let again = open(opts.clone(), clock.clone());
    again.check_index().unwrap_or_else(|e| panic!("{ctx}: {e}"));
    assert_eq!(
        served(&again, &t, &units, &format!("{ctx}, healed and reopened")),
        all,
        "{ctx}"
    );
    for k in &keys {
        assert!(unit_keys(&again).contains(k), "{ctx}");
    }
}

#[test]
fn damage_campaign_serves_intact_units_or_misses() {
    let cases = std::env::var("KVSTACK_DAMAGE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    let start = std::time::Instant::now();
    for case in 0..cases {
        run_case(case);
    }
    eprintln!(
        "{cases} damage cases in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

/// The cases of the campaign that found bugs (fixed; see the two tests below). Layouts depend
/// on the writer's timing, so a seed reproduces its bug often, not always: the named tests do.
#[test]
fn damage_campaign_regressions() {
    // 55: a segment copied under an unused, higher name was reused as a new segment, and its
    // old bytes read back as new damage. 59: a zeroed segment header made open delete the file
    // and fsck call the store clean.
    for case in [55, 59] {
        run_case(case);
    }
}

/// The directory layout's own damage (file names, file sizes): nothing to test on a namespace.
fn skip_on_namespace() -> bool {
    let skip = on_namespace();
    if skip {
        eprintln!("skipped: a segment-file test, and the stores are on an NVMe namespace");
    }
    skip
}

fn written_store(dir: &Path, clock: &Arc<ManualClock>, t: &Tenant) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(7);
    let units = campaign_units(&mut rng, 7, 30);
    let store = open(damage_opts(dir), clock.clone());
    for u in &units {
        put(&store, t, u).unwrap().wait().unwrap();
    }
    store.close().unwrap();
    units
}

#[test]
fn a_segment_copied_under_an_unused_name_is_never_reused() {
    if skip_on_namespace() {
        return;
    }
    let dir = TempDir::new("copied-segment");
    let opts = damage_opts(dir.path());
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let t = Tenant::new("damage");
    let units = written_store(dir.path(), &clock, &t);
    let files = segment_files(dir.path());
    let copy = dir.path().join(segment_name(files.len() as u64 + 2));
    std::fs::copy(&files[0], &copy).unwrap();
    let report = fsck(&opts).unwrap();
    assert_eq!(
        report.invalid_segments.len(),
        1,
        "{:?}",
        report.invalid_segments
    );
    // Enough new segments to pass the copy's id.
    let store = open(opts.clone(), clock.clone());
    let mut rng = StdRng::seed_from_u64(8);
    let more = campaign_units(&mut rng, 8, 30);
    for u in &more {
        put(&store, &t, u).unwrap().wait().unwrap();
    }
    store.close().unwrap();
    assert!(segment_files(dir.path()).len() > files.len() + 3);
    let after = fsck(&opts).unwrap();
    assert!(
        after.damaged.is_empty() && after.torn.is_empty(),
        "{:?}",
        after.damaged
    );
    assert_eq!(after.invalid_segments, report.invalid_segments);
    let store = open(opts, clock);
    let all: BTreeSet<usize> = (0..units.len()).collect();
    assert_eq!(served(&store, &t, &units, "original"), all);
    let all: BTreeSet<usize> = (0..more.len()).collect();
    assert_eq!(served(&store, &t, &more, "new"), all);
}

#[test]
fn a_zeroed_segment_header_is_reported_and_the_file_kept() {
    if skip_on_namespace() {
        return;
    }
    let dir = TempDir::new("zeroed-header");
    let opts = damage_opts(dir.path());
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let t = Tenant::new("damage");
    let units = written_store(dir.path(), &clock, &t);
    let files = segment_files(dir.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap();
    f.write_all_at(&[0u8; ALIGN], 0).unwrap();
    drop(f);
    let report = fsck(&opts).unwrap();
    assert!(!report.clean());
    assert_eq!(
        report.invalid_segments.len(),
        1,
        "{:?}",
        report.invalid_segments
    );
    assert!(report.invalid_segments[0].contains("zero"));
    let store = open(opts.clone(), clock);
    assert_eq!(store.recovery().invalid_segments.len(), 1);
    assert!(
        files[0].exists(),
        "open removed a segment that holds records"
    );
    let served = served(&store, &t, &units, "zeroed header");
    assert!(!served.is_empty() && served.len() < units.len());
    // A file of zeros (created just before a crash) is still removed.
    drop(store);
    let empty = dir.path().join(segment_name(99));
    std::fs::write(&empty, vec![0u8; 64 << 10]).unwrap();
    assert!(fsck(&opts).unwrap().invalid_segments.len() == 1);
    drop(open(opts, Arc::new(ManualClock::new(1_700_000_000_000))));
    assert!(!empty.exists());
}

/// Found by the crash campaign: a SIGKILL between creating a segment file and preallocating it
/// leaves an empty file, which fsck reported as an invalid segment.
#[test]
fn an_empty_segment_file_is_a_crash_leftover_and_a_short_one_is_damage() {
    if skip_on_namespace() {
        return;
    }
    let dir = TempDir::new("empty-segment");
    let opts = damage_opts(dir.path());
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let t = Tenant::new("damage");
    let units = written_store(dir.path(), &clock, &t);
    let empty = dir.path().join(segment_name(90));
    std::fs::write(&empty, []).unwrap();
    let report = fsck(&opts).unwrap();
    assert!(report.clean(), "{:?}", report.invalid_segments);
    drop(open(opts.clone(), clock.clone()));
    assert!(!empty.exists(), "a read-write open removes the leftover");
    // 1 to 4095 bytes: no crash leaves that (preallocation sizes a file whole).
    let short = dir.path().join(segment_name(91));
    std::fs::write(&short, [7u8; 100]).unwrap();
    let report = fsck(&opts).unwrap();
    assert_eq!(
        report.invalid_segments.len(),
        1,
        "{:?}",
        report.invalid_segments
    );
    let store = open(opts, clock);
    assert!(short.exists());
    let all: BTreeSet<usize> = (0..units.len()).collect();
    assert_eq!(served(&store, &t, &units, "with leftovers"), all);
}
