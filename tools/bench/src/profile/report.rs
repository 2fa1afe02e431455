//! What a replay measured and modelled (`docs/profile.md` describes every JSON field).

use serde::Serialize;

fn is_zero(x: &u64) -> bool {
    *x == 0
}

fn is_zero_f(x: &f64) -> bool {
    *x == 0.0
}

/// Input tokens by where their KV came from. The parts add up to the input tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TokensBySource {
    /// The session's live sequence in the paged cache (the previous turn still resident).
    pub live: u64,
    /// Blocks mapped from the paged cache's prefix index (no I/O).
    pub dram_cache: u64,
    /// The last window's tokens of a tier hit whose window came from the DRAM window pool
    /// (their global KV came from the paged cache or the SSD; the pool saved their replay).
    pub dram_pool: u64,
    /// Global KV read from the SSD store.
    pub ssd: u64,
    /// Global KV fetched from another node's SSD store (runs of several nodes with shared
    /// tiers), then read from this node's store; serialized only when not zero, so one
    /// node's report is unchanged.
    #[serde(skip_serializing_if = "is_zero")]
    pub peer: u64,
    /// The last window's tokens of a tier hit without a window snapshot: their global KV came
    /// from a tier, their window KV is recomputed (bounded replay). Not a miss.
    pub replayed: u64,
    /// Computed from scratch.
    pub computed: u64,
}

impl TokensBySource {
    /// Sum of all parts.
    pub fn total(&self) -> u64 {
        self.live
            + self.dram_cache
            + self.dram_pool
            + self.ssd
            + self.peer
            + self.replayed
            + self.computed
    }

    /// Tokens whose global KV came from a cache or tier.
    pub fn hits(&self) -> u64 {
        self.total() - self.computed
    }

    pub(crate) fn add(&mut self, o: &TokensBySource) {
        self.live += o.live;
        self.dram_cache += o.dram_cache;
        self.dram_pool += o.dram_pool;
        self.ssd += o.ssd;
        self.peer += o.peer;
        self.replayed += o.replayed;
        self.computed += o.computed;
    }

    /// Each part over `total` (zeros when empty).
    pub fn shares(&self) -> SourceShares {
        let t = self.total().max(1) as f64;
        SourceShares {
            live: self.live as f64 / t,
            dram_cache: self.dram_cache as f64 / t,
            dram_pool: self.dram_pool as f64 / t,
            ssd: self.ssd as f64 / t,
            peer: self.peer as f64 / t,
            replayed: self.replayed as f64 / t,
            computed: self.computed as f64 / t,
        }
    }
}

/// [`TokensBySource`] as fractions of the input tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SourceShares {
    /// See [`TokensBySource::live`].
    pub live: f64,
    /// See [`TokensBySource::dram_cache`].
    pub dram_cache: f64,
    /// See [`TokensBySource::dram_pool`].
    pub dram_pool: f64,
    /// See [`TokensBySource::ssd`].
    pub ssd: f64,
    /// See [`TokensBySource::peer`] (serialized only when not zero).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub peer: f64,
    /// See [`TokensBySource::replayed`].
    pub replayed: f64,
    /// See [`TokensBySource::computed`].
    pub computed: f64,
}

/// Percentiles of a latency, milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Percentiles {
    /// Of `samples` (sorted in place); all zero when empty.
    pub fn of(samples: &mut [f64]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let at = |q: f64| samples[(((n - 1) as f64) * q).round() as usize];
        Percentiles {
            count: n as u64,
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: samples[n - 1],
            mean: samples.iter().sum::<f64>() / n as f64,
        }
    }
}

/// Latencies of the stages of admission (wall time on this machine).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latencies {
    /// `Tiers::lookup` (chained block keys, index, pool).
    pub lookup: Percentiles,
    /// `Tiers::restore` of hits that read from the SSD (reads, checks, appends).
    pub restore_ssd: Percentiles,
    /// `Tiers::restore` of hits served from DRAM only (mapped blocks, window snapshot).
    pub restore_dram: Percentiles,
    /// The whole admission: live sequence or lookup and restore (synthesis of computed KV
    /// excluded: it stands for the model's work, which the cost model counts).
    pub admission: Percentiles,
    /// `Tiers::persist` (payload copies into the write-behind queue, window snapshot put).
    pub persist: Percentiles,
    /// Waits for durability before trace time moves on.
    pub flush: Percentiles,
}

/// The SSD store over the replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SsdReport {
    /// Capacity asked for.
    pub capacity_bytes: u64,
    /// Capacity the store ran with (lower for a model whose bytes the store models, below).
    pub store_capacity_bytes: u64,
    /// Bytes per segment.
    pub segment_bytes: u64,
    /// Retention after last use, trace milliseconds.
    pub retention_ms: u64,
    /// The I/O engine (`io_uring` or `sync`) and whether `O_DIRECT` is in use.
    pub engine: String,
    /// Whether reads and writes bypass the page cache.
    pub direct: bool,
    /// KV payload bytes read by restores.
    pub bytes_read: u64,
    /// Bytes written to the device (records with headers and padding, commits, touch
    /// commits, compaction, segment headers).
    pub bytes_written: u64,
    /// KV payload bytes of the blocks stored.
    pub kv_bytes_written: u64,
    /// `bytes_written / kv_bytes_written`.
    pub write_amplification: f64,
    /// Units made durable (a unit already stored counts again, as a touch).
    pub units_written: u64,
    /// Units refused because the store was full of data younger than the retention.
    pub units_refused_full: u64,
    /// Units refused because the write-behind queue was full.
    pub units_refused_queue: u64,
    /// Units that failed otherwise.
    pub units_failed: u64,
    /// Units evicted (only ever past the retention, when space was needed).
    pub evictions: u64,
    /// Units past the retention by the end of the replay (evicted or still held).
    pub expiries: u64,
    /// Segments compacted.
    pub segments_compacted: u64,
    /// Live record bytes at the end.
    pub live_bytes_end: u64,
    /// Most live record bytes at a sample.
    pub live_bytes_peak: u64,
    /// KV bytes read over the wall time of the restores that read them, GB/s.
    pub read_gb_per_s: f64,
    /// Bytes written over the wall time from the first write of each interval until it was
    /// durable, GB/s (a lower bound on the device's rate).
    pub write_gb_per_s: f64,
}

/// The DRAM window pool over the replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PoolReport {
    /// Whether the model has window KV to pool (and the pool is not sized 0).
    pub enabled: bool,
    /// Capacity asked for.
    pub capacity_bytes: u64,
    /// Bytes of one snapshot slot of the model.
    pub slot_bytes: u64,
    /// Snapshots it holds at most.
    pub slots: u64,
    /// Time to live of a snapshot, trace milliseconds.
    pub ttl_ms: u64,
    /// Bytes copied out by gets.
    pub bytes_read: u64,
    /// Bytes copied in by puts.
    pub bytes_written: u64,
    /// Puts.
    pub puts: u64,
    /// Gets that returned a snapshot.
    pub hits: u64,
    /// Gets that found none.
    pub misses: u64,
    /// Snapshots evicted to make room (least recently used).
    pub evictions: u64,
    /// Gets that found the snapshot expired (its TTL passed).
    pub expiries: u64,
    /// Most bytes held at a sample.
    pub peak_bytes: u64,
    /// Bytes copied in and out over the time spent copying, GB/s.
    pub gb_per_s: f64,
}

/// The paged cache (the HBM stand-in) over the replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CacheReport {
    /// Bytes of global entries and indexer keys it may hold.
    pub capacity_bytes: u64,
    /// Tokens that is at the model's bytes per token.
    pub capacity_tokens: u64,
    /// Sequences at most (in flight and live).
    pub max_sequences: u64,
    /// Prefix blocks evicted (least recently used) because a pool was full.
    pub evictions: u64,
    /// Idle live sequences dropped to make room.
    pub live_dropped: u64,
    /// Requests whose sequence did not fit even after dropping every idle one.
    pub requests_not_admitted: u64,
    /// Most global-entry and index-key bytes in use at a sample.
    pub peak_in_use_bytes: u64,
}

/// The prefill cost model and what it gives.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CostReport {
    /// Prefill rate of the model, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Where that rate came from: `flag` or `engine` (measured on the built-in model).
    pub prefill_rate_source: String,
    /// Decode rate of one sequence, tokens per second (when outputs end, in trace time).
    pub decode_tokens_per_s: f64,
    /// Prefill seconds of every prompt from scratch.
    pub prefill_seconds_without_tiers: f64,
    /// Prefill seconds of the computed and replayed tokens.
    pub prefill_seconds_with_tiers: f64,
    /// The difference.
    pub prefill_seconds_saved: f64,
    /// `saved / without`.
    pub fraction_saved: f64,
    /// Time to first token without tiers: prompt / rate.
    pub ttft_ms_without_tiers: Percentiles,
    /// With: measured admission + (computed + replayed) / rate.
    pub ttft_ms_with_tiers: Percentiles,
}

/// Values per bucket of trace time (for the plots).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Series {
    /// Bucket length, trace milliseconds.
    pub bucket_ms: u64,
    /// Start of each bucket, trace seconds.
    pub t_s: Vec<f64>,
    /// Input tokens per source of the requests that arrived in each bucket.
    pub tokens: Vec<TokensBySource>,
    /// SSD live bytes at each bucket's end.
    pub ssd_live_bytes: Vec<u64>,
    /// DRAM window pool bytes held at each bucket's end.
    pub pool_bytes: Vec<u64>,
    /// Paged cache bytes in use at each bucket's end.
    pub cache_bytes: Vec<u64>,
    /// SSD KV bytes read per trace second in each bucket.
    pub ssd_read_bytes_per_s: Vec<f64>,
    /// SSD device bytes written per trace second in each bucket.
    pub ssd_write_bytes_per_s: Vec<f64>,
}

/// Latency samples for the CDF plots (not serialized).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Samples {
    /// Lookups, ms.
    pub lookup: Vec<f64>,
    /// SSD restores, ms.
    pub restore_ssd: Vec<f64>,
    /// DRAM restores, ms.
    pub restore_dram: Vec<f64>,
    /// Admissions, ms.
    pub admission: Vec<f64>,
    /// Each request's input tokens by source, in trace order.
    pub per_request: Vec<TokensBySource>,
}

/// What one replay measured and modelled.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The trace file (or `<memory>`).
    pub trace: String,
    /// The model whose cache geometry was replayed.
    pub model: String,
    /// Its persistent bytes per token (`kvstack calc`).
    pub model_bytes_per_token: f64,
    /// Whether the tiers and the paged cache hold this model's own entries (V4.1 / CSA2);
    /// otherwise they hold V4.1 entries at the token capacity this model's bytes give.
    pub native_geometry: bool,
    /// Requests replayed.
    pub requests: u64,
    /// Their prompt tokens.
    pub input_tokens: u64,
    /// Their output tokens.
    pub output_tokens: u64,
    /// Sessions (inferred from prefix extension unless turned off).
    pub sessions: u64,
    /// Requests that continue an earlier one.
    pub continued_turns: u64,
    /// Input tokens by source.
    pub tokens_by_source: TokensBySource,
    /// Input tokens whose global KV came from a cache or tier, over input tokens (replayed
    /// windows count as hits).
    pub hit_rate_tokens: f64,
    /// Trace blocks (512 tokens) wholly served from a cache or tier, over all blocks.
    pub hit_rate_blocks: f64,
    /// Each source's share of the input tokens.
    pub hit_rate_by_source: SourceShares,
    /// Tier hits whose window came from the pool.
    pub windows_from_pool: u64,
    /// Tier hits that replayed their window.
    pub window_replays: u64,
    /// The SSD store.
    pub ssd: SsdReport,
    /// The DRAM window pool.
    pub dram_pool: PoolReport,
    /// The paged cache.
    pub dram_cache: CacheReport,
    /// Latency percentiles per stage, ms.
    pub latency_ms: Latencies,
    /// The prefill cost model.
    pub cost_model: CostReport,
    /// Wall seconds of the replay.
    pub seconds: f64,
    /// Trace seconds replayed (first to last arrival).
    pub trace_seconds: f64,
    /// Requests per wall second.
    pub requests_per_s: f64,
    /// `--speed` (trace seconds per wall second), `None`: as fast as possible.
    pub speed: Option<f64>,
    /// Peak resident set size of the process during the replay.
    pub peak_rss_bytes: u64,
    /// Per-bucket values for plots.
    pub series: Series,
    /// Which figures are measured.
    pub measured: Vec<String>,
    /// Which figures are modelled.
    pub modelled: Vec<String>,
    /// Remarks.
    pub notes: Vec<String>,
    /// Runs of several nodes (`--nodes` > 1): the routing and the shared tiers; absent for
    /// one node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterReport>,
    /// Latency samples for plots.
    #[serde(skip)]
    pub samples: Samples,
}

/// A replay over several in-process nodes (`docs/profile.md`, "Several nodes").
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClusterReport {
    /// Nodes, each with its own SSD store, DRAM window pool and paged cache.
    pub nodes: u64,
    /// How requests were routed to nodes (in words).
    pub routing: String,
    /// Requests each node served.
    pub requests_per_node: Vec<u64>,
    /// Whether a node looked for units on the other nodes and windows in a shared level.
    pub shared_tiers: bool,
    /// The shared window level: `"in-process model"`, `"redis-cluster"`, or `null` without
    /// shared tiers.
    pub shared_window_level: Option<String>,
    /// Units fetched from another node's store and made durable in the asker's.
    pub peer_fetches: u64,
    /// Fetches that did not complete (the holder's unit gone, the asker's store refusing it).
    pub peer_fetch_failures: u64,
    /// KV payload bytes copied between nodes by the fetches.
    pub peer_bytes: u64,
    /// Tier hits whose window came from the shared level (their tokens count in
    /// `tokens_by_source.dram_pool`).
    pub windows_from_shared_level: u64,
    /// Snapshots put into the shared level.
    pub shared_level_puts: u64,
    /// Gets that found a snapshot in the shared level.
    pub shared_level_hits: u64,
    /// Remarks on what is modelled.
    pub notes: Vec<String>,
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn lat(p: &Percentiles) -> String {
    if p.count == 0 {
        return "-".into();
    }
    format!(
        "{:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>7}",
        p.p50, p.p90, p.p99, p.max, p.count
    )
}

impl std::fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.tokens_by_source;
        writeln!(
            f,
            "replay of {}: {} requests, {} input tokens, {} sessions ({} continued turns)",
            self.trace, self.requests, self.input_tokens, self.sessions, self.continued_turns
        )?;
        writeln!(
            f,
            "  model {} ({} B/token{}); ssd {} (retention {} h), dram pool {} (ttl {} s), paged cache {}",
            self.model,
            self.model_bytes_per_token,
            if self.native_geometry {
                ""
            } else {
                ", byte volumes modelled"
            },
            gb(self.ssd.capacity_bytes),
            self.ssd.retention_ms as f64 / 3.6e6,
            gb(self.dram_pool.capacity_bytes),
            self.dram_pool.ttl_ms / 1000,
            gb(self.dram_cache.capacity_bytes),
        )?;
        writeln!(
            f,
            "  {:.1} s wall for {:.0} s of trace ({:.1} requests/s), peak RSS {}",
            self.seconds,
            self.trace_seconds,
            self.requests_per_s,
            gb(self.peak_rss_bytes)
        )?;
        writeln!(
            f,
            "  hit rate {} of tokens, {} of blocks",
            pct(self.hit_rate_tokens),
            pct(self.hit_rate_blocks)
        )?;
        writeln!(f, "  {:<12} {:>14} {:>8}", "source", "tokens", "share")?;
        let h = s.shares();
        for (name, n, x) in [
            ("live", s.live, h.live),
            ("dram_cache", s.dram_cache, h.dram_cache),
            ("dram_pool", s.dram_pool, h.dram_pool),
            ("ssd", s.ssd, h.ssd),
            ("peer", s.peer, h.peer),
            ("replayed", s.replayed, h.replayed),
            ("computed", s.computed, h.computed),
        ] {
            if name == "peer" && self.cluster.is_none() {
                continue;
            }
            writeln!(f, "  {name:<12} {n:>14} {:>8}", pct(x))?;
        }
        writeln!(
            f,
            "  windows: {} from the pool, {} replayed",
            self.windows_from_pool, self.window_replays
        )?;
        if let Some(c) = &self.cluster {
            writeln!(
                f,
                "  cluster: {} nodes ({}), requests {:?}; shared tiers: {}",
                c.nodes,
                c.routing,
                c.requests_per_node,
                match &c.shared_window_level {
                    Some(l) if c.shared_tiers => format!("on, shared window level: {l}"),
                    _ => "off".to_owned(),
                }
            )?;
            if c.shared_tiers {
                writeln!(
                    f,
                    "  peer fetches {} ({} failed, {}), windows from the shared level {} \
                     ({} puts, {} hits)",
                    c.peer_fetches,
                    c.peer_fetch_failures,
                    gb(c.peer_bytes),
                    c.windows_from_shared_level,
                    c.shared_level_puts,
                    c.shared_level_hits
                )?;
            }
            for n in &c.notes {
                writeln!(f, "  cluster note: {n}")?;
            }
        }
        let d = &self.ssd;
        writeln!(
            f,
            "  ssd: read {}, written {} (KV {}, amplification {:.3}), units {} written, {} refused full, {} refused queue, {} failed; {} evicted, {} past retention; live {} at the end (peak {}); {} {:.2} GB/s read, {:.2} GB/s write",
            gb(d.bytes_read),
            gb(d.bytes_written),
            gb(d.kv_bytes_written),
            d.write_amplification,
            d.units_written,
            d.units_refused_full,
            d.units_refused_queue,
            d.units_failed,
            d.evictions,
            d.expiries,
            gb(d.live_bytes_end),
            gb(d.live_bytes_peak),
            d.engine,
            d.read_gb_per_s,
            d.write_gb_per_s
        )?;
        let p = &self.dram_pool;
        if p.enabled {
            writeln!(
                f,
                "  dram pool: {} slots of {} B; {} puts, {} hits, {} misses, {} evicted, {} expired; read {}, written {}; peak {}; {:.2} GB/s",
                p.slots,
                p.slot_bytes,
                p.puts,
                p.hits,
                p.misses,
                p.evictions,
                p.expiries,
                gb(p.bytes_read),
                gb(p.bytes_written),
                gb(p.peak_bytes),
                p.gb_per_s
            )?;
        } else {
            writeln!(
                f,
                "  dram pool: not used (no window KV to pool, or sized 0)"
            )?;
        }
        let c = &self.dram_cache;
        writeln!(
            f,
            "  paged cache: {} tokens; {} prefix blocks evicted, {} idle sessions dropped, {} requests not admitted; peak in use {}",
            c.capacity_tokens,
            c.evictions,
            c.live_dropped,
            c.requests_not_admitted,
            gb(c.peak_in_use_bytes)
        )?;
        writeln!(
            f,
            "  {:<14} {:>9} {:>9} {:>9} {:>9} {:>7}",
            "latency ms", "p50", "p90", "p99", "max", "count"
        )?;
        let l = &self.latency_ms;
        for (name, p) in [
            ("lookup", &l.lookup),
            ("restore ssd", &l.restore_ssd),
            ("restore dram", &l.restore_dram),
            ("admission", &l.admission),
            ("persist", &l.persist),
            ("flush", &l.flush),
        ] {
            writeln!(f, "  {name:<14} {}", lat(p))?;
        }
        let m = &self.cost_model;
        writeln!(
            f,
            "  cost model ({:.0} prefill tokens/s, {}): prefill {:.0} s without tiers, {:.0} s with, {:.0} s saved ({})",
            m.prefill_tokens_per_s,
            m.prefill_rate_source,
            m.prefill_seconds_without_tiers,
            m.prefill_seconds_with_tiers,
            m.prefill_seconds_saved,
            pct(m.fraction_saved)
        )?;
        writeln!(
            f,
            "  {:<14} {}",
            "ttft without",
            lat(&m.ttft_ms_without_tiers)
        )?;
        writeln!(f, "  {:<14} {}", "ttft with", lat(&m.ttft_ms_with_tiers))?;
        writeln!(f, "  measured: {}", self.measured.join("; "))?;
        writeln!(f, "  modelled: {}", self.modelled.join("; "))?;
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        Ok(())
    }
}
