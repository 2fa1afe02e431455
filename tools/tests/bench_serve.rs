//! `kvstack bench serve` end to end, on a small workload: the real kvstackd and the engine
//! in-process, the report's fields filled from what ran.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

#[test]
fn bench_serve_reports_both_runs() {
    let kvstack = Path::new(env!("CARGO_BIN_EXE_kvstack"));
    let kvstackd = kvstack.with_file_name("kvstackd");
    assert!(
        kvstackd.is_file(),
        "{} is missing: `cargo test --workspace` builds it (or `cargo build -p kvstack-appliance`)",
        kvstackd.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(kvstack)
        .args([
            "bench",
            "serve",
            "--json",
            "--clients",
            "4",
            "--requests",
            "8",
        ])
        .args([
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "3",
            "--threads",
            "1",
        ])
        .arg("--dir")
        .arg(dir.path())
        .arg("--kvstackd")
        .arg(&kvstackd)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The ratio target may be missed on a loaded machine (exit 1 with the report printed);
    // anything else is a failure.
    assert!(
        out.status.success() || stderr.contains("tokens/s is"),
        "{stderr}"
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for side in ["daemon", "in_process"] {
        assert_eq!(r[side]["requests"], 8, "{r}");
        assert_eq!(r[side]["errors"], 0, "{r}");
        let tokens = r[side]["tokens"].as_u64().unwrap();
        assert!((8..=24).contains(&tokens), "{side}: {tokens} tokens: {r}");
        assert!(r[side]["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    assert!(r["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{r}");
    assert!(
        r["ttft_ms"]["p99"].as_f64().unwrap() >= r["ttft_queued_ms"]["p99"].as_f64().unwrap(),
        "{r}"
    );
    assert!(r["peak_rss_bytes"].as_u64().unwrap() > 1 << 20, "{r}");
    assert!(r["pool_peak_bytes"].as_u64().unwrap() <= r["pool_cap_bytes"].as_u64().unwrap());
    // The bench removed its working directory.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
