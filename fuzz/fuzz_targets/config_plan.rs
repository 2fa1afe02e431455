//! The config parser and everything derived from a config: `ModelConfig::from_json_str` on
//! arbitrary text, then (when it parses) the detection, every accessor, `LayerPlan::from_config`
//! and `CacheReport::compute` under every format override, the report's arithmetic at extreme
//! contexts and its JSON. Errors are fine; a panic, a hang or an unbounded allocation is not
//! (scripts/fuzz runs it with a per-input time limit and a malloc limit).
//!
//! Byte 0 picks the format overrides; the rest is the JSON text.
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_spec::{
    CacheReport, FormatOverrides, GlobalFormat, IndexFormat, LayerPlan, ModelConfig, compare,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, text)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_json_str(text) else {
        return;
    };
    let _ = cfg.detect();
    let _ = cfg.num_hidden_layers();
    let _ = cfg.attention_head_dim();
    let _ = cfg.layer_compress_ratios();
    let _ = cfg.speculative_compress_ratios();
    let _ = cfg.has_csa2_sources();
    if let Ok(plan) = LayerPlan::from_config(&cfg) {
        assert_eq!(plan.layers.len(), cfg.num_hidden_layers().unwrap());
        for (i, l) in plan.layers.iter().enumerate() {
            assert_eq!(l.index, i);
            if let Some(s) = l.kv_source {
                assert!(s <= i, "layer {i} reads KV of a later layer {s}");
            }
            let _ = (l.owns_kv(), l.owns_index_keys(), l.is_indexed());
        }
    }
    let globals = [None].into_iter().chain(GlobalFormat::ALL.map(Some));
    let overrides: Vec<FormatOverrides> = globals
        .flat_map(|g| {
            [None]
                .into_iter()
                .chain(IndexFormat::ALL.map(Some))
                .map(move |i| FormatOverrides {
                    global: g,
                    index: i,
                })
        })
        .collect();
    // The default formats, and one override pair chosen by the input.
    let pick = overrides[usize::from(mode) % overrides.len()];
    let mut reports = Vec::new();
    for o in [FormatOverrides::default(), pick] {
        let Ok(r) = CacheReport::compute(&cfg, &o) else {
            continue;
        };
        for t in [0, 1, 2, 127, 1 << 20, u64::MAX / 2, u64::MAX] {
            let b = r.bytes_at_context(t);
            assert!(r.total_bytes_at_context(t) >= b);
            let _ = r.gib_at_context(t);
        }
        assert!(r.bytes_at_context(1 << 20) >= r.bytes_at_context(1 << 10));
        let _ = serde_json::to_string(&r).unwrap();
        reports.push(r);
    }
    let _ = compare(&reports);
});
