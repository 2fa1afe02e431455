//! Rotary position embedding on the LAST `rope_dim` channels of a head, interleaved pairs
//! `(2i, 2i + 1)` rotated as complex numbers by `e^{i · pos · f_i}` (spec §4), with the
//! frequency-only YaRN of spec §4 for layers with compression, and the inverse rotation the
//! output applies (`e^{-i · pos · f_i}`).
//!
//! Frequencies are computed in f32 as the reference does (`1 / θ^(2i/d)`, then the YaRN
//! blend `f/s · (1 - smooth) + f · smooth` with `smooth = 1 - ramp`); the correction range
//! `[low, high]` is computed in f64 like the reference's `math` calls. Angles are
//! `f32(pos) · f_i` in f32 (the reference's `outer(t, freqs)`), and the rotation uses
//! `cos`/`sin` of that f32 angle.

use super::{Error, check_len};

/// YaRN frequency scaling (spec §4): frequency-only, no attention-temperature factor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `factor` (16 in V4.1).
    pub factor: f64,
    /// `original_max_position_embeddings` (65536).
    pub original_max_position: f64,
    /// `beta_fast` (32).
    pub beta_fast: f64,
    /// `beta_slow` (1).
    pub beta_slow: f64,
}

impl Yarn {
    /// The correction range `(low, high)` of spec §4 for `d` rotary dims and base `theta`.
    pub fn correction_range(&self, d: usize, theta: f64) -> (usize, usize) {
        let dim = |rotations: f64| {
            d as f64 * (self.original_max_position / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let low = dim(self.beta_fast).floor().max(0.0);
        let high = dim(self.beta_slow).ceil().min(d as f64 - 1.0);
        // Both are small non-negative whole numbers here (clamped to [0, d - 1]).
        (low as usize, high.max(0.0) as usize)
    }
}

/// The rotation of one layer: `rope_dim / 2` frequencies.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    rope_dim: usize,
    freqs: Vec<f32>,
}

impl Rope {
    /// Frequencies for `rope_dim` rotary dims (even, > 0), base `theta`, optional YaRN.
    pub fn new(rope_dim: usize, theta: f64, yarn: Option<Yarn>) -> Result<Rope, Error> {
        if rope_dim == 0 || !rope_dim.is_multiple_of(2) {
            return Err(Error::Param {
                what: "rope_dim",
                reason: format!("{rope_dim} is not a positive even number"),
            });
        }
        if !(theta.is_finite() && theta > 1.0) {
            return Err(Error::Param {
                what: "rope theta",
                reason: format!("{theta} is not a finite base above 1"),
            });
        }
        let half = rope_dim / 2;
        let base = theta as f32;
        let mut freqs: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / rope_dim as f32))
            .collect();
        if let Some(y) = yarn {
            if !(y.factor.is_finite() && y.factor > 0.0) {
                return Err(Error::Param {
                    what: "rope_scaling.factor",
                    reason: format!("{} is not a positive number", y.factor),
                });
            }
            let (low, high) = y.correction_range(rope_dim, theta);
            // `linear_ramp_factor`: a zero-width range is widened by 0.001.
            let span = if low == high {
                0.001f32
            } else {
                high as f32 - low as f32
            };
            let factor = y.factor as f32;
            for (i, f) in freqs.iter_mut().enumerate() {
                let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                let smooth = 1.0 - ramp;
                *f = *f / factor * (1.0 - smooth) + *f * smooth;
            }
        }
        Ok(Rope { rope_dim, freqs })
    }

    /// Rotary dims.
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    /// The `rope_dim / 2` frequencies.
    pub fn freqs(&self) -> &[f32] {
        &self.freqs
    }

    /// The angles `f32(pos) · f_i` (what the vectors record as `angles`).
    pub fn angles(&self, pos: u64, out: &mut [f32]) -> Result<(), Error> {
        check_len("rope angles", self.freqs.len(), out.len())?;
        let p = pos as f32;
        for (o, &f) in out.iter_mut().zip(&self.freqs) {
            *o = p * f;
        }
        Ok(())
    }

    /// Reference: rotates one `rope_dim`-wide slice by `pos` (by `-pos` when `inverse`),
    /// computing each angle's cosine and sine.
    pub fn rotate_ref(&self, x: &mut [f32], pos: u64, inverse: bool) -> Result<(), Error> {
        check_len("rope input (rope_dim values)", self.rope_dim, x.len())?;
        let p = pos as f32;
        for (pair, &f) in x.chunks_exact_mut(2).zip(&self.freqs) {
            let a = p * f;
            let (c, s) = (a.cos(), if inverse { -a.sin() } else { a.sin() });
            let (x0, x1) = (pair[0], pair[1]);
            pair[0] = x0 * c - x1 * s;
            pair[1] = x0 * s + x1 * c;
        }
        Ok(())
    }

    /// The interleaved `(cos, sin)` (sine negated for `inverse`) of every frequency at `pos`
    /// into `cs`, from this thread's cache of recent positions when it has them: a decode
    /// step rotates the same position in every layer with one of a model's two ropes, and
    /// `cos`/`sin` were 6% of a decode step. An entry is found by its frequencies' bits, so
    /// the values are exactly what computing them gives.
    fn cos_sin(&self, pos: u64, inverse: bool, cached: bool, cs: &mut [f32]) {
        /// Cached (frequencies, position, inverse, values) per thread.
        type Entry = (Vec<f32>, u64, bool, Vec<f32>);
        const ENTRIES: usize = 16;
        thread_local! {
            static CACHE: std::cell::RefCell<(Vec<Entry>, usize)> =
                const { std::cell::RefCell::new((Vec::new(), 0)) };
        }
        let same = |f: &[f32]| {
            f.len() == self.freqs.len()
                && f.iter()
                    .zip(&self.freqs)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
        };
        let hit = cached
            && CACHE.with(|c| {
                let c = c.borrow();
                c.0.iter()
                    .find(|e| e.1 == pos && e.2 == inverse && same(&e.0))
                    .map(|e| cs.copy_from_slice(&e.3))
                    .is_some()
            });
        if hit {
            return;
        }
        let p = pos as f32;
        for (c, &f) in cs.chunks_exact_mut(2).zip(&self.freqs) {
            let a = p * f;
            c[0] = a.cos();
            c[1] = if inverse { -a.sin() } else { a.sin() };
        }
        if !cached {
            return;
        }
        CACHE.with(|c| {
            let mut c = c.borrow_mut();
            let entry = (self.freqs.clone(), pos, inverse, cs.to_vec());
            if c.0.len() < ENTRIES {
                c.0.push(entry);
            } else {
                let at = c.1 % ENTRIES;
                c.0[at] = entry;
                c.1 = at + 1;
            }
        });
    }

    /// Fast: rotates the last `rope_dim` channels of every `head_width`-wide head of every
    /// `row_width`-wide row of `x`, row `r` by `positions[r]`. Cosines and sines are computed
    /// once per row and shared by its heads; the arithmetic per pair is that of
    /// [`Rope::rotate_ref`], so results are bit-identical to it.
    pub fn rotate_rows(
        &self,
        x: &mut [f32],
        row_width: usize,
        head_width: usize,
        positions: &[u64],
        inverse: bool,
    ) -> Result<(), Error> {
        if head_width < self.rope_dim || row_width == 0 || !row_width.is_multiple_of(head_width) {
            return Err(Error::Param {
                what: "rope rows",
                reason: format!(
                    "row width {row_width} is not whole heads of {head_width} (each at least rope_dim {})",
                    self.rope_dim
                ),
            });
        }
        check_len(
            "rope rows (positions x row width)",
            positions.len() * row_width,
            x.len(),
        )?;
        let half = self.freqs.len();
        let mut cs = vec![0f32; 2 * half];
        for (row, &pos) in x.chunks_exact_mut(row_width).zip(positions) {
            // Only decode-sized steps revisit positions; a prefill's rows are all new.
            self.cos_sin(pos, inverse, positions.len() <= 4, &mut cs);
            for head in row.chunks_exact_mut(head_width) {
                let tail = &mut head[head_width - self.rope_dim..];
                for (pair, c) in tail.chunks_exact_mut(2).zip(cs.chunks_exact(2)) {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0 * c[0] - x1 * c[1];
                    pair[1] = x0 * c[1] + x1 * c[0];
                }
            }
        }
        Ok(())
    }
}
