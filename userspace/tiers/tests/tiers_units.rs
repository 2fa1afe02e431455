//! Prefix units over a real V4.1-Flash paged cache: persist, look up, restore bit-identical
//! (global entries, indexer keys, window rows), the window snapshot and its TTL, the bounded
//! replay plan on a global hit without a snapshot, mapping from the cache's own prefix index,
//! and the unit schedule.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/redis_cluster.rs"]
mod redis_cluster;
mod tiers_common;

use std::sync::Arc;

use kvstack_cache::{AppendData, CacheOptions, KvCache, SequenceId};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use kvstack_spec::builtin::default_config;
use kvstack_tiers::unit::ReplayPlan;
use kvstack_tiers::window_pool::DEFAULT_TTL_MS;
use kvstack_tiers::{
    ManualClock, PoolOptions, RedisOptions, StoreHooks, StoreLocation, StoreOptions, Tenant,
    TierOptions, Tiers,
};
use tiers_common::{MEM, TempDir};
use zerocopy::{FromBytes, IntoBytes};

fn cache() -> KvCache {
    KvCache::for_config(
        &default_config().unwrap(),
        CacheOptions {
            context_limit: 4096,
            max_sequences: 4,
            memory: MEM,
            ..CacheOptions::default()
        },
    )
    .unwrap()
}

fn tiers(dir: &std::path::Path, clock: Arc<ManualClock>) -> Tiers {
    tiers_with(dir, clock, None)
}

fn tiers_with(
    dir: &std::path::Path,
    clock: Arc<ManualClock>,
    remote: Option<RedisOptions>,
) -> Tiers {
    tiers_hooked(dir, clock, remote, None)
}

fn tiers_hooked(
    dir: &std::path::Path,
    clock: Arc<ManualClock>,
    remote: Option<RedisOptions>,
    hooks: Option<Arc<dyn StoreHooks>>,
) -> Tiers {
    let mut store = StoreOptions::new(StoreLocation::Directory(dir.to_path_buf()));
    store.segment_bytes = 8 << 20;
    store.capacity_bytes = 8 * store.segment_bytes;
    store.memory = MEM;
    store.hooks = hooks;
    let mut pool = PoolOptions::new(1);
    pool.capacity_bytes = Some(64 << 20);
    pool.memory = MEM;
    let opts = TierOptions {
        store,
        pool,
        remote,
        ..TierOptions::new(StoreOptions::new(StoreLocation::Directory(
            dir.to_path_buf(),
        )))
    };
    Tiers::open(&default_config().unwrap(), 256, opts, clock).unwrap()
}

fn byte(pos: u64, layer: usize, kind: u64, i: usize, salt: u64) -> u8 {
    (pos.wrapping_mul(31) ^ (layer as u64) << 3 ^ kind << 7 ^ i as u64 ^ salt) as u8
}

/// Appends `tokens[from..to]` to `seq` with entries that are a function of position, layer
/// and kind, and window rows for the chunk's last tokens.
fn grow(c: &mut KvCache, seq: SequenceId, tokens: &[u32], from: usize, to: usize, salt: u64) {
    let g = c.geometry().clone();
    let mut global = Vec::new();
    let mut index = Vec::new();
    let mut pending = Vec::new();
    for s in &g.sources {
        let r = s.ratio as u64;
        let (a, b) = (from as u64 / r, to as u64 / r);
        global.push(
            (a..b)
                .map(|j| {
                    let v: Vec<u8> = (0..288).map(|i| byte(j, s.layer, 0, i, salt)).collect();
                    GlobalFp4Entry::read_from_bytes(&v).unwrap()
                })
                .collect::<Vec<_>>(),
        );
        index.push(
            (a..b)
                .map(|j| {
                    let v: Vec<u8> = (0..68).map(|i| byte(j, s.layer, 1, i, salt)).collect();
                    IndexMxfp4Entry::read_from_bytes(&v).unwrap()
                })
                .collect::<Vec<_>>(),
        );
        let n = (to as u64 % r) as usize * g.pending_token_floats;
        pending.push(
            (0..n)
                .map(|i| (i as f32) + salt as f32)
                .collect::<Vec<f32>>(),
        );
    }
    let k = (to - from).min(g.window_tokens);
    let mut window = Vec::new();
    for l in 0..g.num_layers {
        for p in to - k..to {
            let v: Vec<u8> = (0..528).map(|i| byte(p as u64, l, 2, i, salt)).collect();
            window.push(WindowFp8Entry::read_from_bytes(&v).unwrap());
        }
    }
    c.append(
        seq,
        &AppendData {
            tokens: &tokens[from..to],
            global: global.iter().map(Vec::as_slice).collect(),
            index: index.iter().map(Vec::as_slice).collect(),
            window: &window,
            pending: pending.iter().map(Vec::as_slice).collect(),
        },
    )
    .unwrap();
}

fn build(c: &mut KvCache, tokens: &[u32], salt: u64) -> SequenceId {
    let seq = c.create_sequence().unwrap();
    let mut at = 0;
    while at < tokens.len() {
        let to = (at + 300).min(tokens.len());
        grow(c, seq, tokens, at, to, salt);
        at = to;
    }
    seq
}

/// Every global entry and indexer key of the first `n` tokens equal; window rows too.
fn same(a: &KvCache, sa: SequenceId, b: &KvCache, sb: SequenceId, window: bool) {
    let n = b.len(sb).unwrap();
    for s in &a.geometry().sources {
        let (ga, gb) = (
            a.global_entries(sa, s.layer).unwrap(),
            b.global_entries(sb, s.layer).unwrap(),
        );
        assert_eq!(gb.len(), n / u64::from(s.ratio));
        for j in 0..gb.len() {
            assert_eq!(ga.get(j).unwrap().as_bytes(), gb.get(j).unwrap().as_bytes());
        }
        let (ia, ib) = (
            a.index_keys(sa, s.layer).unwrap(),
            b.index_keys(sb, s.layer).unwrap(),
        );
        for j in 0..ib.len() {
            assert_eq!(ia.get(j).unwrap().as_bytes(), ib.get(j).unwrap().as_bytes());
        }
    }
    if window {
        for l in 0..a.geometry().num_layers {
            let (wa, wb) = (a.window(sa, l).unwrap(), b.window(sb, l).unwrap());
            assert_eq!(wb.range(), wa.range());
            for p in wb.range() {
                assert_eq!(wa.get(p).unwrap().as_bytes(), wb.get(p).unwrap().as_bytes());
            }
        }
    }
}

#[test]
fn persist_lookup_restore_with_window_snapshot_then_replay_after_ttl() {
    let dir = TempDir::new("units");
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let tiers = tiers(dir.path(), clock.clone());
    let tenant = Tenant::new("acme");
    let tokens: Vec<u32> = (0..1000).map(|i| i * 7 + 1).collect();
    let mut src = cache();
    let seq = build(&mut src, &tokens, 3);
    tiers
        .persist(&src, seq, &tenant, 1000)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        tiers.persist(&src, seq, &tenant, 1001).is_err(),
        "a unit past the sequence's end is refused"
    );

    // A request that extends the prompt hits the whole unit, with its window.
    let mut request = tokens.clone();
    request.extend([5, 6, 7]);
    let hit = tiers.lookup(&request, &tenant);
    assert_eq!((hit.tokens, hit.window), (1000, true));
    assert_eq!(tiers.lookup(&request, &Tenant::new("other")).tokens, 0);

    let mut dst = cache();
    let r = tiers.restore(&mut dst, &request, &hit).unwrap();
    assert_eq!(
        (r.tokens, r.read_tokens, r.window, r.replay),
        (1000, 1000, true, None)
    );
    same(&src, seq, &dst, r.seq, true);
    assert_eq!(dst.tokens(r.seq).unwrap(), tokens);

    // After the TTL the snapshot is gone: a global hit, and the plan for bounded replay.
    clock.advance(DEFAULT_TTL_MS);
    let hit = tiers.lookup(&request, &tenant);
    assert_eq!((hit.tokens, hit.window), (1000, false));
    let r = tiers.restore(&mut dst, &request, &hit).unwrap();
    assert!(!r.window);
    assert_eq!(
        r.replay,
        Some(ReplayPlan {
            start: 872,
            end: 1000
        })
    );
    // The cache's own prefix index held the three whole blocks: only the tail was read.
    assert_eq!((r.mapped_tokens, r.read_tokens), (768, 232));
    same(&src, seq, &dst, r.seq, false);
    tiers.close().unwrap();
    let report = kvstack_tiers::fsck::fsck(&StoreOptions {
        memory: MEM,
        ..StoreOptions::new(StoreLocation::Directory(dir.path().to_path_buf()))
    })
    .unwrap();
    assert!(
        report.clean() && report.units_incomplete.is_empty(),
        "{report:?}"
    );

    // Units survive a restart.
    let tiers2 = self::tiers(dir.path(), clock.clone());
    let hit = tiers2.lookup(&request, &tenant);
    assert_eq!(hit.tokens, 1000);
    let mut fresh = cache();
    let r = tiers2.restore(&mut fresh, &request, &hit).unwrap();
    same(&src, seq, &fresh, r.seq, false);
}

#[test]
fn interval_units_share_blocks_with_the_final_one() {
    let dir = TempDir::new("units-interval");
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let tiers = tiers(dir.path(), clock);
    assert_eq!(tiers.unit_points(0, 10_000, true), [4096, 8192, 10_000]);
    assert_eq!(tiers.unit_points(4000, 4100, false), [4096]);
    // A turn ends where it ends: its snapshot holds the trailing group's compressor state.
    assert_eq!(tiers.unit_points(0, 1001, true), [1001]);
    assert_eq!(tiers.unit_points(0, 4096, true), [4096]);
    let tenant = Tenant::new("t");
    let tokens: Vec<u32> = (0..2600).map(|i| i ^ 0x55).collect();
    let mut src = cache();
    let seq = build(&mut src, &tokens, 9);
    // A long input persisted at 1024 and at its end: the second unit writes only new blocks.
    let a = tiers.persist(&src, seq, &tenant, 1024).unwrap();
    assert_eq!(a.new_blocks, 4);
    a.wait().unwrap();
    let b = tiers.persist(&src, seq, &tenant, 2600).unwrap();
    assert_eq!((b.shared_blocks, b.new_blocks), (4, 7));
    b.wait().unwrap();
    assert_eq!(tiers.lookup(&tokens[..2000], &tenant).tokens, 1792);
    assert_eq!(tiers.lookup(&tokens, &tenant).tokens, 2600);
    let mut dst = cache();
    let hit = tiers.lookup(&tokens, &tenant);
    let r = tiers.restore(&mut dst, &tokens, &hit).unwrap();
    assert!(r.window);
    same(&src, seq, &dst, r.seq, true);
}

#[test]
fn units_as_bytes_round_trip_between_tenants_and_bad_shapes_are_refused() {
    let dir = TempDir::new("units-bytes");
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let tiers = tiers(dir.path(), clock.clone());
    let (a, b) = (Tenant::new("a"), Tenant::new("b"));
    let tokens: Vec<u32> = (0..1000).map(|i| i * 3 + 2).collect();
    let mut src = cache();
    let seq = build(&mut src, &tokens, 9);
    tiers.persist(&src, seq, &a, 1000).unwrap().wait().unwrap();

    // Read tenant a's unit as bytes: 4 blocks (3 of 256, one of 232) with the window.
    let hit = tiers.lookup(&tokens, &a);
    let data = tiers.read_unit(&tokens, &hit).unwrap().unwrap();
    assert_eq!(data.tokens, 1000);
    assert_eq!(data.blocks.len(), 4);
    assert_eq!(data.blocks[0].len(), (3 * 128 + 256) * (288 + 68));
    assert_eq!(data.blocks[3].len(), (3 * 116 + 232) * (288 + 68));
    assert!(data.window.is_some());
    // The same bytes through a sink, block by block in order.
    let mut flat = Vec::new();
    let read = tiers
        .read_unit_with(&tokens, &hit, |i, kv| {
            assert_eq!(kv, data.blocks[i], "block {i}");
            flat.extend_from_slice(kv);
            Ok(())
        })
        .unwrap()
        .unwrap();
    assert_eq!((read.tokens, read.blocks), (1000, 4));
    assert_eq!(read.payload_bytes, data.payload_bytes());
    assert_eq!(flat, data.blocks.concat());
    assert_eq!(read.window, data.window);
    // Tenant b sees nothing of it...
    assert_eq!(tiers.lookup(&tokens, &b).tokens, 0);
    assert!(
        tiers
            .read_unit(&tokens, &tiers.lookup(&tokens, &b))
            .unwrap()
            .is_none()
    );

    // ...until it stores the same bytes itself; then it restores the same KV.
    tiers
        .write_unit(&b, &tokens, &data)
        .unwrap()
        .wait()
        .unwrap();
    let hit_b = tiers.lookup(&tokens, &b);
    assert_eq!((hit_b.tokens, hit_b.window), (1000, true));
    assert_eq!(tiers.read_unit(&tokens, &hit_b).unwrap().unwrap(), data);
    let mut dst = cache();
    let mut request = tokens.clone();
    request.push(1);
    let r = tiers.restore(&mut dst, &request, &hit_b).unwrap();
    assert_eq!((r.tokens, r.window), (1000, true));
    same(&src, seq, &dst, r.seq, true);

    // Every wrong shape is refused before anything is stored.
    let c = Tenant::new("c");
    let refused = |d: &kvstack_tiers::UnitData, t: &[u32]| {
        let e = tiers.write_unit(&c, t, d).unwrap_err().to_string();
        assert_eq!(tiers.lookup(t, &c).tokens, 0, "{e}");
        e
    };
    let mut short = data.clone();
    short.blocks[2].pop();
    assert!(refused(&short, &tokens).contains("block 2"));
    let mut fewer = data.clone();
    fewer.blocks.pop();
    assert!(refused(&fewer, &tokens).contains("3 blocks given"));
    let mut mismatched = data.clone();
    mismatched.tokens = 999;
    assert!(refused(&mismatched, &tokens).contains("does not fit"));
    let mut long_window = data.clone();
    long_window.window.as_mut().unwrap().push(0);
    assert!(refused(&long_window, &tokens).contains("window snapshot"));
    // A window taken at another length does not belong to this unit.
    let tokens_998 = &tokens[..998];
    let mut other = data.clone();
    other.tokens = 998;
    other.blocks[3].truncate((3 * 115 + 230) * (288 + 68));
    assert!(refused(&other, tokens_998).contains("window snapshot"));
    other.window = None;
    tiers
        .write_unit(&c, tokens_998, &other)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(tiers.lookup(tokens_998, &c).tokens, 998);
}

#[test]
fn a_unit_may_end_inside_a_compress_group_and_comes_back_whole_with_its_window() {
    let dir = TempDir::new("units-odd");
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let tiers = tiers(dir.path(), clock.clone());
    let tenant = Tenant::new("acme");
    // 777 tokens: the ratio-2 sources hold 388 entries and one pending token each.
    let tokens: Vec<u32> = (0..777).map(|i| i * 5 + 3).collect();
    let mut src = cache();
    let seq = build(&mut src, &tokens, 4);
    assert!(src.pending(seq, 2).unwrap().is_some_and(|p| !p.is_empty()));
    tiers
        .persist(&src, seq, &tenant, 777)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(tiers.unit_points(700, 777, true), vec![777]);

    let mut request = tokens.clone();
    request.push(9);
    let hit = tiers.lookup(&request, &tenant);
    assert_eq!((hit.tokens, hit.window), (777, true));
    let mut dst = cache();
    let r = tiers.restore(&mut dst, &request, &hit).unwrap();
    assert_eq!((r.tokens, r.window, r.replay), (777, true, None));
    same(&src, seq, &dst, r.seq, true);
    for s in src.geometry().sources.iter().filter(|s| s.ratio > 1) {
        assert_eq!(
            src.pending(seq, s.layer).unwrap(),
            dst.pending(r.seq, s.layer).unwrap(),
            "pending state of layer {}",
            s.layer
        );
    }

    // Without the snapshot (TTL) only the prefix up to the group boundary comes back, and the
    // window is replayed from there.
    clock.advance(DEFAULT_TTL_MS);
    let hit = tiers.lookup(&request, &tenant);
    assert_eq!((hit.tokens, hit.window), (777, false));
    let r = tiers.restore(&mut dst, &request, &hit).unwrap();
    assert_eq!(r.tokens, 776);
    assert_eq!(
        r.replay,
        Some(ReplayPlan {
            start: 648,
            end: 776
        })
    );
    same(&src, seq, &dst, r.seq, false);
    assert!(dst.pending(r.seq, 2).unwrap().is_none_or(<[f32]>::is_empty));
}

/// Two nodes (two stores, two DRAM pools) sharing one Redis Cluster: node B holds the unit's
/// global KV (copied as bytes, without its window) and restores the window node A put into
/// Redis, bit for bit; with the DRAM level off, B keeps nothing locally; another tenant
/// never sees it.
#[test]
fn a_second_node_restores_the_window_from_redis() {
    let Some(cluster) = redis_cluster::RedisCluster::start() else {
        return;
    };
    let (da, db) = (TempDir::new("node-a"), TempDir::new("node-b"));
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let mut remote = RedisOptions::new(cluster.urls());
    remote.key_prefix = "units:".into();
    remote.node_id = Some("node-a".into());
    let a = tiers_with(da.path(), clock.clone(), Some(remote.clone()));
    remote.local_level = false;
    remote.node_id = Some("node-b".into());
    let b = tiers_with(db.path(), clock.clone(), Some(remote));
    let tenant = Tenant::new("acme");
    let tokens: Vec<u32> = (0..1000).map(|i| i * 5 + 3).collect();
    let mut src = cache();
    let seq = build(&mut src, &tokens, 4);
    a.persist(&src, seq, &tenant, 1000).unwrap().wait().unwrap();
    assert_eq!(a.remote().unwrap().stats().puts, 1);
    // Indexed once durable, by A's index thread.
    a.flush_index();

    // The shared prefix index tells B that node-a holds the 1000 tokens (4 blocks of 256,
    // the last partial), also for a longer request, and for a request that shares only the
    // first two blocks; nothing for another tenant.
    let mut longer = tokens.clone();
    longer.extend([1, 2, 3]);
    let ix = b.cluster_lookup(&tokens, &tenant).unwrap();
    assert_eq!(
        (ix.blocks, ix.entry.node.as_str(), ix.entry.unit_tokens),
        (4, "node-a", 1000)
    );
    assert_eq!(b.cluster_lookup(&longer, &tenant).unwrap().blocks, 3);
    let mut diverging = tokens[..600].to_vec();
    diverging.push(77);
    assert_eq!(b.cluster_lookup(&diverging, &tenant).unwrap().blocks, 2);
    assert_eq!(b.cluster_lookup(&tokens, &Tenant::new("other")), None);

    // B gets the global KV as bytes (what the KV-cache API carries), not the window.
    let hit = a.lookup(&tokens, &tenant);
    let mut data = a.read_unit(&tokens, &hit).unwrap().unwrap();
    assert!(data.window.take().is_some());
    b.write_unit(&tenant, &tokens, &data)
        .unwrap()
        .wait()
        .unwrap();
    b.flush_index();
    assert_eq!(b.pool().stats().entries, 0);
    // Now B holds it too: the last writer's entry wins.
    assert_eq!(
        b.cluster_lookup(&tokens, &tenant).unwrap().entry.node,
        "node-b"
    );

    let mut request = tokens.clone();
    request.push(9);
    let hit = b.lookup(&request, &tenant);
    assert_eq!((hit.tokens, hit.window), (1000, true));
    let mut dst = cache();
    let r = b.restore(&mut dst, &request, &hit).unwrap();
    assert_eq!(
        (r.tokens, r.window, r.window_remote, r.replay),
        (1000, true, true, None)
    );
    same(&src, seq, &dst, r.seq, true);
    // With its DRAM level off, B kept no copy; A's own restores come from its DRAM level.
    assert_eq!(b.pool().stats().entries, 0);
    assert_eq!(b.remote().unwrap().stats().hits, 1);
    let hit = a.lookup(&request, &tenant);
    let mut dst2 = cache();
    let r = a.restore(&mut dst2, &request, &hit).unwrap();
    assert_eq!((r.window, r.window_remote), (true, false));

    // Another tenant with the same tokens and blocks finds no window (its own keys).
    let other = Tenant::new("other");
    b.write_unit(&other, &tokens, &data)
        .unwrap()
        .wait()
        .unwrap();
    let hit = b.lookup(&request, &other);
    assert_eq!((hit.tokens, hit.window), (1000, false));

    // A delete on B drops the snapshot from Redis too: A, which still has it in DRAM, is
    // unaffected, but a third node would find none.
    b.delete_unit(&tenant, &tokens).unwrap().wait().unwrap();
    b.flush_index();
    // B's entries are gone; A's were overwritten by B's, so the index has none (a stale
    // answer would only cost a miss at the peer).
    assert_eq!(b.cluster_lookup(&tokens, &tenant), None);
    let hit = a.lookup(&request, &tenant);
    assert!(hit.window);
    let mut out = Vec::new();
    let model = *a.model();
    let key = hit.key().unwrap();
    let id = kvstack_tiers::redis_pool::SnapshotId {
        tenant: tenant.id(),
        model: &model,
        key: &key,
    };
    assert!(!a.remote().unwrap().get(id, &mut out));
}

/// A syncer that waits while the gate is closed: units are queued and written, not durable.
#[derive(Debug, Default)]
struct Gate {
    closed: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }
}

impl StoreHooks for Gate {
    fn before_sync(&self) {
        let mut c = self.closed.lock().unwrap();
        while *c {
            c = self.opened.wait(c).unwrap();
        }
    }
}

/// The shared prefix index follows the SSD (docs/cluster.md): an entry appears only once its
/// unit is durable (not while it is queued), goes when the unit is evicted (its tenant's
/// quota) or deleted, stays for blocks a longer unit of the node still holds, and is never
/// removed where it names another node.
#[test]
fn index_entries_follow_durability_eviction_and_deletes() {
    let Some(cluster) = redis_cluster::RedisCluster::start() else {
        return;
    };
    let (da, db) = (TempDir::new("ix-a"), TempDir::new("ix-b"));
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let mut remote = RedisOptions::new(cluster.urls());
    remote.key_prefix = "ix:".into();
    remote.node_id = Some("node-a".into());
    let gate = Arc::new(Gate::default());
    let a = tiers_hooked(
        da.path(),
        clock.clone(),
        Some(remote.clone()),
        Some(gate.clone()),
    );
    remote.node_id = Some("node-b".into());
    let b = tiers_with(db.path(), clock.clone(), Some(remote));
    let tenant = Tenant::new("acme");
    let node_of = |t: &Tiers, tokens: &[u32]| {
        t.cluster_lookup(tokens, &tenant)
            .map(|h| (h.blocks, h.entry.node, h.entry.unit_tokens))
    };

    // Queued, written, not durable (the syncer is held): no entry, also after the index
    // thread has handled everything queued.
    let u1: Vec<u32> = (0..600).map(|i| i * 3 + 1).collect();
    let mut src = cache();
    let s1 = build(&mut src, &u1, 1);
    gate.set(true);
    let ticket = a.persist(&src, s1, &tenant, 600).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    a.flush_index();
    assert_eq!(node_of(&b, &u1), None, "indexed before it was durable");
    assert_eq!(a.index_stats().unwrap().units_indexed, 0);
    // Durable: indexed (3 blocks: 256 + 256 + 88), with a TTL of the store's retention.
    gate.set(false);
    ticket.wait().unwrap();
    a.flush_index();
    assert_eq!(node_of(&b, &u1), Some((3, "node-a".into(), 600)));
    let ttl = cluster_ttl_ms(&cluster, &a, &tenant, &u1);
    assert!(
        ttl > 71 * 3_600_000 && ttl <= 72 * 3_600_000,
        "entry TTL {ttl} ms, not the 72 h retention"
    );

    // The tenant's SSD quota holds one such unit: a second one evicts the first, whose
    // entries go; the second's are there.
    a.set_ssd_quotas([(&tenant, a.ssd_bytes(&tenant) * 3 / 2)]);
    let u2: Vec<u32> = (0..600).map(|i| i * 7 + 2).collect();
    let s2 = build(&mut src, &u2, 2);
    a.persist(&src, s2, &tenant, 600).unwrap().wait().unwrap();
    a.flush_index();
    assert_eq!(a.lookup(&u1, &tenant).tokens, 0, "u1 was not evicted");
    assert_eq!(node_of(&b, &u1), None, "the evicted unit is still indexed");
    assert_eq!(node_of(&b, &u2), Some((3, "node-a".into(), 600)));
    let st = a.index_stats().unwrap();
    assert_eq!((st.units_indexed, st.units_unindexed), (2, 1), "{st:?}");
    assert_eq!(
        (st.entries_removed, st.failed, st.dropped),
        (3, 0, 0),
        "{st:?}"
    );

    // A shorter unit sharing the first two blocks of a longer one: deleting it keeps the
    // entries of those blocks (the longer unit holds them); deleting the longer one removes
    // every entry.
    a.set_ssd_quotas([]);
    a.persist(&src, s2, &tenant, 512).unwrap().wait().unwrap();
    a.delete_unit(&tenant, &u2[..512]).unwrap().wait().unwrap();
    a.flush_index();
    assert_eq!(a.lookup(&u2, &tenant).tokens, 600);
    assert_eq!(node_of(&b, &u2[..512]), Some((2, "node-a".into(), 512)));
    assert_eq!(node_of(&b, &u2), Some((3, "node-a".into(), 600)));
    a.delete_unit(&tenant, &u2).unwrap().wait().unwrap();
    a.flush_index();
    assert_eq!(node_of(&b, &u2), None);
    assert_eq!(node_of(&b, &u2[..300]), None);

    // Entries naming another node are not A's to remove: B holds u3 too (written last, its
    // entries win); A deleting its copy leaves them.
    let u3: Vec<u32> = (0..300).map(|i| i * 5 + 9).collect();
    let s3 = build(&mut src, &u3, 3);
    a.persist(&src, s3, &tenant, 300).unwrap().wait().unwrap();
    let hit = a.lookup(&u3, &tenant);
    let data = a.read_unit(&u3, &hit).unwrap().unwrap();
    a.flush_index();
    b.write_unit(&tenant, &u3, &data).unwrap().wait().unwrap();
    b.flush_index();
    assert_eq!(node_of(&a, &u3), Some((2, "node-b".into(), 300)));
    a.delete_unit(&tenant, &u3).unwrap().wait().unwrap();
    a.flush_index();
    assert_eq!(node_of(&a, &u3), Some((2, "node-b".into(), 300)));
    // Another tenant never sees any of it.
    assert_eq!(b.cluster_lookup(&u3, &Tenant::new("other")), None);

    // Reopened, A indexes what recovery found: an entry lost meanwhile (expired, dropped) is
    // written again.
    let u4: Vec<u32> = (0..400).map(|i| i * 11 + 5).collect();
    let s4 = build(&mut src, &u4, 4);
    a.persist(&src, s4, &tenant, 400).unwrap().wait().unwrap();
    a.flush_index();
    let keys = kvstack_tiers::key::chain_keys(&u4, 256, a.model(), &tenant);
    let removed = a
        .remote()
        .unwrap()
        .index_remove(tenant.id(), a.model(), &keys, "node-a");
    assert_eq!(removed, Some(2));
    assert_eq!(node_of(&b, &u4), None);
    drop(a);
    let mut remote = RedisOptions::new(cluster.urls());
    remote.key_prefix = "ix:".into();
    remote.node_id = Some("node-a".into());
    let a = tiers_with(da.path(), clock.clone(), Some(remote));
    a.flush_index();
    assert_eq!(node_of(&b, &u4), Some((2, "node-a".into(), 400)));
    // u1, evicted in memory only (its commit was still on disk), came back with recovery:
    // indexed again too, as the node holds it again.
    assert_eq!(a.lookup(&u1, &tenant).tokens, 600);
    assert_eq!(node_of(&b, &u1), Some((3, "node-a".into(), 600)));
    assert_eq!(a.index_stats().unwrap().units_indexed, 2);
}

/// The remaining TTL (ms) of the index entry of `tokens`' first block, read with redis-cli.
fn cluster_ttl_ms(
    cluster: &redis_cluster::RedisCluster,
    t: &Tiers,
    tenant: &Tenant,
    tokens: &[u32],
) -> u64 {
    let keys = kvstack_tiers::key::chain_keys(tokens, 256, t.model(), tenant);
    let key = t
        .remote()
        .unwrap()
        .index_key(tenant.id(), t.model(), &keys[0]);
    let out = std::process::Command::new("redis-cli")
        .args(["-c", "-p", &cluster.ports()[0].to_string(), "PTTL", &key])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}
