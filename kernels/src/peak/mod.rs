//! Machine ceilings for benchmarks: a memory-read stream and register-resident FMA and 8-bit
//! integer multiply-add loops, one per [`SimdLevel`].
//!
//! A benchmark compares a kernel's rate with what this machine can do at best in the same run:
//! bytes read per second ([`Peaks::read_sum`]), f32 multiply-adds per second ([`Peaks::fma`])
//! and the 8-bit integer multiply-adds of the indexer's instruction mix ([`Peaks::int8`]). The
//! loops touch no memory besides their input (the compute loops none at all), so their rates
//! are the ceilings the kernels are held to. Each loop returns a value derived from all of its
//! work, so that the work cannot be elided; pass the iteration count and the result through
//! [`std::hint::black_box`].
//!
//! [`Peaks`] is made for one level after checking it against the CPU, as every `_with(level,
//! ..)` entry point of the crate does, so its loops are safe to call.
//!
//! ```
//! use kvstack_kernels::peak::Peaks;
//!
//! let p = Peaks::detected();
//! // 128 words of eight 1 bytes.
//! assert_eq!(p.read_sum(&[1u8; 1024]), 128 * 0x0101_0101_0101_0101);
//! let flops = p.fma_flops_per_iter() * 1000;
//! assert!(p.fma(1000, 0.5).is_finite() && flops > 0);
//! ```

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use crate::level::Verified;
use crate::{Error, SimdLevel};

/// Independent accumulator chains of every compute loop: two FMA pipes with a 4-5 cycle
/// latency need at least 10 chains in flight; 12 fit the register file with the two constant
/// operands.
const CHAINS: usize = 12;

/// The 8-bit integer multiply-add instruction the indexer scan runs at a level, whose peak
/// [`Peaks::int8`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int8Kernel {
    /// AVX2 `vpmaddubsw` + `vpaddw`: 32 multiply-adds per instruction pair.
    Vpmaddubsw,
    /// AVX-512 VNNI `vpdpbusd`: 64 multiply-adds per instruction (the AVX-512 level on a CPU
    /// with VNNI).
    Vpdpbusd,
}

impl Int8Kernel {
    /// The instruction's name: `vpmaddubsw`, `vpdpbusd`.
    pub const fn name(self) -> &'static str {
        match self {
            Int8Kernel::Vpmaddubsw => "vpmaddubsw",
            Int8Kernel::Vpdpbusd => "vpdpbusd",
        }
    }

    /// Multiply-adds per iteration of [`Peaks::int8`]: one instruction (pair) per chain.
    pub const fn macs_per_iter(self) -> u64 {
        match self {
            Int8Kernel::Vpmaddubsw => CHAINS as u64 * 32,
            Int8Kernel::Vpdpbusd => CHAINS as u64 * 64,
        }
    }
}

/// The ceiling loops of one SIMD level, checked to run on this CPU.
#[derive(Clone, Copy, Debug)]
pub struct Peaks {
    level: Verified,
    int8: Option<Int8Kernel>,
}

impl Peaks {
    /// The loops of `level`.
    ///
    /// # Errors
    ///
    /// [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
    pub fn new(level: SimdLevel) -> Result<Self, Error> {
        Ok(Peaks::of(Verified::new(level)?))
    }

    /// The loops of the process-wide [`crate::detected_level`].
    pub fn detected() -> Self {
        Peaks::of(Verified::detected())
    }

    fn of(level: Verified) -> Self {
        #[cfg(target_arch = "x86_64")]
        let int8 = match level.level() {
            SimdLevel::Portable => None,
            SimdLevel::Avx2 | SimdLevel::Avx512 => {
                Some(if crate::level::Vnni::detect(level).is_some() {
                    Int8Kernel::Vpdpbusd
                } else {
                    Int8Kernel::Vpmaddubsw
                })
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        let int8 = None;
        Peaks { level, int8 }
    }

    /// The level whose loops these are.
    pub fn level(&self) -> SimdLevel {
        self.level.level()
    }

    /// Wrapping sum of `bytes` as little-endian 64-bit words: a read stream fast enough to be
    /// bound by memory, for the read-bandwidth ceiling. When `bytes.len()` is a multiple of
    /// 128 the result is the wrapping sum of its words on every level; a shorter tail is
    /// summed in its own level-dependent way.
    pub fn read_sum(&self, bytes: &[u8]) -> u64 {
        match self.level.level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `self.level` is `Verified` as AVX2 or AVX-512 (which includes AVX2 and
            // FMA), so this CPU has AVX2 and FMA. A read stream is memory-bound at either width.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::read_sum(bytes) },
            _ => read_sum_portable(bytes),
        }
    }

    /// FLOPs (2 per multiply-add) of one iteration of [`Peaks::fma`]: 12 chains of 8 lanes,
    /// or of 16 lanes at [`SimdLevel::Avx512`].
    pub fn fma_flops_per_iter(&self) -> u64 {
        let lanes = match self.level.level() {
            SimdLevel::Avx512 => 16,
            SimdLevel::Portable | SimdLevel::Avx2 => 8,
        };
        CHAINS as u64 * lanes * 2
    }

    /// `iters` iterations of 12 independent vector multiply-add chains in registers: fused
    /// multiply-adds of 256 bits (AVX2) or 512 bits (AVX-512); on the portable level a plain
    /// multiply and add per lane (two roundings, as the portable kernels compute). `seed`
    /// starts the chains. Returns a value derived from every chain.
    pub fn fma(&self, iters: u64, seed: f32) -> f32 {
        match self.level.level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `self.level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
            SimdLevel::Avx2 => unsafe { avx2::fma_peak(iters, seed) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `self.level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL,
            // AVX2 and FMA.
            SimdLevel::Avx512 => unsafe { avx512::fma_peak(iters, seed) },
            _ => fma_portable(iters, seed),
        }
    }

    /// The 8-bit multiply-add the indexer scan runs at this level on this CPU (`None` on
    /// [`SimdLevel::Portable`], whose indexer has no integer kernel).
    pub fn int8_kernel(&self) -> Option<Int8Kernel> {
        self.int8
    }

    /// `iters` iterations of 12 independent chains of [`Peaks::int8_kernel`]'s instruction
    /// in registers (each chain feeds its result back as the next operand, so nothing can be
    /// hoisted); `seed` starts the chains. Returns a value derived from every chain, or
    /// `None` without an integer kernel.
    pub fn int8(&self, iters: u64, seed: i32) -> Option<i32> {
        match self.int8? {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Vpdpbusd` is chosen only when `crate::level::Vnni::detect` found the
            // AVX-512 level verified and AVX-512 VNNI on this CPU.
            Int8Kernel::Vpdpbusd => Some(unsafe { avx512::int8_peak_vnni(iters, seed) }),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: an integer kernel exists only at a `Verified` AVX2 or AVX-512 level,
            // so this CPU has AVX2 and FMA.
            Int8Kernel::Vpmaddubsw => Some(unsafe { avx2::int8_peak(iters, seed) }),
            #[cfg(not(target_arch = "x86_64"))]
            _ => None,
        }
    }
}

/// Wrapping sum of all 8-byte words (and the tail bytes). Eight independent accumulators let
/// LLVM vectorize it.
fn read_sum_portable(bytes: &[u8]) -> u64 {
    let (words, tail) = bytes.as_chunks::<64>();
    let mut acc = [0u64; 8];
    for w in words {
        for (a, c) in acc.iter_mut().zip(w.as_chunks::<8>().0) {
            *a = a.wrapping_add(u64::from_le_bytes(*c));
        }
    }
    let t = tail.iter().fold(0u64, |s, &b| s.wrapping_add(u64::from(b)));
    acc.iter().fold(t, |s, &a| s.wrapping_add(a))
}

/// The portable stand-in for the FMA loop: 12 chains of 8-lane multiply-add.
fn fma_portable(iters: u64, seed: f32) -> f32 {
    let mut acc = [[seed; 8]; CHAINS];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            for x in a.iter_mut() {
                *x = *x * 0.999_999 + 1e-7;
            }
        }
    }
    acc.iter().flatten().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::available_levels;

    #[test]
    fn every_available_level_has_its_loops_and_others_are_refused() {
        for l in SimdLevel::ALL {
            match Peaks::new(l) {
                Ok(p) => {
                    assert!(l.is_available());
                    assert_eq!(p.level(), l);
                    assert!(p.fma(100, 0.25).is_finite(), "{l}");
                    assert_eq!(p.int8(100, 1).is_some(), p.int8_kernel().is_some(), "{l}");
                    assert_eq!(p.int8_kernel().is_none(), l == SimdLevel::Portable, "{l}");
                }
                Err(e) => {
                    assert!(!l.is_available());
                    assert!(matches!(e, Error::UnsupportedLevel { level, .. } if level == l));
                }
            }
        }
        assert_eq!(Peaks::detected().level(), crate::detected_level());
    }

    #[test]
    fn read_sum_is_the_word_sum_on_every_level() {
        let bytes: Vec<u8> = (0..128 * 37).map(|i| (i * 131 % 251) as u8).collect();
        let words = bytes
            .as_chunks::<8>()
            .0
            .iter()
            .fold(0u64, |s, w| s.wrapping_add(u64::from_le_bytes(*w)));
        for l in available_levels() {
            let p = Peaks::new(l).unwrap_or_else(|_| Peaks::detected());
            assert_eq!(p.read_sum(&bytes), words, "{l}");
        }
    }

    #[test]
    fn flop_counts_follow_the_vector_width() {
        for l in available_levels() {
            let p = Peaks::new(l).unwrap_or_else(|_| Peaks::detected());
            let want = if l == SimdLevel::Avx512 { 384 } else { 192 };
            assert_eq!(p.fma_flops_per_iter(), want, "{l}");
        }
        assert_eq!(Int8Kernel::Vpmaddubsw.macs_per_iter(), 384);
        assert_eq!(Int8Kernel::Vpdpbusd.macs_per_iter(), 768);
    }
}
