//! The footprint bench (`kvstack bench footprint`): one V4.1-Flash sequence of N tokens in a
//! real cache, bytes measured from the pools' own allocations.

use std::time::Instant;

use kvstack_firmware_interface::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;
use zerocopy::{FromBytes, IntoBytes};

use kvstack_cache::{AppendData, CacheOptions, CacheUsage, KvCache};
use kvstack_spec::builtin::default_config;
use kvstack_spec::plan::LayerPlan;
use kvstack_spec::{CacheReport, FormatOverrides};

use crate::Error;

/// Tokens per prefill chunk of the bench.
pub const FOOTPRINT_CHUNK_TOKENS: u64 = 4096;

/// The footprint targets for N = 1,048,576 tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct FootprintTargets {
    /// `global_bytes_per_token` must not exceed this (890 is the entry arithmetic).
    pub global_bytes_per_token_max: f64,
    /// The window constant must equal this (`layers * window * 528`, from `kvstack calc`).
    pub window_bytes: u64,
    /// `peak_rss_bytes` must stay below this.
    pub peak_rss_bytes_max: u64,
}

/// What [`run_footprint_bench`] measured. Byte counts come from the pools' own allocations
/// (committed memory), not from formulas; `arithmetic_*` fields are `kvstack calc`'s for
/// comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FootprintReport {
    /// Tokens in the sequence.
    pub tokens: u64,
    /// Wall time of building the cache (encoding included).
    pub seconds: f64,
    /// How entries were encoded: `kvstack_kernels::quantize` at this SIMD level.
    pub codec: String,
    /// Tokens per page.
    pub page_tokens: u64,
    /// Tokens per append.
    pub chunk_tokens: u64,
    /// Allocated bytes of the global-entry and index-key pools per token.
    pub global_bytes_per_token: f64,
    /// Bytes of valid global entries and index keys per token.
    pub global_bytes_per_token_in_use: f64,
    /// `kvstack calc`'s persistent bytes per token (890 for V4.1-Flash).
    pub arithmetic_bytes_per_token: f64,
    /// Allocated bytes of the global-entry pools.
    pub global_allocated_bytes: u64,
    /// Bytes of valid global entries.
    pub global_entry_bytes: u64,
    /// Allocated bytes of the index-key pools.
    pub index_allocated_bytes: u64,
    /// Bytes of valid index keys.
    pub index_entry_bytes: u64,
    /// The per-sequence constant: window slab + pending-state buffers, allocated.
    pub per_sequence_bytes: u64,
    /// The window slab, allocated.
    pub window_bytes: u64,
    /// Pending compressor state buffers, allocated.
    pub pending_state_bytes: u64,
    /// `kvstack calc`'s per-sequence constant.
    pub arithmetic_per_sequence_bytes: u64,
    /// The cache's bookkeeping (block tables, token ids, prefix index, pool metadata).
    pub metadata_bytes: u64,
    /// `metadata_bytes / tokens`.
    pub metadata_bytes_per_token: f64,
    /// Peak resident set size of the process (`VmHWM`).
    pub peak_rss_bytes: u64,
    /// Resident set size before the cache was built.
    pub rss_before_bytes: u64,
    /// Pool bytes locked in memory.
    pub locked_bytes: u64,
    /// Pool bytes in transparent huge pages.
    pub huge_page_bytes: u64,
    /// The full accounting.
    pub usage: CacheUsage,
    /// The limits.
    pub targets: FootprintTargets,
    /// Which limits were missed (empty when all are met).
    pub failures: Vec<String>,
}

impl FootprintReport {
    /// Whether every target is met.
    pub fn meets_targets(&self) -> bool {
        self.failures.is_empty()
    }
}

/// A human-readable summary (the CLI's text output); `--json` serializes the report instead.
impl std::fmt::Display for FootprintReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = &self.targets;
        writeln!(
            f,
            "footprint of one V4.1-Flash sequence of {} tokens",
            self.tokens
        )?;
        writeln!(
            f,
            "  built in {:.2} s, {}-token chunks, {}-token pages, {}",
            self.seconds, self.chunk_tokens, self.page_tokens, self.codec
        )?;
        writeln!(
            f,
            "  global bytes per token   {:>14.3}  allocated (limit {}; in use {:.3}; calc {})",
            self.global_bytes_per_token,
            t.global_bytes_per_token_max,
            self.global_bytes_per_token_in_use,
            self.arithmetic_bytes_per_token
        )?;
        writeln!(
            f,
            "    global entries         {:>14}  allocated, {} in use",
            self.global_allocated_bytes, self.global_entry_bytes
        )?;
        writeln!(
            f,
            "    index keys             {:>14}  allocated, {} in use",
            self.index_allocated_bytes, self.index_entry_bytes
        )?;
        writeln!(
            f,
            "  per-sequence bytes       {:>14}  (calc {})",
            self.per_sequence_bytes, self.arithmetic_per_sequence_bytes
        )?;
        writeln!(
            f,
            "    window                 {:>14}  (must be {})",
            self.window_bytes, t.window_bytes
        )?;
        writeln!(
            f,
            "    pending state          {:>14}",
            self.pending_state_bytes
        )?;
        writeln!(
            f,
            "  metadata bytes           {:>14}  ({:.3} per token)",
            self.metadata_bytes, self.metadata_bytes_per_token
        )?;
        writeln!(
            f,
            "  peak RSS                 {:>14}  (limit {}; {} before the cache)",
            self.peak_rss_bytes, t.peak_rss_bytes_max, self.rss_before_bytes
        )?;
        writeln!(
            f,
            "  locked                   {:>14}  huge pages {}",
            self.locked_bytes, self.huge_page_bytes
        )?;
        if self.failures.is_empty() {
            writeln!(f, "  targets met")
        } else {
            writeln!(f, "  TARGETS MISSED: {}", self.failures.join("; "))
        }
    }
}

/// A small deterministic generator of synthetic values (xorshift64*).
struct Synth(u64);

impl Synth {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Values in [-8, 8) (the magnitude of post-RoPE entries, spec §5.2: about 10 observed),
    /// four 16-bit draws per step of the generator.
    fn fill(&mut self, out: &mut [f32]) {
        const SCALE: f32 = 16.0 / 65536.0;
        let mut chunks = out.chunks_exact_mut(4);
        for c in &mut chunks {
            let x = self.next();
            for (k, v) in c.iter_mut().enumerate() {
                *v = ((x >> (16 * k)) & 0xFFFF) as f32 * SCALE - 8.0;
            }
        }
        for v in chunks.into_remainder() {
            *v = (self.next() & 0xFFFF) as f32 * SCALE - 8.0;
        }
    }
}

/// Rows encoded per codec call (bounds the f32 scratch to 512 KiB).
const BATCH_ROWS: usize = 256;

/// Appends `rows` entries encoded from synthetic values to `out`, in batches.
fn encode<T: FromBytes + IntoBytes + Clone>(
    synth: &mut Synth,
    format: EntryFormat,
    rows: usize,
    scratch: &mut Vec<f32>,
    out: &mut Vec<T>,
) -> Result<(), Error> {
    let mut left = rows;
    while left > 0 {
        let n = left.min(BATCH_ROWS);
        scratch.resize(n * format.dim(), 0.0);
        synth.fill(scratch);
        let start = out.len();
        out.resize(start + n, T::new_zeroed());
        let bytes = out[start..].as_mut_bytes();
        kvstack_kernels::quantize(format, scratch, bytes).map_err(|source| Error::Codec {
            what: format.name(),
            source,
        })?;
        left -= n;
    }
    Ok(())
}

fn rss() -> crate::Result<kvstack_driver::probe::Rss> {
    kvstack_driver::probe::rss().map_err(|source| crate::Error::Io {
        what: "cannot read",
        path: "/proc/self/status".into(),
        source,
    })
}

/// Builds a V4.1-Flash cache (the built-in config, its real plan and entry sizes) holding one
/// sequence of `tokens` tokens, appended in chunks of [`FOOTPRINT_CHUNK_TOKENS`], with entries
/// encoded from synthetic values chunk by chunk (nothing is materialised for all tokens), and
/// reports the bytes the pools allocated. `progress` is called with the tokens appended so far
/// after every chunk. Run it in a fresh process: `peak_rss_bytes` is the process's peak.
///
/// # Errors
/// Config and cache errors; [`crate::Error::Io`] if `/proc/self/status` cannot be read.
pub fn run_footprint_bench(
    tokens: u64,
    mut progress: impl FnMut(u64),
) -> crate::Result<FootprintReport> {
    let rss_before = rss()?.current_bytes;
    let cfg = default_config()?;
    let plan = LayerPlan::from_config(&cfg)?;
    let arithmetic = CacheReport::compute(&cfg, &FormatOverrides::default())?;
    let options = CacheOptions {
        context_limit: tokens.max(1),
        max_sequences: 1,
        ..Default::default()
    };
    let start = Instant::now();
    let mut cache = KvCache::new(&cfg, &plan, options)?;
    let seq = cache.create_sequence()?;
    let g = cache.geometry().clone();
    let sources = g.sources.len();
    let window_start = tokens.saturating_sub(g.window_tokens as u64);

    let mut synth = Synth(0x9E37_79B9_7F4A_7C15);
    let mut scratch: Vec<f32> = Vec::new();
    let mut token_ids: Vec<u32> = Vec::new();
    let mut global: Vec<Vec<GlobalFp4Entry>> = vec![Vec::new(); sources];
    let mut index: Vec<Vec<IndexMxfp4Entry>> = vec![Vec::new(); sources];
    let mut pending: Vec<Vec<f32>> = vec![Vec::new(); sources];
    let mut window: Vec<WindowFp8Entry> = Vec::new();

    let mut t = 0u64;
    while t < tokens {
        let n = FOOTPRINT_CHUNK_TOKENS.min(tokens - t);
        let end = t + n;
        let shape = cache.append_shape(seq, n)?;
        token_ids.clear();
        token_ids.extend((t..end).map(|i| (i.wrapping_mul(2_654_435_761) % 129_280) as u32));
        for i in 0..sources {
            let e = shape.entries[i] as usize;
            global[i].clear();
            encode(
                &mut synth,
                EntryFormat::GlobalFp4,
                e,
                &mut scratch,
                &mut global[i],
            )?;
            index[i].clear();
            encode(
                &mut synth,
                EntryFormat::IndexMxfp4,
                e,
                &mut scratch,
                &mut index[i],
            )?;
            pending[i].resize(
                (shape.pending_tokens[i] * shape.pending_token_floats) as usize,
                0.0,
            );
            synth.fill(&mut pending[i]);
        }
        // Window rows only for the positions that end in the final window (a prefill keeps
        // the last 128 rows of every layer; earlier rows would be overwritten in the ring).
        let k = end.saturating_sub(t.max(window_start));
        window.clear();
        let rows = (g.num_layers as u64 * k) as usize;
        encode(
            &mut synth,
            EntryFormat::WindowFp8,
            rows,
            &mut scratch,
            &mut window,
        )?;
        let data = AppendData {
            tokens: &token_ids,
            global: global.iter().map(Vec::as_slice).collect(),
            index: index.iter().map(Vec::as_slice).collect(),
            window: &window,
            pending: pending.iter().map(Vec::as_slice).collect(),
        };
        cache.append(seq, &data)?;
        t = end;
        progress(t);
    }
    let seconds = start.elapsed().as_secs_f64();
    let usage = cache.usage();
    let per_seq = cache.sequence_usage(seq)?;
    let peak_rss = rss()?.peak_bytes;

    let denom = tokens.max(1) as f64;
    let persistent = usage.persistent_allocated_bytes();
    let targets = FootprintTargets {
        global_bytes_per_token_max: 890.5,
        window_bytes: arithmetic.window_bytes,
        peak_rss_bytes_max: 1_200_000_000,
    };
    let mut report = FootprintReport {
        tokens,
        seconds,
        codec: format!(
            "kvstack_kernels::quantize ({})",
            kvstack_kernels::detected_level()
        ),
        page_tokens: g.page_tokens as u64,
        chunk_tokens: FOOTPRINT_CHUNK_TOKENS,
        global_bytes_per_token: persistent as f64 / denom,
        global_bytes_per_token_in_use: usage.persistent_entry_bytes() as f64 / denom,
        arithmetic_bytes_per_token: arithmetic.persistent_bytes_per_token,
        global_allocated_bytes: usage.global.allocated_bytes,
        global_entry_bytes: usage.global.entry_bytes,
        index_allocated_bytes: usage.index.allocated_bytes,
        index_entry_bytes: usage.index.entry_bytes,
        per_sequence_bytes: per_seq.per_sequence_bytes(),
        window_bytes: usage.window.allocated_bytes,
        pending_state_bytes: usage.pending.allocated_bytes,
        arithmetic_per_sequence_bytes: arithmetic.per_sequence_bytes,
        metadata_bytes: usage.metadata.total(),
        metadata_bytes_per_token: usage.metadata.total() as f64 / denom,
        peak_rss_bytes: peak_rss,
        rss_before_bytes: rss_before,
        locked_bytes: usage.pools.iter().map(|p| p.locked_bytes).sum(),
        huge_page_bytes: usage.pools.iter().map(|p| p.huge_page_bytes).sum(),
        usage,
        targets,
        failures: Vec::new(),
    };
    if report.global_bytes_per_token > targets.global_bytes_per_token_max {
        report.failures.push(format!(
            "global bytes per token {:.3} > {}",
            report.global_bytes_per_token, targets.global_bytes_per_token_max
        ));
    }
    if report.window_bytes != targets.window_bytes {
        report.failures.push(format!(
            "window bytes {} != {}",
            report.window_bytes, targets.window_bytes
        ));
    }
    if report.peak_rss_bytes >= targets.peak_rss_bytes_max {
        report.failures.push(format!(
            "peak RSS {} >= {}",
            report.peak_rss_bytes, targets.peak_rss_bytes_max
        ));
    }
    Ok(report)
}
