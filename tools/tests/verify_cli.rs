//! `kvstack verify attention` and `kvstack verify model` end to end: pass on
//! `testdata/vectors/csa2`, exit non-zero on a failed comparison and on malformed input, naming
//! what is wrong; the model's teacher-forced mode and the end-to-end cache-flip table.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn csa2(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/vectors/csa2")
        .join(name)
        .display()
        .to_string()
}

fn verify(extra: &[&str], weights: &str) -> Output {
    let config = csa2("config.json");
    let vectors = csa2("attn_vectors.safetensors");
    let mut args = vec![
        "verify",
        "attention",
        "--config",
        &config,
        "--weights",
        weights,
        "--vectors",
        &vectors,
    ];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args(&args)
        .output()
        .expect("run kvstack")
}

#[test]
fn verify_attention_passes_on_the_shared_vectors() {
    let o = verify(&[], &csa2("attn_weights.safetensors"));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("PASS"), "{out}");
    // One line per layer, pass and stage; e.g. layer 7's candidate-masked scores.
    assert!(
        out.lines()
            .any(|l| l.starts_with("chain") && l.contains("index_scores_after_candidates")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("stage") && l.contains("topk_indices")),
        "{out}"
    );

    let o = verify(
        &["--json", "--pass", "stage"],
        &csa2("attn_weights.safetensors"),
    );
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], 300);
    assert!(
        v["stages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["pass"] == "stage" && s["passed"] == true)
    );
}

#[test]
fn verify_attention_fails_with_a_nonzero_exit() {
    // An impossible tolerance: f32 stages fail, the exit status says so.
    let o = verify(
        &["--rel-tol", "1e-12", "--pass", "chain"],
        &csa2("attn_weights.safetensors"),
    );
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("FAIL") && out.contains(" NO"), "{out}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("out of tolerance"));

    // Weights of another model (the tiny whole model): the chain disagrees everywhere.
    let o = verify(&["--pass", "chain"], &csa2("model_weights.safetensors"));
    assert_eq!(o.status.code(), Some(1));

    // A missing file is named.
    let missing = PathBuf::from(csa2("no-such-weights.safetensors"))
        .display()
        .to_string();
    let o = verify(&[], &missing);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no-such-weights.safetensors"));
}

fn verify_model(extra: &[&str]) -> Output {
    let (config, weights, vectors) = (
        csa2("model_config.json"),
        csa2("model_weights.released.safetensors"),
        csa2("model_vectors.safetensors"),
    );
    let mut args = vec![
        "verify",
        "model",
        "--config",
        &config,
        "--weights",
        &weights,
        "--vectors",
        &vectors,
    ];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args(&args)
        .output()
        .expect("run kvstack")
}

#[test]
fn verify_model_runs_both_modes_and_names_cache_flips_by_layer() {
    // Teacher-forced: every block on the reference's own inputs.
    let o = verify_model(&["--teacher-forced", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tensors = v["tensors"].as_array().unwrap();
    assert!(tensors.iter().all(|t| t["pass"] == "teacher-forced"));
    assert!(tensors.iter().any(|t| t["name"] == "layers.6.streams_out"));
    assert!(
        tensors
            .iter()
            .any(|t| t["name"] == "logits(reference final_hidden)")
    );
    assert!(v["cache_flips"].as_array().unwrap().is_empty());

    // End to end: the flips table, one row per layer and kind, with layer 2's compressed rows.
    let o = verify_model(&[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("PASS"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("layer  2 compressed")),
        "{out}"
    );
    let o = verify_model(&["--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let flips = v["cache_flips"].as_array().unwrap();
    assert_eq!(
        flips.iter().filter(|f| f["kind"] == "window").count(),
        8,
        "{flips:?}"
    );
    assert!(
        flips
            .iter()
            .all(|f| f["differ"].as_u64() <= f["elements"].as_u64())
    );
}
