//! Cache-entry arithmetic (spec §6), derived from a config and the storage formats.
//!
//! Nothing here is tabled per model: the layer plan ([`crate::plan`]) says which layers own
//! entries and at which compress ratio, the config gives the entry dimensions, and
//! [`GlobalFormat`] / [`IndexFormat`] turn dimensions into bytes. `docs/cache-arithmetic.md`
//! walks through every generation with the numbers.
//!
//! # Persistent bytes per token
//! `sum over layers that own KV of global_entry / ratio + sum over layers that own indexer keys
//! of index_entry / ratio`, speculative layers excluded. Computed exactly as a fraction and
//! reported as `f64` (exact for every released model: the ratios are powers of two).
//!
//! # Per-sequence constant
//! Bytes a sequence holds independent of its length, at steady state: the sliding window of
//! every layer (`num_hidden_layers * sliding_window * window_entry`, speculative layers
//! excluded) plus the compressor state of groups not yet complete: at most `ratio - 1` pending
//! tokens per KV-owning layer with ratio > 1, each holding the `wkv` and `wgate` projections in
//! f32 (`2 * head_dim * 4` bytes; 4096 for head_dim 512, spec §4). Exact for V4.1; for V4 it is
//! an approximation (see [`CacheReport::per_sequence_is_approximate`]). 0 for generations
//! without a window and without compression.
//!
//! # Levers
//! See [`Levers`]: a chain of five stages from an uncompressed BF16 multi-head baseline down to
//! the persistent bytes, whose four ratios multiply to `baseline / persistent` exactly.
//!
//! # Format overrides
//! [`FormatOverrides`] replaces the deployed global and/or index format. An index-format
//! override on a model without an indexer is ignored and recorded in [`CacheReport::notes`]
//! (so one set of flags can be applied to several models). A global format that cannot describe
//! the model's entries (a RoPE-splitting format on GQA keys) is an error
//! ([`Error::FormatNotApplicable`]). The window format is never overridden.

mod format;

pub use format::{
    BF16_BYTES, F32_BYTES, FP4_TILE, FP8_MLA_TILE, FP8_TILE, GlobalFormat, INDEX_FP8_TILE,
    IndexFormat, MXFP4_TILE, V4_FP8_TILE, V4_SCALE_ALIGN,
};

use serde::Serialize;

use crate::config::{DetectedBy, Detection, Generation, ModelConfig};
use crate::error::{Error, Result};
use crate::frac::Frac;
use crate::plan::{LayerMode, LayerPlan, PlanKind, Side};

/// Bytes in a GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

/// Dimensions above this are rejected as implausible (keeps every product in range).
const MAX_DIM: u64 = 1 << 24;

/// The storage formats of a model's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StorageFormats {
    /// Persistent (global) KV entries.
    pub global: GlobalFormat,
    /// Indexer keys; `None` for models without an indexer.
    pub index: Option<IndexFormat>,
    /// Sliding-window entries; `None` for models without a window.
    pub window: Option<GlobalFormat>,
}

impl StorageFormats {
    /// The formats the released models of each generation deploy (spec §6): BF16 for GQA and
    /// MLA; FP8 MLA (656 B) + FP8 indexer (132 B) for V3.2; V4's FP8 + BF16-RoPE entry (584 B)
    /// for global and window + MXFP4 indexer (68 B); V4.1's FP4 (288 B) + MXFP4 (68 B) with an
    /// FP8 window (528 B, spec §5).
    pub const fn deployed(generation: Generation) -> StorageFormats {
        match generation {
            Generation::Gqa | Generation::Mla => StorageFormats {
                global: GlobalFormat::Bf16,
                index: None,
                window: None,
            },
            Generation::MlaIndexer => StorageFormats {
                global: GlobalFormat::Fp8Mla,
                index: Some(IndexFormat::Fp8),
                window: None,
            },
            Generation::V4Compressed => StorageFormats {
                global: GlobalFormat::Fp8NopeBf16Rope,
                index: Some(IndexFormat::Mxfp4),
                window: Some(GlobalFormat::Fp8NopeBf16Rope),
            },
            Generation::V41Csa2 => StorageFormats {
                global: GlobalFormat::Fp4,
                index: Some(IndexFormat::Mxfp4),
                window: Some(GlobalFormat::Fp8),
            },
        }
    }
}

/// Replacements for the deployed formats (`--global-format`, `--index-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FormatOverrides {
    /// Replaces the global format.
    pub global: Option<GlobalFormat>,
    /// Replaces the index format; ignored (with a note) for models without an indexer.
    pub index: Option<IndexFormat>,
}

/// The formats a report used and the entry sizes they give for this model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FormatsUsed {
    /// Global format.
    pub global: GlobalFormat,
    /// Bytes of one global entry: everything one KV-owning layer stores per compressed position
    /// (for GQA: K and V of every KV head).
    pub global_entry_bytes: u64,
    /// Index format, `None` without an indexer.
    pub index: Option<IndexFormat>,
    /// Bytes of one indexer key.
    pub index_entry_bytes: Option<u64>,
    /// Window format, `None` without a window.
    pub window: Option<GlobalFormat>,
    /// Bytes of one window entry.
    pub window_entry_bytes: Option<u64>,
}

/// One layer's row of a report.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LayerRow {
    /// Layer index.
    pub layer: usize,
    /// Encoder / decoder (CSA2 only).
    pub side: Option<Side>,
    /// Mode of the layer (window-only, full, reindex, reuse).
    pub mode: LayerMode,
    /// Compress ratio (0 = window only; 1 for dense generations).
    pub compress_ratio: u32,
    /// Layer whose KV it attends.
    pub kv_source: Option<usize>,
    /// Layer whose top-k it uses.
    pub index_source: Option<usize>,
    /// Whether its top-k is restricted to the candidate pool.
    pub uses_candidates: bool,
    /// Bytes of the global entries this layer stores itself (0 when it reuses another layer's).
    pub global_entry_bytes: u64,
    /// Bytes of the indexer keys this layer stores itself (0 when it stores none).
    pub index_entry_bytes: u64,
    /// Persistent bytes per token of its own global entries: `global_entry_bytes / ratio`.
    pub global_bytes_per_token: f64,
    /// Persistent bytes per token of its own indexer keys: `index_entry_bytes / ratio`.
    pub index_bytes_per_token: f64,
}

/// The four levers of spec §1, as a chain of bytes-per-token stages (all persistent, per token,
/// speculative layers excluded):
///
/// - `B0` baseline: every layer stores one K and one V per **attention** head in BF16 for every
///   token (plain multi-head attention). Per layer `num_attention_heads * (k_dim + v_dim) * 2`:
///   `k = v = head_dim` for GQA and V4/V4.1, `k = qk_nope + qk_rope`, `v = v_head_dim` for MLA.
/// - `B1` after entry sharing: every layer stores the model's actual entry for every token in
///   BF16: GQA K and V per KV head, the MLA latent + RoPE key, V4's single K=V vector; plus one
///   BF16 indexer key on every layer that selects through an indexer (in CSA2 that is every
///   compressed layer, as each would need its own keys without cross-layer sharing).
/// - `B2` after sequence compression: each layer's `B1` bytes divided by its compress ratio;
///   window-only layers keep no persistent cache and drop to 0.
/// - `B3` after cross-layer sharing: only layers that own KV (and own indexer keys) count.
/// - `B4` after the storage format: `B3` with the actual formats instead of BF16; this is
///   [`CacheReport::persistent_bytes_per_token`].
///
/// Levers: `entry_sharing = B0/B1`, `sequence_compression = B1/B2`,
/// `cross_layer_sharing = B2/B3`, `storage_format = B3/B4`; their product is `total = B0/B4`
/// (a telescoping product, exact; the `f64` values agree to rounding). A lever of 1 means the
/// generation does not use it. A stage of 0 (a model with no persistent cache) gives a factor of
/// infinity (or 1 when both stages are 0).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Levers {
    /// `B0`, bytes per token.
    pub baseline_bytes_per_token: f64,
    /// `B1`, bytes per token.
    pub after_entry_sharing: f64,
    /// `B2`, bytes per token.
    pub after_sequence_compression: f64,
    /// `B3`, bytes per token.
    pub after_cross_layer_sharing: f64,
    /// `B4` = persistent bytes per token.
    pub after_storage_format: f64,
    /// `B0 / B1`.
    pub entry_sharing: f64,
    /// `B1 / B2`.
    pub sequence_compression: f64,
    /// `B2 / B3`.
    pub cross_layer_sharing: f64,
    /// `B3 / B4`.
    pub storage_format: f64,
    /// `B0 / B4`.
    pub total: f64,
}

impl Levers {
    /// The product of the four levers (equals [`Levers::total`] up to `f64` rounding).
    pub fn product(&self) -> f64 {
        self.entry_sharing
            * self.sequence_compression
            * self.cross_layer_sharing
            * self.storage_format
    }
}

/// The cache arithmetic of one model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheReport {
    /// The text model's `model_type`.
    pub model_type: Option<String>,
    /// The wrapper's `model_type` for nested configs.
    pub wrapper_model_type: Option<String>,
    /// The attention generation.
    pub generation: Generation,
    /// How the generation was detected.
    pub detection: Detection,
    /// How the layer plan was built.
    pub plan_kind: PlanKind,
    /// Layers counted (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Entries of `compress_ratios` beyond `num_hidden_layers` (speculative layers), excluded
    /// from every number here.
    pub speculative_layers_excluded: usize,
    /// Formats and entry sizes.
    pub formats: FormatsUsed,
    /// Persistent (global) cache bytes per token of context: grows linearly with the context.
    pub persistent_bytes_per_token: f64,
    /// Per-sequence constant: `window_bytes + pending_state_bytes`.
    pub per_sequence_bytes: u64,
    /// Sliding-window KV of all layers, full window.
    pub window_bytes: u64,
    /// Upper bound of pending compressor state (incomplete groups).
    pub pending_state_bytes: u64,
    /// True when the per-sequence constant is an approximation (V4: see `notes`).
    pub per_sequence_is_approximate: bool,
    /// One row per layer.
    pub layers: Vec<LayerRow>,
    /// The four levers.
    pub levers: Levers,
    /// Remarks: excluded layers, ignored overrides, defaults applied, approximations.
    pub notes: Vec<String>,
}

/// The shape of the vectors one KV-owning layer stores per compressed position.
struct GlobalShape {
    /// Vectors per entry (2 * KV heads for GQA, 1 otherwise).
    vectors: u64,
    /// Width of each vector.
    dim: u64,
    /// Trailing RoPE dims, when the model has a decoupled RoPE part.
    rope: Option<u64>,
    /// Baseline (B0) BF16 bytes per layer and token.
    baseline_layer_bytes: u64,
}

fn dim_checked(cfg: &ModelConfig, field: &str, v: u64) -> Result<u64> {
    if v > MAX_DIM {
        Err(cfg.invalid(field, format!("{v} is implausibly large (limit {MAX_DIM})")))
    } else {
        Ok(v)
    }
}

fn global_shape(cfg: &ModelConfig, g: Generation, notes: &mut Vec<String>) -> Result<GlobalShape> {
    let heads = dim_checked(cfg, "num_attention_heads", cfg.num_attention_heads()?)?;
    match g {
        Generation::Gqa => {
            let kv_heads = match cfg.num_key_value_heads {
                Some(_) => cfg.num_key_value_heads()?,
                None => {
                    notes.push(format!(
                        "{} absent: using num_attention_heads ({heads}), the transformers default",
                        cfg.field_path("num_key_value_heads")
                    ));
                    heads
                }
            };
            let kv_heads = dim_checked(cfg, "num_key_value_heads", kv_heads)?;
            let d = dim_checked(cfg, "head_dim", cfg.attention_head_dim()?)?;
            Ok(GlobalShape {
                vectors: 2 * kv_heads,
                dim: d,
                rope: None,
                baseline_layer_bytes: heads * 2 * d * BF16_BYTES,
            })
        }
        Generation::Mla | Generation::MlaIndexer => {
            let latent = dim_checked(cfg, "kv_lora_rank", cfg.kv_lora_rank()?)?;
            let rope = dim_checked(cfg, "qk_rope_head_dim", cfg.qk_rope_head_dim()?)?;
            let nope = dim_checked(cfg, "qk_nope_head_dim", cfg.qk_nope_head_dim()?)?;
            let v = dim_checked(cfg, "v_head_dim", cfg.v_head_dim()?)?;
            Ok(GlobalShape {
                vectors: 1,
                dim: latent + rope,
                rope: Some(rope),
                baseline_layer_bytes: heads * (nope + rope + v) * BF16_BYTES,
            })
        }
        Generation::V4Compressed | Generation::V41Csa2 => {
            let d = dim_checked(cfg, "head_dim", cfg.head_dim()?)?;
            let rope = cfg.qk_rope_head_dim()?;
            if rope > d {
                return Err(cfg.invalid("qk_rope_head_dim", format!("{rope} exceeds head_dim {d}")));
            }
            Ok(GlobalShape {
                vectors: 1,
                dim: d,
                rope: Some(rope),
                baseline_layer_bytes: heads * 2 * d * BF16_BYTES,
            })
        }
    }
}

/// Adds `num / den` to an accumulator, reporting overflow as a config error.
fn acc(cfg: &ModelConfig, sum: &mut Frac, num: u64, den: u32) -> Result<()> {
    let overflow = || cfg.invalid("compress_ratios", "the cache arithmetic overflows");
    let term = Frac::new(u128::from(num), u128::from(den)).ok_or_else(overflow)?;
    *sum = sum.checked_add(term).ok_or_else(overflow)?;
    Ok(())
}

fn factor(a: Frac, b: Frac) -> f64 {
    if b.is_zero() {
        if a.is_zero() { 1.0 } else { f64::INFINITY }
    } else {
        a.checked_div(b)
            .map_or_else(|| a.to_f64() / b.to_f64(), Frac::to_f64)
    }
}

fn mul(cfg: &ModelConfig, field: &str, a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b)
        .ok_or_else(|| cfg.invalid(field, "the cache arithmetic overflows"))
}

impl CacheReport {
    /// Computes the report of a config with the deployed formats replaced by `overrides`.
    pub fn compute(cfg: &ModelConfig, overrides: &FormatOverrides) -> Result<CacheReport> {
        let detection = cfg.detect()?;
        let g = detection.generation;
        let plan = LayerPlan::for_generation(cfg, g)?;
        let n = plan.layers.len();
        let mut notes = Vec::new();

        if let DetectedBy::Structure { .. } = &detection.by {
            notes.push(format!("generation detected by structure: {detection}"));
        }
        let speculative = match g {
            Generation::V4Compressed | Generation::V41Csa2 => {
                cfg.speculative_compress_ratios()?.len()
            }
            _ => 0,
        };
        let nextn = cfg.num_nextn_predict_layers();
        if speculative > 0 {
            let mut note = format!(
                "compress_ratios has {} entries for {n} layers: the last {speculative} \
                 (speculative layers) are excluded",
                n + speculative
            );
            if speculative != nextn {
                note.push_str(&format!(
                    "; NOTE num_nextn_predict_layers is {nextn}, not {speculative}"
                ));
            }
            notes.push(note);
        } else if nextn > 0 {
            notes.push(format!(
                "{nextn} speculative (nextn) layer(s) are not part of the persistent cache and excluded"
            ));
        }

        // Formats.
        let mut formats = StorageFormats::deployed(g);
        if let Some(gf) = overrides.global {
            formats.global = gf;
        }
        let has_indexer = plan.has_indexer();
        if let Some(ix) = overrides.index {
            if has_indexer {
                formats.index = Some(ix);
            } else {
                notes.push(format!(
                    "index format override `{ix}` ignored: the model has no indexer"
                ));
            }
        }
        if !has_indexer {
            formats.index = None;
        }

        // Entry sizes.
        let shape = global_shape(cfg, g, &mut notes)?;
        let not_applicable = |reason: String| Error::FormatNotApplicable {
            kind: "global",
            format: formats.global.name(),
            generation: g,
            reason,
        };
        if formats.global.splits_rope() && shape.rope.is_none() {
            return Err(not_applicable(
                "its keys have no decoupled RoPE part to store separately".into(),
            ));
        }
        let vector_bytes = formats
            .global
            .vector_bytes(shape.dim, shape.rope)
            .ok_or_else(|| not_applicable(format!("no size for a {}-wide vector", shape.dim)))?;
        let global_entry = shape.vectors * vector_bytes;
        let global_bf16 = shape.vectors * shape.dim * BF16_BYTES;
        let (index_entry, index_bf16) = match formats.index {
            Some(ix) => {
                let d = dim_checked(cfg, "index_head_dim", cfg.index_head_dim()?)?;
                let bytes = ix
                    .key_bytes(d)
                    .ok_or_else(|| cfg.invalid("index_head_dim", "too large"))?;
                (bytes, d * BF16_BYTES)
            }
            None => (0, 0),
        };
        let window_entry = match formats.window {
            Some(wf) => Some(wf.vector_bytes(shape.dim, shape.rope).ok_or_else(|| {
                cfg.invalid("qk_rope_head_dim", "does not fit the window entry format")
            })?),
            None => None,
        };

        // Per-layer rows and the lever stages.
        let mut persistent = Frac::ZERO;
        let b0 = Frac::int(mul(
            cfg,
            "num_hidden_layers",
            n as u64,
            shape.baseline_layer_bytes,
        )?);
        let (mut b1, mut b2, mut b3) = (Frac::ZERO, Frac::ZERO, Frac::ZERO);
        let mut layers = Vec::with_capacity(n);
        for l in &plan.layers {
            let m = l.compress_ratio;
            let own_g = if l.owns_kv() { global_entry } else { 0 };
            let own_i = if l.owns_index_keys() { index_entry } else { 0 };
            let unshared_bf16 = global_bf16 + if l.is_indexed() { index_bf16 } else { 0 };
            acc(cfg, &mut b1, unshared_bf16, 1)?;
            let (g_bpt, i_bpt) = if m > 0 {
                acc(cfg, &mut persistent, own_g + own_i, m)?;
                acc(cfg, &mut b2, unshared_bf16, m)?;
                let own_bf16 = if l.owns_kv() { global_bf16 } else { 0 }
                    + if l.owns_index_keys() { index_bf16 } else { 0 };
                acc(cfg, &mut b3, own_bf16, m)?;
                (own_g as f64 / f64::from(m), own_i as f64 / f64::from(m))
            } else {
                (0.0, 0.0)
            };
            layers.push(LayerRow {
                layer: l.index,
                side: l.side,
                mode: l.mode,
                compress_ratio: m,
                kv_source: l.kv_source,
                index_source: l.index_source,
                uses_candidates: l.uses_candidates,
                global_entry_bytes: own_g,
                index_entry_bytes: own_i,
                global_bytes_per_token: g_bpt,
                index_bytes_per_token: i_bpt,
            });
        }
        let levers = Levers {
            baseline_bytes_per_token: b0.to_f64(),
            after_entry_sharing: b1.to_f64(),
            after_sequence_compression: b2.to_f64(),
            after_cross_layer_sharing: b3.to_f64(),
            after_storage_format: persistent.to_f64(),
            entry_sharing: factor(b0, b1),
            sequence_compression: factor(b1, b2),
            cross_layer_sharing: factor(b2, b3),
            storage_format: factor(b3, persistent),
            total: factor(b0, persistent),
        };

        // Per-sequence constant.
        let window_bytes = match window_entry {
            Some(we) => {
                let w = cfg.sliding_window()?;
                let per_layer = mul(cfg, "sliding_window", w, we)?;
                mul(cfg, "sliding_window", n as u64, per_layer)?
            }
            None => 0,
        };
        let pending_token_bytes = 2 * shape.dim * F32_BYTES;
        let mut pending_state_bytes = 0u64;
        for l in plan.kv_sources().filter(|l| l.compress_ratio > 1) {
            let bytes = mul(
                cfg,
                "compress_ratios",
                u64::from(l.compress_ratio - 1),
                pending_token_bytes,
            )?;
            pending_state_bytes = pending_state_bytes
                .checked_add(bytes)
                .ok_or_else(|| cfg.invalid("compress_ratios", "the cache arithmetic overflows"))?;
        }
        let per_sequence_is_approximate = g == Generation::V4Compressed;
        if per_sequence_is_approximate {
            notes.push(
                "per-sequence constant is approximate for V4: it counts (ratio - 1) pending tokens of \
                 kv + gate projections (f32) per compressed layer; V4's ratio-4 compressor also \
                 keeps the previous group for its overlapping windows, at twice the width, and \
                 its indexer has a compressor of its own, so engines hold more state than this"
                    .into(),
            );
        }
        let per_sequence_bytes = window_bytes
            .checked_add(pending_state_bytes)
            .ok_or_else(|| cfg.invalid("sliding_window", "the cache arithmetic overflows"))?;

        Ok(CacheReport {
            model_type: cfg.model_type.clone(),
            wrapper_model_type: cfg.wrapper_model_type.clone(),
            generation: g,
            detection,
            plan_kind: plan.kind,
            num_hidden_layers: n,
            speculative_layers_excluded: speculative,
            formats: FormatsUsed {
                global: formats.global,
                global_entry_bytes: global_entry,
                index: formats.index,
                index_entry_bytes: formats.index.map(|_| index_entry),
                window: formats.window,
                window_entry_bytes: window_entry,
            },
            persistent_bytes_per_token: persistent.to_f64(),
            per_sequence_bytes,
            window_bytes,
            pending_state_bytes,
            per_sequence_is_approximate,
            layers,
            levers,
            notes,
        })
    }

    /// Persistent (global) cache bytes of one sequence of `tokens` tokens: for every layer that
    /// owns entries, `floor(tokens / ratio)` complete entries (an incomplete group has no entry
    /// yet, spec §4) times its entry bytes. Saturates at `u64::MAX`. Excludes the per-sequence
    /// constant (see [`CacheReport::total_bytes_at_context`]).
    pub fn bytes_at_context(&self, tokens: u64) -> u64 {
        let total: u128 = self
            .layers
            .iter()
            .filter(|r| r.compress_ratio > 0)
            .map(|r| {
                let entry = u128::from(r.global_entry_bytes) + u128::from(r.index_entry_bytes);
                u128::from(tokens / u64::from(r.compress_ratio)).saturating_mul(entry)
            })
            .fold(0u128, u128::saturating_add);
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// [`CacheReport::bytes_at_context`] in GiB (2^30 bytes).
    pub fn gib_at_context(&self, tokens: u64) -> f64 {
        self.bytes_at_context(tokens) as f64 / GIB
    }

    /// Persistent bytes at `tokens` plus the per-sequence constant (an upper bound of the whole
    /// cache of one sequence: the window is counted full). Saturates at `u64::MAX`.
    pub fn total_bytes_at_context(&self, tokens: u64) -> u64 {
        self.bytes_at_context(tokens)
            .saturating_add(self.per_sequence_bytes)
    }
}

/// One row of [`compare`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    /// The report's `model_type`.
    pub model_type: Option<String>,
    /// The report's generation.
    pub generation: Generation,
    /// The report's persistent bytes per token.
    pub persistent_bytes_per_token: f64,
    /// `first.persistent_bytes_per_token / this.persistent_bytes_per_token`: how many times
    /// smaller this model's persistent cache is than the first's (1 for the first itself).
    pub times_smaller_than_first: f64,
    /// That ratio formatted by [`format_ratio`].
    pub display: String,
}

/// Compares every report with the first: with DeepSeek-LLM-67B first and V4.1-Flash second the
/// second row reads `437.2`.
pub fn compare(reports: &[CacheReport]) -> Vec<Comparison> {
    let Some(first) = reports.first() else {
        return Vec::new();
    };
    reports
        .iter()
        .map(|r| {
            let ratio = first.persistent_bytes_per_token / r.persistent_bytes_per_token;
            Comparison {
                model_type: r.model_type.clone(),
                generation: r.generation,
                persistent_bytes_per_token: r.persistent_bytes_per_token,
                times_smaller_than_first: ratio,
                display: format_ratio(ratio),
            }
        })
        .collect()
}

/// Formats a ratio the way spec §6 writes them: one decimal from 100 up (`437.2`), two below
/// (`3.95`, `13.68`); `inf` / `NaN` as such.
pub fn format_ratio(ratio: f64) -> String {
    if !ratio.is_finite() {
        format!("{ratio}")
    } else if ratio.abs() >= 100.0 {
        format!("{ratio:.1}")
    } else {
        format!("{ratio:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_formatting() {
        assert_eq!(format_ratio(389_120.0 / 890.0), "437.2");
        assert_eq!(format_ratio(3514.25 / 890.0), "3.95");
        assert_eq!(format_ratio(1.0), "1.00");
        assert_eq!(format_ratio(f64::INFINITY), "inf");
    }

    #[test]
    fn factor_handles_zero_stages() {
        assert_eq!(factor(Frac::ZERO, Frac::ZERO), 1.0);
        assert_eq!(factor(Frac::int(3), Frac::ZERO), f64::INFINITY);
        assert_eq!(factor(Frac::int(3), Frac::int(2)), 1.5);
    }
}
