//! CSA2 attention building blocks on the CPU (spec §4), width-generic.
//!
//! Every block has a plain **reference** form (`*_ref`, written to mirror the public
//! DeepSeek-V4.1 reference arithmetic step by step) and a **fast** form that the runtime uses;
//! `kernels/tests/csa2_blocks.rs` tests each fast form against its reference. Dimensions are
//! arguments, not constants: the deployed model has 512-wide KV entries and 128-wide index
//! keys, the test model of `shared/vectors/csa2` 64 and 32. Quantized rows use
//! [`RowLayout`](kvstack_firmware_interface::rows::RowLayout) ([`quant::RowCodec`]); at the
//! real widths the SIMD codecs and fused dots of this crate take over.
//!
//! | block | module | spec |
//! |---|---|---|
//! | f32 `y = x Wᵀ` through `matrixmultiply` | [`gemm`] | §4 (every projection) |
//! | RMSNorm | [`norm`] | §4 |
//! | interleaved-pair RoPE on the last rotary dims, frequency-only YaRN, inverse | [`rope`] | §4 |
//! | softmax with a per-head sink logit | [`softmax`] | §4 core attention |
//! | compressor state (ratio 2 gated pooling, ratio 1 pass-through) | [`compress`] | §4 compressor |
//! | quantized rows, exact MXFP4·MXFP4 dot at any width | [`quant`] | §5 |
//! | indexer scores `Σ_h w_h relu(q_h·k)` | [`indexer`] | §4 indexer |
//! | top-k with the reference's `-1` sentinel | [`topk`] | §4 indexer |
//! | hierarchical candidate pool | [`candidates`] | §4 candidate pool |
//! | sparse attention over FP8 window + FP4 entries, sink, `P·V` with `V = K` | [`attention`] | §4 core attention |
//! | grouped low-rank output projection | [`output`] | §4 core attention |
//!
//! Composition (which weights feed which block, per layer mode) is the runtime's
//! (`kvstack_model::attention`); this module holds no weights and no state beyond the
//! compressor's pending tokens.

pub mod attention;
pub mod candidates;
pub mod compress;
pub mod gemm;
pub mod indexer;
pub mod norm;
pub mod output;
pub mod quant;
pub mod rope;
pub mod softmax;
pub mod topk;

/// The crate's error type, re-exported where the blocks are.
pub use crate::Error;

/// Checks that a buffer has exactly `expected` elements.
pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<(), Error> {
    if expected == actual {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}
