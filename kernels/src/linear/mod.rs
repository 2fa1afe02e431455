//! Linear layers whose weights stay in the released checkpoint's storage formats (spec §9):
//! FP8 E4M3 with UE8M0 block scales, packed FP4 E2M1 with per-32-column scales, BF16, and f32
//! (kept for verification). `y[m, n] = x[m, k] · Wᵀ` with `W` in `nn.Linear` layout `[n, k]`.
//!
//! # Layout (packed once, at load)
//!
//! Weights are re-laid out once into *panels* of [`PANEL`] output columns, `k`-major: panel
//! `p` holds, for each `l` in `0..k`, the codes of columns `16p .. 16p + 16` at `l` (FP4: 8
//! bytes, byte `i` = column `16p + i` in the low nibble and `16p + i + 8` in the high one). A
//! step then reads each weight byte once, in order, as one vector per `l`, decoded in
//! registers; nothing is repacked per call. Scales are expanded at load to one f32 per
//! (panel, scale block, lane) (FP8: times 256, see below): 1/32 byte per weight for FP8, 1/8
//! for FP4.
//!
//! # Exactness
//!
//! Every weight decodes to exactly the f32 the dequantizer of the storage produces
//! (`code · scale` is a product of a small float and a power of two: exact unless it leaves
//! the normal range, and then rounded once, identically). FP8 codes are widened as IEEE half
//! (`e4m3 / 256` exactly: same mantissa, exponent bias 15 instead of 7) and multiplied by
//! `256 · scale`; packing refuses scales for which `256 · scale` overflows and the two NaN
//! codes, so the product is the same real number, rounded once.
//!
//! Each output element is summed in one fixed order, whatever the rows, columns or threads
//! computed together: in blocks of [`KC`] along `k`, each block a chain of fused multiply-adds
//! from `+0`, the blocks added in order to a sum starting at `+0`. That is the order of
//! `matrixmultiply`'s FMA kernel ([`crate::csa2::gemm::linear`] on CPUs with FMA), so on
//! such CPUs the result is bit-identical to `linear` on the dequantized weights, and on every
//! CPU to [`PackedLinear::forward_ref`], the scalar reference every SIMD level is tested
//! against. This is why the kernels widen to f32 and use f32 FMA rather than VNNI or
//! `vdpbf16ps`: those sum pairs or quads of products before rounding (and VNNI needs int8
//! activations), which would make the stored-format model differ from its f32 verification
//! path in the last bits, and the CSA2 quantizers downstream turn such differences into
//! flipped cache codes.
//!
//! # Levels
//!
//! AVX-512 (F + F16C: `vcvtph2ps`, `vpermps` as the FP4 table), AVX2 + FMA + F16C, and the
//! portable scalar reference, chosen at run time ([`crate::detected_level`]). AVX-512 decodes
//! FP8 two `l` at a time (32 codes widened in one 512-bit register, then two `vcvtph2ps`):
//! the decode, not the FMAs, bounds a decode step's linears, and a pair needs one widening
//! and one shift sequence where two singles need two; each accumulator still takes `l`, then
//! `l + 1`, so the order above is unchanged.

mod avx2;
mod avx512;
#[cfg(test)]
mod tests;

use kvstack_firmware_interface::element::{e2m1_to_f32, e4m3_to_f32};

use crate::csa2::check_len;
use crate::csa2::gemm::guarded;
use crate::level::Verified;
use crate::{Error, SimdLevel};

/// Output columns per panel (one 512-bit vector of f32).
pub const PANEL: usize = 16;

/// The summation block along `k` (matrixmultiply's `kc` for f32).
pub const KC: usize = 256;

/// Multiply-adds below which one more thread does not pay for waking it (the same threshold
/// as the f32 GEMM's).
pub use crate::csa2::gemm::MIN_MACS_PER_THREAD;

/// The storage format of a [`PackedLinear`]'s weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// IEEE f32 (4 bytes per weight): what verification uses.
    F32,
    /// BF16 (2 bytes).
    Bf16,
    /// FP8 E4M3 with UE8M0 block scales (1 byte + scales).
    Fp8,
    /// Packed FP4 E2M1 with per-row, per-block scales (half a byte + scales).
    Fp4,
}

impl WeightFormat {
    /// The name printed in reports: `f32`, `bf16`, `fp8-e4m3`, `fp4-e2m1`.
    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Fp8 => "fp8-e4m3",
            WeightFormat::Fp4 => "fp4-e2m1",
        }
    }
}

/// Packed codes, panel-major (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Codes {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Fp8(Vec<u8>),
    Fp4(Vec<u8>),
}

/// A linear layer's weight `[n, k]` in its storage format, packed for the kernels.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLinear {
    n: usize,
    k: usize,
    panels: usize,
    codes: Codes,
    /// `[panels][kblocks][PANEL]`: each lane's scale in each scale block along `k` (FP8: times
    /// 256); empty for f32 and BF16.
    scales: Vec<f32>,
    /// Columns of `k` per scale block (`k` when there are no scales).
    bc: usize,
    /// Scale blocks along `k`.
    kblocks: usize,
}

/// The f32 value of every FP8 code divided by 256 (what `vcvtph2ps` gives for the code laid out
/// as a half; exact).
fn fp8_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|c| e4m3_to_f32(c as u8) / 256.0))
}

/// The f32 value of every FP4 code.
fn fp4_table() -> &'static [f32; 16] {
    static T: std::sync::OnceLock<[f32; 16]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|c| e2m1_to_f32(c as u8)))
}

/// Block shape `(br, bc)` of a `[rows, cols]` matrix with a `[srows, scols]` scale grid.
fn blocks(rows: usize, cols: usize, srows: usize, scols: usize) -> Option<(usize, usize)> {
    if srows == 0 || scols == 0 {
        return None;
    }
    let (br, bc) = (rows.div_ceil(srows), cols.div_ceil(scols));
    (br > 0 && bc > 0 && rows.div_ceil(br) == srows && cols.div_ceil(bc) == scols)
        .then_some((br, bc))
}

fn param(what: &'static str, reason: String) -> Error {
    Error::Param { what, reason }
}

impl PackedLinear {
    fn check_dims(n: usize, k: usize) -> Result<usize, Error> {
        if n == 0 || k == 0 {
            return Err(param("linear weight shape", format!("[{n}, {k}] is empty")));
        }
        Ok(n.div_ceil(PANEL))
    }

    /// Panel-major copy of a row-major `[n, k]` matrix of `T` (pad columns zero).
    fn panelize<T: Copy + Default>(w: &[T], n: usize, k: usize, panels: usize) -> Vec<T> {
        let mut out = vec![T::default(); panels * k * PANEL];
        for (j, row) in w.chunks_exact(k).enumerate().take(n) {
            let (p, lane) = (j / PANEL, j % PANEL);
            for (l, &v) in row.iter().enumerate() {
                out[(p * k + l) * PANEL + lane] = v;
            }
        }
        out
    }

    /// Expands a `[srows, scols]` scale grid over `(br, bc)` blocks to `[panels][kblocks][16]`,
    /// each value times `factor`.
    fn expand_scales(
        scales: &[f32],
        n: usize,
        panels: usize,
        (br, _): (usize, usize),
        scols: usize,
        factor: f32,
    ) -> Vec<f32> {
        let mut out = vec![0f32; panels * scols * PANEL];
        for p in 0..panels {
            for kb in 0..scols {
                for lane in 0..PANEL {
                    let j = p * PANEL + lane;
                    if j < n {
                        out[(p * scols + kb) * PANEL + lane] =
                            scales[(j / br) * scols + kb] * factor;
                    }
                }
            }
        }
        out
    }

    /// Checks a scale grid: shape, and every scale finite and positive (and, times `factor`,
    /// still finite).
    fn check_scales(
        n: usize,
        k: usize,
        scales: &[f32],
        srows: usize,
        scols: usize,
        factor: f32,
    ) -> Result<(usize, usize), Error> {
        let b = blocks(n, k, srows, scols).ok_or_else(|| {
            param(
                "linear weight scales",
                format!("scale grid [{srows}, {scols}] does not tile a [{n}, {k}] matrix"),
            )
        })?;
        check_len(
            "linear weight scales [srows, scols]",
            srows * scols,
            scales.len(),
        )?;
        if let Some((i, s)) = scales
            .iter()
            .enumerate()
            .find(|&(_, &s)| !(s.is_finite() && s > 0.0 && (s * factor).is_finite()))
        {
            return Err(param(
                "linear weight scales",
                format!(
                    "scale {s:e} at [{}, {}] is not a finite positive power-of-two scale the kernels can apply",
                    i / scols,
                    i % scols
                ),
            ));
        }
        Ok(b)
    }

    /// Packs f32 weights `[n, k]` (row-major, `nn.Linear` layout).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] / [`Error::Param`] for a wrong length or an empty shape.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Result<PackedLinear, Error> {
        let panels = Self::check_dims(n, k)?;
        check_len("linear weight [n, k]", n * k, w.len())?;
        Ok(PackedLinear {
            n,
            k,
            panels,
            codes: Codes::F32(Self::panelize(w, n, k, panels)),
            scales: Vec::new(),
            bc: k,
            kblocks: 1,
        })
    }

    /// Packs BF16 weights `[n, k]` given as their bit patterns.
    ///
    /// # Errors
    /// As [`PackedLinear::from_f32`].
    pub fn from_bf16(bits: &[u16], n: usize, k: usize) -> Result<PackedLinear, Error> {
        let panels = Self::check_dims(n, k)?;
        check_len("linear weight [n, k] (BF16)", n * k, bits.len())?;
        Ok(PackedLinear {
            n,
            k,
            panels,
            codes: Codes::Bf16(Self::panelize(bits, n, k, panels)),
            scales: Vec::new(),
            bc: k,
            kblocks: 1,
        })
    }

    /// Packs FP8 E4M3 codes `[n, k]` with block scales `[srows, scols]` (the block shape is
    /// derived as in the checkpoint: `ceil(n / srows) x ceil(k / scols)`).
    ///
    /// # Errors
    /// [`Error::Param`] for a scale grid that does not tile the matrix, a scale that is not
    /// finite and positive (or too large to apply exactly), or a NaN code (naming its place).
    pub fn from_fp8(
        codes: &[u8],
        n: usize,
        k: usize,
        scales: &[f32],
        srows: usize,
        scols: usize,
    ) -> Result<PackedLinear, Error> {
        let panels = Self::check_dims(n, k)?;
        check_len("linear weight [n, k] (FP8)", n * k, codes.len())?;
        let b = Self::check_scales(n, k, scales, srows, scols, 256.0)?;
        if let Some(i) = codes.iter().position(|&c| c & 0x7F == 0x7F) {
            return Err(param(
                "linear weight (FP8)",
                format!("NaN code {:#04x} at [{}, {}]", codes[i], i / k, i % k),
            ));
        }
        Ok(PackedLinear {
            n,
            k,
            panels,
            codes: Codes::Fp8(Self::panelize(codes, n, k, panels)),
            scales: Self::expand_scales(scales, n, panels, b, scols, 256.0),
            bc: b.1,
            kblocks: scols,
        })
    }

    /// Packs FP4 E2M1 weights stored as bytes `[n, k / 2]` (the even element in the low nibble)
    /// with scales `[srows, scols]` (the release: one per row and 32 columns).
    ///
    /// # Errors
    /// [`Error::Param`] for an odd `k` or a scale grid as in [`PackedLinear::from_fp8`].
    pub fn from_fp4(
        packed: &[u8],
        n: usize,
        k: usize,
        scales: &[f32],
        srows: usize,
        scols: usize,
    ) -> Result<PackedLinear, Error> {
        let panels = Self::check_dims(n, k)?;
        if !k.is_multiple_of(2) {
            return Err(param(
                "linear weight (FP4)",
                format!("packed FP4 needs an even width, not {k}"),
            ));
        }
        check_len(
            "linear weight [n, k / 2] (packed FP4)",
            n * k / 2,
            packed.len(),
        )?;
        let b = Self::check_scales(n, k, scales, srows, scols, 1.0)?;
        let code = |j: usize, l: usize| (packed[j * (k / 2) + l / 2] >> (4 * (l & 1))) & 0xF;
        let mut out = vec![0u8; panels * k * PANEL / 2];
        for p in 0..panels {
            for l in 0..k {
                for i in 0..PANEL / 2 {
                    let (j0, j1) = (p * PANEL + i, p * PANEL + i + PANEL / 2);
                    let lo = if j0 < n { code(j0, l) } else { 0 };
                    let hi = if j1 < n { code(j1, l) } else { 0 };
                    out[(p * k + l) * PANEL / 2 + i] = lo | (hi << 4);
                }
            }
        }
        Ok(PackedLinear {
            n,
            k,
            panels,
            codes: Codes::Fp4(out),
            scales: Self::expand_scales(scales, n, panels, b, scols, 1.0),
            bc: b.1,
            kblocks: scols,
        })
    }

    /// Output features (`W`'s rows).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (`W`'s columns).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The storage format.
    pub fn format(&self) -> WeightFormat {
        match self.codes {
            Codes::F32(_) => WeightFormat::F32,
            Codes::Bf16(_) => WeightFormat::Bf16,
            Codes::Fp8(_) => WeightFormat::Fp8,
            Codes::Fp4(_) => WeightFormat::Fp4,
        }
    }

    /// Bytes this weight holds in memory (codes, pad columns and expanded scales).
    pub fn resident_bytes(&self) -> usize {
        let codes = match &self.codes {
            Codes::F32(v) => v.len() * 4,
            Codes::Bf16(v) => v.len() * 2,
            Codes::Fp8(v) | Codes::Fp4(v) => v.len(),
        };
        codes + self.scales.len() * 4
    }

    /// The weight of output `j`, input `l`, as f32 (exactly what the kernels multiply by).
    fn weight(&self, j: usize, l: usize) -> f32 {
        let (p, lane) = (j / PANEL, j % PANEL);
        let at = (p * self.k + l) * PANEL + lane;
        let scale = || self.scales[(p * self.kblocks + l / self.bc) * PANEL + lane];
        match &self.codes {
            Codes::F32(v) => v[at],
            Codes::Bf16(v) => f32::from_bits(u32::from(v[at]) << 16),
            Codes::Fp8(v) => fp8_table()[usize::from(v[at])] * scale(),
            Codes::Fp4(v) => {
                let b = v[(p * self.k + l) * PANEL / 2 + lane % (PANEL / 2)];
                let c = if lane < PANEL / 2 { b & 0xF } else { b >> 4 };
                fp4_table()[usize::from(c)] * scale()
            }
        }
    }

    /// The weights as row-major f32 `[n, k]`: bit-identical to the storage's dequantizer.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.n * self.k);
        for j in 0..self.n {
            out.extend((0..self.k).map(|l| self.weight(j, l)));
        }
        out
    }

    fn check_io(&self, x: &[f32], m: usize, out: &[f32]) -> Result<(), Error> {
        check_len("linear input x [m, k]", m * self.k, x.len())?;
        check_len("linear output [m, n]", m * self.n, out.len())
    }

    /// `out[m, n] = x[m, k] · Wᵀ` in plain scalar code, in the summation order of the module
    /// documentation (the reference every level is tested against).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `x` or `out` is not `m` rows.
    pub fn forward_ref(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), Error> {
        self.check_io(x, m, out)?;
        self.columns_scalar(x, m, 0..self.panels, out, self.n);
        Ok(())
    }

    /// `out[m, n] = x[m, k] · Wᵀ` at the detected SIMD level.
    ///
    /// # Errors
    /// As [`PackedLinear::forward_ref`].
    pub fn forward(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), Error> {
        self.forward_with(crate::detected_level(), x, m, out)
    }

    /// [`PackedLinear::forward`] at a given level.
    ///
    /// # Errors
    /// [`Error::UnsupportedLevel`] when the CPU cannot run `level`; as
    /// [`PackedLinear::forward_ref`].
    pub fn forward_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        m: usize,
        out: &mut [f32],
    ) -> Result<(), Error> {
        self.check_io(x, m, out)?;
        let level = Verified::new(level)?;
        self.columns(level, x, m, 0..self.panels, out, self.n);
        Ok(())
    }

    /// Computes panels `panels` for all `m` rows into `out` (row stride `ldo`, column 0 = the
    /// first column of `panels.start`). Lengths were checked by the caller.
    fn columns(
        &self,
        level: Verified,
        x: &[f32],
        m: usize,
        panels: std::ops::Range<usize>,
        out: &mut [f32],
        ldo: usize,
    ) {
        {
            let cols = ((panels.end * PANEL).min(self.n)).saturating_sub(panels.start * PANEL);
            let per_panel = self.resident_bytes() / self.panels.max(1);
            crate::work::add_linear(
                (m * cols * self.k) as u64,
                (panels.len() * per_panel) as u64,
            );
        }
        let fast = f16c();
        match level.level() {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 if fast => {
                // SAFETY: `Verified` proves AVX-512 F/BW/VL with AVX2 + FMA, `fast` F16C; the
                // callers checked `x` is `m` rows of `k` and `out` holds `m` rows of `ldo` with
                // the panels' columns, which is all the kernel indexes.
                unsafe { avx512::columns(self, x, m, panels, out, ldo) }
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 | SimdLevel::Avx512 if fast => {
                // SAFETY: `Verified` proves AVX2 + FMA (both SIMD levels include them), `fast`
                // F16C; buffers as above.
                unsafe { avx2::columns(self, x, m, panels, out, ldo) }
            }
            _ => self.columns_scalar(x, m, panels, out, ldo),
        }
    }

    fn columns_scalar(
        &self,
        x: &[f32],
        m: usize,
        panels: std::ops::Range<usize>,
        out: &mut [f32],
        ldo: usize,
    ) {
        let j0 = panels.start * PANEL;
        let j1 = (panels.end * PANEL).min(self.n);
        for i in 0..m {
            let xi = &x[i * self.k..(i + 1) * self.k];
            for j in j0..j1 {
                let mut sum = 0f32;
                for kb in (0..self.k).step_by(KC) {
                    let mut acc = 0f32;
                    for (l, &xv) in xi.iter().enumerate().take((kb + KC).min(self.k)).skip(kb) {
                        acc = xv.mul_add(self.weight(j, l), acc);
                    }
                    sum += acc;
                }
                out[i * ldo + j - j0] = sum;
            }
        }
    }

    /// [`PackedLinear::forward`] over up to `threads` threads, as many as the work pays for:
    /// many rows are split by rows, a few (decode) by panels of output columns. The result is
    /// bit-identical for every thread count (each element's order is fixed). Inside a task of
    /// [`crate::par::run_tasks`] it runs on the calling thread.
    ///
    /// # Errors
    /// As [`PackedLinear::forward`]; [`Error::Internal`] if a worker panicked.
    pub fn forward_threads(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        threads: usize,
    ) -> Result<(), Error> {
        self.check_io(x, m, out)?;
        let level = Verified::detected();
        let (n, k) = (self.n, self.k);
        let macs = m.saturating_mul(n).saturating_mul(k);
        let t = threads
            .min(macs / crate::par::min_split_work(MIN_MACS_PER_THREAD))
            .min(m.max(self.panels))
            .max(1);
        if t == 1 || crate::par::in_task() {
            self.columns(level, x, m, 0..self.panels, out, n);
            return Ok(());
        }
        let mut results: Vec<Result<(), Error>> = Vec::with_capacity(t);
        // Rows are split only when every thread gets at least two groups of the kernels' four
        // rows: each part reads all the weights, so a decode-sized product (a few rows,
        // bound by the weight stream) splits its panels instead, each thread reading its share
        // of the weights once.
        if m >= 8 * t {
            let per = m.div_ceil(t);
            let parts: Vec<(usize, &mut [f32])> = out
                .chunks_mut(per * n)
                .enumerate()
                .map(|(c, o)| (c * per, o))
                .collect();
            results.resize_with(parts.len(), || Ok(()));
            crate::par::run_tasks(results.iter_mut().zip(parts).map(|(r, (i0, o))| {
                move || {
                    let rows = o.len() / n;
                    *r = guarded(|| {
                        self.columns(
                            level,
                            &x[i0 * k..(i0 + rows) * k],
                            rows,
                            0..self.panels,
                            o,
                            n,
                        );
                        Ok(())
                    });
                }
            }));
            return results.into_iter().collect();
        }
        let per = self.panels.div_ceil(t);
        let mut bufs: Vec<(usize, usize, Vec<f32>)> = (0..self.panels)
            .step_by(per)
            .map(|p0| {
                let p1 = (p0 + per).min(self.panels);
                let cols = (p1 * PANEL).min(n) - p0 * PANEL;
                (p0, p1, vec![0f32; m * cols])
            })
            .collect();
        results.resize_with(bufs.len(), || Ok(()));
        crate::par::run_tasks(
            results
                .iter_mut()
                .zip(bufs.iter_mut())
                .map(|(r, (p0, p1, b))| {
                    let (p0, p1) = (*p0, *p1);
                    move || {
                        let cols = b.len() / m;
                        *r = guarded(|| {
                            self.columns(level, x, m, p0..p1, b, cols);
                            Ok(())
                        });
                    }
                }),
        );
        results.into_iter().collect::<Result<(), Error>>()?;
        for (p0, _, b) in &bufs {
            let cols = b.len() / m;
            let j0 = p0 * PANEL;
            for (i, row) in b.chunks_exact(cols).enumerate() {
                out[i * n + j0..i * n + j0 + cols].copy_from_slice(row);
            }
        }
        Ok(())
    }
}

/// Whether the CPU converts halves (F16C), which the FP8 decode of the SIMD levels uses.
#[cfg(target_arch = "x86_64")]
fn f16c() -> bool {
    std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn f16c() -> bool {
    false
}
