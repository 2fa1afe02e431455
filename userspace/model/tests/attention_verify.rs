//! `verify attention` on `shared/vectors/csa2` (the public DeepSeek-V4.1 reference run on a
//! tiny config): every recorded stage of every layer within tolerance, in both passes.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kvstack_model::attention::verify::{VerifyOptions, verify_attention};

fn vectors() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/vectors/csa2"
    ))
}

#[test]
fn verify_attention_passes_on_the_reference_vectors() {
    let dir = vectors();
    let report = verify_attention(
        &dir.join("config.json"),
        &dir.join("attn_weights.safetensors"),
        &dir.join("attn_vectors.safetensors"),
        &VerifyOptions::default(),
    )
    .unwrap();
    for s in &report.stages {
        println!(
            "{:>5} {} {:<40} {:>9} abs {:>10.3e} rel {:>10.3e} mism {:>4} frag {:>3} {}",
            s.pass.to_string(),
            s.layer,
            s.stage,
            s.compared,
            s.max_abs,
            s.max_rel,
            s.mismatches,
            s.fragile,
            if s.passed { "ok" } else { "FAIL" }
        );
    }
    println!("skipped: {:?}", report.skipped);
    assert!(report.passed());
}
