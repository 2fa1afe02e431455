//! `kvstack bench serve`.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use kvstack_bench::serve::{ServeBenchOptions, run_serve_bench};

use crate::error::CliError;

/// Arguments of `kvstack bench serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Bench directory (the bench works in a subdirectory it removes).
    #[arg(long, value_name = "D", default_value = crate::DEFAULT_DATA_DIR)]
    dir: PathBuf,
    /// The kvstackd binary (default: beside this `kvstack` binary).
    #[arg(long, value_name = "PATH")]
    kvstackd: Option<PathBuf>,
    /// Concurrent streaming clients.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = crate::flags::count::<usize>(1, 4096))]
    clients: usize,
    /// Requests in all (each run).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = crate::flags::count::<usize>(1, 1 << 20))]
    requests: usize,
    /// Prompt tokens of each request.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = crate::flags::count::<usize>(1, 1 << 16))]
    prompt_tokens: usize,
    /// Tokens each request generates.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = crate::flags::count::<usize>(1, 4096))]
    max_tokens: usize,
    /// Engine threads (both runs).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = crate::flags::count::<usize>(1, 1024))]
    threads: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `kvstack bench serve`. Exits non-zero when a request fails, the daemon's tokens/s is
/// below 0.9 of in-process, or the DRAM pool exceeds its cap.
pub fn run(a: &ServeArgs) -> Result<(), CliError> {
    let kvstackd = match &a.kvstackd {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| CliError::Usage {
                flag: "--kvstackd",
                reason: format!("cannot find this program's own path to look beside it: {e}"),
            })?
            .with_file_name("kvstackd"),
    };
    let mut o = ServeBenchOptions::new(a.dir.clone(), kvstackd);
    o.clients = a.clients;
    o.requests = a.requests;
    o.prompt_tokens = a.prompt_tokens;
    o.max_tokens = a.max_tokens;
    o.threads = a.threads;
    let quiet = a.json;
    let report = run_serve_bench(&o, |stage| {
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
    let failures = report.failures();
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CliError::TargetsMissed(failures.join("; ")))
    }
}
