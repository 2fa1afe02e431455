//! `kvstack verify attention`: the CSA2 attention chain against a reference dump
//! (`kvstack_model::attention::verify`), one line per layer, pass and stage.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use kvstack_model::attention::verify::{Kind, VerifyOptions, VerifyReport, verify_attention};

use crate::error::CliError;

/// Which passes to run.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PassArg {
    /// Own state threaded from layer to layer, from the recorded layer inputs.
    Chain,
    /// Every stage fed the reference's own inputs for that stage.
    Stage,
    /// Both.
    Both,
}

/// Arguments of `kvstack verify attention`.
#[derive(Args)]
pub struct AttentionArgs {
    /// Model config (`config.json`); dimensions, layer plan and RoPE come from it.
    #[arg(long)]
    config: PathBuf,
    /// Attention weights (safetensors, `layers.{l}.attn.*` or `model.layers.{l}.attn.*`, f32).
    #[arg(long)]
    weights: PathBuf,
    /// Reference dump (safetensors, `layers.{l}.<stage>` and `state.{l}.*`, batch 1).
    #[arg(long)]
    vectors: PathBuf,
    /// Passes to run.
    #[arg(long, value_enum, default_value = "both")]
    pass: PassArg,
    /// Norm-wise relative tolerance of f32 stages.
    #[arg(long, default_value_t = 1e-4, value_parser = crate::flags::rel_tol)]
    rel_tol: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn kind(k: Kind) -> &'static str {
    match k {
        Kind::Values => "f32",
        Kind::Quantized => "quant",
        Kind::Selection => "set",
    }
}

fn print_table(out: &mut impl Write, r: &VerifyReport) -> std::io::Result<()> {
    writeln!(
        out,
        "{} tokens, {} layers; f32 tolerance {:.0e} (norm-wise per row), quantized bit-exact except fragile, selections exact",
        r.tokens, r.layers, r.rel_tol
    )?;
    writeln!(
        out,
        "{:<5} {:>5} {:<34} {:<5} {:>8} {:>10} {:>10} {:>6} {:>7}  ok",
        "pass", "layer", "stage", "kind", "compared", "max abs", "max rel", "mism", "fragile"
    )?;
    for s in &r.stages {
        writeln!(
            out,
            "{:<5} {:>5} {:<34} {:<5} {:>8} {:>10.3e} {:>10.3e} {:>6} {:>7}  {}",
            s.pass.to_string(),
            s.layer,
            s.stage,
            kind(s.kind),
            s.compared,
            s.max_abs,
            s.max_rel,
            s.mismatches,
            s.fragile,
            if s.passed { "yes" } else { "NO" }
        )?;
    }
    for s in &r.skipped {
        writeln!(out, "note: {s} is not recorded in the dump; skipped")?;
    }
    let failed = r.stages.iter().filter(|s| !s.passed).count();
    writeln!(
        out,
        "{}: {} of {} stage comparisons within tolerance",
        if failed == 0 { "PASS" } else { "FAIL" },
        r.stages.len() - failed,
        r.stages.len()
    )
}

/// Runs `kvstack verify attention`; fails (exit 1) when a stage is out of tolerance.
pub fn attention(args: &AttentionArgs) -> Result<(), CliError> {
    let opts = VerifyOptions {
        chain: matches!(args.pass, PassArg::Chain | PassArg::Both),
        stage: matches!(args.pass, PassArg::Stage | PassArg::Both),
        rel_tol: args.rel_tol,
    };
    let report = verify_attention(&args.config, &args.weights, &args.vectors, &opts)
        .map_err(CliError::Verify)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(CliError::Json)?;
        writeln!(out, "{text}").map_err(CliError::Stdout)?;
    } else {
        print_table(&mut out, &report).map_err(CliError::Stdout)?;
    }
    let failed = report.stages.iter().filter(|s| !s.passed).count();
    if failed > 0 {
        return Err(CliError::VerifyFailed {
            failed,
            total: report.stages.len(),
        });
    }
    Ok(())
}
