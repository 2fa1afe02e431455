//! kvstack runtime: model configuration, the CSA2 layer plan and the cache-entry arithmetic.
//!
//! - [`config`]: [`ModelConfig`] parsed from a Hugging Face `config.json` (flat or with the text
//!   model nested under `text_config`) and the attention [`Generation`] it belongs to.
//! - [`plan`]: the per-layer [`LayerPlan`] (which layers own compressed KV / indexer keys, which
//!   reuse them), validated by the rules of spec §4.
//! - [`calc`]: the cache arithmetic of spec §6 ([`CacheReport`]): persistent bytes per token,
//!   the per-sequence constant, per-layer rows and the four levers, derived from the config and
//!   the storage formats.
//!
//! - [`cache`]: the paged KV cache with its prefix index (`docs/paged-cache.md`).
//! - [`tiers`]: tiered persistence: the SSD store of global KV, the DRAM window pool and the
//!   prefix units (`docs/tiers.md`, `docs/ssd-format.md`).
//!
//! - [`attention`]: the CSA2 attention layer, prefill and decode, every layer mode
//!   (`docs/attention.md`); [`weights`]: tensors from safetensors files; [`verify`]: `verify
//!   attention` against a reference dump.
//! - [`model`]: the V4.1 forward pass (hyper-connections, MoE, head, sampling; exact and CED
//!   prefill), checkpoints in the released or NeMo naming and storage, `verify model`, seeded
//!   random checkpoints (`docs/model.md`).
//!
//! - [`engine`]: the serving engine: sessions, chunked prefill, continuous batching of decode
//!   steps, prefix reuse through the tiers with bounded replay (`docs/engine.md`).
//!
//! The formulas, entry layouts and numbers are written out in `docs/cache-arithmetic.md`.

pub mod attention;
pub mod builtin;
pub mod cache;
pub mod calc;
pub mod config;
pub mod engine;
mod error;
mod frac;
pub mod model;
pub mod plan;
mod threads;
pub mod tiers;
pub mod verify;
pub mod weights;

pub use calc::{
    CacheReport, Comparison, FormatOverrides, GlobalFormat, IndexFormat, Levers, StorageFormats,
    compare, format_ratio,
};
pub use config::{DetectedBy, Detection, Generation, ModelConfig};
pub use error::{Error, Result};
pub use plan::{LayerMode, LayerPlan, LayerSpec, PlanKind, Side};
