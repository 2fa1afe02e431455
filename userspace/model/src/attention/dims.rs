//! The attention dimensions of a model, from its config (spec §2, §4).

use kvstack_kernels::csa2::candidates::CandidateParams;
use kvstack_kernels::csa2::rope::{Rope, Yarn};

use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::{LayerPlan, LayerSpec};

use crate::Error;

/// Every dimension and constant the CSA2 attention layer needs. Derived from the config's
/// fields (`from_config`), so a model of another size (for example the 64-wide test model of
/// `shared/vectors/csa2`) works unchanged; the entry formats need `head_dim` to be a multiple
/// of 32 (FP8 tiles; FP4 tiles are 16) and `index_head_dim` a multiple of 32 (MXFP4 blocks).
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionDims {
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `head_dim`: query head width and the shared K = V latent width.
    pub head_dim: usize,
    /// `qk_rope_head_dim`: rotary dims, the LAST ones of every head (and index head).
    pub rope_dim: usize,
    /// `q_lora_rank`.
    pub q_lora_rank: usize,
    /// `o_groups`.
    pub o_groups: usize,
    /// `o_lora_rank`.
    pub o_lora_rank: usize,
    /// `sliding_window`: the window of query `t` is `[t - window + 1, t]`.
    pub window: usize,
    /// `index_n_heads` (0 when no layer has an indexer).
    pub index_heads: usize,
    /// `index_head_dim` (0 when no layer has an indexer).
    pub index_head_dim: usize,
    /// `index_topk` (0 when no layer has an indexer).
    pub index_topk: usize,
    /// The candidate pool (`candidate_block_size`, `candidate_topk_blocks`), when the plan has
    /// a candidate source.
    pub candidates: Option<CandidateParams>,
    /// `rms_norm_eps`.
    pub eps: f32,
    /// `rope_theta`: window-only layers.
    pub rope_theta: f64,
    /// `compress_rope_theta`: every rotation of layers with compression.
    pub compress_rope_theta: f64,
    /// `rope_scaling` of type `yarn`: applied with `compress_rope_theta` only.
    pub yarn: Option<Yarn>,
}

fn req<T: Copy>(cfg: &ModelConfig, v: Option<T>, field: &str) -> kvstack_spec::Result<T> {
    v.ok_or_else(|| cfg.missing(field))
}

fn usize_of(cfg: &ModelConfig, v: u64, field: &str) -> kvstack_spec::Result<usize> {
    usize::try_from(v).map_err(|_| cfg.invalid(field, "does not fit this machine's usize"))
}

fn positive(cfg: &ModelConfig, v: Option<u64>, field: &str) -> kvstack_spec::Result<usize> {
    match req(cfg, v, field)? {
        0 => Err(cfg.invalid(field, "must be at least 1")),
        x => usize_of(cfg, x, field),
    }
}

impl AttentionDims {
    /// Reads and checks the dimensions. Indexer and candidate fields are required only when
    /// the plan uses them; `compress_rope_theta` only when a layer has compression.
    pub fn from_config(cfg: &ModelConfig, plan: &LayerPlan) -> Result<AttentionDims, Error> {
        AttentionDims::read(cfg, plan).map_err(Error::AttentionConfig)
    }

    /// [`AttentionDims::from_config`] with the config errors unwrapped.
    fn read(cfg: &ModelConfig, plan: &LayerPlan) -> kvstack_spec::Result<AttentionDims> {
        let hidden = usize_of(cfg, cfg.hidden_size()?, "hidden_size")?;
        let heads = usize_of(cfg, cfg.num_attention_heads()?, "num_attention_heads")?;
        let head_dim = usize_of(cfg, cfg.head_dim()?, "head_dim")?;
        let rope_dim = usize_of(cfg, cfg.qk_rope_head_dim()?, "qk_rope_head_dim")?;
        let q_lora_rank = positive(cfg, cfg.q_lora_rank, "q_lora_rank")?;
        let o_groups = positive(cfg, cfg.o_groups, "o_groups")?;
        let o_lora_rank = positive(cfg, cfg.o_lora_rank, "o_lora_rank")?;
        let window = usize_of(cfg, cfg.sliding_window()?, "sliding_window")?;
        let eps = req(cfg, cfg.rms_norm_eps, "rms_norm_eps")?;
        let rope_theta = req(cfg, cfg.rope_theta, "rope_theta")?;

        if !head_dim.is_multiple_of(32) {
            return Err(cfg.invalid(
                "head_dim",
                format!("{head_dim} is not a multiple of 32 (FP8 window tiles, spec §5.1)"),
            ));
        }
        if rope_dim == 0 || !rope_dim.is_multiple_of(2) || rope_dim > head_dim {
            return Err(cfg.invalid(
                "qk_rope_head_dim",
                format!("{rope_dim} must be even, positive and at most head_dim {head_dim}"),
            ));
        }
        if !heads.is_multiple_of(o_groups) {
            return Err(cfg.invalid(
                "o_groups",
                format!("{o_groups} does not divide num_attention_heads {heads}"),
            ));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(cfg.invalid("rms_norm_eps", "must be a finite non-negative number"));
        }

        let compressed = plan.layers.iter().any(|l| l.compress_ratio > 0);
        let compress_rope_theta = if compressed {
            req(cfg, cfg.compress_rope_theta, "compress_rope_theta")?
        } else {
            cfg.compress_rope_theta.unwrap_or(rope_theta)
        };
        let yarn = match &cfg.rope_scaling {
            Some(rs) if rs.kind.as_deref() == Some("yarn") => Some(Yarn {
                factor: req(cfg, rs.factor, "rope_scaling.factor")?,
                original_max_position: req(
                    cfg,
                    rs.original_max_position_embeddings,
                    "rope_scaling.original_max_position_embeddings",
                )? as f64,
                // DeepSeek's defaults when a config leaves them out.
                beta_fast: rs.beta_fast.unwrap_or(32.0),
                beta_slow: rs.beta_slow.unwrap_or(1.0),
            }),
            _ => None,
        };

        let (index_heads, index_head_dim, index_topk) = if plan.has_indexer() {
            let ih = usize_of(cfg, cfg.index_n_heads()?, "index_n_heads")?;
            let id = usize_of(cfg, cfg.index_head_dim()?, "index_head_dim")?;
            let k = positive(cfg, cfg.index_topk, "index_topk")?;
            if !id.is_multiple_of(32) || id < rope_dim {
                return Err(cfg
                    .invalid(
                        "index_head_dim",
                        format!("{id} must be a multiple of 32 (MXFP4 blocks, spec §5.3) and at least qk_rope_head_dim {rope_dim}"),
                    )
                );
            }
            (ih, id, k)
        } else {
            (0, 0, 0)
        };
        let candidates = if plan.layers.iter().any(|l| l.is_candidate_source) {
            Some(CandidateParams {
                block: positive(cfg, cfg.candidate_block_size, "candidate_block_size")?,
                top_blocks: positive(cfg, cfg.candidate_topk_blocks, "candidate_topk_blocks")?,
            })
        } else {
            None
        };
        let dims = AttentionDims {
            hidden,
            heads,
            head_dim,
            rope_dim,
            q_lora_rank,
            o_groups,
            o_lora_rank,
            window,
            index_heads,
            index_head_dim,
            index_topk,
            candidates,
            eps: eps as f32,
            rope_theta,
            compress_rope_theta,
            yarn,
        };
        // Fail here, naming the fields, rather than at the first forward pass.
        for spec in &plan.layers {
            dims.rope(spec).map_err(|e| {
                cfg.invalid(
                    if spec.compress_ratio > 0 {
                        "compress_rope_theta"
                    } else {
                        "rope_theta"
                    },
                    e.to_string(),
                )
            })?;
        }
        Ok(dims)
    }

    /// The rotation of a layer (spec §4): `rope_theta` without YaRN for window-only layers,
    /// `compress_rope_theta` with YaRN (when configured) for every rotation of a layer with
    /// compression.
    pub fn rope(&self, spec: &LayerSpec) -> Result<Rope, kvstack_kernels::csa2::Error> {
        if spec.compress_ratio == 0 {
            Rope::new(self.rope_dim, self.rope_theta, None)
        } else {
            Rope::new(self.rope_dim, self.compress_rope_theta, self.yarn)
        }
    }

    /// Query width: `heads · head_dim`.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Indexer query width: `index_heads · index_head_dim`.
    pub fn index_q_width(&self) -> usize {
        self.index_heads * self.index_head_dim
    }

    /// Inputs of one output group: `heads / o_groups · head_dim`.
    pub fn group_width(&self) -> usize {
        self.heads / self.o_groups * self.head_dim
    }
}
