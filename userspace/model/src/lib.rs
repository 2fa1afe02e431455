//! The DeepSeek-V4.1 model on the CPU: what a checkpoint is and how it computes (spec §2-§4,
//! §9), matched to the public reference.
//!
//! - [`weights`]: tensors of memory-mapped safetensors files, shapes and dtypes checked, errors
//!   naming the file, the tensor and the expected shape; [`shards`]: a [`Checkpoint`] is one
//!   such file or a sharded Hugging Face directory (`model.safetensors.index.json`, shards
//!   mapped lazily).
//! - [`attention`]: the CSA2 attention layer, prefill and decode, every layer mode
//!   (`docs/attention.md`), over a [`attention::KvStore`] (in memory at any width, or the paged
//!   cache of `kvstack-cache`), and [`attention::verify`], `verify attention` against a
//!   reference dump.
//! - [`Model`]: the forward pass (hyper-connections, MoE, head, sampling; exact and CED
//!   prefill, bounded replay, batched steps) over [`ModelWeights`] loaded in the released or
//!   NeMo naming and storage (`docs/model.md`); [`init`]: seeded random checkpoints;
//!   [`verify`]: `verify model` against a reference dump; [`tokenizer`]: text to token ids
//!   for models without a `tokenizer.json` (byte-level).
//!
//! The building blocks are `kvstack_kernels::csa2` and `kvstack_kernels::model`; configs and
//! layer plans come from `kvstack-spec`. Nothing here does I/O beyond reading tensor files
//! (and writing a generated checkpoint): persistence is `kvstack-tiers`' concern.
//!
//! [`ModelDims`]: the non-attention dimensions from the config. [`ModelWeights`]: every
//! tensor, in either naming (the released checkpoint's `layers.{l}...`, `embed.weight`,
//! `head.weight`, or the NeMo reference's `model.layers.{l}...`) and any released storage type
//! (F32, BF16, FP8 E4M3 with UE8M0 block scales, packed FP4 E2M1 experts with UE8M0 scales),
//! **dequantized to f32 on load** (`docs/model.md` says why).

pub mod attention;
mod checkpoint;
mod dims;
mod error;
mod forward;
pub mod init;
pub mod shards;
mod storage;
mod threads;
pub mod tokenizer;
pub mod verify;
pub mod weights;

pub use checkpoint::{BlockWeights, ExpertWeights, HcWeights, ModelWeights, Naming, TensorSource};
pub use dims::ModelDims;
pub use error::{Error, Result};
pub use forward::{
    BatchItem, BlockTrace, ForcedInput, Logits, Model, ModelStore, ModelTrace, PrefillMode,
    PrefillStep, WeightBytes,
};
pub use shards::{Checkpoint, Sharded};
pub use storage::{
    StoredMatrix, WeightPrecision, dequantize_fp4, dequantize_fp8, encode_fp4, encode_fp8,
    f32_from_bf16, load_f32, load_stored, stored_matrix,
};
