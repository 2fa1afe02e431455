//! Prints the codec benchmark report (ignored by default: a benchmark, not a test).
//!
//! `cargo test --release -p kvstack-bench --test codec_report -- --ignored --nocapture`
//! (set `KVSTACK_BENCH_QUICK=1` for 8 MiB buffers, `KVSTACK_BENCH_LEVEL=portable` for a level).

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_bench::codecs::{CodecBenchOptions, run_codec_bench};

#[test]
#[ignore = "benchmark; run explicitly in release"]
fn codec_bench_report() {
    let mut opts = if std::env::var_os("KVSTACK_BENCH_QUICK").is_some() {
        CodecBenchOptions::quick()
    } else {
        CodecBenchOptions::default()
    };
    if let Ok(l) = std::env::var("KVSTACK_BENCH_LEVEL") {
        opts.level = Some(l.parse().unwrap());
    }
    let report = run_codec_bench(&opts);
    println!("{report}");
    assert!(report.results.iter().all(|r| r.throughput.gb_per_s > 0.0));
}
