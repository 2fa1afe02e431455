//! Hyper-connections (spec §9): `hc_mult` residual streams mixed around every sublayer.
//!
//! One coefficient site (`hc_attn_*` or `hc_ffn_*`) reads the flattened streams of one token
//! and produces `pre` (how the sublayer's input is gathered from the streams), `post` (how its
//! output is spread back) and `comb` (how the streams mix among themselves, a doubly-stochastic
//! matrix from Sinkhorn iterations).

use crate::csa2::Error;
use crate::level::SimdLevel;
use crate::linear::PackedLinear;

/// The parameters of one coefficient site, borrowed from the weights.
#[derive(Clone, Copy, Debug)]
pub struct HcSite<'a> {
    /// `fn`: `[n + n + n*n, n * hidden]` (`nn.Linear` layout, packed).
    pub proj: &'a PackedLinear,
    /// `base`: `[n + n + n*n]`.
    pub base: &'a [f32],
    /// `scale`: `[3]`, for the pre, post and comb logits.
    pub scale: &'a [f32],
}

/// Shape and constants of the hyper-connections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HcShape {
    /// Streams (`hc_mult`, 4 in V4.1).
    pub streams: usize,
    /// Hidden size of one stream.
    pub hidden: usize,
    /// Sinkhorn iterations (`hc_sinkhorn_iters`, 20): the first is the softmax, then
    /// `iters - 1` row-and-column normalizations.
    pub sinkhorn_iters: usize,
    /// `hc_eps` (1e-6): added to `pre` and to the softmaxed `comb`.
    pub eps: f32,
    /// The epsilon of the RMS scaling of the mixes (1e-20, the model's `rms_norm_eps`).
    pub norm_eps: f32,
}

/// The coefficients of one site for one token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HcMix {
    /// `sigmoid(.) + eps`, one per stream.
    pub pre: Vec<f32>,
    /// `2 * sigmoid(.)`, one per stream.
    pub post: Vec<f32>,
    /// `comb[s * n + j]`: weight of input stream `s` in output stream `j`.
    pub comb: Vec<f32>,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl HcShape {
    fn coeffs(&self) -> usize {
        self.streams * (2 + self.streams)
    }

    fn check(&self, site: &HcSite<'_>, streams: &[f32], tokens: usize) -> Result<(), Error> {
        let n = self.streams;
        let width = n * self.hidden;
        let len = |what, expected: usize, actual: usize| {
            if expected == actual {
                Ok(())
            } else {
                Err(Error::LengthMismatch {
                    what,
                    expected,
                    actual,
                })
            }
        };
        if site.proj.n() != self.coeffs() || site.proj.k() != width {
            return Err(Error::Param {
                what: "hc fn [n*(n+2), n*hidden]",
                reason: format!(
                    "weight is [{}, {}], expected [{}, {width}]",
                    site.proj.n(),
                    site.proj.k(),
                    self.coeffs()
                ),
            });
        }
        len("hc base [n*(n+2)]", self.coeffs(), site.base.len())?;
        len("hc scale [3]", 3, site.scale.len())?;
        len(
            "hc streams [tokens, n, hidden]",
            tokens * width,
            streams.len(),
        )
    }

    /// Computes the mixes of `tokens` tokens; `streams` is `[tokens, n, hidden]`.
    pub fn mixes(
        &self,
        site: &HcSite<'_>,
        streams: &[f32],
        tokens: usize,
    ) -> Result<Vec<HcMix>, Error> {
        self.check(site, streams, tokens)?;
        let n = self.streams;
        let c = self.coeffs();
        let width = n * self.hidden;
        let mut raw = vec![0f32; tokens * c];
        site.proj.forward(streams, tokens, &mut raw)?;
        let mut out = Vec::with_capacity(tokens);
        for (flat, raw) in streams.chunks_exact(width).zip(raw.chunks_exact(c)) {
            // The projection of the unnormalized streams is scaled afterwards, which equals
            // projecting the RMS-normalized streams (spec §9).
            let ms = flat.iter().map(|v| v * v).sum::<f32>() / width as f32;
            let r = 1.0 / (ms + self.norm_eps).sqrt();
            let logit = |i: usize, group: usize| site.base[i] + raw[i] * r * site.scale[group];
            let pre = (0..n).map(|i| sigmoid(logit(i, 0)) + self.eps).collect();
            let post = (0..n).map(|i| 2.0 * sigmoid(logit(n + i, 1))).collect();
            let logits: Vec<f32> = (0..n * n).map(|i| logit(2 * n + i, 2)).collect();
            out.push(HcMix {
                pre,
                post,
                comb: self.sinkhorn(&logits),
            });
        }
        Ok(out)
    }

    /// Softmax over each row, `+ eps`, a column normalization, then `iters - 1` rounds of row
    /// and column normalization.
    fn sinkhorn(&self, logits: &[f32]) -> Vec<f32> {
        let n = self.streams;
        let mut m = vec![0f32; n * n];
        for (row, l) in m.chunks_exact_mut(n).zip(logits.chunks_exact(n)) {
            let max = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0.0;
            for (o, &v) in row.iter_mut().zip(l) {
                *o = (v - max).exp();
                sum += *o;
            }
            row.iter_mut().for_each(|o| *o = *o / sum + self.eps);
        }
        let normalize_columns = |m: &mut [f32]| {
            for j in 0..n {
                let s: f32 = (0..n).map(|i| m[i * n + j]).sum();
                (0..n).for_each(|i| m[i * n + j] /= s);
            }
        };
        normalize_columns(&mut m);
        for _ in 1..self.sinkhorn_iters {
            for row in m.chunks_exact_mut(n) {
                let s: f32 = row.iter().sum();
                row.iter_mut().for_each(|v| *v /= s);
            }
            normalize_columns(&mut m);
        }
        m
    }

    /// `out[t] = sum_s pre[t][s] * streams[t][s]`: the input of a sublayer (`[tokens, hidden]`).
    pub fn collapse(&self, pre: &[HcMix], streams: &[f32], out: &mut [f32]) -> Result<(), Error> {
        let width = self.streams * self.hidden;
        if streams.len() != pre.len() * width || out.len() != pre.len() * self.hidden {
            return Err(Error::LengthMismatch {
                what: "hc collapse streams [tokens, n, hidden] / out [tokens, hidden]",
                expected: pre.len() * width,
                actual: streams.len(),
            });
        }
        for ((mix, s), o) in pre
            .iter()
            .zip(streams.chunks_exact(width))
            .zip(out.chunks_exact_mut(self.hidden))
        {
            o.fill(0.0);
            for (&p, stream) in mix.pre.iter().zip(s.chunks_exact(self.hidden)) {
                o.iter_mut().zip(stream).for_each(|(o, &v)| *o += p * v);
            }
        }
        Ok(())
    }

    /// `streams'[t][j] = post[t][j] * y[t] + sum_s comb[t][s, j] * streams[t][s]`, in place.
    pub fn expand(&self, mix: &[HcMix], y: &[f32], streams: &mut [f32]) -> Result<(), Error> {
        let n = self.streams;
        let h = self.hidden;
        if streams.len() != mix.len() * n * h || y.len() != mix.len() * h {
            return Err(Error::LengthMismatch {
                what: "hc expand streams [tokens, n, hidden] / y [tokens, hidden]",
                expected: mix.len() * n * h,
                actual: streams.len(),
            });
        }
        let mut old = vec![0f32; n * h];
        match crate::level::Verified::detected().level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the detected level is verified available: AVX-512 means AVX-512 F (and
            // AVX2, FMA), the features `expand_avx512` is compiled for.
            SimdLevel::Avx512 => unsafe { expand_avx512(n, h, mix, y, streams, &mut old) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; the AVX2 level means AVX2 and FMA.
            SimdLevel::Avx2 => unsafe { expand_avx2(n, h, mix, y, streams, &mut old) },
            _ => expand_tokens(n, h, mix, y, streams, &mut old),
        }
        Ok(())
    }
}

/// [`HcShape::expand`]'s loop: per token and stream, for each element
/// `post * y + Σ_src comb * old` with separate multiplies and adds in `src` order. Rust never
/// fuses them, so the copies compiled for wider vectors ([`expand_avx512`], [`expand_avx2`];
/// the element loops vectorize) give the same bits.
#[inline(always)]
fn expand_tokens(
    n: usize,
    h: usize,
    mix: &[HcMix],
    y: &[f32],
    streams: &mut [f32],
    old: &mut [f32],
) {
    for ((m, y), s) in mix
        .iter()
        .zip(y.chunks_exact(h))
        .zip(streams.chunks_exact_mut(n * h))
    {
        old.copy_from_slice(s);
        for (j, out) in s.chunks_exact_mut(h).enumerate() {
            // Element by element the same sum in the same order; the loops over the elements
            // innermost, so that they vectorize.
            let post = m.post[j];
            for (o, &yc) in out.iter_mut().zip(y) {
                *o = post * yc;
            }
            for (src, prev) in old.chunks_exact(h).enumerate() {
                let w = m.comb[src * n + j];
                for (o, &v) in out.iter_mut().zip(prev) {
                    *o += w * v;
                }
            }
        }
    }
}

/// [`expand_tokens`] compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512 F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn expand_avx512(
    n: usize,
    h: usize,
    mix: &[HcMix],
    y: &[f32],
    streams: &mut [f32],
    old: &mut [f32],
) {
    expand_tokens(n, h, mix, y, streams, old);
}

/// [`expand_tokens`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn expand_avx2(
    n: usize,
    h: usize,
    mix: &[HcMix],
    y: &[f32],
    streams: &mut [f32],
    old: &mut [f32],
) {
    expand_tokens(n, h, mix, y, streams, old);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> HcShape {
        HcShape {
            streams: 4,
            hidden: 8,
            sinkhorn_iters: 20,
            eps: 1e-6,
            norm_eps: 1e-20,
        }
    }

    #[test]
    fn comb_is_doubly_stochastic_and_pre_post_in_range() {
        let s = shape();
        let width = 32;
        let proj: Vec<f32> = (0..24 * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 80.0)
            .collect();
        let base: Vec<f32> = (0..24).map(|i| (i as f32 - 12.0) / 10.0).collect();
        let scale = [0.6, 0.7, 0.55];
        let streams: Vec<f32> = (0..2 * width)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
            .collect();
        let proj = PackedLinear::from_f32(&proj, 24, width).unwrap();
        let site = HcSite {
            proj: &proj,
            base: &base,
            scale: &scale,
        };
        let mixes = s.mixes(&site, &streams, 2).unwrap();
        for m in &mixes {
            for j in 0..4 {
                let col: f32 = (0..4).map(|i| m.comb[i * 4 + j]).sum();
                let row: f32 = m.comb[j * 4..j * 4 + 4].iter().sum();
                assert!(
                    (col - 1.0).abs() < 1e-5 && (row - 1.0).abs() < 1e-3,
                    "{col} {row}"
                );
            }
            assert!(m.pre.iter().all(|&p| p > 0.0 && p <= 1.0 + 1e-6));
            assert!(m.post.iter().all(|&p| (0.0..=2.0).contains(&p)));
        }
    }

    /// The expand loop (element loops innermost) and its copies compiled for AVX-512 and AVX2
    /// give the bits of the formula summed element by element (widths with and without a
    /// vector tail, several tokens).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn expand_is_bit_identical_at_every_level() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 22) as f32 - 2.0
        };
        for (n, h, t) in [(4usize, 1024usize, 3usize), (4, 37, 2), (3, 100, 1)] {
            let mix: Vec<HcMix> = (0..t)
                .map(|_| HcMix {
                    pre: (0..n).map(|_| next()).collect(),
                    post: (0..n).map(|_| next()).collect(),
                    comb: (0..n * n).map(|_| next()).collect(),
                })
                .collect();
            let y: Vec<f32> = (0..t * h).map(|_| next()).collect();
            let streams: Vec<f32> = (0..t * n * h).map(|_| next()).collect();
            let mut old = vec![0f32; n * h];
            // The formula element by element (sources innermost, as written in the doc of
            // `expand`): the reference every copy must match bit for bit.
            let mut want = streams.clone();
            for ((m, yt), st) in mix
                .iter()
                .zip(y.chunks_exact(h))
                .zip(want.chunks_exact_mut(n * h))
            {
                let prev = st.to_vec();
                for j in 0..n {
                    for c in 0..h {
                        let mut acc = m.post[j] * yt[c];
                        for src in 0..n {
                            acc += m.comb[src * n + j] * prev[src * h + c];
                        }
                        st[j * h + c] = acc;
                    }
                }
            }
            let mut portable = streams.clone();
            expand_tokens(n, h, &mix, &y, &mut portable, &mut old);
            assert!(
                portable
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            if SimdLevel::Avx512.is_available() {
                let mut got = streams.clone();
                // SAFETY: AVX-512 (F, with AVX2 and FMA) was checked just above.
                unsafe { expand_avx512(n, h, &mix, &y, &mut got, &mut old) };
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
            } else {
                eprintln!("skipped the AVX-512 copy: this CPU lacks AVX-512");
            }
            if SimdLevel::Avx2.is_available() {
                let mut got = streams.clone();
                // SAFETY: AVX2 and FMA were checked just above.
                unsafe { expand_avx2(n, h, &mix, &y, &mut got, &mut old) };
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
            }
            // And through the public entry point (the detected level).
            let mut got = streams.clone();
            HcShape {
                streams: n,
                hidden: h,
                sinkhorn_iters: 1,
                eps: 0.0,
                norm_eps: 0.0,
            }
            .expand(&mix, &y, &mut got)
            .unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
    }

    #[test]
    fn collapse_and_expand_follow_the_formulas() {
        let s = HcShape {
            streams: 2,
            hidden: 2,
            sinkhorn_iters: 1,
            eps: 0.0,
            norm_eps: 0.0,
        };
        let mix = HcMix {
            pre: vec![0.5, 2.0],
            post: vec![1.0, 3.0],
            comb: vec![1.0, 0.0, 0.25, 0.75],
        };
        let streams = vec![1.0, 2.0, 10.0, 20.0];
        let mut x = vec![0.0; 2];
        s.collapse(std::slice::from_ref(&mix), &streams, &mut x)
            .unwrap();
        assert_eq!(x, vec![20.5, 41.0]);
        let mut st = streams.clone();
        s.expand(std::slice::from_ref(&mix), &[1.0, -1.0], &mut st)
            .unwrap();
        // stream 0: 1*y + 1*s0 + 0.25*s1; stream 1: 3*y + 0*s0 + 0.75*s1
        assert_eq!(
            st,
            vec![1.0 + 1.0 + 2.5, -1.0 + 2.0 + 5.0, 3.0 + 7.5, -3.0 + 15.0]
        );
    }
}
