//! `kvstack profile replay|plan` as a user runs them: JSON fields, a sweep with a compared
//! generation and plots, flags out of range, a malformed trace.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn kvstack() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvstack"))
}

fn trace(dir: &std::path::Path) -> std::path::PathBuf {
    let lines = [
        r#"{"timestamp": 0, "input_length": 1024, "output_length": 20, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 2000, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]}"#,
        r#"{"timestamp": 4000, "input_length": 900, "output_length": 5, "hash_ids": [1, 9]}"#,
    ];
    let p = dir.join("trace.jsonl");
    std::fs::write(&p, lines.join("\n")).unwrap();
    p
}

fn small(cmd: &mut Command, dir: &std::path::Path) {
    cmd.args(["--data-dir", dir.to_str().unwrap()]).args([
        "--dram-pool",
        "64M",
        "--cache",
        "128M",
        "--max-sequences",
        "8",
    ]);
}

#[test]
fn replay_prints_the_json_fields() {
    let d = tempfile::tempdir().unwrap();
    let t = trace(d.path());
    let mut c = kvstack();
    c.args([
        "profile",
        "replay",
        "--trace",
        t.to_str().unwrap(),
        "--json",
    ])
    .args(["--ssd-capacity", "64M"]);
    small(&mut c, d.path());
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 3);
    assert_eq!(v["input_tokens"], 1024 + 1300 + 900);
    let s = &v["tokens_by_source"];
    let sum: u64 = [
        "live",
        "dram_cache",
        "dram_pool",
        "ssd",
        "replayed",
        "computed",
    ]
    .iter()
    .map(|k| s[k].as_u64().unwrap())
    .sum();
    assert_eq!(sum, 3224);
    // The second request continues the first (its session's live sequence).
    assert_eq!(s["live"], 1024 + 20);
    assert!(v["hit_rate_tokens"].as_f64().unwrap() > 0.3);
    // Its run directory is gone.
    let left: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("kvstack-profile")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn sweep_and_compare_write_plots() {
    let d = tempfile::tempdir().unwrap();
    let t = trace(d.path());
    let out_dir = d.path().join("out");
    let v3 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/configs/deepseek-v3.json"
    );
    let mut c = kvstack();
    c.args(["profile", "replay", "--trace", t.to_str().unwrap()])
        .args(["--ssd-capacity", "400M,800M", "--compare", v3])
        .args(["--out", out_dir.to_str().unwrap()]);
    small(&mut c, d.path());
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("byte volumes modelled"), "{text}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("report.json")).unwrap()).unwrap();
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4);
    assert_eq!(runs[0]["native_geometry"], true);
    assert_eq!(runs[2]["native_geometry"], false);
    assert_eq!(runs[2]["model_bytes_per_token"], 70272.0);
    // V3 has no window: nothing pooled, nothing replayed.
    assert_eq!(runs[2]["tokens_by_source"]["replayed"], 0);
    if out_dir.join("hit-rate-vs-capacity.png").exists() {
        for f in ["run1-hit-rate", "run4-latency-cdf", "hit-rate-vs-capacity"] {
            assert!(out_dir.join(format!("{f}.svg")).exists(), "{f}");
        }
    } else {
        // Only a machine without any TrueType font lacks plots; it says so.
        assert!(String::from_utf8_lossy(&out.stderr).contains("font"));
    }
}

#[test]
fn bad_flags_and_traces_are_refused_with_names() {
    let d = tempfile::tempdir().unwrap();
    let t = trace(d.path());
    for (flag, value) in [
        ("--ssd-capacity", "1K"),
        ("--window-ttl", "0s"),
        ("--prefill-tokens-per-s", "0"),
        ("--speed", "0"),
        ("--retention", "5 weeks"),
    ] {
        let out = kvstack()
            .args([
                "profile",
                "replay",
                "--trace",
                t.to_str().unwrap(),
                flag,
                value,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(flag),
            "{flag}"
        );
    }
    let bad = d.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1}\n",
    )
    .unwrap();
    let out = kvstack()
        .args(["profile", "replay", "--trace", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("hash_ids"), "{err}");
}

#[test]
fn plan_sizes_the_tiers() {
    let v3 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/configs/deepseek-v3.json"
    );
    let out = kvstack()
        .args(["profile", "plan", "--sessions", "1000", "--context", "64K"])
        .args([
            "--turns-per-hour",
            "6",
            "--turns",
            "6",
            "--json",
            "--compare",
            v3,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plans = v["plans"].as_array().unwrap();
    assert_eq!(plans.len(), 2);
    let (a, b) = (&plans[0], &plans[1]);
    assert_eq!(a["bytes_per_token"], 890.0);
    // 1000 sessions of 1 h, each kept 72 h after its last turn.
    assert_eq!(a["stored_sessions"], 73_000.0);
    let ratio = b["ssd_bytes"].as_f64().unwrap() / a["ssd_bytes"].as_f64().unwrap();
    assert!(ratio > 70.0 && ratio < 80.0, "{ratio}");
    assert_eq!(b["dram_pool_bytes"], 0.0, "V3 has no window KV");
    let text = kvstack()
        .args(["profile", "plan", "--sessions", "10", "--context", "8K"])
        .args(["--turns-per-hour", "12"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("SSD capacity"));
}

#[test]
fn two_nodes_report_both_modes() {
    let d = tempfile::tempdir().unwrap();
    let t = trace(d.path());
    let mut c = kvstack();
    c.args([
        "profile",
        "replay",
        "--trace",
        t.to_str().unwrap(),
        "--json",
    ])
    .args(["--ssd-capacity", "64M", "--nodes", "2"]);
    small(&mut c, d.path());
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "without and with the shared tiers");
    for (r, shared) in runs.iter().zip([false, true]) {
        assert_eq!(r["cluster"]["nodes"], 2);
        assert_eq!(r["cluster"]["shared_tiers"], shared);
        assert_eq!(r["cluster"]["requests_per_node"], serde_json::json!([2, 1]));
    }
    assert!(runs[0]["cluster"]["shared_window_level"].is_null());
    assert_eq!(
        runs[1]["cluster"]["shared_window_level"],
        "in-process model"
    );
    // Request 1 (node 1) extends request 0's prefix, which only node 0 holds.
    assert!(runs[1]["tokens_by_source"]["peer"].as_u64().unwrap() > 0);

    // The Redis level needs several nodes, and URLs.
    for args in [
        &["--redis-cluster", "redis://127.0.0.1:7000"][..],
        &["--nodes", "2", "--redis-cluster", "127.0.0.1:7000"][..],
    ] {
        let mut c = kvstack();
        c.args(["profile", "replay", "--trace", t.to_str().unwrap()])
            .args(args);
        small(&mut c, d.path());
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--redis-cluster"), "{err}");
    }
}
