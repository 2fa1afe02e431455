//! Decode-step benchmark of the attention kernels at the real V4.1-Flash dimensions, against
//! this machine's limits measured in the same run.
//!
//! Cases (synthetic caches produced by the codecs, in pages of 256 entries of memory advised
//! for transparent huge pages as the runtime's page pool allocates it; 64 heads x 512, index
//! 32 x 128, top-512, window 128, pool 2048 x 8):
//!
//! | case | what one step does |
//! |---|---|
//! | `attention` | sparse attention alone: 128 FP8 window + 512 FP4 entries, warm; timed over 8 back-to-back calls |
//! | `reuse` | a Reuse layer: the same with a top-k drawn from a 1M-entry global cache |
//! | `reindex` | a Reindex layer: scores of a 16,384-position pool, top-512, attention; part `read` reads the cache lines of another such pool and nothing else (the memory floor of this access pattern) |
//! | `full-131k`, `full-1M` | the Full layer 20: scan of all entries, top-512, the pool |
//! | `plain-8k` | plain attention (64 heads over 8,192 FP4 entries), for other engines |
//!
//! The Reuse and Reindex cases draw a new selection (and pool) every repetition, so their
//! entries come from DRAM as in a real decode step. Steps with parts also report each part.
//!
//! Counted bytes are cache bytes read (68 B per index key scored, 528 B per window entry, 288 B
//! per global entry); score buffers, queries and outputs are not counted. Counted FLOPs are 2
//! per multiply-add of the dot products only: `32 x 128` per index key, `64 x 512` for the
//! logits plus `64 x 512` for `P . V` per attended entry; softmax, exponentials, dequantization
//! and selection are not counted. Every time is the best of the repetitions (the median is
//! reported too). Threads are the caller plus rayon's pool, for the cases and the limit probes
//! alike, so a timed call finds the pool's workers awake, as the stages of a decode step leave
//! them; the first call after the pool has idled pays the wake-up of a parked worker on top.
//!
//! Limits, per thread count: memory read bandwidth (a vectorized sum over a 256 MiB buffer split
//! between the threads), the f32 FMA peak (12 independent FMA chains in registers per thread)
//! and the 8-bit integer peak of the indexer's instruction mix (`vpmaddubsw` + `vpaddw`, 32
//! multiply-adds per pair). The compute peaks are probed before every repetition of every
//! case (a few ms each), so that a case and its limits see the same conditions on a shared
//! machine; a row uses the best probes of its own repetitions. A case's binding limit is the
//! one with the longer ideal time (bytes / bandwidth or FLOPs / peak; the indexer's peak is the
//! integer one, since its kernel multiplies in 8-bit integers), and its ratio is that ideal
//! time over the measured time. Targets: the indexer scans (the Full layer's over every entry,
//! the Reindex layer's over its pool) and the sparse attention (alone, and the plain 8k case)
//! reach at least 0.5.

use std::fmt;
use std::hint::black_box;
use std::time::Instant;

use kvstack_kernels::attn::{
    HEAD_DIM, HEADS, INDEX_DIM, INDEX_HEADS, IndexQuery, POOL_BLOCK, POOL_BLOCKS, Paged,
    SparseAttnInput, TOPK, WINDOW, candidate_blocks, indexer_scores_at_with, indexer_scores_with,
    sparse_attention_decode_with, topk, topk_positions,
};
use kvstack_kernels::peak::{Int8Kernel, Peaks};
use kvstack_kernels::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, SimdLevel, WindowFp8Entry};
use zerocopy::{FromBytes, IntoBytes};

use crate::Result;
use crate::rng::Rng;

/// What to run.
#[derive(Debug, Clone)]
pub struct AttentionBenchOptions {
    /// Thread counts to run every case with.
    pub threads: Vec<usize>,
    /// Repetitions per measurement (at least 1); the fastest counts.
    pub repetitions: usize,
    /// Smaller caches (131,072 entries, no 1M case) and fewer repetitions: a smoke run.
    pub quick: bool,
    /// Level to run; `None` (or an unavailable level, with a note) runs the detected one.
    pub level: Option<SimdLevel>,
}

impl Default for AttentionBenchOptions {
    fn default() -> Self {
        AttentionBenchOptions {
            threads: vec![1, 2],
            repetitions: 7,
            quick: false,
            level: None,
        }
    }
}

impl AttentionBenchOptions {
    /// A smoke run: see [`AttentionBenchOptions::quick`].
    pub fn quick() -> Self {
        AttentionBenchOptions {
            repetitions: 3,
            quick: true,
            ..AttentionBenchOptions::default()
        }
    }
}

/// This machine's limits for one thread count, measured in the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MachineLimits {
    /// Threads running at once.
    pub threads: usize,
    /// Memory read bandwidth, GB/s.
    pub read_gb_per_s: f64,
    /// f32 FMA peak of the SIMD path, GFLOP/s (2 per multiply-add).
    pub fma_gflop_per_s: f64,
    /// 8-bit integer multiply-add peak (`vpmaddubsw` + `vpaddw`), in GFLOP/s-equivalent (2 per
    /// multiply-add). Zero on levels without the integer kernel.
    pub int8_gflop_per_s: f64,
}

/// The limit a case is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Memory read bandwidth.
    Memory,
    /// f32 FMA peak.
    Fma,
    /// 8-bit integer multiply-add peak.
    Int8,
    /// Nothing counted (selection only).
    None,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::Memory => "memory",
            Bound::Fma => "fma",
            Bound::Int8 => "int8",
            Bound::None => "-",
        })
    }
}

/// One measured row.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseResult {
    /// Case name (see the module table).
    pub case: &'static str,
    /// `step` (the whole decode step of the case) or one of its parts: `scan`, `select`,
    /// `attention`.
    pub part: &'static str,
    /// Threads.
    pub threads: usize,
    /// Best time, milliseconds.
    pub ms: f64,
    /// Median time, milliseconds.
    pub median_ms: f64,
    /// Cache bytes read per step.
    pub bytes: u64,
    /// FLOPs counted per step.
    pub flops: u64,
    /// `bytes / best time`, GB/s.
    pub gb_per_s: f64,
    /// `flops / best time`, GFLOP/s.
    pub gflop_per_s: f64,
    /// `gb_per_s` over the read bandwidth.
    pub mem_ratio: f64,
    /// The f32 FMA peak measured next to this row (best of the probes interleaved with its
    /// repetitions), GFLOP/s.
    pub fma_limit: f64,
    /// The integer peak measured next to this row, GFLOP/s-equivalent (0 without it).
    pub int8_limit: f64,
    /// `gflop_per_s` over the f32 FMA peak.
    pub fma_ratio: f64,
    /// `gflop_per_s` over the integer peak (indexer rows only).
    pub int8_ratio: Option<f64>,
    /// The binding limit.
    pub bound: Bound,
    /// Ideal time under the binding limit over the measured time.
    pub ratio: f64,
    /// Target ratio, for the rows that have one (the indexer scans and the sparse attention).
    pub target: Option<f64>,
}

impl CaseResult {
    /// Whether the row meets its target (`None` without one).
    pub fn meets_target(&self) -> Option<bool> {
        self.target.map(|t| self.ratio >= t)
    }
}

/// Everything one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionBenchReport {
    /// The SIMD level that ran.
    pub level: SimdLevel,
    /// Repetitions per measurement.
    pub repetitions: usize,
    /// Limits per thread count.
    pub limits: Vec<MachineLimits>,
    /// One row per case, part and thread count.
    pub results: Vec<CaseResult>,
    /// Anything the reader should know.
    pub notes: Vec<String>,
}

impl AttentionBenchReport {
    /// Whether every row with a target meets it.
    pub fn meets_targets(&self) -> bool {
        self.results.iter().all(|r| r.meets_target() != Some(false))
    }
}

/// Target ratio of the indexer scan and the sparse attention.
const TARGET: f64 = 0.5;

/// `total` entries of `format`: `distinct` random rows quantized by the codecs, repeated.
fn entries<E: FromBytes + IntoBytes + Clone>(
    format: EntryFormat,
    distinct: usize,
    total: usize,
    rng: &mut Rng,
) -> Result<Vec<E>, kvstack_kernels::Error> {
    let distinct = distinct.min(total).max(1);
    let mut x = Vec::with_capacity(distinct * format.dim());
    for _ in 0..distinct {
        // Per-row magnitudes vary like normed activations with RoPE.
        let s = 1.0 + rng.uniform();
        x.extend((0..format.dim()).map(|_| rng.normal(2.0 * s)));
    }
    let mut base = vec![E::new_zeroed(); distinct];
    kvstack_kernels::quantize(format, &x, base.as_mut_bytes())?;
    let mut v = Vec::with_capacity(total);
    while v.len() < total {
        let take = (total - v.len()).min(base.len());
        v.extend_from_slice(&base[..take]);
    }
    Ok(v)
}

/// Cache entries in memory like the runtime's page pool holds them: an anonymous mapping
/// advised for transparent huge pages (the driver's `GrowableRegion` does the same), so that a
/// random entry costs a DRAM access and not also a walk of 4 KiB page tables, which would add
/// to the gathered scans what the runtime does not pay. Falls back to the heap, with a note,
/// where the mapping or the advice fails.
enum CacheMemory<E> {
    Mapped(memmap2::MmapMut, std::marker::PhantomData<E>),
    Heap(Vec<E>),
}

impl<E: FromBytes + IntoBytes + zerocopy::Immutable + zerocopy::KnownLayout> CacheMemory<E> {
    fn new(v: Vec<E>, notes: &mut Vec<String>) -> Self {
        let bytes = v.as_bytes();
        let mut map = match memmap2::MmapMut::map_anon(bytes.len().max(1)) {
            Ok(m) => m,
            Err(e) => {
                notes.push(format!(
                    "cache memory from the heap: anonymous mapping failed: {e}"
                ));
                return CacheMemory::Heap(v);
            }
        };
        // The advice must come before the first touch, which is when pages are chosen.
        #[cfg(target_os = "linux")]
        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
            notes.push(format!(
                "cache memory in base pages: MADV_HUGEPAGE failed: {e}"
            ));
        }
        if let Some(dst) = map.get_mut(..bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        CacheMemory::Mapped(map, std::marker::PhantomData)
    }

    fn entries(&self) -> &[E] {
        match self {
            CacheMemory::Mapped(m, _) => m
                .get(..m.len() / size_of::<E>() * size_of::<E>())
                .and_then(|b| <[E]>::ref_from_bytes(b).ok())
                .unwrap_or_default(),
            CacheMemory::Heap(v) => v,
        }
    }
}

/// Runs `f(i)` on `threads` threads at once: the caller and rayon's pool, the threads the
/// kernels run on. The probe thus leaves the pool's workers as a decode step leaves them
/// between its stages (awake), rather than parked while fresh OS threads ran the probe, so a
/// timed call does not pay a worker's wake-up that a decode step would not.
fn on_threads(threads: usize, f: impl Fn(usize) + Sync) {
    let f = &f;
    kvstack_kernels::par::run_tasks((0..threads.max(1)).map(|i| move || f(i)));
}

/// Reads every cache line of the pool's keys (blocks of [`POOL_BLOCK`] consecutive
/// positions), the blocks split between `threads` threads: what a gathered scan must fetch,
/// with nothing else to do, so the floor of the Reindex scan's time for this access pattern.
fn read_pool(keys: Paged<'_, IndexMxfp4Entry>, pool: &[i32], threads: usize) -> u64 {
    let blocks: Vec<&[i32]> = pool.chunks(POOL_BLOCK).collect();
    let per = blocks.len().div_ceil(threads.max(1)).max(1);
    let total = std::sync::atomic::AtomicU64::new(0);
    on_threads(threads, |i| {
        let mut sum = 0u64;
        for b in blocks.iter().skip(i * per).take(per) {
            let Some(start) = b.first().and_then(|&p| usize::try_from(p).ok()) else {
                continue;
            };
            for (_, run) in keys.runs(start..start + b.len()) {
                let bytes = run.as_bytes();
                for off in (0..bytes.len()).step_by(64) {
                    sum += u64::from(bytes.get(off).copied().unwrap_or(0));
                }
                sum += u64::from(bytes.last().copied().unwrap_or(0));
            }
        }
        total.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
    });
    total.into_inner()
}

/// The limit probes of one thread count. Each probe returns the rate it measured and keeps
/// the best one seen in [`Probes::best`].
struct Probes<'a> {
    peaks: Peaks,
    threads: usize,
    mem: &'a [u8],
    iters: u64,
    best: MachineLimits,
}

/// The compute limits measured next to one case (best over its repetitions).
#[derive(Clone, Copy, Debug, Default)]
struct Local {
    fma: f64,
    int8: f64,
}

impl<'a> Probes<'a> {
    fn new(peaks: Peaks, threads: usize, mem: &'a [u8], iters: u64) -> Self {
        Probes {
            peaks,
            threads,
            mem,
            iters,
            best: MachineLimits {
                threads,
                read_gb_per_s: 0.0,
                fma_gflop_per_s: 0.0,
                int8_gflop_per_s: 0.0,
            },
        }
    }

    /// Memory read bandwidth, GB/s: the threads sum disjoint parts of the buffer.
    fn read(&mut self) -> f64 {
        let (peaks, mem, t) = (self.peaks, self.mem, self.threads);
        let chunk = mem.len().div_ceil(t).max(1);
        let s = Instant::now();
        on_threads(t, |i| {
            let part = mem
                .get(i * chunk..((i + 1) * chunk).min(mem.len()))
                .unwrap_or_default();
            black_box(peaks.read_sum(black_box(part)));
        });
        let r = mem.len() as f64 / s.elapsed().as_secs_f64() / 1e9;
        self.best.read_gb_per_s = self.best.read_gb_per_s.max(r);
        r
    }

    /// The compute peaks, GFLOP/s: every thread runs the FMA loop, then the integer loop.
    fn compute(&mut self) -> Local {
        let (peaks, iters, t) = (self.peaks, self.iters, self.threads);
        let s = Instant::now();
        on_threads(t, |i| {
            black_box(peaks.fma(black_box(iters), i as f32));
        });
        let fma = peaks.fma_flops_per_iter() as f64 * (iters * t as u64) as f64
            / s.elapsed().as_secs_f64()
            / 1e9;
        // The peak of the instruction the indexer's kernel runs at this level on this CPU.
        let int8 = match peaks.int8_kernel() {
            Some(kernel) => {
                let s = Instant::now();
                on_threads(t, |i| {
                    black_box(peaks.int8(black_box(iters), i as i32));
                });
                2.0 * kernel.macs_per_iter() as f64 * (iters * t as u64) as f64
                    / s.elapsed().as_secs_f64()
                    / 1e9
            }
            None => 0.0,
        };
        self.best.fma_gflop_per_s = self.best.fma_gflop_per_s.max(fma);
        self.best.int8_gflop_per_s = self.best.int8_gflop_per_s.max(int8);
        Local { fma, int8 }
    }

    /// Times `reps` runs of `op` (after one untimed warm-up), each preceded by a compute probe
    /// so that the case and its limits see the same conditions on a busy machine. Returns the
    /// best and median times and the best probe rates.
    fn time(&mut self, reps: usize, mut op: impl FnMut(usize)) -> ((f64, f64), Local) {
        op(0);
        let mut local = Local::default();
        let mut t = Vec::with_capacity(reps.max(1));
        for i in 1..=reps.max(1) {
            let l = self.compute();
            local.fma = local.fma.max(l.fma);
            local.int8 = local.int8.max(l.int8);
            let s = Instant::now();
            op(i);
            t.push(s.elapsed().as_secs_f64());
        }
        (best_median(&mut t), local)
    }
}

/// What a row is held to.
#[derive(Clone, Copy)]
enum Kind {
    /// The integer indexer kernel.
    Index,
    /// The f32 attention kernels.
    Attention,
    /// Both (a step with a scan and an attention): held to the sum of the ideal times.
    Mixed { index_flops: u64 },
    /// Selection only.
    Select,
    /// Memory reads only (held to the read bandwidth).
    Read,
}

#[allow(clippy::too_many_arguments)]
fn row(
    case: &'static str,
    part: &'static str,
    lim: &MachineLimits,
    local: Local,
    (best, median): (f64, f64),
    bytes: u64,
    flops: u64,
    kind: Kind,
    target: Option<f64>,
) -> CaseResult {
    let gb = bytes as f64 / best / 1e9;
    let gf = flops as f64 / best / 1e9;
    let t_mem = bytes as f64 / (lim.read_gb_per_s * 1e9);
    let int8 = local.int8 > 0.0;
    // Ideal compute time: integer FLOPs at the integer peak (when the level has that kernel),
    // f32 FLOPs at the FMA peak.
    let (int_flops, f32_flops) = match kind {
        Kind::Index if int8 => (flops, 0),
        Kind::Mixed { index_flops } if int8 => (index_flops, flops.saturating_sub(index_flops)),
        _ => (0, flops),
    };
    let t_int = if int_flops > 0 {
        int_flops as f64 / (local.int8 * 1e9)
    } else {
        0.0
    };
    let t_cmp = t_int + f32_flops as f64 / (local.fma * 1e9);
    let (bound, ideal) = if matches!(kind, Kind::Select) {
        (Bound::None, 0.0)
    } else if t_mem >= t_cmp {
        (Bound::Memory, t_mem)
    } else if t_int >= t_cmp - t_int {
        (Bound::Int8, t_cmp)
    } else {
        (Bound::Fma, t_cmp)
    };
    CaseResult {
        case,
        part,
        threads: lim.threads,
        ms: best * 1e3,
        median_ms: median * 1e3,
        bytes,
        flops,
        gb_per_s: gb,
        gflop_per_s: gf,
        mem_ratio: gb / lim.read_gb_per_s,
        fma_ratio: gf / local.fma,
        int8_ratio: (matches!(kind, Kind::Index) && int8).then(|| gf / local.int8),
        fma_limit: local.fma,
        int8_limit: local.int8,
        bound,
        ratio: if best > 0.0 { ideal / best } else { 0.0 },
        target,
    }
}

/// FLOPs of one attended entry: logits and `P . V` for 64 heads.
const ATTN_FLOPS_PER_ROW: u64 = (HEADS * HEAD_DIM * 4) as u64;
/// FLOPs of one scored index key.
const INDEX_FLOPS_PER_KEY: u64 = (INDEX_HEADS * INDEX_DIM * 2) as u64;

/// `TOPK` distinct positions below `n`, ascending.
fn random_selection(rng: &mut Rng, n: usize, k: usize) -> Vec<i32> {
    let mut v: Vec<i32> = Vec::with_capacity(k);
    while v.len() < k.min(n) {
        let p = rng.below(n) as i32;
        if !v.contains(&p) {
            v.push(p);
        }
    }
    v.sort_unstable();
    v
}

/// A candidate pool: `POOL_BLOCKS` distinct random blocks of `POOL_BLOCK` positions below `n`.
fn random_pool(rng: &mut Rng, n: usize) -> Vec<i32> {
    let blocks = random_selection(rng, n / POOL_BLOCK, POOL_BLOCKS);
    blocks
        .iter()
        .flat_map(|&b| (0..POOL_BLOCK as i32).map(move |i| b * POOL_BLOCK as i32 + i))
        .collect()
}

/// Runs the benchmark (see the module documentation). Fails only if a kernel returns an
/// error, which would be a bug.
///
/// # Errors
///
/// [`crate::Error::Kernel`] with the first error a kernel call returned.
pub fn run_attention_bench(opts: &AttentionBenchOptions) -> Result<AttentionBenchReport> {
    let mut notes = Vec::new();
    let peaks = crate::peaks_for(opts.level, &mut notes);
    let lv = peaks.level();
    let reps = opts.repetitions.max(1);
    let n_max: usize = if opts.quick { 1 << 17 } else { 1 << 20 };
    let full_sizes: &[(&'static str, usize)] = if opts.quick {
        &[("full-131k", 1 << 17)]
    } else {
        &[("full-131k", 1 << 17), ("full-1M", 1 << 20)]
    };
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);

    // Caches: pages of 256 entries, as the paged KV cache stores them.
    const PAGE: usize = 256;
    let index_keys = CacheMemory::new(
        entries::<IndexMxfp4Entry>(EntryFormat::IndexMxfp4, 65536, n_max, &mut rng)?,
        &mut notes,
    );
    let global = CacheMemory::new(
        entries::<GlobalFp4Entry>(EntryFormat::GlobalFp4, 8192, n_max, &mut rng)?,
        &mut notes,
    );
    let (index_keys, global) = (index_keys.entries(), global.entries());
    let window: Vec<WindowFp8Entry> = entries(EntryFormat::WindowFp8, WINDOW, WINDOW, &mut rng)?;
    let key_pages: Vec<&[IndexMxfp4Entry]> = index_keys.chunks(PAGE).collect();
    let global_pages: Vec<&[GlobalFp4Entry]> = global.chunks(PAGE).collect();
    let global_paged = Paged::pages(&global_pages, PAGE)?;

    let qf: Vec<f32> = (0..HEADS * HEAD_DIM).map(|_| rng.normal(2.0)).collect();
    let q: Vec<[f32; HEAD_DIM]> = qf
        .chunks_exact(HEAD_DIM)
        .map(|c| std::array::from_fn(|i| c.get(i).copied().unwrap_or(0.0)))
        .collect();
    let sinks: Vec<f32> = (0..HEADS).map(|_| rng.uniform() * 4.0).collect();
    let iq: Vec<f32> = (0..INDEX_HEADS * INDEX_DIM)
        .map(|_| rng.normal(2.0))
        .collect();
    let w: [f32; INDEX_HEADS] = std::array::from_fn(|_| rng.uniform() + 0.2);
    let query = IndexQuery::from_f32(&iq, &w)?;
    if !query.has_fast_path() {
        notes.push("the index query falls outside the integer fast path".to_owned());
    }
    let selections: Vec<Vec<i32>> = (0..=reps)
        .map(|_| random_selection(&mut rng, n_max, TOPK))
        .collect();
    let pools: Vec<Vec<i32>> = (0..=reps).map(|_| random_pool(&mut rng, n_max)).collect();
    let read_pools: Vec<Vec<i32>> = (0..=reps).map(|_| random_pool(&mut rng, n_max)).collect();
    let runs = [&window[..]];
    let sel_all: Vec<i32> = (0..TOPK as i32).collect();
    let plain_n = 8192usize;
    let plain_sel: Vec<i32> = (0..plain_n as i32).collect();
    let mut out = vec![[0f32; HEAD_DIM]; HEADS];
    let mut scores = vec![0f32; n_max];
    let mut pool_scores = vec![0f32; POOL_BLOCKS * POOL_BLOCK];
    let mut top = vec![0i32; TOPK];

    let mem = vec![0x5Au8; if opts.quick { 64 << 20 } else { 256 << 20 }];
    // About 2-5 ms per probe: short next to the cases it is interleaved with.
    let iters: u64 = 1 << 20;
    let mut limits = Vec::new();
    let mut results = Vec::new();
    let attn_bytes = (WINDOW * WindowFp8Entry::BYTES + TOPK * GlobalFp4Entry::BYTES) as u64;
    let attn_flops = (WINDOW + TOPK) as u64 * ATTN_FLOPS_PER_ROW;
    let mut err: Option<kvstack_kernels::Error> = None;
    let mut keep = |r: Result<(), kvstack_kernels::Error>| {
        if let Err(e) = r {
            err.get_or_insert(e);
        }
    };

    for &t in &opts.threads {
        let t = t.max(1);
        let mut pr = Probes::new(peaks, t, &mem, iters);
        for _ in 0..reps.min(3) {
            pr.read();
        }
        let lim = pr.best;
        let attend = |input: &SparseAttnInput<'_>, out: &mut [[f32; HEAD_DIM]]| {
            sparse_attention_decode_with(lv, input, t, out)
        };

        // Sparse attention alone: warm entries.
        let input = SparseAttnInput {
            q: &q,
            sinks: Some(&sinks),
            window: &runs,
            global: Paged::contiguous(global.get(..TOPK).unwrap_or_default()),
            selected: &sel_all,
        };
        // Back-to-back calls, as the layers of one decode step make them: the time per call
        // without a timer read and a pool wake-up around each 0.3-0.8 ms call.
        let (tm, lo) = pr.time(reps, |_| {
            for _ in 0..ATTN_CALLS {
                keep(attend(black_box(&input), &mut out));
            }
        });
        let tm = (tm.0 / ATTN_CALLS as f64, tm.1 / ATTN_CALLS as f64);
        results.push(row(
            "attention",
            "step",
            &lim,
            lo,
            tm,
            attn_bytes,
            attn_flops,
            Kind::Attention,
            Some(TARGET),
        ));

        // Reuse layer: inherited top-k from the large paged cache, a new one each repetition.
        let (tm, lo) = pr.time(reps, |i| {
            let input = SparseAttnInput {
                global: global_paged,
                selected: selections.get(i).map_or(&sel_all[..], |s| &s[..]),
                q: &q,
                sinks: Some(&sinks),
                window: &runs,
            };
            keep(attend(black_box(&input), &mut out));
        });
        results.push(row(
            "reuse",
            "step",
            &lim,
            lo,
            tm,
            attn_bytes,
            attn_flops,
            Kind::Attention,
            None,
        ));

        // Reindex layer: candidate scores, top-k over the pool, attention.
        let keys = Paged::pages(&key_pages, PAGE)?;
        let (mut ts, mut tk, mut ta) = (Vec::new(), Vec::new(), Vec::new());
        let pool_len = (POOL_BLOCKS * POOL_BLOCK) as u64;
        let (tm, lo) = pr.time(reps, |i| {
            let pool = pools.get(i).map_or(&pools[0][..], |p| &p[..]);
            let s = Instant::now();
            keep(indexer_scores_at_with(
                lv,
                &query,
                keys,
                n_max,
                pool,
                t,
                &mut pool_scores,
            ));
            let s1 = Instant::now();
            keep(topk_positions(&pool_scores, pool, &mut top));
            let s2 = Instant::now();
            let input = SparseAttnInput {
                global: global_paged,
                selected: &top,
                q: &q,
                sinks: Some(&sinks),
                window: &runs,
            };
            keep(attend(&input, &mut out));
            let s3 = Instant::now();
            if i > 0 {
                ts.push((s1 - s).as_secs_f64());
                tk.push((s2 - s1).as_secs_f64());
                ta.push((s3 - s2).as_secs_f64());
            }
        });
        let idx_bytes = pool_len * IndexMxfp4Entry::BYTES as u64;
        let idx_flops = pool_len * INDEX_FLOPS_PER_KEY;
        results.push(row(
            "reindex",
            "step",
            &lim,
            lo,
            tm,
            idx_bytes + attn_bytes,
            idx_flops + attn_flops,
            Kind::Mixed {
                index_flops: idx_flops,
            },
            None,
        ));
        results.push(row(
            "reindex",
            "scan",
            &lim,
            lo,
            best_median(&mut ts),
            idx_bytes,
            idx_flops,
            Kind::Index,
            Some(TARGET),
        ));
        // The same access pattern without the scoring: the memory floor of the scan.
        let (tm, lo) = pr.time(reps, |i| {
            let pool = read_pools.get(i).map_or(&read_pools[0][..], |p| &p[..]);
            black_box(read_pool(keys, pool, t));
        });
        results.push(row(
            "reindex",
            "read",
            &lim,
            lo,
            tm,
            idx_bytes,
            0,
            Kind::Read,
            None,
        ));
        results.push(row(
            "reindex",
            "select",
            &lim,
            lo,
            best_median(&mut tk),
            0,
            0,
            Kind::Select,
            None,
        ));
        results.push(row(
            "reindex",
            "attention",
            &lim,
            lo,
            best_median(&mut ta),
            attn_bytes,
            attn_flops,
            Kind::Attention,
            None,
        ));

        // Full layer 20: scan of every visible entry, top-k, candidate pool.
        for &(name, n) in full_sizes {
            let keys = Paged::pages(key_pages.get(..n / PAGE).unwrap_or_default(), PAGE)?;
            let sc = scores.get_mut(..n).unwrap_or_default();
            let (mut ts, mut tk) = (Vec::new(), Vec::new());
            let (tm, lo) = pr.time(reps, |i| {
                let s = Instant::now();
                keep(indexer_scores_with(lv, &query, keys, n, t, sc));
                let s1 = Instant::now();
                keep(topk(sc, &mut top));
                let c = candidate_blocks(sc, n, POOL_BLOCKS, POOL_BLOCK);
                keep(c.map(|c| {
                    black_box(c);
                }));
                let s2 = Instant::now();
                if i > 0 {
                    ts.push((s1 - s).as_secs_f64());
                    tk.push((s2 - s1).as_secs_f64());
                }
            });
            let bytes = (n * IndexMxfp4Entry::BYTES) as u64;
            let flops = n as u64 * INDEX_FLOPS_PER_KEY;
            results.push(row(
                name,
                "step",
                &lim,
                lo,
                tm,
                bytes,
                flops,
                Kind::Index,
                None,
            ));
            results.push(row(
                name,
                "scan",
                &lim,
                lo,
                best_median(&mut ts),
                bytes,
                flops,
                Kind::Index,
                Some(TARGET),
            ));
            results.push(row(
                name,
                "select",
                &lim,
                lo,
                best_median(&mut tk),
                0,
                0,
                Kind::Select,
                None,
            ));
        }

        // Plain attention: 64 heads over 8,192 FP4 entries, no window, no sink.
        let plain = SparseAttnInput {
            q: &q,
            sinks: None,
            window: &[],
            global: Paged::contiguous(global.get(..plain_n).unwrap_or_default()),
            selected: &plain_sel,
        };
        let (tm, lo) = pr.time(reps, |_| keep(attend(black_box(&plain), &mut out)));
        results.push(row(
            "plain-8k",
            "step",
            &lim,
            lo,
            tm,
            (plain_n * GlobalFp4Entry::BYTES) as u64,
            plain_n as u64 * ATTN_FLOPS_PER_ROW,
            Kind::Attention,
            Some(TARGET),
        ));
        pr.read();
        limits.push(pr.best);
    }
    if let Some(e) = err {
        return Err(e.into());
    }
    if lv == SimdLevel::Avx512 {
        let vnni = peaks.int8_kernel() == Some(Int8Kernel::Vpdpbusd);
        notes.push(if vnni {
            "level avx512: sparse attention runs 512-bit kernels (FMA limit: 512-bit peak); the \
             indexer scan's per-key products use AVX-512 VNNI (int8 limit: the vpdpbusd peak)"
                .to_owned()
        } else {
            "level avx512: sparse attention runs 512-bit kernels (FMA limit: 512-bit peak); the \
             indexer scan runs its AVX2 integer kernel (this CPU has no AVX-512 VNNI; int8 \
             limit: the AVX2 peak)"
                .to_owned()
        });
    }
    Ok(AttentionBenchReport {
        level: lv,
        repetitions: reps,
        limits,
        results,
        notes,
    })
}

/// Calls per timed repetition of the warm sparse attention case.
const ATTN_CALLS: usize = 8;

/// `(best, median)` of measured part times.
fn best_median(t: &mut [f64]) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    match t.first() {
        Some(&b) => (b, t[t.len() / 2]),
        None => (0.0, 0.0),
    }
}

impl fmt::Display for AttentionBenchReport {
    /// The limits, then one line per row.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simd level {}, best of {} runs",
            self.level, self.repetitions
        )?;
        writeln!(
            f,
            "limits (same run)  threads  read GB/s  FMA GFLOP/s  int8 GFLOP/s"
        )?;
        for l in &self.limits {
            writeln!(
                f,
                "                   {:>7}  {:>9.2}  {:>11.1}  {:>12.1}",
                l.threads, l.read_gb_per_s, l.fma_gflop_per_s, l.int8_gflop_per_s
            )?;
        }
        writeln!(
            f,
            "{:<10} {:<9} {:>3} {:>8} {:>8} {:>6} {:>7} {:>6} {:>6} {:>7} {:>6} {:>7} {:>5}  target",
            "case",
            "part",
            "thr",
            "ms",
            "median",
            "GB/s",
            "GFLOP/s",
            "vs mem",
            "vs FMA",
            "vs int8",
            "bound",
            "limit",
            "ratio",
        )?;
        for r in &self.results {
            let int8 = r.int8_ratio.map_or("-".to_owned(), |x| format!("{x:.2}"));
            let limit = match r.bound {
                Bound::Memory => self
                    .limits
                    .iter()
                    .find(|l| l.threads == r.threads)
                    .map_or(0.0, |l| l.read_gb_per_s),
                Bound::Fma => r.fma_limit,
                Bound::Int8 => r.int8_limit,
                Bound::None => 0.0,
            };
            let target = match (r.target, r.meets_target()) {
                (Some(t), Some(true)) => format!(">={t:.1} ok"),
                (Some(t), _) => format!(">={t:.1} MISSED"),
                _ => String::new(),
            };
            writeln!(
                f,
                "{:<10} {:<9} {:>3} {:>8.3} {:>8.3} {:>6.2} {:>7.1} {:>6.2} {:>6.2} {:>7} {:>6} {:>7.1} {:>5.2}  {}",
                r.case,
                r.part,
                r.threads,
                r.ms,
                r.median_ms,
                r.gb_per_s,
                r.gflop_per_s,
                r.mem_ratio,
                r.fma_ratio,
                int8,
                r.bound.to_string(),
                limit,
                r.ratio,
                target
            )?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}
