//! The forward pass (spec §3, §9) over a [`KvStore`].
//!
//! One step runs `n` tokens at positions `store.len() ..`: embedding into `hc_mult` identical
//! streams; per block the attention HC site, the collapse with the previous block's `ffn_hc.pre`
//! (stream 0 for the first block), `attn_norm`, CSA2 attention, the expansion; the MoE HC site,
//! the collapse with this block's `attn_hc.pre`, `ffn_norm`, router and experts, the expansion;
//! finally the collapse with the last `ffn_hc.pre`, the norm and the LM head. Then the store
//! commits the step.
//!
//! Prefill modes ([`PrefillMode`]):
//! - **Exact**: every layer over every token (the reference);
//! - **CED** (spec §3): with `T` tokens after the prompt and `w` the sliding window, the
//!   encoder (layers `0 .. L/2`) runs over every prompt token, the decoder (`L/2 .. L`) only
//!   over positions `>= T - w`, its window attention truncated there. Decoder KV sources get
//!   their compressed entries for the skipped positions from the L/2 boundary state (the
//!   encoder's output, collapsed with the last encoder `ffn_hc.pre`, normed with the source's
//!   own `attn_norm`): in the V4.1 plan the only decoder source is layer 20, the first decoder
//!   layer, whose input IS that state, so its entries equal exact mode's. Decoder layers get
//!   placeholder window rows for skipped positions, which the truncation never reads.

use std::ops::Range;

use kvstack_kernels::csa2::norm::rms_norm;
use kvstack_kernels::linear::PackedLinear;
use kvstack_kernels::model::{Expert, HcMix, HcShape, HcSite, MoeShape, Route};

use crate::attention::{
    AttentionDims, ContiguousStore, Csa2Attention, KvStore, LayerTrace, PagedStore, PagedView,
    Projections, StepState,
};
use crate::weights::TensorFile;
use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::{LayerMode, LayerPlan};

use crate::Error;
use crate::checkpoint::{BlockWeights, ExpertWeights, HcWeights, ModelWeights, TensorSource};
use crate::dims::ModelDims;
use crate::storage::WeightPrecision;
use crate::threads;

/// Expert work (FLOP) below which an extra MoE thread does not pay for its spawn.
const MIN_MOE_FLOPS_PER_THREAD: usize = 4_000_000;

/// Members of a batch step with at most this many rows each have their attentions spread
/// over the threads (decode steps); longer ones split their rows inside the attention.
const MAX_SPREAD_ROWS: usize = 4;
/// A [`KvStore`] the model can drive: told each step's token ids before it runs.
pub trait ModelStore: KvStore + Send {
    /// Called with the token ids of a step before any layer runs.
    fn begin_step(&mut self, _tokens: &[u32]) {}
}

impl ModelStore for ContiguousStore {}

impl ModelStore for PagedStore<'_> {
    fn begin_step(&mut self, tokens: &[u32]) {
        PagedStore::begin_step(self, tokens);
    }
}

impl ModelStore for PagedView<'_> {
    fn begin_step(&mut self, tokens: &[u32]) {
        PagedView::begin_step(self, tokens);
    }
}

/// How a prompt is prefilled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    /// Every layer over every token.
    Exact,
    /// Encoder over every token, decoder over the last `sliding_window` (spec §3).
    Ced,
}

/// Which logits a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill chunks before the last).
    None,
    /// The last token's.
    Last,
    /// Every token's, `[n, vocab]`.
    All,
}

/// Most tokens a member of a [`Model::step_batch`] may have for the step to run its members
/// in parallel groups (decode, or a few speculative tokens); larger steps split each phase.
pub(crate) const SEQUENCE_PARALLEL_TOKENS: usize = 4;

/// One sequence's part of a batched step ([`Model::step_batch`]).
pub struct BatchItem<'a> {
    /// Its store.
    pub store: &'a mut dyn ModelStore,
    /// Its tokens in this step (at least one).
    pub tokens: &'a [u32],
    /// Which logits it wants.
    pub logits: Logits,
    /// Window truncation of the decoder layers (CED; 0 for none).
    pub decoder_window_start: u64,
}

impl std::fmt::Debug for BatchItem<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchItem")
            .field("tokens", &self.tokens.len())
            .field("logits", &self.logits)
            .finish_non_exhaustive()
    }
}

/// A batch member inside [`Model::run_batch`].
struct Member<'s, 'a> {
    store: &'s mut (dyn ModelStore + 'a),
    step: StepState,
    tokens: &'s [u32],
    logits: Logits,
    rows: Range<usize>,
    p0: u64,
    decoder_window_start: u64,
}

/// One step of a prefill ([`Model::prefill_plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillStep {
    /// Which of the prefill's tokens it runs.
    pub tokens: Range<usize>,
    /// CED: only the encoder runs ([`Model::step_encoder`]); otherwise every layer
    /// ([`Model::step_batch`], which can batch it with other sequences' steps).
    pub encoder_only: bool,
    /// Window truncation of the decoder layers (CED).
    pub decoder_window_start: u64,
}

/// What a teacher-forced step feeds one block in place of what the blocks before it
/// computed (`verify model --teacher-forced`): the reference's own inputs of that block.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ForcedInput {
    /// `[n, hc_mult, hidden]`: the streams entering the block.
    pub streams: Vec<f32>,
    /// `[n, hc_mult]`: the HC `pre` weights its attention input is collapsed with (the
    /// previous block's `ffn_hc.pre`; one-hot on stream 0 before the first block).
    pub pre: Vec<f32>,
}

/// What one block computed in a step (for `verify model`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockTrace {
    /// `[n, hc_mult, hidden]` entering the block.
    pub streams_in: Vec<f32>,
    /// `[n, hc_mult, hidden]` leaving the block.
    pub streams_out: Vec<f32>,
    /// `[n, hidden]`: `attn_norm` of the collapsed streams.
    pub attn_input: Vec<f32>,
    /// `[n, hidden]`.
    pub attn_output: Vec<f32>,
    /// `[n, hidden]`: `ffn_norm` of the collapsed streams.
    pub ffn_input: Vec<f32>,
    /// `[n, hidden]`.
    pub ffn_output: Vec<f32>,
    /// Attention HC coefficients per token.
    pub attn_hc: Vec<HcMix>,
    /// MoE HC coefficients per token.
    pub ffn_hc: Vec<HcMix>,
    /// Routing per token.
    pub routes: Vec<Route>,
    /// The attention layer's trace (top-k in `topk`).
    pub attention: LayerTrace,
    /// The candidate pool after the layer, if any.
    pub candidates: Option<Vec<Vec<u32>>>,
}

/// What a step computed (for `verify model`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelTrace {
    /// One per block that ran.
    pub blocks: Vec<BlockTrace>,
    /// `[n, hidden]` after the final norm.
    pub final_hidden: Vec<f32>,
}

/// What a model's weights hold in memory ([`Model::weight_bytes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightBytes {
    /// Bytes resident: packed codes, expanded scales, pad columns, f32 vectors.
    pub resident: u64,
    /// Bytes the same weights take as f32 (the verification path).
    pub f32: u64,
    /// Parameters per storage format (`fp8-e4m3`, `fp4-e2m1`, `bf16`, `f32`, and the f32
    /// vectors: embedding, norms, HC).
    pub formats: std::collections::BTreeMap<&'static str, u64>,
}

/// A loaded V4.1 model.
#[derive(Clone, Debug)]
pub struct Model {
    dims: ModelDims,
    attn: Csa2Attention,
    embed: Vec<f32>,
    head: PackedLinear,
    norm: Vec<f32>,
    blocks: Vec<BlockWeights>,
    threads: usize,
}

fn site(w: &HcWeights) -> HcSite<'_> {
    HcSite {
        proj: &w.proj,
        base: &w.base,
        scale: &w.scale,
    }
}

fn expert(w: &ExpertWeights) -> Expert<'_> {
    Expert {
        w1: &w.w1,
        w2: &w.w2,
        w3: &w.w3,
    }
}

/// A finished job: its index and its rows (or the kernel's error).
type JobResult = (usize, Result<Vec<f32>, kvstack_kernels::csa2::Error>);

/// One expert's work in a step: which tokens, with which weights.
struct Job<'a> {
    shape: MoeShape,
    expert: Expert<'a>,
    tokens: Vec<usize>,
    weights: Vec<f32>,
}

impl Job<'_> {
    fn run(&self, x: &[f32], h: usize) -> Result<Vec<f32>, kvstack_kernels::csa2::Error> {
        let mut xs = Vec::with_capacity(self.tokens.len() * h);
        for &t in &self.tokens {
            xs.extend_from_slice(&x[t * h..(t + 1) * h]);
        }
        let mut ys = vec![0f32; self.tokens.len() * h];
        self.shape
            .expert_add(&self.expert, &xs, self.tokens.len(), &self.weights, &mut ys)?;
        Ok(ys)
    }
}

impl Model {
    /// Assembles a model from its parts (the layer plan comes from the config).
    pub fn new(cfg: &ModelConfig, weights: ModelWeights) -> Result<Model, Error> {
        let plan = LayerPlan::from_config(cfg).map_err(Error::AttentionConfig)?;
        let ad = AttentionDims::from_config(cfg, &plan)?;
        let dims = ModelDims::from_config(cfg)?;
        if weights.blocks.len() != dims.layers || plan.layers.len() != dims.layers {
            return Err(Error::ModelInput(format!(
                "{} blocks of weights and {} planned layers for num_hidden_layers {}",
                weights.blocks.len(),
                plan.layers.len(),
                dims.layers
            )));
        }
        let attn = Csa2Attention::new(ad, plan, weights.attention)?;
        Ok(Model {
            dims,
            attn,
            embed: weights.embed,
            head: weights.head,
            norm: weights.norm,
            blocks: weights.blocks,
            threads: 1,
        })
    }

    /// Loads a model: config and a memory-mapped safetensors checkpoint (either naming, any
    /// released storage type; linear weights kept as stored, the rest dequantized to f32).
    pub fn load(cfg: &ModelConfig, file: &TensorFile) -> Result<Model, Error> {
        Model::load_from(cfg, file)
    }

    /// [`Model::load`] from any [`TensorSource`] (a file, or [`super::init::Generator`]),
    /// linear weights as stored.
    pub fn load_from(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Model, Error> {
        Model::load_with(cfg, src, WeightPrecision::Stored)
    }

    /// [`Model::load_from`] with linear weights at `precision` (f32 for verification; the
    /// two give the same bits, see `kvstack_kernels::linear`).
    pub fn load_with(
        cfg: &ModelConfig,
        src: &dyn TensorSource,
        precision: WeightPrecision,
    ) -> Result<Model, Error> {
        let plan = LayerPlan::from_config(cfg).map_err(Error::AttentionConfig)?;
        let ad = AttentionDims::from_config(cfg, &plan)?;
        let md = ModelDims::from_config(cfg)?;
        let w = ModelWeights::load_with(src, &md, &ad, &plan, precision)?;
        Model::new(cfg, w)
    }

    /// The bytes the weights hold in memory and what they would hold as f32.
    pub fn weight_bytes(&self) -> WeightBytes {
        let mut b = WeightBytes::default();
        let mut lin = |w: &PackedLinear| {
            b.resident += w.resident_bytes() as u64;
            b.f32 += (w.n() * w.k() * 4) as u64;
            *b.formats.entry(w.format().name()).or_insert(0) += (w.n() * w.k()) as u64;
        };
        for l in &self.attn.weights().layers {
            for w in [&l.wq_a, &l.wq_b, &l.wkv, &l.wo_b]
                .into_iter()
                .chain(&l.wo_a)
            {
                lin(w);
            }
            if let Some(c) = &l.compressor {
                lin(&c.wkv);
                if let Some(g) = &c.wgate {
                    lin(g);
                }
            }
            if let Some(i) = &l.indexer {
                lin(&i.wq_b);
                lin(&i.weights_proj);
                if let Some(k) = &i.keys {
                    lin(&k.wk);
                }
            }
        }
        for blk in &self.blocks {
            lin(&blk.gate);
            for e in blk.experts.iter().chain(std::iter::once(&blk.shared)) {
                lin(&e.w1);
                lin(&e.w2);
                lin(&e.w3);
            }
        }
        lin(&self.head);
        let mut vecs = self.embed.len() + self.norm.len();
        for l in &self.attn.weights().layers {
            vecs += l.q_norm.len() + l.kv_norm.len() + l.sinks.len();
            vecs += l.compressor.as_ref().map_or(0, |c| c.norm.len());
            vecs += l
                .indexer
                .as_ref()
                .and_then(|i| i.keys.as_ref())
                .map_or(0, |k| k.k_norm.len());
        }
        for blk in &self.blocks {
            vecs += blk.attn_norm.len() + blk.ffn_norm.len() + blk.gate_bias.len();
            for hc in [&blk.attn_hc, &blk.ffn_hc] {
                lin(&hc.proj);
                vecs += hc.base.len() + hc.scale.len();
            }
        }
        b.resident += vecs as u64 * 4;
        b.f32 += vecs as u64 * 4;
        *b.formats.entry("f32 (embedding, norms, HC)").or_insert(0) += vecs as u64;
        b
    }

    /// [`Model::load`] from paths; `weights` is one safetensors file or a sharded checkpoint
    /// (its directory or its `model.safetensors.index.json`, see [`crate::Checkpoint`]).
    pub fn from_files(config: &std::path::Path, weights: &std::path::Path) -> Result<Model, Error> {
        let cfg = ModelConfig::from_file(config).map_err(Error::ModelConfig)?;
        let ck = crate::Checkpoint::open(weights)?;
        Model::load_from(&cfg, ck.source())
    }

    /// Threads for the routed experts and for the attention of prefill steps (at least 1);
    /// results do not depend on it.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
        self.attn.set_threads(self.threads);
    }

    /// The dimensions.
    pub fn dims(&self) -> &ModelDims {
        &self.dims
    }

    /// The attention of every layer (dimensions, plan, codecs).
    pub fn attention(&self) -> &Csa2Attention {
        &self.attn
    }

    /// The sliding window (`n_win` of CED and of the bounded replay).
    pub fn window(&self) -> usize {
        self.attn.dims().window
    }

    /// The encoder/decoder boundary `L / 2` (spec §3).
    pub fn boundary(&self) -> usize {
        self.dims.layers / 2
    }

    /// An empty in-memory store keeping `keep_window` window rows per layer (all with `None`).
    pub fn new_store(&self, keep_window: Option<usize>) -> ContiguousStore {
        self.attn.new_store(keep_window)
    }

    fn hc(&self) -> HcShape {
        self.dims.hc()
    }

    fn block_weights(&self, l: usize) -> Result<&BlockWeights, Error> {
        self.blocks
            .get(l)
            .ok_or_else(|| Error::ModelInput(format!("layer {l} of {}", self.dims.layers)))
    }

    /// RMSNorm of every row of `x`, rows split over the threads when they pay.
    fn norm_rows(&self, x: &[f32], w: &[f32], what: &str) -> Result<Vec<f32>, Error> {
        let h = self.dims.hidden;
        let mut out = vec![0f32; x.len()];
        let n = x.len() / h.max(1);
        let parts = threads::parts(n, self.threads, 4 * x.len());
        threads::rows_mut(&mut out, h, parts, what, |r, part| {
            rms_norm(&x[r.start * h..r.end * h], w, self.dims.eps, part)
                .map_err(Error::model_kernel(what))
        })?;
        Ok(out)
    }

    /// Width of one token's streams (`hc_mult * hidden`).
    fn stream_width(&self) -> usize {
        self.dims.hc_mult * self.dims.hidden
    }

    /// The HC mixes of site `w` for `n` tokens, rows split over the threads when they pay.
    fn mixes(
        &self,
        what: &str,
        w: &HcWeights,
        streams: &[f32],
        n: usize,
    ) -> Result<Vec<HcMix>, Error> {
        let (hc, sw) = (self.hc(), self.stream_width());
        let coeffs = (self.dims.hc_mult + 2) * self.dims.hc_mult;
        let parts = threads::parts(n, self.threads, n * sw * coeffs);
        let s = site(w);
        threads::rows_collect(n, parts, what, |r| {
            let rows = streams
                .get(r.start * sw..r.end * sw)
                .ok_or_else(|| Error::ModelInput(format!("{what}: streams of {n} tokens")))?;
            hc.mixes(&s, rows, r.len())
                .map_err(Error::model_kernel(what))
        })
    }

    /// `x` = the streams collapsed with each token's `pre` weights, rows split when they pay.
    fn collapse(
        &self,
        what: &str,
        pre: &[HcMix],
        streams: &[f32],
        x: &mut [f32],
    ) -> Result<(), Error> {
        let (hc, h, sw) = (self.hc(), self.dims.hidden, self.stream_width());
        let n = x.len() / h.max(1);
        let parts = threads::parts(n, self.threads, 2 * n * sw);
        threads::rows_mut(x, h, parts, what, |r, part| {
            let (Some(pre), Some(rows)) =
                (pre.get(r.clone()), streams.get(r.start * sw..r.end * sw))
            else {
                return Err(Error::ModelInput(format!(
                    "{what}: mixes or streams of {n} tokens"
                )));
            };
            hc.collapse(pre, rows, part)
                .map_err(Error::model_kernel(what))
        })
    }

    /// Adds `y` expanded with each token's mix into the streams, rows split when they pay.
    fn expand(
        &self,
        what: &str,
        mix: &[HcMix],
        y: &[f32],
        streams: &mut [f32],
    ) -> Result<(), Error> {
        let (hc, h, sw) = (self.hc(), self.dims.hidden, self.stream_width());
        let n = streams.len() / sw.max(1);
        let parts = threads::parts(n, self.threads, 4 * n * sw);
        threads::rows_mut(streams, sw, parts, what, |r, part| {
            let (Some(mix), Some(y)) = (mix.get(r.clone()), y.get(r.start * h..r.end * h)) else {
                return Err(Error::ModelInput(format!(
                    "{what}: mixes or outputs of {n} tokens"
                )));
            };
            hc.expand(mix, y, part).map_err(Error::model_kernel(what))
        })
    }

    /// The router's choice for every row of `x`, rows split when they pay.
    fn route(&self, b: &BlockWeights, x: &[f32], n: usize) -> Result<Vec<Route>, Error> {
        let h = self.dims.hidden;
        let moe = self.dims.moe();
        let parts = threads::parts(n, self.threads, n * h * self.dims.experts);
        threads::rows_collect(n, parts, "router", |r| {
            moe.route(&x[r.start * h..r.end * h], &b.gate, &b.gate_bias, r.len())
                .map_err(Error::model_kernel("router"))
        })
    }

    /// The MoE over `n` rows of `x`: the shared expert and every routed expert once over its
    /// tokens, spread over [`Model::set_threads`] threads; results are added in a fixed order
    /// (shared, then experts ascending), so the output does not depend on the thread count.
    fn moe(
        &self,
        b: &BlockWeights,
        x: &[f32],
        n: usize,
        routes: &[Route],
    ) -> Result<Vec<f32>, Error> {
        let h = self.dims.hidden;
        let mut jobs = vec![Job {
            shape: self.dims.shared_moe(),
            expert: expert(&b.shared),
            tokens: (0..n).collect(),
            weights: vec![1.0; n],
        }];
        let mut per: Vec<(Vec<usize>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.dims.experts];
        for (t, r) in routes.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                if let Some(p) = per.get_mut(e) {
                    p.0.push(t);
                    p.1.push(w);
                }
            }
        }
        for (e, (tokens, weights)) in per.into_iter().enumerate() {
            if !tokens.is_empty()
                && let Some(w) = b.experts.get(e)
            {
                jobs.push(Job {
                    shape: self.dims.moe(),
                    expert: expert(w),
                    tokens,
                    weights,
                });
            }
        }
        // A thread pays for its spawn (75-400 us on a busy 2-core VM) only with a few MFLOP
        // of expert work: a decode step of a small model has far less and runs on one.
        let flops = jobs.iter().map(|j| j.tokens.len()).sum::<usize>() * 6 * h * self.dims.inter;
        let threads = self
            .threads
            .min(jobs.len())
            .min(flops / kvstack_kernels::par::min_split_work(MIN_MOE_FLOPS_PER_THREAD))
            .max(1);
        let mut results: Vec<Option<Vec<f32>>> = vec![None; jobs.len()];
        if threads == 1 {
            for (j, r) in jobs.iter().zip(results.iter_mut()) {
                *r = Some(j.run(x, h).map_err(Error::model_kernel("moe expert"))?);
            }
        } else {
            // Greedy balance by token count.
            let mut bins: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); threads];
            let mut order: Vec<usize> = (0..jobs.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].tokens.len()));
            for i in order {
                if let Some(bin) = bins.iter_mut().min_by_key(|b| b.0) {
                    bin.0 += jobs[i].tokens.len();
                    bin.1.push(i);
                }
            }
            let jobs = &jobs;
            let done: Vec<Option<Vec<JobResult>>> =
                crate::threads::on_threads(&mut bins, 1, |_, bin| {
                    bin.iter()
                        .flat_map(|(_, idx)| idx.iter())
                        .map(|&i| (i, jobs[i].run(x, h)))
                        .collect::<Vec<_>>()
                });
            for (i, r) in done.into_iter().flatten().flatten() {
                results[i] = Some(r.map_err(Error::model_kernel("moe expert"))?);
            }
        }
        let mut out = vec![0f32; n * h];
        for (j, r) in jobs.iter().zip(results) {
            let ys = r.ok_or_else(|| Error::ModelInput("an MoE worker thread panicked".into()))?;
            for (&t, y) in j.tokens.iter().zip(ys.chunks_exact(h)) {
                out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(y)
                    .for_each(|(o, &v)| *o += v);
            }
        }
        Ok(out)
    }

    /// One block over the step of every member of a batch (rows of all members
    /// concatenated in `streams`; attention per member, everything else over all rows).
    fn block(
        &self,
        l: usize,
        members: &mut [Member<'_, '_>],
        streams: &mut [f32],
        prev_pre: &mut Vec<HcMix>,
        trace: Option<&mut BlockTrace>,
    ) -> Result<(), Error> {
        let b = self.block_weights(l)?;
        let h = self.dims.hidden;
        let n: usize = members.iter().map(|m| m.rows.len()).sum();
        let boundary = self.boundary();
        let streams_in = trace.is_some().then(|| streams.to_vec());
        let attn_mix = self.mixes(&format!("layer {l}: attn_hc"), &b.attn_hc, streams, n)?;
        let mut x = vec![0f32; n * h];
        self.collapse(&format!("layer {l}: collapse"), prev_pre, streams, &mut x)?;
        let attn_input = self.norm_rows(&x, &b.attn_norm, "attn_norm")?;
        let mut lt = LayerTrace::default();
        let single = members.len() == 1;
        // The attention's projections over every member's rows at once (each weight read
        // once per step, not once per member; rows do not interact, so each member's rows
        // are those of its step alone), the selection and sparse attention per member over
        // its own store, the output projection over all rows again.
        let positions: Vec<u64> = members
            .iter()
            .flat_map(|m| m.p0..m.p0 + m.rows.len() as u64)
            .collect();
        let counts: Vec<usize> = members.iter().map(|m| m.rows.len()).collect();
        let projections = self
            .attn
            .project(l, &attn_input, &positions)?
            .split(l, &counts)?;
        let attend = |m: &mut Member<'_, '_>,
                      p: Projections,
                      lt: Option<&mut LayerTrace>|
         -> Result<Vec<f32>, Error> {
            let ws = if l >= boundary {
                m.decoder_window_start
            } else {
                0
            };
            self.attn
                .attend_projected(l, &mut *m.store, &mut m.step, p, lt, ws)
        };
        let mut attended = if single {
            Vec::new()
        } else {
            Vec::with_capacity(n * self.attn.dims().q_width())
        };
        // Decode steps of several members: their attentions are independent, and one decode
        // query is too little work to split, so the members are spread over the threads
        // instead (prefill rows are split inside the attention).
        let spread = self.threads.min(members.len());
        if spread > 1 && members.iter().all(|m| m.rows.len() <= MAX_SPREAD_ROWS) {
            let per = members.len().div_ceil(spread);
            let attend = &attend;
            let mut work: Vec<(&mut Member<'_, '_>, Projections)> =
                members.iter_mut().zip(projections).collect();
            let parts = crate::threads::on_threads(&mut work, per, |_, part| {
                let mut a = Vec::new();
                for (m, p) in part.iter_mut() {
                    a.extend_from_slice(&attend(m, std::mem::take(p), None)?);
                }
                Ok::<_, Error>(a)
            });
            for part in parts {
                let part = part.unwrap_or_else(|| {
                    Err(Error::ModelInput(
                        "an attention worker thread panicked".into(),
                    ))
                })?;
                attended.extend_from_slice(&part);
            }
        } else {
            for (m, p) in members.iter_mut().zip(projections) {
                let a = attend(m, p, (single && trace.is_some()).then_some(&mut lt))?;
                // (One member, the prefill case: its rows are the whole step, not copied.)
                if single {
                    attended = a;
                } else {
                    attended.extend_from_slice(&a);
                }
            }
        }
        let y = self.attn.output(l, attended, &positions)?;
        if single && trace.is_some() {
            lt.output = y.clone();
        }
        self.expand(&format!("layer {l}: expand"), &attn_mix, &y, streams)?;
        let ffn_mix = self.mixes(&format!("layer {l}: ffn_hc"), &b.ffn_hc, streams, n)?;
        self.collapse(&format!("layer {l}: collapse"), &attn_mix, streams, &mut x)?;
        let ffn_input = self.norm_rows(&x, &b.ffn_norm, "ffn_norm")?;
        let routes = self.route(b, &ffn_input, n)?;
        let out = self.moe(b, &ffn_input, n, &routes)?;
        self.expand(&format!("layer {l}: expand"), &ffn_mix, &out, streams)?;
        if let Some(tr) = trace {
            *tr = BlockTrace {
                streams_in: streams_in.unwrap_or_default(),
                streams_out: streams.to_vec(),
                attn_input,
                attn_output: y,
                ffn_input,
                ffn_output: out,
                attn_hc: attn_mix,
                ffn_hc: ffn_mix.clone(),
                routes,
                attention: lt,
                candidates: members
                    .first()
                    .and_then(|m| m.step.candidates().map(|c| c.rows.clone())),
            };
        }
        *prev_pre = ffn_mix;
        Ok(())
    }

    /// Runs one step over `tokens` through the layers `layers` (all, or the encoder only), then
    /// commits it. `decoder_window_start` truncates the window of decoder layers.
    fn run(
        &self,
        store: &mut dyn ModelStore,
        tokens: &[u32],
        logits: Logits,
        trace: Option<&mut ModelTrace>,
        layers: Range<usize>,
        decoder_window_start: u64,
    ) -> Result<Vec<f32>, Error> {
        let mut items = [BatchItem {
            store,
            tokens,
            logits,
            decoder_window_start,
        }];
        let mut out = self.run_batch(&mut items, trace, layers, None)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One step of several sequences together (continuous batching): every member's tokens
    /// run through `layers` as one set of rows (HC, norms, router and experts over all rows
    /// at once; attention per member over its own store), then each member commits. Rows do
    /// not interact, so each member's results are those of running it alone.
    /// With `forced`, block `l` starts from `forced[l]` instead of what block `l - 1` left.
    /// Refuses a step with an empty member or a token outside the vocabulary, before any
    /// store is touched.
    fn check_items(&self, items: &[BatchItem<'_>]) -> Result<(), Error> {
        let v = self.dims.vocab;
        for (k, it) in items.iter().enumerate() {
            if it.tokens.is_empty() {
                return Err(Error::ModelInput(format!(
                    "batch member {k}: a step needs at least one token"
                )));
            }
            if let Some((i, &tok)) = it
                .tokens
                .iter()
                .enumerate()
                .find(|(_, t)| **t as usize >= v)
            {
                return Err(Error::ModelInput(format!(
                    "token id {tok} at step position {i} is outside the vocabulary of {v}"
                )));
            }
        }
        Ok(())
    }

    /// [`Model::run_batch_on`] with the model's threads as a team
    /// (`kvstack_kernels::par::with_team`): a step's splits hand their parts to threads kept
    /// spinning for the step instead of waking pool threads at each. Inside a task of a split
    /// (a sequence group of [`Model::step_batch`]) the step runs on its own thread.
    fn run_batch(
        &self,
        items: &mut [BatchItem<'_>],
        trace: Option<&mut ModelTrace>,
        layers: Range<usize>,
        forced: Option<&[ForcedInput]>,
    ) -> Result<Vec<Vec<f32>>, Error> {
        let helpers = if kvstack_kernels::par::in_task() {
            0
        } else {
            self.threads - 1
        };
        kvstack_kernels::par::with_team(helpers, || self.run_batch_on(items, trace, layers, forced))
    }

    /// One step of every member of `items` over `layers` on the calling thread's team (or
    /// alone); `trace` and `forced` as in [`Model::step_teacher_forced`].
    fn run_batch_on(
        &self,
        items: &mut [BatchItem<'_>],
        mut trace: Option<&mut ModelTrace>,
        layers: Range<usize>,
        forced: Option<&[ForcedInput]>,
    ) -> Result<Vec<Vec<f32>>, Error> {
        let (h, ns, v) = (self.dims.hidden, self.dims.hc_mult, self.dims.vocab);
        let mut members = Vec::with_capacity(items.len());
        let mut n = 0usize;
        self.check_items(items)?;
        for it in items.iter_mut() {
            it.store.begin_step(it.tokens);
            let m = it.tokens.len();
            members.push(Member {
                tokens: it.tokens,
                logits: it.logits,
                p0: it.store.step_start(),
                store: &mut *it.store,
                step: StepState::new(m),
                rows: n..n + m,
                decoder_window_start: it.decoder_window_start,
            });
            n += m;
        }
        if members.is_empty() {
            return Ok(Vec::new());
        }
        let mut streams = vec![0f32; n * ns * h];
        for (i, &tok) in members.iter().flat_map(|m| m.tokens.iter()).enumerate() {
            let t = tok as usize;
            let row = &self.embed[t * h..(t + 1) * h];
            for s in 0..ns {
                streams[(i * ns + s) * h..(i * ns + s + 1) * h].copy_from_slice(row);
            }
        }
        let mut one_hot = vec![0f32; ns];
        one_hot[0] = 1.0;
        let mut prev_pre: Vec<HcMix> = (0..n)
            .map(|_| HcMix {
                pre: one_hot.clone(),
                ..HcMix::default()
            })
            .collect();
        if members.len() > 1 {
            trace = None;
        }
        if let Some(t) = trace.as_deref_mut() {
            t.blocks.clear();
        }
        for l in layers.clone() {
            if let Some(forced) = forced {
                force(l, forced.get(l), &mut streams, &mut prev_pre, ns)?;
            }
            let bt = match trace.as_deref_mut() {
                Some(t) => {
                    t.blocks.push(BlockTrace::default());
                    t.blocks.last_mut()
                }
                None => None,
            };
            self.block(l, &mut members, &mut streams, &mut prev_pre, bt)?;
        }
        let mut x = vec![0f32; n * h];
        self.collapse("final collapse", &prev_pre, &streams, &mut x)?;
        if layers.end < self.dims.layers {
            // CED encoder-only step: decoder KV sources from the boundary state, placeholder
            // window rows for the decoder layers (never read: their window is truncated).
            let wb = self.attn.window_codec().bytes();
            for m in &mut members {
                let xm = &x[m.rows.start * h..m.rows.end * h];
                let placeholder = vec![0u8; m.rows.len() * wb];
                for l in layers.end..self.dims.layers {
                    let spec = self.attn.plan().layers.get(l).copied();
                    if let Some(spec) = spec
                        && spec.mode == LayerMode::Full
                    {
                        let b = self.block_weights(l)?;
                        let xin = self.norm_rows(xm, &b.attn_norm, "attn_norm")?;
                        self.attn.compress_step(l, &mut *m.store, &xin)?;
                    }
                    m.store.push_window(l, m.p0, &placeholder)?;
                }
                m.store.commit(m.rows.len() as u64)?;
            }
            return Ok(vec![Vec::new(); members.len()]);
        }
        for m in &mut members {
            m.store.commit(m.rows.len() as u64)?;
        }
        let hidden = self.norm_rows(&x, &self.norm, "final norm")?;
        let mut outs = Vec::with_capacity(members.len());
        for m in &members {
            let rows = match m.logits {
                Logits::None => 0..0,
                Logits::Last => m.rows.end - 1..m.rows.end,
                Logits::All => m.rows.clone(),
            };
            let mut out = vec![0f32; rows.len() * v];
            if !rows.is_empty() {
                self.head
                    .forward_threads(
                        &hidden[rows.start * h..rows.end * h],
                        rows.len(),
                        &mut out,
                        self.threads,
                    )
                    .map_err(Error::model_kernel("lm head"))?;
            }
            outs.push(out);
        }
        if let Some(t) = trace {
            t.final_hidden = hidden;
        }
        Ok(outs)
    }

    /// One exact step of several sequences together (continuous batching: a decoded token of
    /// each, or prefill chunks beside them); returns each member's requested logits. Each
    /// member's results equal those of [`Model::step`] on it alone.
    ///
    /// With several threads and a decode-sized step (every member at most
    /// `SEQUENCE_PARALLEL_TOKENS` tokens), the members are split into at most one group per
    /// thread, each group stepped on its own thread with a team of the threads left over
    /// (none with as many members as threads): a decode step's phases are short and many,
    /// so even handed to a team their splits wait more than whole sequences on their own
    /// threads do, and a member's results do not depend on the members beside it, so the
    /// bits are the same. Each group reads the weights itself, which the step's compute
    /// outweighs while it is not bound by the weight stream. Other steps run on one team of
    /// all the threads.
    pub fn step_batch(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>, Error> {
        let groups = self.threads.min(items.len());
        let decode = items
            .iter()
            .all(|it| it.tokens.len() <= SEQUENCE_PARALLEL_TOKENS);
        if groups < 2 || !decode || kvstack_kernels::par::in_task() {
            return self.run_batch(items, None, 0..self.dims.layers, None);
        }
        // Bad input fails the whole step before any group touches its stores.
        self.check_items(items)?;
        let per = items.len().div_ceil(groups);
        let groups = items.len().div_ceil(per);
        // The threads left over after one for each group (more threads than members).
        let helpers = self.threads / groups - 1;
        let mut results: Vec<Result<Vec<Vec<f32>>, Error>> = Vec::new();
        results.resize_with(groups, || Ok(Vec::new()));
        let layers = 0..self.dims.layers;
        kvstack_kernels::par::run_tasks(items.chunks_mut(per).zip(results.iter_mut()).map(
            |(group, slot)| {
                let layers = layers.clone();
                move || {
                    *slot = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        kvstack_kernels::par::with_team(helpers, || {
                            self.run_batch_on(group, None, layers, None)
                        })
                    }))
                    .unwrap_or_else(|_| Err(Error::Panicked("a sequence group of the step".into())))
                }
            },
        ));
        let mut outs = Vec::with_capacity(items.len());
        for r in results {
            outs.extend(r?);
        }
        Ok(outs)
    }

    /// One exact step (every layer over every token of `tokens`), committed to `store`;
    /// returns the requested logits (`[rows, vocab]`).
    pub fn step(
        &self,
        store: &mut dyn ModelStore,
        tokens: &[u32],
        logits: Logits,
        trace: Option<&mut ModelTrace>,
    ) -> Result<Vec<f32>, Error> {
        self.run(store, tokens, logits, trace, 0..self.dims.layers, 0)
    }

    /// One exact step over `tokens` in which every block starts from the reference's own
    /// inputs (`forced[l]` for block `l`) instead of what the blocks before it computed, so
    /// each block is checked on its own: the CSA2 state a block reads still comes from this
    /// step's earlier layers, computed from their forced inputs. Returns every token's logits;
    /// `trace` gets every block.
    ///
    /// # Errors
    /// [`Error::ModelInput`] when `forced` does not hold one input of the step's shape per
    /// layer; the step's own errors.
    pub fn step_teacher_forced(
        &self,
        store: &mut dyn ModelStore,
        tokens: &[u32],
        forced: &[ForcedInput],
        trace: &mut ModelTrace,
    ) -> Result<Vec<f32>, Error> {
        if forced.len() != self.dims.layers {
            return Err(Error::ModelInput(format!(
                "teacher forcing needs inputs for {} blocks, got {}",
                self.dims.layers,
                forced.len()
            )));
        }
        let mut items = [BatchItem {
            store,
            tokens,
            logits: Logits::All,
            decoder_window_start: 0,
        }];
        let mut out = self.run_batch(&mut items, Some(trace), 0..self.dims.layers, Some(forced))?;
        Ok(out.pop().unwrap_or_default())
    }

    /// The LM head over `hidden` (`[rows, hidden]`, after the final norm): `[rows, vocab]`
    /// logits.
    ///
    /// # Errors
    /// [`Error::ModelInput`] when `hidden` is not whole rows.
    pub fn lm_head(&self, hidden: &[f32]) -> Result<Vec<f32>, Error> {
        let (h, v) = (self.dims.hidden, self.dims.vocab);
        if h == 0 || !hidden.len().is_multiple_of(h) {
            return Err(Error::ModelInput(format!(
                "lm head input of {} values is not whole rows of {h}",
                hidden.len()
            )));
        }
        let rows = hidden.len() / h;
        let mut out = vec![0f32; rows * v];
        self.head
            .forward_threads(hidden, rows, &mut out, self.threads)
            .map_err(Error::model_kernel("lm head"))?;
        Ok(out)
    }

    /// Decodes one token; returns its logits.
    pub fn decode(&self, store: &mut dyn ModelStore, token: u32) -> Result<Vec<f32>, Error> {
        self.step(store, &[token], Logits::Last, None)
    }

    /// Prefills `tokens` after what `store` holds, in chunks of at most `chunk` tokens, in
    /// `mode`; returns the last token's logits.
    pub fn prefill(
        &self,
        store: &mut dyn ModelStore,
        tokens: &[u32],
        mode: PrefillMode,
        chunk: usize,
    ) -> Result<Vec<f32>, Error> {
        self.prefill_steps(store, tokens, 0, mode, chunk)
    }

    /// Bounded replay (spec §7) then prefill: `store` holds a restored prefix whose global KV
    /// is complete but whose window is missing; `replay` are its last tokens (at most the
    /// window; positions `store.len() - replay.len() ..`, a multiple of every compress ratio).
    /// They run again with the new `tokens`, regenerating window KV only (cached global
    /// entries are never rewritten), every window truncated at the replay start. Returns the
    /// last token's logits (with no new tokens, the next-token logits of the prefix).
    pub fn prefill_replay(
        &self,
        store: &mut dyn ModelStore,
        replay: &[u32],
        tokens: &[u32],
        mode: PrefillMode,
        chunk: usize,
    ) -> Result<Vec<f32>, Error> {
        if replay.is_empty() {
            return self.prefill(store, tokens, mode, chunk);
        }
        let len = store.len();
        let from = len.checked_sub(replay.len() as u64).ok_or_else(|| {
            Error::ModelInput(format!(
                "a replay of {} tokens is longer than the {len} the store holds",
                replay.len()
            ))
        })?;
        store.begin_replay(from)?;
        let mut all = Vec::with_capacity(replay.len() + tokens.len());
        all.extend_from_slice(replay);
        all.extend_from_slice(tokens);
        self.prefill_steps(store, &all, replay.len(), mode, chunk)
    }

    /// How a prefill of `tokens` tokens from position `start` runs, step by step, in `mode`
    /// with chunks of at most `chunk` tokens; the first `replayed` tokens are a bounded replay
    /// and all run in the first step (spec §7). CED (spec §3) gives encoder-only steps for all
    /// but the last `sliding_window` tokens, unless a replay is longer than that part.
    pub fn prefill_plan(
        &self,
        start: u64,
        tokens: usize,
        replayed: usize,
        mode: PrefillMode,
        chunk: usize,
    ) -> Vec<PrefillStep> {
        let chunk = chunk.max(1);
        let total = start + tokens as u64;
        let (mut split, ws) = match mode {
            PrefillMode::Exact => (0, 0),
            PrefillMode::Ced => {
                let from = total.saturating_sub(self.window() as u64);
                ((from.saturating_sub(start)) as usize, from)
            }
        };
        if split < replayed {
            // The replay must commit in one step; a short suffix runs every layer instead.
            split = 0;
        }
        let split = split.min(tokens);
        let mut steps = Vec::new();
        let mut at = 0usize;
        for (encoder_only, hi) in [(true, split), (false, tokens)] {
            while at < hi {
                let bonus = if at == 0 { replayed } else { 0 };
                let end = (at + chunk + bonus).min(hi);
                steps.push(PrefillStep {
                    tokens: at..end,
                    encoder_only,
                    decoder_window_start: ws,
                });
                at = end;
            }
        }
        steps
    }

    /// One CED encoder-only prefill step ([`PrefillStep::encoder_only`]): the encoder layers
    /// over `tokens`, the decoder's KV sources from the boundary state; committed to `store`.
    pub fn step_encoder(
        &self,
        store: &mut dyn ModelStore,
        tokens: &[u32],
        decoder_window_start: u64,
    ) -> Result<(), Error> {
        self.run(
            store,
            tokens,
            Logits::None,
            None,
            0..self.boundary(),
            decoder_window_start,
        )?;
        Ok(())
    }

    /// Prefill of `tokens` from `store.step_start()`; the first `replayed` of them are a
    /// replay, which must all run in the first step.
    fn prefill_steps(
        &self,
        store: &mut dyn ModelStore,
        tokens: &[u32],
        replayed: usize,
        mode: PrefillMode,
        chunk: usize,
    ) -> Result<Vec<f32>, Error> {
        if tokens.is_empty() {
            return Err(Error::ModelInput(
                "a prefill needs at least one token".into(),
            ));
        }
        let plan = self.prefill_plan(store.step_start(), tokens.len(), replayed, mode, chunk);
        let mut last = Vec::new();
        let k = plan.len();
        for (i, st) in plan.into_iter().enumerate() {
            let c = &tokens[st.tokens];
            if st.encoder_only {
                self.step_encoder(store, c, st.decoder_window_start)?;
            } else {
                let want = if i + 1 == k {
                    Logits::Last
                } else {
                    Logits::None
                };
                last = self.run(
                    store,
                    c,
                    want,
                    None,
                    0..self.dims.layers,
                    st.decoder_window_start,
                )?;
            }
        }
        Ok(last)
    }
}

/// Replaces the streams and the collapse weights entering block `l` with its forced input.
fn force(
    l: usize,
    input: Option<&ForcedInput>,
    streams: &mut [f32],
    prev_pre: &mut [HcMix],
    ns: usize,
) -> Result<(), Error> {
    let input = input.ok_or_else(|| Error::ModelInput(format!("no forced input for block {l}")))?;
    if input.streams.len() != streams.len() || input.pre.len() != prev_pre.len() * ns {
        return Err(Error::ModelInput(format!(
            "block {l}: forced streams of {} values and pre of {} for a step of {} and {}",
            input.streams.len(),
            input.pre.len(),
            streams.len(),
            prev_pre.len() * ns
        )));
    }
    streams.copy_from_slice(&input.streams);
    for (mix, pre) in prev_pre.iter_mut().zip(input.pre.chunks_exact(ns)) {
        mix.pre = pre.to_vec();
    }
    Ok(())
}
