//! The attention weights of every layer, loaded from a safetensors file by name with their
//! shapes derived from the config (spec §4; `nn.Linear` layout `[out, in]`, `y = x Wᵀ`).
//!
//! Tensor names: `<prefix>layers.{l}.attn.<param>` where the prefix is empty (the reference
//! dump `attn_weights.safetensors`, and the released checkpoint naming) or `model.` (the NeMo
//! model naming); the sink is `sinks_param.weight` (NeMo) or `attn_sink` (released). Which
//! layer needs which tensor follows the plan:
//!
//! | tensors | layers |
//! |---|---|
//! | `wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`, `wo_a`, `wo_b`, sink | every layer |
//! | `compressor.wkv`, `compressor.norm` (+ `compressor.wgate` at ratio ≥ 2) | KV sources (Full) |
//! | `indexer.wq_b`, `indexer.weights_proj` | index sources (Full, Reindex) |
//! | `indexer.wk`, `indexer.k_norm` | index-key owners (Full) |
//!
//! Only f32 tensors are read; a released FP8 checkpoint must be dequantized first (its
//! `wq_b` would fail with a dtype error naming the tensor).

use crate::weights::TensorFile;
use kvstack_kernels::linear::PackedLinear;
use kvstack_spec::plan::{LayerMode, LayerPlan, LayerSpec};

use super::dims::AttentionDims;
use crate::Error;

/// The compressor of a KV source.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressorWeights {
    /// `compressor.wkv` `[head_dim, hidden]`.
    pub wkv: PackedLinear,
    /// `compressor.wgate` `[head_dim, hidden]` (ratio ≥ 2 only).
    pub wgate: Option<PackedLinear>,
    /// `compressor.norm` `[head_dim]`.
    pub norm: Vec<f32>,
}

/// The key side of an indexer (index-key owners only).
#[derive(Clone, Debug, PartialEq)]
pub struct IndexKeyWeights {
    /// `indexer.wk` `[index_head_dim, head_dim]`.
    pub wk: PackedLinear,
    /// `indexer.k_norm` `[index_head_dim]`.
    pub k_norm: Vec<f32>,
}

/// The indexer of an index source.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerWeights {
    /// `indexer.wq_b` `[index_heads · index_head_dim, q_lora_rank]`.
    pub wq_b: PackedLinear,
    /// `indexer.weights_proj` `[index_heads, hidden]`.
    pub weights_proj: PackedLinear,
    /// Key projection, for layers that own index keys.
    pub keys: Option<IndexKeyWeights>,
}

/// The weights of one attention layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `wq_a` `[q_lora_rank, hidden]`.
    pub wq_a: PackedLinear,
    /// `q_norm` `[q_lora_rank]`.
    pub q_norm: Vec<f32>,
    /// `wq_b` `[heads · head_dim, q_lora_rank]`.
    pub wq_b: PackedLinear,
    /// `wkv` `[head_dim, hidden]` (window KV).
    pub wkv: PackedLinear,
    /// `kv_norm` `[head_dim]`.
    pub kv_norm: Vec<f32>,
    /// `wo_a` `[o_groups · o_lora_rank, heads / o_groups · head_dim]`, one matrix per group
    /// (rows `g · o_lora_rank ..` of the stored tensor: group `g`'s `[o_lora_rank, heads /
    /// o_groups · head_dim]`).
    pub wo_a: Vec<PackedLinear>,
    /// `wo_b` `[hidden, o_groups · o_lora_rank]`.
    pub wo_b: PackedLinear,
    /// One sink logit per head `[heads]`.
    pub sinks: Vec<f32>,
    /// KV sources only.
    pub compressor: Option<CompressorWeights>,
    /// Index sources only.
    pub indexer: Option<IndexerWeights>,
}

/// How the tensors of a file are named.
#[derive(Clone, Debug)]
struct Names {
    prefix: &'static str,
}

impl Names {
    const PREFIXES: [&'static str; 2] = ["", "model."];

    fn detect(file: &TensorFile, plan: &LayerPlan) -> Names {
        let probe = plan.layers.first().map_or(0, |l| l.index);
        let prefix = Self::PREFIXES
            .into_iter()
            .find(|p| file.contains(&format!("{p}layers.{probe}.attn.wq_a.weight")))
            .unwrap_or("");
        Names { prefix }
    }

    fn name(&self, layer: usize, param: &str) -> String {
        format!("{}layers.{layer}.attn.{param}", self.prefix)
    }
}

fn load(file: &TensorFile, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
    file.f32(name, shape)
}

/// An f32 tensor of `file` packed as `groups` row blocks.
fn load_linear(
    file: &TensorFile,
    name: &str,
    shape: &[usize],
    groups: usize,
) -> Result<Vec<PackedLinear>, Error> {
    let v = load(file, name, shape)?;
    let (n, k) = match shape {
        [n, k] => (*n, *k),
        _ => (1, v.len()),
    };
    let per = n / groups.max(1);
    (0..groups.max(1))
        .map(|g| {
            PackedLinear::from_f32(&v[g * per * k..(g + 1) * per * k], per, k).map_err(|e| {
                Error::Storage {
                    path: file.path().to_path_buf(),
                    name: name.to_owned(),
                    reason: e.to_string(),
                }
            })
        })
        .collect()
}

impl LayerWeights {
    fn load(
        file: &TensorFile,
        names: &Names,
        dims: &AttentionDims,
        spec: &LayerSpec,
    ) -> Result<LayerWeights, Error> {
        let l = spec.index;
        // NeMo names the sink `sinks_param.weight`, the released checkpoint `attn_sink`.
        let sink = ["sinks_param.weight", "attn_sink"]
            .into_iter()
            .find(|p| file.contains(&names.name(l, p)))
            .unwrap_or("sinks_param.weight");
        LayerWeights::from_loader(
            dims,
            spec,
            sink,
            |param, shape| load(file, &names.name(l, param), shape),
            |param, shape, groups| load_linear(file, &names.name(l, param), shape, groups),
        )
    }

    /// Builds one layer's weights through `w(param, shape)` (f32 vectors) and `lin(param,
    /// shape, groups)` (linear weights, packed, split into `groups` row blocks), where `param`
    /// is relative to the layer's `attn.` prefix and `sink` is the sink tensor's param name.
    /// Shared by the f32 loader here and the model loader (which keeps the released storage
    /// types).
    pub(crate) fn from_loader<E>(
        d: &AttentionDims,
        spec: &LayerSpec,
        sink: &str,
        w: impl Fn(&str, &[usize]) -> Result<Vec<f32>, E>,
        lin: impl Fn(&str, &[usize], usize) -> Result<Vec<PackedLinear>, E>,
    ) -> Result<LayerWeights, E> {
        let l = spec.index;
        let one = |param: &str, shape: &[usize]| -> Result<PackedLinear, E> {
            let mut v = lin(param, shape, 1)?;
            // `lin` returns exactly `groups` matrices.
            Ok(v.swap_remove(0))
        };
        let compressor = if spec.mode == LayerMode::Full {
            Some(CompressorWeights {
                wkv: one("compressor.wkv.weight", &[d.head_dim, d.hidden])?,
                wgate: if spec.compress_ratio >= 2 {
                    Some(one("compressor.wgate.weight", &[d.head_dim, d.hidden])?)
                } else {
                    None
                },
                norm: w("compressor.norm.weight", &[d.head_dim])?,
            })
        } else {
            None
        };
        let indexer = if spec.compress_ratio > 0 && spec.index_source == Some(l) {
            Some(IndexerWeights {
                wq_b: one("indexer.wq_b.weight", &[d.index_q_width(), d.q_lora_rank])?,
                weights_proj: one("indexer.weights_proj.weight", &[d.index_heads, d.hidden])?,
                keys: if spec.owns_index_keys() {
                    Some(IndexKeyWeights {
                        wk: one("indexer.wk.weight", &[d.index_head_dim, d.head_dim])?,
                        k_norm: w("indexer.k_norm.weight", &[d.index_head_dim])?,
                    })
                } else {
                    None
                },
            })
        } else {
            None
        };
        Ok(LayerWeights {
            wq_a: one("wq_a.weight", &[d.q_lora_rank, d.hidden])?,
            q_norm: w("q_norm.weight", &[d.q_lora_rank])?,
            wq_b: one("wq_b.weight", &[d.q_width(), d.q_lora_rank])?,
            wkv: one("wkv.weight", &[d.head_dim, d.hidden])?,
            kv_norm: w("kv_norm.weight", &[d.head_dim])?,
            wo_a: lin(
                "wo_a.weight",
                &[d.o_groups * d.o_lora_rank, d.group_width()],
                d.o_groups,
            )?,
            wo_b: one("wo_b.weight", &[d.hidden, d.o_groups * d.o_lora_rank])?,
            sinks: w(sink, &[d.heads])?,
            compressor,
            indexer,
        })
    }
}

/// The attention weights of every planned layer.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionWeights {
    /// One entry per layer of the plan, in order.
    pub layers: Vec<LayerWeights>,
}

impl AttentionWeights {
    /// Loads every layer's tensors (see the module documentation for names and shapes).
    pub fn load(
        file: &TensorFile,
        dims: &AttentionDims,
        plan: &LayerPlan,
    ) -> Result<AttentionWeights, Error> {
        let names = Names::detect(file, plan);
        let layers = plan
            .layers
            .iter()
            .map(|spec| LayerWeights::load(file, &names, dims, spec))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AttentionWeights { layers })
    }
}
