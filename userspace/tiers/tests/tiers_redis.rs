//! The window pool's Redis Cluster level against a real 6-process cluster on 127.0.0.1
//! (tests/support/redis_cluster.rs): round trip and pipelined gets, the TTL as the key's
//! expiry, damaged and truncated values are misses, tenants and models never read each
//! other's snapshots, a master killed (failover) and the whole cluster stopped give misses
//! (logged once, counted) and it recovers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/redis_cluster.rs"]
mod redis_cluster;

use std::time::{Duration, Instant};

use kvstack_tiers::redis_pool::{HEADER_BYTES, SnapshotId};
use kvstack_tiers::{ModelFingerprint, RedisOptions, RedisPool};
use redis_cluster::RedisCluster;

fn pool(c: &RedisCluster, ttl_ms: u64, prefix: &str) -> RedisPool {
    let mut o = RedisOptions::new(c.urls());
    o.key_prefix = prefix.into();
    o.retry_ms = 200;
    o.io_timeout_ms = 500;
    RedisPool::new(o, ttl_ms).unwrap()
}

fn snapshot(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A raw connection to the cluster, to tamper with values behind the pool's back.
fn raw(c: &RedisCluster) -> redis::cluster::ClusterConnection {
    redis::cluster::ClusterClient::new(c.urls())
        .unwrap()
        .get_connection()
        .unwrap()
}

#[test]
fn round_trip_ttl_damage_and_tenant_isolation() {
    let Some(c) = RedisCluster::start() else {
        return;
    };
    let p = pool(&c, 60_000, "t1:");
    let model = ModelFingerprint([5; 32]);
    let keys: Vec<[u8; 32]> = (0..8u8).map(|i| [i; 32]).collect();
    let id = |tenant: u64, k: usize| SnapshotId {
        tenant,
        model: &model,
        key: &keys[k],
    };
    // A V4.1-Flash-sized snapshot (2.7 MB) and small ones, spread over the masters.
    let big = snapshot(1, 2_700_000);
    assert!(p.put(id(1, 0), &big));
    let mut out = Vec::new();
    assert!(p.get(id(1, 0), &mut out));
    assert!(out == big, "the 2.7 MB snapshot came back different");
    for k in 1..8 {
        assert!(p.put(id(1, k), &snapshot(k as u8, 1000 + k)));
    }
    let ids: Vec<SnapshotId<'_>> = (1..8).map(|k| id(1, k)).collect();
    let many = p.get_many(&ids);
    for (k, got) in (1..8).zip(&many) {
        assert_eq!(
            got.as_deref(),
            Some(&snapshot(k as u8, 1000 + k)[..]),
            "key {k}"
        );
    }
    // The keys landed on more than one master (the slots are spread).
    let mut con = raw(&c);
    let slots: std::collections::HashSet<u16> = (0..8)
        .map(|k| {
            let slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(p.value_key(id(1, k)))
                .query(&mut con)
                .unwrap();
            slot / 5462
        })
        .collect();
    assert!(slots.len() > 1, "{slots:?}");

    // Another tenant or model never reads it: other keys, and a value copied under another
    // tenant's key is refused by its header.
    assert!(!p.get(id(2, 0), &mut out));
    assert!(!p.contains(id(2, 0)));
    let other_model = ModelFingerprint([6; 32]);
    let om = SnapshotId {
        model: &other_model,
        ..id(1, 0)
    };
    assert!(!p.get(om, &mut out));
    let stolen: Vec<u8> = redis::cmd("GET")
        .arg(p.value_key(id(1, 1)))
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(p.value_key(id(2, 1)))
        .arg(&stolen)
        .query(&mut con)
        .unwrap();
    let before = p.stats();
    assert!(!p.get(id(2, 1), &mut out));
    assert_eq!(p.stats().damaged, before.damaged + 1);

    // Damaged: one bit flipped in the snapshot, truncated, or only a header: misses.
    let mut flipped = stolen.clone();
    flipped[HEADER_BYTES + 10] ^= 1;
    let truncated = stolen[..stolen.len() - 1].to_vec();
    let header_only = stolen[..HEADER_BYTES].to_vec();
    for (k, bad) in [(2, flipped), (3, truncated), (4, header_only)] {
        let _: () = redis::cmd("SET")
            .arg(p.value_key(id(1, k)))
            .arg(&bad)
            .query(&mut con)
            .unwrap();
    }
    let before = p.stats();
    for k in [2, 3, 4] {
        out.clear();
        assert!(!p.get(id(1, k), &mut out), "damaged value {k} served");
        assert!(out.is_empty());
    }
    let many = p.get_many(&[id(1, 2), id(1, 5), id(1, 3)]);
    assert!(many[0].is_none() && many[1].is_some() && many[2].is_none());
    let after = p.stats();
    assert_eq!(after.damaged, before.damaged + 5);
    assert_eq!(after.hits, before.hits + 1);

    // The TTL is the key's expiry (PX): a short-lived pool's snapshot is gone after it.
    let short = pool(&c, 300, "t1:");
    assert!(short.put(id(3, 0), &snapshot(9, 100)));
    let ttl: i64 = redis::cmd("PTTL")
        .arg(short.value_key(id(3, 0)))
        .query(&mut con)
        .unwrap();
    assert!((1..=300).contains(&ttl), "PTTL {ttl}");
    assert!(short.get(id(3, 0), &mut out));
    std::thread::sleep(Duration::from_millis(450));
    assert!(!short.get(id(3, 0), &mut out));
    assert!(!short.contains(id(3, 0)));

    // Remove drops it; prefixes keep deployments apart.
    p.remove(id(1, 5));
    assert!(!p.get(id(1, 5), &mut out));
    assert!(!pool(&c, 60_000, "t2:").get(id(1, 6), &mut out));
    let s = p.stats();
    assert_eq!((s.errors, s.incidents, s.put_failures), (0, 0, 0));
    assert!(p.health().up);
}

#[test]
fn failover_and_a_stopped_cluster_give_misses_and_it_recovers() {
    let Some(mut c) = RedisCluster::start() else {
        return;
    };
    let p = pool(&c, 60_000, "t3:");
    let model = ModelFingerprint([5; 32]);
    let keys: Vec<[u8; 32]> = (0..32u8).map(|i| [i; 32]).collect();
    let id = |k: usize| SnapshotId {
        tenant: 7,
        model: &model,
        key: &keys[k],
    };
    for k in 0..32 {
        assert!(p.put(id(k), &snapshot(k as u8, 5000)));
    }

    // Kill one master: until its replica takes over, its slots fail (misses); never a wrong
    // byte, and the other masters keep serving.
    let masters = c.masters();
    assert_eq!(masters.len(), 3, "{masters:?}");
    let victim = c.ports().iter().position(|&p| p == masters[0]).unwrap();
    c.kill(victim);
    let end = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    let mut rounds = 0;
    loop {
        rounds += 1;
        let mut all = true;
        for k in 0..32 {
            if p.get(id(k), &mut out) {
                assert_eq!(out, snapshot(k as u8, 5000), "wrong bytes for key {k}");
            } else {
                // Not reachable yet, or lost with the master (replication is asynchronous):
                // a miss; written again for when its slot is served again.
                all = false;
                p.put(id(k), &snapshot(k as u8, 5000));
            }
        }
        if all && c.masters().len() == 3 {
            break;
        }
        assert!(
            Instant::now() < end,
            "no failover after 20 s ({rounds} rounds): {:?} {:?}, masters {:?}",
            p.stats(),
            p.health(),
            c.masters()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let s = p.stats();
    assert!(s.incidents >= 1 && s.errors >= 1, "{s:?}");
    assert!(p.health().up);

    // Stop every node: calls are misses, fast, and one incident is counted however many.
    c.stop();
    let incidents = p.stats().incidents;
    let t = Instant::now();
    for k in 0..32 {
        assert!(!p.get(id(k), &mut out));
        assert!(!p.put(id(k), &[1, 2, 3]));
        assert!(
            p.get_many(&[id(k), id((k + 1) % 32)])
                .iter()
                .all(Option::is_none)
        );
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let s = p.stats();
    assert_eq!(s.incidents, incidents + 1, "{s:?}");
    assert!(s.skipped > 0 && s.put_failures >= 32, "{s:?}");
    let h = p.health();
    assert!(
        !h.up && h.last_error.is_some() && h.down_for_ms.is_some(),
        "{h:?}"
    );

    // Back up (empty: no persistence): the pool reconnects by itself within its retry time.
    c.restart();
    let end = Instant::now() + Duration::from_secs(15);
    while !p.put(id(0), &snapshot(0, 5000)) {
        assert!(Instant::now() < end, "no recovery: {:?}", p.health());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(p.get(id(0), &mut out) && out == snapshot(0, 5000));
    assert!(p.health().up);
    assert_eq!(p.stats().incidents, incidents + 1);
}

/// docs/cluster.md's table: a V4.1-Flash window snapshot (2.7 MB) read back from the DRAM
/// level and from the Redis Cluster level (GET, header and CRC-32C check, copy), and 8 at a
/// time through one pipeline, in the same run. `cargo test -p kvstack-tiers --release --test
/// tiers_redis -- --ignored --nocapture measure`.
#[test]
#[ignore = "measurement for docs/cluster.md; prints a table"]
fn measure_window_snapshot_restore_local_vs_redis() {
    use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
    use kvstack_tiers::{PoolOptions, SystemClock, WindowPool};
    let Some(c) = RedisCluster::start() else {
        return;
    };
    let cfg = kvstack_spec::builtin::default_config().unwrap();
    let plan = kvstack_spec::plan::LayerPlan::from_config(&cfg).unwrap();
    let g = kvstack_cache::CacheGeometry::new(&cfg, &plan, 256).unwrap();
    let bytes = kvstack_tiers::unit::snapshot_bytes(&g);
    let n = 32usize;
    let p = pool(&c, 600_000, "measure:");
    let local = WindowPool::new(
        PoolOptions {
            capacity_bytes: Some((n * bytes.next_multiple_of(4096)) as u64),
            ttl_ms: 600_000,
            slot_bytes: bytes,
            memory: PinnedOptions {
                huge_pages: HugePages::Never,
                locking: Locking::Never,
            },
        },
        std::sync::Arc::new(SystemClock),
    )
    .unwrap();
    let model = ModelFingerprint([5; 32]);
    let keys: Vec<[u8; 32]> = (0..n).map(|i| [i as u8; 32]).collect();
    let id = |k: usize| SnapshotId {
        tenant: 1,
        model: &model,
        key: &keys[k],
    };
    let snaps: Vec<Vec<u8>> = (0..n).map(|k| snapshot(k as u8, bytes)).collect();
    let mut put_ms = Vec::new();
    for k in 0..n {
        local.put(keys[k], &snaps[k]).unwrap();
        let t = Instant::now();
        assert!(p.put(id(k), &snaps[k]));
        put_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut out = Vec::with_capacity(bytes);
    let time = |f: &mut dyn FnMut(usize)| {
        let mut ms: Vec<f64> = (0..n)
            .map(|k| {
                let t = Instant::now();
                f(k);
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        let total: f64 = ms.iter().sum();
        (ms[n / 2], ms[n * 9 / 10], (n * bytes) as f64 / total / 1e6)
    };
    let dram = time(&mut |k| {
        assert!(local.get(&keys[k], &mut out) && out == snaps[k]);
    });
    let redis = time(&mut |k| {
        assert!(p.get(id(k), &mut out) && out == snaps[k]);
    });
    // Pipelined: each batch's time split over its 8 snapshots.
    let mut per: Vec<f64> = (0..n / 8)
        .map(|b| {
            let ids: Vec<_> = (b * 8..b * 8 + 8).map(id).collect();
            let t = Instant::now();
            let got = p.get_many(&ids);
            let ms = t.elapsed().as_secs_f64() * 1e3 / 8.0;
            assert!(
                got.iter()
                    .zip(b * 8..)
                    .all(|(g, j)| g.as_deref() == Some(&snaps[j][..]))
            );
            ms
        })
        .collect();
    per.sort_by(f64::total_cmp);
    let batch = (
        per[per.len() / 2],
        per[per.len() * 9 / 10],
        (n * bytes) as f64 / (per.iter().sum::<f64>() * 8.0) / 1e6,
    );
    put_ms.sort_by(f64::total_cmp);
    println!("snapshot {bytes} bytes, {n} snapshots, 6-process cluster on 127.0.0.1");
    println!("| read | p50 ms | p90 ms | GB/s |");
    println!("|---|---|---|---|");
    for (name, (p50, p90, gbs)) in [
        ("DRAM level (WindowPool::get, copy)", dram),
        ("Redis Cluster level (GET + CRC-32C + copy)", redis),
        ("Redis Cluster, 8 per pipeline (per snapshot)", batch),
    ] {
        println!("| {name} | {p50:.3} | {p90:.3} | {gbs:.2} |");
    }
    println!(
        "| Redis Cluster put (SET PX) | {:.3} | {:.3} | {:.2} |",
        put_ms[n / 2],
        put_ms[n * 9 / 10],
        (n * bytes) as f64 / put_ms.iter().sum::<f64>() / 1e6
    );
}
