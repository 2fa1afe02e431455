//! Model configuration: the fields of a Hugging Face `config.json` that the layer plan and the
//! cache arithmetic need, and the attention [`Generation`] a config belongs to.
//!
//! Two shapes of file are accepted:
//! - flat: the text model's fields at the top level (every file in `shared/spec/configs`,
//!   `shared/vectors/csa2/config.json`);
//! - nested: a multimodal wrapper with the text model under `text_config`
//!   (`shared/vectors/csa2/model_config.json`). The nested object is then the config; the
//!   wrapper's own fields (its `model_type`, `dtype`, `vision_config`, ...) never shadow it. The
//!   wrapper's `model_type` is kept in [`ModelConfig::wrapper_model_type`] and used for
//!   generation detection only when the text model has none.
//!
//! Every field is an `Option` (absent and JSON `null` both read as `None`); unknown fields are
//! ignored. Typed accessors of the same name return the value or [`Error::MissingField`], naming
//! the field as written in the file (`text_config.head_dim` for nested files).
//!
//! # `compress_ratios` and speculative layers
//! `compress_ratios` may hold more entries than `num_hidden_layers`: the released configs append
//! one entry per speculative (MTP / "DSpark" / nextn) layer. In every config of
//! `shared/spec/configs` the surplus equals `num_nextn_predict_layers` (V4.1-Flash 43 entries for
//! 40 layers with 3 nextn layers; V4-Flash 44 for 43 with 1; V4-Pro 62 for 61 with 1), and the
//! surplus entries are 0. Only the first `num_hidden_layers` entries describe the persistent cache
//! ([`ModelConfig::layer_compress_ratios`]); the rest are reported by
//! [`ModelConfig::speculative_compress_ratios`] and excluded (spec §2, §8).

use std::fmt;
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The attention / KV-cache generation of a model, which decides how its cache is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Generation {
    /// Grouped-query attention with per-head K and V (DeepSeek-LLM / V1, `model_type` `llama`).
    #[serde(rename = "gqa")]
    Gqa,
    /// Multi-head latent attention: one shared latent + decoupled RoPE key per token and layer
    /// (`deepseek_v2`, `deepseek_v3`).
    #[serde(rename = "mla")]
    Mla,
    /// MLA plus a lightning indexer with one FP8 key per token and layer (`deepseek_v32`).
    #[serde(rename = "mla-indexer")]
    MlaIndexer,
    /// V4 compressed attention: per-layer CSA (ratio 4, with indexer) or HCA (ratio 128, no
    /// indexer) plus a sliding window, no cross-layer reuse (`deepseek_v4`).
    #[serde(rename = "v4-compressed")]
    V4Compressed,
    /// V4.1 CSA2: compressed attention with cross-layer reuse of KV and indexer state, plus a
    /// sliding window (`deepseek_v41`, spec §4).
    #[serde(rename = "v4.1-csa2")]
    V41Csa2,
}

impl Generation {
    /// Every generation, oldest first.
    pub const ALL: [Generation; 5] = [
        Generation::Gqa,
        Generation::Mla,
        Generation::MlaIndexer,
        Generation::V4Compressed,
        Generation::V41Csa2,
    ];

    /// Short machine name (the one used in serialized reports).
    pub const fn name(self) -> &'static str {
        match self {
            Generation::Gqa => "gqa",
            Generation::Mla => "mla",
            Generation::MlaIndexer => "mla-indexer",
            Generation::V4Compressed => "v4-compressed",
            Generation::V41Csa2 => "v4.1-csa2",
        }
    }

    /// Human-readable description.
    pub const fn describe(self) -> &'static str {
        match self {
            Generation::Gqa => "GQA (DeepSeek-LLM / V1)",
            Generation::Mla => "MLA (V2 / V3)",
            Generation::MlaIndexer => "MLA + FP8 indexer (V3.2)",
            Generation::V4Compressed => "V4 compressed attention (CSA / HCA)",
            Generation::V41Csa2 => "V4.1 CSA2 (cross-layer reuse)",
        }
    }

    /// Whether the generation keeps a per-layer sliding-window KV besides its persistent cache.
    pub const fn has_window(self) -> bool {
        matches!(self, Generation::V4Compressed | Generation::V41Csa2)
    }

    /// The generation of a known `model_type`. A `_text` suffix (the text model of a multimodal
    /// wrapper, e.g. `deepseek_v41_text`) is ignored.
    pub fn from_model_type(model_type: &str) -> Option<Generation> {
        let base = model_type.strip_suffix("_text").unwrap_or(model_type);
        match base {
            "llama" => Some(Generation::Gqa),
            "deepseek_v2" | "deepseek_v3" => Some(Generation::Mla),
            "deepseek_v32" => Some(Generation::MlaIndexer),
            "deepseek_v4" => Some(Generation::V4Compressed),
            "deepseek_v41" => Some(Generation::V41Csa2),
            _ => None,
        }
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// How a config's [`Generation`] was determined.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "by", rename_all = "kebab-case")]
pub enum DetectedBy {
    /// The text model's `model_type` is known.
    ModelType {
        /// The `model_type` as written.
        model_type: String,
    },
    /// The text model has no `model_type`; the wrapper's is known.
    WrapperModelType {
        /// The wrapper's `model_type` as written.
        model_type: String,
    },
    /// No known `model_type`; the generation was inferred from which fields are present.
    Structure {
        /// The unknown `model_type`, if there was one.
        model_type: Option<String>,
        /// The field (or fields) that decided it.
        marker: &'static str,
    },
}

/// A detected generation and how it was detected.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Detection {
    /// The generation.
    pub generation: Generation,
    /// How it was determined.
    pub by: DetectedBy,
}

impl fmt::Display for Detection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.by {
            DetectedBy::ModelType { model_type } => {
                write!(f, "{} (model_type {model_type:?})", self.generation)
            }
            DetectedBy::WrapperModelType { model_type } => {
                write!(f, "{} (wrapper model_type {model_type:?})", self.generation)
            }
            DetectedBy::Structure { model_type, marker } => {
                match model_type {
                    Some(mt) => write!(f, "{} (unknown model_type {mt:?}; ", self.generation)?,
                    None => write!(f, "{} (no model_type; ", self.generation)?,
                }
                write!(f, "inferred from `{marker}`)")
            }
        }
    }
}

/// RoPE scaling parameters (`rope_scaling`, or `rope_parameters` in newer `transformers`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RopeScaling {
    /// `type` / `rope_type`, e.g. `yarn`.
    pub kind: Option<String>,
    /// `factor`.
    pub factor: Option<f64>,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: Option<u64>,
    /// `beta_fast`.
    pub beta_fast: Option<f64>,
    /// `beta_slow`.
    pub beta_slow: Option<f64>,
}

/// The text model's configuration, as far as kvstack needs it.
///
/// Fields are the raw values of the file (`None` when absent or `null`); the methods of the same
/// name return them or a structured error. See the module documentation for nested files and
/// for `compress_ratios`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ModelConfig {
    /// True when the fields come from a nested `text_config` object.
    pub nested: bool,
    /// `model_type` of the text model.
    pub model_type: Option<String>,
    /// `model_type` of the wrapper, when the text model is nested.
    pub wrapper_model_type: Option<String>,
    /// `num_hidden_layers`: transformer layers, speculative layers excluded.
    pub num_hidden_layers: Option<usize>,
    /// `hidden_size`.
    pub hidden_size: Option<u64>,
    /// `vocab_size`.
    pub vocab_size: Option<u64>,
    /// `num_attention_heads`: query heads.
    pub num_attention_heads: Option<u64>,
    /// `num_key_value_heads`: KV heads (1 for MQA, spec §2).
    pub num_key_value_heads: Option<u64>,
    /// `head_dim`: per-head width (V4/V4.1: the shared K=V vector, 512).
    pub head_dim: Option<u64>,
    /// `qk_rope_head_dim`: rotary dims (the LAST dims of a V4/V4.1 head).
    pub qk_rope_head_dim: Option<u64>,
    /// `qk_nope_head_dim`: MLA non-rotary query/key dims per head.
    pub qk_nope_head_dim: Option<u64>,
    /// `v_head_dim`: MLA value dims per head.
    pub v_head_dim: Option<u64>,
    /// `kv_lora_rank`: MLA latent width.
    pub kv_lora_rank: Option<u64>,
    /// `q_lora_rank`.
    pub q_lora_rank: Option<u64>,
    /// `o_groups`: groups of the low-rank output projection.
    pub o_groups: Option<u64>,
    /// `o_lora_rank`.
    pub o_lora_rank: Option<u64>,
    /// `sliding_window`: window length in tokens.
    pub sliding_window: Option<u64>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: Option<u64>,
    /// `rope_theta`.
    pub rope_theta: Option<f64>,
    /// `compress_rope_theta`: RoPE base of layers with compression.
    pub compress_rope_theta: Option<f64>,
    /// `rope_scaling` (or `rope_parameters`).
    pub rope_scaling: Option<RopeScaling>,
    /// `rms_norm_eps`.
    pub rms_norm_eps: Option<f64>,
    /// `index_n_heads`: indexer query heads.
    pub index_n_heads: Option<u64>,
    /// `index_head_dim`: width of one indexer key.
    pub index_head_dim: Option<u64>,
    /// `index_topk`.
    pub index_topk: Option<u64>,
    /// `compress_ratios`: per layer, speculative layers appended (see module docs).
    pub compress_ratios: Option<Vec<u32>>,
    /// `kv_source_layer_ids`: CSA2 layers that compute their own compressed KV.
    pub kv_source_layer_ids: Option<Vec<usize>>,
    /// `index_source_layer_ids`: CSA2 layers that compute their own indexer top-k.
    pub index_source_layer_ids: Option<Vec<usize>>,
    /// `candidate_source_layer_id`: the layer whose scores build the candidate pool.
    pub candidate_source_layer_id: Option<usize>,
    /// `candidate_topk_blocks`.
    pub candidate_topk_blocks: Option<u64>,
    /// `candidate_block_size`.
    pub candidate_block_size: Option<u64>,
    /// `num_nextn_predict_layers`: speculative layers.
    pub num_nextn_predict_layers: Option<usize>,
    /// `n_routed_experts`.
    pub n_routed_experts: Option<u64>,
    /// `n_shared_experts`.
    pub n_shared_experts: Option<u64>,
    /// `num_experts_per_tok`.
    pub num_experts_per_tok: Option<u64>,
    /// `moe_intermediate_size`.
    pub moe_intermediate_size: Option<u64>,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: Option<f64>,
    /// `scoring_func`.
    pub scoring_func: Option<String>,
    /// `topk_method`.
    pub topk_method: Option<String>,
    /// `swiglu_limit`.
    pub swiglu_limit: Option<f64>,
    /// `hc_mult`: hyper-connection streams.
    pub hc_mult: Option<u64>,
    /// `hc_sinkhorn_iters`.
    pub hc_sinkhorn_iters: Option<u64>,
    /// `hc_eps`.
    pub hc_eps: Option<f64>,
    /// `engram_layer_ids`.
    pub engram_layer_ids: Option<Vec<usize>>,
}

/// Name used for text parsed from memory in [`Error::Json`].
const IN_MEMORY: &str = "<string>";

/// Most layers a config may declare: far above any released model (V4-Pro has 61), low enough
/// that a plan of that many layers is a few MB.
pub const MAX_LAYERS: usize = 1 << 16;

impl ModelConfig {
    /// Reads and parses a `config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<ModelConfig> {
        let path = path.as_ref();
        let bytes =
            crate::files::read_regular(path, crate::files::MAX_CONFIG_BYTES).map_err(|source| {
                Error::Io {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
        let text = String::from_utf8(bytes).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: crate::files::FileError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not UTF-8 text (at byte {})", e.utf8_error().valid_up_to()),
            )),
        })?;
        Self::parse_text(&text, path)
    }

    /// Parses `config.json` text held in memory.
    pub fn from_json_str(text: &str) -> Result<ModelConfig> {
        Self::parse_text(text, Path::new(IN_MEMORY))
    }

    fn parse_text(text: &str, path: &Path) -> Result<ModelConfig> {
        let value: Value = serde_json::from_str(text).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_value(&value)
    }

    /// Builds a config from an already parsed JSON value (flat or with `text_config`).
    pub fn from_value(value: &Value) -> Result<ModelConfig> {
        let root = value.as_object().ok_or_else(|| Error::InvalidField {
            field: "(root)".into(),
            reason: format!("expected a JSON object, found {}", describe(value)),
        })?;
        let (obj, prefix, wrapper_model_type) = match root.get("text_config") {
            None | Some(Value::Null) => (root, "", None),
            Some(Value::Object(text)) => {
                let wrapper = Fields {
                    obj: root,
                    prefix: "",
                }
                .get::<String>("model_type")?;
                (text, "text_config.", wrapper)
            }
            Some(other) => {
                return Err(Error::InvalidField {
                    field: "text_config".into(),
                    reason: format!("expected an object, found {}", describe(other)),
                });
            }
        };
        let f = Fields { obj, prefix };
        Ok(ModelConfig {
            nested: !prefix.is_empty(),
            model_type: f.get("model_type")?,
            wrapper_model_type,
            num_hidden_layers: f.get("num_hidden_layers")?,
            hidden_size: f.get("hidden_size")?,
            vocab_size: f.get("vocab_size")?,
            num_attention_heads: f.get("num_attention_heads")?,
            num_key_value_heads: f.get("num_key_value_heads")?,
            head_dim: f.get("head_dim")?,
            qk_rope_head_dim: f.get("qk_rope_head_dim")?,
            qk_nope_head_dim: f.get("qk_nope_head_dim")?,
            v_head_dim: f.get("v_head_dim")?,
            kv_lora_rank: f.get("kv_lora_rank")?,
            q_lora_rank: f.get("q_lora_rank")?,
            o_groups: f.get("o_groups")?,
            o_lora_rank: f.get("o_lora_rank")?,
            sliding_window: f.get("sliding_window")?,
            max_position_embeddings: f.get("max_position_embeddings")?,
            rope_theta: f.get("rope_theta")?,
            compress_rope_theta: f.get("compress_rope_theta")?,
            rope_scaling: f.rope_scaling()?,
            rms_norm_eps: f.get("rms_norm_eps")?,
            index_n_heads: f.get("index_n_heads")?,
            index_head_dim: f.get("index_head_dim")?,
            index_topk: f.get("index_topk")?,
            compress_ratios: f.get("compress_ratios")?,
            kv_source_layer_ids: f.get("kv_source_layer_ids")?,
            index_source_layer_ids: f.get("index_source_layer_ids")?,
            candidate_source_layer_id: f.get("candidate_source_layer_id")?,
            candidate_topk_blocks: f.get("candidate_topk_blocks")?,
            candidate_block_size: f.get("candidate_block_size")?,
            num_nextn_predict_layers: f.get("num_nextn_predict_layers")?,
            n_routed_experts: f.get("n_routed_experts")?,
            n_shared_experts: f.get("n_shared_experts")?,
            num_experts_per_tok: f.get("num_experts_per_tok")?,
            moe_intermediate_size: f.get("moe_intermediate_size")?,
            routed_scaling_factor: f.get("routed_scaling_factor")?,
            scoring_func: f.get("scoring_func")?,
            topk_method: f.get("topk_method")?,
            swiglu_limit: f.get("swiglu_limit")?,
            hc_mult: f.get("hc_mult")?,
            hc_sinkhorn_iters: f.get("hc_sinkhorn_iters")?,
            hc_eps: f.get("hc_eps")?,
            engram_layer_ids: f.get("engram_layer_ids")?,
        })
    }

    /// The name of `field` as written in the file: `text_config.<field>` for nested configs.
    pub fn field_path(&self, field: &str) -> String {
        if self.nested {
            format!("text_config.{field}")
        } else {
            field.to_owned()
        }
    }

    /// A [`Error::MissingField`] for `field`.
    pub fn missing(&self, field: &str) -> Error {
        Error::MissingField {
            field: self.field_path(field),
        }
    }

    /// An [`Error::InvalidField`] for `field`.
    pub fn invalid(&self, field: &str, reason: impl Into<String>) -> Error {
        Error::InvalidField {
            field: self.field_path(field),
            reason: reason.into(),
        }
    }

    fn req<T: Copy>(&self, value: Option<T>, field: &str) -> Result<T> {
        value.ok_or_else(|| self.missing(field))
    }

    fn req_positive(&self, value: Option<u64>, field: &str) -> Result<u64> {
        match self.req(value, field)? {
            0 => Err(self.invalid(field, "must be at least 1")),
            v => Ok(v),
        }
    }

    /// Detects the attention generation: from the text model's `model_type` when known, else
    /// from the wrapper's `model_type` when the text model has none, else from which fields
    /// are present (in this order: `kv_source_layer_ids` / `index_source_layer_ids` -> V4.1
    /// CSA2; `compress_ratios` -> V4; `kv_lora_rank` with `index_head_dim` -> MLA + indexer;
    /// `kv_lora_rank` -> MLA; `num_attention_heads` -> GQA).
    pub fn detect(&self) -> Result<Detection> {
        if let Some(mt) = &self.model_type {
            if let Some(generation) = Generation::from_model_type(mt) {
                return Ok(Detection {
                    generation,
                    by: DetectedBy::ModelType {
                        model_type: mt.clone(),
                    },
                });
            }
        } else if let Some(mt) = &self.wrapper_model_type
            && let Some(generation) = Generation::from_model_type(mt)
        {
            return Ok(Detection {
                generation,
                by: DetectedBy::WrapperModelType {
                    model_type: mt.clone(),
                },
            });
        }
        let structural = if self.kv_source_layer_ids.is_some() {
            Some((Generation::V41Csa2, "kv_source_layer_ids"))
        } else if self.index_source_layer_ids.is_some() {
            Some((Generation::V41Csa2, "index_source_layer_ids"))
        } else if self.compress_ratios.is_some() {
            Some((Generation::V4Compressed, "compress_ratios"))
        } else if self.kv_lora_rank.is_some() && self.index_head_dim.is_some() {
            Some((Generation::MlaIndexer, "kv_lora_rank + index_head_dim"))
        } else if self.kv_lora_rank.is_some() {
            Some((Generation::Mla, "kv_lora_rank"))
        } else if self.num_attention_heads.is_some() {
            Some((Generation::Gqa, "num_attention_heads"))
        } else {
            None
        };
        let model_type = self.model_type.clone().or(self.wrapper_model_type.clone());
        match structural {
            Some((generation, marker)) => Ok(Detection {
                generation,
                by: DetectedBy::Structure { model_type, marker },
            }),
            None => Err(match model_type {
                Some(mt) => self.invalid(
                    "model_type",
                    format!(
                        "unknown model_type {mt:?} and no field that identifies the attention type"
                    ),
                ),
                None => self.missing("model_type"),
            }),
        }
    }

    /// The detected generation (see [`ModelConfig::detect`]).
    pub fn generation(&self) -> Result<Generation> {
        Ok(self.detect()?.generation)
    }

    /// `num_hidden_layers` (1 to [`MAX_LAYERS`]).
    pub fn num_hidden_layers(&self) -> Result<usize> {
        match self.req(self.num_hidden_layers, "num_hidden_layers")? {
            0 => Err(self.invalid("num_hidden_layers", "must be at least 1")),
            // Plans and reports allocate a row per layer: an absurd count from a file must be
            // an error, not an allocation failure (found by fuzzing, fuzz/ config_plan).
            n if n > MAX_LAYERS => Err(self.invalid(
                "num_hidden_layers",
                format!("{n} is implausibly large (limit {MAX_LAYERS})"),
            )),
            n => Ok(n),
        }
    }

    /// `hidden_size` (at least 1).
    pub fn hidden_size(&self) -> Result<u64> {
        self.req_positive(self.hidden_size, "hidden_size")
    }

    /// `num_attention_heads` (at least 1).
    pub fn num_attention_heads(&self) -> Result<u64> {
        self.req_positive(self.num_attention_heads, "num_attention_heads")
    }

    /// `num_key_value_heads` (at least 1). No default is applied here.
    pub fn num_key_value_heads(&self) -> Result<u64> {
        self.req_positive(self.num_key_value_heads, "num_key_value_heads")
    }

    /// `head_dim` (at least 1). No default is applied here.
    pub fn head_dim(&self) -> Result<u64> {
        self.req_positive(self.head_dim, "head_dim")
    }

    /// Per-head width of a GQA/MHA model: `head_dim` when given, else
    /// `hidden_size / num_attention_heads` (the `transformers` default; it must divide).
    pub fn attention_head_dim(&self) -> Result<u64> {
        if self.head_dim.is_some() {
            return self.head_dim();
        }
        let hidden = self.hidden_size()?;
        let heads = self.num_attention_heads()?;
        if hidden % heads != 0 {
            return Err(self.invalid(
                "hidden_size",
                format!("{hidden} is not divisible by num_attention_heads {heads} and head_dim is absent"),
            ));
        }
        Ok(hidden / heads)
    }

    /// `qk_rope_head_dim` (may be 0).
    pub fn qk_rope_head_dim(&self) -> Result<u64> {
        self.req(self.qk_rope_head_dim, "qk_rope_head_dim")
    }

    /// `qk_nope_head_dim` (may be 0).
    pub fn qk_nope_head_dim(&self) -> Result<u64> {
        self.req(self.qk_nope_head_dim, "qk_nope_head_dim")
    }

    /// `v_head_dim` (at least 1).
    pub fn v_head_dim(&self) -> Result<u64> {
        self.req_positive(self.v_head_dim, "v_head_dim")
    }

    /// `kv_lora_rank` (at least 1).
    pub fn kv_lora_rank(&self) -> Result<u64> {
        self.req_positive(self.kv_lora_rank, "kv_lora_rank")
    }

    /// `index_n_heads` (at least 1).
    pub fn index_n_heads(&self) -> Result<u64> {
        self.req_positive(self.index_n_heads, "index_n_heads")
    }

    /// `index_head_dim` (at least 1).
    pub fn index_head_dim(&self) -> Result<u64> {
        self.req_positive(self.index_head_dim, "index_head_dim")
    }

    /// `sliding_window` (at least 1).
    pub fn sliding_window(&self) -> Result<u64> {
        self.req_positive(self.sliding_window, "sliding_window")
    }

    /// `num_nextn_predict_layers`, 0 when absent.
    pub fn num_nextn_predict_layers(&self) -> usize {
        self.num_nextn_predict_layers.unwrap_or(0)
    }

    /// The whole `compress_ratios` list, speculative entries included.
    pub fn compress_ratios(&self) -> Result<&[u32]> {
        self.compress_ratios
            .as_deref()
            .ok_or_else(|| self.missing("compress_ratios"))
    }

    /// The first `num_hidden_layers` entries of `compress_ratios`: the layers of the persistent
    /// cache. Fails when the list is shorter than that.
    pub fn layer_compress_ratios(&self) -> Result<&[u32]> {
        let layers = self.num_hidden_layers()?;
        let all = self.compress_ratios()?;
        all.get(..layers).ok_or_else(|| {
            self.invalid(
                "compress_ratios",
                format!(
                    "has {} entries but num_hidden_layers is {layers}",
                    all.len()
                ),
            )
        })
    }

    /// The entries of `compress_ratios` beyond `num_hidden_layers` (speculative layers, not part
    /// of the persistent cache). Empty when there are none.
    pub fn speculative_compress_ratios(&self) -> Result<&[u32]> {
        let layers = self.num_hidden_layers()?;
        let all = self.compress_ratios()?;
        Ok(all.get(layers..).unwrap_or(&[]))
    }

    /// `kv_source_layer_ids`.
    pub fn kv_source_layer_ids(&self) -> Result<&[usize]> {
        self.kv_source_layer_ids
            .as_deref()
            .ok_or_else(|| self.missing("kv_source_layer_ids"))
    }

    /// `index_source_layer_ids`.
    pub fn index_source_layer_ids(&self) -> Result<&[usize]> {
        self.index_source_layer_ids
            .as_deref()
            .ok_or_else(|| self.missing("index_source_layer_ids"))
    }

    /// `candidate_source_layer_id`.
    pub fn candidate_source_layer_id(&self) -> Result<usize> {
        self.req(self.candidate_source_layer_id, "candidate_source_layer_id")
    }

    /// Whether the config names CSA2 source layers (a V4.1-style config).
    pub fn has_csa2_sources(&self) -> bool {
        self.kv_source_layer_ids.is_some() || self.index_source_layer_ids.is_some()
    }
}

/// Typed lookup of fields in one JSON object, with error messages naming the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn get<T: FromJson>(&self, name: &str) -> Result<Option<T>> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => T::from_json(v)
                .map(Some)
                .map_err(|reason| Error::InvalidField {
                    field: format!("{}{name}", self.prefix),
                    reason,
                }),
        }
    }

    fn rope_scaling(&self) -> Result<Option<RopeScaling>> {
        let (name, value) = match (
            self.obj.get("rope_scaling"),
            self.obj.get("rope_parameters"),
        ) {
            (Some(v), _) if !v.is_null() => ("rope_scaling", v),
            (_, Some(v)) if !v.is_null() => ("rope_parameters", v),
            _ => return Ok(None),
        };
        let prefix = format!("{}{name}.", self.prefix);
        let obj = value.as_object().ok_or_else(|| Error::InvalidField {
            field: format!("{}{name}", self.prefix),
            reason: format!("expected an object, found {}", describe(value)),
        })?;
        let f = Fields {
            obj,
            prefix: &prefix,
        };
        let kind = match f.get::<String>("type")? {
            Some(k) => Some(k),
            None => f.get::<String>("rope_type")?,
        };
        Ok(Some(RopeScaling {
            kind,
            factor: f.get("factor")?,
            original_max_position_embeddings: f.get("original_max_position_embeddings")?,
            beta_fast: f.get("beta_fast")?,
            beta_slow: f.get("beta_slow")?,
        }))
    }
}

/// A short rendering of a JSON value for error messages.
fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "the number",
        Value::String(_) => "the string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    match v {
        Value::Number(_) | Value::String(_) | Value::Bool(_) => {
            let text = v.to_string();
            let mut short: String = text.chars().take(40).collect();
            if short.len() < text.len() {
                short.push_str("...");
            }
            format!("{kind} {short}")
        }
        _ => kind.to_owned(),
    }
}

/// Conversion of one JSON value into a typed field value; the error is the reason text.
trait FromJson: Sized {
    fn expected() -> String;
    fn convert(v: &Value) -> Option<Self>;
    fn from_json(v: &Value) -> Result<Self, String> {
        Self::convert(v)
            .ok_or_else(|| format!("expected {}, found {}", Self::expected(), describe(v)))
    }
}

/// Largest integer an f64 holds exactly (2^53).
const F64_EXACT_INT: f64 = 9_007_199_254_740_992.0;

impl FromJson for u64 {
    fn expected() -> String {
        "a non-negative integer".into()
    }
    fn convert(v: &Value) -> Option<u64> {
        // Integral floats (`128.0`) are accepted: some exporters write every number as a float.
        v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= F64_EXACT_INT)
                .map(|f| f as u64)
        })
    }
}

impl FromJson for usize {
    fn expected() -> String {
        "a non-negative integer".into()
    }
    fn convert(v: &Value) -> Option<usize> {
        u64::convert(v).and_then(|x| usize::try_from(x).ok())
    }
}

impl FromJson for u32 {
    fn expected() -> String {
        "a non-negative integer below 2^32".into()
    }
    fn convert(v: &Value) -> Option<u32> {
        u64::convert(v).and_then(|x| u32::try_from(x).ok())
    }
}

impl FromJson for f64 {
    fn expected() -> String {
        "a number".into()
    }
    fn convert(v: &Value) -> Option<f64> {
        v.as_f64()
    }
}

impl FromJson for String {
    fn expected() -> String {
        "a string".into()
    }
    fn convert(v: &Value) -> Option<String> {
        v.as_str().map(str::to_owned)
    }
}

impl<T: FromJson> FromJson for Vec<T> {
    fn expected() -> String {
        format!("an array of elements each {}", T::expected())
    }
    fn convert(v: &Value) -> Option<Vec<T>> {
        v.as_array()?.iter().map(T::convert).collect()
    }
    fn from_json(v: &Value) -> Result<Vec<T>, String> {
        let Some(items) = v.as_array() else {
            return Err(format!("expected an array, found {}", describe(v)));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                T::convert(item).ok_or_else(|| {
                    format!(
                        "element {i}: expected {}, found {}",
                        T::expected(),
                        describe(item)
                    )
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flat_and_nested_and_null() {
        let flat = ModelConfig::from_value(&json!({"model_type": "llama", "num_hidden_layers": 2,
            "head_dim": null, "unknown_field": [1, 2]}))
        .unwrap();
        assert!(!flat.nested);
        assert_eq!(flat.num_hidden_layers, Some(2));
        assert_eq!(flat.head_dim, None);

        let nested = ModelConfig::from_value(&json!({"model_type": "wrapper_mm",
            "hidden_size": 1, "text_config": {"model_type": "deepseek_v41_text", "hidden_size": 7}}))
        .unwrap();
        assert!(nested.nested);
        assert_eq!(nested.hidden_size, Some(7));
        assert_eq!(nested.model_type.as_deref(), Some("deepseek_v41_text"));
        assert_eq!(nested.wrapper_model_type.as_deref(), Some("wrapper_mm"));
        assert_eq!(nested.generation().unwrap(), Generation::V41Csa2);
        assert_eq!(
            nested.missing("head_dim").field(),
            Some("text_config.head_dim")
        );
    }

    #[test]
    fn bad_types_name_the_field() {
        let err = ModelConfig::from_value(&json!({"num_hidden_layers": "forty"})).unwrap_err();
        assert!(matches!(&err, Error::InvalidField { field, .. } if field == "num_hidden_layers"));
        assert!(err.to_string().contains("\"forty\""), "{err}");

        let err = ModelConfig::from_value(&json!({"head_dim": "é".repeat(50)})).unwrap_err();
        assert!(err.to_string().ends_with("..."), "{err}");

        let err = ModelConfig::from_value(&json!({"compress_ratios": [0, 2, -1]})).unwrap_err();
        assert!(err.to_string().contains("element 2"), "{err}");

        let err = ModelConfig::from_value(&json!({"text_config": {"head_dim": 1.5}})).unwrap_err();
        assert_eq!(err.field(), Some("text_config.head_dim"));

        let err = ModelConfig::from_value(&json!([1])).unwrap_err();
        assert_eq!(err.field(), Some("(root)"));
        let err = ModelConfig::from_value(&json!({"text_config": 3})).unwrap_err();
        assert_eq!(err.field(), Some("text_config"));

        // Integral floats are accepted.
        let c = ModelConfig::from_value(&json!({"sliding_window": 128.0})).unwrap();
        assert_eq!(c.sliding_window, Some(128));
    }

    #[test]
    fn bad_json_reports_the_path() {
        let err = ModelConfig::from_json_str("{\"a\": ").unwrap_err();
        assert!(matches!(err, Error::Json { .. }));
        assert!(
            err.to_string().starts_with("<string>: invalid JSON"),
            "{err}"
        );
    }

    #[test]
    fn model_type_table_and_structural_fallback() {
        let cases = [
            ("llama", Generation::Gqa),
            ("deepseek_v2", Generation::Mla),
            ("deepseek_v3", Generation::Mla),
            ("deepseek_v32", Generation::MlaIndexer),
            ("deepseek_v4", Generation::V4Compressed),
            ("deepseek_v41", Generation::V41Csa2),
            ("deepseek_v41_text", Generation::V41Csa2),
        ];
        for (mt, g) in cases {
            assert_eq!(Generation::from_model_type(mt), Some(g), "{mt}");
        }
        assert_eq!(Generation::from_model_type("mistral"), None);

        let structural = [
            (
                json!({"kv_source_layer_ids": [2]}),
                Generation::V41Csa2,
                "kv_source_layer_ids",
            ),
            (
                json!({"index_source_layer_ids": [2]}),
                Generation::V41Csa2,
                "index_source_layer_ids",
            ),
            (
                json!({"compress_ratios": [0]}),
                Generation::V4Compressed,
                "compress_ratios",
            ),
            (
                json!({"kv_lora_rank": 512, "index_head_dim": 128}),
                Generation::MlaIndexer,
                "kv_lora_rank + index_head_dim",
            ),
            (
                json!({"kv_lora_rank": 512}),
                Generation::Mla,
                "kv_lora_rank",
            ),
            (
                json!({"num_attention_heads": 8}),
                Generation::Gqa,
                "num_attention_heads",
            ),
        ];
        for (mut v, g, marker) in structural {
            v["model_type"] = json!("someone_elses_model");
            let d = ModelConfig::from_value(&v).unwrap().detect().unwrap();
            assert_eq!(d.generation, g);
            assert_eq!(
                d.by,
                DetectedBy::Structure {
                    model_type: Some("someone_elses_model".into()),
                    marker
                }
            );
            assert!(d.to_string().contains("someone_elses_model"));
        }
        let err = ModelConfig::from_value(&json!({"model_type": "x"}))
            .unwrap()
            .detect()
            .unwrap_err();
        assert_eq!(err.field(), Some("model_type"));
        let err = ModelConfig::from_value(&json!({}))
            .unwrap()
            .detect()
            .unwrap_err();
        assert!(matches!(err, Error::MissingField { .. }));
    }

    #[test]
    fn wrapper_model_type_is_used_only_when_the_text_model_has_none() {
        let c = ModelConfig::from_value(&json!({"model_type": "deepseek_v41",
            "text_config": {"num_hidden_layers": 2}}))
        .unwrap();
        let d = c.detect().unwrap();
        assert_eq!(d.generation, Generation::V41Csa2);
        assert!(matches!(d.by, DetectedBy::WrapperModelType { .. }));

        // The text model's own model_type wins over the wrapper's.
        let c = ModelConfig::from_value(&json!({"model_type": "deepseek_v41",
            "text_config": {"model_type": "llama"}}))
        .unwrap();
        assert_eq!(c.generation().unwrap(), Generation::Gqa);
    }

    #[test]
    fn rope_parameters_are_read_as_rope_scaling() {
        let c = ModelConfig::from_value(&json!({"rope_parameters": {"rope_type": "yarn",
            "factor": 16, "original_max_position_embeddings": 65536}}))
        .unwrap();
        let r = c.rope_scaling.unwrap();
        assert_eq!(r.kind.as_deref(), Some("yarn"));
        assert_eq!(r.factor, Some(16.0));
        assert_eq!(r.original_max_position_embeddings, Some(65536));
    }

    #[test]
    fn layer_ratios_exclude_speculative_entries() {
        let c = ModelConfig::from_value(&json!({"num_hidden_layers": 3,
            "compress_ratios": [0, 2, 1, 0, 0]}))
        .unwrap();
        assert_eq!(c.layer_compress_ratios().unwrap(), &[0, 2, 1]);
        assert_eq!(c.speculative_compress_ratios().unwrap(), &[0, 0]);
        let short = ModelConfig::from_value(&json!({"num_hidden_layers": 6,
            "compress_ratios": [0, 2, 1, 0, 0]}))
        .unwrap();
        let err = short.layer_compress_ratios().unwrap_err();
        assert_eq!(err.field(), Some("compress_ratios"));
    }
}
