//! Fast codecs and fused dot products for the three KV entry formats of spec §5
//! (`shared/spec/dsv41-kv.md`), with runtime SIMD dispatch.
//!
//! - [`quantize`], [`quantize_unchecked`], [`dequantize`]: many rows at once, byte-identical
//!   (encode) and bit-identical (decode) to the scalar reference codecs of
//!   `kvstack_firmware_interface::entry` on every [`SimdLevel`].
//! - [`dot_fp4`], [`dot_mxfp4`], [`dot_mxfp4_mxfp4`] and their `_many` batch forms: dot products
//!   of a query with stored entries, decoding in registers (see [`dot`] for accuracy).
//! - Every entry point has a `_with(level, ..)` form that forces a level (for tests and
//!   benchmarks); the plain forms use [`detected_level`], chosen once per process.
//! - [`peak`]: machine ceilings for benchmarks (memory-read stream, FMA and 8-bit integer
//!   multiply-add peaks per level); the benchmarks themselves live in `kvstack-bench`.
//! - [`linear`]: linear layers with weights in their stored formats (FP8, FP4, BF16, f32),
//!   packed once at load, decoded in registers (spec §9).
//! - [`par`]: the few parallel tasks of a decode step on rayon's pool, with a short wait.
//! - [`csa2`]: the CSA2 attention building blocks of spec §4 at any width (GEMM, RMSNorm, RoPE
//!   with YaRN, compressor, indexer, top-k, candidate pool, sparse attention, output
//!   projection), each with a reference form its fast form is tested against.
//!
//! Levels: [`SimdLevel::Portable`] everywhere, [`SimdLevel::Avx2`] (AVX2 + FMA) and
//! [`SimdLevel::Avx512`] (AVX-512 F/BW/VL) on x86-64, chosen at run time with
//! `is_x86_feature_detected!` (never from `-C target-cpu`). The codecs, fused dots and
//! attention kernels ([`attn`]) have a kernel per level (the indexer's AVX-512 form is its AVX2
//! kernel with VNNI products where the CPU has AVX-512 VNNI, and one integer sum per head where
//! it also has VBMI and the exponent spans allow).
//!
//! # Example
//!
//! ```
//! use kvstack_kernels::{EntryFormat, GlobalFp4Entry, dequantize, dot_fp4, quantize};
//!
//! let x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.1).sin()).collect();
//! let mut bytes = vec![0u8; GlobalFp4Entry::BYTES];
//! quantize(EntryFormat::GlobalFp4, &x, &mut bytes)?;
//! let mut y = vec![0f32; 512];
//! dequantize(EntryFormat::GlobalFp4, &bytes, &mut y)?;
//!
//! let entry: GlobalFp4Entry = zerocopy::transmute!(<[u8; 288]>::try_from(&bytes[..]).unwrap());
//! let q: [f32; 512] = std::array::from_fn(|i| x[i]);
//! let d = dot_fp4(&q, &entry);
//! let exact: f32 = q.iter().zip(&y).map(|(a, b)| a * b).sum();
//! assert!((d - exact).abs() <= 1e-3 * exact.abs());
//! # Ok::<(), kvstack_kernels::Error>(())
//! ```

pub mod aligned;
pub mod attn;
mod codec;
pub mod csa2;
pub mod dot;
mod error;
mod level;
pub mod linear;
pub mod model;
pub mod par;
pub mod peak;
mod portable;
mod scalar;
pub mod work;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use codec::{
    dequantize, dequantize_with, quantize, quantize_unchecked, quantize_unchecked_with,
    quantize_with,
};
pub use dot::{
    dot_fp4, dot_fp4_many, dot_fp4_many_with, dot_fp4_with, dot_mxfp4, dot_mxfp4_many,
    dot_mxfp4_many_with, dot_mxfp4_mxfp4, dot_mxfp4_mxfp4_many, dot_mxfp4_mxfp4_many_with,
    dot_mxfp4_mxfp4_with, dot_mxfp4_with,
};
pub use error::Error;
pub use kvstack_firmware_interface::{
    EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry,
};
pub use level::{LEVEL_ENV, SimdLevel, available_levels, detected_level};
