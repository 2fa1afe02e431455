//! `kvstack run`: the main job. Serves a simulated agent workload (several multi-turn sessions
//! sharing a long system prompt, with growing tool outputs) with the embedded tiny V4.1 model
//! (the real V4.1-Flash cache geometry, weights generated in memory from a seed) and prints a
//! summary: prefill and decode tokens/s, tokens reused vs computed, cache bytes and measured
//! bytes/token, time to first token with and without reuse.
//!
//! Today each session keeps its KV state live in memory between turns (a turn computes only its
//! new tokens). Cross-session prefix reuse through the paged cache's prefix index and the SSD /
//! DRAM tiers is not wired in yet; the summary prints "n/a" for those figures.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvstack_kernels::model::{Sampling, sample};
use kvstack_runtime::attention::ContiguousStore;
use kvstack_runtime::model::init::random_model;
use kvstack_runtime::model::{Model, PrefillMode};
use kvstack_runtime::plan::LayerMode;

use crate::error::CliError;

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
    /// Data directory (created if absent; the SSD tier will live here).
    #[arg(long, default_value = "kvstack-data")]
    data_dir: PathBuf,
    /// Concurrent agent sessions.
    #[arg(long, default_value_t = 3)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Tokens of the system prompt all sessions share.
    #[arg(long, default_value_t = 512)]
    system_tokens: usize,
    /// Tokens of the first tool output; turn k's output is (k + 1) times as long.
    #[arg(long, default_value_t = 96)]
    tool_tokens: usize,
    /// Tokens of each user message.
    #[arg(long, default_value_t = 16)]
    user_tokens: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
    /// Prefill chunk (tokens per step).
    #[arg(long, default_value_t = 256)]
    chunk: usize,
    /// Prefill mode.
    #[arg(long, value_enum, default_value = "ced")]
    prefill: ModeArg,
    /// Threads for the routed experts.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Seed of the model weights and the workload.
    #[arg(long, default_value_t = 4101)]
    seed: u64,
    /// Sampling temperature (greedy when absent).
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus mass with --temperature.
    #[arg(long, default_value_t = 0.9)]
    top_p: f32,
}

/// Deterministic workload tokens.
fn tokens(seed: u64, tag: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

struct Session {
    store: ContiguousStore,
    turn: usize,
}

#[derive(Default)]
struct Stats {
    prefill_tokens: u64,
    prefill_time: Duration,
    decode_tokens: u64,
    decode_time: Duration,
    reused_tokens: u64,
    ttft_cold: Vec<Duration>,
    ttft_warm: Vec<Duration>,
}

fn mean(v: &[Duration]) -> String {
    if v.is_empty() {
        return "n/a".into();
    }
    let s: Duration = v.iter().sum();
    format!("{:.1} ms", s.as_secs_f64() * 1e3 / v.len() as f64)
}

fn global_bytes(model: &Model, store: &ContiguousStore) -> u64 {
    model
        .attention()
        .plan()
        .layers
        .iter()
        .filter(|s| s.mode == LayerMode::Full)
        .map(|s| {
            (store.compressed_rows(s.index).len() + store.index_key_rows(s.index).len()) as u64
        })
        .sum()
}

/// Runs `kvstack run`.
pub fn run(a: &RunArgs) -> Result<(), CliError> {
    let cfg = kvstack_runtime::builtin::tiny_config().map_err(CliError::Runtime)?;
    std::fs::create_dir_all(&a.data_dir).map_err(CliError::Stdout)?;
    let t0 = Instant::now();
    let mut model = random_model(&cfg, a.seed).map_err(CliError::Model)?;
    model.set_threads(a.threads);
    let load = t0.elapsed();
    let vocab = model.dims().vocab;
    let mode = match a.prefill {
        ModeArg::Exact => PrefillMode::Exact,
        ModeArg::Ced => PrefillMode::Ced,
    };
    let sampling = match a.temperature {
        Some(t) => Sampling::TopP {
            temperature: t,
            top_p: a.top_p,
        },
        None => Sampling::Greedy,
    };
    let system = tokens(a.seed, 1, a.system_tokens, vocab);
    let total: u64 = (0..a.turns)
        .map(|k| (a.tool_tokens * (k + 1) + a.user_tokens + a.decode_tokens) as u64)
        .sum::<u64>()
        * a.sessions as u64
        + (a.system_tokens * a.sessions) as u64;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} tokens {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let window = model.window();
    let mut sessions: Vec<Session> = (0..a.sessions)
        .map(|_| Session {
            store: model.new_store(Some(window)),
            turn: 0,
        })
        .collect();
    let mut st = Stats::default();
    let mut rng = a.seed | 1;
    let mut uniform = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 40) as f32 / (1u64 << 24) as f32
    };
    for turn in 0..a.turns {
        // Prefill every session's new input, then decode all sessions round-robin.
        let mut next: Vec<u32> = Vec::with_capacity(a.sessions);
        for (i, s) in sessions.iter_mut().enumerate() {
            bar.set_message(format!("turn {} session {i}: prefill", turn + 1));
            let mut input = Vec::new();
            if s.turn == 0 {
                input.extend_from_slice(&system);
            }
            let tag = ((i as u64) << 32) | turn as u64;
            input.extend(tokens(
                a.seed,
                2 + 2 * tag,
                a.tool_tokens * (turn + 1),
                vocab,
            ));
            input.extend(tokens(a.seed, 3 + 2 * tag, a.user_tokens, vocab));
            let reused = s.store_len();
            let t = Instant::now();
            let logits = model
                .prefill(&mut s.store, &input, mode, a.chunk)
                .map_err(CliError::Model)?;
            let tok = sample(&logits, sampling, uniform()).unwrap_or(0) as u32;
            let dt = t.elapsed();
            st.prefill_tokens += input.len() as u64;
            st.prefill_time += dt;
            st.reused_tokens += reused;
            if reused == 0 {
                st.ttft_cold.push(dt);
            } else {
                st.ttft_warm.push(dt);
            }
            s.turn += 1;
            next.push(tok);
            bar.inc(input.len() as u64);
        }
        bar.set_message(format!("turn {}: decode", turn + 1));
        for _ in 0..a.decode_tokens {
            for (s, tok) in sessions.iter_mut().zip(next.iter_mut()) {
                let t = Instant::now();
                let logits = model.decode(&mut s.store, *tok).map_err(CliError::Model)?;
                *tok = sample(&logits, sampling, uniform()).unwrap_or(0) as u32;
                st.decode_time += t.elapsed();
                st.decode_tokens += 1;
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let tokens_held: u64 = sessions.iter().map(|s| s.store_len()).sum();
    let bytes: u64 = sessions
        .iter()
        .map(|s| global_bytes(&model, &s.store))
        .sum();
    let rate =
        |n: u64, d: Duration| format!("{:.1} tokens/s", n as f64 / d.as_secs_f64().max(1e-9));
    let mut out = std::io::stdout().lock();
    let lines = [
        format!(
            "model: built-in kvstack-tiny-v4.1 (40 layers, CSA2 plan of V4.1-Flash, head dim 512), seed {}, generated in {:.1} s; {} expert thread(s); prefill {:?}",
            a.seed,
            load.as_secs_f64(),
            a.threads,
            mode
        ),
        format!(
            "workload: {} sessions x {} turns, system prompt {} tokens, tool outputs {}..{} tokens, user {} tokens, {} generated per turn",
            a.sessions,
            a.turns,
            a.system_tokens,
            a.tool_tokens,
            a.tool_tokens * a.turns,
            a.user_tokens,
            a.decode_tokens
        ),
        format!(
            "prefill: {} tokens, {}",
            st.prefill_tokens,
            rate(st.prefill_tokens, st.prefill_time)
        ),
        format!(
            "decode:  {} tokens, {} (sessions interleaved one token per step)",
            st.decode_tokens,
            rate(st.decode_tokens, st.decode_time)
        ),
        format!(
            "tokens: computed {} (prefill) + {} (decode); reused from live sessions (DRAM) {}; from the DRAM window pool n/a; from SSD n/a",
            st.prefill_tokens, st.decode_tokens, st.reused_tokens
        ),
        format!(
            "cache: global KV + index keys {} B for {} tokens = {:.1} B/token measured (spec: 890); window rows {} B per session",
            bytes,
            tokens_held,
            bytes as f64 / tokens_held.max(1) as f64,
            model.dims().layers * window * model.attention().window_codec().bytes()
        ),
        "tiers: SSD bytes n/a, DRAM window pool bytes n/a (tiers not wired into run yet)"
            .to_owned(),
        format!(
            "time to first token: without reuse {} (first turn of each session); with reuse of the live session {}; with a cached prefix from the tiers n/a",
            mean(&st.ttft_cold),
            mean(&st.ttft_warm)
        ),
        format!(
            "data directory: {} (nothing persisted yet)",
            a.data_dir.display()
        ),
    ];
    for l in lines {
        writeln!(out, "{l}").map_err(CliError::Stdout)?;
    }
    Ok(())
}

impl Session {
    fn store_len(&self) -> u64 {
        use kvstack_runtime::attention::KvStore;
        self.store.len()
    }
}
