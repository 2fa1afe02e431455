//! Malformed weights, vectors and configs give errors that name the tensor (or config
//! field) and the expected shape or dtype.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvstack_model::attention::Csa2Attention;
use kvstack_model::attention::verify::{VerifyOptions, verify_attention};
use safetensors::tensor::{Dtype, TensorView};

fn vectors() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/vectors/csa2"
    ))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvstack-attention-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// (dtype, shape, bytes) of every tensor of a file.
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(n, v)| {
            (
                n.to_owned(),
                (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
            )
        })
        .collect()
}

fn write(tensors: &Tensors, name: &str) -> PathBuf {
    let path = scratch(name);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

fn load_err(weights: &Path) -> String {
    let e = Csa2Attention::from_files(&vectors().join("config.json"), weights).unwrap_err();
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(" / ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

#[test]
fn missing_weight_names_the_tensor_and_shape() {
    let mut t = read(&vectors().join("attn_weights.safetensors"));
    t.remove("layers.2.attn.compressor.wgate.weight").unwrap();
    let msg = load_err(&write(&t, "missing.safetensors"));
    assert!(
        msg.contains("`layers.2.attn.compressor.wgate.weight` is missing"),
        "{msg}"
    );
    assert!(msg.contains("F32 [64, 128]"), "{msg}");
}

#[test]
fn wrong_weight_shape_names_both_shapes() {
    let mut t = read(&vectors().join("attn_weights.safetensors"));
    t.get_mut("layers.0.attn.wq_a.weight").unwrap().1 = vec![128, 64];
    let msg = load_err(&write(&t, "shape.safetensors"));
    assert!(
        msg.contains("`layers.0.attn.wq_a.weight` has shape [128, 64], expected [64, 128]"),
        "{msg}"
    );
}

#[test]
fn wrong_weight_dtype_names_the_dtypes() {
    let mut t = read(&vectors().join("attn_weights.safetensors"));
    let e = t.get_mut("layers.5.attn.indexer.wk.weight").unwrap();
    // Same bytes as 16-bit values: twice as many elements.
    e.0 = Dtype::BF16;
    e.1 = vec![32, 128];
    let msg = load_err(&write(&t, "dtype.safetensors"));
    assert!(
        msg.contains(
            "`layers.5.attn.indexer.wk.weight` has dtype BF16, expected F32 (shape [32, 64])"
        ),
        "{msg}"
    );
}

#[test]
fn garbage_files_are_format_errors() {
    let path = scratch("garbage.safetensors");
    std::fs::write(&path, b"not a safetensors file at all").unwrap();
    let msg = load_err(&path);
    assert!(msg.contains("not a valid safetensors file"), "{msg}");
    let full = std::fs::read(vectors().join("attn_weights.safetensors")).unwrap();
    let cut = scratch("truncated.safetensors");
    std::fs::write(&cut, &full[..full.len() - 100]).unwrap();
    assert!(load_err(&cut).contains("not a valid safetensors file"));
    assert!(load_err(&scratch("does-not-exist.safetensors")).contains("cannot open"));
}

#[test]
fn both_checkpoint_namings_load_the_same_weights() {
    // NeMo (`model.layers.*`, `sinks_param.weight`) and released (`layers.*`, `attn_sink`).
    let cfg = vectors().join("config.json");
    let nemo =
        Csa2Attention::from_files(&cfg, &vectors().join("model_weights.safetensors")).unwrap();
    let released =
        Csa2Attention::from_files(&cfg, &vectors().join("model_weights.released.safetensors"))
            .unwrap();
    assert_eq!(nemo.weights(), released.weights());
}

fn config_with(edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let text = std::fs::read_to_string(vectors().join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    let path = scratch(&format!("config-{}.json", rand_suffix()));
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
    path
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn config_err(cfg: &Path) -> String {
    let e =
        Csa2Attention::from_files(cfg, &vectors().join("attn_weights.safetensors")).unwrap_err();
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(" / ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

#[test]
fn malformed_configs_name_the_field() {
    let c = config_with(|v| v["head_dim"] = 48.into());
    assert!(
        config_err(&c).contains("`head_dim` is invalid"),
        "{}",
        config_err(&c)
    );
    let c = config_with(|v| {
        v.as_object_mut().unwrap().remove("compress_rope_theta");
    });
    assert!(config_err(&c).contains("`compress_rope_theta` is missing"));
    let c = config_with(|v| {
        v.as_object_mut().unwrap().remove("q_lora_rank");
    });
    assert!(config_err(&c).contains("`q_lora_rank` is missing"));
    let c = config_with(|v| v["o_groups"] = 3.into());
    assert!(config_err(&c).contains("`o_groups` is invalid"));
    let c = config_with(|v| v["index_head_dim"] = 40.into());
    assert!(config_err(&c).contains("`index_head_dim` is invalid"));
    // A config of another shape than the weights: the first mismatching tensor is named.
    let c = config_with(|v| v["q_lora_rank"] = 96.into());
    assert!(
        config_err(&c)
            .contains("`layers.0.attn.wq_a.weight` has shape [64, 128], expected [96, 128]")
    );
}

fn verify_err(vectors_file: &Path) -> String {
    let e = verify_attention(
        &vectors().join("config.json"),
        &vectors().join("attn_weights.safetensors"),
        vectors_file,
        &VerifyOptions::default(),
    )
    .unwrap_err();
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(" / ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

#[test]
fn malformed_vectors_name_the_tensor() {
    let base = read(&vectors().join("attn_vectors.safetensors"));
    // A small dump: the inputs of every layer only, truncated to 20 tokens.
    let mut small: Tensors = base
        .iter()
        .filter(|(n, _)| n.ends_with(".input"))
        .map(|(n, (d, _, b))| {
            (
                n.clone(),
                (*d, vec![1, 20, 128], b[..20 * 128 * 4].to_vec()),
            )
        })
        .collect();
    let ok = write(&small, "vectors-inputs-only.safetensors");
    let report = verify_attention(
        &vectors().join("config.json"),
        &vectors().join("attn_weights.safetensors"),
        &ok,
        &VerifyOptions::default(),
    )
    .unwrap();
    assert!(
        report.stages.is_empty() && !report.skipped.is_empty(),
        "nothing to compare, everything noted as skipped"
    );

    let mut bad = small.clone();
    bad.get_mut("layers.0.input").unwrap().1 = vec![1, 40, 64];
    let msg = verify_err(&write(&bad, "vectors-bad-input.safetensors"));
    assert!(
        msg.contains("`layers.0.input` has shape [1, 40, 64], expected [1, T, 128]"),
        "{msg}"
    );

    bad = small.clone();
    bad.get_mut("layers.3.input").unwrap().1 = vec![1, 10, 256];
    let msg = verify_err(&write(&bad, "vectors-bad-layer3.safetensors"));
    assert!(
        msg.contains("`layers.3.input` has shape [1, 10, 256], expected [1, 20, 128]"),
        "{msg}"
    );

    bad = small.clone();
    bad.remove("layers.4.input");
    let msg = verify_err(&write(&bad, "vectors-missing.safetensors"));
    assert!(
        msg.contains("`layers.4.input` is missing (expected F32 [1, 20, 128])"),
        "{msg}"
    );

    // A recorded stage with the wrong dtype.
    let (_, _, idx) = base.get("layers.2.topk_indices").unwrap();
    small.insert(
        "layers.2.topk_indices".into(),
        (Dtype::F32, vec![1, 20, 32], idx[..20 * 16 * 8].to_vec()),
    );
    let msg = verify_err(&write(&small, "vectors-dtype.safetensors"));
    assert!(
        msg.contains("`layers.2.topk_indices` has dtype F32, expected I64 (shape [1, 20, 16])"),
        "{msg}"
    );
}
