//! The CSA2 attention layer on the CPU (spec §4), matched to the public DeepSeek-V4.1
//! reference, for every layer mode (window-only, Full, Reindex, Reuse) and any model
//! dimensions of this shape.
//!
//! - [`AttentionDims`]: dimensions and RoPE parameters from the config;
//! - [`AttentionWeights`]: the tensors of every layer from a safetensors file
//!   ([`crate::weights::TensorFile`]), shapes checked, errors naming the tensor;
//! - [`KvStore`]: the persistent per-sequence state (window rows, compressed entries, index
//!   keys, pending compressor tokens) behind a small trait; [`ContiguousStore`] keeps it in
//!   vectors at any widths, [`PagedStore`] in the paged [`kvstack_cache::KvCache`] at the
//!   deployed widths;
//! - [`StepState`]: the top-k and candidate pool threaded from layer to layer within a step;
//! - [`Csa2Attention`]: the layer itself. [`Csa2Attention::forward`] runs one layer over a
//!   step of `n` tokens: prefill is a step of many tokens, decode a step of one. Decoding
//!   token by token reproduces prefill (same selections, same outputs: the projections'
//!   GEMM sums in the same order for any number of rows, and every other stage works per
//!   token), which `tests/attention_decode.rs` checks.
//!
//! The building blocks are `kvstack_kernels::csa2`; the data flow per mode is written out in
//! `docs/attention.md`.

mod dims;
mod layer;
mod paged;
mod params;
mod step;
mod store;
pub mod verify;

pub use dims::AttentionDims;
pub use layer::{
    AttentionPath, Compressed, Csa2Attention, ENTRY_DECODE_BYTES, LayerTrace, Projections,
};
pub use paged::{PagedStage, PagedStore, PagedView};
pub use params::{
    AttentionWeights, CompressorWeights, IndexKeyWeights, IndexerWeights, LayerWeights,
};
pub use step::{Candidates, StepState, TopK};
pub use store::{ContiguousStore, KvStore};
