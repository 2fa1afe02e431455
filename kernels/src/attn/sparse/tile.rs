//! Aligned storage shared by the attention kernels (plain Rust, every level).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::attn::HEAD_DIM;

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
///
/// Done in 16 x 16 blocks: writing one head's 512 values at a stride of `hp` floats touches
/// 512 lines that map onto a few L1 sets (65 us for 64 heads); a block reads 16 lines and
/// writes 16 whole lines.
pub(crate) fn transpose_q(q: &[[f32; HEAD_DIM]], hp: usize) -> Vec<V8> {
    const B: usize = 16;
    let mut qt = zeroed(HEAD_DIM * hp);
    let f = flat_mut(&mut qt);
    let q = q.get(..q.len().min(hp)).unwrap_or_default();
    for (hb, heads) in q.chunks(B).enumerate() {
        for db in (0..HEAD_DIM).step_by(B) {
            for (i, row) in heads.iter().enumerate() {
                let src = row.get(db..db + B).unwrap_or_default();
                for (j, &x) in src.iter().enumerate() {
                    if let Some(t) = f.get_mut((db + j) * hp + hb * B + i) {
                        *t = x;
                    }
                }
            }
        }
    }
    qt
}
