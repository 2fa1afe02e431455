//! The layer plan: for every layer, whether it keeps a persistent (compressed or dense) cache of
//! its own, reuses another layer's, or keeps only its sliding window.
//!
//! - [`PlanKind::Csa2`] (V4.1, configs with `kv_source_layer_ids` / `index_source_layer_ids`):
//!   built and validated by the rules of spec §4 ([`LayerPlan::csa2`]).
//! - [`PlanKind::V4Compressed`] (V4): no cross-layer reuse; every layer with a ratio > 0 is its
//!   own KV source. A layer with ratio [`V4_CSA_RATIO`] (4) is CSA and owns indexer keys; any other
//!   ratio > 0 (128 in the released models) is HCA, which attends all compressed entries and has
//!   no indexer ([`LayerPlan::v4`]).
//! - [`PlanKind::Dense`] (GQA, MLA, MLA + indexer): every layer keeps one entry per token of its
//!   own, written here as mode [`LayerMode::Full`] with ratio 1 ([`LayerPlan::dense`]).
//!
//! Only the first `num_hidden_layers` layers are planned; speculative layers are outside the
//! persistent cache (see [`crate::config`]).

use std::fmt;

use serde::Serialize;

use crate::config::{Generation, ModelConfig};
use crate::error::{Error, Result};

/// The compress ratio of V4's CSA layers (the ones with an indexer). The V4 reference builds an
/// indexer, and overlapping compression windows, exactly for ratio-4 layers; every other ratio
/// > 0 is HCA.
pub const V4_CSA_RATIO: u32 = 4;

/// Which half of the causal encoder-decoder split a layer is in (spec §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// Layers `0 .. num_hidden_layers / 2`.
    Encoder,
    /// Layers `num_hidden_layers / 2 ..`.
    Decoder,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Encoder => "encoder",
            Side::Decoder => "decoder",
        })
    }
}

/// What a layer does with compressed KV and indexer state (spec §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayerMode {
    /// Ratio 0: sliding window only, no persistent cache.
    WindowOnly,
    /// Computes and stores its own persistent KV (a KV source); in CSA2 and V4 CSA also its own
    /// indexer keys and a fresh top-k. Dense generations mark every layer `Full`.
    Full,
    /// CSA2: reuses the latest KV source's KV and indexer keys but runs its own indexer query and
    /// top-k (an index source that is not a KV source).
    Reindex,
    /// CSA2: reuses the latest KV source's KV and inherits the latest index source's top-k.
    Reuse,
}

impl fmt::Display for LayerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayerMode::WindowOnly => "window-only",
            LayerMode::Full => "full",
            LayerMode::Reindex => "reindex",
            LayerMode::Reuse => "reuse",
        })
    }
}

/// How a plan was built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlanKind {
    /// Every layer keeps one entry per token (GQA, MLA, MLA + indexer).
    Dense,
    /// V4: per-layer compression (CSA / HCA), no cross-layer reuse.
    V4Compressed,
    /// V4.1 CSA2 with cross-layer reuse (spec §4).
    Csa2,
}

/// The plan of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerSpec {
    /// Layer index.
    pub index: usize,
    /// Tokens per compressed entry: 0 = window only; 1 for every layer of a dense generation.
    pub compress_ratio: u32,
    /// Encoder or decoder half (spec §3); `None` for generations without the split.
    pub side: Option<Side>,
    /// What the layer computes and reuses.
    pub mode: LayerMode,
    /// The layer whose persistent KV this layer attends (itself for `Full`); `None` for
    /// window-only layers.
    pub kv_source: Option<usize>,
    /// The layer whose indexer top-k this layer uses (itself for an index source); `None` when
    /// the layer uses no indexer (window-only, HCA, generations without an indexer).
    pub index_source: Option<usize>,
    /// Whether this layer's indexer scores build the candidate pool (spec §4).
    pub is_candidate_source: bool,
    /// Whether this layer's top-k is restricted to the candidate pool: a `Reindex` layer in the
    /// decoder after the candidate source (spec §4).
    pub uses_candidates: bool,
}

impl LayerSpec {
    /// Whether the layer stores persistent KV entries of its own.
    pub fn owns_kv(&self) -> bool {
        self.mode == LayerMode::Full
    }

    /// Whether the layer stores indexer keys of its own (a `Full` layer that is its own index
    /// source; `Reindex` layers reuse their KV source's keys).
    pub fn owns_index_keys(&self) -> bool {
        self.mode == LayerMode::Full && self.index_source == Some(self.index)
    }

    /// Whether the layer selects entries with an indexer top-k (its own or inherited).
    pub fn is_indexed(&self) -> bool {
        self.index_source.is_some()
    }
}

/// The plan of every layer of a model (speculative layers excluded).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayerPlan {
    /// How the plan was built.
    pub kind: PlanKind,
    /// One entry per layer, in order.
    pub layers: Vec<LayerSpec>,
}

impl LayerPlan {
    /// The plan for a config, by its detected generation.
    pub fn from_config(cfg: &ModelConfig) -> Result<LayerPlan> {
        Self::for_generation(cfg, cfg.generation()?)
    }

    /// The plan for a config of a given generation.
    pub fn for_generation(cfg: &ModelConfig, generation: Generation) -> Result<LayerPlan> {
        match generation {
            Generation::Gqa | Generation::Mla => Self::dense(cfg, false),
            Generation::MlaIndexer => Self::dense(cfg, true),
            Generation::V4Compressed => Self::v4(cfg),
            Generation::V41Csa2 => Self::csa2(cfg),
        }
    }

    /// A dense plan: every layer `Full` with ratio 1, its own KV source, and its own index
    /// source when `indexed`.
    pub fn dense(cfg: &ModelConfig, indexed: bool) -> Result<LayerPlan> {
        let n = cfg.num_hidden_layers()?;
        let layers = (0..n)
            .map(|i| LayerSpec {
                index: i,
                compress_ratio: 1,
                side: None,
                mode: LayerMode::Full,
                kv_source: Some(i),
                index_source: indexed.then_some(i),
                is_candidate_source: false,
                uses_candidates: false,
            })
            .collect();
        Ok(LayerPlan {
            kind: PlanKind::Dense,
            layers,
        })
    }

    /// The V4 plan: one KV head; every layer with ratio > 0 owns its compressed KV; ratio-4
    /// layers (CSA) own indexer keys, other compressed layers (HCA) have no indexer.
    pub fn v4(cfg: &ModelConfig) -> Result<LayerPlan> {
        check_single_kv_head(cfg)?;
        let ratios = cfg.layer_compress_ratios()?;
        let layers = ratios
            .iter()
            .enumerate()
            .map(|(i, &m)| {
                let compressed = m > 0;
                LayerSpec {
                    index: i,
                    compress_ratio: m,
                    side: None,
                    mode: if compressed {
                        LayerMode::Full
                    } else {
                        LayerMode::WindowOnly
                    },
                    kv_source: compressed.then_some(i),
                    index_source: (m == V4_CSA_RATIO).then_some(i),
                    is_candidate_source: false,
                    uses_candidates: false,
                }
            })
            .collect();
        Ok(LayerPlan {
            kind: PlanKind::V4Compressed,
            layers,
        })
    }

    /// The CSA2 plan of spec §4, validated. Checks, in this order (each error names the layer
    /// and the field to fix):
    /// 1. exactly one KV head (`num_key_value_heads`);
    /// 2. `compress_ratios` present and at least `num_hidden_layers` long;
    /// 3. `kv_source_layer_ids` and `index_source_layer_ids` present, in range and strictly
    ///    ascending;
    /// 4. a ratio-0 layer is never a source;
    /// 5. every KV source is an index source;
    /// 6. every compressed layer has a KV source at or before it, and the nearest one has the
    ///    same ratio;
    /// 7. the candidate source (if `candidate_source_layer_id` is given) is in range and a Full
    ///    KV source. Without it no layer uses candidates.
    pub fn csa2(cfg: &ModelConfig) -> Result<LayerPlan> {
        check_single_kv_head(cfg)?;
        let n = cfg.num_hidden_layers()?;
        let ratios = cfg.layer_compress_ratios()?;
        let kv_ids = cfg.kv_source_layer_ids()?;
        let index_ids = cfg.index_source_layer_ids()?;
        check_ids(cfg, "kv_source_layer_ids", kv_ids, n)?;
        check_ids(cfg, "index_source_layer_ids", index_ids, n)?;

        for (field, ids) in [
            ("kv_source_layer_ids", kv_ids),
            ("index_source_layer_ids", index_ids),
        ] {
            if let Some(&l) = ids.iter().find(|&&l| ratios[l] == 0) {
                return Err(plan_error(
                    cfg,
                    l,
                    field,
                    "a window-only layer (compress ratio 0) cannot be a source",
                ));
            }
        }
        if let Some(&l) = kv_ids.iter().find(|l| !index_ids.contains(l)) {
            return Err(plan_error(
                cfg,
                l,
                "index_source_layer_ids",
                "every KV source must also be an index source",
            ));
        }

        let candidate = match cfg.candidate_source_layer_id {
            None => None,
            Some(c) if c >= n => {
                return Err(plan_error(
                    cfg,
                    c,
                    "candidate_source_layer_id",
                    format!("out of range: the model has {n} layers"),
                ));
            }
            Some(c) if !kv_ids.contains(&c) => {
                return Err(plan_error(
                    cfg,
                    c,
                    "candidate_source_layer_id",
                    "the candidate source must be a Full KV source (listed in kv_source_layer_ids)",
                ));
            }
            Some(c) => Some(c),
        };

        let half = n / 2;
        let mut layers = Vec::with_capacity(n);
        let mut kv_source: Option<usize> = None;
        let mut index_source: Option<usize> = None;
        for (i, &m) in ratios.iter().enumerate() {
            let is_kv = kv_ids.contains(&i);
            let is_index = index_ids.contains(&i);
            if is_kv {
                kv_source = Some(i);
            }
            if is_index {
                index_source = Some(i);
            }
            let side = Some(if i < half {
                Side::Encoder
            } else {
                Side::Decoder
            });
            if m == 0 {
                layers.push(LayerSpec {
                    index: i,
                    compress_ratio: 0,
                    side,
                    mode: LayerMode::WindowOnly,
                    kv_source: None,
                    index_source: None,
                    is_candidate_source: false,
                    uses_candidates: false,
                });
                continue;
            }
            let Some(src) = kv_source else {
                return Err(plan_error(
                    cfg,
                    i,
                    "kv_source_layer_ids",
                    format!("compressed layer (ratio {m}) has no KV source at or before it"),
                ));
            };
            if ratios[src] != m {
                return Err(plan_error(
                    cfg,
                    i,
                    "compress_ratios",
                    format!(
                        "ratio {m} differs from ratio {} of its KV source, layer {src}",
                        ratios[src]
                    ),
                ));
            }
            let mode = if is_kv {
                LayerMode::Full
            } else if is_index {
                LayerMode::Reindex
            } else {
                LayerMode::Reuse
            };
            layers.push(LayerSpec {
                index: i,
                compress_ratio: m,
                side,
                mode,
                kv_source: Some(src),
                // A KV source at or before `i` is an index source, so this is `Some`.
                index_source,
                is_candidate_source: candidate == Some(i),
                uses_candidates: mode == LayerMode::Reindex
                    && side == Some(Side::Decoder)
                    && candidate.is_some_and(|c| c < i),
            });
        }
        Ok(LayerPlan {
            kind: PlanKind::Csa2,
            layers,
        })
    }

    /// The layers that store persistent KV of their own.
    pub fn kv_sources(&self) -> impl Iterator<Item = &LayerSpec> {
        self.layers.iter().filter(|l| l.owns_kv())
    }

    /// The layers that store indexer keys of their own.
    pub fn index_key_owners(&self) -> impl Iterator<Item = &LayerSpec> {
        self.layers.iter().filter(|l| l.owns_index_keys())
    }

    /// Whether any layer uses an indexer.
    pub fn has_indexer(&self) -> bool {
        self.layers.iter().any(LayerSpec::is_indexed)
    }
}

fn plan_error(cfg: &ModelConfig, layer: usize, field: &str, reason: impl Into<String>) -> Error {
    Error::Plan {
        layer,
        field: cfg.field_path(field),
        reason: reason.into(),
    }
}

fn check_single_kv_head(cfg: &ModelConfig) -> Result<()> {
    match cfg.num_key_value_heads()? {
        1 => Ok(()),
        h => Err(cfg.invalid(
            "num_key_value_heads",
            format!("is {h}; compressed attention needs exactly one KV head (K = V shared)"),
        )),
    }
}

fn check_ids(cfg: &ModelConfig, field: &str, ids: &[usize], n: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(cfg.invalid(field, "is empty"));
    }
    let mut prev: Option<usize> = None;
    for &l in ids {
        if l >= n {
            return Err(plan_error(
                cfg,
                l,
                field,
                format!("out of range: the model has {n} layers"),
            ));
        }
        if prev.is_some_and(|p| l <= p) {
            return Err(plan_error(
                cfg,
                l,
                field,
                "source layer ids must be strictly ascending",
            ));
        }
        prev = Some(l);
    }
    Ok(())
}
