//! What a model's KV cache is, read from its config: everything `kvstack calc` needs and every
//! crate above builds on (spec §2, §4, §6).
//!
//! - [`config`]: [`ModelConfig`] parsed from a Hugging Face `config.json` (flat or with the text
//!   model nested under `text_config`) and the attention [`Generation`] it belongs to.
//! - [`plan`]: the per-layer [`LayerPlan`] (which layers own compressed KV / indexer keys, which
//!   reuse them), validated by the rules of spec §4.
//! - [`calc`]: the cache arithmetic of spec §6 ([`CacheReport`]): persistent bytes per token,
//!   the per-sequence constant, per-layer rows and the four levers, derived from the config and
//!   the storage formats (`docs/cache-arithmetic.md`).
//! - [`builtin`]: the embedded configs (DeepSeek-V4.1-Flash and the tiny model of `kvstack run`).
//! - [`files`]: bounded reads of input files (regular files only, size limits).
//!
//! No I/O beyond reading a config file, no model weights: the paged cache, the tiers and the
//! model all depend on this crate, never the other way.

pub mod builtin;
pub mod calc;
pub mod config;
mod error;
pub mod files;
mod frac;
pub mod plan;

pub use calc::{
    CacheReport, Comparison, FormatOverrides, GlobalFormat, IndexFormat, Levers, StorageFormats,
    compare, format_ratio,
};
pub use config::{DetectedBy, Detection, Generation, ModelConfig};
pub use error::{Error, Result};
pub use plan::{LayerMode, LayerPlan, LayerSpec, PlanKind, Side};
