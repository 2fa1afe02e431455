//! `kvstack profile replay|plan`: request traces through the real tiers, and tier sizing from
//! the cache arithmetic (`docs/profile.md`).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvstack_bench::profile::plan::{Plan, PlanInput, plan};
use kvstack_bench::profile::tokens::Sessions;
use kvstack_bench::profile::{ModelSpec, Progress, ReplayOptions, ReplayReport, read_trace};
use kvstack_spec::{ModelConfig, builtin};

use crate::error::CliError;
use crate::flags;

/// What `kvstack profile` does.
// Parsed once per process: the size of the replay's arguments costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum ProfileOp {
    /// Replay a request trace (Mooncake JSONL) through the real SSD store, DRAM window pool
    /// and paged cache, in trace time, and report hit rates, bytes, latencies and the prefill
    /// time the tiers save (cost model).
    Replay(ReplayArgs),
    /// The DRAM and SSD capacity and SSD write bandwidth a workload needs, from the cache
    /// arithmetic.
    Plan(PlanArgs),
}

/// Arguments of `kvstack profile replay`.
#[derive(Args)]
pub struct ReplayArgs {
    /// The trace: JSONL, one request a line (timestamp, input_length, output_length,
    /// hash_ids).
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N", value_parser = flags::count::<usize>(1, 100_000_000))]
    requests: Option<usize>,
    /// Directory for the SSD store (each run in a subdirectory removed afterwards); it should
    /// be on the SSD to profile.
    #[arg(long, value_name = "D", default_value = crate::DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Model whose cache geometry is replayed: `builtin` (DeepSeek-V4.1-Flash) or a
    /// config.json.
    #[arg(long, value_name = "builtin|CONFIG", default_value = "builtin")]
    model: String,
    /// Replay again with each of these configs' cache geometry, at the same byte capacities.
    #[arg(long, num_args = 1.., value_name = "CONFIG")]
    compare: Vec<PathBuf>,
    /// SSD capacity, or a comma-separated list to sweep (K, M, G, T: powers of 1000; Ki..Ti:
    /// of 1024).
    #[arg(long, value_name = "SIZE[,SIZE..]", value_delimiter = ',', default_value = "20G", value_parser = flags::ssd_capacity)]
    ssd_capacity: Vec<u64>,
    /// SSD retention after last use, in trace time.
    #[arg(long, value_name = "DURATION", default_value = "72h", value_parser = flags::profile_duration)]
    retention: u64,
    /// DRAM window pool capacity, or a list to sweep (0: no pool). Default: 10% of RAM.
    #[arg(long, value_name = "SIZE[,SIZE..]", value_delimiter = ',', value_parser = flags::dram_pool)]
    dram_pool: Vec<u64>,
    /// Window snapshot TTL, in trace time.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = flags::profile_duration)]
    window_ttl: u64,
    /// Paged cache (HBM stand-in) capacity for global entries and indexer keys.
    #[arg(long, alias = "hbm", value_name = "SIZE", default_value = "2G", value_parser = flags::cache_bytes)]
    cache: u64,
    /// Sequences the paged cache holds at most (in flight and live).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = flags::count::<usize>(1, 65_536))]
    max_sequences: usize,
    /// Do not keep a session's sequence in the paged cache between turns.
    #[arg(long)]
    no_keep_live: bool,
    /// Do not infer sessions: each request is its own, sharing only the blocks its ids say.
    #[arg(long)]
    no_sessions: bool,
    /// Trace seconds per wall second (default: as fast as possible).
    #[arg(long, value_name = "N", value_parser = flags::speed)]
    speed: Option<f64>,
    /// Prefill rate of the cost model, tokens per second.
    #[arg(long, value_name = "RATE", default_value = "20000", value_parser = flags::token_rate)]
    prefill_tokens_per_s: f64,
    /// Decode rate of one sequence, tokens per second (when outputs end in trace time).
    #[arg(long, value_name = "RATE", default_value = "50", value_parser = flags::token_rate)]
    decode_tokens_per_s: f64,
    /// Calibrate the prefill rate on the real engine: run the first N prompts through the
    /// built-in model (on this machine's CPU) first.
    #[arg(long, value_name = "N", value_parser = flags::count::<usize>(1, 1000))]
    engine: Option<usize>,
    /// Tokens of each calibration prompt at most.
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = flags::count::<usize>(16, 65_536))]
    engine_max_tokens: usize,
    /// Time-series bucket, in trace time (default: a 60th of the trace, at least 1 s).
    #[arg(long, value_name = "DURATION", value_parser = flags::bucket)]
    bucket: Option<u64>,
    /// Write report.json and the plots (PNG and SVG) into this directory.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Print JSON instead of text (one report; `{"runs": [...]}` for several).
    #[arg(long)]
    json: bool,
    /// Split the trace over N in-process nodes (each its own SSD store, DRAM pool and paged
    /// cache), round-robin by arrival; N > 1 replays twice: without and with the shared tiers
    /// (peer fetches of units, a shared window level).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = flags::count::<usize>(1, 64))]
    nodes: usize,
    /// Redis Cluster seed nodes (`redis://HOST:PORT`, comma-separated) for the shared window
    /// level of `--nodes`; without it the level is modelled in process.
    #[arg(long, value_name = "URL[,URL..]", value_delimiter = ',')]
    redis_cluster: Vec<String>,
}

/// Arguments of `kvstack profile plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// Sessions active at once.
    #[arg(long, value_name = "N", value_parser = flags::count::<u64>(1, 1_000_000_000))]
    sessions: u64,
    /// Context a session reaches (K and M: x1024, x1024^2).
    #[arg(long, value_name = "TOKENS", value_parser = flags::plan_context)]
    context: u64,
    /// Turns per session per hour.
    #[arg(long, value_name = "N", value_parser = flags::turns_per_hour)]
    turns_per_hour: f64,
    /// Turns of a session over its life.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = flags::count::<u64>(1, 1_000_000))]
    turns: u64,
    /// DRAM window TTL.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = flags::profile_duration)]
    window_ttl: u64,
    /// SSD retention after last use.
    #[arg(long, value_name = "DURATION", default_value = "72h", value_parser = flags::profile_duration)]
    retention: u64,
    /// Model: `builtin` or a config.json.
    #[arg(long, value_name = "builtin|CONFIG", default_value = "builtin")]
    model: String,
    /// Also plan for these configs.
    #[arg(long, num_args = 1.., value_name = "CONFIG")]
    compare: Vec<PathBuf>,
    /// Print JSON (an array, one object per model).
    #[arg(long)]
    json: bool,
}

/// Runs `kvstack profile`.
pub fn run(op: &ProfileOp) -> Result<(), CliError> {
    match op {
        ProfileOp::Replay(a) => replay(a),
        ProfileOp::Plan(a) => plan_cmd(a),
    }
}

fn load_model(name: &str) -> Result<ModelSpec, CliError> {
    if name == "builtin" {
        let config = builtin::default_config().map_err(CliError::ConfigLoad)?;
        return Ok(ModelSpec {
            name: builtin::DEFAULT_CONFIG_NAME.to_owned(),
            config,
        });
    }
    let config = ModelConfig::from_file(name).map_err(CliError::ConfigLoad)?;
    Ok(ModelSpec {
        name: name.to_owned(),
        config,
    })
}

fn models(model: &str, compare: &[PathBuf]) -> Result<Vec<ModelSpec>, CliError> {
    let mut v = vec![load_model(model)?];
    for c in compare {
        v.push(load_model(&c.display().to_string())?);
    }
    Ok(v)
}

fn clock(ms: u64) -> String {
    let s = ms / 1000;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// Progress on standard error: a bar on a terminal, a line every few seconds otherwise.
struct Shown {
    bar: Option<ProgressBar>,
    last: Instant,
    label: String,
}

impl Shown {
    fn new(total: u64, label: String, quiet: bool) -> Shown {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} requests {msg} (eta {eta})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(label.clone());
            b
        });
        Shown {
            bar,
            last: Instant::now(),
            label,
        }
    }

    fn update(&mut self, p: &Progress) {
        let rate = p.done as f64 / p.seconds.max(1e-9);
        let msg = format!(
            "trace {} / {}, {:.1} requests/s",
            clock(p.trace_ms),
            clock(p.span_ms),
            rate
        );
        match &self.bar {
            Some(b) => {
                b.set_position(p.done);
                b.set_message(msg);
            }
            None => {
                if self.last.elapsed().as_secs_f64() >= 5.0 || p.done == p.total {
                    self.last = Instant::now();
                    let eta = (p.total - p.done) as f64 / rate.max(1e-9);
                    eprintln!(
                        "{}: {}/{} requests, {msg}, eta {:.0} s",
                        self.label, p.done, p.total, eta
                    );
                }
            }
        }
    }

    fn finish(self) {
        if let Some(b) = self.bar {
            b.finish_and_clear();
        }
    }
}

fn replay(a: &ReplayArgs) -> Result<(), CliError> {
    let trace = read_trace(&a.trace, a.requests).map_err(CliError::Profile)?;
    let models = models(&a.model, &a.compare)?;
    let pools = if a.dram_pool.is_empty() {
        let ram = kvstack_tiers::window_pool::machine_ram_bytes().unwrap_or(8 << 30);
        vec![(ram as f64 * kvstack_tiers::window_pool::DEFAULT_RAM_FRACTION) as u64]
    } else {
        a.dram_pool.clone()
    };
    let quiet = a.json;
    let mut prefill = a.prefill_tokens_per_s;
    let mut source = "flag".to_owned();
    if let Some(n) = a.engine {
        if !quiet {
            eprintln!(
                "calibrating the prefill rate: {n} prompts (at most {} tokens each) through the \
                 built-in model ...",
                a.engine_max_tokens
            );
        }
        let sessions = if a.no_sessions {
            Sessions::none(&trace)
        } else {
            Sessions::infer(&trace)
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let c = kvstack_bench::profile::calibrate::calibrate(
            &trace,
            &sessions,
            n,
            a.engine_max_tokens,
            threads,
        )
        .map_err(CliError::Profile)?;
        prefill = c.prefill_tokens_per_s;
        source = format!(
            "engine: {} on this machine's CPU, {} prompts, {} tokens, measured in {:.1} s",
            c.model, c.requests, c.tokens, c.seconds
        );
        if !quiet {
            eprintln!("  {prefill:.1} prefill tokens/s ({source})");
        }
    }
    if !a.redis_cluster.is_empty() && a.nodes < 2 {
        return Err(CliError::Usage {
            flag: "--redis-cluster",
            reason: "needs --nodes 2 or more (it is the shared window level)".into(),
        });
    }
    for u in &a.redis_cluster {
        if !u.starts_with("redis://") {
            return Err(CliError::Usage {
                flag: "--redis-cluster",
                reason: format!("`{u}` is not a redis://HOST:PORT URL"),
            });
        }
    }
    let modes: &[bool] = if a.nodes > 1 {
        &[false, true]
    } else {
        &[false]
    };
    let mut runs: Vec<ReplayReport> = Vec::new();
    let total = models.len() * pools.len() * a.ssd_capacity.len() * modes.len();
    for m in &models {
        for &pool in &pools {
            for (&cap, &shared) in a
                .ssd_capacity
                .iter()
                .flat_map(|c| modes.iter().map(move |s| (c, s)))
            {
                let mut o = ReplayOptions::new(a.data_dir.clone(), m.clone());
                o.ssd_capacity_bytes = cap;
                o.retention_ms = a.retention;
                o.dram_pool_bytes = pool;
                o.window_ttl_ms = a.window_ttl;
                o.cache_bytes = a.cache;
                o.max_sequences = a.max_sequences;
                o.keep_live = !a.no_keep_live;
                o.sessions = !a.no_sessions;
                o.speed = a.speed;
                o.prefill_tokens_per_s = prefill;
                o.prefill_rate_source = source.clone();
                o.decode_tokens_per_s = a.decode_tokens_per_s;
                o.bucket_ms = a.bucket;
                o.trace_name = a.trace.display().to_string();
                o.nodes = a.nodes;
                o.shared_tiers = shared;
                o.redis_cluster = a.redis_cluster.clone();
                let mut label = format!(
                    "run {}/{total} ({}, ssd {:.1} GB, pool {:.1} GB)",
                    runs.len() + 1,
                    m.name,
                    cap as f64 / 1e9,
                    pool as f64 / 1e9
                );
                if a.nodes > 1 {
                    let how = if shared {
                        "shared tiers"
                    } else {
                        "own tiers only"
                    };
                    label = format!("{label}, {} nodes, {how}", a.nodes);
                }
                let mut shown = Shown::new(trace.requests.len() as u64, label, quiet);
                let r = kvstack_bench::profile::replay(&trace, &o, &mut |p| shown.update(p))
                    .map_err(CliError::Profile)?;
                shown.finish();
                runs.push(r);
            }
        }
    }
    if let Some(dir) = &a.out {
        write_out(dir, &runs, quiet)?;
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        let v = if runs.len() == 1 {
            serde_json::to_value(&runs[0])
        } else {
            serde_json::to_value(&runs).map(|r| serde_json::json!({ "runs": r }))
        }
        .map_err(CliError::Json)?;
        let text = serde_json::to_string_pretty(&v).map_err(CliError::Json)?;
        return writeln!(out, "{text}").map_err(CliError::Stdout);
    }
    for r in &runs {
        write!(out, "{r}").map_err(CliError::Stdout)?;
    }
    if runs.len() > 1 {
        summary(&mut out, &runs).map_err(CliError::Stdout)?;
    }
    Ok(())
}

fn summary(out: &mut impl Write, runs: &[ReplayReport]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<40} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8}",
        "model", "ssd GB", "pool GB", "hit", "live", "cache", "pool", "ssd", "replayed", "refused"
    )?;
    let nodes = runs.iter().any(|r| r.cluster.is_some());
    for r in runs {
        let h = &r.hit_rate_by_source;
        let p = |x: f64| format!("{:.1}%", 100.0 * x);
        writeln!(
            out,
            "{:<40} {:>9.1} {:>9.1} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8}",
            r.model,
            r.ssd.capacity_bytes as f64 / 1e9,
            r.dram_pool.capacity_bytes as f64 / 1e9,
            p(r.hit_rate_tokens),
            p(h.live),
            p(h.dram_cache),
            p(h.dram_pool),
            p(h.ssd),
            p(h.replayed),
            r.ssd.units_refused_full
        )?;
        if nodes {
            // Runs of several nodes: which mode, and what came from peers.
            let c = r.cluster.as_ref();
            writeln!(
                out,
                "  {} nodes, {}: peer {}, windows from the shared level {}",
                c.map_or(1, |c| c.nodes),
                if c.is_some_and(|c| c.shared_tiers) {
                    "shared tiers"
                } else {
                    "own tiers only"
                },
                p(h.peer),
                c.map_or(0, |c| c.windows_from_shared_level)
            )?;
        }
    }
    Ok(())
}

fn write_out(dir: &std::path::Path, runs: &[ReplayReport], quiet: bool) -> Result<(), CliError> {
    std::fs::create_dir_all(dir).map_err(|source| CliError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let json = if runs.len() == 1 {
        serde_json::to_string_pretty(&runs[0])
    } else {
        serde_json::to_string_pretty(&serde_json::json!({ "runs": runs }))
    }
    .map_err(CliError::Json)?;
    let path = dir.join("report.json");
    std::fs::write(&path, json).map_err(|source| CliError::Write {
        path: path.clone(),
        source,
    })?;
    let mut files = vec![path];
    for (i, r) in runs.iter().enumerate() {
        let prefix = if runs.len() == 1 {
            String::new()
        } else {
            format!("run{}-", i + 1)
        };
        files.extend(
            kvstack_bench::profile::plot::plot_run(r, dir, &prefix).map_err(CliError::Profile)?,
        );
    }
    if runs.len() > 1 {
        files.extend(
            kvstack_bench::profile::plot::plot_sweep(runs, dir).map_err(CliError::Profile)?,
        );
    }
    if !quiet {
        for f in files {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}

fn plan_cmd(a: &PlanArgs) -> Result<(), CliError> {
    let input = PlanInput {
        sessions: a.sessions,
        context_tokens: a.context,
        turns_per_hour: a.turns_per_hour,
        turns_per_session: a.turns,
        window_ttl_s: a.window_ttl as f64 / 1e3,
        retention_h: a.retention as f64 / 3.6e6,
    };
    let plans: Vec<Plan> = models(&a.model, &a.compare)?
        .iter()
        .map(|m| plan(&m.name, &m.config, &input))
        .collect::<Result<_, _>>()
        .map_err(CliError::Profile)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "input": input,
            "plans": plans,
        }))
        .map_err(CliError::Json)?;
        return writeln!(out, "{text}").map_err(CliError::Stdout);
    }
    writeln!(
        out,
        "{} sessions, {} tokens of context, {} turns/h over {} turns, window TTL {} s, \
         retention {} h",
        input.sessions,
        input.context_tokens,
        input.turns_per_hour,
        input.turns_per_session,
        input.window_ttl_s,
        input.retention_h
    )
    .map_err(CliError::Stdout)?;
    for p in &plans {
        write!(out, "{p}").map_err(CliError::Stdout)?;
    }
    Ok(())
}
