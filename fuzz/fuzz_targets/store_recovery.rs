//! Recovery of the SSD store from arbitrary files: the input is a store image
//! (`kvstack_fuzz::image`, seeds written by a real `SsdStore`), written into a fresh
//! directory, then opened read-only, checked with `fsck` and `inspect`, opened read-write and
//! closed, and opened read-only again. After each open every unit the store reports and every
//! unit of the seed store is looked up and read.
//!
//! What must hold besides "no panic": every block the store serves is the KV part of a record
//! on disk that passes its header and payload CRCs, with the requested key, the served header
//! and the served length; a read's outcome matches what it delivered; and a block of the seed
//! store is served with exactly the bytes its writer produced unless the record on disk carries
//! another payload CRC (then it is a different, valid record: CRC fix-ups or a copy).
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::Path;

use kvstack_firmware_interface::record::{
    ALIGN, Key, RecordHeader, RecordKind, commit_keys, crc32c,
};
use kvstack_fuzz::image::Image;
use kvstack_fuzz::{P, ScratchDir, block_kv, clock, model, store_options, tenants, units};
use kvstack_tiers::key::{block_key, chain_keys, root_key};
use kvstack_tiers::{ReadOutcome, SsdStore, StoreOptions};
use libfuzzer_sys::fuzz_target;

/// A record's header and payload.
type Record = (RecordHeader, Vec<u8>);

/// Every valid record on disk, found by an independent scan at every 4 KiB boundary of every
/// store file (a superset of what the store's own scan accepts).
#[derive(Default)]
struct DiskRecords {
    /// (segment, seq) -> (header, payload) of valid blocks.
    blocks: HashMap<(u64, u64), Vec<Record>>,
    /// unit key -> (seq, keys) of the newest valid commit.
    commits: HashMap<Key, (u64, Vec<Key>)>,
    /// Keys of valid blocks, in file order (for single-block reads).
    block_keys: Vec<Key>,
}

fn scan_disk(dir: &Path) -> DiskRecords {
    let mut d = DiskRecords::default();
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for path in names {
        let bytes = std::fs::read(&path).unwrap();
        let mut p = 0usize;
        while p + RecordHeader::BYTES <= bytes.len() {
            if let Ok(h) = RecordHeader::decode(&bytes[p..]) {
                let start = p + ALIGN;
                let payload = start
                    .checked_add(h.payload_len as usize)
                    .and_then(|end| bytes.get(start..end));
                if let Some(payload) = payload
                    && h.verify_payload(payload).is_ok()
                {
                    match h.kind {
                        RecordKind::Block => {
                            d.block_keys.push(h.key);
                            d.blocks
                                .entry((h.segment, h.seq))
                                .or_default()
                                .push((h, payload.to_vec()));
                        }
                        RecordKind::Commit => {
                            let newer = d.commits.get(&h.key).is_none_or(|(s, _)| *s < h.seq);
                            if newer {
                                d.commits
                                    .insert(h.key, (h.seq, commit_keys(payload).collect()));
                            }
                        }
                        // A tombstone only hides units from lookups; every block the store
                        // serves must still be a valid record on disk, which is all this
                        // scan is for.
                        RecordKind::Delete => {}
                    }
                }
            }
            p += ALIGN;
        }
    }
    d
}

/// What a valid writer put in the seed store for a block: its KV bytes, token count, payload
/// length and payload CRC.
struct Expected {
    kv: Vec<u8>,
    tokens: u32,
    payload_len: u64,
    crc: u32,
}

/// Reads `keys` and checks every served block (target docs). Returns the blocks delivered.
fn read_checked(
    store: &SsdStore,
    dir: &Path,
    disk: &mut DiskRecords,
    keys: &[Key],
    expected: Option<&[Expected]>,
) -> usize {
    let mut delivered = 0usize;
    let outcome = store.read_blocks(keys, |i, h, kv| {
        assert_eq!(i, delivered, "blocks delivered out of order");
        assert_eq!(h.key, keys[i], "served block {i} has another key");
        assert_eq!(h.kind, RecordKind::Block);
        // The store may have written records since the last scan (touches, compaction).
        let found = |d: &DiskRecords| {
            d.blocks.get(&(h.segment, h.seq)).is_some_and(|v| {
                v.iter().any(|(dh, payload)| {
                    dh == h
                        && payload.len() >= 4 * h.tokens as usize
                        && kv == &payload[..payload.len() - 4 * h.tokens as usize]
                })
            })
        };
        if !found(disk) {
            *disk = scan_disk(dir);
        }
        assert!(
            found(disk),
            "served block {i} (segment {} seq {}, {} bytes) is not the KV of a valid record on disk",
            h.segment,
            h.seq,
            kv.len()
        );
        // A header that describes the writer's payload (same CRC, length and token split) must
        // come with the writer's bytes; any other header is another valid record (a CRC
        // fix-up of the input), only held to the checks above.
        if let Some(e) = expected.and_then(|e| e.get(i))
            && (h.payload_crc, h.payload_len, h.tokens) == (e.crc, e.payload_len, e.tokens)
        {
            assert_eq!(kv, e.kv.as_slice(), "seed block {i} served with other bytes");
        }
        delivered += 1;
        Ok(())
    });
    let outcome = outcome.unwrap();
    match outcome {
        ReadOutcome::Complete => assert_eq!(delivered, keys.len()),
        ReadOutcome::Miss { at } | ReadOutcome::Damaged { at } => {
            assert_eq!(delivered, at);
            assert!(at < keys.len());
        }
    }
    delivered
}

/// Looks up and reads every unit the store reports and every unit of the seed store.
fn exercise(store: &SsdStore, dir: &Path) {
    let mut disk = scan_disk(dir);
    let rec = store.recovery();
    assert!(rec.blocks >= rec.units.min(1), "units without blocks");
    // Units the store reports: their chains come from the commits on disk.
    let reported = store.units();
    for (end, _tokens, _) in reported.iter().take(32) {
        if let Some((_, keys)) = disk.commits.get(end).cloned() {
            read_checked(store, dir, &mut disk, &keys, None);
        }
    }
    // Single blocks: damaged, stale and shadowed records among them.
    let singles: Vec<Key> = disk.block_keys.iter().take(32).copied().collect();
    for k in singles {
        read_checked(store, dir, &mut disk, &[k], None);
    }
    // The seed store's units, through lookups, checked against what the writer produced.
    let m = model();
    let tenants = tenants();
    for (t, tokens) in units() {
        let tenant = &tenants[t];
        let hit = store.lookup(&m, tenant, &tokens, P);
        assert_eq!(hit.keys.len(), hit.block_tokens.len());
        assert!(hit.tokens <= tokens.len() as u64);
        assert_eq!(
            hit.tokens,
            hit.block_tokens.iter().map(|&n| u64::from(n)).sum::<u64>()
        );
        let full = chain_keys(&tokens[..tokens.len() / P * P], P, &m, tenant);
        let mut first = 0usize;
        let mut parent = root_key(&m, tenant);
        let mut expected = Vec::new();
        for (i, (&k, &n)) in hit.keys.iter().zip(&hit.block_tokens).enumerate() {
            let n = n as usize;
            assert!((1..=P).contains(&n) && first + n <= tokens.len());
            let block = &tokens[first..first + n];
            let want = block_key(&parent, block, &m, tenant);
            assert_eq!(
                k, want,
                "lookup returned block {i} with a key of other tokens"
            );
            if n == P {
                assert_eq!(Some(&k), full.get(i));
            }
            let kv = block_kv(&tokens, first, n, tenant);
            let mut payload = kv.clone();
            for t in block {
                payload.extend_from_slice(&t.to_le_bytes());
            }
            expected.push(Expected {
                kv,
                tokens: n as u32,
                payload_len: payload.len() as u64,
                crc: crc32c(&payload),
            });
            parent = k;
            first += n;
        }
        read_checked(store, dir, &mut disk, &hit.keys, Some(&expected));
    }
}

fn open(opts: &StoreOptions) -> Option<SsdStore> {
    SsdStore::open(opts.clone(), clock()).ok()
}

fuzz_target!(|data: &[u8]| {
    let image = Image::parse(data);
    let scratch = ScratchDir::new("store");
    let dir = scratch.path();
    image.write_to(dir).unwrap();
    let layout = image.layout();
    let seg = image.segment_bytes();
    let ro = store_options(dir, layout, seg, true);

    if let Some(store) = open(&ro) {
        exercise(&store, dir);
        drop(store);
    }
    let _ = kvstack_tiers::fsck::fsck(&ro);
    let _ = kvstack_tiers::fsck::inspect(&ro, true);

    if image.write() {
        let rw = store_options(dir, layout, seg, false);
        if let Some(store) = open(&rw) {
            exercise(&store, dir);
            let _ = store.flush();
            let _ = store.close();
        }
        // What the read-write session left (touch commits, compaction) reads back clean.
        if let Some(store) = open(&ro) {
            exercise(&store, dir);
        }
    }
});
