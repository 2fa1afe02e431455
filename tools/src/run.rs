//! `kvstack run`: the main job. Serves a simulated agent workload with the embedded tiny V4.1
//! model (the real V4.1-Flash cache geometry, weights generated in memory from a seed) through
//! the serving engine (`kvstack_engine::Service`): the paged cache for live sequences,
//! continuous batching, and prefix reuse through the SSD store in `--data-dir` and the DRAM
//! window pool. Prints a summary: prefill and decode tokens/s, where context tokens came from
//! (live sessions, the paged cache, SSD, the window pool, replayed, computed), bytes per tier,
//! measured bytes/token, and time to first token by kind of reuse. A second run over the same
//! data directory finds the first run's units on SSD.
//!
//! The workload: `--sessions` agent sessions of one tenant share a system prompt. Session `i`
//! arrives when session `i - 1` has its first token (so later sessions can find the shared
//! prompt); each turn sends a tool output (turn `k`'s is `k + 1` times `--tool-tokens`) and a
//! user message, and generates `--decode-tokens`; the next turn follows as soon as a turn
//! ends, so prefills of some sessions run beside decodes of others. Between turns a session
//! holds no cache unless `--keep-live`: it waits on its tools, and its next turn is restored
//! from the tiers.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvstack_cache::CacheOptions;
use kvstack_engine::{
    EngineOptions, Event, ModelSource, RequestSpec, Service, ServiceOptions, ServiceReport,
    SessionId,
};
use kvstack_kernels::model::Sampling;
use kvstack_model::PrefillMode;
use serde::Serialize;

use crate::error::CliError;
use crate::flags;

/// Tokens one session may reach: the paged cache's context limit in `kvstack run`.
const CONTEXT_LIMIT: u64 = 1 << 16;

/// Prefill mode.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModeArg {
    /// Every layer over every prompt token.
    Exact,
    /// Encoder over every prompt token, decoder over the last 128 (spec §3).
    Ced,
}

/// Arguments of `kvstack run`.
#[derive(Args)]
pub struct RunArgs {
    /// Data directory: the SSD store's segments (created if absent).
    #[arg(long, default_value = crate::DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Concurrent agent sessions.
    #[arg(long, default_value_t = 3, value_parser = flags::count::<usize>(1, 256))]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 3, value_parser = flags::count::<usize>(1, 1024))]
    turns: usize,
    /// Tokens of the system prompt all sessions share.
    #[arg(long, default_value_t = 512, value_parser = flags::count::<usize>(0, CONTEXT_LIMIT))]
    system_tokens: usize,
    /// Tokens of the first tool output; turn k's output is (k + 1) times as long.
    #[arg(long, default_value_t = 96, value_parser = flags::count::<usize>(0, CONTEXT_LIMIT))]
    tool_tokens: usize,
    /// Tokens of each user message.
    #[arg(long, default_value_t = 16, value_parser = flags::count::<usize>(1, CONTEXT_LIMIT))]
    user_tokens: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 16, value_parser = flags::count::<usize>(1, CONTEXT_LIMIT))]
    decode_tokens: usize,
    /// Prefill chunk (tokens per step).
    #[arg(long, default_value_t = 256, value_parser = flags::count::<usize>(1, CONTEXT_LIMIT))]
    chunk: usize,
    /// Prefill mode.
    #[arg(long, value_enum, default_value = "ced")]
    prefill: ModeArg,
    /// Threads for the routed experts.
    #[arg(long, default_value_t = 1, value_parser = flags::count::<usize>(1, 1024))]
    threads: usize,
    /// Seed of the model weights and the workload.
    #[arg(long, default_value_t = 4101)]
    seed: u64,
    /// Sampling temperature (greedy when absent).
    #[arg(long, value_parser = flags::temperature)]
    temperature: Option<f32>,
    /// Nucleus mass with --temperature.
    #[arg(long, default_value_t = 0.9, value_parser = flags::top_p)]
    top_p: f32,
    /// Keep each session's sequence in the paged cache between turns (no tier restores).
    #[arg(long)]
    keep_live: bool,
    /// Serve without the tiers (nothing persisted, no reuse across sessions or runs).
    #[arg(long)]
    no_tiers: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Deterministic workload tokens.
fn tokens(seed: u64, tag: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// The JSON summary (`--json`): the workload, then the service's counters.
#[derive(Serialize)]
struct Summary {
    sessions: usize,
    turns: usize,
    wall_seconds: f64,
    #[serde(flatten)]
    service: ServiceReport,
}

/// Checks what the flags' own ranges cannot: the longest session must fit the context limit.
fn check(a: &RunArgs) -> Result<(), CliError> {
    // Session context after its last turn: the system prompt, then per turn k its tool
    // output ((k + 1) x --tool-tokens), user message and generated tokens.
    let turns = a.turns as u128;
    let longest = a.system_tokens as u128
        + a.tool_tokens as u128 * turns * (turns + 1) / 2
        + (a.user_tokens as u128 + a.decode_tokens as u128) * turns;
    if longest > u128::from(CONTEXT_LIMIT) {
        return Err(CliError::Usage {
            flag: "--turns",
            reason: format!(
                "with --system-tokens {}, --tool-tokens {}, --user-tokens {} and --decode-tokens \
                 {}, {} turns make a session of {longest} tokens, over the {CONTEXT_LIMIT}-token \
                 context limit",
                a.system_tokens, a.tool_tokens, a.user_tokens, a.decode_tokens, a.turns
            ),
        });
    }
    Ok(())
}

/// Runs `kvstack run`.
pub fn run(a: &RunArgs) -> Result<(), CliError> {
    check(a)?;
    let mut opts = ServiceOptions::new(ModelSource::BuiltinTiny { seed: a.seed });
    if !a.no_tiers {
        std::fs::create_dir_all(&a.data_dir).map_err(CliError::Stdout)?;
        opts = opts.with_data_dir(&a.data_dir);
    }
    opts.threads = a.threads;
    opts.engine = EngineOptions {
        prefill: match a.prefill {
            ModeArg::Exact => PrefillMode::Exact,
            ModeArg::Ced => PrefillMode::Ced,
        },
        chunk: a.chunk,
        keep_live: a.keep_live,
        cache: CacheOptions {
            context_limit: CONTEXT_LIMIT,
            max_sequences: a.sessions + 1,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    };
    let mut engine = Service::open(opts).map_err(CliError::Runtime)?;
    let load = engine.load_time();
    let recovery = engine.recovery_seconds();
    let vocab = engine.engine().model().dims().vocab;
    let sampling = match a.temperature {
        Some(t) => Sampling::TopP {
            temperature: t,
            top_p: a.top_p,
        },
        None => Sampling::Greedy,
    };
    let system = tokens(a.seed, 1, a.system_tokens, vocab);
    let turn_input = |i: usize, k: usize| -> Vec<u32> {
        let mut v = if k == 0 { system.clone() } else { Vec::new() };
        let tag = ((i as u64) << 32) | k as u64;
        v.extend(tokens(a.seed, 2 + 2 * tag, a.tool_tokens * (k + 1), vocab));
        v.extend(tokens(a.seed, 3 + 2 * tag, a.user_tokens, vocab));
        v
    };
    let spec = |i: usize, k: usize| RequestSpec {
        tokens: turn_input(i, k),
        max_new_tokens: a.decode_tokens,
        sampling,
        seed: a.seed ^ ((i as u64) << 20) ^ k as u64,
    };

    let total = (a.sessions * a.turns) as u64;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} turns {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let sessions: Vec<SessionId> = (0..a.sessions)
        .map(|_| engine.open_session("agent"))
        .collect();
    // Which session each request belongs to, and each session's next turn.
    let mut owner = std::collections::HashMap::new();
    let mut next_turn = vec![0usize; a.sessions];
    let mut arrived = 0usize;
    let start = Instant::now();
    if a.sessions > 0 && a.turns > 0 {
        let id = engine
            .submit(sessions[0], spec(0, 0))
            .map_err(CliError::Runtime)?;
        owner.insert(id, 0usize);
        next_turn[0] = 1;
        arrived = 1;
    }
    let mut failures = Vec::new();
    while !engine.is_idle() {
        let events = engine.step().map_err(CliError::Runtime)?;
        for ev in events {
            match ev {
                Event::FirstToken { request, .. } => {
                    // The next session arrives once the previous one is being served.
                    if owner.get(&request) == Some(&(arrived - 1)) && arrived < a.sessions {
                        let i = arrived;
                        let id = engine
                            .submit(sessions[i], spec(i, 0))
                            .map_err(CliError::Runtime)?;
                        owner.insert(id, i);
                        next_turn[i] = 1;
                        arrived += 1;
                    }
                }
                Event::Finished(c) => {
                    bar.inc(1);
                    let i = owner.get(&c.request).copied().unwrap_or(0);
                    if next_turn[i] < a.turns {
                        let k = next_turn[i];
                        let id = engine
                            .submit(sessions[i], spec(i, k))
                            .map_err(CliError::Runtime)?;
                        owner.insert(id, i);
                        next_turn[i] += 1;
                    }
                }
                Event::Failed { request, error } => {
                    bar.inc(1);
                    failures.push(format!("request {}: {error}", request.0));
                }
                Event::Token { .. } => {}
            }
        }
        let st = engine.engine().stats();
        bar.set_message(format!(
            "prefill {:.0} tok/s, decode {:.1} tok/s, from SSD {} tokens",
            st.prefill_rate(),
            st.decode_rate(),
            st.ssd_tokens
        ));
    }
    engine.flush().map_err(CliError::Runtime)?;
    let wall = start.elapsed();
    bar.finish_and_clear();
    let summary = Summary {
        sessions: a.sessions,
        turns: a.turns,
        wall_seconds: wall.as_secs_f64(),
        service: engine.report(),
    };
    let pool = engine.engine().tiers().map(|t| t.pool().stats());
    let store = engine.engine().tiers().map(|t| t.store().stats());
    engine.close().map_err(CliError::Runtime)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let text = serde_json::to_string_pretty(&summary).map_err(CliError::Json)?;
        writeln!(out, "{text}").map_err(CliError::Stdout)?;
    } else {
        let (s, w) = (&summary.service, &summary);
        let pct = |n: u64| 100.0 * n as f64 / s.context_tokens.max(1) as f64;
        let mut lines = vec![
            format!(
                "model: built-in kvstack-tiny-v4.1 (40 layers, the CSA2 plan of V4.1-Flash, head dim 512, index 32 x 128), seed {}, generated in {:.1} s; {} expert thread(s); prefill {:?}, chunk {}",
                a.seed,
                load.as_secs_f64(),
                a.threads,
                a.prefill,
                a.chunk
            ),
            format!(
                "workload: {} sessions x {} turns (one tenant), shared system prompt {} tokens, tool outputs {}..{} tokens, user {} tokens, {} generated per turn; sessions {}",
                a.sessions,
                a.turns,
                a.system_tokens,
                a.tool_tokens,
                a.tool_tokens * a.turns,
                a.user_tokens,
                a.decode_tokens,
                if a.keep_live {
                    "stay live between turns"
                } else {
                    "release their cache between turns"
                }
            ),
            format!(
                "served {} requests ({} failed) in {:.1} s",
                s.requests, s.failed, w.wall_seconds
            ),
            format!(
                "prefill: {:.1} tokens/s ({} rows incl. replay); decode: {:.1} tokens/s ({} tokens, mean batch {:.2} sequences)",
                s.prefill_tokens_per_s,
                s.computed_tokens + s.replayed_tokens,
                s.decode_tokens_per_s,
                s.decode_tokens,
                s.mean_decode_batch
            ),
            format!(
                "context tokens: {} = live sessions {} ({:.1}%) + DRAM paged cache {} ({:.1}%) + SSD {} ({:.1}%) + computed {} ({:.1}%); windows from the DRAM pool {}, replayed {} tokens",
                s.context_tokens,
                s.live_tokens,
                pct(s.live_tokens),
                s.dram_cache_tokens,
                pct(s.dram_cache_tokens),
                s.ssd_tokens,
                pct(s.ssd_tokens),
                s.computed_tokens,
                pct(s.computed_tokens),
                s.pool_windows,
                s.replayed_tokens
            ),
            format!(
                "cache: {:.1} bytes per token of persistent KV (FP4 global entries + MXFP4 indexer keys, every layer) measured over finished sequences (spec: 890 at even lengths; a trailing incomplete compress group has no entry yet); DRAM paged cache {:.1} MB allocated",
                s.measured_bytes_per_token,
                s.dram_cache_bytes as f64 / 1e6
            ),
        ];
        match (&store, &pool) {
            (Some(st), Some(p)) => lines.push(format!(
                "tiers: SSD {} units ({} at start, recovered in {:.2} s), {} blocks, {:.1} MB live, {:.1} MB read this run ({:?} engine); DRAM window pool {} snapshots, {:.1} MB; {} units persisted, {} refused",
                st.units,
                s.ssd_units_at_start,
                recovery,
                st.blocks,
                st.live_bytes as f64 / 1e6,
                s.ssd_read_bytes as f64 / 1e6,
                st.engine.kind,
                p.entries,
                p.committed_bytes as f64 / 1e6,
                s.units_persisted,
                s.persist_failures
            )),
            _ => lines.push("tiers: off (--no-tiers)".into()),
        }
        let mut ttft = String::from(
            "time to first token, mean = queueing (admission, other requests' prefill steps) + service (lookup, restore, own prefill):",
        );
        for t in &s.ttft_ms {
            ttft.push_str(&format!(
                " {} {:.1} ms = {:.1} + {:.1} ({} requests);",
                t.reuse.label(),
                t.mean_ms,
                t.queue_ms,
                t.service_ms,
                t.requests
            ));
        }
        lines.push(ttft.trim_end_matches(';').to_owned());
        lines.push(format!(
            "data directory: {} (run again to serve these prefixes from SSD)",
            a.data_dir.display()
        ));
        for l in lines {
            writeln!(out, "{l}").map_err(CliError::Stdout)?;
        }
    }
    if !failures.is_empty() {
        for f in &failures {
            log::error!("{f}");
        }
        return Err(CliError::RunFailed {
            failed: failures.len(),
        });
    }
    Ok(())
}
