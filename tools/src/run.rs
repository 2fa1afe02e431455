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
use kvstack_model::tokenizer::{ByteLevel, Tokenizer};
use kvstack_model::{PrefillMode, WeightPrecision};
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
    /// Threads of the whole forward step (default: every core this process may use).
    #[arg(long, value_parser = flags::count::<usize>(1, 1024))]
    threads: Option<usize>,
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
    /// How the model holds its linear weights: `stored` (FP8/FP4/BF16 as the checkpoint
    /// stores them) or `f32` (the verification path: the same results, 4 bytes per weight).
    #[arg(long, value_enum, default_value = "stored")]
    weight_format: WeightFormatArg,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    /// Complete this text instead of running the agent workload: it is tokenized (the
    /// checkpoint's `tokenizer.json`, else byte-level), served through the tiers like any
    /// request, and the generated text streams to stdout (`--decode-tokens` of it at most, up
    /// to the end-of-sequence token); one summary line goes to stderr (`--json`: one object on
    /// stdout instead).
    #[arg(long, conflicts_with_all = ["sessions", "turns", "system_tokens", "tool_tokens", "user_tokens", "keep_live"])]
    prompt: Option<String>,
    /// A checkpoint's `config.json`, to run it instead of the built-in model (with --weights).
    #[arg(long, requires = "weights")]
    config: Option<PathBuf>,
    /// The checkpoint's weights: a safetensors file, or a sharded checkpoint (its directory or
    /// its `model.safetensors.index.json`); a `tokenizer.json` beside them is its tokenizer.
    #[arg(long, requires = "config")]
    weights: Option<PathBuf>,
}

/// `--weight-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightFormatArg {
    /// As the checkpoint stores them.
    Stored,
    /// Dequantized to f32.
    F32,
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

/// The model `a` names: a checkpoint, or the built-in model of its seed.
fn model_source(a: &RunArgs) -> ModelSource {
    match (&a.config, &a.weights) {
        (Some(config), Some(weights)) => ModelSource::Checkpoint {
            config: config.clone(),
            weights: weights.clone(),
        },
        _ => ModelSource::BuiltinTiny { seed: a.seed },
    }
}

/// Threads of the forward step: `--threads`, or every core this process may use.
fn threads(a: &RunArgs) -> usize {
    a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(std::num::NonZeroUsize::get)
            .unwrap_or(1)
    })
}

/// The service `a` asks for, serving at most `sequences` sequences at once.
fn service_options(a: &RunArgs, sequences: usize) -> Result<ServiceOptions, CliError> {
    let mut opts = ServiceOptions::new(model_source(a));
    if !a.no_tiers {
        std::fs::create_dir_all(&a.data_dir).map_err(CliError::Stdout)?;
        opts = opts.with_data_dir(&a.data_dir);
    }
    opts.threads = threads(a);
    opts.weight_precision = match a.weight_format {
        WeightFormatArg::Stored => WeightPrecision::Stored,
        WeightFormatArg::F32 => WeightPrecision::F32,
    };
    opts.engine = EngineOptions {
        prefill: match a.prefill {
            ModeArg::Exact => PrefillMode::Exact,
            ModeArg::Ced => PrefillMode::Ced,
        },
        chunk: a.chunk,
        keep_live: a.keep_live,
        cache: CacheOptions {
            context_limit: CONTEXT_LIMIT,
            max_sequences: sequences,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    };
    Ok(opts)
}

/// The sampling `a` asks for.
fn sampling(a: &RunArgs) -> Sampling {
    match a.temperature {
        Some(t) => Sampling::TopP {
            temperature: t,
            top_p: a.top_p,
        },
        None => Sampling::Greedy,
    }
}

/// `eos_token_id` of a `config.json` (top level, else in `text_config`), if it has one.
fn eos_token_id(config: &std::path::Path) -> Result<Option<u32>, CliError> {
    let bytes = kvstack_spec::files::read_regular(config, kvstack_spec::files::MAX_CONFIG_BYTES)
        .map_err(|e| CliError::Usage {
            flag: "--config",
            reason: format!("{}: {e}", config.display()),
        })?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(CliError::Json)?;
    let id = v
        .get("eos_token_id")
        .or_else(|| v.get("text_config").and_then(|t| t.get("eos_token_id")))
        .and_then(serde_json::Value::as_u64);
    Ok(id.and_then(|i| u32::try_from(i).ok()))
}

/// What `kvstack run --prompt --json` prints.
#[derive(Serialize)]
struct PromptSummary {
    /// The generated text.
    text: String,
    /// The generated token ids.
    tokens: Vec<u32>,
    /// Tokens of the prompt.
    prompt_tokens: usize,
    /// `stop` (the end-of-sequence token) or `length` (`--decode-tokens`).
    finish_reason: &'static str,
    /// The tokenizer: `byte-level` or its `tokenizer.json`.
    tokenizer: String,
    /// Time to first token (ms) and its queueing part.
    ttft_ms: f64,
    /// Where the context came from.
    reuse: kvstack_engine::Reuse,
}

/// `kvstack run --prompt TEXT`: one completion, its text streamed to stdout.
fn run_prompt(a: &RunArgs, text: &str) -> Result<(), CliError> {
    let mut engine = Service::open(service_options(a, 2)?).map_err(CliError::Runtime)?;
    let vocab = engine.engine().model().dims().vocab as u32;
    let tokenizer = match (&a.config, &a.weights) {
        (Some(c), Some(w)) => Tokenizer::for_weights(w, vocab, eos_token_id(c)?),
        _ => ByteLevel::new(vocab).map(Tokenizer::Bytes),
    }
    .map_err(CliError::Model)?;
    let prompt = tokenizer.encode(text).map_err(CliError::Model)?;
    if prompt.is_empty() {
        return Err(CliError::Usage {
            flag: "--prompt",
            reason: "the text has no tokens".into(),
        });
    }
    let session = engine.open_session("prompt");
    let id = engine
        .submit(
            session,
            RequestSpec {
                tokens: prompt.clone(),
                max_new_tokens: a.decode_tokens,
                sampling: sampling(a),
                seed: a.seed,
            },
        )
        .map_err(CliError::Runtime)?;
    let mut out = std::io::stdout().lock();
    let (mut generated, mut printed) = (Vec::new(), 0usize);
    let mut done = None;
    let mut finish_reason = "length";
    while done.is_none() {
        if engine.is_idle() {
            return Err(CliError::Usage {
                flag: "--prompt",
                reason: "the engine went idle before the request finished".into(),
            });
        }
        for ev in engine.step().map_err(CliError::Runtime)? {
            match ev {
                Event::FirstToken { token, .. } | Event::Token { token, .. } => {
                    generated.push(token);
                    if tokenizer.eos() == Some(token) {
                        finish_reason = "stop";
                        done = engine.stop(id);
                    }
                    if !a.json {
                        // A token may end inside a UTF-8 character: hold back the
                        // replacement characters at the end until it completes.
                        let full = tokenizer.decode(&generated);
                        let ready = full.trim_end_matches('\u{FFFD}');
                        if ready.len() > printed && ready.is_char_boundary(printed) {
                            write!(out, "{}", &ready[printed..]).map_err(CliError::Stdout)?;
                            out.flush().map_err(CliError::Stdout)?;
                            printed = ready.len();
                        }
                    }
                }
                Event::Finished(c) => done = Some(c),
                Event::Failed { error, .. } => {
                    return Err(CliError::Usage {
                        flag: "--prompt",
                        reason: format!("the request failed: {error}"),
                    });
                }
            }
        }
    }
    engine.flush().map_err(CliError::Runtime)?;
    let c = done.ok_or_else(|| CliError::Usage {
        flag: "--prompt",
        reason: "no completion".into(),
    })?;
    engine.close().map_err(CliError::Runtime)?;
    let full = tokenizer.decode(&c.tokens);
    if a.json {
        let s = PromptSummary {
            text: full,
            tokens: c.tokens.clone(),
            prompt_tokens: prompt.len(),
            finish_reason,
            tokenizer: tokenizer.describe(),
            ttft_ms: c.ttft.as_secs_f64() * 1e3,
            reuse: c.reuse,
        };
        let text = serde_json::to_string_pretty(&s).map_err(CliError::Json)?;
        writeln!(out, "{text}").map_err(CliError::Stdout)?;
    } else {
        if full.len() > printed {
            write!(out, "{}", &full[printed.min(full.len())..]).map_err(CliError::Stdout)?;
        }
        writeln!(out).map_err(CliError::Stdout)?;
        let r = &c.reuse;
        eprintln!(
            "prompt {} tokens ({}): {} from the tiers (paged cache {}, SSD {}, window {}), {} computed; {} generated ({finish_reason}); time to first token {:.1} ms ({:.1} queued), {:.2} s in all",
            prompt.len(),
            tokenizer.describe(),
            r.live_tokens + r.mapped_tokens + r.ssd_tokens,
            r.mapped_tokens,
            r.ssd_tokens,
            if r.window_from_pool {
                "from the DRAM pool"
            } else {
                "replayed or computed"
            },
            r.computed_tokens,
            c.tokens.len(),
            c.ttft.as_secs_f64() * 1e3,
            c.ttft_queued.as_secs_f64() * 1e3,
            c.total.as_secs_f64()
        );
    }
    Ok(())
}

/// Runs `kvstack run`.
pub fn run(a: &RunArgs) -> Result<(), CliError> {
    if let Some(text) = &a.prompt {
        return run_prompt(a, text);
    }
    check(a)?;
    let opts = service_options(a, a.sessions + 1)?;
    let mut engine = Service::open(opts).map_err(CliError::Runtime)?;
    let load = engine.load_time();
    let recovery = engine.recovery_seconds();
    let vocab = engine.engine().model().dims().vocab;
    let layers = engine.engine().model().dims().layers;
    let sampling = sampling(a);
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
            match &a.weights {
                None => format!(
                    "model: built-in kvstack-tiny-v4.1 (40 layers, the CSA2 plan of V4.1-Flash, head dim 512, index 32 x 128), seed {}, generated in {:.1} s; {} thread(s); prefill {:?}, chunk {}",
                    a.seed,
                    load.as_secs_f64(),
                    threads(a),
                    a.prefill,
                    a.chunk
                ),
                Some(w) => format!(
                    "model: checkpoint {} ({layers} layers), loaded in {:.1} s; {} thread(s); prefill {:?}, chunk {}",
                    w.display(),
                    load.as_secs_f64(),
                    threads(a),
                    a.prefill,
                    a.chunk
                ),
            },
            format!(
                "weights: {:.1} MB resident ({}; as f32: {:.1} MB, {:.2}x)",
                s.weight_bytes_resident as f64 / 1e6,
                match a.weight_format {
                    WeightFormatArg::Stored => "linear weights as stored: FP8, FP4, BF16",
                    WeightFormatArg::F32 => "--weight-format f32",
                },
                s.weight_bytes_f32 as f64 / 1e6,
                s.weight_bytes_f32 as f64 / s.weight_bytes_resident.max(1) as f64
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
