//! The V4.1 forward pass on the CPU (spec §3, §9): embedding, hyper-connections (4 streams,
//! Sinkhorn mixing), CSA2 attention ([`crate::attention`]), the MoE (sqrt-softplus router with
//! the selection-only correction bias, clamped SwiGLU experts, one shared expert; routed experts
//! threaded), the final collapse, norm and LM head, and sampling.
//!
//! - [`ModelDims`]: the non-attention dimensions from the config;
//! - [`ModelWeights`]: every tensor, loaded from a memory-mapped safetensors file in either
//!   naming (the released checkpoint's `layers.{l}...`, `embed.weight`, `head.weight`, or the
//!   NeMo reference's `model.layers.{l}...`) and any released storage type (F32, BF16, FP8 E4M3
//!   with UE8M0 block scales, packed FP4 E2M1 experts with UE8M0 scales), **dequantized to f32
//!   on load** (`docs/model.md` says why);
//! - [`Model`]: the forward pass over a [`crate::attention::KvStore`] ([`Model::step`]: exact,
//!   every layer over every token; [`Model::prefill`]: exact or CED, chunked), decode and
//!   sampling;
//! - [`init`]: a seeded random checkpoint of any valid config (`kvstack model init`) and the
//!   in-memory default model;
//! - [`verify`]: `verify model` against `shared/vectors/csa2/model_vectors.safetensors`.

mod dims;
mod forward;
pub mod init;
mod storage;
pub mod verify;
mod weights;

pub use dims::ModelDims;
pub use forward::{
    BatchItem, BlockTrace, Logits, Model, ModelStore, ModelTrace, PrefillMode, PrefillStep,
};
pub use storage::{
    dequantize_fp4, dequantize_fp8, encode_fp4, encode_fp8, f32_from_bf16, load_f32,
};
pub use weights::{BlockWeights, ExpertWeights, HcWeights, ModelWeights, Naming, TensorSource};
