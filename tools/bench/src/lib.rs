//! kvstack's benchmark harnesses: each runs real work through the public APIs of the kvstack
//! crates and compares its rate with limits of this machine measured in the same run
//! (memcpy, memory-read bandwidth, FMA and 8-bit integer peaks from
//! [`kvstack_kernels::peak`], fio on the same directory), so that its ratios mean the same on
//! any machine. `kvstack bench` runs them.
//!
//! - [`codecs`]: quantize, dequantize and the fused dots per entry format, one thread
//!   (`kvstack bench codecs`).
//! - [`attention`]: the CSA2 decode kernels at the V4.1-Flash dimensions per thread count
//!   (`kvstack bench attention`).
//! - [`footprint`]: the measured bytes per token of a real V4.1-Flash paged cache
//!   (`kvstack bench footprint`).
//! - [`tiers`]: the SSD store and the DRAM window pool against fio (`kvstack bench tiers`).
//! - [`profile`]: replays of request traces through the real SSD store, DRAM window pool and
//!   paged cache, with a prefill cost model, reports and plots (`kvstack profile`).
//! - [`serve`]: kvstackd under concurrent streaming clients against the engine in-process
//!   (`kvstack bench serve`).
//! - [`runtime`]: the engine's tokens/s and time to first token of a cached prompt against
//!   the same prompt from scratch (`kvstack bench runtime`).
//!
//! The harnesses return reports (with a plain-text `Display`); the CLI prints them or their
//! JSON form. The libraries carry no benchmark code; what a harness needs from them is public
//! API.

pub mod attention;
pub mod codecs;
mod error;
pub mod footprint;
pub mod profile;
mod rng;
pub mod runtime;
pub mod serve;
mod synth;
pub mod tiers;

pub use error::{Error, Result};

use kvstack_kernels::SimdLevel;
use kvstack_kernels::peak::Peaks;

/// The ceilings (and so the level) a harness runs: `level` where this CPU can run it, else the
/// detected level, with a note saying so.
fn peaks_for(level: Option<SimdLevel>, notes: &mut Vec<String>) -> Peaks {
    match level.map(Peaks::new) {
        None => Peaks::detected(),
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            notes.push(format!(
                "{e}; ran {} instead",
                kvstack_kernels::detected_level()
            ));
            Peaks::detected()
        }
    }
}
