//! The CSA2 attention layer (spec §4) for every mode, in prefill (many tokens) and decode
//! (one token) shapes: both are [`Csa2Attention::forward`] over a step of `n` tokens.
//!
//! Per layer and step (positions `p0 .. p0 + n`, `p0 = store.len()`):
//! 1. query: `q_latent = q_norm(x wq_aᵀ)`, `q = RoPE(q_latent wq_bᵀ)` per head (never
//!    quantized);
//! 2. window KV: `FP8(RoPE(kv_norm(x wkvᵀ)))`, the layer's own;
//! 3. Full (KV source): the compressor over the pending and new tokens (completed groups
//!    only), `latent = norm(pooled)`, entries `FP4(RoPE_{j·r}(latent))`, index keys
//!    `MXFP4(RoPE_{j·r}(k_norm(latent wkᵀ)))` from the unrotated, unquantized latent; pushed
//!    to the store before any layer attends them;
//! 4. index sources (Full, Reindex): index queries `MXFP4(RoPE(q_latent wq_bᵢᵀ))`, head
//!    weights, scores over the visible entries of the KV source (`j < (t + 1) / r`), the
//!    candidate pool (candidate source) or the candidate mask (Reindex with
//!    `uses_candidates`), top-k; Reuse layers take the step's top-k;
//! 5. sparse attention over the window `[t - window + 1, t]` and the top-k entries, sink,
//!    `P · V` with `V = K`; inverse RoPE on the last rope dims; grouped `wo_a`, then `wo_b`.
//!
//! Every stage is also a public method taking that stage's inputs, which is how
//! `verify attention` feeds each stage the reference's own inputs.
//!
//! [`Csa2Attention::forward_from`] is three parts, which a batch of sequences runs apart:
//! [`Csa2Attention::project`] (the per-row projections of steps 1, 2, 3's compressor inputs
//! and 4's queries and head weights), [`Csa2Attention::attend_projected`] (per sequence: the
//! compressor, selection and sparse attention over its store) and [`Csa2Attention::output`].
//! `Model::step_batch` runs the first and the last over every member's rows at once, so each
//! weight is read once per step.

use kvstack_firmware_interface::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use kvstack_kernels::aligned::AlignedF32;
use kvstack_kernels::attn as fast;
use kvstack_kernels::csa2::attention::{AttentionShape, KeyRow, SparseAttention};
use kvstack_kernels::csa2::candidates::{candidate_pool, mask_to_candidates};
use kvstack_kernels::csa2::compress::CompressorState;
use kvstack_kernels::csa2::indexer::{IndexQuery, scale_head_weights};
use kvstack_kernels::csa2::norm::rms_norm_in_place;
use kvstack_kernels::csa2::output::OutputShape;
use kvstack_kernels::csa2::quant::RowCodec;
use kvstack_kernels::csa2::rope::Rope;
use kvstack_kernels::csa2::topk::topk;
use kvstack_kernels::linear::PackedLinear;
use zerocopy::FromBytes;

use crate::weights::TensorFile;
use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::{LayerMode, LayerPlan, LayerSpec};

use super::dims::AttentionDims;
use super::params::{AttentionWeights, LayerWeights};
use super::step::{Candidates, StepState, TopK};
use super::store::{ContiguousStore, KvStore};
use crate::Error;

/// What the compressor of a KV source produced in one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Compressed {
    /// Compressed position of the first new entry.
    pub first: u64,
    /// `[g, head_dim]`: pooled and RMS-normalized, before RoPE (`compressor.latent`).
    pub latent: Vec<f32>,
    /// `[g, head_dim]`: after RoPE, before FP4 (`compressed_kv.pre_quant`).
    pub pre_quant: Vec<f32>,
    /// `g` FP4 rows.
    pub rows: Vec<u8>,
    /// `[g, index_head_dim]`: index keys before MXFP4 (`index_keys.pre_quant`).
    pub key_pre_quant: Vec<f32>,
    /// `g` MXFP4 key rows.
    pub key_rows: Vec<u8>,
    /// The compressor's pending projections after the step.
    pub pending: Vec<f32>,
}

/// Everything one layer computed in one step (for verification and debugging).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerTrace {
    /// Token positions of the step.
    pub positions: Vec<u64>,
    /// `[n, q_lora_rank]`.
    pub query_latent: Vec<f32>,
    /// `[n, heads · head_dim]`, after RoPE.
    pub query: Vec<f32>,
    /// `[n, head_dim]`: window KV before FP8.
    pub window_pre_quant: Vec<f32>,
    /// `n` FP8 rows.
    pub window_rows: Vec<u8>,
    /// KV sources: the new compressed entries.
    pub compressed: Option<Compressed>,
    /// Index sources: `[n, index_heads · index_head_dim]` before MXFP4.
    pub index_queries_pre_quant: Vec<f32>,
    /// Index sources: `n · index_heads` MXFP4 rows.
    pub index_query_rows: Vec<u8>,
    /// Index sources: `[n, index_heads]`, scaled.
    pub index_weights: Vec<f32>,
    /// Index sources: scores `[n, score_width]`, `-inf` where not visible.
    pub index_scores: Vec<f32>,
    /// Width of the score rows (compressed entries of the KV source at scoring time).
    pub score_width: usize,
    /// Visible entries per token.
    pub visible: Vec<u64>,
    /// Candidate source: block scores `[n, blocks]` (`+inf` on the forced block).
    pub candidate_block_scores: Vec<f32>,
    /// Reindex layers using candidates: scores after the mask.
    pub scores_after_candidates: Option<Vec<f32>>,
    /// Layers with compression: the top-k used, `[n, index_topk]` canonical.
    pub topk: Vec<i32>,
    /// `[n, heads · head_dim]`: attention result before the inverse RoPE.
    pub attended: Vec<f32>,
    /// `[n, hidden]`.
    pub output: Vec<f32>,
}

/// The per-row projections of one layer's step (spec §4 steps 1, 2 and 4's queries and head
/// weights, and the compressor's inputs of step 3): every row depends on its own input row and
/// position only, so a batch computes them over all its members' rows with one product per
/// weight ([`Csa2Attention::project`]) and hands each member its rows
/// ([`Projections::split`]). The linear kernels sum each output element in one fixed order
/// whatever the rows computed together, so a member's rows are bit for bit those of its step
/// alone.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Projections {
    /// Token positions of the rows.
    pub positions: Vec<u64>,
    /// `[n, q_lora_rank]`.
    pub query_latent: Vec<f32>,
    /// `[n, heads · head_dim]`, after RoPE.
    pub query: Vec<f32>,
    /// `[n, head_dim]`: window KV before FP8.
    pub window_pre_quant: Vec<f32>,
    /// `n` FP8 rows.
    pub window_rows: Vec<u8>,
    /// Index sources: `[n, index_heads · index_head_dim]` before MXFP4 (else empty).
    pub index_queries_pre_quant: Vec<f32>,
    /// Index sources: `n · index_heads` MXFP4 rows (else empty).
    pub index_query_rows: Vec<u8>,
    /// Index sources: `[n, index_heads]`, scaled (else empty).
    pub index_weights: Vec<f32>,
    /// KV sources: `[n, head_dim]`, the compressor's `x wkvᵀ` (else empty).
    pub compressor_kv: Vec<f32>,
    /// KV sources with a gate: `[n, head_dim]`, `x wgateᵀ`.
    pub compressor_gate: Option<Vec<f32>>,
}

impl Projections {
    /// Rows in the projections.
    pub fn rows(&self) -> usize {
        self.positions.len()
    }

    /// Cuts the rows into consecutive parts of `counts` rows (in order; they must add up to
    /// [`Projections::rows`]).
    ///
    /// # Errors
    /// [`Error::State`] naming `layer` when the counts do not cover the rows or a field is not
    /// whole rows.
    pub fn split(self, layer: usize, counts: &[usize]) -> Result<Vec<Projections>, Error> {
        let n = self.rows();
        if counts.iter().sum::<usize>() != n {
            return Err(Error::State {
                layer,
                reason: format!("projections of {n} rows cut into parts of {counts:?}"),
            });
        }
        if let [_] = counts {
            return Ok(vec![self]);
        }
        fn cut<T: Clone>(
            layer: usize,
            what: &str,
            v: &[T],
            n: usize,
            counts: &[usize],
        ) -> Result<Vec<Vec<T>>, Error> {
            if n == 0 || !v.len().is_multiple_of(n) {
                return Err(Error::State {
                    layer,
                    reason: format!("{what}: {} values are not {n} whole rows", v.len()),
                });
            }
            let w = v.len() / n;
            let mut at = 0;
            Ok(counts
                .iter()
                .map(|&c| {
                    let part = v[at * w..(at + c) * w].to_vec();
                    at += c;
                    part
                })
                .collect())
        }
        let positions = cut(layer, "positions", &self.positions, n, counts)?;
        let ql = cut(layer, "query latent", &self.query_latent, n, counts)?;
        let q = cut(layer, "query", &self.query, n, counts)?;
        let wpre = cut(layer, "window KV", &self.window_pre_quant, n, counts)?;
        let wrows = cut(layer, "window rows", &self.window_rows, n, counts)?;
        let opt = |what: &str, v: &[f32]| -> Result<Vec<Vec<f32>>, Error> {
            if v.is_empty() {
                Ok(vec![Vec::new(); counts.len()])
            } else {
                cut(layer, what, v, n, counts)
            }
        };
        let iq_pre = opt("index queries", &self.index_queries_pre_quant)?;
        let iq_rows = if self.index_query_rows.is_empty() {
            vec![Vec::new(); counts.len()]
        } else {
            cut(layer, "index query rows", &self.index_query_rows, n, counts)?
        };
        let iw = opt("index weights", &self.index_weights)?;
        let ckv = opt("compressor kv", &self.compressor_kv)?;
        let gate = match &self.compressor_gate {
            Some(g) => cut(layer, "compressor gate", g, n, counts)?
                .into_iter()
                .map(Some)
                .collect(),
            None => vec![None; counts.len()],
        };
        let mut parts = Vec::with_capacity(counts.len());
        let fields = positions
            .into_iter()
            .zip(ql)
            .zip(q)
            .zip(wpre)
            .zip(wrows)
            .zip(iq_pre)
            .zip(iq_rows)
            .zip(iw)
            .zip(ckv)
            .zip(gate);
        for (((((((((p, ql), q), wpre), wrows), iqp), iqr), iw), ckv), g) in fields {
            parts.push(Projections {
                positions: p,
                query_latent: ql,
                query: q,
                window_pre_quant: wpre,
                window_rows: wrows,
                index_queries_pre_quant: iqp,
                index_query_rows: iqr,
                index_weights: iw,
                compressor_kv: ckv,
                compressor_gate: g,
            });
        }
        Ok(parts)
    }
}

/// The default of [`Csa2Attention::set_entry_decode_limit`]: about a core's L2.
pub const ENTRY_DECODE_BYTES: usize = 2 << 20;

/// One query's rows for the tiled attention path: its window rows and its selected entries,
/// each as a one-entry run.
struct QueryRows<'a> {
    window: Vec<&'a [WindowFp8Entry]>,
    entries: Vec<&'a [GlobalFp4Entry]>,
}

/// Which keys each query of one layer's step attends: window positions and selected entries.
/// Both attention paths go through this (and [`KeySource`]), with the same errors.
struct Selection<'f> {
    layer: usize,
    topk: Option<&'f TopK>,
    /// The window length.
    len: u64,
    /// The first position the window may reach back to.
    start: u64,
}

impl Selection<'_> {
    /// The window positions of the query at `t`.
    fn window_positions(&self, t: u64) -> std::ops::RangeInclusive<u64> {
        (t + 1).saturating_sub(self.len).max(self.start)..=t
    }

    /// The compressed positions token `i` of the step selected (none without a top-k).
    fn selected(&self, i: usize) -> Result<impl Iterator<Item = u64> + '_, Error> {
        let row = match self.topk {
            None => &[][..],
            Some(tk) => tk.row(i).ok_or_else(|| Error::State {
                layer: self.layer,
                reason: format!("top-k of layer {} has no row for token {i}", tk.source),
            })?,
        };
        Ok(row.iter().filter_map(|&j| u64::try_from(j).ok()))
    }
}

/// Where the keys of a [`Selection`] are read: the store's row accessors.
struct KeySource<'a, 'f> {
    sel: Selection<'f>,
    window: &'f dyn Fn(u64) -> Option<&'a [u8]>,
    entry: &'f dyn Fn(u64) -> Option<&'a [u8]>,
}

impl<'a> KeySource<'a, '_> {
    /// The window row of position `p`, read for the query at `t`.
    fn window_row(&self, p: u64, t: u64) -> Result<&'a [u8], Error> {
        (self.window)(p).ok_or_else(|| Error::State {
            layer: self.sel.layer,
            reason: format!("window row of position {p} (query {t}) is not available"),
        })
    }

    /// Compressed entry `j`, selected by the query at `t`.
    fn entry_row(&self, j: u64, t: u64) -> Result<&'a [u8], Error> {
        (self.entry)(j).ok_or_else(|| Error::State {
            layer: self.sel.layer,
            reason: format!("compressed entry {j} selected for query {t} is not in the store"),
        })
    }
}

/// The CSA2 attention of a whole model: dimensions, plan, weights and per-layer rotations.
#[derive(Clone, Debug)]
pub struct Csa2Attention {
    dims: AttentionDims,
    plan: LayerPlan,
    weights: AttentionWeights,
    ropes: Vec<Rope>,
    shape: AttentionShape,
    window_codec: RowCodec,
    entry_codec: RowCodec,
    key_codec: Option<RowCodec>,
    output_shape: OutputShape,
    /// Threads of a prefill step's attention (queries split between them).
    threads: usize,
    /// Which path the sparse attention takes.
    path: AttentionPath,
    /// [`Csa2Attention::set_entry_decode_limit`].
    entry_decode_bytes: usize,
}

/// The path of a layer's sparse attention (see [`Csa2Attention::set_attention_path`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionPath {
    /// The tiled kernel where it pays: 512-wide heads, at least 16 of them (the kernel pads
    /// the heads to a multiple of 16, so 4 heads cost it what 16 do, and the general path is
    /// then as fast: measured 0.27-0.32 ms per query for both at 4 heads over 640 entries,
    /// against 0.63 / 3.56 ms at 64 heads).
    #[default]
    Auto,
    /// The tiled kernel whenever the heads are 512 wide.
    Tiled,
    /// The general per-key path for every layer.
    General,
}

impl AttentionPath {
    /// Whether a model of `dims` runs its sparse attention through the tiled kernel on this
    /// path.
    pub fn is_tiled(self, dims: &AttentionDims) -> bool {
        dims.head_dim == fast::HEAD_DIM
            && match self {
                AttentionPath::Auto => dims.heads >= 16,
                AttentionPath::Tiled => true,
                AttentionPath::General => false,
            }
    }
}

/// The first error of a step's chunks split over threads; a chunk that panicked is an
/// error naming `what` worker.
fn joined(layer: usize, what: &str, results: Vec<Option<Result<(), Error>>>) -> Result<(), Error> {
    results.into_iter().try_for_each(|r| {
        r.unwrap_or_else(|| {
            Err(Error::State {
                layer,
                reason: format!("{what} worker thread panicked"),
            })
        })
    })
}

fn check_input(
    layer: usize,
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), Error> {
    if expected == actual {
        Ok(())
    } else {
        Err(Error::Input {
            layer,
            what,
            expected,
            actual,
        })
    }
}

impl Csa2Attention {
    /// Assembles the layer from checked parts.
    pub fn new(
        dims: AttentionDims,
        plan: LayerPlan,
        weights: AttentionWeights,
    ) -> Result<Csa2Attention, Error> {
        if weights.layers.len() != plan.layers.len() {
            return Err(Error::State {
                layer: weights.layers.len(),
                reason: format!(
                    "weights for {} layers, plan of {}",
                    weights.layers.len(),
                    plan.layers.len()
                ),
            });
        }
        let ropes = plan
            .layers
            .iter()
            .map(|s| dims.rope(s).map_err(Error::kernel(s.index, "rope")))
            .collect::<Result<Vec<_>, _>>()?;
        let shape = AttentionShape::new(dims.heads, dims.head_dim)
            .map_err(Error::kernel(0, "attention shape"))?;
        let key_codec = if dims.index_head_dim > 0 {
            Some(
                RowCodec::new(EntryFormat::IndexMxfp4, dims.index_head_dim)
                    .map_err(Error::kernel(0, "index key rows"))?,
            )
        } else {
            None
        };
        Ok(Csa2Attention {
            output_shape: OutputShape {
                heads: dims.heads,
                head_dim: dims.head_dim,
                groups: dims.o_groups,
                rank: dims.o_lora_rank,
                hidden: dims.hidden,
            },
            threads: 1,
            path: AttentionPath::Auto,
            entry_decode_bytes: ENTRY_DECODE_BYTES,
            window_codec: shape.window_codec(),
            entry_codec: shape.compressed_codec(),
            key_codec,
            shape,
            dims,
            plan,
            weights,
            ropes,
        })
    }

    /// Loads config, plan and weights from files.
    pub fn from_files(
        config: &std::path::Path,
        weights: &std::path::Path,
    ) -> Result<Csa2Attention, Error> {
        let cfg = ModelConfig::from_file(config).map_err(Error::AttentionConfig)?;
        let plan = LayerPlan::from_config(&cfg).map_err(Error::AttentionConfig)?;
        let dims = AttentionDims::from_config(&cfg, &plan)?;
        let file = TensorFile::open(weights)?;
        let w = AttentionWeights::load(&file, &dims, &plan)?;
        Csa2Attention::new(dims, plan, w)
    }

    /// The dimensions.
    pub fn dims(&self) -> &AttentionDims {
        &self.dims
    }

    /// Threads for the attention of a prefill step (at least 1); results do not depend on it.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// The most bytes of f32 rows a prefill step decodes its selected entries into
    /// ([`ENTRY_DECODE_BYTES`] by default). Each entry is decoded once per step and shared by
    /// the step's queries while the decoded rows fit in a core's cache; a long context's
    /// step selects more (up to every entry: megabytes per layer), and its queries would read
    /// the decoded rows from memory, 2 KB each at 512 wide, so past the limit each query
    /// reads the entries as stored (FP4: 288 bytes) and dequantizes its own. The values, and
    /// so the results, are the same either way; `0` always reads them as stored.
    pub fn set_entry_decode_limit(&mut self, bytes: usize) {
        self.entry_decode_bytes = bytes;
    }

    /// A projection `out = x Wᵀ` (`W` `[n, k]` in its stored format) on the layer's threads
    /// (bit-identical for every count).
    fn linear(
        &self,
        x: &[f32],
        w: &PackedLinear,
        m: usize,
        k: usize,
        n: usize,
        out: &mut [f32],
    ) -> Result<(), kvstack_kernels::Error> {
        if w.n() != n || w.k() != k {
            return Err(kvstack_kernels::Error::Param {
                what: "projection weight",
                reason: format!("[{}, {}], expected [{n}, {k}]", w.n(), w.k()),
            });
        }
        if m == 0 {
            // No rows (a step that completes no compressor group): nothing to read.
            return Ok(());
        }
        w.forward_threads(x, m, out, self.threads)
    }

    /// The grouped low-rank output projection (spec §4, as
    /// `kvstack_kernels::csa2::output::grouped_output`) with packed weights: group `g`'s
    /// slice of `x` (`[n, heads · head_dim]`) through its `wo_a`, the concatenation through
    /// `wo_b`.
    fn grouped_output(
        &self,
        n: usize,
        x: &[f32],
        wo_a: &[PackedLinear],
        wo_b: &PackedLinear,
        out: &mut [f32],
    ) -> Result<(), kvstack_kernels::Error> {
        let s = &self.output_shape;
        let (gw, width, rank) = (s.group_width(), s.heads * s.head_dim, s.rank);
        let gr = s.groups * rank;
        if wo_a.len() != s.groups {
            return Err(kvstack_kernels::Error::Param {
                what: "wo_a groups",
                reason: format!("{} matrices for {} groups", wo_a.len(), s.groups),
            });
        }
        let mut low = vec![0f32; n * gr];
        let mut xg = vec![0f32; n * gw];
        let mut yg = vec![0f32; n * rank];
        for (g, wa) in wo_a.iter().enumerate() {
            for (t, row) in xg.chunks_exact_mut(gw).enumerate() {
                row.copy_from_slice(&x[t * width + g * gw..t * width + (g + 1) * gw]);
            }
            self.linear(&xg, wa, n, gw, rank, &mut yg)?;
            for (t, row) in yg.chunks_exact(rank).enumerate() {
                low[t * gr + g * rank..t * gr + (g + 1) * rank].copy_from_slice(row);
            }
        }
        self.linear(&low, wo_b, n, gr, s.hidden, out)
    }

    /// Which path the sparse attention takes: the register-tiled decode kernel of
    /// `kvstack_kernels::attn`, for 512-wide heads (V4.1-Flash: 5.6x faster than the general
    /// path at its 64 heads on one thread), or the general per-key path every head width
    /// takes. The two differ by f32 rounding only; [`AttentionPath::Auto`] (the default)
    /// picks the faster, the others are for comparing them and for debugging.
    pub fn set_attention_path(&mut self, path: AttentionPath) {
        self.path = path;
    }

    /// Whether the sparse attention runs the tiled kernel (see [`AttentionPath`]).
    pub fn tiled_attention(&self) -> bool {
        self.path.is_tiled(&self.dims)
    }

    /// The layer plan.
    pub fn plan(&self) -> &LayerPlan {
        &self.plan
    }

    /// The weights.
    pub fn weights(&self) -> &AttentionWeights {
        &self.weights
    }

    /// The rotation of `layer`.
    pub fn rope(&self, layer: usize) -> Option<&Rope> {
        self.ropes.get(layer)
    }

    /// FP8 window rows at `head_dim`.
    pub fn window_codec(&self) -> RowCodec {
        self.window_codec
    }

    /// FP4 entries at `head_dim`.
    pub fn entry_codec(&self) -> RowCodec {
        self.entry_codec
    }

    /// MXFP4 index keys at `index_head_dim` (when the model has an indexer).
    pub fn key_codec(&self) -> Option<RowCodec> {
        self.key_codec
    }

    /// An empty in-memory store for this model, keeping `keep_window` window rows per layer
    /// (all with `None`).
    pub fn new_store(&self, keep_window: Option<usize>) -> ContiguousStore {
        ContiguousStore::new(
            self.plan.layers.len(),
            self.window_codec.bytes(),
            self.entry_codec.bytes(),
            self.key_codec.map_or(0, |c| c.bytes()),
            keep_window,
        )
    }

    fn spec(&self, layer: usize) -> Result<(&LayerSpec, &LayerWeights, &Rope), Error> {
        match (
            self.plan.layers.get(layer),
            self.weights.layers.get(layer),
            self.ropes.get(layer),
        ) {
            (Some(s), Some(w), Some(r)) => Ok((s, w, r)),
            _ => Err(Error::State {
                layer,
                reason: format!("the model has {} layers", self.plan.layers.len()),
            }),
        }
    }

    fn tokens(
        &self,
        layer: usize,
        what: &'static str,
        x: &[f32],
        width: usize,
    ) -> Result<usize, Error> {
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(Error::Input {
                layer,
                what,
                expected: x.len().div_ceil(width.max(1)) * width,
                actual: x.len(),
            });
        }
        Ok(x.len() / width)
    }

    /// `q_norm(x wq_aᵀ)`: `x` is `[n, hidden]`.
    pub fn query_latent(&self, layer: usize, x: &[f32]) -> Result<Vec<f32>, Error> {
        let (_, w, _) = self.spec(layer)?;
        let d = &self.dims;
        let n = self.tokens(layer, "attention input [n, hidden]", x, d.hidden)?;
        let mut ql = vec![0f32; n * d.q_lora_rank];
        self.linear(x, &w.wq_a, n, d.hidden, d.q_lora_rank, &mut ql)
            .map_err(Error::kernel(layer, "wq_a"))?;
        rms_norm_in_place(&mut ql, &w.q_norm, d.eps).map_err(Error::kernel(layer, "q_norm"))?;
        Ok(ql)
    }

    /// `RoPE(q_latent wq_bᵀ)` per head at `positions`.
    pub fn query(
        &self,
        layer: usize,
        q_latent: &[f32],
        positions: &[u64],
    ) -> Result<Vec<f32>, Error> {
        let (_, w, rope) = self.spec(layer)?;
        let d = &self.dims;
        let n = positions.len();
        check_input(
            layer,
            "query latent [n, q_lora_rank]",
            n * d.q_lora_rank,
            q_latent.len(),
        )?;
        let mut q = vec![0f32; n * d.q_width()];
        self.linear(q_latent, &w.wq_b, n, d.q_lora_rank, d.q_width(), &mut q)
            .map_err(Error::kernel(layer, "wq_b"))?;
        rope.rotate_rows(&mut q, d.q_width(), d.head_dim, positions, false)
            .map_err(Error::kernel(layer, "query rope"))?;
        Ok(q)
    }

    /// Window KV `RoPE(kv_norm(x wkvᵀ))` at `positions` and its FP8 rows.
    pub fn window_kv(
        &self,
        layer: usize,
        x: &[f32],
        positions: &[u64],
    ) -> Result<(Vec<f32>, Vec<u8>), Error> {
        let (_, w, rope) = self.spec(layer)?;
        let d = &self.dims;
        let n = positions.len();
        check_input(layer, "attention input [n, hidden]", n * d.hidden, x.len())?;
        let mut kv = vec![0f32; n * d.head_dim];
        self.linear(x, &w.wkv, n, d.hidden, d.head_dim, &mut kv)
            .map_err(Error::kernel(layer, "wkv"))?;
        rms_norm_in_place(&mut kv, &w.kv_norm, d.eps).map_err(Error::kernel(layer, "kv_norm"))?;
        rope.rotate_rows(&mut kv, d.head_dim, d.head_dim, positions, false)
            .map_err(Error::kernel(layer, "window rope"))?;
        let rows = self.quantize(layer, self.window_codec, &kv)?;
        Ok((kv, rows))
    }

    fn quantize(&self, layer: usize, codec: RowCodec, x: &[f32]) -> Result<Vec<u8>, Error> {
        let mut out = vec![0u8; x.len() / codec.dim() * codec.bytes()];
        codec
            .quantize(x, &mut out)
            .map_err(Error::kernel(layer, "quantize"))?;
        Ok(out)
    }

    fn group_positions(spec: &LayerSpec, first: u64, count: usize) -> Vec<u64> {
        let r = u64::from(spec.compress_ratio);
        (0..count as u64).map(|i| (first + i) * r).collect()
    }

    /// The compressor of KV source `layer` over `x` (`[n, hidden]`), resuming from `pending`;
    /// the first completed group gets compressed position `first`.
    pub fn compress(
        &self,
        layer: usize,
        x: &[f32],
        pending: &[f32],
        first: u64,
    ) -> Result<Compressed, Error> {
        let (kv, gate) = self.compressor_projections(layer, x)?;
        self.compress_projected(layer, &kv, gate.as_deref(), pending, first)
    }

    /// The compressor's projections of KV source `layer` over `x` (`[n, hidden]`): `x wkvᵀ`
    /// and, where the layer has a gate, `x wgateᵀ`, each `[n, head_dim]`.
    pub fn compressor_projections(
        &self,
        layer: usize,
        x: &[f32],
    ) -> Result<(Vec<f32>, Option<Vec<f32>>), Error> {
        let (spec, w, _) = self.spec(layer)?;
        let d = &self.dims;
        let Some(cw) = &w.compressor else {
            return Err(Error::State {
                layer,
                reason: format!("layer is {} and has no compressor", spec.mode),
            });
        };
        let n = self.tokens(layer, "attention input [n, hidden]", x, d.hidden)?;
        let mut kv = vec![0f32; n * d.head_dim];
        self.linear(x, &cw.wkv, n, d.hidden, d.head_dim, &mut kv)
            .map_err(Error::kernel(layer, "compressor.wkv"))?;
        let gate = match &cw.wgate {
            Some(wg) => {
                let mut g = vec![0f32; n * d.head_dim];
                self.linear(x, wg, n, d.hidden, d.head_dim, &mut g)
                    .map_err(Error::kernel(layer, "compressor.wgate"))?;
                Some(g)
            }
            None => None,
        };
        Ok((kv, gate))
    }

    /// [`Csa2Attention::compress`] from the compressor's projections of the step's rows
    /// (`kv` and `gate` `[n, head_dim]`, as [`Csa2Attention::compressor_projections`]).
    pub fn compress_projected(
        &self,
        layer: usize,
        kv: &[f32],
        gate: Option<&[f32]>,
        pending: &[f32],
        first: u64,
    ) -> Result<Compressed, Error> {
        let (spec, w, _) = self.spec(layer)?;
        let d = &self.dims;
        let Some(cw) = &w.compressor else {
            return Err(Error::State {
                layer,
                reason: format!("layer is {} and has no compressor", spec.mode),
            });
        };
        let n = self.tokens(layer, "compressor kv [n, head_dim]", kv, d.head_dim)?;
        if let Some(g) = gate {
            check_input(
                layer,
                "compressor gate [n, head_dim]",
                n * d.head_dim,
                g.len(),
            )?;
        }
        let ratio = spec.compress_ratio as usize;
        let mut state = CompressorState::with_pending(ratio, d.head_dim, pending)
            .map_err(Error::kernel(layer, "compressor state"))?;
        let mut latent = Vec::new();
        state
            .push(kv, gate, &mut latent)
            .map_err(Error::kernel(layer, "compressor"))?;
        rms_norm_in_place(&mut latent, &cw.norm, d.eps)
            .map_err(Error::kernel(layer, "compressor.norm"))?;
        let (pre_quant, rows) = self.compressed_entries(layer, &latent, first)?;
        let (key_pre_quant, key_rows) = self.index_keys(layer, &latent, first)?;
        Ok(Compressed {
            first,
            latent,
            pre_quant,
            rows,
            key_pre_quant,
            key_rows,
            pending: state.pending().to_vec(),
        })
    }

    /// Entries from normalized latents (`[g, head_dim]`, positions `first ..`): RoPE at each
    /// group's first token, then FP4.
    pub fn compressed_entries(
        &self,
        layer: usize,
        latent: &[f32],
        first: u64,
    ) -> Result<(Vec<f32>, Vec<u8>), Error> {
        let (spec, _, rope) = self.spec(layer)?;
        let d = &self.dims;
        let g = self.tokens(layer, "compressor latent [g, head_dim]", latent, d.head_dim)?;
        let mut pre = latent.to_vec();
        rope.rotate_rows(
            &mut pre,
            d.head_dim,
            d.head_dim,
            &Self::group_positions(spec, first, g),
            false,
        )
        .map_err(Error::kernel(layer, "compressed rope"))?;
        let rows = self.quantize(layer, self.entry_codec, &pre)?;
        Ok((pre, rows))
    }

    /// Index keys from normalized, unrotated, unquantized latents: `k_norm(latent wkᵀ)`, RoPE
    /// at each group's first token, MXFP4.
    pub fn index_keys(
        &self,
        layer: usize,
        latent: &[f32],
        first: u64,
    ) -> Result<(Vec<f32>, Vec<u8>), Error> {
        let (spec, w, rope) = self.spec(layer)?;
        let d = &self.dims;
        let (Some(kw), Some(codec)) = (
            w.indexer.as_ref().and_then(|i| i.keys.as_ref()),
            self.key_codec,
        ) else {
            return Err(Error::State {
                layer,
                reason: "layer owns no index keys (no indexer.wk)".into(),
            });
        };
        let g = self.tokens(layer, "compressor latent [g, head_dim]", latent, d.head_dim)?;
        let mut k = vec![0f32; g * d.index_head_dim];
        self.linear(latent, &kw.wk, g, d.head_dim, d.index_head_dim, &mut k)
            .map_err(Error::kernel(layer, "indexer.wk"))?;
        rms_norm_in_place(&mut k, &kw.k_norm, d.eps)
            .map_err(Error::kernel(layer, "indexer.k_norm"))?;
        rope.rotate_rows(
            &mut k,
            d.index_head_dim,
            d.index_head_dim,
            &Self::group_positions(spec, first, g),
            false,
        )
        .map_err(Error::kernel(layer, "index key rope"))?;
        let rows = self.quantize(layer, codec, &k)?;
        Ok((k, rows))
    }

    /// Index queries `RoPE(q_latent wq_bᵢᵀ)` per index head, and their MXFP4 rows.
    pub fn index_queries(
        &self,
        layer: usize,
        q_latent: &[f32],
        positions: &[u64],
    ) -> Result<(Vec<f32>, Vec<u8>), Error> {
        let (_, w, rope) = self.spec(layer)?;
        let d = &self.dims;
        let (Some(iw), Some(codec)) = (&w.indexer, self.key_codec) else {
            return Err(Error::State {
                layer,
                reason: "layer is not an index source".into(),
            });
        };
        let n = positions.len();
        check_input(
            layer,
            "query latent [n, q_lora_rank]",
            n * d.q_lora_rank,
            q_latent.len(),
        )?;
        let mut q = vec![0f32; n * d.index_q_width()];
        self.linear(
            q_latent,
            &iw.wq_b,
            n,
            d.q_lora_rank,
            d.index_q_width(),
            &mut q,
        )
        .map_err(Error::kernel(layer, "indexer.wq_b"))?;
        rope.rotate_rows(
            &mut q,
            d.index_q_width(),
            d.index_head_dim,
            positions,
            false,
        )
        .map_err(Error::kernel(layer, "index query rope"))?;
        let rows = self.quantize(layer, codec, &q)?;
        Ok((q, rows))
    }

    /// Head weights `weights_proj(x) · index_head_dim^-1/2 · index_heads^-1/2`, `[n, index_heads]`.
    pub fn index_weights(&self, layer: usize, x: &[f32]) -> Result<Vec<f32>, Error> {
        let (_, w, _) = self.spec(layer)?;
        let d = &self.dims;
        let Some(iw) = &w.indexer else {
            return Err(Error::State {
                layer,
                reason: "layer is not an index source".into(),
            });
        };
        let n = self.tokens(layer, "attention input [n, hidden]", x, d.hidden)?;
        let mut out = vec![0f32; n * d.index_heads];
        self.linear(x, &iw.weights_proj, n, d.hidden, d.index_heads, &mut out)
            .map_err(Error::kernel(layer, "indexer.weights_proj"))?;
        scale_head_weights(&mut out, d.index_head_dim, d.index_heads);
        Ok(out)
    }

    /// Visible compressed entries for query position `t` of a layer with ratio `r`:
    /// `(t + 1) / r` (spec §4: only completed groups).
    pub fn visible(ratio: u32, t: u64) -> u64 {
        if ratio == 0 {
            0
        } else {
            (t + 1) / u64::from(ratio)
        }
    }

    /// Index scores `[n, width]` of MXFP4 queries (`n · index_heads` rows) with head weights
    /// (`[n, index_heads]`) over `width` keys from `key(j)`; `-inf` where `j` is not visible.
    #[allow(clippy::too_many_arguments)]
    pub fn index_scores<'k>(
        &self,
        layer: usize,
        q_rows: &[u8],
        weights: &[f32],
        positions: &[u64],
        width: usize,
        key: &dyn Fn(u64) -> Option<&'k [u8]>,
    ) -> Result<Vec<f32>, Error> {
        self.index_scores_of(
            layer,
            q_rows,
            weights,
            positions,
            width,
            IndexKeys::Rows(key),
        )
    }

    /// [`Csa2Attention::index_scores`] with the keys given as byte runs in position order
    /// ([`KvStore::index_key_runs`]), which the integer scan reads in place.
    ///
    /// # Errors
    /// As [`Csa2Attention::index_scores`].
    pub fn index_scores_in_runs(
        &self,
        layer: usize,
        q_rows: &[u8],
        weights: &[f32],
        positions: &[u64],
        width: usize,
        runs: &[&[u8]],
    ) -> Result<Vec<f32>, Error> {
        self.index_scores_of(
            layer,
            q_rows,
            weights,
            positions,
            width,
            IndexKeys::Runs(runs),
        )
    }

    fn index_scores_of(
        &self,
        layer: usize,
        q_rows: &[u8],
        weights: &[f32],
        positions: &[u64],
        width: usize,
        keys: IndexKeys<'_, '_>,
    ) -> Result<Vec<f32>, Error> {
        let (spec, _, _) = self.spec(layer)?;
        let d = &self.dims;
        let Some(codec) = self.key_codec else {
            return Err(Error::State {
                layer,
                reason: "the model has no indexer".into(),
            });
        };
        let n = positions.len();
        let qb = d.index_heads * codec.bytes();
        check_input(layer, "index query rows (bytes)", n * qb, q_rows.len())?;
        check_input(
            layer,
            "index weights [n, index_heads]",
            n * d.index_heads,
            weights.len(),
        )?;
        let mut scores = vec![f32::NEG_INFINITY; n * width];
        if self.fast_indexer() && width > 0 {
            let held = KeyPages::new(layer, &keys, width)?;
            let pages = held.pages();
            let paged = fast::Paged::pages(&pages, held.page).map_err(|e| Error::State {
                layer,
                reason: format!("index keys: {e}"),
            })?;
            self.index_scores_fast(
                layer,
                spec.compress_ratio,
                q_rows,
                weights,
                positions,
                paged,
                &mut scores,
            )?;
            return Ok(scores);
        }
        let rows: Vec<&[u8]> = match keys {
            IndexKeys::Rows(_) => Vec::new(),
            IndexKeys::Runs(runs) => runs
                .iter()
                .flat_map(|r| r.chunks_exact(codec.bytes()))
                .collect(),
        };
        let key = |j: u64| match keys {
            IndexKeys::Rows(f) => f(j),
            IndexKeys::Runs(_) => usize::try_from(j).ok().and_then(|j| rows.get(j)).copied(),
        };
        for (i, &t) in positions.iter().enumerate() {
            let q = IndexQuery::new(
                codec.layout(),
                &q_rows[i * qb..(i + 1) * qb],
                &weights[i * d.index_heads..(i + 1) * d.index_heads],
            )
            .map_err(Error::kernel(layer, "index query"))?;
            let visible = (Self::visible(spec.compress_ratio, t) as usize).min(width);
            kvstack_kernels::work::add_index(
                visible as u64,
                d.index_heads as u64,
                codec.dim() as u64,
                codec.bytes() as u64,
            );
            for (j, s) in scores[i * width..i * width + visible]
                .iter_mut()
                .enumerate()
            {
                let k = key(j as u64).ok_or_else(|| Error::State {
                    layer,
                    reason: format!("index key {j} missing from the store"),
                })?;
                *s = q.score(k).map_err(Error::kernel(layer, "index score"))?;
            }
        }
        Ok(scores)
    }

    /// [`Csa2Attention::index_scores`] at the deployed indexer shape (32 heads of 128) with
    /// the integer scan of `kvstack_kernels::attn`, whose scores are bit-identical to the
    /// exact dots (its docs say why). The keys come as equal pages ([`KeyPages`]); a step of several
    /// queries splits them between threads, a single query splits its keys instead.
    #[allow(clippy::too_many_arguments)]
    fn index_scores_fast(
        &self,
        layer: usize,
        ratio: u32,
        q_rows: &[u8],
        weights: &[f32],
        positions: &[u64],
        paged: fast::Paged<'_, IndexMxfp4Entry>,
        scores: &mut [f32],
    ) -> Result<(), Error> {
        let n = positions.len();
        let width = scores.len() / n.max(1);
        let fast_err = |e: fast::AttnError| Error::State {
            layer,
            reason: format!("indexer scan: {e}"),
        };
        let score = |i: usize, t: u64, row: &mut [f32], threads: usize| -> Result<(), Error> {
            let q = fast_query(layer, q_rows, weights, i)?;
            let visible = (Self::visible(ratio, t) as usize).min(width);
            fast::indexer_scores(&q, paged, visible, threads, row).map_err(fast_err)
        };
        let threads = self.threads.min(n).max(1);
        if n == 1 || threads == 1 {
            for (i, (&t, row)) in positions
                .iter()
                .zip(scores.chunks_exact_mut(width))
                .enumerate()
            {
                score(i, t, row, if n == 1 { self.threads } else { 1 })?;
            }
            return Ok(());
        }
        let per = n.div_ceil(threads);
        let score = &score;
        let results = crate::threads::on_threads(scores, per * width, |c, part| {
            for (k, row) in part.chunks_exact_mut(width).enumerate() {
                let i = c * per + k;
                score(i, positions[i], row, 1)?;
            }
            Ok(())
        });
        joined(layer, "an indexer", results)
    }

    /// Whether the indexer has the deployed shape the integer scan of `kvstack_kernels::attn`
    /// serves: 32 MXFP4 heads of 128.
    fn fast_indexer(&self) -> bool {
        self.dims.index_heads == fast::INDEX_HEADS
            && self
                .key_codec
                .is_some_and(|c| c.dim() == fast::INDEX_DIM && c.bytes() == IndexMxfp4Entry::BYTES)
    }

    /// Top-k rows (`[n, index_topk]`, canonical) of a Reindex layer that uses candidate
    /// pools (`pools[i]` for token `i`), scoring only the pool positions with the integer scan
    /// (spec §4: every other score is masked to `-inf`, so it is never selected). The sets equal
    /// those of masking full score rows and selecting (`fast::topk_positions` ranks as
    /// [`topk`] does, ties to the lower position), for 2,048 x 8 keys a token instead of every
    /// stored one. `None` (score everything instead) when the indexer is not at the deployed
    /// shape or a token has no pool.
    ///
    /// # Errors
    /// [`Error::State`] for keys missing from the store or malformed query rows.
    #[allow(clippy::too_many_arguments)]
    fn select_in_pools(
        &self,
        layer: usize,
        ratio: u32,
        q_rows: &[u8],
        weights: &[f32],
        positions: &[u64],
        width: usize,
        runs: &[&[u8]],
        pools: &[Vec<u32>],
    ) -> Result<Option<Vec<i32>>, Error> {
        let d = &self.dims;
        let heads = fast::INDEX_HEADS;
        let n = positions.len();
        if !self.fast_indexer() || pools.len() < n || width == 0 {
            return Ok(None);
        }
        let qb = heads * IndexMxfp4Entry::BYTES;
        check_input(layer, "index query rows (bytes)", n * qb, q_rows.len())?;
        check_input(
            layer,
            "index weights [n, index_heads]",
            n * heads,
            weights.len(),
        )?;
        let fast_err = |e: fast::AttnError| Error::State {
            layer,
            reason: format!("indexer candidates: {e}"),
        };
        let held = KeyPages::new(layer, &IndexKeys::Runs(runs), width)?;
        let pages = held.pages();
        let paged = fast::Paged::pages(&pages, held.page).map_err(fast_err)?;
        let k = d.index_topk;
        let mut out = vec![-1i32; n * k];
        let (mut pos, mut scores) = (Vec::new(), Vec::new());
        for (i, (&t, pool)) in positions.iter().zip(pools).enumerate() {
            let q = fast_query(layer, q_rows, weights, i)?;
            // A pool position past i32 cannot be stored (the width is below it): never selected.
            pos.clear();
            pos.extend(pool.iter().map(|&p| i32::try_from(p).unwrap_or(-1)));
            scores.clear();
            scores.resize(pos.len(), f32::NEG_INFINITY);
            let visible = (Self::visible(ratio, t) as usize).min(width);
            fast::indexer_scores_at(&q, paged, visible, &pos, self.threads, &mut scores)
                .map_err(fast_err)?;
            fast::topk_positions(&scores, &pos, &mut out[i * k..(i + 1) * k]).map_err(fast_err)?;
        }
        Ok(Some(out))
    }

    /// Top-k rows (`[n, index_topk]`, canonical) of score rows `[n, width]`.
    pub fn select(&self, layer: usize, scores: &[f32], n: usize) -> Result<Vec<i32>, Error> {
        let k = self.dims.index_topk;
        let width = scores.len().checked_div(n).unwrap_or(0);
        check_input(layer, "index scores [n, width]", n * width, scores.len())?;
        let mut out = vec![-1i32; n * k];
        for i in 0..n {
            topk(
                &scores[i * width..(i + 1) * width],
                k,
                &mut out[i * k..(i + 1) * k],
            )
            .map_err(Error::kernel(layer, "top-k"))?;
        }
        Ok(out)
    }

    /// Candidate pools and block scores of score rows `[n, width]`.
    pub fn candidate_pools(
        &self,
        layer: usize,
        scores: &[f32],
        positions: &[u64],
    ) -> Result<(Vec<Vec<u32>>, Vec<f32>), Error> {
        let (spec, _, _) = self.spec(layer)?;
        let Some(params) = self.dims.candidates else {
            return Err(Error::State {
                layer,
                reason: "the config has no candidate pool".into(),
            });
        };
        let n = positions.len();
        let width = scores.len().checked_div(n).unwrap_or(0);
        let mut pools = Vec::with_capacity(n);
        let mut all_bs = Vec::new();
        let mut bs = Vec::new();
        check_input(layer, "index scores [n, width]", n * width, scores.len())?;
        for (i, &t) in positions.iter().enumerate() {
            let row = &scores[i * width..(i + 1) * width];
            let visible = (Self::visible(spec.compress_ratio, t) as usize).min(width);
            let mut pool = Vec::new();
            candidate_pool(row, visible, params, &mut bs, &mut pool)
                .map_err(Error::kernel(layer, "candidate pool"))?;
            all_bs.extend_from_slice(&bs);
            pools.push(pool);
        }
        Ok((pools, all_bs))
    }

    /// Sparse attention of every token: `q` `[n, heads · head_dim]` at `positions`; window
    /// rows from `window(pos)`, compressed entries from `entry(j)` for the valid slots of the
    /// token's `topk` row (none for window-only layers). Returns `attended` before the inverse
    /// RoPE.
    #[allow(clippy::too_many_arguments)]
    pub fn attend<'a>(
        &self,
        layer: usize,
        q: &[f32],
        positions: &[u64],
        window: &dyn Fn(u64) -> Option<&'a [u8]>,
        entry: &dyn Fn(u64) -> Option<&'a [u8]>,
        topk: Option<&TopK>,
    ) -> Result<Vec<f32>, Error> {
        self.attend_from(layer, q, positions, window, entry, topk, 0)
    }

    /// [`Csa2Attention::attend`] with the window truncated at `window_start` (see
    /// [`Csa2Attention::forward_from`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_from<'a>(
        &self,
        layer: usize,
        q: &[f32],
        positions: &[u64],
        window: &dyn Fn(u64) -> Option<&'a [u8]>,
        entry: &dyn Fn(u64) -> Option<&'a [u8]>,
        topk: Option<&TopK>,
        window_start: u64,
    ) -> Result<Vec<f32>, Error> {
        let (_, w, _) = self.spec(layer)?;
        let d = &self.dims;
        let n = positions.len();
        check_input(
            layer,
            "query [n, heads * head_dim]",
            n * d.q_width(),
            q.len(),
        )?;
        let mut out = vec![0f32; n * d.q_width()];
        let keys = KeySource {
            sel: Selection {
                layer,
                topk,
                len: d.window as u64,
                start: window_start,
            },
            window,
            entry,
        };
        let sel = &keys.sel;
        if self.tiled_attention() {
            self.attend_tiled(layer, q, positions, &keys, &w.sinks, &mut out)?;
            return Ok(out);
        }
        let mut attn = SparseAttention::new(self.shape);
        let hd = d.head_dim;
        // A step of several queries decodes each key once: the window rows the step reads
        // (one contiguous range) and every selected entry (while their rows fit the entry
        // decode limit; past it the queries read the entries as stored), into f32 rows the
        // queries share. (Both in cache-line-aligned buffers: rows of a multiple of 16 floats,
        // as V4.1's 512, then start on a line, and none of the kernel's loads straddles two.)
        let (mut wdec, mut wlo) = (AlignedF32::default(), 0u64);
        let mut edec = AlignedF32::default();
        let mut eslot: Vec<u32> = Vec::new();
        let mut ebytes: Vec<&[u8]> = Vec::new();
        if n > 1 {
            wlo = *sel.window_positions(positions[0]).start();
            let whi = positions[n - 1];
            if whi >= wlo {
                wdec = AlignedF32::zeroed((whi - wlo + 1) as usize * hd);
                for (p, row) in (wlo..=whi).zip(wdec.as_mut_slice().chunks_exact_mut(hd)) {
                    // The first query that reads row `p`.
                    let t = p.max(positions[0]);
                    self.shape
                        .decode_row(KeyRow::Window(keys.window_row(p, t)?), row)
                        .map_err(Error::kernel(layer, "sparse attention"))?;
                }
            }
            // Each selected entry once, in order of first use: its slot, then its decoded row
            // (or its stored bytes, resolved here: the store's accessors need not be `Sync`).
            let mut first: Vec<(u64, u64)> = Vec::new();
            for (i, &t) in positions.iter().enumerate() {
                for j in sel.selected(i)? {
                    let j = j as usize;
                    if j >= eslot.len() {
                        eslot.resize(j + 1, u32::MAX);
                    }
                    if eslot[j] == u32::MAX {
                        eslot[j] = first.len() as u32;
                        first.push((j as u64, t));
                    }
                }
            }
            if first.len() * hd * 4 > self.entry_decode_bytes {
                for &(j, t) in &first {
                    ebytes.push(keys.entry_row(j, t)?);
                }
            } else {
                edec = AlignedF32::zeroed(first.len() * hd);
                for (&(j, t), row) in first.iter().zip(edec.as_mut_slice().chunks_exact_mut(hd)) {
                    let e = keys.entry_row(j, t)?;
                    self.shape
                        .decode_row(KeyRow::Compressed(e), row)
                        .map_err(Error::kernel(layer, "sparse attention"))?;
                }
            }
        }
        let (wdec, edec, ebytes) = (wdec.as_slice(), edec.as_slice(), &ebytes);
        let qw = d.q_width();
        if n > 1 {
            // Every key is decoded or resolved: the queries are independent and may run on
            // several threads.
            let query = |i: usize, t: u64, attn: &mut SparseAttention, o: &mut [f32]| {
                let mut rows: Vec<KeyRow<'_>> = Vec::with_capacity(d.window + d.index_topk);
                for p in sel.window_positions(t) {
                    let k = (p - wlo) as usize;
                    rows.push(KeyRow::Decoded(&wdec[k * hd..(k + 1) * hd]));
                }
                for j in sel.selected(i)? {
                    let k = eslot[j as usize] as usize;
                    rows.push(match ebytes.get(k) {
                        Some(e) => KeyRow::Compressed(e),
                        None => KeyRow::Decoded(&edec[k * hd..(k + 1) * hd]),
                    });
                }
                attn.run(&q[i * qw..(i + 1) * qw], &w.sinks, rows, o)
                    .map_err(Error::kernel(layer, "sparse attention"))
            };
            // At least 8 queries per thread: fewer do not pay for the spawn.
            let threads = self.threads.min(n / 8).max(1);
            if threads == 1 {
                for (i, (&t, o)) in positions.iter().zip(out.chunks_exact_mut(qw)).enumerate() {
                    query(i, t, &mut attn, o)?;
                }
            } else {
                let per = n.div_ceil(threads);
                let query = &query;
                let shape = self.shape;
                let results = crate::threads::on_threads(&mut out, per * qw, |c, part| {
                    let mut attn = SparseAttention::new(shape);
                    for (k, o) in part.chunks_exact_mut(qw).enumerate() {
                        let i = c * per + k;
                        query(i, positions[i], &mut attn, o)?;
                    }
                    Ok(())
                });
                joined(layer, "an attention", results)?;
            }
            return Ok(out);
        }
        let mut rows: Vec<KeyRow<'_>> = Vec::new();
        for (i, &t) in positions.iter().enumerate() {
            rows.clear();
            for p in sel.window_positions(t) {
                rows.push(KeyRow::Window(keys.window_row(p, t)?));
            }
            for j in sel.selected(i)? {
                rows.push(KeyRow::Compressed(keys.entry_row(j, t)?));
            }
            attn.run(
                &q[i * qw..(i + 1) * qw],
                &w.sinks,
                rows.iter().copied(),
                &mut out[i * qw..(i + 1) * qw],
            )
            .map_err(Error::kernel(layer, "sparse attention"))?;
        }
        Ok(out)
    }

    /// [`Csa2Attention::attend_from`] through `kvstack_kernels::attn::sparse_attention_decode`
    /// for 512-wide heads: per query, its window rows and selected entries (in one-entry
    /// pages, as the store hands them out one by one) go to the kernel, which dequantizes each
    /// entry once per 32-head group and computes logits and `P . V` in register tiles. A
    /// query's output depends only on its query and keys, never on the step's size or the
    /// thread count (queries are split between threads; a lone query's heads at most one
    /// thread per 32-head group, which the kernel keeps bit-identical to one thread), so
    /// decoding token by token reproduces a prefill bit for bit, as on the general path.
    fn attend_tiled<'a>(
        &self,
        layer: usize,
        q: &[f32],
        positions: &[u64],
        keys: &KeySource<'a, '_>,
        sinks: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error> {
        let d = &self.dims;
        let qw = d.q_width();
        let size = |what: String, len: usize, want: usize| Error::State {
            layer,
            reason: format!("{what} has {len} bytes, not {want}"),
        };
        // The store's rows are resolved on this thread (its accessors need not be `Sync`);
        // the kernel calls may then run anywhere.
        let resolve = |i: usize, t: u64| -> Result<QueryRows<'a>, Error> {
            let mut r = QueryRows {
                window: Vec::with_capacity(d.window),
                entries: Vec::new(),
            };
            for p in keys.sel.window_positions(t) {
                let bytes = keys.window_row(p, t)?;
                let row = WindowFp8Entry::ref_from_bytes(bytes).map_err(|_| {
                    size(
                        format!("window row of position {p}"),
                        bytes.len(),
                        WindowFp8Entry::BYTES,
                    )
                })?;
                r.window.push(std::slice::from_ref(row));
            }
            for j in keys.sel.selected(i)? {
                let bytes = keys.entry_row(j, t)?;
                let e = GlobalFp4Entry::ref_from_bytes(bytes).map_err(|_| {
                    size(
                        format!("compressed entry {j}"),
                        bytes.len(),
                        GlobalFp4Entry::BYTES,
                    )
                })?;
                r.entries.push(std::slice::from_ref(e));
            }
            Ok(r)
        };
        let rows = positions
            .iter()
            .enumerate()
            .map(|(i, &t)| resolve(i, t))
            .collect::<Result<Vec<_>, _>>()?;
        let query = |i: usize, threads: usize, o: &mut [f32]| -> Result<(), Error> {
            let r = &rows[i];
            let selected: Vec<i32> = (0..r.entries.len() as i32).collect();
            let input = fast::SparseAttnInput {
                q: q[i * qw..(i + 1) * qw].as_chunks::<{ fast::HEAD_DIM }>().0,
                sinks: Some(sinks),
                window: &r.window,
                global: fast::Paged::pages(&r.entries, 1)
                    .map_err(Error::kernel(layer, "sparse attention"))?,
                selected: &selected,
            };
            fast::sparse_attention_decode(
                &input,
                threads,
                o.as_chunks_mut::<{ fast::HEAD_DIM }>().0,
            )
            .map_err(Error::kernel(layer, "sparse attention"))
        };
        let n = positions.len();
        // At least 8 queries per thread: fewer do not pay for the hand-off.
        let threads = self.threads.min(n / 8).max(1);
        if threads == 1 {
            // One query at a time, each on up to one thread per 32-head group.
            let per_query = self.threads.min(d.heads.div_ceil(32)).max(1);
            for (i, o) in out.chunks_exact_mut(qw).enumerate() {
                query(i, per_query, o)?;
            }
            return Ok(());
        }
        let per = n.div_ceil(threads);
        let results = crate::threads::on_threads(out, per * qw, |c, part| {
            for (k, o) in part.chunks_exact_mut(qw).enumerate() {
                query(c * per + k, 1, o)?;
            }
            Ok(())
        });
        joined(layer, "an attention", results)
    }

    /// Inverse RoPE on `attended` (`[n, heads · head_dim]`, rotated in place: taken by value
    /// so a prefill step does not copy it) at `positions`, then the grouped output
    /// projection; `[n, hidden]`.
    pub fn output(
        &self,
        layer: usize,
        mut attended: Vec<f32>,
        positions: &[u64],
    ) -> Result<Vec<f32>, Error> {
        let (_, w, rope) = self.spec(layer)?;
        let d = &self.dims;
        let n = positions.len();
        check_input(
            layer,
            "attended [n, heads * head_dim]",
            n * d.q_width(),
            attended.len(),
        )?;
        rope.rotate_rows(&mut attended, d.q_width(), d.head_dim, positions, true)
            .map_err(Error::kernel(layer, "inverse rope"))?;
        let mut out = vec![0f32; n * d.hidden];
        self.grouped_output(n, &attended, &w.wo_a, &w.wo_b, &mut out)
            .map_err(Error::kernel(layer, "wo_a/wo_b"))?;
        Ok(out)
    }

    /// One layer over one step: `x` is `[n, hidden]` for the `n = step.tokens()` tokens at
    /// positions `store.len() ..`. Writes the layer's new rows to `store` (the caller commits
    /// after the last layer), updates `step` as the plan says, and returns `[n, hidden]`.
    /// With `trace`, every intermediate is recorded there.
    pub fn forward(
        &self,
        layer: usize,
        store: &mut dyn KvStore,
        step: &mut StepState,
        x: &[f32],
        trace: Option<&mut LayerTrace>,
    ) -> Result<Vec<f32>, Error> {
        self.forward_from(layer, store, step, x, trace, 0)
    }

    /// The compressor step of KV source `layer` over the step's input `x` (positions
    /// `store.step_start() ..`): checks that the store's compressor state ends where the step
    /// starts, pushes the completed entries and index keys, and replaces the pending state.
    /// In a bounded replay (spec §7) the groups of the replayed tokens are recomputed (the
    /// compressor needs them to reach the new tokens' groups) but only entries past those the
    /// store holds are pushed: replay never overwrites cached global KV.
    pub fn compress_step(
        &self,
        layer: usize,
        store: &mut dyn KvStore,
        x: &[f32],
    ) -> Result<Compressed, Error> {
        let (kv, gate) = self.compressor_projections(layer, x)?;
        self.compress_step_projected(layer, store, &kv, gate.as_deref())
    }

    /// [`Csa2Attention::compress_step`] from the compressor's projections of the step's rows
    /// ([`Csa2Attention::compressor_projections`]).
    pub fn compress_step_projected(
        &self,
        layer: usize,
        store: &mut dyn KvStore,
        kv: &[f32],
        gate: Option<&[f32]>,
    ) -> Result<Compressed, Error> {
        let (spec, _, _) = self.spec(layer)?;
        let r = u64::from(spec.compress_ratio.max(1));
        let (p0, len) = (store.step_start(), store.len());
        let held = store.compressed_len(layer);
        let pending_tokens = (store.pending(layer).len() / (2 * self.dims.head_dim)) as u64;
        if held * r + pending_tokens != len {
            return Err(Error::State {
                layer,
                reason: format!(
                    "compressor state ({held} entries + {pending_tokens} pending tokens at ratio {r}) does not end at position {len}"
                ),
            });
        }
        let c = if p0 == len {
            self.compress_projected(layer, kv, gate, store.pending(layer), held)?
        } else {
            if !p0.is_multiple_of(r) || p0 > len {
                return Err(Error::State {
                    layer,
                    reason: format!(
                        "a replay from position {p0} (of {len}) does not start a compress group of {r} tokens"
                    ),
                });
            }
            self.compress_projected(layer, kv, gate, &[], p0 / r)?
        };
        let skip = usize::try_from(held.saturating_sub(c.first)).unwrap_or(usize::MAX);
        let (eb, kb) = (
            self.entry_codec.bytes(),
            self.key_codec.map_or(0, |k| k.bytes()),
        );
        let rows = c.rows.get(skip * eb..).unwrap_or_default();
        let keys = c.key_rows.get(skip * kb..).unwrap_or_default();
        store.push_compressed(layer, rows, keys)?;
        store.set_pending(layer, &c.pending)?;
        Ok(c)
    }

    /// [`Csa2Attention::forward`] with the window truncated at `window_start`: query `t`
    /// attends the window rows `[max(window_start, t - window + 1), t]` only (spec §3 CED
    /// prefill and §7 bounded replay: window rows before the replayed segment do not exist).
    pub fn forward_from(
        &self,
        layer: usize,
        store: &mut dyn KvStore,
        step: &mut StepState,
        x: &[f32],
        mut trace: Option<&mut LayerTrace>,
        window_start: u64,
    ) -> Result<Vec<f32>, Error> {
        let d = &self.dims;
        let n = step.tokens();
        check_input(layer, "attention input [n, hidden]", n * d.hidden, x.len())?;
        let p0 = store.step_start();
        let positions: Vec<u64> = (p0..p0 + n as u64).collect();
        let proj = self.project(layer, x, &positions)?;
        let attended =
            self.attend_projected(layer, store, step, proj, trace.as_deref_mut(), window_start)?;
        let out = self.output(layer, attended, &positions)?;
        if let Some(tr) = trace {
            tr.output = out.clone();
        }
        Ok(out)
    }

    /// The per-row projections of `layer` over `x` (`[n, hidden]`, the rows at `positions`,
    /// of one or several sequences): the query latent and query, the window KV, an index
    /// source's index queries and head weights, a KV source's compressor projections; one
    /// product per weight over all rows.
    pub fn project(
        &self,
        layer: usize,
        x: &[f32],
        positions: &[u64],
    ) -> Result<Projections, Error> {
        let (spec, _, _) = self.spec(layer)?;
        let spec = *spec;
        let d = &self.dims;
        check_input(
            layer,
            "attention input [n, hidden]",
            positions.len() * d.hidden,
            x.len(),
        )?;
        let query_latent = self.query_latent(layer, x)?;
        let query = self.query(layer, &query_latent, positions)?;
        let (window_pre_quant, window_rows) = self.window_kv(layer, x, positions)?;
        let mut p = Projections {
            positions: positions.to_vec(),
            query_latent,
            query,
            window_pre_quant,
            window_rows,
            ..Projections::default()
        };
        if spec.mode == LayerMode::Full {
            let (kv, gate) = self.compressor_projections(layer, x)?;
            p.compressor_kv = kv;
            p.compressor_gate = gate;
        }
        if spec.compress_ratio > 0 && spec.index_source == Some(layer) {
            let (iq_pre, iq_rows) = self.index_queries(layer, &p.query_latent, positions)?;
            p.index_queries_pre_quant = iq_pre;
            p.index_query_rows = iq_rows;
            p.index_weights = self.index_weights(layer, x)?;
        }
        Ok(p)
    }

    /// One sequence's part of [`Csa2Attention::forward_from`] after the projections: from its
    /// rows of [`Csa2Attention::project`] (positions `store.step_start() ..`), the compressor
    /// step, the indexer's selection and the sparse attention; pushes the window rows and
    /// returns the attended rows `[n, heads · head_dim]` before the inverse RoPE, which
    /// [`Csa2Attention::output`] takes (over one sequence's rows or a batch's). With `trace`,
    /// every intermediate but the output is recorded there.
    pub fn attend_projected(
        &self,
        layer: usize,
        store: &mut dyn KvStore,
        step: &mut StepState,
        proj: Projections,
        trace: Option<&mut LayerTrace>,
        window_start: u64,
    ) -> Result<Vec<f32>, Error> {
        let (spec, _, _) = self.spec(layer)?;
        let spec = *spec;
        let d = &self.dims;
        let n = step.tokens();
        let p0 = store.step_start();
        let window_start = window_start.max(store.window_floor());
        let Projections {
            positions,
            query_latent: ql,
            query: q,
            window_pre_quant: wpre,
            window_rows: wrows,
            index_queries_pre_quant: iq_pre,
            index_query_rows: iq_rows,
            index_weights: iw,
            compressor_kv,
            compressor_gate,
        } = proj;
        if positions.len() != n || positions.iter().zip(p0..).any(|(&p, want)| p != want) {
            return Err(Error::State {
                layer,
                reason: format!(
                    "projections of {} rows from position {:?}, the step is {n} tokens from {p0}",
                    positions.len(),
                    positions.first()
                ),
            });
        }
        check_input(
            layer,
            "query [n, heads * head_dim]",
            n * d.q_width(),
            q.len(),
        )?;
        check_input(
            layer,
            "window rows",
            n * self.window_codec.bytes(),
            wrows.len(),
        )?;

        let mut compressed = None;
        if spec.mode == LayerMode::Full {
            compressed = Some(self.compress_step_projected(
                layer,
                store,
                &compressor_kv,
                compressor_gate.as_deref(),
            )?);
            // spec §4: a Full layer starts a new selection state; only the candidate source
            // publishes candidates (below).
            step.candidates = None;
        }

        let mut t = LayerTrace::default();
        let src = spec.kv_source.unwrap_or(layer);
        if spec.compress_ratio > 0 && spec.index_source == Some(layer) {
            check_input(
                layer,
                "index weights [n, index_heads]",
                n * d.index_heads,
                iw.len(),
            )?;
            let width = usize::try_from(store.compressed_len(src)).unwrap_or(usize::MAX);
            let runs = store.index_key_runs(src);
            // Serving a Reindex layer that uses the step's candidate pools: only the pool
            // positions can be selected (the rest are masked to -inf), so only they are
            // scored. A traced step scores every key, as the reference records them.
            let pooled = match &step.candidates {
                Some(c) if trace.is_none() && spec.uses_candidates && !spec.is_candidate_source => {
                    self.select_in_pools(
                        layer,
                        spec.compress_ratio,
                        &iq_rows,
                        &iw,
                        &positions,
                        width,
                        &runs,
                        &c.rows,
                    )?
                }
                _ => None,
            };
            if let Some(rows) = pooled {
                step.topk = Some(TopK {
                    source: layer,
                    k: d.index_topk,
                    rows,
                });
            } else {
                let mut scores =
                    self.index_scores_in_runs(layer, &iq_rows, &iw, &positions, width, &runs)?;
                if spec.is_candidate_source {
                    let (pools, bs) = self.candidate_pools(layer, &scores, &positions)?;
                    t.candidate_block_scores = bs;
                    step.candidates = Some(Candidates {
                        source: layer,
                        rows: pools,
                    });
                }
                let unmasked = if spec.uses_candidates {
                    match &step.candidates {
                        Some(c) => {
                            let raw = scores.clone();
                            for (i, pool) in c.rows.iter().enumerate().take(n) {
                                mask_to_candidates(&mut scores[i * width..(i + 1) * width], pool);
                            }
                            t.scores_after_candidates = Some(scores.clone());
                            Some(raw)
                        }
                        None => {
                            log::debug!(
                                "layer {layer}: no candidate pool in this step (reset by a Full layer); scoring all entries"
                            );
                            None
                        }
                    }
                } else {
                    None
                };
                let rows = self.select(layer, &scores, n)?;
                step.topk = Some(TopK {
                    source: layer,
                    k: d.index_topk,
                    rows,
                });
                t.index_scores = unmasked.unwrap_or(scores);
            }
            t.index_queries_pre_quant = iq_pre;
            t.index_query_rows = iq_rows;
            t.index_weights = iw;
            t.visible = positions
                .iter()
                .map(|&p| Self::visible(spec.compress_ratio, p).min(width as u64))
                .collect();
            t.score_width = width;
        }

        let topk = if spec.compress_ratio > 0 {
            let tk = step.topk.as_ref().ok_or_else(|| Error::State {
                layer,
                reason: format!(
                    "{} layer found no top-k in this step (index source {:?} did not run)",
                    spec.mode, spec.index_source
                ),
            })?;
            if Some(tk.source) != spec.index_source {
                return Err(Error::State {
                    layer,
                    reason: format!(
                        "top-k comes from layer {}, the plan says {:?}",
                        tk.source, spec.index_source
                    ),
                });
            }
            Some(tk)
        } else {
            None
        };
        let wb = self.window_codec.bytes();
        let store_ref: &dyn KvStore = store;
        let window = |p: u64| {
            if p >= p0 {
                let i = (p - p0) as usize;
                wrows.get(i * wb..(i + 1) * wb)
            } else {
                store_ref.window_row(layer, p)
            }
        };
        let entry = |j: u64| store_ref.compressed_row(src, j);
        let attended =
            self.attend_from(layer, &q, &positions, &window, &entry, topk, window_start)?;
        if let Some(tr) = trace {
            t.topk = topk.map(|tk| tk.rows.clone()).unwrap_or_default();
            t.positions = positions;
            t.query_latent = ql;
            t.query = q;
            t.window_pre_quant = wpre;
            t.compressed = compressed;
            t.attended = attended.clone();
            t.window_rows = wrows.clone();
            *tr = t;
        }
        store.push_window(layer, p0, &wrows)?;
        Ok(attended)
    }
}

/// Index query `i` of a step's rows (32 MXFP4 heads each) and weights (32 each), prepared for
/// the integer scan.
fn fast_query(
    layer: usize,
    q_rows: &[u8],
    weights: &[f32],
    i: usize,
) -> Result<fast::IndexQuery, Error> {
    let (heads, qb) = (
        fast::INDEX_HEADS,
        fast::INDEX_HEADS * IndexMxfp4Entry::BYTES,
    );
    let hq = q_rows
        .get(i * qb..(i + 1) * qb)
        .and_then(|b| <[IndexMxfp4Entry]>::ref_from_bytes(b).ok())
        .and_then(|h| <&[IndexMxfp4Entry; fast::INDEX_HEADS]>::try_from(h).ok());
    let hw = weights
        .get(i * heads..(i + 1) * heads)
        .and_then(|w| <&[f32; fast::INDEX_HEADS]>::try_from(w).ok());
    match (hq, hw) {
        (Some(hq), Some(hw)) => Ok(fast::IndexQuery::new(hq, hw)),
        _ => Err(Error::State {
            layer,
            reason: format!("index query {i} is not 32 MXFP4 heads with 32 weights"),
        }),
    }
}

/// Where the index keys of a scan come from.
#[derive(Clone, Copy)]
enum IndexKeys<'k, 'f> {
    /// One row per call, from any store.
    Rows(&'f dyn Fn(u64) -> Option<&'k [u8]>),
    /// Byte runs in position order ([`KvStore::index_key_runs`]).
    Runs(&'f [&'k [u8]]),
}

/// The first `width` index keys as equal pages for the integer scan. Runs of one page length
/// are read in place (a paged store's full pages); from the first run of another length on (a
/// partly filled last page, the keys this step pushed) the keys are copied and cut into pages
/// of that length, so only a page or so and the step's own keys are copied. Keys given row by
/// row are all copied.
struct KeyPages<'k> {
    in_place: Vec<&'k [IndexMxfp4Entry]>,
    copied: Vec<IndexMxfp4Entry>,
    /// Keys per page.
    page: usize,
}

impl<'k> KeyPages<'k> {
    fn new(layer: usize, keys: &IndexKeys<'k, '_>, width: usize) -> Result<Self, Error> {
        let missing = |j: usize| Error::State {
            layer,
            reason: format!("index key {j} missing from the store"),
        };
        let mut kp = KeyPages {
            in_place: Vec::new(),
            copied: Vec::new(),
            page: width.max(1),
        };
        match keys {
            IndexKeys::Rows(key) => {
                kp.copied.reserve(width);
                for j in 0..width {
                    let k = key(j as u64)
                        .and_then(|b| IndexMxfp4Entry::read_from_bytes(b).ok())
                        .ok_or_else(|| missing(j))?;
                    kp.copied.push(k);
                }
            }
            IndexKeys::Runs(runs) => {
                let mut have = 0usize;
                for r in runs.iter() {
                    if have >= width {
                        break;
                    }
                    let entries =
                        <[IndexMxfp4Entry]>::ref_from_bytes(r).map_err(|_| Error::State {
                            layer,
                            reason: format!(
                                "a run of index keys is {} bytes, not whole {}-byte keys",
                                r.len(),
                                IndexMxfp4Entry::BYTES
                            ),
                        })?;
                    let entries = entries.get(..width - have).unwrap_or(entries);
                    if kp.in_place.is_empty() && kp.copied.is_empty() {
                        kp.page = entries.len().max(1);
                    }
                    if kp.copied.is_empty() && entries.len() == kp.page {
                        kp.in_place.push(entries);
                    } else {
                        kp.copied.extend_from_slice(entries);
                    }
                    have += entries.len();
                }
                if have < width {
                    return Err(missing(have));
                }
            }
        }
        Ok(kp)
    }

    /// The pages: every one `page` keys long but the last.
    fn pages(&self) -> Vec<&[IndexMxfp4Entry]> {
        self.in_place
            .iter()
            .copied()
            .chain(self.copied.chunks(self.page))
            .collect()
    }
}
