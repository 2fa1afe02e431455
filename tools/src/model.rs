//! `kvstack model init` (a seeded random checkpoint of any valid V4.1 config) and `kvstack
//! verify model` (the whole forward pass against a reference dump).

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use kvstack_model::init::{write_checkpoint, write_sharded_checkpoint};
use kvstack_model::verify::{ModelVerifyOptions, verify_model_with};
use kvstack_spec::ModelConfig;

use crate::error::CliError;

/// `kvstack model ...`.
#[derive(Subcommand)]
pub enum ModelOp {
    /// Write a seeded random checkpoint of a config, in the released tensor naming and storage
    /// (FP8 E4M3 attention/shared-expert linears with UE8M0 128x128 block scales, packed FP4
    /// routed experts with per-row 32-column scales, BF16 embedding/head, F32 the rest).
    Init(InitArgs),
}

/// Arguments of `kvstack model init`.
#[derive(Args)]
pub struct InitArgs {
    /// Model config (`config.json`); `builtin-tiny` for the embedded tiny V4.1 model.
    #[arg(long)]
    config: String,
    /// Output: a safetensors file, or with --shards the checkpoint's directory.
    #[arg(long)]
    out: PathBuf,
    /// Seed of the weights.
    #[arg(long, default_value_t = 4101)]
    seed: u64,
    /// Write a sharded checkpoint in the released layout: `--out` is a directory holding
    /// `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json` (the same weights
    /// as the single file of the same seed).
    #[arg(long, value_parser = crate::flags::count::<usize>(1, 4096))]
    shards: Option<usize>,
}

/// Arguments of `kvstack verify model`.
#[derive(Args)]
pub struct VerifyModelArgs {
    /// Model config (`config.json`).
    #[arg(long)]
    config: PathBuf,
    /// Weights: a safetensors file, or a sharded checkpoint (its directory or its
    /// `model.safetensors.index.json`); released or NeMo naming; F32/BF16/FP8/FP4 storage.
    #[arg(long)]
    weights: PathBuf,
    /// Reference dump (`input_ids`, `logits`, `final_hidden`, `layers.{l}.*`).
    #[arg(long)]
    vectors: PathBuf,
    /// Relative tolerance of f32 tensors (to the tensor's largest magnitude).
    #[arg(long, default_value_t = 1e-4, value_parser = crate::flags::rel_tol)]
    rel_tol: f64,
    /// Teacher-forced mode: every block starts from the reference's own `streams_in`, so each
    /// block is checked on its own inputs (and the LM head on the reference's final hidden
    /// state). Without it: end to end (prefill and decode on the model's own state), with the
    /// quantized cache elements that differ from the teacher-forced step's counted per layer.
    #[arg(long)]
    teacher_forced: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn config(name: &str) -> Result<ModelConfig, CliError> {
    if name == "builtin-tiny" {
        return kvstack_spec::builtin::tiny_config().map_err(CliError::ConfigLoad);
    }
    ModelConfig::from_file(name).map_err(CliError::ConfigLoad)
}

/// Runs `kvstack model <op>`.
pub fn run(op: &ModelOp) -> Result<(), CliError> {
    match op {
        ModelOp::Init(a) => {
            let cfg = config(&a.config)?;
            let s = match a.shards {
                Some(n) => write_sharded_checkpoint(&cfg, a.seed, &a.out, n),
                None => write_checkpoint(&cfg, a.seed, &a.out),
            }
            .map_err(CliError::Model)?;
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "wrote {}{}: {} tensors, {} parameters, {} bytes of tensor data (seed {})",
                a.out.display(),
                a.shards
                    .map(|n| format!(" ({n} shards and {})", kvstack_model::shards::INDEX_FILE))
                    .unwrap_or_default(),
                s.tensors,
                s.parameters,
                s.bytes,
                a.seed
            )
            .map_err(CliError::Stdout)
        }
    }
}

/// Runs `kvstack verify model`; fails (exit 1) when a comparison is out of tolerance.
pub fn verify(a: &VerifyModelArgs) -> Result<(), CliError> {
    let opts = ModelVerifyOptions {
        rel_tol: a.rel_tol,
        end_to_end: !a.teacher_forced,
        teacher_forced: a.teacher_forced,
    };
    let r = verify_model_with(&a.config, &a.weights, &a.vectors, &opts).map_err(CliError::Model)?;
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock<'_>, s: String| {
        writeln!(out, "{s}").map_err(CliError::Stdout)
    };
    if a.json {
        let text = serde_json::to_string_pretty(&r).map_err(CliError::Json)?;
        w(&mut out, text)?;
    } else {
        w(
            &mut out,
            format!(
                "{} tokens, {} layers, {} naming; f32 tolerance {:.0e} of the tensor's largest magnitude (per-row figure also shown); selections exact",
                r.tokens, r.layers, r.naming, r.rel_tol
            ),
        )?;
        w(
            &mut out,
            format!(
                "{:<14} {:<32} {:<9} {:>6} {:>10} {:>10} {:>6}  ok",
                "pass", "tensor", "kind", "rows", "rel", "row rel", "mism"
            ),
        )?;
        for t in &r.tensors {
            w(
                &mut out,
                format!(
                    "{:<14} {:<32} {:<9} {:>6} {:>10.3e} {:>10.3e} {:>6}  {}",
                    t.pass,
                    t.name,
                    t.kind,
                    t.rows,
                    t.max_rel,
                    t.row_rel,
                    t.mismatches,
                    if t.passed { "yes" } else { "NO" }
                ),
            )?;
        }
        for s in &r.skipped {
            w(
                &mut out,
                format!("note: {s}: not compared (absent on one side)"),
            )?;
        }
        if !r.cache_flips.is_empty() {
            w(
                &mut out,
                "quantized cache elements that differ from the teacher-forced step's (dequantized):"
                    .to_string(),
            )?;
            for f in &r.cache_flips {
                w(
                    &mut out,
                    format!(
                        "  layer {:>2} {:<10} {:>8} of {:>9}",
                        f.layer, f.kind, f.differ, f.elements
                    ),
                )?;
            }
        }
        let failed = r.tensors.iter().filter(|t| !t.passed).count();
        w(
            &mut out,
            format!(
                "{}: {} of {} comparisons within tolerance; worst {:.3e}; greedy top-1 {}/{}",
                if failed == 0 { "PASS" } else { "FAIL" },
                r.tensors.len() - failed,
                r.tensors.len(),
                r.worst(),
                r.greedy_agreement,
                r.tokens
            ),
        )?;
    }
    let failed = r.tensors.iter().filter(|t| !t.passed).count();
    if failed > 0 {
        return Err(CliError::ModelVerifyFailed {
            failed,
            total: r.tensors.len(),
        });
    }
    Ok(())
}
