//! `kvstack bench runtime`.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use kvstack_bench::runtime::{RuntimeBenchOptions, run_runtime_bench};
use kvstack_model::PrefillMode;

use crate::error::CliError;
use crate::run::ModeArg;

/// Arguments of `kvstack bench runtime`.
#[derive(Args)]
pub struct RuntimeArgs {
    /// Data directory on the SSD (the bench works in a subdirectory it removes).
    #[arg(long, value_name = "D", default_value = crate::DEFAULT_DATA_DIR)]
    dir: PathBuf,
    /// Tokens of the long prompt of the time-to-first-token runs.
    #[arg(long, value_name = "N", default_value_t = 32_768, value_parser = crate::flags::count::<usize>(2, 1 << 16))]
    tokens: usize,
    /// Of those, new tokens after the cached prefix.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = crate::flags::count::<usize>(1, 1 << 16))]
    suffix: usize,
    /// Thread counts of the throughput runs (the TTFT runs use the largest).
    #[arg(
        long,
        value_name = "N,..",
        value_delimiter = ',',
        default_value = "1,2",
        value_parser = crate::flags::count::<usize>(1, 1024)
    )]
    threads: Vec<usize>,
    /// Prompt tokens of the prefill throughput run.
    #[arg(long, value_name = "N", default_value_t = 2048, value_parser = crate::flags::count::<usize>(1, 1 << 16))]
    prefill_tokens: usize,
    /// Sequences decoding together in the decode throughput run.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = crate::flags::count::<usize>(1, 64))]
    decode_sessions: usize,
    /// Tokens each of them decodes.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = crate::flags::count::<usize>(1, 4096))]
    decode_tokens: usize,
    /// Prompt tokens of the CED vs exact comparison (0 skips it).
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = crate::flags::count::<usize>(0, 1 << 16))]
    ced_tokens: usize,
    /// Prefill mode of the engine runs.
    #[arg(long, value_enum, default_value = "ced")]
    prefill: ModeArg,
    /// Skip the runs against the machine's ceilings (decode at batch 1 and 4, prefill, on one
    /// thread, with the read-stream and FMA peaks measured in the same run).
    #[arg(long)]
    no_limits: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `kvstack bench runtime`. Exits non-zero when a cached TTFT misses its target.
pub fn run(a: &RuntimeArgs) -> Result<(), CliError> {
    if a.suffix >= a.tokens {
        return Err(CliError::Usage {
            flag: "--suffix",
            reason: format!(
                "{} new tokens leave no cached prefix of a {}-token prompt (--tokens)",
                a.suffix, a.tokens
            ),
        });
    }
    let mut o = RuntimeBenchOptions::new(a.dir.clone());
    o.tokens = a.tokens;
    o.suffix = a.suffix;
    o.threads = a.threads.clone();
    o.prefill_tokens = a.prefill_tokens;
    o.decode_sessions = a.decode_sessions;
    o.decode_tokens = a.decode_tokens;
    o.ced_tokens = a.ced_tokens;
    o.limits = !a.no_limits;
    o.prefill = match a.prefill {
        ModeArg::Exact => PrefillMode::Exact,
        ModeArg::Ced => PrefillMode::Ced,
    };
    let quiet = a.json;
    let report = run_runtime_bench(&o, |stage| {
        if !quiet {
            eprintln!("  {stage} ...");
        }
    })
    .map_err(CliError::Bench)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let text = serde_json::to_string_pretty(&report).map_err(CliError::Json)?;
        writeln!(out, "{text}").map_err(CliError::Stdout)?;
    } else {
        write!(out, "{report}").map_err(CliError::Stdout)?;
    }
    if report.meets_targets() {
        Ok(())
    } else {
        Err(CliError::TargetsMissed(report.failures.join("; ")))
    }
}
