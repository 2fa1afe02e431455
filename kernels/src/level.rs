//! SIMD level: what the CPU can run, chosen once at run time.
//!
//! Features decide what is compiled (`cfg(target_arch)`), a CPUID probe decides what runs
//! (`is_x86_feature_detected!`), and the choice is logged once. Nothing depends on
//! `-C target-cpu=native`: a binary built anywhere runs everywhere and picks its best path.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::Error;

/// A family of kernels. Every level computes bit-identical codec results; dot products agree
/// within their documented error bound (and exactly for [`crate::dot_mxfp4_mxfp4`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Plain Rust written so that LLVM can autovectorize it for the build's baseline target.
    /// Runs everywhere.
    Portable,
    /// x86-64 AVX2 + FMA (256-bit vectors).
    Avx2,
    /// x86-64 AVX-512 F + BW + VL (512-bit vectors), with AVX2 + FMA, which every such CPU
    /// has. The codecs and fused dots have AVX-512 kernels; the attention kernels
    /// ([`crate::attn`]) run their AVX2 forms at this level.
    Avx512,
}

impl SimdLevel {
    /// Every level, slowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The level's name as printed and parsed: `portable`, `avx2`, `avx512`.
    pub const fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// Whether this CPU (and this build) can run the level's kernels.
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Portable => true,
            SimdLevel::Avx2 => cpu_has_avx2_fma(),
            SimdLevel::Avx512 => cpu_has_avx2_fma() && cpu_has_avx512(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_avx512() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_avx2_fma() -> bool {
    // std caches the CPUID results, so this is cheap after the first call.
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_avx2_fma() -> bool {
    false
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SimdLevel {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        SimdLevel::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| Error::UnknownLevel { name: s.to_owned() })
    }
}

/// Every level this CPU can run, slowest first (always starts with [`SimdLevel::Portable`]).
pub fn available_levels() -> Vec<SimdLevel> {
    SimdLevel::ALL
        .into_iter()
        .filter(|l| l.is_available())
        .collect()
}

/// Environment variable that lowers the detected level (`portable`, `avx2`, `avx512`), for example to
/// rule out a SIMD path while debugging. A level the CPU cannot run is ignored with a warning.
pub const LEVEL_ENV: &str = "KVSTACK_SIMD";

/// The level the un-suffixed entry points use: the best available one, chosen once per
/// process (and lowered by [`LEVEL_ENV`] if set).
pub fn detected_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = available_levels()
            .last()
            .copied()
            .unwrap_or(SimdLevel::Portable);
        let chosen = match std::env::var(LEVEL_ENV) {
            Ok(name) => match name.parse::<SimdLevel>() {
                Ok(l) if l.is_available() => l,
                Ok(l) => {
                    log::warn!("{LEVEL_ENV}={l} is not available on this CPU; using {best}");
                    best
                }
                Err(e) => {
                    log::warn!("{LEVEL_ENV}: {e}; using {best}");
                    best
                }
            },
            Err(_) => best,
        };
        log::info!("kvstack-kernels: SIMD level {chosen} (best available: {best})");
        chosen
    })
}

/// A level that has been checked to be available on this CPU.
///
/// The field is private and the only constructors check availability, so holding a `Verified`
/// is the proof the `unsafe` dispatch to `#[target_feature]` kernels relies on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Verified(SimdLevel);

impl Verified {
    /// Checks `level` against the CPU.
    pub(crate) fn new(level: SimdLevel) -> Result<Self, Error> {
        if level.is_available() {
            Ok(Verified(level))
        } else {
            Err(Error::UnsupportedLevel {
                level,
                available: available_levels()
                    .iter()
                    .map(|l| l.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    }

    /// The process-wide level ([`detected_level`] only returns available levels).
    pub(crate) fn detected() -> Self {
        Verified(detected_level())
    }

    /// The checked level.
    pub(crate) fn level(self) -> SimdLevel {
        self.0
    }
}

/// Proof that this CPU has AVX-512 F/BW/VL and VNNI and that the AVX-512 level was chosen:
/// only [`Vnni::detect`] makes one, so holding it is what the `unsafe` calls of the indexer's
/// VNNI kernels (`attn::index::avx512::index_tile16`) from the AVX2 tile loop rely on;
/// [`Vnni::vbmi`] says whether the fused kernel (`index_tile16_fused`) may be called too.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Vnni {
    vbmi: bool,
}

#[cfg(target_arch = "x86_64")]
impl Vnni {
    /// A token if `level` is the AVX-512 level and the CPU has VNNI.
    pub(crate) fn detect(level: Verified) -> Option<Vnni> {
        (level.level() == SimdLevel::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni"))
            .then(|| Vnni {
                vbmi: std::arch::is_x86_feature_detected!("avx512vbmi"),
            })
    }

    /// Whether the CPU also has AVX-512 VBMI (`vpermb`), which the fused kernel needs.
    pub(crate) fn vbmi(self) -> bool {
        self.vbmi
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_roundtrip() {
        for l in SimdLevel::ALL {
            assert_eq!(l.to_string().parse::<SimdLevel>(), Ok(l));
        }
        let err = "sse9".parse::<SimdLevel>().unwrap_err();
        assert!(err.to_string().contains("\"sse9\""), "{err}");
    }

    #[test]
    fn detected_is_available_and_portable_always_is() {
        assert!(detected_level().is_available());
        assert_eq!(available_levels().first(), Some(&SimdLevel::Portable));
        assert!(available_levels().contains(&detected_level()));
    }

    #[test]
    fn unavailable_level_is_an_error_naming_it() {
        for l in SimdLevel::ALL {
            match Verified::new(l) {
                Ok(v) => assert_eq!(v.level(), l),
                Err(e) => {
                    assert!(!l.is_available());
                    let msg = e.to_string();
                    assert!(msg.contains(l.name()) && msg.contains("portable"), "{msg}");
                }
            }
        }
    }
}
