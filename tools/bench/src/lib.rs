//! kvstack's benchmark harnesses, over the public APIs of the crates they measure: what
//! `kvstack bench` runs. Each harness measures its limits in the same run (memory bandwidth,
//! SIMD peaks, fio on the same directory) and reports ratios to them, never absolute targets
//! that depend on the machine.
//!
//! - [`footprint`]: `kvstack bench footprint`, the measured bytes per token of a real
//!   V4.1-Flash paged cache.
//! - [`tiers`]: `kvstack bench tiers`, the SSD store and the DRAM window pool against fio.
//! - [`runtime`]: `kvstack bench runtime`, the engine's tokens/s and time to first token of a
//!   cached prompt against the same prompt from scratch.
//!
//! The libraries carry no benchmark code; what a harness needs from them is public API.

mod error;
pub mod footprint;
pub mod runtime;
pub mod tiers;

pub use error::{Error, Result};
