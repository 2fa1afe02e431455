//! `kvstack bench attention`: the CSA2 decode kernels at the real V4.1-Flash dimensions against
//! this machine's limits measured in the same run.

use std::io::Write;

use clap::Args;
use kvstack_bench::attention::{AttentionBenchOptions, AttentionBenchReport, run_attention_bench};
use kvstack_driver::probe::{CpuIdentity, cpu_identity};
use kvstack_kernels::SimdLevel;
use serde_json::json;

use crate::error::CliError;

/// Arguments of `kvstack bench attention`.
#[derive(Args)]
pub struct AttentionArgs {
    /// Thread counts to run every case with, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2",
        value_name = "N,..",
        value_parser = crate::flags::count::<usize>(1, 1024)
    )]
    threads: Vec<usize>,
    /// Caches of 131,072 entries (no 1M case) and 3 repetitions: a smoke run.
    #[arg(long)]
    quick: bool,
    /// Repetitions per measurement (the fastest counts).
    #[arg(long, value_name = "N", value_parser = crate::flags::count::<usize>(1, 1000))]
    repetitions: Option<usize>,
    /// SIMD level to run (portable, avx2, avx512); default: the detected one.
    #[arg(long, value_name = "LEVEL")]
    level: Option<SimdLevel>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The CPU the bench ran on, for comparing runs across machines: the ratios depend on the
/// microarchitecture (docs/attention-kernels.md has runs on several).
struct BenchCpu {
    id: CpuIdentity,
    /// CPUs this process may run on.
    logical_cpus: usize,
}

impl BenchCpu {
    fn probe() -> Self {
        BenchCpu {
            id: cpu_identity(),
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl std::fmt::Display for BenchCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}",
            self.id.model_name.as_deref().unwrap_or("unknown CPU")
        )?;
        if let (Some(family), Some(model)) = (self.id.family, self.id.model) {
            write!(f, " (family {family} model {model})")?;
        }
        write!(f, ", {} logical CPUs", self.logical_cpus)
    }
}

fn to_json(r: &AttentionBenchReport, cpu: &BenchCpu) -> serde_json::Value {
    json!({
        "cpu": {
            "model_name": cpu.id.model_name,
            "family": cpu.id.family,
            "model": cpu.id.model,
            "logical_cpus": cpu.logical_cpus,
        },
        "level": r.level.name(),
        "repetitions": r.repetitions,
        "limits": r.limits.iter().map(|l| json!({
            "threads": l.threads,
            "read_gb_per_s": l.read_gb_per_s,
            "fma_gflop_per_s": l.fma_gflop_per_s,
            "int8_gflop_per_s": l.int8_gflop_per_s,
        })).collect::<Vec<_>>(),
        "results": r.results.iter().map(|x| json!({
            "case": x.case,
            "part": x.part,
            "threads": x.threads,
            "ms": x.ms,
            "median_ms": x.median_ms,
            "bytes": x.bytes,
            "flops": x.flops,
            "gb_per_s": x.gb_per_s,
            "gflop_per_s": x.gflop_per_s,
            "mem_ratio": x.mem_ratio,
            "fma_ratio": x.fma_ratio,
            "int8_ratio": x.int8_ratio,
            "bound": x.bound.to_string(),
            "ratio": x.ratio,
            "target": x.target,
            "meets_target": x.meets_target(),
        })).collect::<Vec<_>>(),
        "meets_targets": r.meets_targets(),
        "notes": r.notes,
    })
}

/// Runs `kvstack bench attention`. Exits non-zero when a target is missed.
pub fn run(args: &AttentionArgs) -> Result<(), CliError> {
    let mut opts = if args.quick {
        AttentionBenchOptions::quick()
    } else {
        AttentionBenchOptions::default()
    };
    if !args.threads.is_empty() {
        opts.threads = args.threads.clone();
    }
    if let Some(n) = args.repetitions {
        opts.repetitions = n;
    }
    opts.level = args.level;
    if !args.json {
        eprintln!(
            "benchmarking attention decode kernels: threads {:?}, best of {} runs{} ...",
            opts.threads,
            opts.repetitions,
            if opts.quick { ", quick" } else { "" }
        );
    }
    let report = run_attention_bench(&opts).map_err(CliError::Attention)?;
    let cpu = BenchCpu::probe();
    let mut out = std::io::stdout().lock();
    if args.json {
        let text = serde_json::to_string_pretty(&to_json(&report, &cpu)).map_err(CliError::Json)?;
        writeln!(out, "{text}").map_err(CliError::Stdout)?;
    } else {
        writeln!(out, "cpu: {cpu}").map_err(CliError::Stdout)?;
        write!(out, "{report}").map_err(CliError::Stdout)?;
        writeln!(
            out,
            "bytes: cache bytes read (68 B/index key, 528 B/window entry, 288 B/global entry); \
             FLOPs: 2 per multiply-add of the dots (indexer 32x128 per key, attention 2x64x512 \
             per entry); ratio: ideal time at the binding limit / measured time"
        )
        .map_err(CliError::Stdout)?;
    }
    if report.meets_targets() {
        Ok(())
    } else {
        let missed: Vec<String> = report
            .results
            .iter()
            .filter(|r| r.meets_target() == Some(false))
            .map(|r| format!("{} {} x{}: {:.2}", r.case, r.part, r.threads, r.ratio))
            .collect();
        Err(CliError::TargetsMissed(missed.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_line_names_model_family_and_cpus() {
        let cpu = |model_name: Option<&str>, family, model| BenchCpu {
            id: CpuIdentity {
                model_name: model_name.map(str::to_owned),
                family,
                model,
            },
            logical_cpus: 2,
        };
        assert_eq!(
            cpu(Some("AMD EPYC"), Some(25), Some(17)).to_string(),
            "AMD EPYC (family 25 model 17), 2 logical CPUs"
        );
        assert_eq!(
            cpu(None, None, None).to_string(),
            "unknown CPU, 2 logical CPUs"
        );
        assert_eq!(
            cpu(Some("X"), Some(6), None).to_string(),
            "X, 2 logical CPUs"
        );
    }
}
