//! `kvstack run` end to end: a small agent workload twice over one data directory; the second
//! run must serve prefixes from the SSD units the first one left.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn run(dir: &std::path::Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args([
            "run",
            "--data-dir",
            dir.to_str().unwrap(),
            "--sessions",
            "2",
            "--turns",
            "2",
            "--system-tokens",
            "300",
            "--tool-tokens",
            "40",
            "--user-tokens",
            "8",
            "--decode-tokens",
            "4",
            "--chunk",
            "128",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvstack run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn second_run_serves_prefixes_from_ssd() {
    let dir = std::env::temp_dir().join(format!("kvstack-run-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = run(&dir);
    let second = run(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let u = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    for v in [&first, &second] {
        assert_eq!(u(v, "requests"), 4);
        assert_eq!(u(v, "failed"), 0);
        // Every context token is accounted for exactly once.
        assert_eq!(
            u(v, "context_tokens"),
            u(v, "live_tokens")
                + u(v, "dram_cache_tokens")
                + u(v, "ssd_tokens")
                + u(v, "computed_tokens")
        );
        let b = f(v, "measured_bytes_per_token");
        assert!((880.0..=890.0).contains(&b), "bytes/token {b}");
        assert!(f(v, "prefill_tokens_per_s") > 0.0 && f(v, "decode_tokens_per_s") > 0.0);
    }
    assert_eq!(u(&first, "ssd_units_at_start"), 0);
    assert!(u(&first, "units_persisted") > 0);
    // The shared system prompt: the second session maps it from the first one's blocks.
    assert!(u(&first, "dram_cache_tokens") >= 256, "{first}");
    // After the restart the units are on SSD and the first session's prompt hits them.
    assert!(u(&second, "ssd_units_at_start") > 0, "{second}");
    assert!(u(&second, "ssd_tokens") >= 256, "{second}");
    assert!(
        u(&second, "computed_tokens") < u(&first, "computed_tokens"),
        "first {first}\nsecond {second}"
    );
}
