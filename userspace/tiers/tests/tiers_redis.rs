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
