//! AVX-512 ceiling loops. Callers hold a [`crate::level::Verified`] AVX-512 level (and, for
//! the VNNI loop, the crate's proof that the CPU has VNNI).

use core::arch::x86_64::*;

use super::CHAINS;
use crate::x86::avx512::to_array_ps;

/// `iters` iterations of 12 independent 16-lane FMA chains: this CPU's 512-bit FMA peak (the
/// construction of [`super::avx2::fma_peak`] at twice the width).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) fn fma_peak(iters: u64, seed: f32) -> f32 {
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc: [__m512; CHAINS] =
        std::array::from_fn(|i| _mm512_add_ps(_mm512_set1_ps(seed), _mm512_set1_ps(i as f32)));
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    to_array_ps(s).iter().sum()
}

/// `iters` iterations of 12 independent `vpdpbusd` chains (64 multiply-adds of 8-bit integers
/// each): the integer peak of the VNNI indexer kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) fn int8_peak_vnni(iters: u64, seed: i32) -> i32 {
    let q = _mm512_set1_epi8(3);
    let mut acc: [__m512i; CHAINS] = std::array::from_fn(|i| _mm512_set1_epi32(seed + i as i32));
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbusd_epi32(*x, *x, q);
        }
    }
    let mut s = _mm512_setzero_si512();
    for x in acc {
        s = _mm512_add_epi32(s, x);
    }
    _mm512_reduce_add_epi32(s)
}
