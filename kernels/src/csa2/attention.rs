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
//!   from the reference by rounding only (summation order of the dots and of `P · V`), and
//!   are the same bits at every SIMD level: the AVX2 loop runs four heads at once, the AVX-512
//!   one two heads per vector over batches of keys, each with the portable loop's fused
//!   multiply-adds per element in the same order (`f32::mul_add` there, exact on every CPU)
//!   and the softmax's exponentials by [`super::softmax::exp_nonpositive`] (its vector form
//!   on AVX-512), so prefill, decode and every level agree bit for bit.

use kvstack_firmware_interface::EntryFormat;

use super::quant::RowCodec;
#[cfg(target_arch = "x86_64")]
use super::softmax::{EXP_FLOOR, EXP_POLY, LN2_HI, LN2_LO, exp_argument};
use super::softmax::{OnlineSoftmax, PushStep, softmax_with_sink_ref};
use super::{Error, check_len};
use crate::aligned::AlignedF32;
use crate::level::{SimdLevel, Verified};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m512, _mm512_setzero_ps};

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

impl KeyRow<'_> {
    /// The bytes of the stored (quantized) row; 0 for a row already decoded.
    pub fn stored_bytes(&self) -> usize {
        match self {
            KeyRow::Window(b) | KeyRow::Compressed(b) => b.len(),
            KeyRow::Decoded(_) => 0,
        }
    }
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
    /// The row's stored bytes count as attention cache bytes read ([`crate::work`]).
    pub fn decode_row(&self, key: KeyRow<'_>, out: &mut [f32]) -> Result<(), Error> {
        self.decode(key, out, false)?;
        crate::work::add_attention_bytes(key.stored_bytes() as u64);
        Ok(())
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
    level: Verified,
    /// Decoded key rows: one for the portable and AVX2 loops, [`KEY_BATCH`] for AVX-512.
    rows: AlignedF32,
    /// The query with heads interleaved in pairs for the AVX-512 dots (see [`interleave_pairs`]).
    pairs: AlignedF32,
    heads: Vec<OnlineSoftmax>,
}

/// Keys the AVX-512 path takes at once: their dots are independent add chains (a dot's own
/// chain is fixed by the bit-identity), and each accumulator element is loaded and stored once
/// for all of them.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const KEY_BATCH: usize = 8;

/// A key of the batch being gathered: borrowed when already decoded, else in a scratch row.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy)]
enum Gathered<'k> {
    Borrowed(&'k [f32]),
    Scratch(usize),
}

impl SparseAttention {
    /// Buffers for `shape`, computing with the process-wide SIMD level
    /// ([`crate::detected_level`]).
    pub fn new(shape: AttentionShape) -> SparseAttention {
        SparseAttention::build(shape, Verified::detected())
    }

    /// Buffers for `shape`, computing with `level` (every level gives the same bits; this is
    /// for benchmarks and tests). An error if this CPU cannot run `level`.
    pub fn with_level(shape: AttentionShape, level: SimdLevel) -> Result<SparseAttention, Error> {
        Ok(SparseAttention::build(shape, Verified::new(level)?))
    }

    fn build(shape: AttentionShape, level: Verified) -> SparseAttention {
        let rows = if level.level() == SimdLevel::Avx512 {
            KEY_BATCH
        } else {
            1
        };
        SparseAttention {
            shape,
            level,
            rows: AlignedF32::zeroed(rows * shape.head_dim),
            pairs: AlignedF32::default(),
            heads: (0..shape.heads)
                .map(|_| OnlineSoftmax::new(shape.head_dim, 0.0))
                .collect(),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }

    /// The SIMD level it computes with.
    pub fn level(&self) -> SimdLevel {
        self.level.level()
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
        // The work, counted once for the call (`crate::work`).
        let (mut visited, mut stored) = (0u64, 0u64);
        let keys = keys.into_iter().inspect(|k| {
            visited += 1;
            stored += k.stored_bytes() as u64;
        });
        match self.level.level() {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => self.keys_avx512(q, keys)?,
            level => {
                for key in keys {
                    let row: &[f32] = match key {
                        KeyRow::Decoded(v) => {
                            check_len("decoded key row [head_dim]", d, v.len())?;
                            v
                        }
                        _ => {
                            shape.decode(key, self.rows.as_mut_slice(), false)?;
                            self.rows.as_slice()
                        }
                    };
                    if level == SimdLevel::Avx2 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `self.level` is verified available, and the AVX2 level
                        // means the CPU has AVX2 and FMA, the features `key_step_avx2` is
                        // compiled for.
                        unsafe {
                            key_step_avx2(q, row, shape.scale, &mut self.heads);
                        }
                        #[cfg(not(target_arch = "x86_64"))]
                        key_step(q, row, shape.scale, &mut self.heads);
                    } else {
                        key_step(q, row, shape.scale, &mut self.heads);
                    }
                }
            }
        }
        crate::work::add_attention(visited * 2 * (shape.heads * d) as u64, stored);
        for (acc, oh) in self.heads.iter().zip(out.chunks_exact_mut(d.max(1))) {
            acc.finish(oh)?;
        }
        Ok(())
    }

    /// The AVX-512 key loop: keys in batches of [`KEY_BATCH`] (quantized ones decoded into the
    /// scratch rows), each batch through [`key_batch_avx512`], in key order.
    #[cfg(target_arch = "x86_64")]
    fn keys_avx512<'k>(
        &mut self,
        q: &[f32],
        keys: impl IntoIterator<Item = KeyRow<'k>>,
    ) -> Result<(), Error> {
        let shape = self.shape;
        let d = shape.head_dim;
        interleave_pairs(q, shape.heads, d, &mut self.pairs);
        let mut batch = [Gathered::Scratch(0); KEY_BATCH];
        let mut n = 0;
        let mut keys = keys.into_iter();
        loop {
            let key = keys.next();
            if let Some(key) = key {
                batch[n] = match key {
                    KeyRow::Decoded(v) => {
                        check_len("decoded key row [head_dim]", d, v.len())?;
                        Gathered::Borrowed(v)
                    }
                    _ => {
                        shape.decode(
                            key,
                            &mut self.rows.as_mut_slice()[n * d..(n + 1) * d],
                            false,
                        )?;
                        Gathered::Scratch(n)
                    }
                };
                n += 1;
            }
            if n == KEY_BATCH || (key.is_none() && n > 0) {
                let rows = batch.map(|g| match g {
                    Gathered::Borrowed(v) => v,
                    Gathered::Scratch(i) => &self.rows.as_slice()[i * d..(i + 1) * d],
                });
                // SAFETY: `self.level` is verified available and is AVX-512, which means
                // AVX-512 F and AVX2 + FMA, the features `key_batch_avx512` is compiled for.
                unsafe {
                    key_batch_avx512(
                        self.pairs.as_slice(),
                        q,
                        &rows[..n],
                        shape.scale,
                        &mut self.heads,
                    );
                }
                n = 0;
            }
            if key.is_none() {
                return Ok(());
            }
        }
    }
}

/// Lays the query `[heads, d]` out for the AVX-512 dots: for each pair of heads `(a, b)` and
/// each whole 8-wide chunk `c`, 16 floats: `q_a[8c..8c+8]` then `q_b[8c..8c+8]` (zeros for
/// `b` when the head count is odd). The chunks' tails stay in `q`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn interleave_pairs(q: &[f32], heads: usize, d: usize, out: &mut AlignedF32) {
    let chunks = d / 8;
    // Every element is written below (the odd head count's pad half included): no zeroing
    // per query.
    out.resize_for_overwrite(heads.div_ceil(2) * chunks * 16);
    let out = out.as_mut_slice();
    for (h, qh) in q.chunks_exact(d.max(1)).take(heads).enumerate() {
        let half = (h % 2) * 8;
        let base = (h / 2) * chunks * 16;
        for (c, x) in qh.as_chunks::<8>().0.iter().enumerate() {
            let at = base + c * 16 + half;
            out[at..at + 8].copy_from_slice(x);
        }
    }
    if heads % 2 == 1 {
        let base = (heads / 2) * chunks * 16;
        for c in 0..chunks {
            let at = base + c * 16 + 8;
            out[at..at + 8].fill(0.0);
        }
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
/// (the fused multiply-adds are `mul_add`'s, the exponential [`OnlineSoftmax::push`]'s), so
/// the results are bit-identical to the baseline build's.
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
        _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
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
                *vk = _mm256_fmadd_ps(_mm256_loadu_ps(ck[c].as_ptr()), yv, *vk);
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
            tail = x.mul_add(*y, tail);
        }
        *o = ((acc[0] + acc[4]) + (acc[1] + acc[5]))
            + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
            + tail;
    }
    out
}

/// [`dot8`] with AVX2 intrinsics: lane `i` of the accumulator is `dot8`'s `acc[i]`, updated
/// with the same fused multiply-adds in the same order, and reduced the same way, so the
/// result is bit-identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot8_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::{
        _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    let mut v = _mm256_setzero_ps();
    for (x, y) in ac.iter().zip(bc) {
        // SAFETY: `x` and `y` are arrays of 8 f32, exactly one unaligned 256-bit load each.
        let (xv, yv) = unsafe { (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr())) };
        v = _mm256_fmadd_ps(xv, yv, v);
    }
    let mut acc = [0f32; 8];
    // SAFETY: `acc` holds 8 f32, one unaligned 256-bit store.
    unsafe { _mm256_storeu_ps(acc.as_mut_ptr(), v) };
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail = x.mul_add(*y, tail);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// A batch of keys (`rows`, in key order, at most [`KEY_BATCH`]) for every head with AVX-512:
/// the same operations as [`key_step`] on each key in turn, on wider vectors.
///
/// - Dots: two heads share a 512-bit accumulator (lanes 0-7 head `a`, 8-15 head `b`; the row
///   chunk is broadcast to both halves), so each lane is [`dot8`]'s lane: the same fused
///   multiply-adds in the same order, reduced the same way with the same scalar tail. The
///   keys' dots are independent, so a batch runs 16 chains at once.
/// - Logits: the dots' lane sums for the whole group and batch in vectors
///   ([`logits_avx512`]), the same additions as [`dot8`]'s.
/// - Pushes: a whole batch in which every key only accumulates (no new maximum, no weight
///   zero; checked in vectors, [`steady_weights_avx512`]) goes straight to the pass over the
///   group's accumulators ([`accumulate4_avx512`]). Otherwise (and for partial batches and
///   groups of fewer than four heads), per head, the running maximum through the batch gives
///   every exponential's argument; the exponentials of the group's batch in two vectors
///   ([`exp_batch_avx512`]); then [`OnlineSoftmax::advance_with`] in key order (the scalar
///   part), and each head's element updates in key order, in runs that start at a new
///   maximum, one pass over its accumulator per run, 16 elements wide.
///
/// # Safety
/// The CPU must support AVX-512 F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn key_batch_avx512(
    pairs: &[f32],
    q: &[f32],
    rows: &[&[f32]],
    scale: f32,
    heads: &mut [OnlineSoftmax],
) {
    debug_assert!(rows.len() <= KEY_BATCH);
    let n = rows.len().min(KEY_BATCH);
    let Some(&first) = rows.first() else {
        return;
    };
    let d = first.len();
    let chunks = d / 8;
    let pair = |p: usize| &pairs[p * chunks * 16..(p + 1) * chunks * 16];
    // Four heads (two pairs) at a time: eight independent add chains of the dots, each
    // broadcast row chunk used by both pairs.
    for (g, group) in heads.chunks_mut(4).enumerate() {
        let lanes = if group.len() > 2 {
            dots_avx512([pair(2 * g), pair(2 * g + 1)], rows)
        } else {
            let [l] = dots_avx512([pair(2 * g)], rows);
            [l, [_mm512_setzero_ps(); KEY_BATCH]]
        };
        // Each dot's scalar tail (the columns past the whole chunks: `+0` when there are
        // none, as in `dot8`), then the lane sums and the scale, all 32 at once.
        let mut tails = [[0f32; KEY_BATCH]; 4];
        if chunks * 8 < d {
            for (i, tl) in tails.iter_mut().enumerate().take(group.len()) {
                let qh = &q[(4 * g + i) * d..(4 * g + i + 1) * d];
                for (t, row) in tl.iter_mut().zip(&rows[..n]) {
                    for (x, y) in qh[chunks * 8..].iter().zip(&row[chunks * 8..]) {
                        *t = x.mul_add(*y, *t);
                    }
                }
            }
        }
        let logits = logits_avx512(lanes, &tails, scale);
        // The usual case, checked in vectors: a whole batch in which no key is a new maximum
        // for any head of the group and every weight is non-zero; then every step is an
        // accumulate with the weight `exp(logit - max)`, applied by one pass over the rows per
        // two heads.
        if let ([a, b, c, e], Ok(rows8)) = (&mut *group, <[&[f32]; KEY_BATCH]>::try_from(rows)) {
            let heads4 = [&mut *a, &mut *b, &mut *c, &mut *e];
            if let Some(w) = steady_weights_avx512(&logits, heads4) {
                accumulate4_avx512(
                    [a.acc_mut(), b.acc_mut(), c.acc_mut(), e.acc_mut()],
                    w,
                    rows8,
                );
                continue;
            }
        }
        // The scalar steps key by key: first each head's running maximum through the batch
        // and so every exponential's argument, then the exponentials of the whole group and
        // batch at once (two vectors, the same bits as `exp_nonpositive`), then each head's
        // denominator and steps in key order.
        let mut args = [[0f32; KEY_BATCH]; 4];
        let mut new_max = [[false; KEY_BATCH]; 4];
        for (((a, nm), lg), head) in args
            .iter_mut()
            .zip(new_max.iter_mut())
            .zip(&logits)
            .zip(group.iter())
        {
            let mut m = head.max();
            for k in 0..n {
                (a[k], nm[k]) = exp_argument(m, lg[k]);
                m = m.max(lg[k]);
            }
        }
        let exps = exp_batch_avx512(&args);
        let mut steps = [[PushStep::Skip; KEY_BATCH]; 4];
        for k in 0..n {
            for (h, (st, head)) in steps.iter_mut().zip(group.iter_mut()).enumerate() {
                st[k] = head.advance_with(logits[h][k], new_max[h][k], exps[h][k]);
            }
        }
        // Head by head, in runs: each a new maximum's rescale (or nothing) then the
        // accumulating keys up to the next one, one pass over the accumulator per run (most
        // heads: one run; skipped keys do nothing).
        for (head, steps) in group.iter_mut().zip(&steps) {
            let acc = head.acc_mut();
            let mut lead = None;
            let (mut w, mut r) = ([0f32; KEY_BATCH], [&[][..]; KEY_BATCH]);
            let mut m = 0;
            for (k, (&st, &row)) in steps.iter().zip(rows).enumerate() {
                if let PushStep::Accumulate(e) = st {
                    (w[m], r[m]) = (e, row);
                    m += 1;
                }
                let next = steps.get(k + 1).filter(|_| k + 1 < n);
                if let PushStep::Rescale(s) = st {
                    lead = Some((s, row));
                }
                // A run ends before the next rescale and at the batch's end.
                if matches!(next, Some(PushStep::Rescale(_)) | None) {
                    run_avx512(acc, lead.take(), &w[..m], &r[..m]);
                    m = 0;
                }
            }
        }
    }
}

/// The weights of a whole batch for four heads when every key only accumulates, with each
/// head's denominator advanced by them in key order, or `None` (nothing changed) when some key
/// would take another step: a new maximum (`logit > max`), or a weight of zero (an
/// exponential that underflows, or a NaN or infinite argument, which the exponential maps to
/// zero). What [`exp_argument`] and [`OnlineSoftmax::advance_with`] do for such keys: the
/// argument `logit - max` (the maximum is unchanged through the batch), the same
/// exponentials ([`exp_batch_avx512`]), `denom += e` key by key.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn steady_weights_avx512(
    logits: &[[f32; KEY_BATCH]; 4],
    heads: [&mut OnlineSoftmax; 4],
) -> Option<[[f32; KEY_BATCH]; 4]> {
    use std::arch::x86_64::{
        _CMP_EQ_OQ, _CMP_GT_OQ, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_mask_blend_ps,
        _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm512_sub_ps,
    };
    let mut args = [[0f32; KEY_BATCH]; 4];
    for p in 0..2 {
        // Heads 2p (lanes 0-7) and 2p + 1 (lanes 8-15): their logits and maxima.
        // SAFETY: `logits[2p..2p + 2]` and `args[2p..2p + 2]` are 16 consecutive f32 each.
        unsafe {
            let l = _mm512_loadu_ps(logits[2 * p..].as_ptr().cast());
            let m = _mm512_mask_blend_ps(
                0xff00,
                _mm512_set1_ps(heads[2 * p].max()),
                _mm512_set1_ps(heads[2 * p + 1].max()),
            );
            if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(l, m) != 0 {
                return None;
            }
            _mm512_storeu_ps(args[2 * p..].as_mut_ptr().cast(), _mm512_sub_ps(l, m));
        }
    }
    let exps = exp_batch_avx512(&args);
    for p in 0..2 {
        // SAFETY: `exps[2p..2p + 2]` is 16 consecutive f32.
        let e = unsafe { _mm512_loadu_ps(exps[2 * p..].as_ptr().cast()) };
        if _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(e, _mm512_setzero_ps()) != 0 {
            return None;
        }
    }
    for (head, es) in heads.into_iter().zip(&exps) {
        head.accumulate_all(es);
    }
    Some(exps)
}

/// One run of [`key_batch_avx512`]'s steps on a head's accumulator: `lead`'s rescale
/// `(s, row)`, if any, then the accumulating keys (weights `w`, rows `r`, at most
/// [`KEY_BATCH`]) in order, through [`accumulate_avx512`] sized to the run.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn run_avx512(acc: &mut [f32], lead: Option<(f32, &[f32])>, w: &[f32], r: &[&[f32]]) {
    macro_rules! sized {
        ($($n:literal)*) => {
            match w.len() {
                0 if lead.is_none() => {}
                $($n => {
                    if let (Ok(w), Ok(r)) = (<[f32; $n]>::try_from(w), <[&[f32]; $n]>::try_from(r)) {
                        accumulate_avx512(acc, lead, w, r);
                    }
                })*
                // (Runs are at most `KEY_BATCH` long.)
                _ => {}
            }
        };
    }
    sized!(0 1 2 3 4 5 6 7 8)
}

/// [`super::softmax::exp_nonpositive`] of every element, 8 at a time in f64 lanes: the same
/// IEEE operations in the same order on vectors (round to nearest even, fused multiply-adds,
/// the exact scaling by `2^n`, one rounding to f32, zero below the floor and for NaN), so the
/// same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn exp_batch_avx512(x: &[[f32; KEY_BATCH]; 4]) -> [[f32; KEY_BATCH]; 4] {
    use std::arch::x86_64::{
        _CMP_GE_OQ, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm256_loadu_ps,
        _mm256_storeu_ps, _mm512_cmp_pd_mask, _mm512_cvtpd_ps, _mm512_cvtps_pd, _mm512_fmadd_pd,
        _mm512_maskz_scalef_pd, _mm512_mul_pd, _mm512_roundscale_pd, _mm512_set1_pd,
    };
    let mut out = [[0f32; KEY_BATCH]; 4];
    let src = x.as_flattened();
    let dst = out.as_flattened_mut();
    for (xs, os) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
        // SAFETY: `xs` and `os` are 8 f32 each: one unaligned 256-bit load and one store.
        unsafe {
            let x = _mm512_cvtps_pd(_mm256_loadu_ps(xs.as_ptr()));
            let valid = _mm512_cmp_pd_mask::<_CMP_GE_OQ>(x, _mm512_set1_pd(f64::from(EXP_FLOOR)));
            let n = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_pd(x, _mm512_set1_pd(std::f64::consts::LOG2_E)),
            );
            let r = _mm512_fmadd_pd(n, _mm512_set1_pd(-LN2_HI), x);
            let r = _mm512_fmadd_pd(n, _mm512_set1_pd(-LN2_LO), r);
            let mut p = _mm512_set1_pd(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c));
            }
            // `p · 2^n`, exact for the valid lanes; the others (below the floor, NaN) zero.
            let e = _mm512_maskz_scalef_pd(valid, p, n);
            _mm256_storeu_ps(os.as_mut_ptr(), _mm512_cvtpd_ps(e));
        }
    }
    out
}

/// [`dot_pairs_avx512`] of the `P` pairs with the batch's rows (1 to [`KEY_BATCH`]; the
/// vectors past the batch are zero, unused).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn dots_avx512<const P: usize>(qp: [&[f32]; P], rows: &[&[f32]]) -> [[__m512; KEY_BATCH]; P] {
    fn pad<const P: usize, const N: usize>(
        v: [[__m512; N]; P],
        z: __m512,
    ) -> [[__m512; KEY_BATCH]; P] {
        v.map(|l| {
            let mut out = [z; KEY_BATCH];
            out[..N].copy_from_slice(&l);
            out
        })
    }
    let z = _mm512_setzero_ps();
    let zero = [[z; KEY_BATCH]; P];
    macro_rules! sized {
        ($($n:literal)*) => {
            match rows.len() {
                $($n => match <[&[f32]; $n]>::try_from(rows) {
                    Ok(r) => pad(dot_pairs_avx512(qp, r), z),
                    Err(_) => zero,
                },)*
                // (The caller passes 1 to `KEY_BATCH` rows.)
                _ => zero,
            }
        };
    }
    sized!(1 2 3 4 5 6 7 8)
}

/// The accumulators of two heads' [`dot8`]s (lanes 0-7 the pair's first head, 8-15 its
/// second) for each of `P` pairs and `N` rows: `qp[p]` is a pair's interleaved query (16
/// floats a chunk, [`interleave_pairs`]); lane `i` adds `q[8c+i] * row[8c+i]` for
/// `c = 0, 1, ...` in order, one fused multiply-add each as [`dot8`] does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn dot_pairs_avx512<const P: usize, const N: usize>(
    qp: [&[f32]; P],
    rows: [&[f32]; N],
) -> [[__m512; N]; P] {
    use std::arch::x86_64::{
        _mm256_loadu_pd, _mm512_broadcast_f64x4, _mm512_castpd_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
    };
    let chunks = qp.iter().map(|x| x.len() / 16).min().unwrap_or(0);
    // Each pair's and row's whole chunks (a shorter row panics here, before any load);
    // pointers, so that the loop carries no bounds checks.
    let xp = qp.map(|x| x[..chunks * 16].as_ptr());
    let rp = rows.map(|r| r[..chunks * 8].as_ptr());
    let mut v: [[__m512; N]; P] = [[_mm512_setzero_ps(); N]; P];
    for c in 0..chunks {
        // SAFETY: `xp[p] + 16c .. + 16` lies in pair `p`'s first `16 * chunks` floats and
        // `rp[k] + 8c .. + 8` in row `k`'s first `8 * chunks` (`c < chunks`): unaligned
        // 512- and 256-bit loads.
        unsafe {
            let xv = xp.map(|x| _mm512_loadu_ps(x.add(c * 16)));
            for (k, r) in rp.iter().enumerate() {
                // The 8 floats in both halves (a 64-bit-element broadcast moves the same
                // bits and needs only AVX-512 F).
                let y = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                    r.add(c * 8).cast::<f64>(),
                )));
                for (vp, x) in v.iter_mut().zip(&xv) {
                    vp[k] = _mm512_fmadd_ps(*x, y, vp[k]);
                }
            }
        }
    }
    v
}

/// The logits `logits[h][k]` of a group's four heads (two pairs) and a batch's keys from
/// their [`dot_pairs_avx512`] accumulators: each dot is [`dot8`]'s
/// `((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)) + tail`, times `scale`, with the same
/// additions (IEEE addition is commutative, so the lanes' order within one does not matter).
///
/// Three rounds of two shuffles and an add, each halving the lanes per dot: `a_i + a_(i+4)`
/// (128-bit blocks), then neighbours within a block, twice. The keys are paired `k` with
/// `k + 4` at the start, so that the last round leaves each block holding four consecutive
/// keys of one head.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn logits_avx512(
    lanes: [[__m512; KEY_BATCH]; 2],
    tails: &[[f32; KEY_BATCH]; 4],
    scale: f32,
) -> [[f32; KEY_BATCH]; 4] {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_set1_ps, _mm512_shuffle_f32x4,
        _mm512_shuffle_ps, _mm512_storeu_ps,
    };
    // Block indices 0, 2 of `a` and of `b` / 1, 3 of each: (evens, odds) of 4-lane blocks.
    const EVEN_BLOCKS: i32 = 0b10_00_10_00;
    const ODD_BLOCKS: i32 = 0b11_01_11_01;
    // Lanes 0, 2 of each block of `a` then of `b` / lanes 1, 3.
    const EVEN_LANES: i32 = 0b10_00_10_00;
    const ODD_LANES: i32 = 0b11_01_11_01;
    let mut out = [[0f32; KEY_BATCH]; 4];
    for (p, v) in lanes.iter().enumerate() {
        // Round 1: keys k and k + 4 → blocks (k head a, k head b, k+4 head a, k+4 head b),
        // each block `a_i + a_(i+4)`, i = 0..4.
        let t: [__m512; 4] = std::array::from_fn(|k| {
            let (a, b) = (v[k], v[k + 4]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<EVEN_BLOCKS>(a, b),
                _mm512_shuffle_f32x4::<ODD_BLOCKS>(a, b),
            )
        });
        let half = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<EVEN_LANES>(a, b),
                _mm512_shuffle_ps::<ODD_LANES>(a, b),
            )
        };
        // Round 2: (t0 + t1, t2 + t3) of keys (0, 1) / (2, 3) in each block.
        let (r, w) = (half(t[0], t[1]), half(t[2], t[3]));
        // Round 3: the dots; block j holds keys 0-3 (j = 0: head a, 1: head b), then keys
        // 4-7 (j = 2, 3).
        let dots = half(r, w);
        // SAFETY: `tails[2p..2p + 2]` is 16 consecutive f32, as is `out[2p..2p + 2]`.
        unsafe {
            let tail = _mm512_loadu_ps(tails[2 * p..].as_ptr().cast());
            // To (head a keys 0-7, head b keys 0-7), the order of `tails` and `out`.
            let dots = _mm512_shuffle_f32x4::<0b11_01_10_00>(dots, dots);
            let l = _mm512_mul_ps(_mm512_add_ps(dots, tail), _mm512_set1_ps(scale));
            _mm512_storeu_ps(out[2 * p..].as_mut_ptr().cast(), l);
        }
    }
    out
}

/// [`accumulate_avx512`] of four heads over the same [`KEY_BATCH`] rows (`w[h][k]`: head
/// `h`'s weight of row `k`): each head's elements see the same fused multiply-adds in the
/// same key order. Two heads per pass over the rows: their 16 weights, the 8 row chunks and
/// the two accumulator chunks stay in registers (four heads' 32 weights would not, and their
/// reloads made the pass about twice as slow).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn accumulate4_avx512(acc: [&mut [f32]; 4], w: [[f32; KEY_BATCH]; 4], rows: [&[f32]; KEY_BATCH]) {
    let [a0, a1, a2, a3] = acc;
    let [w0, w1, w2, w3] = w;
    accumulate2_avx512([a0, a1], [w0, w1], rows);
    accumulate2_avx512([a2, a3], [w2, w3], rows);
}

/// Two heads of [`accumulate4_avx512`] in one pass over the rows, 16 elements at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn accumulate2_avx512(acc: [&mut [f32]; 2], w: [[f32; KEY_BATCH]; 2], rows: [&[f32]; KEY_BATCH]) {
    use std::arch::x86_64::{_mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_storeu_ps};
    let d = acc.iter().map(|a| a.len()).min().unwrap_or(0);
    let whole = d / 16 * 16;
    // Every accumulator and row cut to the common width (a shorter row panics here, before
    // any load); pointers, so that the loop carries no bounds checks.
    let rp = rows.map(|r| r[..d].as_ptr());
    let [a0, a1] = acc;
    let ap = [a0[..d].as_mut_ptr(), a1[..d].as_mut_ptr()];
    // (Not `map` with a closure: a closure does not inherit the target features, and
    // its intrinsics become calls.)
    let mut wv = [[_mm512_setzero_ps(); KEY_BATCH]; 2];
    for (vh, wh) in wv.iter_mut().zip(&w) {
        for (v, &e) in vh.iter_mut().zip(wh) {
            *v = _mm512_set1_ps(e);
        }
    }
    for j in (0..whole).step_by(16) {
        // SAFETY: `j + 16 <= whole <= d`, and every row and accumulator pointer covers `d`
        // floats (the two accumulators are distinct slices): unaligned 512-bit loads and
        // stores.
        unsafe {
            let mut r = [_mm512_setzero_ps(); KEY_BATCH];
            for (v, p) in r.iter_mut().zip(&rp) {
                *v = _mm512_loadu_ps(p.add(j));
            }
            for (a, wh) in ap.iter().zip(&wv) {
                let mut x = _mm512_loadu_ps(a.add(j));
                for (e, rk) in wh.iter().zip(&r) {
                    x = _mm512_fmadd_ps(*e, *rk, x);
                }
                _mm512_storeu_ps(a.add(j), x);
            }
        }
    }
    for (a, wh) in ap.iter().zip(&w) {
        for i in whole..d {
            for (&e, r) in wh.iter().zip(&rows) {
                // SAFETY: `i < d`: within the accumulator's first `d` floats.
                unsafe { *a.add(i) = e.mul_add(r[i], *a.add(i)) };
            }
        }
    }
}

/// `acc[j] = acc[j] * s + lead_row[j]` first when there is a `lead` (a new maximum's
/// rescale), then `acc[j] = w_k * rows[k][j] + acc[j]` for `k = 0..N` in order (fused, as
/// [`OnlineSoftmax::push`] does per key), 16 elements at a time, each element loaded and
/// stored once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn accumulate_avx512<const N: usize>(
    acc: &mut [f32],
    lead: Option<(f32, &[f32])>,
    w: [f32; N],
    rows: [&[f32]; N],
) {
    use std::arch::x86_64::{_mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_storeu_ps};
    let d = acc.len();
    // Each row cut to the accumulator's width (a shorter row panics here, before any load);
    // pointers, so that the loop carries no bounds checks.
    let rows = rows.map(|r| &r[..d]);
    let rp = rows.map(|r| r.as_ptr());
    let lead = lead.map(|(s, r)| (s, &r[..d]));
    // (Not `map` with a closure: a closure does not inherit the target features, and
    // its intrinsics become calls.)
    let mut lp = None;
    if let Some((s, r)) = lead {
        lp = Some((_mm512_set1_ps(s), r.as_ptr()));
    }
    let mut wv = [_mm512_setzero_ps(); N];
    for (v, &e) in wv.iter_mut().zip(&w) {
        *v = _mm512_set1_ps(e);
    }
    let (ac, at) = acc.as_chunks_mut::<16>();
    let whole = ac.len() * 16;
    for (j, a) in ac.iter_mut().enumerate() {
        // SAFETY: `a` is an array of 16 f32, and `rp[k] + 16j .. + 16j + 16` (and the lead
        // row's) lies within that row's `d` floats (`16j + 16 <= whole <= d`): unaligned
        // 512-bit loads and one store.
        unsafe {
            let mut x = _mm512_loadu_ps(a.as_ptr());
            if let Some((s, r)) = lp {
                x = _mm512_fmadd_ps(x, s, _mm512_loadu_ps(r.add(j * 16)));
            }
            for (e, r) in wv.iter().zip(&rp) {
                x = _mm512_fmadd_ps(*e, _mm512_loadu_ps(r.add(j * 16)), x);
            }
            _mm512_storeu_ps(a.as_mut_ptr(), x);
        }
    }
    for (i, a) in at.iter_mut().enumerate() {
        if let Some((s, r)) = lead {
            *a = a.mul_add(s, r[whole + i]);
        }
        for (&e, r) in w.iter().zip(&rows) {
            *a = e.mul_add(r[whole + i], *a);
        }
    }
}

/// f32 dot with eight partial sums (vectorizable).
#[inline(always)]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail = x.mul_add(*y, tail);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut x = seed;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        }
    }

    fn bits(heads: &[OnlineSoftmax], d: usize) -> Vec<Vec<u32>> {
        heads
            .iter()
            .map(|h| {
                let mut o = vec![0f32; d];
                h.finish(&mut o).unwrap();
                o.iter().map(|v| v.to_bits()).collect()
            })
            .collect()
    }

    /// The AVX2 key loop (heads in groups of four, then the rest) and the AVX-512 batches
    /// (heads in pairs, keys in batches of every size from 1 to `KEY_BATCH`) give exactly the
    /// portable loop's bits, for head counts with and without a remainder, widths with a tail
    /// (of the 8-wide dot chunks and of the 16-wide accumulator chunks), and keys that make a
    /// new maximum mid-batch or underflow to weight zero.
    #[test]
    fn simd_key_steps_are_bit_identical_to_the_portable_one() {
        let avx2 = SimdLevel::Avx2.is_available();
        let avx512 = SimdLevel::Avx512.is_available();
        if !avx2 {
            eprintln!("skipped the AVX2 comparison: this CPU lacks AVX2/FMA");
        }
        if !avx512 {
            eprintln!("skipped the AVX-512 comparison: this CPU lacks AVX-512 F/BW/VL");
        }
        let mut next = rng(0x2545_f491);
        for (heads, d) in [
            (4usize, 512usize),
            (6, 64),
            (3, 36),
            (9, 520),
            (1, 8),
            (2, 5),
            (5, 24),
        ] {
            let q: Vec<f32> = (0..heads * d).map(|_| next()).collect();
            let mut rows: Vec<Vec<f32>> =
                (0..43).map(|_| (0..d).map(|_| next()).collect()).collect();
            // Large rows: a new maximum for some heads (mid-batch), weight zero for others.
            for i in [22, 29] {
                rows[i].iter_mut().for_each(|v| *v *= 400.0);
            }
            let mut a: Vec<OnlineSoftmax> =
                (0..heads).map(|_| OnlineSoftmax::new(d, 0.5)).collect();
            for row in &rows {
                key_step(&q, row, 0.125, &mut a);
            }
            let want = bits(&a, d);
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                let mut b: Vec<OnlineSoftmax> =
                    (0..heads).map(|_| OnlineSoftmax::new(d, 0.5)).collect();
                for row in &rows {
                    // SAFETY: AVX2 and FMA were checked above.
                    unsafe { key_step_avx2(&q, row, 0.125, &mut b) };
                }
                assert!(bits(&b, d) == want, "AVX2, heads {heads}, width {d}");
            }
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                let mut c: Vec<OnlineSoftmax> =
                    (0..heads).map(|_| OnlineSoftmax::new(d, 0.5)).collect();
                let mut pairs = AlignedF32::default();
                interleave_pairs(&q, heads, d, &mut pairs);
                let pairs = pairs.as_slice();
                let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
                let (mut at, mut size) = (0, 1);
                while at < refs.len() {
                    let end = (at + size).min(refs.len());
                    // SAFETY: AVX-512 F/BW/VL and AVX2/FMA were checked above.
                    unsafe { key_batch_avx512(pairs, &q, &refs[at..end], 0.125, &mut c) };
                    at = end;
                    size = size % KEY_BATCH + 1;
                }
                assert!(bits(&c, d) == want, "AVX-512, heads {heads}, width {d}");
            }
        }
    }

    /// The vector check of a steady batch against the scalar steps: when it takes a batch,
    /// every key of every head is an accumulate with the same weight bits and the heads end
    /// with the same maximum and denominator bits; it declines (changing nothing) exactly
    /// when some key is a new maximum or weighs zero (underflow, NaN, infinity).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn steady_batches_take_the_scalar_steps() {
        if !SimdLevel::Avx512.is_available() {
            eprintln!("skipped: this CPU lacks AVX-512 F/BW/VL");
            return;
        }
        let mut next = rng(0x51f1_5eed);
        let (mut taken, mut declined) = (0, 0);
        for case in 0..500usize {
            let mut logits = [[0f32; KEY_BATCH]; 4];
            for l in logits.as_flattened_mut() {
                *l = next() * 3.0;
            }
            let (h, k) = (case % 4, (case / 4) % KEY_BATCH);
            logits[h][k] = match case % 6 {
                1 => 6.5,
                2 => -200.0,
                3 => f32::NAN,
                4 => f32::NEG_INFINITY,
                _ => logits[h][k],
            };
            let mut vector: Vec<OnlineSoftmax> = (0..4)
                .map(|i| OnlineSoftmax::new(4, 6.0 + i as f32 * 0.25))
                .collect();
            // A little history: each head's denominator is past its start.
            for (i, head) in vector.iter_mut().enumerate() {
                head.push(next() - 1.0, &[1.0, 2.0, 3.0, 4.0 + i as f32]);
            }
            let mut scalar = vector.clone();
            let mut steps = Vec::new();
            // In key order, each key for every head (as `key_step`).
            for kk in 0..KEY_BATCH {
                for (hh, (head, lg)) in scalar.iter_mut().zip(&logits).enumerate() {
                    steps.push((hh, kk, head.advance(lg[kk])));
                }
            }
            let steady = steps
                .iter()
                .all(|(_, _, s)| matches!(s, PushStep::Accumulate(_)));
            let before: Vec<(u32, u32)> = vector
                .iter()
                .map(|h| (h.max().to_bits(), h.denom().to_bits()))
                .collect();
            let [a, b, c, e] = &mut vector[..] else {
                unreachable!()
            };
            // SAFETY: AVX-512 F/BW/VL (with AVX2 and FMA) was checked above.
            let got = unsafe { steady_weights_avx512(&logits, [a, b, c, e]) };
            match got {
                Some(w) => {
                    assert!(steady, "case {case}: took a batch with other steps");
                    for &(hh, kk, s) in &steps {
                        let PushStep::Accumulate(x) = s else {
                            unreachable!()
                        };
                        assert_eq!(x.to_bits(), w[hh][kk].to_bits(), "case {case}");
                    }
                    for (v, s) in vector.iter().zip(&scalar) {
                        assert_eq!(v.max().to_bits(), s.max().to_bits(), "case {case}");
                        assert_eq!(v.denom().to_bits(), s.denom().to_bits(), "case {case}");
                    }
                    taken += 1;
                }
                None => {
                    assert!(!steady, "case {case}: declined a steady batch");
                    let after: Vec<(u32, u32)> = vector
                        .iter()
                        .map(|h| (h.max().to_bits(), h.denom().to_bits()))
                        .collect();
                    assert_eq!(before, after, "case {case}: declining changed a head");
                    declined += 1;
                }
            }
        }
        assert!(
            taken > 100 && declined > 100,
            "{taken} taken, {declined} declined"
        );
    }

    /// `SparseAttention::run` at every level this CPU has gives the portable run's bits, over
    /// quantized keys (decoded into the scratch rows) and decoded ones, for key counts that
    /// fill the AVX-512 batches or leave a partial one.
    /// The vector exponential against the scalar one, bit for bit: a sweep of the range,
    /// the floor's neighbourhood, zeros, infinities and NaN.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_is_bit_identical_to_the_scalar_one() {
        use crate::csa2::softmax::exp_nonpositive;
        if !SimdLevel::Avx512.is_available() {
            eprintln!("skipped: this CPU lacks AVX-512 F/BW/VL");
            return;
        }
        let mut xs: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 4.4e-4).collect();
        xs.extend([
            0.0,
            -0.0,
            EXP_FLOOR,
            f32::from_bits(EXP_FLOOR.to_bits() + 1),
            f32::from_bits(EXP_FLOOR.to_bits() - 1),
            -1e-30,
            -f32::MIN_POSITIVE,
            f32::NEG_INFINITY,
            f32::NAN,
            -1000.0,
        ]);
        let mut checked = 0;
        for chunk in xs.chunks(4 * KEY_BATCH) {
            let mut x = [[0f32; KEY_BATCH]; 4];
            for (d, &v) in x.as_flattened_mut().iter_mut().zip(chunk) {
                *d = v;
            }
            // SAFETY: AVX-512 F/BW/VL (with AVX2 and FMA) was checked above.
            let got = unsafe { exp_batch_avx512(&x) };
            for (g, v) in got.as_flattened().iter().zip(x.as_flattened()) {
                let want = exp_nonpositive(*v);
                assert_eq!(g.to_bits(), want.to_bits(), "exp({v})");
                checked += 1;
            }
        }
        assert!(checked >= xs.len());
    }

    #[test]
    fn every_level_runs_to_the_portable_bits() {
        let levels = crate::level::available_levels();
        if !levels.contains(&SimdLevel::Avx512) {
            eprintln!("skipped the AVX-512 run: this CPU lacks AVX-512 F/BW/VL");
        }
        let mut next = rng(0x9e37_79b9);
        for (heads, d) in [(4usize, 512usize), (3, 64), (2, 64)] {
            let shape = AttentionShape::new(heads, d).unwrap();
            let (wc, ec) = (shape.window_codec(), shape.compressed_codec());
            let x: Vec<f32> = (0..40 * d).map(|_| next()).collect();
            let mut wrows = vec![0u8; 20 * wc.bytes()];
            let mut erows = vec![0u8; 20 * ec.bytes()];
            wc.quantize(&x[..20 * d], &mut wrows).unwrap();
            ec.quantize(&x[20 * d..], &mut erows).unwrap();
            let q: Vec<f32> = (0..heads * d).map(|_| next()).collect();
            let sinks: Vec<f32> = (0..heads).map(|_| next()).collect();
            for n in [0usize, 1, 3, 4, 5, 11, 40] {
                let quantized: Vec<KeyRow<'_>> = wrows
                    .chunks_exact(wc.bytes())
                    .map(KeyRow::Window)
                    .chain(erows.chunks_exact(ec.bytes()).map(KeyRow::Compressed))
                    .take(n)
                    .collect();
                let decoded: Vec<KeyRow<'_>> =
                    x[..n * d].chunks_exact(d).map(KeyRow::Decoded).collect();
                for keys in [&quantized, &decoded] {
                    let mut want = vec![0f32; heads * d];
                    SparseAttention::with_level(shape, SimdLevel::Portable)
                        .unwrap()
                        .run(&q, &sinks, keys.iter().copied(), &mut want)
                        .unwrap();
                    for &level in &levels {
                        let mut got = vec![1f32; heads * d];
                        let mut attn = SparseAttention::with_level(shape, level).unwrap();
                        assert_eq!(attn.level(), level);
                        // Twice: the buffers are reused.
                        for _ in 0..2 {
                            attn.run(&q, &sinks, keys.iter().copied(), &mut got)
                                .unwrap();
                            let same = got
                                .iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{level}, heads {heads}, width {d}, {n} keys");
                        }
                    }
                }
            }
            // A decoded row of the wrong width is an error naming it, at every level.
            for &level in &levels {
                let mut attn = SparseAttention::with_level(shape, level).unwrap();
                let short = vec![0f32; d - 1];
                let mut out = vec![0f32; heads * d];
                let keys = [KeyRow::Decoded(&x[..d]), KeyRow::Decoded(&short)];
                let err = attn.run(&q, &sinks, keys, &mut out).unwrap_err();
                assert!(
                    err.to_string().contains("decoded key row"),
                    "{level}: {err}"
                );
            }
        }
    }
}
