//! `kvstack bench ...`: benchmarks that print ratios to limits measured in the same run.

use std::io::Write;

use clap::Args;
use kvstack_bench::codecs::{CodecBenchOptions, CodecBenchReport, run_codec_bench};
use kvstack_kernels::SimdLevel;
use serde_json::json;

use crate::error::CliError;

/// Arguments of `kvstack bench codecs`.
#[derive(Args)]
pub struct CodecsArgs {
    /// Small (8 MiB, likely cache-resident) buffers and 3 repetitions: a smoke run whose ratios
    /// are only indicative.
    #[arg(long)]
    quick: bool,
    /// Buffer size in MiB (f32 side of the codecs, encoded side of the dots). Default 64, larger
    /// than the last-level cache so DRAM bandwidth is what is measured.
    #[arg(long, value_name = "MIB", conflicts_with = "quick", value_parser = crate::flags::count::<usize>(1, 16 << 10))]
    buffer_mib: Option<usize>,
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

fn to_json(r: &CodecBenchReport) -> serde_json::Value {
    json!({
        "level": r.level.name(),
        "buffer_bytes": r.buffer_bytes,
        "repetitions": r.repetitions,
        "memcpy_gb_per_s": r.memcpy.gb_per_s,
        "results": r.results.iter().map(|x| json!({
            "format": x.format.name(),
            "op": x.op.name(),
            "level": x.level.name(),
            "rows": x.rows,
            "bytes": x.throughput.bytes,
            "seconds": x.throughput.seconds,
            "gb_per_s": x.throughput.gb_per_s,
            "baseline": x.baseline.to_string(),
            "baseline_gb_per_s": x.baseline_gb_per_s,
            "ratio": x.ratio,
            "target": x.target,
            "meets_target": x.meets_target,
        })).collect::<Vec<_>>(),
        "notes": r.notes,
    })
}

/// Runs `kvstack bench codecs`.
pub fn codecs(args: &CodecsArgs) -> Result<(), CliError> {
    let mut opts = if args.quick {
        CodecBenchOptions::quick()
    } else {
        CodecBenchOptions::default()
    };
    if let Some(mib) = args.buffer_mib {
        opts.buffer_bytes = mib << 20;
    }
    if let Some(n) = args.repetitions {
        opts.repetitions = n;
    }
    opts.level = args.level;
    if !args.json {
        eprintln!(
            "benchmarking codecs: {} MiB buffers, best of {} runs, one thread ...",
            opts.buffer_bytes >> 20,
            opts.repetitions
        );
    }
    let report = run_codec_bench(&opts);
    let mut out = std::io::stdout().lock();
    if args.json {
        let text = serde_json::to_string_pretty(&to_json(&report)).map_err(CliError::Json)?;
        return writeln!(out, "{text}").map_err(CliError::Stdout);
    }
    let w = |out: &mut std::io::StdoutLock<'_>| -> std::io::Result<()> {
        writeln!(
            out,
            "simd level {}; memcpy {:.2} GB/s ({} MiB, same run)",
            report.level,
            report.memcpy.gb_per_s,
            report.buffer_bytes >> 20
        )?;
        writeln!(
            out,
            "{:<12} {:<11} {:>9} {:>10} {:>8} {:>12} {:>7} {:>7}  ok",
            "format", "op", "rows", "GB/s", "vs", "limit GB/s", "ratio", "target"
        )?;
        for x in &report.results {
            writeln!(
                out,
                "{:<12} {:<11} {:>9} {:>10.2} {:>8} {:>12.2} {:>7.2} {:>7.2}  {}",
                x.format.name(),
                x.op.name(),
                x.rows,
                x.throughput.gb_per_s,
                x.baseline.to_string(),
                x.baseline_gb_per_s,
                x.ratio,
                x.target,
                if x.meets_target { "yes" } else { "NO" }
            )?;
        }
        for n in &report.notes {
            writeln!(out, "note: {n}")?;
        }
        writeln!(
            out,
            "bytes counted: quantize = f32 input, dequantize = f32 output, dots = encoded bytes read"
        )
    };
    w(&mut out).map_err(CliError::Stdout)
}

/// Arguments of `kvstack bench footprint`.
#[derive(Args)]
pub struct FootprintArgs {
    /// Tokens in the one sequence built (K and M suffixes: x1024, x1024^2).
    #[arg(long, value_parser = crate::flags::footprint_tokens, default_value = "1M", value_name = "N")]
    tokens: u64,
    /// Print the report as JSON (`global_bytes_per_token`, `per_sequence_bytes`,
    /// `peak_rss_bytes`, ...).
    #[arg(long)]
    json: bool,
}

/// Runs `kvstack bench footprint`: builds a real V4.1-Flash cache for one sequence and reports
/// the bytes its pools allocated. Exits non-zero when a target is missed.
pub fn footprint(args: &FootprintArgs) -> Result<(), CliError> {
    let bar = indicatif::ProgressBar::new(args.tokens);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {human_pos}/{human_len} tokens ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message("appending");
    let report =
        kvstack_bench::footprint::run_footprint_bench(args.tokens, |done| bar.set_position(done))
            .map_err(CliError::Bench)?;
    bar.finish_and_clear();
    let mut out = std::io::stdout().lock();
    if args.json {
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
