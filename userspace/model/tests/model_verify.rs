//! `verify model` on the tiny reference model of `shared/vectors/csa2` with both weight files
//! (NeMo naming and released naming), CED vs exact prefill, and a seeded checkpoint written in
//! the released storage types (FP8/FP4/BF16) loaded back.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kvstack_kernels::model::argmax;
use kvstack_model::init::{random_model, write_checkpoint};
use kvstack_model::verify::{ModelVerifyOptions, row_errors, verify_model, verify_model_with};
use kvstack_model::weights::TensorFile;
use kvstack_model::{Logits, Model, PrefillMode};
use kvstack_spec::config::ModelConfig;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/vectors/csa2");

fn path(name: &str) -> PathBuf {
    PathBuf::from(DIR).join(name)
}

fn check(weights: &str) {
    let r = verify_model(
        &path("model_config.json"),
        &path(weights),
        &path("model_vectors.safetensors"),
        1e-4,
    )
    .unwrap();
    for t in &r.tensors {
        if !t.passed || t.row_rel > 1e-5 {
            eprintln!(
                "{} {} {} tensor {:e} row {:e} mismatches {}",
                if t.passed { "ok  " } else { "FAIL" },
                t.pass,
                t.name,
                t.max_rel,
                t.row_rel,
                t.mismatches
            );
        }
    }
    let worst_row = r.tensors.iter().fold(0f64, |m, t| m.max(t.row_rel));
    eprintln!("{weights}: worst per-row relative error {worst_row:e}");
    let sel = r.tensors.iter().filter(|t| t.kind == "selection").count();
    eprintln!(
        "{weights}: {} tensors ({} selections), worst relative error {:e}, greedy {}/{}, skipped {:?}",
        r.tensors.len(),
        sel,
        r.worst(),
        r.greedy_agreement,
        r.tokens,
        r.skipped
    );
    assert!(r.passed(), "{weights}: verify model failed");
    assert!(r.skipped.is_empty(), "{:?}", r.skipped);
    // logits, final_hidden, decode logits + per block at least 11 value tensors.
    assert!(r.tensors.len() >= 3 + 8 * 11);
    assert_eq!(r.greedy_agreement, r.tokens);
}

#[test]
fn verify_model_nemo_naming() {
    check("model_weights.safetensors");
}

#[test]
fn verify_model_released_naming() {
    check("model_weights.released.safetensors");
}

/// Teacher forcing: every block fed the reference's own inputs passes at 1e-4 on its own; and
/// the end-to-end pass names, per layer, the quantized cache elements its drift flipped.
#[test]
fn teacher_forced_blocks_pass_and_end_to_end_flips_are_counted() {
    let opts = ModelVerifyOptions {
        rel_tol: 1e-4,
        end_to_end: true,
        teacher_forced: true,
    };
    let r = verify_model_with(
        &path("model_config.json"),
        &path("model_weights.released.safetensors"),
        &path("model_vectors.safetensors"),
        &opts,
    )
    .unwrap();
    let tf: Vec<_> = r
        .tensors
        .iter()
        .filter(|t| t.pass == "teacher-forced")
        .collect();
    for t in &tf {
        if !t.passed || t.row_rel > 1e-5 {
            eprintln!(
                "{} {} tensor {:e} row {:e} mismatches {}",
                if t.passed { "ok  " } else { "FAIL" },
                t.name,
                t.max_rel,
                t.row_rel,
                t.mismatches
            );
        }
    }
    let worst = tf
        .iter()
        .filter(|t| t.kind == "values")
        .fold(0f64, |m, t| m.max(t.max_rel));
    eprintln!(
        "teacher-forced: {} tensors, worst relative error {worst:e}, greedy {}/{}",
        tf.len(),
        r.greedy_agreement,
        r.tokens
    );
    assert!(r.passed(), "a pass failed");
    assert!(r.skipped.is_empty(), "{:?}", r.skipped);
    // logits, final_hidden, head on the reference's hidden, and per block its tensors and
    // (but for the last) the streams leaving it.
    assert!(tf.len() >= 3 + 8 * 11, "{}", tf.len());
    assert!(tf.iter().any(|t| t.name == "layers.6.streams_out"));
    assert!(
        tf.iter()
            .any(|t| t.name == "logits(reference final_hidden)" && t.passed)
    );
    // Cache flips: every layer's window rows (64 tokens x head_dim 64), the KV sources'
    // compressed entries (layer 2 at ratio 2, layer 5 at ratio 1) and index keys (dim 32).
    let f = |l: usize, kind: &str| {
        r.cache_flips
            .iter()
            .find(|c| c.layer == l && c.kind == kind)
            .unwrap_or_else(|| panic!("no {kind} flips for layer {l}"))
    };
    for c in &r.cache_flips {
        eprintln!(
            "layer {} {}: {} of {} differ",
            c.layer, c.kind, c.differ, c.elements
        );
        assert!(c.differ <= c.elements);
    }
    for l in 0..8 {
        assert_eq!(f(l, "window").elements, 64 * 64);
    }
    assert_eq!(f(2, "compressed").elements, 32 * 64);
    assert_eq!(f(5, "compressed").elements, 64 * 64);
    assert_eq!(f(2, "index_keys").elements, 32 * 32);
    assert_eq!(f(5, "index_keys").elements, 64 * 32);
    assert_eq!(r.cache_flips.len(), 8 + 2 + 2);
}

/// CED vs exact prefill on the reference tiny model (window 16): a 200-token prompt, then the
/// next-token logits of both modes and of 16 greedy decode steps from the exact run's tokens.
#[test]
fn ced_prefill_is_close_to_exact() {
    let cfg = ModelConfig::from_file(path("model_config.json")).unwrap();
    let file = TensorFile::open(path("model_weights.released.safetensors")).unwrap();
    let model = Model::load(&cfg, &file).unwrap();
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 97 + 13) % 256).collect();
    let mut exact = model.new_store(None);
    let mut ced = model.new_store(None);
    let mut le = model
        .prefill(&mut exact, &prompt, PrefillMode::Exact, 64)
        .unwrap();
    let mut lc = model
        .prefill(&mut ced, &prompt, PrefillMode::Ced, 64)
        .unwrap();
    let (mut worst, mut agree, steps) = (0f64, 0, 17);
    for _ in 0..steps {
        let (rel, _) = row_errors(&lc, &le, le.len(), f64::INFINITY);
        worst = worst.max(rel);
        let (a, b) = (argmax(&le).unwrap(), argmax(&lc).unwrap());
        agree += usize::from(a == b);
        le = model.decode(&mut exact, a as u32).unwrap();
        lc = model.decode(&mut ced, a as u32).unwrap();
    }
    eprintln!(
        "reference tiny model, 200-token prompt, window 16: CED vs exact worst logit error {worst:e} (norm-wise), top-1 agreement {agree}/{steps}"
    );
    assert!(worst.is_finite() && worst > 0.0);
    // And a prompt shorter than the window: CED is exact.
    let short = &prompt[..12];
    let mut a = model.new_store(None);
    let mut b = model.new_store(None);
    let x = model.prefill(&mut a, short, PrefillMode::Exact, 5).unwrap();
    let y = model.prefill(&mut b, short, PrefillMode::Ced, 5).unwrap();
    assert_eq!(x, y);
}

/// `model init` writes FP8/FP4/BF16 storage; loading it back equals the in-memory generator.
#[test]
fn seeded_checkpoint_round_trips_through_the_released_storage() {
    let cfg = ModelConfig::from_file(path("model_config.json")).unwrap();
    let dir = std::env::temp_dir().join(format!("kvstack-model-init-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tiny.safetensors");
    let s = write_checkpoint(&cfg, 7, &file).unwrap();
    assert!(s.tensors > 300, "{s:?}");
    let tf = TensorFile::open(&file).unwrap();
    assert_eq!(
        tf.dtype_name("layers.0.attn.wq_a.weight").unwrap(),
        "F8_E4M3"
    );
    assert_eq!(
        tf.dtype_name("layers.0.attn.wq_a.scale").unwrap(),
        "F8_E8M0"
    );
    assert_eq!(
        tf.dtype_name("layers.0.ffn.experts.3.w2.weight").unwrap(),
        "I8"
    );
    assert_eq!(tf.dtype_name("embed.weight").unwrap(), "BF16");
    let loaded = Model::load(&cfg, &tf).unwrap();
    let generated = random_model(&cfg, 7).unwrap();
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 31 + 5) % 256).collect();
    let mut s1 = loaded.new_store(None);
    let mut s2 = generated.new_store(None);
    let a = loaded.step(&mut s1, &tokens, Logits::All, None).unwrap();
    let b = generated.step(&mut s2, &tokens, Logits::All, None).unwrap();
    assert_eq!(a, b);
    assert!(a.iter().all(|v| v.is_finite()));
    // A missing tensor is an error naming it.
    let err = Model::load(
        &ModelConfig::from_file(path("model_config.json")).unwrap(),
        &TensorFile::open(path("attn_weights.safetensors")).unwrap(),
    )
    .unwrap_err();
    assert!(format!("{err}").contains("embed.weight"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
