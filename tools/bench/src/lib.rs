//! Benchmark harnesses behind `kvstack bench`: each runs real work through the public APIs of
//! the kvstack crates and compares its rate with limits of this machine measured in the same
//! run (memcpy, memory-read bandwidth, FMA and 8-bit integer peaks from
//! [`kvstack_kernels::peak`]), so that its ratios mean the same on any machine.
//!
//! - [`codecs`]: quantize, dequantize and the fused dots per entry format, one thread
//!   (`kvstack bench codecs`).
//! - [`attention`]: the CSA2 decode kernels at the V4.1-Flash dimensions per thread count
//!   (`kvstack bench attention`).
//!
//! The harnesses return reports (with a plain-text `Display`); the CLI prints them or their
//! JSON form.

pub mod attention;
pub mod codecs;
mod error;
mod rng;

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
