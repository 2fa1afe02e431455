//! Codec throughput against limits measured in the same run (one thread).
//!
//! Speed targets are ratios, not absolute numbers, so they hold on any machine:
//!
//! | operation | bytes counted | compared with | target |
//! |---|---|---|---|
//! | quantize | f32 input | memcpy of a buffer that size | >= 0.25 |
//! | dequantize | f32 output | memcpy of a buffer that size | >= 0.5 |
//! | fused dot | encoded entries | a vectorized read (sum) of those same entries | >= 0.5 |
//!
//! Each operation's baseline is measured in the same run, interleaved with it repetition by
//! repetition (so both see the same conditions on a busy machine), over the same number of
//! bytes: 64 MiB by default, larger than the last-level caches of typical servers, so both
//! sides stream from DRAM. Every figure is the best of N repetitions, with inputs and outputs
//! passed through [`std::hint::black_box`]. With small buffers (for example
//! [`CodecBenchOptions::quick`]) the data stays in cache and the ratios are only indicative.

use std::fmt;
use std::hint::black_box;
use std::time::Instant;

use kvstack_kernels::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, SimdLevel};
use zerocopy::FromBytes;

use crate::rng::Rng;

/// What to measure.
#[derive(Debug, Clone)]
pub struct CodecBenchOptions {
    /// Size of the f32 side of quantize and dequantize, of the encoded entries of the dots, and
    /// of the memcpy and read baselines. Default 64 MiB; make it exceed the last-level cache to
    /// measure DRAM bandwidth.
    pub buffer_bytes: usize,
    /// Repetitions of every measurement; the fastest is reported. At least 1.
    pub repetitions: usize,
    /// Level to run; `None` runs [`kvstack_kernels::detected_level`]. An unavailable level
    /// falls back to the detected one, with a note in the report.
    pub level: Option<SimdLevel>,
    /// Formats to run, in order.
    pub formats: Vec<EntryFormat>,
}

impl Default for CodecBenchOptions {
    fn default() -> Self {
        CodecBenchOptions {
            buffer_bytes: 64 << 20,
            repetitions: 5,
            level: None,
            formats: EntryFormat::ALL.to_vec(),
        }
    }
}

impl CodecBenchOptions {
    /// A quick run: 8 MiB buffers (likely cache-resident, so ratios are only indicative) and
    /// 3 repetitions.
    pub fn quick() -> Self {
        CodecBenchOptions {
            buffer_bytes: 8 << 20,
            repetitions: 3,
            ..CodecBenchOptions::default()
        }
    }
}

/// A measured operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchOp {
    /// [`kvstack_kernels::quantize`] (checked).
    Quantize,
    /// [`kvstack_kernels::dequantize`].
    Dequantize,
    /// [`kvstack_kernels::dot_fp4_many`] or [`kvstack_kernels::dot_mxfp4_many`]: an f32 query
    /// against the entries.
    DotF32,
    /// [`kvstack_kernels::dot_mxfp4_mxfp4_many`]: an MXFP4 query against the keys.
    DotMxfp4,
}

impl BenchOp {
    /// Short name: `quantize`, `dequantize`, `dot-f32`, `dot-mxfp4`.
    pub const fn name(self) -> &'static str {
        match self {
            BenchOp::Quantize => "quantize",
            BenchOp::Dequantize => "dequantize",
            BenchOp::DotF32 => "dot-f32",
            BenchOp::DotMxfp4 => "dot-mxfp4",
        }
    }
}

impl fmt::Display for BenchOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The limit an operation is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// memcpy of a buffer as large as the counted bytes.
    Memcpy,
    /// A vectorized sum over the counted bytes (memory-read bandwidth).
    MemoryRead,
}

impl fmt::Display for Baseline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Baseline::Memcpy => "memcpy",
            Baseline::MemoryRead => "read",
        })
    }
}

/// One timed measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throughput {
    /// Bytes counted.
    pub bytes: u64,
    /// Best time over the repetitions, in seconds.
    pub seconds: f64,
    /// `bytes / seconds / 1e9`.
    pub gb_per_s: f64,
}

impl Throughput {
    fn new(bytes: u64, seconds: f64) -> Self {
        Throughput {
            bytes,
            seconds,
            gb_per_s: if seconds > 0.0 {
                bytes as f64 / seconds / 1e9
            } else {
                f64::INFINITY
            },
        }
    }
}

/// The result of one operation on one format.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecBenchResult {
    /// The entry format.
    pub format: EntryFormat,
    /// The operation.
    pub op: BenchOp,
    /// The SIMD level that ran.
    pub level: SimdLevel,
    /// Rows (entries) processed per repetition.
    pub rows: usize,
    /// Bytes counted (see the module table), time and rate.
    pub throughput: Throughput,
    /// What the rate is compared with.
    pub baseline: Baseline,
    /// The baseline's rate, measured in this run over the same number of bytes.
    pub baseline_gb_per_s: f64,
    /// `throughput.gb_per_s / baseline_gb_per_s`.
    pub ratio: f64,
    /// The target ratio (see the module table).
    pub target: f64,
    /// `ratio >= target`.
    pub meets_target: bool,
}

/// Everything one [`run_codec_bench`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecBenchReport {
    /// The SIMD level that ran.
    pub level: SimdLevel,
    /// [`CodecBenchOptions::buffer_bytes`] as used.
    pub buffer_bytes: usize,
    /// Repetitions per measurement.
    pub repetitions: usize,
    /// The fastest memcpy baseline of the run (bytes counted once, not read plus write).
    pub memcpy: Throughput,
    /// One entry per format and operation.
    pub results: Vec<CodecBenchResult>,
    /// Anything the caller should know (for example a level that was not available).
    pub notes: Vec<String>,
}

/// Target ratios of the module table.
const QUANTIZE_TARGET: f64 = 0.25;
const DEQUANTIZE_TARGET: f64 = 0.5;
const DOT_TARGET: f64 = 0.5;

/// Best wall times of `reps` alternating runs of `base` and `op` (after one untimed warm-up run
/// of each). Alternating gives both the same conditions on a machine whose bandwidth varies
/// with its neighbours' load.
fn best_of_pair(reps: usize, mut base: impl FnMut(), mut op: impl FnMut()) -> (f64, f64) {
    base();
    op();
    let (mut tb, mut to) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        base();
        tb = tb.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        op();
        to = to.min(t.elapsed().as_secs_f64());
    }
    (tb, to)
}

/// Deterministic test data: activations of varying magnitude per row.
fn activations(n: usize, seed: u64) -> Vec<f32> {
    // An odd seed: xorshift never leaves zero.
    let mut rng = Rng(seed | 1);
    (0..n)
        .map(|i| {
            // The magnitude changes every 64 values, so tiles see different scales.
            let mag = 2f32.powi(((i / 64) % 16) as i32 - 8);
            rng.uniform() * mag
        })
        .collect()
}

fn result(
    format: EntryFormat,
    op: BenchOp,
    level: SimdLevel,
    rows: usize,
    throughput: Throughput,
    baseline: (Baseline, f64),
    target: f64,
) -> CodecBenchResult {
    let ratio = throughput.gb_per_s / baseline.1;
    CodecBenchResult {
        format,
        op,
        level,
        rows,
        throughput,
        baseline: baseline.0,
        baseline_gb_per_s: baseline.1,
        ratio,
        target,
        meets_target: ratio >= target,
    }
}

/// Fills `n` entries by repeating `block` (whole entries).
fn tile_entries(block: &[u8], entry_bytes: usize, n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(n * entry_bytes);
    while v.len() < n * entry_bytes {
        let take = (n * entry_bytes - v.len()).min(block.len());
        v.extend_from_slice(&block[..take]);
    }
    v
}

/// Runs the codec benchmark on one thread: for each requested format, quantize and dequantize
/// (each interleaved with a memcpy of as many bytes as its f32 side) and the fused dots (each
/// interleaved with a vectorized read of the same entries).
pub fn run_codec_bench(opts: &CodecBenchOptions) -> CodecBenchReport {
    let mut notes = Vec::new();
    let peaks = crate::peaks_for(opts.level, &mut notes);
    let lv = peaks.level();
    let reps = opts.repetitions.max(1);
    let buf = opts.buffer_bytes.max(1 << 16);

    // memcpy buffers, written once so that page faults are never timed.
    let src = vec![0x5Au8; buf];
    let mut dst = vec![0u8; buf];
    let mut memcpy = Throughput::new(buf as u64, f64::INFINITY);
    let mut results = Vec::new();
    let mut err: Option<kvstack_kernels::Error> = None;

    for &format in &opts.formats {
        let dim = format.dim();
        let eb = format.entry_bytes();

        // Quantize and dequantize: `buf` bytes of f32 (whole rows).
        let rows = (buf / (dim * 4)).max(1);
        let f32_bytes = rows * dim * 4;
        let x = activations(rows * dim, 0x9E37_79B9 ^ dim as u64);
        let mut enc = vec![0u8; rows * eb];
        let mut copy = |n: usize| {
            let n = n.min(buf);
            dst[..n].copy_from_slice(black_box(&src[..n]));
            black_box(&mut dst);
        };
        let (tm, t) = best_of_pair(
            reps,
            || copy(f32_bytes),
            || {
                let r = kvstack_kernels::quantize_with(lv, format, black_box(&x), &mut enc);
                black_box(&mut enc);
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
            },
        );
        let base = Throughput::new(f32_bytes as u64, tm);
        if base.seconds < memcpy.seconds {
            memcpy = base;
        }
        results.push(result(
            format,
            BenchOp::Quantize,
            lv,
            rows,
            Throughput::new(f32_bytes as u64, t),
            (Baseline::Memcpy, base.gb_per_s),
            QUANTIZE_TARGET,
        ));
        drop(x);
        let mut y = vec![0f32; rows * dim];
        let (tm, t) = best_of_pair(
            reps,
            || copy(f32_bytes),
            || {
                let r = kvstack_kernels::dequantize_with(lv, format, black_box(&enc), &mut y);
                black_box(&mut y);
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
            },
        );
        let base = Throughput::new(f32_bytes as u64, tm);
        if base.seconds < memcpy.seconds {
            memcpy = base;
        }
        results.push(result(
            format,
            BenchOp::Dequantize,
            lv,
            rows,
            Throughput::new(f32_bytes as u64, t),
            (Baseline::Memcpy, base.gb_per_s),
            DEQUANTIZE_TARGET,
        ));
        drop(y);

        // Dots: `buf` bytes of entries, built by repeating the entries just encoded.
        if format == EntryFormat::WindowFp8 {
            continue;
        }
        let n = (buf / eb).max(1);
        let entries = tile_entries(&enc[..enc.len().min(4096 * eb)], eb, n);
        drop(enc);
        let enc_bytes = (n * eb) as u64;
        let mut out = vec![0f32; n];
        let q = activations(dim, 42);
        let mut dot =
            |op: BenchOp, run: &mut dyn FnMut(&mut [f32]) -> Result<(), kvstack_kernels::Error>| {
                let (tr, t) = best_of_pair(
                    reps,
                    || {
                        black_box(peaks.read_sum(black_box(&entries)));
                    },
                    || {
                        if let Err(e) = run(&mut out) {
                            err.get_or_insert(e);
                        }
                        black_box(&mut out);
                    },
                );
                result(
                    format,
                    op,
                    lv,
                    n,
                    Throughput::new(enc_bytes, t),
                    (
                        Baseline::MemoryRead,
                        Throughput::new(enc_bytes, tr).gb_per_s,
                    ),
                    DOT_TARGET,
                )
            };
        match format {
            EntryFormat::GlobalFp4 => {
                let (Ok(es), Ok(q)) = (
                    <[GlobalFp4Entry]>::ref_from_bytes(&entries),
                    <&[f32; 512]>::try_from(&q[..]),
                ) else {
                    notes.push("internal: fp4 entry view failed".to_owned());
                    continue;
                };
                results.push(dot(BenchOp::DotF32, &mut |o| {
                    kvstack_kernels::dot_fp4_many_with(lv, black_box(q), es, o)
                }));
            }
            EntryFormat::IndexMxfp4 => {
                let (Ok(ks), Ok(qf)) = (
                    <[IndexMxfp4Entry]>::ref_from_bytes(&entries),
                    <&[f32; 128]>::try_from(&q[..]),
                ) else {
                    notes.push("internal: mxfp4 entry view failed".to_owned());
                    continue;
                };
                results.push(dot(BenchOp::DotF32, &mut |o| {
                    kvstack_kernels::dot_mxfp4_many_with(lv, black_box(qf), ks, o)
                }));
                let qm = ks[n / 2];
                results.push(dot(BenchOp::DotMxfp4, &mut |o| {
                    kvstack_kernels::dot_mxfp4_mxfp4_many_with(lv, black_box(&qm), ks, o)
                }));
            }
            EntryFormat::WindowFp8 => {}
        }
    }
    if let Some(e) = err {
        notes.push(format!(
            "a measured call failed, results are not meaningful: {e}"
        ));
    }
    if opts.formats.contains(&EntryFormat::WindowFp8) {
        notes.push("fp8-window has no fused dot kernel; only its codecs are measured".to_owned());
    }

    CodecBenchReport {
        level: lv,
        buffer_bytes: buf,
        repetitions: reps,
        memcpy,
        results,
        notes,
    }
}

impl fmt::Display for CodecBenchReport {
    /// A plain-text table, one line per result.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "level {}, buffers {} MiB, best of {}; memcpy {:.2} GB/s",
            self.level,
            self.buffer_bytes >> 20,
            self.repetitions,
            self.memcpy.gb_per_s
        )?;
        writeln!(
            f,
            "{:<12} {:<10} {:>10} {:>9} {:>8} {:>10} {:>7} {:>7}",
            "format", "op", "MB", "GB/s", "vs", "base GB/s", "ratio", "target"
        )?;
        for r in &self.results {
            writeln!(
                f,
                "{:<12} {:<10} {:>10.1} {:>9.2} {:>8} {:>10.2} {:>7.3} {:>6.2}{}",
                r.format.name(),
                r.op.name(),
                r.throughput.bytes as f64 / 1e6,
                r.throughput.gb_per_s,
                r.baseline.to_string(),
                r.baseline_gb_per_s,
                r.ratio,
                r.target,
                if r.meets_target { " ok" } else { " MISS" }
            )?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}
