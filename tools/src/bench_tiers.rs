//! `kvstack bench tiers`.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use kvstack_bench::tiers::{TiersBenchOptions, run_tiers_bench};

use crate::error::CliError;

/// Arguments of `kvstack bench tiers`.
#[derive(Args)]
pub struct TiersArgs {
    /// Data directory on the SSD to measure (the bench works in a subdirectory it removes).
    #[arg(long, value_name = "D", default_value = crate::DEFAULT_DATA_DIR)]
    dir: PathBuf,
    /// Units of 131,072 tokens written and read (about 120 MB each).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = crate::flags::count::<usize>(1, 1024))]
    units: usize,
    /// Tokens per unit and of the restored prefix (a multiple of 256).
    #[arg(long, value_name = "N", default_value_t = 131_072, value_parser = crate::flags::count::<u64>(256, 1 << 20))]
    unit_tokens: u64,
    /// Window snapshots cycled through the DRAM pool.
    #[arg(long, value_name = "N", default_value_t = 48, value_parser = crate::flags::count::<usize>(2, 4096))]
    snapshots: usize,
    /// Queue depth of the store (and of fio).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = crate::flags::count::<usize>(1, 256))]
    queue_depth: usize,
    /// Alternating fio / store runs of the SSD measurements (the best of each counts).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = crate::flags::count::<usize>(1, 100))]
    repeat: usize,
    /// The store's I/O engine: auto, io_uring, sync, sync-direct, or vfio:PCI-ADDRESS (the
    /// store on namespace 1 of that NVMe controller, bound to vfio-pci, through the userspace
    /// driver; fio still measures a file in --dir).
    #[arg(long, value_name = "ENGINE")]
    io_engine: Option<String>,
    /// Skip fio even when it is installed.
    #[arg(long)]
    no_fio: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `kvstack bench tiers`. Exits non-zero when a measured ratio misses its target.
pub fn run(args: &TiersArgs) -> Result<(), CliError> {
    if !args.unit_tokens.is_multiple_of(256) {
        return Err(CliError::Usage {
            flag: "--unit-tokens",
            reason: format!("{} is not a multiple of 256", args.unit_tokens),
        });
    }
    let mut opts = TiersBenchOptions::new(args.dir.clone());
    opts.write_units = args.units;
    opts.unit_tokens = args.unit_tokens;
    opts.pool_snapshots = args.snapshots;
    opts.queue_depth = args.queue_depth;
    opts.fio = !args.no_fio;
    opts.repetitions = args.repeat;
    opts.io_engine = args.io_engine.clone();
    let quiet = args.json;
    let report = run_tiers_bench(&opts, |stage| {
        if !quiet {
            eprintln!("  {stage} ...");
        }
    })
    .map_err(CliError::Bench)?;
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
