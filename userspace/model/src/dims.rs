//! The non-attention dimensions of a V4.1 model (spec §2, §9), from its config.

use kvstack_kernels::model::{HcShape, MoeShape};

use kvstack_spec::config::ModelConfig;

use crate::Error;

/// Dimensions and constants of the embedding, hyper-connections, MoE and head. Attention has
/// its own ([`crate::attention::AttentionDims`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDims {
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `n_routed_experts`.
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `moe_intermediate_size`: one routed expert's FFN width.
    pub inter: usize,
    /// `n_shared_experts` (default 1): the shared expert is `inter · shared` wide.
    pub shared: usize,
    /// `routed_scaling_factor` (default 1).
    pub routed_scale: f32,
    /// `swiglu_limit` (default 10).
    pub swiglu_limit: f32,
    /// `hc_mult` (default 4).
    pub hc_mult: usize,
    /// `hc_sinkhorn_iters` (default 20).
    pub sinkhorn_iters: usize,
    /// `hc_eps` (default 1e-6).
    pub hc_eps: f32,
    /// `rms_norm_eps` (default 1e-20, the released value).
    pub eps: f32,
}

fn req(cfg: &ModelConfig, v: Option<u64>, field: &str) -> kvstack_spec::Result<usize> {
    match v {
        None => Err(cfg.missing(field)),
        Some(0) => Err(cfg.invalid(field, "must be at least 1")),
        Some(x) => {
            usize::try_from(x).map_err(|_| cfg.invalid(field, "does not fit this machine's usize"))
        }
    }
}

impl ModelDims {
    /// Reads and checks the dimensions. `scoring_func`, when given, must be `sqrtsoftplus`.
    pub fn from_config(cfg: &ModelConfig) -> Result<ModelDims, Error> {
        ModelDims::read(cfg).map_err(Error::ModelConfig)
    }

    /// [`ModelDims::from_config`] with the config errors unwrapped.
    fn read(cfg: &ModelConfig) -> kvstack_spec::Result<ModelDims> {
        if let Some(f) = &cfg.scoring_func
            && f != "sqrtsoftplus"
        {
            return Err(cfg.invalid(
                "scoring_func",
                format!("`{f}`: the V4.1 forward pass implements `sqrtsoftplus` only"),
            ));
        }
        let experts = req(cfg, cfg.n_routed_experts, "n_routed_experts")?;
        let top_k = req(cfg, cfg.num_experts_per_tok, "num_experts_per_tok")?;
        if top_k > experts {
            return Err(cfg.invalid(
                "num_experts_per_tok",
                format!("{top_k} exceeds n_routed_experts {experts}"),
            ));
        }
        let hidden = usize::try_from(cfg.hidden_size()?)
            .map_err(|_| cfg.invalid("hidden_size", "too large"))?;
        Ok(ModelDims {
            vocab: req(cfg, cfg.vocab_size, "vocab_size")?,
            hidden,
            layers: cfg.num_hidden_layers()?,
            experts,
            top_k,
            inter: req(cfg, cfg.moe_intermediate_size, "moe_intermediate_size")?,
            shared: match cfg.n_shared_experts {
                None => 1,
                Some(_) => req(cfg, cfg.n_shared_experts, "n_shared_experts")?,
            },
            routed_scale: cfg.routed_scaling_factor.unwrap_or(1.0) as f32,
            swiglu_limit: cfg.swiglu_limit.unwrap_or(10.0) as f32,
            hc_mult: match cfg.hc_mult {
                None => 4,
                Some(_) => req(cfg, cfg.hc_mult, "hc_mult")?,
            },
            sinkhorn_iters: match cfg.hc_sinkhorn_iters {
                None => 20,
                Some(_) => req(cfg, cfg.hc_sinkhorn_iters, "hc_sinkhorn_iters")?,
            },
            hc_eps: cfg.hc_eps.unwrap_or(1e-6) as f32,
            eps: cfg.rms_norm_eps.unwrap_or(1e-20) as f32,
        })
    }

    /// The hyper-connection shape.
    pub fn hc(&self) -> HcShape {
        HcShape {
            streams: self.hc_mult,
            hidden: self.hidden,
            sinkhorn_iters: self.sinkhorn_iters,
            eps: self.hc_eps,
            norm_eps: self.eps,
        }
    }

    /// The routed MoE shape.
    pub fn moe(&self) -> MoeShape {
        MoeShape {
            hidden: self.hidden,
            inter: self.inter,
            experts: self.experts,
            top_k: self.top_k,
            routed_scale: self.routed_scale,
            swiglu_limit: self.swiglu_limit,
        }
    }

    /// The shape of the shared expert (`inter · shared` wide).
    pub fn shared_moe(&self) -> MoeShape {
        MoeShape {
            inter: self.inter * self.shared,
            ..self.moe()
        }
    }

    /// HC coefficients per site: `n (2 + n)`.
    pub fn hc_coeffs(&self) -> usize {
        self.hc_mult * (2 + self.hc_mult)
    }
}
