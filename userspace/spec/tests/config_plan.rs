//! Config parsing and layer plans over the released configs in `shared/spec/configs` and the
//! tiny CSA2 model of `shared/vectors/csa2`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_spec::config::DetectedBy;
use kvstack_spec::plan::V4_CSA_RATIO;
use kvstack_spec::{
    Error, Generation, LayerMode, LayerPlan, LayerSpec, ModelConfig, PlanKind, Side,
};
use serde_json::{Value, json};

const CONFIGS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/configs");
const CSA2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/vectors/csa2");

fn spec_path(name: &str) -> String {
    format!("{CONFIGS}/{name}.json")
}

fn spec_value(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(spec_path(name)).unwrap()).unwrap()
}

fn spec(name: &str) -> ModelConfig {
    ModelConfig::from_file(spec_path(name)).unwrap()
}

fn v41_plan_of(value: &Value) -> Result<LayerPlan, Error> {
    LayerPlan::csa2(&ModelConfig::from_value(value).unwrap())
}

#[test]
fn every_config_parses_and_is_detected_by_model_type() {
    let expected = [
        ("deepseek-llm-67b", Generation::Gqa, 95),
        ("deepseek-v2", Generation::Mla, 60),
        ("deepseek-v3", Generation::Mla, 61),
        ("deepseek-v3.2-exp", Generation::MlaIndexer, 61),
        ("deepseek-v4-flash", Generation::V4Compressed, 43),
        ("deepseek-v4-pro", Generation::V4Compressed, 61),
        ("deepseek-v4.1-flash", Generation::V41Csa2, 40),
    ];
    let mut files: Vec<String> = std::fs::read_dir(CONFIGS)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".json"))
        .collect();
    files.sort();
    assert_eq!(files.len(), expected.len(), "{files:?}");
    for (name, generation, layers) in expected {
        let cfg = spec(name);
        let d = cfg.detect().unwrap();
        assert_eq!(d.generation, generation, "{name}");
        assert!(matches!(d.by, DetectedBy::ModelType { .. }), "{name}");
        assert_eq!(cfg.num_hidden_layers().unwrap(), layers, "{name}");
        assert!(!cfg.nested);
        // Every config plans.
        LayerPlan::from_config(&cfg).unwrap();
    }
}

#[test]
fn v41_fields_match_spec_section_2() {
    let c = spec("deepseek-v4.1-flash");
    assert_eq!(c.hidden_size().unwrap(), 5120);
    assert_eq!(c.num_attention_heads().unwrap(), 64);
    assert_eq!(c.num_key_value_heads().unwrap(), 1);
    assert_eq!(c.head_dim().unwrap(), 512);
    assert_eq!(c.qk_rope_head_dim().unwrap(), 64);
    assert_eq!(c.q_lora_rank, Some(1280));
    assert_eq!(c.o_groups, Some(8));
    assert_eq!(c.o_lora_rank, Some(1024));
    assert_eq!(c.sliding_window().unwrap(), 128);
    assert_eq!(c.index_n_heads().unwrap(), 32);
    assert_eq!(c.index_head_dim().unwrap(), 128);
    assert_eq!(c.index_topk, Some(512));
    assert_eq!(c.candidate_source_layer_id().unwrap(), 20);
    assert_eq!(c.candidate_topk_blocks, Some(2048));
    assert_eq!(c.candidate_block_size, Some(8));
    assert_eq!(c.kv_source_layer_ids().unwrap(), &[2, 8, 14, 20]);
    assert_eq!(
        c.index_source_layer_ids().unwrap(),
        &[2, 8, 14, 20, 24, 28, 32, 36]
    );
    assert_eq!(c.compress_rope_theta, Some(160_000.0));
    let rope = c.rope_scaling.as_ref().unwrap();
    assert_eq!(rope.kind.as_deref(), Some("yarn"));
    assert_eq!(rope.factor, Some(16.0));
    assert_eq!(rope.original_max_position_embeddings, Some(65536));
    assert_eq!(c.rms_norm_eps, Some(1e-20));
    assert_eq!(c.hc_mult, Some(4));
    assert_eq!(c.engram_layer_ids.as_deref(), Some(&[1, 14][..]));
    assert_eq!(c.vocab_size, Some(129_280));
}

/// `compress_ratios` carries one extra entry per speculative layer; the extra entries are 0 and
/// only the first `num_hidden_layers` describe the persistent cache.
#[test]
fn compress_ratios_surplus_is_the_speculative_layers() {
    for (name, layers, nextn, total) in [
        ("deepseek-v4.1-flash", 40, 3, 43),
        ("deepseek-v4-flash", 43, 1, 44),
        ("deepseek-v4-pro", 61, 1, 62),
    ] {
        let c = spec(name);
        assert_eq!(c.num_hidden_layers().unwrap(), layers, "{name}");
        assert_eq!(c.num_nextn_predict_layers(), nextn, "{name}");
        assert_eq!(c.compress_ratios().unwrap().len(), total, "{name}");
        assert_eq!(c.layer_compress_ratios().unwrap().len(), layers, "{name}");
        let spec_layers = c.speculative_compress_ratios().unwrap();
        assert_eq!(spec_layers.len(), nextn, "{name}");
        assert!(spec_layers.iter().all(|&m| m == 0), "{name}");
        assert_eq!(LayerPlan::from_config(&c).unwrap().layers.len(), layers);
    }
}

/// The released plan, written out from the prose of spec §4 (not from the config).
fn released_v41_plan() -> Vec<LayerSpec> {
    let mut out = Vec::new();
    for i in 0..40usize {
        let side = Some(if i < 20 { Side::Encoder } else { Side::Decoder });
        let spec = if i < 2 {
            LayerSpec {
                index: i,
                compress_ratio: 0,
                side,
                mode: LayerMode::WindowOnly,
                kv_source: None,
                index_source: None,
                is_candidate_source: false,
                uses_candidates: false,
            }
        } else if i < 20 {
            // Encoder: three groups of six (1 Full + 5 Reuse) starting at 2, 8, 14, ratio 2.
            let group_start = 2 + (i - 2) / 6 * 6;
            LayerSpec {
                index: i,
                compress_ratio: 2,
                side,
                mode: if i == group_start {
                    LayerMode::Full
                } else {
                    LayerMode::Reuse
                },
                kv_source: Some(group_start),
                index_source: Some(group_start),
                is_candidate_source: false,
                uses_candidates: false,
            }
        } else {
            // Decoder: five groups of four starting at 20, 24, 28, 32, 36, ratio 1; 20 is Full,
            // the other group heads are Reindex; the rest Reuse. KV always from 20.
            let group_start = 20 + (i - 20) / 4 * 4;
            let mode = if i == 20 {
                LayerMode::Full
            } else if i == group_start {
                LayerMode::Reindex
            } else {
                LayerMode::Reuse
            };
            LayerSpec {
                index: i,
                compress_ratio: 1,
                side,
                mode,
                kv_source: Some(20),
                index_source: Some(group_start),
                is_candidate_source: i == 20,
                uses_candidates: mode == LayerMode::Reindex,
            }
        };
        out.push(spec);
    }
    out
}

#[test]
fn v41_plan_is_the_released_plan() {
    let plan = LayerPlan::from_config(&spec("deepseek-v4.1-flash")).unwrap();
    assert_eq!(plan.kind, PlanKind::Csa2);
    assert_eq!(plan.layers, released_v41_plan());
    let full: Vec<usize> = plan.kv_sources().map(|l| l.index).collect();
    assert_eq!(full, [2, 8, 14, 20]);
    let reindex: Vec<usize> = plan
        .layers
        .iter()
        .filter(|l| l.mode == LayerMode::Reindex)
        .map(|l| l.index)
        .collect();
    assert_eq!(reindex, [24, 28, 32, 36]);
    assert_eq!(
        plan.layers
            .iter()
            .filter(|l| l.mode == LayerMode::Reuse)
            .count(),
        15 + 15
    );
}

#[test]
fn tiny_csa2_configs_plan_as_their_readme_says() {
    let flat = ModelConfig::from_file(format!("{CSA2}/config.json")).unwrap();
    let nested = ModelConfig::from_file(format!("{CSA2}/model_config.json")).unwrap();

    // config.json has no model_type: detected by structure.
    let d = flat.detect().unwrap();
    assert_eq!(d.generation, Generation::V41Csa2);
    assert_eq!(
        d.by,
        DetectedBy::Structure {
            model_type: None,
            marker: "kv_source_layer_ids"
        }
    );
    // model_config.json: the nested text model's model_type, not the wrapper's.
    assert!(nested.nested);
    assert_eq!(nested.model_type.as_deref(), Some("deepseek_v41_text"));
    assert_eq!(nested.wrapper_model_type.as_deref(), Some("deepseek_v41"));
    assert_eq!(nested.hidden_size, Some(128)); // not the vision config's 1024
    assert_eq!(
        nested.detect().unwrap().by,
        DetectedBy::ModelType {
            model_type: "deepseek_v41_text".into()
        }
    );

    let a = LayerPlan::from_config(&flat).unwrap();
    let b = LayerPlan::from_config(&nested).unwrap();
    assert_eq!(a, b);
    let modes: Vec<LayerMode> = a.layers.iter().map(|l| l.mode).collect();
    use LayerMode::*;
    assert_eq!(
        modes,
        [
            WindowOnly, WindowOnly, Full, Reuse, Reuse, Full, Reuse, Reindex
        ]
    );
    let sides: Vec<Side> = a.layers.iter().map(|l| l.side.unwrap()).collect();
    assert_eq!(sides[3], Side::Encoder);
    assert_eq!(sides[4], Side::Decoder);
    assert!(a.layers[5].is_candidate_source);
    let users: Vec<usize> = a
        .layers
        .iter()
        .filter(|l| l.uses_candidates)
        .map(|l| l.index)
        .collect();
    assert_eq!(users, [7]);
    // Layer 4 (ratio 2, decoder side) still reads layer 2's KV; 6 reads 5's.
    assert_eq!(a.layers[4].kv_source, Some(2));
    assert_eq!(a.layers[6].kv_source, Some(5));
    assert_eq!(a.layers[6].index_source, Some(5));
    assert_eq!(a.layers[7].kv_source, Some(5));
    assert_eq!(a.layers[7].index_source, Some(7));
}

#[test]
fn v4_plans_have_one_source_per_compressed_layer() {
    for (name, csa, hca, window_only) in [
        ("deepseek-v4-flash", 21, 20, 2),
        ("deepseek-v4-pro", 30, 31, 0),
    ] {
        let plan = LayerPlan::from_config(&spec(name)).unwrap();
        assert_eq!(plan.kind, PlanKind::V4Compressed);
        let count = |f: &dyn Fn(&LayerSpec) -> bool| plan.layers.iter().filter(|l| f(l)).count();
        assert_eq!(count(&|l| l.compress_ratio == V4_CSA_RATIO), csa, "{name}");
        assert_eq!(count(&|l| l.compress_ratio == 128), hca, "{name}");
        assert_eq!(
            count(&|l| l.mode == LayerMode::WindowOnly),
            window_only,
            "{name}"
        );
        for l in &plan.layers {
            if l.compress_ratio > 0 {
                assert_eq!(l.kv_source, Some(l.index), "{name} {}", l.index);
                assert!(l.owns_kv());
                assert_eq!(l.owns_index_keys(), l.compress_ratio == V4_CSA_RATIO);
            }
            assert_eq!(l.side, None);
            assert!(!l.uses_candidates);
        }
    }
}

#[test]
fn dense_plans() {
    let plan = LayerPlan::from_config(&spec("deepseek-v3.2-exp")).unwrap();
    assert_eq!(plan.kind, PlanKind::Dense);
    assert_eq!(plan.layers.len(), 61);
    assert!(
        plan.layers
            .iter()
            .all(|l| l.owns_kv() && l.owns_index_keys())
    );
    let plan = LayerPlan::from_config(&spec("deepseek-v2")).unwrap();
    assert!(plan.layers.iter().all(|l| l.owns_kv() && !l.is_indexed()));
}

/// Asserts a plan error for `layer` and `field`, and that the message names both.
fn assert_plan_err(err: Error, layer: usize, field: &str) {
    let msg = err.to_string();
    match &err {
        Error::Plan {
            layer: l, field: f, ..
        } => {
            assert_eq!((*l, f.as_str()), (layer, field), "{msg}");
        }
        other => panic!("expected a plan error for layer {layer} / {field}, got {other:?}"),
    }
    assert!(msg.contains(&format!("layer {layer}")), "{msg}");
    assert!(msg.contains(field), "{msg}");
}

fn v41() -> Value {
    spec_value("deepseek-v4.1-flash")
}

#[test]
fn rule_exactly_one_kv_head() {
    let mut v = v41();
    v["num_key_value_heads"] = json!(8);
    let err = v41_plan_of(&v).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidField { field, .. } if field == "num_key_value_heads"),
        "{err:?}"
    );
    assert!(err.to_string().contains("exactly one KV head"), "{err}");

    v.as_object_mut().unwrap().remove("num_key_value_heads");
    let err = v41_plan_of(&v).unwrap_err();
    assert!(matches!(&err, Error::MissingField { field } if field == "num_key_value_heads"));

    // Nested configs name the field with its path.
    let mut nested: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{CSA2}/model_config.json")).unwrap(),
    )
    .unwrap();
    nested["text_config"]["num_key_value_heads"] = json!(2);
    let err = v41_plan_of(&nested).unwrap_err();
    assert_eq!(err.field(), Some("text_config.num_key_value_heads"));
}

#[test]
fn rule_every_kv_source_is_an_index_source() {
    let mut v = v41();
    v["index_source_layer_ids"] = json!([2, 14, 20, 24, 28, 32, 36]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 8, "index_source_layer_ids");
}

#[test]
fn rule_window_only_layer_is_never_a_source() {
    let mut v = v41();
    v["kv_source_layer_ids"] = json!([1, 2, 8, 14, 20]);
    v["index_source_layer_ids"] = json!([1, 2, 8, 14, 20, 24, 28, 32, 36]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 1, "kv_source_layer_ids");

    let mut v = v41();
    v["index_source_layer_ids"] = json!([0, 2, 8, 14, 20, 24, 28, 32, 36]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 0, "index_source_layer_ids");
}

#[test]
fn rule_compressed_layer_needs_a_preceding_source_with_its_ratio() {
    // Layer 21 switched to ratio 2: its nearest KV source (20) has ratio 1.
    let mut v = v41();
    v["compress_ratios"][21] = json!(2);
    let err = v41_plan_of(&v).unwrap_err();
    assert_plan_err(err, 21, "compress_ratios");

    // No KV source at or before layer 2.
    let mut v = v41();
    v["kv_source_layer_ids"] = json!([8, 14, 20]);
    v["index_source_layer_ids"] = json!([8, 14, 20, 24, 28, 32, 36]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 2, "kv_source_layer_ids");

    // A Reindex layer whose KV source (20) has another ratio.
    let mut v = v41();
    v["compress_ratios"][24] = json!(2);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 24, "compress_ratios");
}

#[test]
fn rule_candidate_source_is_a_full_kv_source() {
    let mut v = v41();
    v["candidate_source_layer_id"] = json!(24); // a Reindex layer
    assert_plan_err(
        v41_plan_of(&v).unwrap_err(),
        24,
        "candidate_source_layer_id",
    );
    v["candidate_source_layer_id"] = json!(40);
    assert_plan_err(
        v41_plan_of(&v).unwrap_err(),
        40,
        "candidate_source_layer_id",
    );

    // Without a candidate source nothing uses candidates.
    v.as_object_mut()
        .unwrap()
        .remove("candidate_source_layer_id");
    let plan = v41_plan_of(&v).unwrap();
    assert!(
        plan.layers
            .iter()
            .all(|l| !l.uses_candidates && !l.is_candidate_source)
    );
}

#[test]
fn rule_source_ids_in_range_and_ascending() {
    let mut v = v41();
    v["kv_source_layer_ids"] = json!([2, 8, 14, 20, 40]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 40, "kv_source_layer_ids");

    let mut v = v41();
    v["kv_source_layer_ids"] = json!([2, 14, 8, 20]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 8, "kv_source_layer_ids");

    let mut v = v41();
    v["index_source_layer_ids"] = json!([2, 8, 14, 20, 24, 24, 28, 32, 36]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 24, "index_source_layer_ids");

    let mut v = v41();
    v["index_source_layer_ids"] = json!([2, 8, 14, 20, 24, 28, 32, 36, 99]);
    assert_plan_err(v41_plan_of(&v).unwrap_err(), 99, "index_source_layer_ids");

    let mut v = v41();
    v["kv_source_layer_ids"] = json!([]);
    let err = v41_plan_of(&v).unwrap_err();
    assert_eq!(err.field(), Some("kv_source_layer_ids"));
}

#[test]
fn rule_compress_ratios_present_and_long_enough() {
    let mut v = v41();
    v.as_object_mut().unwrap().remove("compress_ratios");
    let err = v41_plan_of(&v).unwrap_err();
    assert!(matches!(&err, Error::MissingField { field } if field == "compress_ratios"));

    let mut v = v41();
    v["compress_ratios"].as_array_mut().unwrap().truncate(39);
    let err = v41_plan_of(&v).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidField { field, reason }
            if field == "compress_ratios" && reason.contains("39 entries")),
        "{err:?}"
    );

    let mut v = v41();
    v.as_object_mut().unwrap().remove("index_source_layer_ids");
    let err = v41_plan_of(&v).unwrap_err();
    assert!(matches!(&err, Error::MissingField { field } if field == "index_source_layer_ids"));
}

#[test]
fn missing_files_and_bad_json_name_the_path() {
    let err = ModelConfig::from_file(format!("{CONFIGS}/no-such-model.json")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("no-such-model.json"), "{err}");

    let dir = std::env::temp_dir().join(format!("kvstack-runtime-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("broken.json");
    std::fs::write(
        &path,
        "{\"model_type\": \"llama\",\n \"num_hidden_layers\": }",
    )
    .unwrap();
    let err = ModelConfig::from_file(&path).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    match &err {
        Error::Json { path: p, source } => {
            assert_eq!(p, &path);
            assert_eq!(source.line(), 2);
        }
        other => panic!("expected a JSON error, got {other:?}"),
    }
    assert!(
        err.to_string().contains("broken.json: invalid JSON"),
        "{err}"
    );
}

/// Found by fuzzing (fuzz/corpus/config_plan/crash-c385ffdc...): a layer count of 9e15 (written
/// as a float) made the dense plan ask the allocator for 4.8 TB and abort. It is an error now,
/// for every generation, and the limit itself still plans.
#[test]
fn absurd_layer_counts_are_errors_not_allocations() {
    let fuzzed = r#"{
  "architecures": [
    "LlamaForCausalLM"
  ],
  "model_type": "llama",
  "vocab*size": 204800,
  "hidden_size": 8192,
  "intemoe_intermeze": 200,
  "hidden_size": 8192,
  "intemoe_intermeze": 22017,
  "num_hidden_layers": 9000000000000000000001e-06,
  "ro": "bfloat16"
}"#;
    let cfg = ModelConfig::from_json_str(fuzzed).unwrap();
    let err = LayerPlan::from_config(&cfg).unwrap_err();
    assert!(err.to_string().contains("num_hidden_layers"), "{err}");
    assert!(
        kvstack_spec::CacheReport::compute(&cfg, &kvstack_spec::FormatOverrides::default())
            .is_err()
    );
    let at = |n: usize| {
        ModelConfig::from_value(&json!({
            "num_attention_heads": 8, "hidden_size": 64, "num_hidden_layers": n
        }))
        .unwrap()
    };
    let max = kvstack_spec::config::MAX_LAYERS;
    assert_eq!(LayerPlan::from_config(&at(max)).unwrap().layers.len(), max);
    assert!(LayerPlan::from_config(&at(max + 1)).is_err());
}
