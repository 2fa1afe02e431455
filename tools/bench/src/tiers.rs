//! `kvstack bench tiers`: the tiers against the limits of this machine, measured in the same
//! run.
//!
//! - SSD write and read throughput of whole V4.1-Flash units (131,072 tokens each: 512 blocks
//!   of 227,840 bytes of KV plus token ids, one record per I/O at the store's queue depth),
//!   next to `fio` with `--ioengine=io_uring --direct=1` at the same block size (one record)
//!   and depth, in the same directory. Throughput counts the bytes that reach the device
//!   (records: header page, payload, padding), as fio does; the payload share is reported too.
//! - DRAM window pool put/get of 2.7 MB snapshots next to `memcpy` of the same bytes in the
//!   same pattern.
//! - Restore of a 131,072-token V4.1-Flash prefix (about 117 MB of global KV) from SSD into a
//!   fresh paged cache, and its time against `bytes / fio read bandwidth`.
//! - The store's recovery time on reopening the directory.
//!
//! Without `fio` the SSD ratios are absent and the report says how to install it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use kvstack_driver::blockio::EngineChoice;
use kvstack_firmware_interface::record::record_len;
use serde::Serialize;

use kvstack_cache::{CacheOptions, KvCache};
use kvstack_spec::builtin::default_config;
use kvstack_tiers::unit::{block_payload_bytes, snapshot_bytes};
use kvstack_tiers::{
    BlockSource, PoolOptions, ReadOutcome, SsdStore, StoreLocation, StoreOptions, SystemClock,
    Tenant, TierOptions, Tiers, UnitWrite, WindowPool,
};

use crate::synth::{SyntheticKv, pseudo_random};
use crate::{Error, Result};

/// Options of [`run_tiers_bench`].
#[derive(Clone, Debug)]
pub struct TiersBenchOptions {
    /// Data directory (the bench works in a subdirectory it removes afterwards).
    pub dir: PathBuf,
    /// Tokens per unit (and of the restored prefix).
    pub unit_tokens: u64,
    /// Units written for the throughput measurement.
    pub write_units: usize,
    /// Snapshots cycled through the DRAM pool.
    pub pool_snapshots: usize,
    /// Passes over them.
    pub pool_passes: usize,
    /// The store's queue depth (and fio's).
    pub queue_depth: usize,
    /// Run fio when it is installed.
    pub fio: bool,
    /// Alternating fio / store runs of the SSD measurements; the best of each counts.
    pub repetitions: usize,
    /// The store's I/O engine (`--io-engine`; [`StoreOptions::set_io_engine`]): with
    /// `vfio:<pci-address>` the store is that NVMe namespace, driven by the userspace driver,
    /// while fio still measures a file in `dir` (a different device unless `dir` is on it).
    pub io_engine: Option<String>,
}

impl TiersBenchOptions {
    /// Defaults in `dir`: 4 units of 131,072 tokens (about 480 MB of records), 48 snapshots.
    pub fn new(dir: PathBuf) -> TiersBenchOptions {
        TiersBenchOptions {
            dir,
            unit_tokens: 131_072,
            write_units: 4,
            pool_snapshots: 48,
            pool_passes: 4,
            queue_depth: 16,
            fio: true,
            repetitions: 2,
            io_engine: None,
        }
    }
}

/// Bytes moved in some time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Throughput {
    /// Bytes.
    pub bytes: u64,
    /// Seconds.
    pub seconds: f64,
    /// `bytes / seconds / 1e9`.
    pub gb_per_s: f64,
}

impl Throughput {
    fn new(bytes: u64, seconds: f64) -> Throughput {
        Throughput {
            bytes,
            seconds,
            gb_per_s: if seconds > 0.0 {
                bytes as f64 / seconds / 1e9
            } else {
                0.0
            },
        }
    }
}

/// What fio measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FioReport {
    /// `fio --version`.
    pub version: String,
    /// Sequential write bandwidth, GB/s (job ends with an fsync, as the store's units do).
    pub write_gb_per_s: f64,
    /// Sequential read bandwidth, GB/s.
    pub read_gb_per_s: f64,
    /// The common arguments.
    pub args: String,
}

/// DRAM pool against memcpy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DramReport {
    /// Bytes of one snapshot.
    pub snapshot_bytes: u64,
    /// Snapshots cycled.
    pub snapshots: usize,
    /// Pool puts.
    pub put: Throughput,
    /// Pool gets.
    pub get: Throughput,
    /// memcpy of the same bytes, one source into many destinations (as puts).
    pub memcpy_put: Throughput,
    /// memcpy of the same bytes, many sources into one destination (as gets).
    pub memcpy_get: Throughput,
    /// `put / memcpy_put`.
    pub put_ratio: f64,
    /// `get / memcpy_get`.
    pub get_ratio: f64,
    /// Whether the pool's memory is locked.
    pub locked: bool,
}

/// Restore of one prefix.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RestoreReport {
    /// Tokens restored.
    pub tokens: u64,
    /// Bytes of global KV (entries and indexer keys) restored.
    pub global_bytes: u64,
    /// Wall time (lookup, reads, checks, appends) into a warm paged cache (pages committed
    /// by an earlier sequence, as in a serving process).
    pub seconds: f64,
    /// The same into a fresh cache, which also commits, locks and collapses every page.
    pub cold_seconds: f64,
    /// `global_bytes / fio read bandwidth`.
    pub fio_seconds: Option<f64>,
    /// `seconds / fio_seconds` (1.0 = as fast as fio reads the bytes).
    pub ratio: Option<f64>,
}

/// Recovery on reopening.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RecoverySummary {
    /// Seconds.
    pub seconds: f64,
    /// Segments.
    pub segments: u64,
    /// Valid records.
    pub records: u64,
    /// Units.
    pub units: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

/// What [`run_tiers_bench`] measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TiersReport {
    /// Where.
    pub dir: PathBuf,
    /// The store's engine.
    pub engine: EngineChoice,
    /// Bytes per I/O: one full block record.
    pub record_bytes: u64,
    /// Queue depth.
    pub queue_depth: usize,
    /// Tokens per unit.
    pub unit_tokens: u64,
    /// Units written per run.
    pub units: usize,
    /// Alternating runs of fio and the store (best of each).
    pub repetitions: usize,
    /// Store writes of whole units, device bytes, until durable (flush).
    pub ssd_write: Throughput,
    /// Store reads of whole units (every block checked), device bytes.
    pub ssd_read: Throughput,
    /// Share of the device bytes that is KV payload.
    pub payload_fraction: f64,
    /// fio, when installed.
    pub fio: Option<FioReport>,
    /// Why fio did not run.
    pub fio_missing: Option<String>,
    /// `ssd_write / fio write`.
    pub write_ratio: Option<f64>,
    /// `ssd_read / fio read`.
    pub read_ratio: Option<f64>,
    /// Median over the repetitions of store write GB/s over the fio write GB/s of the run just
    /// before it: adjacent runs see the same state of a drifting disk, the two bests need not
    /// (informational; the target is checked on [`TiersReport::write_ratio`]).
    pub write_ratio_paired: Option<f64>,
    /// The same for reads.
    pub read_ratio_paired: Option<f64>,
    /// The DRAM pool.
    pub dram: DramReport,
    /// Restore of one prefix.
    pub restore: RestoreReport,
    /// Recovery on reopening the store.
    pub recovery: RecoverySummary,
    /// Targets: SSD ratios at least this.
    pub ssd_target: f64,
    /// DRAM ratios at least this.
    pub dram_target: f64,
    /// Missed targets.
    pub failures: Vec<String>,
    /// Remarks.
    pub notes: Vec<String>,
}

impl TiersReport {
    /// Whether every measured target is met.
    pub fn meets_targets(&self) -> bool {
        self.failures.is_empty()
    }
}

impl std::fmt::Display for TiersReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ratio = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}"));
        let fio_w = self.fio.as_ref().map(|x| x.write_gb_per_s);
        let fio_r = self.fio.as_ref().map(|x| x.read_gb_per_s);
        let gb = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
        writeln!(f, "tiers bench in {}", self.dir.display())?;
        writeln!(
            f,
            "  engine {} (direct {}, fixed buffers {}), {}-byte records, queue depth {}, best \
             of {} alternating runs",
            self.engine.kind.name(),
            self.engine.direct,
            self.engine.registered,
            self.record_bytes,
            self.queue_depth,
            self.repetitions
        )?;
        writeln!(
            f,
            "  {:<34} {:>10} {:>10} {:>7} {:>7}",
            "", "GB/s", "limit", "ratio", "target"
        )?;
        writeln!(
            f,
            "  {:<34} {:>10.3} {:>10} {:>7} {:>7.2}",
            format!("ssd write ({} x {} tokens)", self.units, self.unit_tokens),
            self.ssd_write.gb_per_s,
            gb(fio_w),
            ratio(self.write_ratio),
            self.ssd_target
        )?;
        writeln!(
            f,
            "  {:<34} {:>10.3} {:>10} {:>7} {:>7.2}",
            "ssd read (every block checked)",
            self.ssd_read.gb_per_s,
            gb(fio_r),
            ratio(self.read_ratio),
            self.ssd_target
        )?;
        if self.write_ratio_paired.is_some() || self.read_ratio_paired.is_some() {
            writeln!(
                f,
                "  {:<34} write {}, read {} (median over runs of store / the fio run just \
                 before it)",
                "ssd paired ratios",
                ratio(self.write_ratio_paired),
                ratio(self.read_ratio_paired)
            )?;
        }
        let d = &self.dram;
        writeln!(
            f,
            "  {:<34} {:>10.3} {:>10.3} {:>7.2} {:>7.2}",
            format!("dram pool put ({} B)", d.snapshot_bytes),
            d.put.gb_per_s,
            d.memcpy_put.gb_per_s,
            d.put_ratio,
            self.dram_target
        )?;
        writeln!(
            f,
            "  {:<34} {:>10.3} {:>10.3} {:>7.2} {:>7.2}",
            "dram pool get", d.get.gb_per_s, d.memcpy_get.gb_per_s, d.get_ratio, self.dram_target
        )?;
        let r = &self.restore;
        writeln!(
            f,
            "  restore of a {}-token prefix ({} B of global KV): {:.3} s (fresh cache {:.3} s); \
             at fio read bandwidth {}; ratio {}",
            r.tokens,
            r.global_bytes,
            r.seconds,
            r.cold_seconds,
            r.fio_seconds
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.3} s")),
            ratio(r.ratio)
        )?;
        let rc = &self.recovery;
        writeln!(
            f,
            "  recovery on reopen: {:.3} s ({} segments, {} records, {} units, {} bytes read)",
            rc.seconds, rc.segments, rc.records, rc.units, rc.bytes_read
        )?;
        writeln!(
            f,
            "  device bytes counted (records: header page + payload + padding); payload \
             share {:.3}",
            self.payload_fraction
        )?;
        if let Some(m) = &self.fio_missing {
            writeln!(f, "  note: {m}")?;
        }
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        for x in &self.failures {
            writeln!(f, "  MISSED: {x}")?;
        }
        Ok(())
    }
}

/// Synthetic block payloads of V4.1-Flash size (their bytes do not matter to the store).
struct Synthetic {
    kv: Vec<u8>,
}

impl BlockSource for Synthetic {
    fn block_payload(
        &self,
        index: usize,
        _: u64,
        tokens: usize,
        out: &mut Vec<u8>,
    ) -> kvstack_tiers::Result<()> {
        let n = self.kv.len() * tokens / 256;
        out.extend_from_slice(&self.kv[..n]);
        // Vary the first bytes so blocks differ.
        let at = out.len() - n;
        if let Some(b) = out.get_mut(at..at + 8) {
            b.copy_from_slice(&(index as u64).to_le_bytes());
        }
        Ok(())
    }
}

/// Runs `fio`; returns bandwidth in bytes per second of the job's `rw` direction.
fn run_fio(args: &[String], rw: &str) -> Result<f64> {
    let out = Command::new("fio")
        .args(args)
        .arg(format!("--rw={rw}"))
        .arg("--output-format=json")
        .output()
        .map_err(|e| Error::Tool {
            tool: "fio",
            reason: e.to_string(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(Error::Tool {
            tool: "fio",
            reason: format!(
                "exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    let json = text.find('{').map_or("", |i| &text[i..]);
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| Error::Tool {
        tool: "fio",
        reason: format!("unreadable JSON output: {e}"),
    })?;
    let dir = if rw == "write" { "write" } else { "read" };
    v["jobs"][0][dir]["bw_bytes"]
        .as_f64()
        .filter(|b| *b > 0.0)
        .ok_or_else(|| Error::Tool {
            tool: "fio",
            reason: "no bandwidth in its report".into(),
        })
}

fn fio_version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Runs the bench (module docs). Works in `opts.dir/kvstack-bench-<pid>`, removed at the end.
///
/// # Errors
/// Store, cache and I/O errors; a fio that is installed but fails.
pub fn run_tiers_bench(
    opts: &TiersBenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<TiersReport> {
    let work = opts
        .dir
        .join(format!("kvstack-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| Error::io("cannot create", &work, e))?;
    let result = bench_in(opts, &work, &mut progress);
    if let Err(e) = std::fs::remove_dir_all(&work) {
        log::warn!("cannot remove {}: {e}", work.display());
    }
    result
}

fn bench_in(
    opts: &TiersBenchOptions,
    work: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<TiersReport> {
    let cfg = default_config()?;
    let clock = Arc::new(SystemClock);
    let store_dir = work.join("store");
    let fio_dir = work.join("fio");
    std::fs::create_dir_all(&fio_dir).map_err(|e| Error::io("cannot create", &fio_dir, e))?;

    let unit_tokens = opts.unit_tokens.next_multiple_of(256).max(256);
    let blocks_per_unit = unit_tokens / 256;
    let mut store_opts = StoreOptions::new(StoreLocation::Directory(store_dir.clone()));
    store_opts.queue_depth = opts.queue_depth.max(1);
    let per_unit =
        blocks_per_unit * record_len(kvstack_tiers::store::V41_BLOCK_PAYLOAD as u64) + (1 << 20);
    store_opts.capacity_bytes = ((opts.repetitions.max(1) * opts.write_units) as u64 + 2)
        .saturating_mul(per_unit * 2)
        .max(8 * store_opts.segment_bytes)
        .next_multiple_of(store_opts.segment_bytes);
    store_opts.max_unit_blocks = store_opts.max_unit_blocks.max(blocks_per_unit as usize);
    if let Some(e) = &opts.io_engine {
        store_opts.set_io_engine(e)?;
    }
    let on_namespace = matches!(store_opts.location, StoreLocation::Namespace(_));
    let mut tier_opts = TierOptions::new(store_opts.clone());
    let mut pool_opts = PoolOptions::new(1);
    pool_opts.capacity_bytes = Some(64 << 20);
    tier_opts.pool = pool_opts;
    let tiers = Tiers::open(&cfg, 256, tier_opts, clock.clone())?;
    let g = tiers.geometry().clone();
    let kv_block = block_payload_bytes(&g, 256) as usize;
    let record = record_len((kv_block + 4 * 256) as u64);
    let engine = tiers.store().engine().clone();
    let mut notes = Vec::new();
    if on_namespace {
        notes.push(format!(
            "the store ran on {} through the userspace NVMe driver; fio measured a file in {}, \
             which is another device unless that directory is on it",
            store_opts.location.path().display(),
            opts.dir.display()
        ));
    }
    if !engine.direct {
        notes.push(
            "the data directory refuses O_DIRECT: the store ran buffered (page cache) and fio's \
             --direct=1 run will fail or differ; measure on the SSD's file system"
                .to_owned(),
        );
    }

    // fio presence.
    let version = if opts.fio { fio_version() } else { None };
    let fio_missing = match (&version, opts.fio) {
        (None, true) => Some(
            "fio not found: install it with `apt-get install fio` (or your distribution's \
             package) to get the SSD ratios"
                .to_owned(),
        ),
        (None, false) => Some("fio disabled (--no-fio)".to_owned()),
        _ => None,
    };
    let write_bytes_planned = opts.write_units as u64 * blocks_per_unit * record;
    let fio_size = write_bytes_planned.max(256 << 20) / record * record;
    let fio_args: Vec<String> = vec![
        "--name=kvstack-tiers".into(),
        format!("--directory={}", fio_dir.display()),
        format!("--bs={record}"),
        format!("--iodepth={}", store_opts.queue_depth),
        "--ioengine=io_uring".into(),
        "--direct=1".into(),
        format!("--size={fio_size}"),
        "--numjobs=1".into(),
    ];

    // SSD write and read: fio and the store alternate, `repetitions` times each; the best run
    // of each counts (the disk's bandwidth drifts between runs by more than what is compared).
    let kv = Synthetic {
        kv: pseudo_random(kv_block, 0x5151),
    };
    let tenant = Tenant::new("bench");
    let reps = opts.repetitions.max(1);
    let mut fio_write: Option<f64> = None;
    let mut ssd_write = Throughput::default();
    // Per repetition: store GB/s over the fio GB/s of the run just before it.
    let mut write_pairs: Vec<f64> = Vec::new();
    let mut read_pairs: Vec<f64> = Vec::new();
    let mut units = Vec::new();
    for rep in 0..reps {
        let mut fio_now = None;
        if version.is_some() {
            progress("fio write");
            let _ = std::fs::remove_dir_all(&fio_dir);
            std::fs::create_dir_all(&fio_dir)
                .map_err(|e| Error::io("cannot create", &fio_dir, e))?;
            let mut a = fio_args.clone();
            a.push("--end_fsync=1".into());
            let bw = run_fio(&a, "write")?;
            fio_write = Some(fio_write.map_or(bw, |b| b.max(bw)));
            fio_now = Some(bw);
        }
        progress("store write");
        let before = tiers.store().stats().bytes_written;
        let start = Instant::now();
        let mut tickets = Vec::new();
        for u in 0..opts.write_units {
            let id = (rep * opts.write_units + u) as u32 + 1;
            let tokens: Vec<u32> = (0..unit_tokens as u32)
                .map(|i| i.wrapping_add(id << 24))
                .collect();
            tickets.push(tiers.store().put_unit(&UnitWrite {
                model: tiers.model(),
                tenant: &tenant,
                tokens: &tokens,
                page_tokens: 256,
                align: 2,
                source: &kv,
            })?);
            units.push(tokens);
        }
        for t in tickets {
            t.wait()?;
        }
        tiers.flush()?;
        let run = Throughput::new(
            tiers.store().stats().bytes_written - before,
            start.elapsed().as_secs_f64(),
        );
        if let Some(f) = fio_now {
            write_pairs.push(run.gb_per_s / (f / 1e9));
        }
        if run.gb_per_s > ssd_write.gb_per_s {
            ssd_write = run;
        }
    }
    let mut fio_read: Option<f64> = None;
    let mut ssd_read = Throughput::default();
    for rep in 0..reps {
        let mut fio_now = None;
        if version.is_some() {
            progress("fio read");
            let bw = run_fio(&fio_args, "read")?;
            fio_read = Some(fio_read.map_or(bw, |b| b.max(bw)));
            fio_now = Some(bw);
        }
        progress("store read");
        let start = Instant::now();
        let mut read_bytes = 0u64;
        // The units written last, as fio reads the file it wrote last: both read data of the
        // same age (a virtual disk may still cache recent writes on its host).
        let _ = rep;
        let last = &units[units.len() - opts.write_units..];
        for tokens in last {
            let hit = tiers.store().lookup(tiers.model(), &tenant, tokens, 256);
            let outcome = tiers.store().read_blocks(&hit.keys, |_, h, _| {
                read_bytes += h.record_len();
                Ok(())
            })?;
            if outcome != ReadOutcome::Complete {
                notes.push(format!("a unit read ended early: {outcome:?}"));
            }
        }
        let run = Throughput::new(read_bytes, start.elapsed().as_secs_f64());
        if let Some(f) = fio_now {
            read_pairs.push(run.gb_per_s / (f / 1e9));
        }
        if run.gb_per_s > ssd_read.gb_per_s {
            ssd_read = run;
        }
    }
    let _ = std::fs::remove_dir_all(&fio_dir);

    // Restore of one V4.1-Flash prefix into a fresh paged cache.
    progress("restore");
    let cache_opts = CacheOptions {
        context_limit: unit_tokens.max(4096),
        max_sequences: 1,
        ..CacheOptions::default()
    };
    let (source_tokens, global_bytes) = {
        let mut src = KvCache::for_config(&cfg, cache_opts)?;
        let seq = src.create_sequence()?;
        let tokens: Vec<u32> = (0..unit_tokens as u32).map(|i| i ^ 0xABCD).collect();
        SyntheticKv::new(src.geometry())?.append(&mut src, seq, &tokens, unit_tokens)?;
        tiers.persist(&src, seq, &tenant, unit_tokens)?.wait()?;
        (tokens, block_payload_bytes(&g, unit_tokens))
    };
    tiers.pool().remove(
        &tiers
            .lookup(&source_tokens, &tenant)
            .key()
            .unwrap_or_default(),
    );
    // Cold: into a fresh cache, whose pools commit (fault in, lock, collapse into huge pages)
    // every page on first use. Warm: the same cache again after the sequence and its prefix
    // index entries are dropped, so its pages are committed already, as in a serving process.
    let mut dst = KvCache::for_config(&cfg, cache_opts)?;
    let mut times = Vec::new();
    let mut restored_tokens = 0;
    for _ in 0..2 {
        let start = Instant::now();
        let hit = tiers.lookup(&source_tokens, &tenant);
        let restored = tiers.restore(&mut dst, &source_tokens, &hit)?;
        times.push(start.elapsed().as_secs_f64());
        restored_tokens = restored.tokens;
        if restored.tokens != unit_tokens || restored.mapped_tokens != 0 {
            notes.push(format!(
                "restore returned {} of {unit_tokens} tokens ({} mapped)",
                restored.tokens, restored.mapped_tokens
            ));
        }
        dst.drop_sequence(restored.seq)?;
        dst.clear_prefix_index();
    }
    drop(dst);
    let (cold_secs, restore_secs) = (times[0], times[1]);

    // DRAM pool.
    progress("dram pool");
    let dram = dram_bench(opts, snapshot_bytes(&g))?;

    // Recovery.
    progress("recovery");
    tiers.close()?;
    let reopened = SsdStore::open(store_opts, clock)?;
    let r = reopened.recovery();
    let recovery = RecoverySummary {
        seconds: r.seconds,
        segments: r.segments,
        records: r.records,
        units: r.units,
        bytes_read: r.bytes_read,
    };
    drop(reopened);

    let write_ratio = fio_write.map(|b| ssd_write.gb_per_s / (b / 1e9));
    let read_ratio = fio_read.map(|b| ssd_read.gb_per_s / (b / 1e9));
    let fio_seconds = fio_read.map(|b| global_bytes as f64 / b);
    let restore = RestoreReport {
        tokens: restored_tokens,
        global_bytes,
        seconds: restore_secs,
        cold_seconds: cold_secs,
        fio_seconds,
        ratio: fio_seconds.map(|f| restore_secs / f),
    };
    let (ssd_target, dram_target) = (0.9, 0.7);
    let mut failures = Vec::new();
    for (name, r) in [("ssd write", write_ratio), ("ssd read", read_ratio)] {
        if let Some(r) = r
            && r < ssd_target
        {
            failures.push(format!("{name} at {r:.2} of fio (target {ssd_target})"));
        }
    }
    for (name, r) in [("dram put", dram.put_ratio), ("dram get", dram.get_ratio)] {
        if r < dram_target {
            failures.push(format!("{name} at {r:.2} of memcpy (target {dram_target})"));
        }
    }
    Ok(TiersReport {
        dir: opts.dir.clone(),
        engine,
        record_bytes: record,
        queue_depth: opts.queue_depth.max(1),
        unit_tokens,
        units: opts.write_units,
        repetitions: opts.repetitions.max(1),
        ssd_write,
        ssd_read,
        payload_fraction: (kv_block + 1024) as f64 / record as f64,
        fio: version.map(|v| FioReport {
            version: v,
            write_gb_per_s: fio_write.unwrap_or(0.0) / 1e9,
            read_gb_per_s: fio_read.unwrap_or(0.0) / 1e9,
            args: fio_args.join(" "),
        }),
        fio_missing,
        write_ratio,
        read_ratio,
        write_ratio_paired: median(&mut write_pairs),
        read_ratio_paired: median(&mut read_pairs),
        dram,
        restore,
        recovery,
        ssd_target,
        dram_target,
        failures,
        notes,
    })
}

/// The median of `v` (mean of the middle two for an even count), `None` when empty.
fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn dram_bench(opts: &TiersBenchOptions, snap: usize) -> Result<DramReport> {
    let n = opts.pool_snapshots.max(2);
    let passes = opts.pool_passes.max(1);
    let pool = WindowPool::new(
        PoolOptions {
            capacity_bytes: Some((n * snap.next_multiple_of(4096)) as u64),
            ttl_ms: u64::MAX / 2,
            slot_bytes: snap,
            memory: kvstack_driver::pinned::PinnedOptions::default(),
        },
        Arc::new(SystemClock),
    )?;
    let src = pseudo_random(snap, 11);
    let key = |i: usize| {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&(i as u64).to_le_bytes());
        k
    };
    // Warm-up: commit every slot once.
    for i in 0..n {
        pool.put(key(i), &src)?;
    }
    let bytes = (n * passes * snap) as u64;
    let start = Instant::now();
    for _ in 0..passes {
        for i in 0..n {
            pool.put(key(i), &src)?;
        }
    }
    let put = Throughput::new(bytes, start.elapsed().as_secs_f64());
    let mut dst = vec![0u8; snap];
    let start = Instant::now();
    for _ in 0..passes {
        for i in 0..n {
            pool.get_with(&key(i), |b| dst.copy_from_slice(b));
        }
    }
    let get = Throughput::new(bytes, start.elapsed().as_secs_f64());
    // memcpy in the same patterns: one source into n buffers, n buffers into one.
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![1u8; snap]).collect();
    let start = Instant::now();
    for _ in 0..passes {
        for b in bufs.iter_mut() {
            b.copy_from_slice(&src);
        }
    }
    let memcpy_put = Throughput::new(bytes, start.elapsed().as_secs_f64());
    let start = Instant::now();
    for _ in 0..passes {
        for b in &bufs {
            dst.copy_from_slice(b);
        }
    }
    let memcpy_get = Throughput::new(bytes, start.elapsed().as_secs_f64());
    std::hint::black_box(&dst);
    let stats = pool.stats();
    Ok(DramReport {
        snapshot_bytes: snap as u64,
        snapshots: n,
        put,
        get,
        memcpy_put,
        memcpy_get,
        put_ratio: put.gb_per_s / memcpy_put.gb_per_s.max(1e-9),
        get_ratio: get.gb_per_s / memcpy_get.gb_per_s.max(1e-9),
        locked: stats.locked_bytes > 0,
    })
}
