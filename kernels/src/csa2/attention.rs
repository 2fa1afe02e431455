//! Sparse attention of one query token (spec §4 core attention): the keys are the FP8 window
//! rows and the FP4 compressed entries the top-k selected (duplicates kept; `-1` slots are the
//! caller's to skip), each both key and value (`V = K`, MQA with one shared latent head).
//!
//! `logit = (q_h · k) · scale` with `scale = head_dim^-1/2`; one sink logit per head adds
//! `exp(sink_h)` to the denominator only; the result per head is `Σ_i p_i k_i`.
//!
//! - [`sparse_attention_ref`]: dequantizes every key into an f32 matrix, computes every logit,
//!   a two-pass softmax ([`super::softmax::softmax_with_sink_ref`]) and `P · K`, as the
//!   reference's eager path does (without its masked columns, which contribute exact zeros).
//! - [`SparseAttention`]: decodes each key row once into a scratch row (SIMD at 512 wide) and
//!   uses it for every head's dot and, through [`super::softmax::OnlineSoftmax`], for the
//!   weighted sum of values, so nothing is materialized beyond one row. Its results differ
//!   from the reference by rounding only (summation order of the dots and of `P · V`).

use kvstack_firmware_interface::EntryFormat;

use super::quant::RowCodec;
use super::softmax::{OnlineSoftmax, softmax_with_sink_ref};
use super::{Error, check_len};

/// One attended key: a quantized row of the window (FP8) or of the compressed cache (FP4).
#[derive(Clone, Copy, Debug)]
pub enum KeyRow<'a> {
    /// An FP8 window row.
    Window(&'a [u8]),
    /// An FP4 compressed entry.
    Compressed(&'a [u8]),
    /// A row already decoded with [`AttentionShape::decode_row`] (prefill decodes each key
    /// once per step instead of once per query; the values, and so the results, are the
    /// same).
    Decoded(&'a [f32]),
}

/// Shapes and codecs of the attention of one layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Width of a head and of the shared key/value row.
    pub head_dim: usize,
    /// Logit scale (`head_dim^-1/2`).
    pub scale: f32,
    window: RowCodec,
    compressed: RowCodec,
}

impl AttentionShape {
    /// The shape for `heads` heads of `head_dim` (FP8 window rows and FP4 entries of that
    /// width), scale `head_dim^-1/2`.
    pub fn new(heads: usize, head_dim: usize) -> Result<AttentionShape, Error> {
        if heads == 0 {
            return Err(Error::Param {
                what: "attention heads",
                reason: "must be at least 1".into(),
            });
        }
        Ok(AttentionShape {
            heads,
            head_dim,
            scale: (head_dim as f64).powf(-0.5) as f32,
            window: RowCodec::new(EntryFormat::WindowFp8, head_dim)?,
            compressed: RowCodec::new(EntryFormat::GlobalFp4, head_dim)?,
        })
    }

    /// The window row codec.
    pub fn window_codec(&self) -> RowCodec {
        self.window
    }

    /// The compressed entry codec.
    pub fn compressed_codec(&self) -> RowCodec {
        self.compressed
    }

    /// Decodes a key row to `head_dim` f32 values with the fast codec (what
    /// [`SparseAttention::run`] does for each quantized key).
    pub fn decode_row(&self, key: KeyRow<'_>, out: &mut [f32]) -> Result<(), Error> {
        self.decode(key, out, false)
    }

    fn decode(&self, key: KeyRow<'_>, out: &mut [f32], reference: bool) -> Result<(), Error> {
        let (codec, bytes) = match key {
            KeyRow::Window(b) => (self.window, b),
            KeyRow::Compressed(b) => (self.compressed, b),
            KeyRow::Decoded(v) => {
                check_len("decoded key row [head_dim]", out.len(), v.len())?;
                out.copy_from_slice(v);
                return Ok(());
            }
        };
        if reference {
            codec.dequantize_ref(bytes, out)
        } else {
            codec.dequantize(bytes, out)
        }
    }

    fn check(&self, q: &[f32], sinks: &[f32], out: &[f32]) -> Result<(), Error> {
        check_len(
            "attention query [heads, head_dim]",
            self.heads * self.head_dim,
            q.len(),
        )?;
        check_len("attention sinks [heads]", self.heads, sinks.len())?;
        check_len(
            "attention output [heads, head_dim]",
            self.heads * self.head_dim,
            out.len(),
        )
    }
}

/// Reference attention of one query token over `keys`.
pub fn sparse_attention_ref(
    shape: &AttentionShape,
    q: &[f32],
    sinks: &[f32],
    keys: &[KeyRow<'_>],
    out: &mut [f32],
) -> Result<(), Error> {
    shape.check(q, sinks, out)?;
    let d = shape.head_dim;
    let mut kmat = vec![0f32; keys.len() * d];
    for (&key, row) in keys.iter().zip(kmat.chunks_exact_mut(d.max(1))) {
        shape.decode(key, row, true)?;
    }
    let mut logits = vec![0f32; keys.len()];
    let mut p = vec![0f32; keys.len()];
    for ((qh, &sink), oh) in q.chunks_exact(d).zip(sinks).zip(out.chunks_exact_mut(d)) {
        for (l, k) in logits.iter_mut().zip(kmat.chunks_exact(d)) {
            let mut dot = 0f32;
            for (a, b) in qh.iter().zip(k) {
                dot += a * b;
            }
            *l = dot * shape.scale;
        }
        softmax_with_sink_ref(&logits, sink, &mut p)?;
        oh.fill(0.0);
        for (&pi, k) in p.iter().zip(kmat.chunks_exact(d)) {
            for (o, &v) in oh.iter_mut().zip(k) {
                *o += pi * v;
            }
        }
    }
    Ok(())
}

/// Fast attention with reusable buffers (one per thread).
#[derive(Clone, Debug)]
pub struct SparseAttention {
    shape: AttentionShape,
    row: Vec<f32>,
    heads: Vec<OnlineSoftmax>,
}

impl SparseAttention {
    /// Buffers for `shape`.
    pub fn new(shape: AttentionShape) -> SparseAttention {
        SparseAttention {
            shape,
            row: vec![0.0; shape.head_dim],
            heads: (0..shape.heads)
                .map(|_| OnlineSoftmax::new(shape.head_dim, 0.0))
                .collect(),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }

    /// Attention of one query token (`q`: `[heads, head_dim]`) over `keys`, into `out`
    /// (`[heads, head_dim]`).
    pub fn run<'k>(
        &mut self,
        q: &[f32],
        sinks: &[f32],
        keys: impl IntoIterator<Item = KeyRow<'k>>,
        out: &mut [f32],
    ) -> Result<(), Error> {
        let shape = self.shape;
        shape.check(q, sinks, out)?;
        let d = shape.head_dim;
        for (h, &s) in self.heads.iter_mut().zip(sinks) {
            h.reset(s);
        }
        let avx2 = crate::level::detected_level() != crate::level::SimdLevel::Portable;
        for key in keys {
            let row: &[f32] = match key {
                KeyRow::Decoded(v) => {
                    check_len("decoded key row [head_dim]", d, v.len())?;
                    v
                }
                _ => {
                    shape.decode(key, &mut self.row, false)?;
                    &self.row
                }
            };
            if avx2 {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `detected_level` reports AVX2 (or better) only when the CPU has
                // AVX2 and FMA, the features `key_step_avx2` is compiled for.
                unsafe {
                    key_step_avx2(q, row, shape.scale, &mut self.heads);
                }
                #[cfg(not(target_arch = "x86_64"))]
                key_step(q, row, shape.scale, &mut self.heads);
            } else {
                key_step(q, row, shape.scale, &mut self.heads);
            }
        }
        for (acc, oh) in self.heads.iter().zip(out.chunks_exact_mut(d)) {
            acc.finish(oh)?;
        }
        Ok(())
    }
}

/// One key for every head: the logit `q_h . row * scale`, pushed with the value `row` (the
/// same key, V = K).
#[inline(always)]
fn key_step(q: &[f32], row: &[f32], scale: f32, heads: &mut [OnlineSoftmax]) {
    let d = row.len();
    for (qh, acc) in q.chunks_exact(d.max(1)).zip(heads.iter_mut()) {
        acc.push(dot8(qh, row) * scale, row);
    }
}

/// [`key_step`] compiled for AVX2: the same operations in the same order on wider vectors
/// (Rust never fuses a multiply and an add on its own), so the results are bit-identical to
/// the baseline build's.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn key_step_avx2(q: &[f32], row: &[f32], scale: f32, heads: &mut [OnlineSoftmax]) {
    let d = row.len().max(1);
    let mut groups = heads.chunks_exact_mut(4);
    let mut at = 0;
    for g in &mut groups {
        // Four heads at once: four independent add chains instead of one.
        let dots = dot8x4_avx2(&q[at..at + 4 * d], row);
        for (acc, dot) in g.iter_mut().zip(dots) {
            acc.push(dot * scale, row);
        }
        at += 4 * d;
    }
    for (qh, acc) in q[at..]
        .chunks_exact(d)
        .zip(groups.into_remainder().iter_mut())
    {
        acc.push(dot8_avx2(qh, row) * scale, row);
    }
}

/// [`dot8`] of four consecutive `b.len()`-wide rows of `a` with `b`, each bit-identical to
/// [`dot8_avx2`] (the same lanes, order and reduction per row; the rows only interleave).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot8x4_avx2(a: &[f32], b: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let d = b.len();
    let (bc, br) = b.as_chunks::<8>();
    let rows: [&[f32]; 4] = [&a[..d], &a[d..2 * d], &a[2 * d..3 * d], &a[3 * d..4 * d]];
    let chunks = rows.map(|r| r.as_chunks::<8>().0);
    let mut v = [_mm256_setzero_ps(); 4];
    for (c, y) in bc.iter().enumerate() {
        // SAFETY: `y` and each `chunks[k][c]` are arrays of 8 f32 (one unaligned load each;
        // every row has as many whole chunks as `b`).
        unsafe {
            let yv = _mm256_loadu_ps(y.as_ptr());
            for (vk, ck) in v.iter_mut().zip(&chunks) {
                *vk = _mm256_add_ps(*vk, _mm256_mul_ps(_mm256_loadu_ps(ck[c].as_ptr()), yv));
            }
        }
    }
    let mut out = [0f32; 4];
    for ((o, vk), r) in out.iter_mut().zip(v).zip(rows) {
        let mut acc = [0f32; 8];
        // SAFETY: `acc` holds 8 f32, one unaligned 256-bit store.
        unsafe { _mm256_storeu_ps(acc.as_mut_ptr(), vk) };
        let mut tail = 0f32;
        for (x, y) in r[bc.len() * 8..].iter().zip(br) {
            tail += x * y;
        }
        *o = ((acc[0] + acc[4]) + (acc[1] + acc[5]))
            + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
            + tail;
    }
    out
}

/// [`dot8`] with AVX2 intrinsics: lane `i` of the accumulator is `dot8`'s `acc[i]`, updated
/// with a separate multiply and add (no FMA) in the same order, and reduced the same way, so
/// the result is bit-identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot8_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    let mut v = _mm256_setzero_ps();
    for (x, y) in ac.iter().zip(bc) {
        // SAFETY: `x` and `y` are arrays of 8 f32, exactly one unaligned 256-bit load each.
        let (xv, yv) = unsafe { (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr())) };
        v = _mm256_add_ps(v, _mm256_mul_ps(xv, yv));
    }
    let mut acc = [0f32; 8];
    // SAFETY: `acc` holds 8 f32, one unaligned 256-bit store.
    unsafe { _mm256_storeu_ps(acc.as_mut_ptr(), v) };
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// f32 dot with eight partial sums (vectorizable).
#[inline(always)]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// The AVX2 key loop (heads in groups of four, then the rest) gives exactly the portable
    /// loop's bits, for head counts with and without a remainder and a width with a tail.
    #[test]
    fn avx2_key_step_is_bit_identical_to_the_portable_one() {
        if !crate::level::SimdLevel::Avx2.is_available() {
            return;
        }
        let mut x = 0x2545_f491_u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        for (heads, d) in [(4usize, 512usize), (6, 64), (3, 36), (9, 520)] {
            let q: Vec<f32> = (0..heads * d).map(|_| next()).collect();
            let mut a: Vec<OnlineSoftmax> =
                (0..heads).map(|_| OnlineSoftmax::new(d, 0.5)).collect();
            let mut b = a.clone();
            for _ in 0..40 {
                let row: Vec<f32> = (0..d).map(|_| next()).collect();
                key_step(&q, &row, 0.125, &mut a);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 and FMA were checked above.
                unsafe {
                    key_step_avx2(&q, &row, 0.125, &mut b);
                }
            }
            for (h, (x, y)) in a.iter().zip(&b).enumerate() {
                let (mut ox, mut oy) = (vec![0f32; d], vec![0f32; d]);
                x.finish(&mut ox).unwrap();
                y.finish(&mut oy).unwrap();
                let same = ox.iter().zip(&oy).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "heads {heads}, width {d}: head {h} differs");
            }
        }
    }
}
