//! `kvstack bench runtime`: the engine on the built-in tiny model (the real V4.1-Flash cache
//! geometry) — prefill and decode tokens/s at each thread count, time to first token of a
//! long prompt whose prefix is cached (global KV on SSD with the window in the DRAM pool, and
//! with the window missing, rebuilt by bounded replay) against the same prompt computed from
//! scratch in the same run, how far the reused runs' first-token logits are from the
//! scratch run's, and CED against exact prefill.
//!
//! Every cached run starts a new engine (an empty paged cache) over the same tiers, so the
//! global KV really comes from the SSD store (O_DIRECT when the file system allows it).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvstack_kernels::model::{Sampling, argmax};
use kvstack_kernels::peak::Peaks;
use kvstack_kernels::work::Work;
use serde::Serialize;

use kvstack_cache::CacheOptions;
use kvstack_engine::{Completion, Engine, EngineOptions, Event, RequestSpec, ReuseKind};
use kvstack_model::init::random_model;
use kvstack_model::verify::row_errors;
use kvstack_model::{BatchItem, Logits, Model, PrefillMode, WeightPrecision};
use kvstack_spec::ModelConfig;
use kvstack_tiers::{StoreLocation, StoreOptions, SystemClock, TierOptions, Tiers};

use crate::{Error, Result};

/// Options of [`run_runtime_bench`].
#[derive(Clone, Debug)]
pub struct RuntimeBenchOptions {
    /// Directory on the SSD to measure (the bench works in a subdirectory it removes).
    pub dir: PathBuf,
    /// Tokens of the long prompt.
    pub tokens: usize,
    /// Of those, the new tokens after the cached prefix.
    pub suffix: usize,
    /// Thread counts of the throughput runs.
    pub threads: Vec<usize>,
    /// Prompt tokens of the prefill throughput run.
    pub prefill_tokens: usize,
    /// Sequences decoding together in the decode throughput run.
    pub decode_sessions: usize,
    /// Tokens each decodes.
    pub decode_tokens: usize,
    /// Prompt tokens of the CED vs exact comparison (0: skip it).
    pub ced_tokens: usize,
    /// Prefill mode of the engine runs.
    pub prefill: PrefillMode,
    /// Prefill chunk.
    pub chunk: usize,
    /// Seed of the weights and tokens.
    pub seed: u64,
    /// Measure decode and prefill against the machine's ceilings ([`LimitsReport`]).
    pub limits: bool,
}

impl RuntimeBenchOptions {
    /// The defaults: a 32,768-token prompt, 1 and 2 threads.
    pub fn new(dir: PathBuf) -> RuntimeBenchOptions {
        RuntimeBenchOptions {
            dir,
            tokens: 32_768,
            suffix: 64,
            threads: vec![1, 2],
            prefill_tokens: 2048,
            decode_sessions: 4,
            decode_tokens: 32,
            ced_tokens: 1024,
            prefill: PrefillMode::Ced,
            chunk: 256,
            seed: 4101,
            limits: true,
        }
    }
}

/// Throughput at one thread count.
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// Expert threads.
    pub threads: usize,
    /// Prefill rows per second (one prompt of `prefill_tokens`).
    pub prefill_tokens_per_s: f64,
    /// Decoded tokens per second, all sequences together.
    pub decode_tokens_per_s: f64,
    /// Mean sequences per decode step.
    pub decode_batch: f64,
    /// Prefill tokens/s over `threads` times the 1-thread run's (when one ran).
    pub prefill_efficiency: Option<f64>,
    /// Decode tokens/s over `threads` times the 1-thread run's (when one ran).
    pub decode_efficiency: Option<f64>,
}

/// One time-to-first-token run of the long prompt.
#[derive(Clone, Debug, Serialize)]
pub struct TtftRun {
    /// How its context was obtained.
    pub reuse: ReuseKind,
    /// Submission to first token, seconds.
    pub ttft_s: f64,
    /// Of that, the lookup and restore (SSD reads, window), seconds.
    pub restore_s: f64,
    /// This run's time over the scratch run's.
    pub ratio_to_scratch: f64,
    /// Tokens read from SSD.
    pub ssd_tokens: u64,
    /// Bytes read from SSD.
    pub ssd_bytes: u64,
    /// Tokens replayed.
    pub replayed_tokens: u64,
    /// Tokens computed.
    pub computed_tokens: u64,
    /// Worst first-token logit difference to the scratch run, relative to the largest
    /// scratch logit magnitude.
    pub logit_error: f64,
    /// Whether the first token equals the scratch run's.
    pub same_top1: bool,
}

/// CED against exact prefill on the built-in model.
#[derive(Clone, Debug, Serialize)]
pub struct CedReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Next-token logits compared (after the prompt, then greedy steps).
    pub steps: usize,
    /// Worst logit difference relative to the exact run's largest logit magnitude.
    pub worst_logit_error: f64,
    /// Steps whose top-1 token agrees.
    pub top1_agreement: usize,
}

/// What [`run_runtime_bench`] measured.
#[derive(Clone, Debug, Serialize)]
pub struct RuntimeReport {
    /// The model.
    pub model: String,
    /// Prefill mode of the engine runs.
    pub prefill_mode: String,
    /// Per thread count.
    pub throughput: Vec<Throughput>,
    /// Tokens of the long prompt.
    pub prompt_tokens: usize,
    /// Tokens of its cached prefix.
    pub cached_tokens: usize,
    /// Threads of the TTFT runs.
    pub ttft_threads: usize,
    /// The prompt computed from scratch, seconds.
    pub scratch_ttft_s: f64,
    /// The cached runs.
    pub cached: Vec<TtftRun>,
    /// The SSD I/O engine.
    pub io_engine: String,
    /// CED vs exact.
    pub ced: Option<CedReport>,
    /// Decode and prefill against the machine's ceilings, one thread (absent with
    /// `limits = false`).
    pub limits: Option<LimitsReport>,
    /// Targets missed (a TTFT ratio above 0.1, a parallel efficiency below 0.7 at 2 threads).
    pub failures: Vec<String>,
}

impl RuntimeReport {
    /// Whether every target was met.
    pub fn meets_targets(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Decode of the built-in model at one batch size against its binding limit (one thread).
#[derive(Clone, Debug, Serialize)]
pub struct DecodeLimit {
    /// Sequences decoding together.
    pub batch: usize,
    /// Decoded tokens per second (all sequences).
    pub tokens_per_s: f64,
    /// Weight bytes the linear products read per step (each product's weights once).
    pub weight_bytes_per_step: f64,
    /// Cache bytes read per step, as stored: the attention's window rows and selected
    /// entries, and the index keys the indexer scans.
    pub cache_bytes_per_step: f64,
    /// FLOPs of the linear products per step (2 per multiply-add).
    pub linear_flops_per_step: f64,
    /// FLOPs of the sparse attention per step (logits and `P · V`, 2 per multiply-add).
    pub attention_flops_per_step: f64,
    /// 8-bit multiply-adds of the indexer scans per step.
    pub index_macs_per_step: f64,
    /// Tokens/s if the step took only the binding time: its weight and cache bytes at the
    /// read stream, or its f32 FLOPs at the FMA peak plus its index multiply-adds at the 8-bit
    /// peak, whichever is longer.
    pub limit_tokens_per_s: f64,
    /// Which one binds: `memory` or `fma` (the compute peaks).
    pub bound: &'static str,
    /// `tokens_per_s / limit_tokens_per_s`.
    pub ratio: f64,
}

/// Prefill of one prompt against the compute peaks (one thread, or the TTFT run's threads).
#[derive(Clone, Debug, Serialize)]
pub struct PrefillLimit {
    /// Prompt tokens.
    pub tokens: usize,
    /// Prefill tokens per second.
    pub tokens_per_s: f64,
    /// Linear FLOPs per token.
    pub linear_flops_per_token: f64,
    /// Sparse attention FLOPs per token.
    pub attention_flops_per_token: f64,
    /// Indexer 8-bit multiply-adds per token.
    pub index_macs_per_token: f64,
    /// The time the prefill would take at the peaks (its f32 FLOPs at the FMA peak, its index
    /// multiply-adds at the 8-bit peak) over the time it took: the fraction of the peaks
    /// reached.
    pub ratio: f64,
}

/// The runtime against the machine's ceilings, all on one thread and in the same run.
///
/// The work is what the kernels count (`kvstack_kernels::work`): linear products, sparse
/// attention and the indexer scans, their multiply-adds and the weight and cache bytes they
/// read. Norms, rotations, hyper-connections, the router and the softmax exponentials are not
/// counted (a few percent of a step), so the limits are slightly above the true ones and the
/// ratios slightly below.
#[derive(Clone, Debug, Serialize)]
pub struct LimitsReport {
    /// Read stream of one thread over 512 MiB, GB/s (best of 3).
    pub read_gb_s: f64,
    /// FMA peak of one thread, GFLOP/s (best of 20).
    pub fma_gflop_s: f64,
    /// 8-bit multiply-add peak of one thread with the indexer's instruction, G/s (best of
    /// 20; 0 where the level has no integer kernel, and the index work is then held to the
    /// FMA peak).
    pub int8_gmac_s: f64,
    /// Weight bytes resident with the weights as stored.
    pub weights_resident_bytes: u64,
    /// The same weights as f32.
    pub weights_f32_bytes: u64,
    /// Decode at batch 1 and 4.
    pub decode: Vec<DecodeLimit>,
    /// Decode at batch 1 with f32 weights (`--weight-format f32`): same bits, more bytes.
    pub decode_f32_weights_tokens_per_s: f64,
    /// Prefill of the throughput prompt (and of the long prompt's scratch run when it ran).
    pub prefill: Vec<PrefillLimit>,
}

/// Decode target: tokens/s over the binding limit.
pub const DECODE_LIMIT_TARGET: f64 = 0.5;

/// Prefill target: linear FLOPs/s over the FMA peak.
pub const PREFILL_PEAK_TARGET: f64 = 0.4;

/// The TTFT target: cached / scratch.
pub const TTFT_TARGET: f64 = 0.1;

/// The parallel efficiency target at 2 threads: tokens/s over twice the 1-thread tokens/s.
pub const EFFICIENCY_TARGET: f64 = 0.7;

impl std::fmt::Display for RuntimeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "model: {}; prefill {}", self.model, self.prefill_mode)?;
        for t in &self.throughput {
            writeln!(
                f,
                "throughput, {} thread(s): prefill {:.1} tokens/s, decode {:.1} tokens/s (mean batch {:.2})",
                t.threads, t.prefill_tokens_per_s, t.decode_tokens_per_s, t.decode_batch
            )?;
            if let (Some(p), Some(d)) = (t.prefill_efficiency, t.decode_efficiency) {
                writeln!(
                    f,
                    "  parallel efficiency vs 1 thread: prefill {p:.2}, decode {d:.2}{}",
                    if t.threads == 2 {
                        format!(" (target >= {EFFICIENCY_TARGET})")
                    } else {
                        String::new()
                    }
                )?;
            }
        }
        writeln!(
            f,
            "time to first token, {}-token prompt, {} thread(s): computed from scratch {:.2} s",
            self.prompt_tokens, self.ttft_threads, self.scratch_ttft_s
        )?;
        for c in &self.cached {
            writeln!(
                f,
                "  {} ({} cached tokens, {} read from SSD = {:.1} MB, {} replayed, {} computed): {:.3} s (restore {:.3} s) = {:.4} of scratch (target <= {TTFT_TARGET}); first-token logits vs scratch: worst error {:.2e}, same top-1: {}",
                c.reuse.label(),
                self.cached_tokens,
                c.ssd_tokens,
                c.ssd_bytes as f64 / 1e6,
                c.replayed_tokens,
                c.computed_tokens,
                c.ttft_s,
                c.restore_s,
                c.ratio_to_scratch,
                c.logit_error,
                c.same_top1
            )?;
        }
        writeln!(f, "SSD I/O engine: {}", self.io_engine)?;
        if let Some(c) = &self.ced {
            writeln!(
                f,
                "CED vs exact prefill, {}-token prompt: worst next-token logit error {:.3e} (relative to the largest logit) over {} steps, top-1 agreement {}/{}",
                c.prompt_tokens, c.worst_logit_error, c.steps, c.top1_agreement, c.steps
            )?;
        }
        if let Some(l) = &self.limits {
            writeln!(
                f,
                "ceilings (1 thread, this run): read stream {:.1} GB/s, FMA {:.1} GFLOP/s, 8-bit multiply-add {:.1} G/s; weights {:.1} MB resident as stored (f32: {:.1} MB)",
                l.read_gb_s,
                l.fma_gflop_s,
                l.int8_gmac_s,
                l.weights_resident_bytes as f64 / 1e6,
                l.weights_f32_bytes as f64 / 1e6
            )?;
            for d in &l.decode {
                writeln!(
                    f,
                    "  decode, batch {}: {:.1} tokens/s; per step {:.1} MB of weights + {:.1} MB of cache, {:.3} GFLOP of linears + {:.3} of attention + {:.3} G index multiply-adds; limit ({} bound) {:.1} tokens/s: {:.2} of it (target >= {DECODE_LIMIT_TARGET})",
                    d.batch,
                    d.tokens_per_s,
                    d.weight_bytes_per_step / 1e6,
                    d.cache_bytes_per_step / 1e6,
                    d.linear_flops_per_step / 1e9,
                    d.attention_flops_per_step / 1e9,
                    d.index_macs_per_step / 1e9,
                    d.bound,
                    d.limit_tokens_per_s,
                    d.ratio
                )?;
            }
            writeln!(
                f,
                "  decode, batch 1, f32 weights: {:.1} tokens/s",
                l.decode_f32_weights_tokens_per_s
            )?;
            for p in &l.prefill {
                writeln!(
                    f,
                    "  prefill, {} tokens: {:.1} tokens/s; per token {:.1} MFLOP of linears + {:.1} of attention + {:.1} M index multiply-adds: {:.2} of the peaks (target >= {PREFILL_PEAK_TARGET})",
                    p.tokens,
                    p.tokens_per_s,
                    p.linear_flops_per_token / 1e6,
                    p.attention_flops_per_token / 1e6,
                    p.index_macs_per_token / 1e6,
                    p.ratio
                )?;
            }
        }
        if self.failures.is_empty() {
            writeln!(f, "all targets met")
        } else {
            writeln!(f, "targets missed: {}", self.failures.join("; "))
        }
    }
}

fn tokens(seed: u64, tag: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = (seed ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

fn engine_opts(o: &RuntimeBenchOptions, keep_live: bool) -> EngineOptions {
    EngineOptions {
        prefill: o.prefill,
        chunk: o.chunk.max(1),
        keep_live,
        keep_first_logits: true,
        cache: CacheOptions {
            context_limit: (o.tokens as u64 + 1024).max(1 << 16),
            max_sequences: o.decode_sessions.max(1) + 1,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    }
}

/// Runs one request alone on `engine`; its completion.
fn one(engine: &mut Engine, tokens: Vec<u32>, new: usize) -> Result<Completion> {
    let s = engine.open_session("bench");
    engine.submit(
        s,
        RequestSpec {
            tokens,
            max_new_tokens: new,
            sampling: Sampling::Greedy,
            seed: 1,
        },
    )?;
    let mut done = None;
    let mut failed = None;
    engine.run_until_idle(|e| match e {
        Event::Finished(c) => done = Some(c.clone()),
        Event::Failed { error, .. } => failed = Some(error.clone()),
        _ => {}
    })?;
    engine.close_session(s)?;
    if let Some(e) = failed {
        return Err(Error::Run(format!("session {}: {e}", s.0)));
    }
    done.ok_or_else(|| Error::Run(format!("session {}: no completion", s.0)))
}

fn open_tiers(cfg: &ModelConfig, dir: &std::path::Path, seed: u64) -> Result<Tiers> {
    let opts = TierOptions {
        weights_id: format!("builtin kvstack-tiny-v4.1 seed {seed}").into_bytes(),
        ..TierOptions::new(StoreOptions::new(StoreLocation::Directory(
            dir.to_path_buf(),
        )))
    };
    Ok(Tiers::open(cfg, 256, opts, Arc::new(SystemClock))?)
}

fn compare(a: &[f32], reference: &[f32]) -> (f64, bool) {
    let (err, _) = row_errors(a, reference, reference.len().max(1), f64::INFINITY);
    (err, argmax(a) == argmax(reference))
}

/// Runs the benchmark, reporting each stage to `progress`.
///
/// # Errors
/// Model, engine and store errors; a data directory that cannot be created.
pub fn run_runtime_bench(
    o: &RuntimeBenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<RuntimeReport> {
    let cfg = kvstack_spec::builtin::tiny_config()?;
    let mut model: Model = random_model(&cfg, o.seed)?;
    let vocab = model.dims().vocab;
    let mut throughput = Vec::new();
    for &t in &o.threads {
        let t = t.max(1);
        model.set_threads(t);
        progress(&format!(
            "{t} thread(s): prefill of {} tokens",
            o.prefill_tokens
        ));
        let mut e = Engine::new(&cfg, model.clone(), None, engine_opts(o, true))?;
        one(
            &mut e,
            tokens(o.seed, 10, o.prefill_tokens.max(1), vocab),
            1,
        )?;
        let prefill = e.stats().prefill_rate();
        progress(&format!(
            "{t} thread(s): {} sequences decoding {} tokens together",
            o.decode_sessions, o.decode_tokens
        ));
        let mut e = Engine::new(&cfg, model.clone(), None, engine_opts(o, true))?;
        let sessions: Vec<_> = (0..o.decode_sessions.max(1))
            .map(|_| e.open_session("bench"))
            .collect();
        for (i, &s) in sessions.iter().enumerate() {
            e.submit(
                s,
                RequestSpec {
                    tokens: tokens(o.seed, 20 + i as u64, 128, vocab),
                    max_new_tokens: o.decode_tokens.max(1) + 1,
                    sampling: Sampling::Greedy,
                    seed: i as u64,
                },
            )?;
        }
        e.run_until_idle(|_| {})?;
        let st = e.stats();
        throughput.push(Throughput {
            threads: t,
            prefill_tokens_per_s: prefill,
            decode_tokens_per_s: st.decode_rate(),
            decode_batch: st.decode_batch_rows as f64 / st.decode_steps.max(1) as f64,
            prefill_efficiency: None,
            decode_efficiency: None,
        });
    }
    if let Some(one) = throughput.iter().find(|t| t.threads == 1).cloned() {
        for t in throughput.iter_mut().filter(|t| t.threads > 1) {
            let n = t.threads as f64;
            t.prefill_efficiency = Some(t.prefill_tokens_per_s / (n * one.prefill_tokens_per_s));
            t.decode_efficiency = Some(t.decode_tokens_per_s / (n * one.decode_tokens_per_s));
        }
    }

    let threads = o.threads.iter().copied().max().unwrap_or(1).max(1);
    model.set_threads(threads);
    let n = o.tokens.max(2);
    // The cached prefix ends on an even position (units end on a multiple of the largest
    // compress ratio) so its end-of-prompt unit carries a window snapshot.
    let cached = (n.saturating_sub(o.suffix.max(1))) / 2 * 2;
    let full = tokens(o.seed, 30, n, vocab);
    let dir = o.dir.join(format!("bench-runtime-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io("cannot create the bench directory", &dir, e))?;
    let result = ttft_runs(o, &cfg, &model, &full, cached, &dir, &mut progress);
    let _ = kvstack_tiers::store::remove_directory_store(&dir);
    let _ = std::fs::remove_dir(&dir);
    let (scratch, runs, io_engine, scratch_work) = result?;

    let ced = if o.ced_tokens > 0 {
        progress(&format!("CED vs exact prefill of {} tokens", o.ced_tokens));
        Some(ced_vs_exact(
            &model,
            &tokens(o.seed, 40, o.ced_tokens, vocab),
        )?)
    } else {
        None
    };
    let limits = if o.limits {
        progress("decode and prefill against the machine's ceilings (1 thread)");
        let mut l = limits(o, &cfg)?;
        let secs = scratch.ttft.as_secs_f64().max(1e-9);
        l.prefill
            .push(prefill_limit(&l, n, secs, &scratch_work, threads));
        Some(l)
    } else {
        None
    };
    let mut failures: Vec<String> = runs
        .iter()
        .filter(|r| r.ratio_to_scratch > TTFT_TARGET)
        .map(|r| {
            format!(
                "TTFT {}: {:.3} of scratch (target <= {TTFT_TARGET})",
                r.reuse.label(),
                r.ratio_to_scratch
            )
        })
        .collect();
    for t in throughput.iter().filter(|t| t.threads == 2) {
        for (what, e) in [
            ("prefill", t.prefill_efficiency),
            ("decode", t.decode_efficiency),
        ] {
            if let Some(e) = e.filter(|&e| e < EFFICIENCY_TARGET) {
                failures.push(format!(
                    "{what} parallel efficiency at 2 threads: {e:.2} (target >= {EFFICIENCY_TARGET})"
                ));
            }
        }
    }
    if let Some(l) = &limits {
        for d in l.decode.iter().filter(|d| d.ratio < DECODE_LIMIT_TARGET) {
            failures.push(format!(
                "decode at batch {}: {:.2} of its binding limit (target >= {DECODE_LIMIT_TARGET})",
                d.batch, d.ratio
            ));
        }
        for p in l.prefill.iter().filter(|p| p.ratio < PREFILL_PEAK_TARGET) {
            failures.push(format!(
                "prefill of {} tokens: {:.2} of the peaks (target >= {PREFILL_PEAK_TARGET})",
                p.tokens, p.ratio
            ));
        }
    }
    Ok(RuntimeReport {
        model: "built-in kvstack-tiny-v4.1 (40 layers, V4.1-Flash CSA2 plan, head dim 512, index 32 x 128)".into(),
        prefill_mode: format!("{:?}", o.prefill),
        throughput,
        prompt_tokens: n,
        cached_tokens: cached,
        ttft_threads: threads,
        scratch_ttft_s: scratch.ttft.as_secs_f64(),
        cached: runs,
        io_engine,
        ced,
        limits,
        failures,
    })
}

/// Seconds of the fastest of `n` runs of `f`.
fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    (0..n.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
        .max(1e-12)
}

/// Decode of `batch` sequences (128-token prompts) for `o.decode_tokens` steps on one thread:
/// (tokens/s, the work of all the steps).
fn decode_run(model: &Model, o: &RuntimeBenchOptions, batch: usize) -> Result<(f64, Work)> {
    let vocab = model.dims().vocab;
    let mut stores: Vec<_> = (0..batch).map(|_| model.new_store(None)).collect();
    let mut last = Vec::with_capacity(batch);
    for (i, st) in stores.iter_mut().enumerate() {
        let prompt = tokens(o.seed, 50 + i as u64, 128, vocab);
        let l = model.prefill(st, &prompt, PrefillMode::Exact, o.chunk)?;
        last.push(argmax(&l).unwrap_or(0) as u32);
    }
    let steps = o.decode_tokens.max(1);
    let w0 = Work::now();
    let t = Instant::now();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let mut items: Vec<BatchItem<'_>> = stores
            .iter_mut()
            .zip(&toks)
            .map(|(s, t)| BatchItem {
                store: s,
                tokens: t,
                logits: Logits::Last,
                decoder_window_start: 0,
            })
            .collect();
        let outs = model.step_batch(&mut items)?;
        last = outs.iter().map(|l| argmax(l).unwrap_or(0) as u32).collect();
    }
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    Ok(((steps * batch) as f64 / secs, Work::now().since(&w0)))
}

/// Seconds `w` takes at the peaks: its f32 FLOPs at the FMA peak (FLOP/s) and its index
/// multiply-adds at the 8-bit peak (multiply-adds/s; at the FMA peak's multiply-add rate
/// where there is no integer kernel).
fn compute_secs(w: &Work, fma_flop_s: f64, int8_mac_s: f64) -> f64 {
    let int8 = if int8_mac_s > 0.0 {
        int8_mac_s
    } else {
        fma_flop_s / 2.0
    };
    w.f32_flops() / fma_flop_s + w.index_macs as f64 / int8
}

/// A prefill of `tokens` in `secs` that did `w` on `threads` threads, against the peaks of
/// `l` (one thread's, times `threads`).
fn prefill_limit(
    l: &LimitsReport,
    tokens: usize,
    secs: f64,
    w: &Work,
    threads: usize,
) -> PrefillLimit {
    let t = threads.max(1) as f64;
    let n = tokens.max(1) as f64;
    let ideal = compute_secs(w, l.fma_gflop_s * 1e9 * t, l.int8_gmac_s * 1e9 * t);
    PrefillLimit {
        tokens,
        tokens_per_s: tokens as f64 / secs,
        linear_flops_per_token: 2.0 * w.linear_macs as f64 / n,
        attention_flops_per_token: 2.0 * w.attention_macs as f64 / n,
        index_macs_per_token: w.index_macs as f64 / n,
        ratio: ideal / secs,
    }
}

/// The ceilings, then decode at batch 1 and 4 and prefill of `o.prefill_tokens`, one thread.
fn limits(o: &RuntimeBenchOptions, cfg: &ModelConfig) -> Result<LimitsReport> {
    let peaks = Peaks::detected();
    let buf = vec![1u8; 512 << 20];
    let read_bw = buf.len() as f64
        / best_of(3, || {
            std::hint::black_box(peaks.read_sum(std::hint::black_box(&buf)));
        });
    drop(buf);
    let iters = 2_000_000u64;
    let fma_peak = (peaks.fma_flops_per_iter() * iters) as f64
        / best_of(20, || {
            std::hint::black_box(peaks.fma(std::hint::black_box(iters), 0.5));
        });
    let int8_peak = match peaks.int8_kernel() {
        Some(k) => {
            (k.macs_per_iter() * iters) as f64
                / best_of(20, || {
                    std::hint::black_box(peaks.int8(std::hint::black_box(iters), 3));
                })
        }
        None => 0.0,
    };
    let mut model = random_model(cfg, o.seed)?;
    model.set_threads(1);
    let wb = model.weight_bytes();
    let mut decode = Vec::new();
    for batch in [1, 4] {
        let (tps, w) = decode_run(&model, o, batch)?;
        let steps = o.decode_tokens.max(1) as f64;
        let (t_mem, t_fma) = (
            w.bytes() / read_bw / steps,
            compute_secs(&w, fma_peak, int8_peak) / steps,
        );
        let limit = batch as f64 / t_mem.max(t_fma).max(1e-12);
        decode.push(DecodeLimit {
            batch,
            tokens_per_s: tps,
            weight_bytes_per_step: w.weight_bytes as f64 / steps,
            cache_bytes_per_step: (w.attention_bytes + w.index_bytes) as f64 / steps,
            linear_flops_per_step: 2.0 * w.linear_macs as f64 / steps,
            attention_flops_per_step: 2.0 * w.attention_macs as f64 / steps,
            index_macs_per_step: w.index_macs as f64 / steps,
            limit_tokens_per_s: limit,
            bound: if t_mem >= t_fma { "memory" } else { "fma" },
            ratio: tps / limit,
        });
    }
    let mut f32_model = kvstack_model::init::random_model_with(cfg, o.seed, WeightPrecision::F32)?;
    f32_model.set_threads(1);
    let (f32_tps, _) = decode_run(&f32_model, o, 1)?;
    drop(f32_model);
    let prompt = tokens(o.seed, 60, o.prefill_tokens.max(1), model.dims().vocab);
    let mut st = model.new_store(None);
    let w0 = Work::now();
    let t = Instant::now();
    model.prefill(&mut st, &prompt, PrefillMode::Exact, o.chunk)?;
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    let w = Work::now().since(&w0);
    let mut l = LimitsReport {
        read_gb_s: read_bw / 1e9,
        fma_gflop_s: fma_peak / 1e9,
        int8_gmac_s: int8_peak / 1e9,
        weights_resident_bytes: wb.resident,
        weights_f32_bytes: wb.f32,
        decode,
        decode_f32_weights_tokens_per_s: f32_tps,
        prefill: Vec::new(),
    };
    l.prefill.push(prefill_limit(&l, prompt.len(), secs, &w, 1));
    Ok(l)
}

/// The scratch run, the cached runs, the I/O engine, and the scratch run's work.
type TtftResult = (Completion, Vec<TtftRun>, String, Work);

fn ttft_runs(
    o: &RuntimeBenchOptions,
    cfg: &ModelConfig,
    model: &Model,
    full: &[u32],
    cached: usize,
    dir: &std::path::Path,
    progress: &mut impl FnMut(&str),
) -> Result<TtftResult> {
    let n = full.len();
    progress(&format!("{n}-token prompt computed from scratch"));
    let mut e = Engine::new(cfg, model.clone(), None, engine_opts(o, false))?;
    let w0 = Work::now();
    let scratch = one(&mut e, full.to_vec(), 1)?;
    let scratch_work = Work::now().since(&w0);
    drop(e);
    let want = scratch.first_logits.clone().unwrap_or_default();

    progress(&format!(
        "caching its first {cached} tokens (a previous turn)"
    ));
    let tiers = open_tiers(cfg, dir, o.seed)?;
    let io_engine = format!("{:?}", tiers.store().engine().kind);
    let mut e = Engine::new(cfg, model.clone(), Some(tiers), engine_opts(o, false))?;
    one(&mut e, full[..cached].to_vec(), 1)?;
    let mut tiers = e.into_tiers()?;

    let mut runs = Vec::new();
    for kind in [ReuseKind::TiersWithWindow, ReuseKind::TiersReplay] {
        let Some(t) = tiers.take() else { break };
        if kind == ReuseKind::TiersReplay {
            // Drop the window snapshot: a global hit without a window.
            if let Some(key) = t
                .lookup(&full[..n - 1], &kvstack_tiers::Tenant::new("bench"))
                .key()
            {
                t.pool().remove(&key);
            }
        }
        progress(&format!(
            "{n}-token prompt, prefix cached ({})",
            kind.label()
        ));
        let mut e = Engine::new(cfg, model.clone(), Some(t), engine_opts(o, false))?;
        let c = one(&mut e, full.to_vec(), 1)?;
        tiers = e.into_tiers()?;
        let (logit_error, same_top1) = compare(c.first_logits.as_deref().unwrap_or(&[]), &want);
        runs.push(TtftRun {
            reuse: c.reuse.kind,
            ttft_s: c.ttft.as_secs_f64(),
            restore_s: c.reuse.restore_time.as_secs_f64(),
            ratio_to_scratch: c.ttft.as_secs_f64() / scratch.ttft.as_secs_f64().max(1e-9),
            ssd_tokens: c.reuse.ssd_tokens,
            ssd_bytes: c.reuse.ssd_bytes,
            replayed_tokens: c.reuse.replayed_tokens,
            computed_tokens: c.reuse.computed_tokens,
            logit_error,
            same_top1,
        });
    }
    if let Some(t) = tiers {
        t.close()?;
    }
    Ok((scratch, runs, io_engine, scratch_work))
}

fn ced_vs_exact(model: &Model, prompt: &[u32]) -> Result<CedReport> {
    let mut exact = model.new_store(Some(model.window()));
    let mut ced = model.new_store(Some(model.window()));
    let mut le = model.prefill(&mut exact, prompt, PrefillMode::Exact, 256)?;
    let mut lc = model.prefill(&mut ced, prompt, PrefillMode::Ced, 256)?;
    let steps = 9;
    let (mut worst, mut agree) = (0f64, 0usize);
    for i in 0..steps {
        let (err, same) = compare(&lc, &le);
        worst = worst.max(err);
        agree += usize::from(same);
        if i + 1 == steps {
            break;
        }
        let t = argmax(&le).unwrap_or(0) as u32;
        le = model.decode(&mut exact, t)?;
        lc = model.decode(&mut ced, t)?;
    }
    Ok(CedReport {
        prompt_tokens: prompt.len(),
        steps,
        worst_logit_error: worst,
        top1_agreement: agree,
    })
}
