//! Every tensor of a V4.1 model, by name, in either naming: linear weights packed for the
//! kernels in their stored formats (`kvstack_kernels::linear`), the rest as f32.
//!
//! | what | released naming | NeMo naming |
//! |---|---|---|
//! | embedding `[vocab, hidden]` | `embed.weight` | `model.embed_tokens.weight` |
//! | LM head `[vocab, hidden]` | `head.weight` | `lm_head.weight` |
//! | final norm | `norm.weight` | `model.norm.weight` |
//! | block norms | `layers.{l}.{attn,ffn}_norm.weight` | `model.layers.{l}.{attn,ffn}_norm.weight` |
//! | attention | `layers.{l}.attn.*`, sink `attn_sink` | `model.layers.{l}.attn.*`, sink `sinks_param.weight` |
//! | HC sites `fn [n(2+n), n·hidden]`, `base`, `scale [3]` | `layers.{l}.hc_{attn,ffn}_{fn,base,scale}` | `model.layers.{l}.{attn,ffn}_hc.{fn,base,scale}` |
//! | router `[experts, hidden]`, correction bias | `layers.{l}.ffn.gate.{weight,bias}` | `...ffn.gate.{weight,e_score_correction_bias}` |
//! | routed experts | `layers.{l}.ffn.experts.{e}.w{1,3}.weight [inter, hidden]`, `w2 [hidden, inter]` | `...ffn.experts.gate_and_up_projs [E, hidden, 2 inter]` (x @ G: gate, then up), `down_projs [E, inter, hidden]` |
//! | shared expert | `layers.{l}.ffn.shared_experts.w{1,2,3}.weight` | `...shared_experts.{gate,down,up}_proj.weight` |
//!
//! Every tensor may be stored as F32, BF16, FP8 E4M3 with block scales, or packed FP4 with
//! scales (spec §9): linear weights are read as stored ([`TensorSource::load_stored`]) and
//! packed once, the rest dequantized ([`super::load_f32`]).

use crate::attention::{AttentionDims, AttentionWeights, LayerWeights};
use crate::weights::TensorFile;
use kvstack_spec::plan::{LayerPlan, LayerSpec};

use crate::Error;
use crate::dims::ModelDims;
use crate::storage::{StoredMatrix, WeightPrecision, load_f32, load_stored};
use kvstack_kernels::linear::PackedLinear;

/// Loads linear weight `name` (`[n, k]`) as stored and packs it for the kernels at
/// `precision`, split into `groups` equal row blocks (1: the whole matrix; `o_groups` for the
/// grouped `wo_a`). Errors name the tensor.
pub(crate) fn load_linear(
    file: &dyn TensorSource,
    name: &str,
    shape: &[usize],
    precision: WeightPrecision,
    groups: usize,
) -> Result<Vec<PackedLinear>, Error> {
    let m = file.load_stored(name, shape)?;
    let bad = |reason: String| Error::Storage {
        path: file.describe(),
        name: name.to_owned(),
        reason,
    };
    let rows = m.shape().0;
    if groups == 0 || !rows.is_multiple_of(groups) {
        return Err(bad(format!(
            "{rows} rows do not split into {groups} groups"
        )));
    }
    let per = rows / groups;
    (0..groups)
        .map(|g| {
            let part = if groups == 1 {
                m.clone()
            } else {
                m.rows(g * per..(g + 1) * per).map_err(bad)?
            };
            part.pack(precision).map_err(bad)
        })
        .collect()
}

/// [`load_linear`] of one whole matrix.
fn linear(
    file: &dyn TensorSource,
    name: &str,
    shape: &[usize],
    precision: WeightPrecision,
) -> Result<PackedLinear, Error> {
    let mut v = load_linear(file, name, shape, precision, 1)?;
    v.pop().ok_or_else(|| Error::Storage {
        path: file.describe(),
        name: name.to_owned(),
        reason: "no matrix".into(),
    })
}

/// Where [`ModelWeights::load_from`] gets tensors: a checkpoint file, or a generator
/// ([`super::init`]).
pub trait TensorSource {
    /// Whether a tensor named `name` exists (used to detect the naming).
    fn contains(&self, name: &str) -> bool;
    /// Tensor `name` of the logical `shape`, as f32.
    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error>;
    /// Tensor `name` of the logical `shape` as stored (what linear weights are packed from).
    /// The default reads it as f32.
    fn load_stored(&self, name: &str, shape: &[usize]) -> Result<StoredMatrix, Error> {
        let values = self.load(name, shape)?;
        let (rows, cols) = match shape {
            [r, c] => (*r, *c),
            _ => (1, values.len()),
        };
        Ok(StoredMatrix::F32 { values, rows, cols })
    }
    /// A description for errors (a path).
    fn describe(&self) -> std::path::PathBuf;
}

impl TensorSource for TensorFile {
    fn contains(&self, name: &str) -> bool {
        TensorFile::contains(self, name)
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
        load_f32(self, name, shape)
    }

    fn load_stored(&self, name: &str, shape: &[usize]) -> Result<StoredMatrix, Error> {
        load_stored(self, name, shape)
    }

    fn describe(&self) -> std::path::PathBuf {
        self.path().to_path_buf()
    }
}

/// Which tensor naming a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// The released checkpoint (`embed.weight`, `layers.{l}...`).
    Released,
    /// The NeMo reference (`model.embed_tokens.weight`, `model.layers.{l}...`).
    Nemo,
}

impl Naming {
    /// Detects the naming from the embedding's name.
    pub fn detect(file: &dyn TensorSource) -> Result<Naming, Error> {
        if file.contains("embed.weight") {
            Ok(Naming::Released)
        } else if file.contains("model.embed_tokens.weight") {
            Ok(Naming::Nemo)
        } else {
            Err(Error::Storage {
                path: file.describe(),
                name: "embed.weight".into(),
                reason:
                    "missing (and so is `model.embed_tokens.weight`): not a V4.1 checkpoint in \
                         the released or the NeMo naming"
                        .into(),
            })
        }
    }

    fn layer(self, l: usize) -> String {
        match self {
            Naming::Released => format!("layers.{l}."),
            Naming::Nemo => format!("model.layers.{l}."),
        }
    }
}

/// One hyper-connection site.
#[derive(Clone, Debug, PartialEq)]
pub struct HcWeights {
    /// `fn` `[n (2 + n), n · hidden]` (packed as stored).
    pub proj: PackedLinear,
    /// `base` `[n (2 + n)]`.
    pub base: Vec<f32>,
    /// `scale` `[3]`.
    pub scale: Vec<f32>,
}

/// One SwiGLU expert (`nn.Linear` layout, in the stored formats).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertWeights {
    /// Gate `[inter, hidden]`.
    pub w1: PackedLinear,
    /// Down `[hidden, inter]`.
    pub w2: PackedLinear,
    /// Up `[inter, hidden]`.
    pub w3: PackedLinear,
}

/// The non-attention weights of one block.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockWeights {
    /// `attn_norm` `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `ffn_norm` `[hidden]`.
    pub ffn_norm: Vec<f32>,
    /// HC site before attention.
    pub attn_hc: HcWeights,
    /// HC site before the MoE.
    pub ffn_hc: HcWeights,
    /// Router `[experts, hidden]`.
    pub gate: PackedLinear,
    /// Selection-only correction bias `[experts]`.
    pub gate_bias: Vec<f32>,
    /// Routed experts.
    pub experts: Vec<ExpertWeights>,
    /// The shared expert (`inter · n_shared_experts` wide).
    pub shared: ExpertWeights,
}

/// Every tensor of the model: linear weights packed in their stored formats (or f32, see
/// [`WeightPrecision`]), the rest f32.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelWeights {
    /// The naming the file used.
    pub naming: Naming,
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    /// `[vocab, hidden]`.
    pub head: PackedLinear,
    /// Final norm `[hidden]`.
    pub norm: Vec<f32>,
    /// Attention of every layer.
    pub attention: AttentionWeights,
    /// The rest of every block.
    pub blocks: Vec<BlockWeights>,
}

fn attention_layer(
    file: &dyn TensorSource,
    naming: Naming,
    d: &AttentionDims,
    spec: &LayerSpec,
    precision: WeightPrecision,
) -> Result<LayerWeights, Error> {
    let l = spec.index;
    let p = format!("{}attn.", naming.layer(l));
    let w = |param: &str, shape: &[usize]| file.load(&format!("{p}{param}"), shape);
    let lin = |param: &str, shape: &[usize], groups: usize| {
        load_linear(file, &format!("{p}{param}"), shape, precision, groups)
    };
    let sink = match naming {
        Naming::Released => "attn_sink",
        Naming::Nemo => "sinks_param.weight",
    };
    LayerWeights::from_loader(d, spec, sink, w, lin)
}

fn block(
    file: &dyn TensorSource,
    naming: Naming,
    md: &ModelDims,
    l: usize,
    precision: WeightPrecision,
) -> Result<BlockWeights, Error> {
    let p = naming.layer(l);
    let (h, i, e_n) = (md.hidden, md.inter, md.experts);
    let si = md.inter * md.shared;
    let w = |param: &str, shape: &[usize]| file.load(&format!("{p}{param}"), shape);
    let lin = |param: &str, shape: &[usize]| linear(file, &format!("{p}{param}"), shape, precision);
    let pack = |v: &[f32], n: usize, k: usize| {
        PackedLinear::from_f32(v, n, k).map_err(|e| Error::Storage {
            path: file.describe(),
            name: format!("{p}ffn.experts"),
            reason: e.to_string(),
        })
    };
    let (c, width) = (md.hc_coeffs(), md.hc_mult * h);
    let site = |site: &str| -> Result<HcWeights, Error> {
        let n = |part: &str| match naming {
            Naming::Released => format!("hc_{site}_{part}"),
            Naming::Nemo => format!("{site}_hc.{part}"),
        };
        Ok(HcWeights {
            proj: lin(&n("fn"), &[c, width])?,
            base: w(&n("base"), &[c])?,
            scale: w(&n("scale"), &[3])?,
        })
    };
    let (experts, shared) = match naming {
        Naming::Released => {
            let experts = (0..e_n)
                .map(|e| {
                    Ok(ExpertWeights {
                        w1: lin(&format!("ffn.experts.{e}.w1.weight"), &[i, h])?,
                        w2: lin(&format!("ffn.experts.{e}.w2.weight"), &[h, i])?,
                        w3: lin(&format!("ffn.experts.{e}.w3.weight"), &[i, h])?,
                    })
                })
                .collect::<Result<Vec<_>, Error>>()?;
            let shared = ExpertWeights {
                w1: lin("ffn.shared_experts.w1.weight", &[si, h])?,
                w2: lin("ffn.shared_experts.w2.weight", &[h, si])?,
                w3: lin("ffn.shared_experts.w3.weight", &[si, h])?,
            };
            (experts, shared)
        }
        Naming::Nemo => {
            // Re-layout: G[e] is [hidden, 2 inter] applied as x @ G (gate columns, then up);
            // D[e] is [inter, hidden] applied as h @ D. nn.Linear layout is the transpose.
            let gu = w("ffn.experts.gate_and_up_projs", &[e_n, h, 2 * i])?;
            let down = w("ffn.experts.down_projs", &[e_n, i, h])?;
            let experts = (0..e_n)
                .map(|e| {
                    let g = &gu[e * h * 2 * i..(e + 1) * h * 2 * i];
                    let d = &down[e * i * h..(e + 1) * i * h];
                    let mut w1 = vec![0f32; i * h];
                    let mut w3 = vec![0f32; i * h];
                    let mut w2 = vec![0f32; h * i];
                    for k in 0..h {
                        for j in 0..i {
                            w1[j * h + k] = g[k * 2 * i + j];
                            w3[j * h + k] = g[k * 2 * i + i + j];
                        }
                    }
                    for j in 0..i {
                        for k in 0..h {
                            w2[k * i + j] = d[j * h + k];
                        }
                    }
                    Ok(ExpertWeights {
                        w1: pack(&w1, i, h)?,
                        w2: pack(&w2, h, i)?,
                        w3: pack(&w3, i, h)?,
                    })
                })
                .collect::<Result<Vec<_>, Error>>()?;
            let shared = ExpertWeights {
                w1: lin("ffn.shared_experts.gate_proj.weight", &[si, h])?,
                w2: lin("ffn.shared_experts.down_proj.weight", &[h, si])?,
                w3: lin("ffn.shared_experts.up_proj.weight", &[si, h])?,
            };
            (experts, shared)
        }
    };
    Ok(BlockWeights {
        attn_norm: w("attn_norm.weight", &[h])?,
        ffn_norm: w("ffn_norm.weight", &[h])?,
        attn_hc: site("attn")?,
        ffn_hc: site("ffn")?,
        gate: lin("ffn.gate.weight", &[e_n, h])?,
        gate_bias: w(
            match naming {
                Naming::Released => "ffn.gate.bias",
                Naming::Nemo => "ffn.gate.e_score_correction_bias",
            },
            &[e_n],
        )?,
        experts,
        shared,
    })
}

impl ModelWeights {
    /// Loads every tensor (see the module documentation), shapes from the dimensions.
    pub fn load(
        file: &TensorFile,
        md: &ModelDims,
        ad: &AttentionDims,
        plan: &LayerPlan,
    ) -> Result<ModelWeights, Error> {
        Self::load_from(file, md, ad, plan)
    }

    /// [`ModelWeights::load`] from any [`TensorSource`], linear weights as stored.
    pub fn load_from(
        file: &dyn TensorSource,
        md: &ModelDims,
        ad: &AttentionDims,
        plan: &LayerPlan,
    ) -> Result<ModelWeights, Error> {
        Self::load_with(file, md, ad, plan, WeightPrecision::Stored)
    }

    /// [`ModelWeights::load_from`] with linear weights at `precision`.
    pub fn load_with(
        file: &dyn TensorSource,
        md: &ModelDims,
        ad: &AttentionDims,
        plan: &LayerPlan,
        precision: WeightPrecision,
    ) -> Result<ModelWeights, Error> {
        let naming = Naming::detect(file)?;
        let (v, h) = (md.vocab, md.hidden);
        let (embed, head, norm) = match naming {
            Naming::Released => ("embed.weight", "head.weight", "norm.weight"),
            Naming::Nemo => (
                "model.embed_tokens.weight",
                "lm_head.weight",
                "model.norm.weight",
            ),
        };
        let attention = AttentionWeights {
            layers: plan
                .layers
                .iter()
                .map(|s| attention_layer(file, naming, ad, s, precision))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let blocks = (0..md.layers)
            .map(|l| block(file, naming, md, l, precision))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ModelWeights {
            naming,
            embed: file.load(embed, &[v, h])?,
            head: linear(file, head, &[v, h], precision)?,
            norm: file.load(norm, &[h])?,
            attention,
            blocks,
        })
    }
}
