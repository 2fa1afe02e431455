//! Cache arithmetic over the released configs (spec §6), derived from the config files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use kvstack_spec::calc::GIB;
use kvstack_spec::{
    CacheReport, Error, FormatOverrides, Generation, GlobalFormat, IndexFormat, LayerMode,
    ModelConfig, compare, format_ratio,
};
use proptest::prelude::*;
use serde_json::{Value, json};

const CONFIGS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/configs");
const CSA2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/vectors/csa2");

const ALL: [&str; 7] = [
    "deepseek-llm-67b",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-v3.2-exp",
    "deepseek-v4-flash",
    "deepseek-v4-pro",
    "deepseek-v4.1-flash",
];

fn cfg(name: &str) -> ModelConfig {
    ModelConfig::from_file(format!("{CONFIGS}/{name}.json")).unwrap()
}

fn value(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{CONFIGS}/{name}.json")).unwrap())
        .unwrap()
}

fn report(name: &str) -> CacheReport {
    CacheReport::compute(&cfg(name), &FormatOverrides::default()).unwrap()
}

fn report_with(
    name: &str,
    global: Option<GlobalFormat>,
    index: Option<IndexFormat>,
) -> CacheReport {
    CacheReport::compute(&cfg(name), &FormatOverrides { global, index }).unwrap()
}

#[test]
fn persistent_bytes_per_token_of_spec_section_6() {
    let expected = [
        ("deepseek-llm-67b", 389_120.0),
        ("deepseek-v2", 69_120.0),
        ("deepseek-v3", 70_272.0),
        ("deepseek-v3.2-exp", 48_068.0),
        ("deepseek-v4-flash", 3514.25),
        ("deepseek-v4-pro", 5031.4375),
        ("deepseek-v4.1-flash", 890.0),
    ];
    for (name, bytes) in expected {
        let r = report(name);
        // Exact: every term is entry bytes over a power-of-two ratio.
        assert_eq!(r.persistent_bytes_per_token, bytes, "{name}");
        let rows: f64 = r
            .layers
            .iter()
            .map(|l| l.global_bytes_per_token + l.index_bytes_per_token)
            .sum();
        assert_eq!(rows, bytes, "{name}: rows must add up");
        assert_eq!(r.levers.after_storage_format, bytes, "{name}");
    }
    assert_eq!(
        format!(
            "{:.1}",
            report("deepseek-v4-pro").persistent_bytes_per_token
        ),
        "5031.4"
    );
}

#[test]
fn spec_ratios() {
    let pairs = [
        ("deepseek-llm-67b", "deepseek-v4.1-flash", "437.2"),
        ("deepseek-v4-flash", "deepseek-v4.1-flash", "3.95"),
        ("deepseek-v3.2-exp", "deepseek-v4-pro", "9.55"),
        ("deepseek-v3.2-exp", "deepseek-v4-flash", "13.68"),
    ];
    for (first, second, shown) in pairs {
        let rows = compare(&[report(first), report(second)]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].display, "1.00");
        assert_eq!(rows[1].display, shown, "{first} / {second}");
        assert_eq!(
            rows[1].times_smaller_than_first,
            rows[0].persistent_bytes_per_token / rows[1].persistent_bytes_per_token
        );
    }
    assert!(compare(&[]).is_empty());
    assert_eq!(format_ratio(389_120.0 / 890.0), "437.2");
}

#[test]
fn entry_sizes_in_reports_match_the_firmware_formats() {
    let r = report("deepseek-v4.1-flash");
    assert_eq!(r.formats.global, GlobalFormat::Fp4);
    assert_eq!(r.formats.global_entry_bytes, GlobalFp4Entry::BYTES as u64);
    assert_eq!(r.formats.index, Some(IndexFormat::Mxfp4));
    assert_eq!(
        r.formats.index_entry_bytes,
        Some(IndexMxfp4Entry::BYTES as u64)
    );
    assert_eq!(r.formats.window, Some(GlobalFormat::Fp8));
    assert_eq!(
        r.formats.window_entry_bytes,
        Some(WindowFp8Entry::BYTES as u64)
    );

    let r = report("deepseek-v3.2-exp");
    assert_eq!(r.formats.global_entry_bytes, 656);
    assert_eq!(r.formats.index_entry_bytes, Some(132));
    assert_eq!(r.formats.window, None);

    for name in ["deepseek-v4-flash", "deepseek-v4-pro"] {
        let r = report(name);
        assert_eq!(r.formats.global_entry_bytes, 584);
        assert_eq!(r.formats.index_entry_bytes, Some(68));
        assert_eq!(r.formats.window_entry_bytes, Some(584));
    }
    assert_eq!(report("deepseek-v2").formats.global_entry_bytes, 1152);
    assert_eq!(report("deepseek-v2").formats.index, None);
    // GQA: K and V of 8 heads x 128 dims in BF16.
    assert_eq!(report("deepseek-llm-67b").formats.global_entry_bytes, 4096);
}

#[test]
fn v41_rows() {
    let r = report("deepseek-v4.1-flash");
    assert_eq!(r.generation, Generation::V41Csa2);
    assert_eq!(r.layers.len(), 40);
    assert_eq!(r.speculative_layers_excluded, 3);
    for row in &r.layers {
        match row.layer {
            2 | 8 | 14 => {
                assert_eq!(row.mode, LayerMode::Full);
                assert_eq!(row.global_bytes_per_token, 144.0);
                assert_eq!(row.index_bytes_per_token, 34.0);
            }
            20 => {
                assert_eq!(row.global_bytes_per_token, 288.0);
                assert_eq!(row.index_bytes_per_token, 68.0);
            }
            _ => {
                assert_ne!(row.mode, LayerMode::Full);
                assert_eq!(row.global_entry_bytes + row.index_entry_bytes, 0);
                assert_eq!(row.global_bytes_per_token + row.index_bytes_per_token, 0.0);
            }
        }
    }
    let uses: Vec<usize> = r
        .layers
        .iter()
        .filter(|l| l.uses_candidates)
        .map(|l| l.layer)
        .collect();
    assert_eq!(uses, [24, 28, 32, 36]);
}

#[test]
fn per_sequence_constant() {
    let r = report("deepseek-v4.1-flash");
    // 40 layers x 128 tokens x 528 B; the 3 speculative layers are excluded.
    assert_eq!(r.window_bytes, 2_703_360);
    assert_eq!(r.window_bytes, 40 * 128 * WindowFp8Entry::BYTES as u64);
    // One pending token (kv + gate, 2 x 512 f32) per ratio-2 KV source (2, 8, 14).
    assert_eq!(r.pending_state_bytes, 3 * 4096);
    assert_eq!(r.per_sequence_bytes, 2_703_360 + 12_288);
    assert!(!r.per_sequence_is_approximate);

    let r = report("deepseek-v4-flash");
    assert_eq!(r.window_bytes, 43 * 128 * 584);
    // ratio - 1 pending tokens of 4096 B per compressed layer: 21 x 3 + 20 x 127.
    assert_eq!(r.pending_state_bytes, (21 * 3 + 20 * 127) * 4096);
    assert!(r.per_sequence_is_approximate);
    assert!(r.notes.iter().any(|n| n.contains("approximate")));

    for name in [
        "deepseek-llm-67b",
        "deepseek-v2",
        "deepseek-v3",
        "deepseek-v3.2-exp",
    ] {
        let r = report(name);
        assert_eq!(
            (r.per_sequence_bytes, r.window_bytes, r.pending_state_bytes),
            (0, 0, 0)
        );
    }
}

#[test]
fn bytes_at_context() {
    let r = report("deepseek-v4.1-flash");
    assert_eq!(r.bytes_at_context(1_000_000), 890_000_000);
    assert_eq!(r.bytes_at_context(0), 0);
    // An odd context: the ratio-2 sources hold floor(T/2) entries.
    assert_eq!(r.bytes_at_context(3), 3 * 356 + 3 * 356);
    assert_eq!(r.gib_at_context(1 << 20), (890u64 << 20) as f64 / GIB);
    assert_eq!(
        r.total_bytes_at_context(1_000_000),
        890_000_000 + r.per_sequence_bytes
    );
    assert_eq!(
        report("deepseek-llm-67b").bytes_at_context(1000),
        389_120_000
    );
    // V4-Flash HCA layers hold floor(T/128) entries.
    let v4 = report("deepseek-v4-flash");
    assert_eq!(v4.bytes_at_context(128), 21 * 32 * 652 + 20 * 584);
    assert_eq!(v4.bytes_at_context(u64::MAX), u64::MAX);
}

#[test]
fn format_overrides() {
    let bf16 = report_with("deepseek-v4.1-flash", Some(GlobalFormat::Bf16), None);
    assert_eq!(
        bf16.persistent_bytes_per_token,
        3.0 * (1024.0 + 68.0) / 2.0 + (1024.0 + 68.0)
    );
    assert_eq!(bf16.persistent_bytes_per_token, 2730.0);
    let fp8 = report_with("deepseek-v4.1-flash", Some(GlobalFormat::Fp8), None);
    assert_eq!(
        fp8.persistent_bytes_per_token,
        3.0 * (528.0 + 68.0) / 2.0 + (528.0 + 68.0)
    );
    let idx = report_with("deepseek-v4.1-flash", None, Some(IndexFormat::Fp8));
    assert_eq!(
        idx.persistent_bytes_per_token,
        3.0 * (288.0 + 132.0) / 2.0 + (288.0 + 132.0)
    );
    // The window format never changes.
    assert_eq!(bf16.window_bytes, 2_703_360);

    // V3.2 with BF16 global entries: 61 x (1152 + 132).
    let v32 = report_with("deepseek-v3.2-exp", Some(GlobalFormat::Bf16), None);
    assert_eq!(v32.persistent_bytes_per_token, 61.0 * (1152.0 + 132.0));
    // V4-Flash with FP4: 21 x (288 + 68) / 4 + 20 x 288 / 128.
    let v4 = report_with("deepseek-v4-flash", Some(GlobalFormat::Fp4), None);
    assert_eq!(
        v4.persistent_bytes_per_token,
        21.0 * 356.0 / 4.0 + 20.0 * 288.0 / 128.0
    );
    // GQA in FP8: K and V of 8 heads, each 128 FP8 + 4 scale bytes.
    let gqa = report_with("deepseek-llm-67b", Some(GlobalFormat::Fp8), None);
    assert_eq!(gqa.persistent_bytes_per_token, 95.0 * 16.0 * 132.0);

    // An index override on a model without an indexer is ignored, with a note.
    let v2 = report_with("deepseek-v2", None, Some(IndexFormat::Fp8));
    assert_eq!(v2.persistent_bytes_per_token, 69_120.0);
    assert_eq!(v2.formats.index, None);
    assert!(
        v2.notes.iter().any(|n| n.contains("ignored")),
        "{:?}",
        v2.notes
    );

    // A RoPE-splitting format cannot describe GQA keys.
    let err = CacheReport::compute(
        &cfg("deepseek-llm-67b"),
        &FormatOverrides {
            global: Some(GlobalFormat::Fp8Mla),
            index: None,
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::FormatNotApplicable { .. }), "{err:?}");

    // The CLI spellings parse.
    assert_eq!("bf16".parse::<GlobalFormat>().unwrap(), GlobalFormat::Bf16);
    assert_eq!("fp8".parse::<GlobalFormat>().unwrap(), GlobalFormat::Fp8);
    assert_eq!("fp4".parse::<GlobalFormat>().unwrap(), GlobalFormat::Fp4);
    assert_eq!("fp8".parse::<IndexFormat>().unwrap(), IndexFormat::Fp8);
    assert_eq!("mxfp4".parse::<IndexFormat>().unwrap(), IndexFormat::Mxfp4);
}

#[test]
fn levers_chain() {
    let r = report("deepseek-v4.1-flash");
    let l = r.levers;
    assert_eq!(l.baseline_bytes_per_token, 40.0 * 64.0 * 2.0 * 512.0 * 2.0);
    assert_eq!(
        l.after_entry_sharing,
        2.0 * 1024.0 + 38.0 * (1024.0 + 256.0)
    );
    assert_eq!(
        l.after_sequence_compression,
        18.0 * 1280.0 / 2.0 + 20.0 * 1280.0
    );
    assert_eq!(l.after_cross_layer_sharing, 3.0 * 1280.0 / 2.0 + 1280.0);
    assert_eq!(l.after_storage_format, 890.0);
    assert_eq!(l.cross_layer_sharing, 37_120.0 / 3_200.0);
    assert_eq!(l.storage_format, 3_200.0 / 890.0);
    assert_eq!(l.total, l.baseline_bytes_per_token / 890.0);

    let v1 = report("deepseek-llm-67b").levers;
    assert_eq!(v1.entry_sharing, 8.0); // 64 query heads over 8 KV heads
    assert_eq!(
        (
            v1.sequence_compression,
            v1.cross_layer_sharing,
            v1.storage_format
        ),
        (1.0, 1.0, 1.0)
    );
    let v4 = report("deepseek-v4-flash").levers;
    assert_eq!(v4.cross_layer_sharing, 1.0);
    assert_eq!(
        v4.after_sequence_compression,
        21.0 * 1280.0 / 4.0 + 20.0 * 1024.0 / 128.0
    );

    for name in ALL {
        let l = report(name).levers;
        let rel = (l.product() - l.total).abs() / l.total;
        assert!(rel < 1e-12, "{name}: {} vs {}", l.product(), l.total);
        assert!(l.entry_sharing >= 1.0 && l.sequence_compression >= 1.0);
        assert!(l.cross_layer_sharing >= 1.0 && l.storage_format >= 1.0);
    }
}

#[test]
fn speculative_entries_do_not_count() {
    let mut v = value("deepseek-v4.1-flash");
    v["compress_ratios"][40] = json!(2);
    v["compress_ratios"][42] = json!(1);
    let r = CacheReport::compute(
        &ModelConfig::from_value(&v).unwrap(),
        &FormatOverrides::default(),
    )
    .unwrap();
    assert_eq!(r.persistent_bytes_per_token, 890.0);
    assert_eq!(
        r.per_sequence_bytes,
        report("deepseek-v4.1-flash").per_sequence_bytes
    );
    assert!(r.notes.iter().any(|n| n.contains("speculative")));

    let mut v = value("deepseek-v4-flash");
    v["compress_ratios"][43] = json!(4);
    let r = CacheReport::compute(
        &ModelConfig::from_value(&v).unwrap(),
        &FormatOverrides::default(),
    )
    .unwrap();
    assert_eq!(r.persistent_bytes_per_token, 3514.25);
}

#[test]
fn tiny_csa2_model() {
    for file in ["config.json", "model_config.json"] {
        let c = ModelConfig::from_file(format!("{CSA2}/{file}")).unwrap();
        let r = CacheReport::compute(&c, &FormatOverrides::default()).unwrap();
        // head_dim 64: FP4 32 + 4 = 36 B; index_head_dim 32: MXFP4 16 + 1 = 17 B.
        assert_eq!(r.formats.global_entry_bytes, 36, "{file}");
        assert_eq!(r.formats.index_entry_bytes, Some(17), "{file}");
        // Sources 2 (ratio 2) and 5 (ratio 1).
        assert_eq!(r.persistent_bytes_per_token, 53.0 / 2.0 + 53.0, "{file}");
        // 8 layers x 16 tokens x (64 FP8 + 2 scales); one pending token of 2 x 64 f32 at layer 2.
        assert_eq!(r.window_bytes, 8 * 16 * 66, "{file}");
        assert_eq!(r.pending_state_bytes, 512, "{file}");
        assert_eq!(r.speculative_layers_excluded, 0);
    }
}

#[test]
fn report_serializes() {
    let r = report("deepseek-v4.1-flash");
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["generation"], "v4.1-csa2");
    assert_eq!(v["persistent_bytes_per_token"], 890.0);
    assert_eq!(v["per_sequence_bytes"], 2_715_648);
    assert_eq!(v["formats"]["global"], "fp4");
    assert_eq!(v["layers"][24]["mode"], "reindex");
    assert_eq!(v["layers"][24]["side"], "decoder");
    assert_eq!(v["layers"][0]["mode"], "window-only");
    assert_eq!(v["detection"]["by"]["by"], "model-type");
    assert!(v["levers"]["cross_layer_sharing"].as_f64().unwrap() > 11.0);
}

proptest! {
    /// For every config and every override, the levers telescope and the exact per-context
    /// bytes stay within one entry per owning layer of `persistent x tokens`.
    #[test]
    fn levers_and_context_bytes_are_consistent(
        which in 0..ALL.len(),
        global in proptest::option::of(0..3usize),
        index in proptest::option::of(0..3usize),
        tokens in 0u64..10_000_000,
    ) {
        let global = global.map(|g| [GlobalFormat::Bf16, GlobalFormat::Fp8, GlobalFormat::Fp4][g]);
        let index = index.map(|i| IndexFormat::ALL[i]);
        let r = report_with(ALL[which], global, index);
        let l = r.levers;
        prop_assert!(((l.product() - l.total) / l.total).abs() < 1e-12);
        let exact = r.bytes_at_context(tokens) as f64;
        let linear = r.persistent_bytes_per_token * tokens as f64;
        let slack: u64 = r.layers.iter().map(|x| x.global_entry_bytes + x.index_entry_bytes).sum();
        prop_assert!(exact <= linear + 1e-6 * linear);
        prop_assert!(exact + slack as f64 >= linear - 1e-6 * linear);
    }
}
