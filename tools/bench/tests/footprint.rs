//! The footprint bench: a small run in the suite, the 1M-token run on demand
//! (`cargo test --release -p kvstack-bench --test footprint -- --ignored --nocapture`;
//! it runs alone in this binary, so the peak RSS is the bench's). `KVSTACK_FOOTPRINT_TOKENS`
//! overrides the 1,048,576 tokens.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_bench::footprint::{FOOTPRINT_CHUNK_TOKENS, run_footprint_bench};

#[test]
fn small_footprint_run_reports_measured_bytes() {
    let tokens = 2 * FOOTPRINT_CHUNK_TOKENS + 301;
    let mut seen = Vec::new();
    let r = run_footprint_bench(tokens, |t| seen.push(t)).unwrap();
    assert_eq!(seen.last(), Some(&tokens));
    assert_eq!(seen.len(), 3);
    assert_eq!(r.window_bytes, 40 * 128 * 528);
    assert_eq!(r.pending_state_bytes, 3 * 4096);
    assert_eq!(r.per_sequence_bytes, r.arithmetic_per_sequence_bytes);
    // An odd length: the ratio-2 sources hold floor(T / 2) entries.
    let want = 3 * (tokens / 2) * 356 + tokens * 356;
    assert_eq!(r.global_entry_bytes + r.index_entry_bytes, want);
    assert!(r.global_bytes_per_token >= r.global_bytes_per_token_in_use);
    assert_eq!(
        r.usage.window.entry_bytes,
        40 * 128 * 528,
        "the window is full"
    );
    assert!(
        r.to_string().contains("targets met") || !r.meets_targets(),
        "{r}"
    );
    let json = serde_json::to_value(&r).unwrap();
    for key in [
        "global_bytes_per_token",
        "per_sequence_bytes",
        "peak_rss_bytes",
    ] {
        assert!(json.get(key).is_some_and(|v| v.is_number()), "{key}");
    }
}

#[test]
#[ignore = "1M tokens: run in release, alone (see the file's docs)"]
fn footprint_at_one_million_tokens() {
    let tokens = std::env::var("KVSTACK_FOOTPRINT_TOKENS").map_or(1 << 20, |v| v.parse().unwrap());
    let r = run_footprint_bench(tokens, |_| {}).unwrap();
    let mut shown = serde_json::to_value(&r).unwrap();
    if let Some(o) = shown.as_object_mut() {
        o.remove("usage");
    }
    println!("{}", serde_json::to_string_pretty(&shown).unwrap());
    println!("{}", serde_json::to_string_pretty(&r.usage).unwrap());
    println!("{r}");
    assert!(r.meets_targets(), "{:?}", r.failures);
    if tokens == 1 << 20 {
        // No partial page and every page size a multiple of 4 KiB: no waste at all.
        assert_eq!(r.global_bytes_per_token, 890.0);
    }
}
