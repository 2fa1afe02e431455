//! Portable attention worker: plain Rust over one entry at a time, written so that LLVM can
//! vectorize the 512-wide loops for the build's baseline target.

use super::tile::flat_mut;
use super::{KvRow, LOGIT_SCALE, Partial};
use crate::attn::HEAD_DIM;

/// Dequantizes one attended entry into `out`.
pub(crate) fn dequantize_row(row: &KvRow<'_>, out: &mut [f32; HEAD_DIM]) {
    let out = std::slice::from_mut(out);
    match row {
        KvRow::Fp8(e) => crate::portable::dequantize_fp8(std::slice::from_ref(*e), out),
        KvRow::Fp4(e) => crate::portable::dequantize_fp4(std::slice::from_ref(*e), out),
    }
}

/// `a . b` with 16 lane accumulators summed pairwise.
fn dot(a: &[f32; HEAD_DIM], b: &[f32; HEAD_DIM]) -> f32 {
    let mut acc = [0f32; 16];
    for (x, y) in a.as_chunks::<16>().0.iter().zip(b.as_chunks::<16>().0) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut n = 16;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            acc[i] += acc[i + n];
        }
    }
    acc[0]
}

/// Online softmax over `rows`, one entry at a time, into `st` (heads `q.len()`).
pub(crate) fn attend(q: &[[f32; HEAD_DIM]], rows: &[KvRow<'_>], st: &mut Partial) {
    let mut v = [0f32; HEAD_DIM];
    let o = flat_mut(&mut st.o);
    for row in rows {
        dequantize_row(row, &mut v);
        for (((qh, m), l), oh) in q
            .iter()
            .zip(st.m.iter_mut())
            .zip(st.l.iter_mut())
            .zip(o.chunks_exact_mut(HEAD_DIM))
        {
            let s = dot(qh, &v) * LOGIT_SCALE;
            let mn = m.max(s);
            // exp(-inf) = 0 drops the empty initial state.
            let alpha = (*m - mn).exp();
            let p = (s - mn).exp();
            *l = *l * alpha + p;
            *m = mn;
            for (x, &vd) in oh.iter_mut().zip(&v) {
                *x = *x * alpha + p * vd;
            }
        }
    }
}
