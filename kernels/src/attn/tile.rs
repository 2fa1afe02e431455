//! Aligned storage shared by the attention kernels (plain Rust, every level).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::HEAD_DIM;

/// Eight f32 aligned to 32 bytes: one AVX2 vector, so no vector load of a `V8` buffer splits a
/// cache line.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub(crate) struct V8(pub(crate) [f32; 8]);

/// One dequantized 512-wide entry, aligned to a cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub(crate) struct Row512(pub(crate) [f32; HEAD_DIM]);

/// A `V8` buffer as f32 values.
pub(crate) fn flat(v: &[V8]) -> &[f32] {
    <[f32]>::ref_from_bytes(v.as_bytes()).unwrap_or_default()
}

/// A `V8` buffer as mutable f32 values.
pub(crate) fn flat_mut(v: &mut [V8]) -> &mut [f32] {
    <[f32]>::mut_from_bytes(v.as_mut_bytes()).unwrap_or_default()
}

/// `n` zeroed f32 (rounded up to whole vectors) in 32-byte aligned storage.
pub(crate) fn zeroed(n: usize) -> Vec<V8> {
    vec![V8::default(); n.div_ceil(8)]
}

/// The queries transposed, `qt[d * hp + h] = q[h][d]`, heads padded with zeros to `hp`.
pub(crate) fn transpose_q(q: &[[f32; HEAD_DIM]], hp: usize) -> Vec<V8> {
    let mut qt = zeroed(HEAD_DIM * hp);
    let f = flat_mut(&mut qt);
    for (h, row) in q.iter().enumerate().take(hp) {
        for (d, &x) in row.iter().enumerate() {
            if let Some(t) = f.get_mut(d * hp + h) {
                *t = x;
            }
        }
    }
    qt
}
