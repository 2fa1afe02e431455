//! `kvstack profile replay` on hand-written traces with known answers, on a slice of the
//! conversation trace (twice, for determinism), the trace parser's errors and the JSON fields.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

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

fn options(dir: &tempfile::TempDir) -> ReplayOptions {
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
    // Each request goes through the tiers.
    o.keep_live = false;
    o.sessions = false;
    o
}

fn run(lines: &[String], o: &ReplayOptions) -> ReplayReport {
    let trace = parse_trace_str(&lines.join("\n"), None).unwrap();
    let r = replay(&trace, o, &mut |_| {}).unwrap();
    assert_eq!(
        r.tokens_by_source.total(),
        r.input_tokens,
        "every token once"
    );
    assert_eq!(r.samples.per_request.len(), lines.len());
    r
}

fn hits(s: &TokensBySource) -> u64 {
    s.hits()
}

#[test]
fn a_repeated_prefix_hits_once_its_unit_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(&dir);
    // A's prefill takes 1024 / 20,000 s = 52 ms of trace time; its unit exists from then on.
    let r = run(
        &[
            line(0, &[1, 2], 1024, 0),
            line(10, &[1, 2, 3], 1500, 0),
            line(1000, &[1, 2, 4], 1500, 0),
        ],
        &o,
    );
    let p = &r.samples.per_request;
    assert_eq!(hits(&p[1]), 0, "before A's unit exists: {:?}", p[1]);
    // After: A's 1024 tokens, its window from the pool (5-minute TTL), the blocks mapped from
    // the paged cache's prefix index.
    assert_eq!(p[2].dram_cache + p[2].ssd, 1024 - 128, "{:?}", p[2]);
    assert_eq!(p[2].dram_pool, 128);
    assert_eq!(p[2].computed, 1500 - 1024);
    assert_eq!(r.windows_from_pool, 1);
    assert!(r.ssd.units_written >= 3);
    assert!(r.ssd.direct || !r.ssd.engine.is_empty());
}

#[test]
fn the_window_pool_misses_after_its_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(&dir);
    o.window_ttl_ms = 60_000;
    let r = run(
        &[
            line(0, &[1, 2], 1024, 0),
            line(30_000, &[1, 2, 3], 1500, 0),
            line(100_000, &[1, 2, 4], 1500, 0),
        ],
        &o,
    );
    let p = &r.samples.per_request;
    assert_eq!((p[1].dram_pool, p[1].replayed), (128, 0), "{:?}", p[1]);
    assert_eq!((p[2].dram_pool, p[2].replayed), (0, 128), "{:?}", p[2]);
    assert_eq!(hits(&p[2]), 1024, "the global KV still hits");
    assert_eq!((r.windows_from_pool, r.window_replays), (1, 1));
    assert_eq!(r.dram_pool.expiries, 1);
}

/// 8 segments of 1 MiB hold four 233,472-byte V4.1 block records each; a 2048-token unit (8
/// blocks and its commit) fills exactly two, and data may not take the last free segment.
fn tiny_store(dir: &tempfile::TempDir, retention_ms: u64) -> ReplayOptions {
    let mut o = options(dir);
    o.ssd_capacity_bytes = 8 << 20;
    o.retention_ms = retention_ms;
    o
}

#[test]
fn a_prefix_older_than_the_retention_misses() {
    let trace = [
        line(0, &[1, 2, 3, 4], 2048, 0),
        line(100_000, &[10, 11, 12, 13], 2048, 0),
        line(110_000, &[20, 21, 22, 23], 2048, 0),
        line(120_000, &[30, 31, 32, 33], 2048, 0),
        line(200_000, &[1, 2, 3, 4, 5], 2100, 0),
    ];
    // Past its 60 s retention, A is evicted when the store needs room.
    let dir = tempfile::tempdir().unwrap();
    let r = run(&trace, &tiny_store(&dir, 60_000));
    assert_eq!(
        hits(&r.samples.per_request[4]),
        0,
        "{:?}",
        r.samples.per_request
    );
    assert!(r.ssd.evictions >= 1);
    assert_eq!(r.ssd.units_refused_full, 0);
    // Within its retention nothing young is evicted: the last filler is refused, A hits.
    let dir = tempfile::tempdir().unwrap();
    let r = run(&trace, &tiny_store(&dir, 3_600_000));
    assert_eq!(
        hits(&r.samples.per_request[4]),
        2048,
        "{:?}",
        r.samples.per_request
    );
    assert_eq!(r.ssd.evictions, 0);
    assert!(r.ssd.units_refused_full >= 1);
}

#[test]
fn eviction_takes_the_least_recently_used_unit_first() {
    let dir = tempfile::tempdir().unwrap();
    let a = [1, 2, 3, 4];
    let b = [10, 11, 12, 13];
    let c = [20, 21, 22, 23];
    let trace = [
        line(0, &a, 2048, 0),
        line(10_000, &b, 2048, 0),
        line(20_000, &c, 2048, 0),
        // A used again: B is now the least recently used.
        line(25_000, &[1, 2, 3, 4, 5], 2058, 0),
        // D needs two segments: one free, one from evicting B.
        line(30_000, &[30, 31, 32, 33], 2048, 0),
        line(40_000, &[1, 2, 3, 4, 6], 2058, 0),
        line(41_000, &[20, 21, 22, 23, 7], 2058, 0),
        line(42_000, &[10, 11, 12, 13, 8], 2058, 0),
    ];
    let r = run(&trace, &tiny_store(&dir, 1000));
    let p = &r.samples.per_request;
    assert_eq!(hits(&p[3]), 2048, "A is read at 25 s: {p:?}");
    assert_eq!(hits(&p[5]), 2048, "A stays: {p:?}");
    assert_eq!(hits(&p[6]), 2048, "C stays: {p:?}");
    assert_eq!(hits(&p[7]), 0, "B went first: {p:?}");
    assert!(r.ssd.evictions >= 1);
}

fn conversation_slice() -> Option<kvstack_bench::profile::Trace> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/traces/conversation_trace.jsonl"
    ));
    if !path.exists() {
        eprintln!("{} is absent; skipped", path.display());
        return None;
    }
    Some(kvstack_bench::profile::read_trace(&path, Some(500)).unwrap())
}

#[test]
fn the_same_trace_twice_gives_the_same_counts() {
    let Some(trace) = conversation_slice() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(&dir);
    o.ssd_capacity_bytes = 2_000_000_000;
    o.segment_bytes = None;
    o.dram_pool_bytes = 300_000_000;
    o.cache_bytes = 1_000_000_000;
    o.max_sequences = 64;
    o.keep_live = true;
    o.sessions = true;
    let a = replay(&trace, &o, &mut |_| {}).unwrap();
    let b = replay(&trace, &o, &mut |_| {}).unwrap();
    assert_eq!(a.requests, 500);
    assert_eq!(a.tokens_by_source.total(), a.input_tokens);
    assert_eq!(a.tokens_by_source, b.tokens_by_source);
    assert_eq!(a.samples.per_request, b.samples.per_request);
    for (x, y) in [
        (a.ssd.bytes_written, b.ssd.bytes_written),
        (a.ssd.bytes_read, b.ssd.bytes_read),
        (a.ssd.units_written, b.ssd.units_written),
        (a.ssd.units_refused_full, b.ssd.units_refused_full),
        (a.ssd.evictions, b.ssd.evictions),
        (a.dram_pool.puts, b.dram_pool.puts),
        (a.dram_pool.hits, b.dram_pool.hits),
        (a.dram_pool.evictions, b.dram_pool.evictions),
        (a.dram_cache.evictions, b.dram_cache.evictions),
    ] {
        assert_eq!(x, y);
    }
    // The slice reuses prefixes through every tier, and fills the 2 GB store.
    let s = &a.tokens_by_source;
    assert!(
        s.live > 0 && s.dram_cache > 0 && s.ssd > 0 && s.dram_pool > 0,
        "{s:?}"
    );
    assert!(a.hit_rate_tokens > 0.05 && a.hit_rate_tokens < 1.0);
    assert!(a.ssd.units_refused_full > 0);
    assert!(a.sessions < a.requests);
    assert!(a.cost_model.prefill_seconds_saved > 0.0);
}

#[test]
fn malformed_lines_name_the_line_and_field() {
    let ok = line(0, &[1, 2], 1000, 5);
    let cases: [(String, usize, Option<&str>, &str); 9] = [
        (format!("{ok}\nnot json"), 2, None, "not valid JSON"),
        ("[1, 2]".into(), 1, None, "not a JSON object"),
        (
            r#"{"input_length": 5, "output_length": 1, "hash_ids": [1]}"#.into(),
            1,
            Some("timestamp"),
            "missing",
        ),
        (
            r#"{"timestamp": -3, "input_length": 5, "output_length": 1, "hash_ids": [1]}"#.into(),
            1,
            Some("timestamp"),
            "not a non-negative integer",
        ),
        (
            r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#.into(),
            1,
            Some("input_length"),
            "not in",
        ),
        (
            format!("{ok}\n\n{}", line(9, &[1, 2, 3], 1000, 5)),
            3,
            Some("hash_ids"),
            "3 ids",
        ),
        (
            r#"{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}"#.into(),
            1,
            Some("hash_ids"),
            "element 0",
        ),
        (
            format!("{}\n{}", line(50, &[1], 10, 1), line(49, &[1], 10, 1)),
            2,
            Some("timestamp"),
            "earlier",
        ),
        (
            format!("{ok}\n{{\"pad\": \"{}\"}}", "x".repeat(1 << 20)),
            2,
            None,
            "longer than",
        ),
    ];
    for (text, want_line, want_field, words) in cases {
        let err = parse_trace_str(&text, None).unwrap_err();
        let kvstack_bench::Error::Trace {
            line,
            field,
            reason,
            ..
        } = &err
        else {
            panic!("{err}");
        };
        assert_eq!((*line, *field), (want_line, want_field), "{err}");
        assert!(reason.contains(words), "{err}");
        assert!(
            err.to_string().contains(&format!("line {want_line}")),
            "{err}"
        );
    }
    // A blank line is skipped; the limit stops reading.
    let t = parse_trace_str(&format!("{ok}\n\n{ok}\nnot json"), Some(2)).unwrap();
    assert_eq!(t.requests.len(), 2);
    // Not a regular file.
    let e =
        kvstack_bench::profile::read_trace(std::path::Path::new("/dev/zero"), None).unwrap_err();
    assert!(e.to_string().contains("/dev/zero"), "{e}");
}

/// The top-level JSON fields of a report, each documented in `docs/profile.md`.
const FIELDS: [&str; 27] = [
    "trace",
    "model",
    "model_bytes_per_token",
    "native_geometry",
    "requests",
    "input_tokens",
    "output_tokens",
    "sessions",
    "continued_turns",
    "tokens_by_source",
    "hit_rate_tokens",
    "hit_rate_blocks",
    "hit_rate_by_source",
    "windows_from_pool",
    "window_replays",
    "ssd",
    "dram_pool",
    "dram_cache",
    "latency_ms",
    "cost_model",
    "seconds",
    "trace_seconds",
    "requests_per_s",
    "speed",
    "peak_rss_bytes",
    "series",
    "measured",
];

#[test]
fn json_fields_are_stable_and_documented() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(&dir);
    let r = run(
        &[line(0, &[1, 2], 1024, 3), line(5000, &[1, 2, 3], 1200, 0)],
        &o,
    );
    let v = serde_json::to_value(&r).unwrap();
    let obj = v.as_object().unwrap();
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let mut want: Vec<&str> = FIELDS
        .iter()
        .copied()
        .chain(["modelled", "notes"])
        .collect();
    want.sort_unstable();
    assert_eq!(
        keys, want,
        "top-level fields changed: update docs/profile.md and this test"
    );
    for k in [
        "live",
        "dram_cache",
        "dram_pool",
        "ssd",
        "replayed",
        "computed",
    ] {
        assert!(v["tokens_by_source"][k].is_u64(), "{k}");
    }
    for tier in ["ssd", "dram_pool"] {
        for k in ["bytes_read", "bytes_written", "evictions", "expiries"] {
            assert!(v[tier][k].is_u64(), "{tier}.{k}");
        }
    }
    for stage in ["lookup", "restore_ssd", "restore_dram", "admission"] {
        for k in ["p50", "p90", "p99", "max"] {
            assert!(v["latency_ms"][stage][k].is_number(), "{stage}.{k}");
        }
    }
    assert!(v["hit_rate_tokens"].is_f64() && v["seconds"].is_f64());
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/profile.md"
    ))
    .unwrap();
    for k in want
        .iter()
        .chain(&["bytes_read", "bytes_written", "evictions", "expiries"])
    {
        assert!(
            doc.contains(&format!("`{k}`")),
            "docs/profile.md lacks `{k}`"
        );
    }
}

#[test]
fn plots_are_written_as_png_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(&dir);
    let r = run(
        &[line(0, &[1, 2], 1024, 3), line(5000, &[1, 2, 3], 1200, 0)],
        &o,
    );
    let out = dir.path().join("plots");
    let files = match kvstack_bench::profile::plot::plot_run(&r, &out, "") {
        Ok(f) => f,
        Err(kvstack_bench::Error::Plot { reason, .. }) if reason.contains("no TrueType font") => {
            eprintln!("{reason}; skipped");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(files.len(), 8);
    for f in &files {
        let b = std::fs::read(f).unwrap();
        if f.extension().is_some_and(|e| e == "png") {
            assert_eq!(&b[1..4], b"PNG");
        } else {
            assert!(String::from_utf8_lossy(&b).contains("<svg"));
        }
    }
    let sweep = kvstack_bench::profile::plot::plot_sweep(&[r.clone(), r], &out).unwrap();
    assert_eq!(sweep.len(), 2);
}
