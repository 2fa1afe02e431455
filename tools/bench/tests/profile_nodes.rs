//! `kvstack profile replay --nodes`: a trace split round-robin over two in-process nodes,
//! without and with the shared tiers (peer fetches of units, a shared window level modelled
//! in process or on a real Redis Cluster on loopback), on a hand-written trace with known
//! answers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../../userspace/tiers/tests/support/redis_cluster.rs"]
mod redis_cluster;

use kvstack_bench::profile::report::TokensBySource;
use kvstack_bench::profile::{ModelSpec, ReplayOptions, ReplayReport, parse_trace_str, replay};
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};

const MEM: PinnedOptions = PinnedOptions {
    huge_pages: HugePages::Never,
    locking: Locking::Never,
};

fn line(ts: u64, ids: &[u64], input: u64, output: u64) -> String {
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    format!(
        r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": {output}, "hash_ids": [{}]}}"#,
        ids.join(", ")
    )
}

fn options(dir: &tempfile::TempDir, shared: bool) -> ReplayOptions {
    let model = ModelSpec {
        name: "v4.1".into(),
        config: kvstack_spec::builtin::default_config().unwrap(),
    };
    let mut o = ReplayOptions::new(dir.path().to_path_buf(), model);
    o.ssd_capacity_bytes = 64 << 20;
    o.segment_bytes = Some(1 << 20);
    o.dram_pool_bytes = 64 << 20;
    o.cache_bytes = 256 << 20;
    o.max_sequences = 16;
    o.memory = MEM;
    o.keep_live = false;
    o.sessions = false;
    o.nodes = 2;
    o.shared_tiers = shared;
    o
}

/// Request 0 (node 0) persists 1024 tokens; request 1 (node 1) extends them; request 2 (node
/// 0) extends request 1's prompt; request 3 (node 1) repeats request 0's.
fn trace() -> Vec<String> {
    vec![
        line(0, &[1, 2], 1024, 0),
        line(5_000, &[1, 2, 3], 1200, 0),
        line(10_000, &[1, 2, 3, 4], 1700, 0),
        line(15_000, &[1, 2], 1024, 0),
    ]
}

fn run(o: &ReplayOptions) -> ReplayReport {
    let trace = parse_trace_str(&trace().join("\n"), None).unwrap();
    let r = replay(&trace, o, &mut |_| {}).unwrap();
    assert_eq!(
        r.tokens_by_source.total(),
        r.input_tokens,
        "every token once"
    );
    assert_eq!(r.samples.per_request.len(), 4);
    let c = r.cluster.as_ref().expect("a cluster report with two nodes");
    assert_eq!(c.nodes, 2);
    assert_eq!(c.requests_per_node, vec![2, 2], "round-robin by arrival");
    r
}

/// Request 1 on node 1 with the shared tiers: node 0's 1024-token unit fetched (896 tokens
/// read, the last 128 with the window from the shared level), 176 computed.
fn fetched() -> TokensBySource {
    TokensBySource {
        peer: 1024 - 128,
        dram_pool: 128,
        computed: 1200 - 1024,
        ..TokensBySource::default()
    }
}

#[test]
fn shared_tiers_serve_a_peers_unit_and_compute_less() {
    let dir = tempfile::tempdir().unwrap();
    let own = run(&options(&dir, false));
    let c = own.cluster.as_ref().unwrap();
    assert!(!c.shared_tiers && c.shared_window_level.is_none());
    assert_eq!(c.peer_fetches, 0);
    assert_eq!(own.tokens_by_source.peer, 0);
    // Node 1 holds nothing of request 0's prefix: all computed.
    assert_eq!(
        own.samples.per_request[1],
        TokensBySource {
            computed: 1200,
            ..TokensBySource::default()
        }
    );
    // The peer field is absent from a report without shared tiers (as from one node's).
    let v = serde_json::to_value(&own).unwrap();
    assert!(v["tokens_by_source"].get("peer").is_none());
    assert_eq!(v["cluster"]["nodes"], 2);

    let shared = run(&options(&dir, true));
    let c = shared.cluster.as_ref().unwrap();
    assert!(c.shared_tiers);
    assert_eq!(c.shared_window_level.as_deref(), Some("in-process model"));
    assert_eq!(shared.samples.per_request[1], fetched());
    assert!(c.peer_fetches >= 1 && c.peer_bytes > 0, "{c:?}");
    assert_eq!(c.peer_fetch_failures, 0);
    assert!(c.windows_from_shared_level >= 1 && c.shared_level_hits >= 1);
    assert!(shared.tokens_by_source.peer > 0);
    assert!(
        shared.tokens_by_source.computed < own.tokens_by_source.computed,
        "shared {:?} own {:?}",
        shared.tokens_by_source,
        own.tokens_by_source
    );
    let v = serde_json::to_value(&shared).unwrap();
    assert_eq!(v["tokens_by_source"]["peer"], shared.tokens_by_source.peer);
    assert_eq!(v["cluster"]["shared_window_level"], "in-process model");

    // Deterministic: the same counts again.
    let again = run(&options(&dir, true));
    assert_eq!(again.samples.per_request, shared.samples.per_request);
    assert_eq!(again.cluster.unwrap().peer_bytes, c.peer_bytes);
}

#[test]
fn one_node_reports_no_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(&dir, true);
    o.nodes = 1;
    let trace = parse_trace_str(&trace().join("\n"), None).unwrap();
    let r = replay(&trace, &o, &mut |_| {}).unwrap();
    assert!(r.cluster.is_none());
    let v = serde_json::to_value(&r).unwrap();
    assert!(v.get("cluster").is_none() && v["tokens_by_source"].get("peer").is_none());
    // One node holds request 0's unit for request 1.
    assert_eq!(r.tokens_by_source.peer, 0);
    assert_eq!(r.samples.per_request[1].computed, 1200 - 1024);
}

#[test]
fn the_shared_window_level_on_redis_cluster() {
    let Some(cluster) = redis_cluster::RedisCluster::start() else {
        eprintln!("SKIPPED: no redis-server");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(&dir, true);
    o.redis_cluster = cluster.urls();
    let r = run(&o);
    let c = r.cluster.as_ref().unwrap();
    assert_eq!(c.shared_window_level.as_deref(), Some("redis-cluster"));
    // The same answer as the in-process level: the window came from Redis.
    assert_eq!(r.samples.per_request[1], fetched());
    assert!(c.windows_from_shared_level >= 1, "{c:?}");
    assert!(
        c.shared_level_puts >= 4 && c.shared_level_hits >= 1,
        "{c:?}"
    );
    assert!(c.peer_fetches >= 1);
}
