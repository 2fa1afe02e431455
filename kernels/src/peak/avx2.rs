//! AVX2 + FMA ceiling loops. Callers hold a [`crate::level::Verified`] AVX2 or AVX-512 level.

use core::arch::x86_64::*;

use zerocopy::transmute_ref;

use super::CHAINS;
use crate::x86::avx2::{ld_si256, to_array_epi32, to_array_ps};

/// `iters` iterations of 12 independent 8-lane FMAs (`12 * 16` FLOP each). Returns a value
/// derived from the accumulators so that the work cannot be elided.
#[target_feature(enable = "avx2,fma")]
pub(super) fn fma_peak(iters: u64, seed: f32) -> f32 {
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for (i, x) in acc.iter_mut().enumerate() {
        *x = _mm256_add_ps(*x, _mm256_set1_ps(i as f32));
    }
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    to_array_ps(s).iter().sum()
}

/// `iters` iterations of 12 independent `vpmaddubsw` + `vpaddw` pairs (32 multiply-adds of
/// 8-bit integers each), the instruction mix of the indexer's inner loop. Each chain feeds its
/// own result back as the next unsigned operand, so nothing can be hoisted.
#[target_feature(enable = "avx2,fma")]
pub(super) fn int8_peak(iters: u64, seed: i32) -> i32 {
    let q = _mm256_set1_epi8(3);
    let d = _mm256_set1_epi16(1);
    let mut acc = [_mm256_set1_epi32(seed); CHAINS];
    for (i, x) in acc.iter_mut().enumerate() {
        *x = _mm256_add_epi32(*x, _mm256_set1_epi32(i as i32));
    }
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_add_epi16(_mm256_maddubs_epi16(*x, q), d);
        }
    }
    let mut s = _mm256_setzero_si256();
    for x in acc {
        s = _mm256_add_epi32(s, x);
    }
    to_array_epi32(s)
        .iter()
        .fold(0i32, |a, &b| a.wrapping_add(b))
}

/// Wrapping sum of the bytes as 64-bit words, 128 bytes per step into four accumulators: a
/// read stream fast enough to be limited by memory, for the bandwidth baseline.
#[target_feature(enable = "avx2,fma")]
pub(super) fn read_sum(bytes: &[u8]) -> u64 {
    let (blocks, tail) = bytes.as_chunks::<128>();
    let mut acc = [_mm256_setzero_si256(); 4];
    for b in blocks {
        let b: &[[u8; 32]; 4] = transmute_ref!(b);
        for (a, v) in acc.iter_mut().zip(b) {
            *a = _mm256_add_epi64(*a, ld_si256(v));
        }
    }
    let [a0, a1, a2, a3] = acc;
    let s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    let lanes = to_array_epi32(s);
    let mut total = super::read_sum_portable(tail);
    for pair in lanes.as_chunks::<2>().0 {
        let w = (u64::from(pair[1] as u32) << 32) | u64::from(pair[0] as u32);
        total = total.wrapping_add(w);
    }
    total
}
