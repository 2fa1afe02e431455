//! `kvstack`: the command-line tool of the kvstack KV-cache stack.
//!
//! Exit codes: 0 success, 1 a command failed (the error chain is printed once on stderr),
//! 2 bad command-line usage (printed by clap). A closed standard output (`kvstack calc | head`)
//! is not an error.

mod bench;
mod bench_attention;
mod bench_runtime;
mod bench_serve;
mod bench_tiers;
mod calc;
mod codec;
mod error;
mod flags;
mod info;
mod model;
mod profile;
mod run;
mod store;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvstack_firmware_interface::EntryFormat;

use crate::error::CliError;

/// The data directory of every subcommand that takes `--data-dir` (or `--dir`), relative to the
/// working directory: `kvstack run` leaves its store there for `kvstack store` to inspect.
const DEFAULT_DATA_DIR: &str = "kvstack-data";

/// kvstack: store, compute and serve the KV cache of DeepSeek-V4.1-Flash-class models.
#[derive(Parser)]
#[command(name = "kvstack", version, about, propagate_version = true)]
struct Cli {
    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Cache-entry arithmetic of a model config (spec §6): bytes per token, per-sequence
    /// constant, per-layer table and the four levers.
    Calc(calc::CalcArgs),
    /// Encode f32 rows into KV entries or decode entries back (raw little-endian files).
    Codec {
        #[command(subcommand)]
        op: CodecOp,
    },
    /// What this machine offers the stack: SIMD, cores, memory, memlock, huge pages,
    /// io_uring, O_DIRECT on the data directory, CUDA.
    Info {
        /// Data directory whose file system is probed for O_DIRECT.
        #[arg(long, default_value = crate::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Inspect and check an SSD store (read-only).
    Store {
        #[command(subcommand)]
        op: store::StoreOp,
    },
    /// Benchmarks that print ratios to limits measured in the same run.
    Bench {
        #[command(subcommand)]
        which: BenchWhich,
    },
    /// The main job: serve a simulated multi-session agent workload with the embedded tiny
    /// V4.1 model and print throughput, reuse, cache bytes and time to first token.
    Run(run::RunArgs),
    /// Model checkpoints: `init` writes a seeded random one.
    Model {
        #[command(subcommand)]
        op: model::ModelOp,
    },
    /// Profile the DRAM and SSD tiers end to end: replay request traces through them, or
    /// size them for a workload.
    Profile {
        #[command(subcommand)]
        op: profile::ProfileOp,
    },
    /// Check kvstack against reference dumps.
    Verify {
        #[command(subcommand)]
        which: VerifyWhich,
    },
}

#[derive(Subcommand)]
enum VerifyWhich {
    /// Run the CSA2 attention chain on a reference dump and compare every recorded stage
    /// (exit 1 when one is out of tolerance).
    Attention(verify::AttentionArgs),
    /// Run the whole forward pass on a reference dump and compare logits, final hidden state
    /// and every recorded per-block tensor (exit 1 when one is out of tolerance).
    Model(model::VerifyModelArgs),
}

#[derive(Subcommand)]
enum CodecOp {
    /// f32 rows in, one entry per row out.
    Encode(CodecArgs),
    /// Entries in, f32 rows out.
    Decode(CodecArgs),
}

#[derive(Args)]
struct CodecArgs {
    /// Entry format.
    #[arg(long, value_enum)]
    format: FormatArg,
    /// Input file.
    #[arg(long)]
    input: PathBuf,
    /// Output file (replaced atomically).
    #[arg(long)]
    output: PathBuf,
}

/// Entry formats as the command line spells them.
#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    /// Window KV, FP8 E4M3 + UE8M0 scales, 512 values, 528 B (spec §5.1).
    #[value(name = "fp8-window")]
    Fp8Window,
    /// Global KV, FP4 E2M1 + E4M3 scales, 512 values, 288 B (spec §5.2).
    #[value(name = "fp4-global")]
    Fp4Global,
    /// Indexer keys, MXFP4, 128 values, 68 B (spec §5.3).
    #[value(name = "mxfp4-index")]
    Mxfp4Index,
}

impl From<FormatArg> for EntryFormat {
    fn from(f: FormatArg) -> Self {
        match f {
            FormatArg::Fp8Window => EntryFormat::WindowFp8,
            FormatArg::Fp4Global => EntryFormat::GlobalFp4,
            FormatArg::Mxfp4Index => EntryFormat::IndexMxfp4,
        }
    }
}

#[derive(Subcommand)]
enum BenchWhich {
    /// Quantize / dequantize / fused-dot throughput per format vs memcpy and memory read
    /// bandwidth measured in the same run (one thread).
    Codecs(bench::CodecsArgs),
    /// Measured footprint of a real V4.1-Flash paged cache holding one N-token sequence:
    /// global bytes per token, per-sequence constant, metadata, peak RSS.
    Footprint(bench::FootprintArgs),
    /// SSD store and DRAM window pool against fio and memcpy measured in the same run; restore
    /// of a 131,072-token prefix; recovery time.
    Tiers(bench_tiers::TiersArgs),
    /// CSA2 decode kernels (indexer scan, top-k, sparse attention) at the real dimensions, with
    /// 1 and 2 threads, vs memory bandwidth and SIMD peaks measured in the same run.
    Attention(bench_attention::AttentionArgs),
    /// The serving engine on the built-in model: prefill and decode tokens/s per thread
    /// count, time to first token of a 32,768-token prompt with its prefix cached (window in
    /// DRAM, and window replayed) vs computed from scratch in the same run, CED vs exact.
    Runtime(bench_runtime::RuntimeArgs),
    /// kvstackd under N concurrent streaming clients over its Unix socket against the same
    /// workload through the engine in-process in the same run: tokens/s ratio (target >= 0.9),
    /// TTFT p50/p99 split into queueing and service, errors, peak RSS, DRAM pool bytes.
    Serve(bench_serve::ServeArgs),
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Calc(args) => calc::run(&args),
        Command::Codec {
            op: CodecOp::Encode(a),
        } => codec::encode(a.format.into(), &a.input, &a.output),
        Command::Codec {
            op: CodecOp::Decode(a),
        } => codec::decode(a.format.into(), &a.input, &a.output),
        Command::Info { data_dir, json } => info::run(&data_dir, json),
        Command::Verify {
            which: VerifyWhich::Attention(args),
        } => verify::attention(&args),
        Command::Verify {
            which: VerifyWhich::Model(args),
        } => model::verify(&args),
        Command::Run(args) => run::run(&args),
        Command::Model { op } => model::run(&op),
        Command::Bench {
            which: BenchWhich::Codecs(args),
        } => bench::codecs(&args),
        Command::Bench {
            which: BenchWhich::Footprint(args),
        } => bench::footprint(&args),
        Command::Bench {
            which: BenchWhich::Tiers(args),
        } => bench_tiers::run(&args),
        Command::Bench {
            which: BenchWhich::Attention(args),
        } => bench_attention::run(&args),
        Command::Bench {
            which: BenchWhich::Runtime(args),
        } => bench_runtime::run(&args),
        Command::Bench {
            which: BenchWhich::Serve(args),
        } => bench_serve::run(&args),
        Command::Store { op } => store::run(&op),
        Command::Profile { op } => profile::run(&op),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if error::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e @ CliError::Usage { .. }) => {
            error::print_chain(&e);
            ExitCode::from(2)
        }
        Err(e) => {
            error::print_chain(&e);
            ExitCode::FAILURE
        }
    }
}
