//! `kvstack bench attention`: the CSA2 decode kernels at the real V4.1-Flash dimensions against
//! this machine's limits measured in the same run.

use std::io::Write;

use clap::Args;
use kvstack_kernels::SimdLevel;
use kvstack_kernels::attn::bench::{
    AttentionBenchOptions, AttentionBenchReport, run_attention_bench,
};
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
        value_name = "N,.."
    )]
    threads: Vec<usize>,
    /// Caches of 131,072 entries (no 1M case) and 3 repetitions: a smoke run.
    #[arg(long)]
    quick: bool,
    /// Repetitions per measurement (the fastest counts).
    #[arg(long, value_name = "N")]
    repetitions: Option<usize>,
    /// SIMD level to run (portable, avx2); default: the detected one.
    #[arg(long, value_name = "LEVEL")]
    level: Option<SimdLevel>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The CPU the bench ran on, for comparing runs across machines: the results depend on the
/// microarchitecture (docs/attention-kernels.md has runs on several).
#[derive(Debug, Default, PartialEq, Eq)]
struct CpuId {
    /// `model name` of the first CPU in `/proc/cpuinfo`.
    model_name: Option<String>,
    /// `cpu family` and `model` (decimal, as `/proc/cpuinfo` prints them): on VMs the model
    /// name is often generic ("AMD EPYC"), these are not.
    family_model: Option<(u32, u32)>,
    /// CPUs this process may run on.
    logical_cpus: usize,
}

impl CpuId {
    /// This machine's; fields that cannot be read stay `None`.
    fn probe() -> Self {
        let mut id = std::fs::read_to_string("/proc/cpuinfo")
            .map(|t| Self::parse(&t))
            .unwrap_or_default();
        id.logical_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        id
    }

    /// The first processor's block of a `/proc/cpuinfo` text.
    fn parse(cpuinfo: &str) -> Self {
        let first = cpuinfo.split("\n\n").next().unwrap_or_default();
        let field = |name: &str| {
            first.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_owned())
            })
        };
        let num = |name: &str| field(name).and_then(|v| v.parse::<u32>().ok());
        CpuId {
            model_name: field("model name").filter(|v| !v.is_empty()),
            family_model: num("cpu family").zip(num("model")),
            logical_cpus: 0,
        }
    }
}

impl std::fmt::Display for CpuId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.model_name.as_deref().unwrap_or("unknown CPU"))?;
        if let Some((fam, model)) = self.family_model {
            write!(f, " (family {fam} model {model})")?;
        }
        write!(f, ", {} logical CPUs", self.logical_cpus)
    }
}

fn to_json(r: &AttentionBenchReport, cpu: &CpuId) -> serde_json::Value {
    json!({
        "cpu": {
            "model_name": cpu.model_name,
            "family": cpu.family_model.map(|(f, _)| f),
            "model": cpu.family_model.map(|(_, m)| m),
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
        opts.threads = args.threads.iter().map(|&t| t.max(1)).collect();
    }
    if let Some(n) = args.repetitions {
        opts.repetitions = n.max(1);
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
    let cpu = CpuId::probe();
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
    fn cpu_id_reads_the_first_processor() {
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
                    model name\t: AMD EPYC\nflags\t\t: fpu avx512f\n\n\
                    processor\t: 1\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Other\n";
        let id = CpuId::parse(text);
        assert_eq!(id.model_name.as_deref(), Some("AMD EPYC"));
        assert_eq!(id.family_model, Some((25, 17)));
        let shown = CpuId {
            logical_cpus: 2,
            ..id
        }
        .to_string();
        assert_eq!(shown, "AMD EPYC (family 25 model 17), 2 logical CPUs");
    }

    #[test]
    fn cpu_id_without_the_fields_is_unknown() {
        // e.g. an aarch64 /proc/cpuinfo: no `model name`, no `cpu family`.
        let id = CpuId::parse("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n");
        assert_eq!(id, CpuId::default());
        assert_eq!(id.to_string(), "unknown CPU, 0 logical CPUs");
    }
}
