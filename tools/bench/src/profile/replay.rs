//! The replay: a trace's requests through the real SSD store, DRAM window pool and paged
//! cache, in trace time (module docs of [`super`]).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstack_cache::{CacheGeometry, CacheOptions, KvCache, SequenceId};
use kvstack_driver::pinned::PinnedOptions;
use kvstack_firmware_interface::record::record_len;
use kvstack_spec::plan::LayerPlan;
use kvstack_spec::{CacheReport as CalcReport, FormatOverrides, ModelConfig};
use kvstack_tiers::unit::{block_payload_bytes, snapshot_bytes};
use kvstack_tiers::{
    ManualClock, PoolOptions, RedisOptions, StoreLocation, StoreOptions, Tenant, TierOptions,
    Tiers, UnitTicket, WindowPool,
};

use super::report::{
    CacheReport, ClusterReport, CostReport, Latencies, Percentiles, PoolReport, ReplayReport,
    Samples, Series, SsdReport, TokensBySource,
};
use super::tokens::Sessions;
use super::trace::{TRACE_BLOCK_TOKENS, Trace};
use crate::synth::SyntheticKv;
use crate::{Error, Result};

/// Trace time 0 on the injected clock (records store wall-clock milliseconds; any fixed epoch
/// keeps a replay reproducible).
const EPOCH_MS: u64 = 1_700_000_000_000;

/// Tokens per page and SSD block.
const PAGE_TOKENS: u32 = 256;

/// A model to replay: a name for reports and its config.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// Shown in reports (the config's path or the built-in name).
    pub name: String,
    /// The config.
    pub config: ModelConfig,
}

/// Options of [`replay`].
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Directory in which the run's store is created (in a subdirectory removed afterwards).
    pub data_dir: PathBuf,
    /// The model whose cache geometry is replayed.
    pub model: ModelSpec,
    /// SSD capacity in bytes.
    pub ssd_capacity_bytes: u64,
    /// Bytes per SSD segment; `None`: a 32nd of the capacity, between 1 and 64 MiB.
    pub segment_bytes: Option<u64>,
    /// SSD retention after last use, trace ms.
    pub retention_ms: u64,
    /// DRAM window pool capacity in bytes (0: no pool).
    pub dram_pool_bytes: u64,
    /// Window snapshot TTL, trace ms.
    pub window_ttl_ms: u64,
    /// Paged cache capacity for global entries and indexer keys, bytes.
    pub cache_bytes: u64,
    /// Sequences the paged cache holds at most (in flight and live).
    pub max_sequences: usize,
    /// Keep a session's sequence in the paged cache after each turn (dropped, least recently
    /// used first, when room is needed).
    pub keep_live: bool,
    /// Infer sessions (see [`Sessions::infer`]).
    pub sessions: bool,
    /// Trace seconds per wall second; `None`: as fast as possible.
    pub speed: Option<f64>,
    /// Prefill tokens per second of the cost model.
    pub prefill_tokens_per_s: f64,
    /// Where that rate came from (for the report).
    pub prefill_rate_source: String,
    /// Decode tokens per second of one sequence (when outputs end in trace time).
    pub decode_tokens_per_s: f64,
    /// Bucket of the time series, trace ms; `None`: a 60th of the trace, at least 1 s.
    pub bucket_ms: Option<u64>,
    /// Memory policy of the pools and buffers.
    pub memory: PinnedOptions,
    /// Name of the trace for the report.
    pub trace_name: String,
    /// In-process nodes, each with its own SSD store (a subdirectory), DRAM window pool and
    /// paged cache; requests go to them round-robin in arrival order (request `i` to node
    /// `i % nodes`). 1: one node, as without the option.
    pub nodes: usize,
    /// With several nodes: on a local miss a node fetches the longest unit another node holds
    /// for the prompt (its stored bytes read there, written and made durable here), and
    /// windows come from a shared second level (`docs/profile.md`, "Several nodes").
    pub shared_tiers: bool,
    /// Seed URLs of a Redis Cluster for the shared window level (`redis://HOST:PORT`); empty:
    /// the level is modelled in process (a window pool shared by the nodes, same TTL on trace
    /// time, the capacity of one node's pool).
    pub redis_cluster: Vec<String>,
}

impl ReplayOptions {
    /// Defaults: 20 GB SSD with 72 h retention, a 2 GB DRAM pool with a 5-minute TTL, a 2 GB
    /// paged cache of 256 sequences, 20,000 prefill tokens/s, 50 decode tokens/s.
    pub fn new(data_dir: PathBuf, model: ModelSpec) -> ReplayOptions {
        ReplayOptions {
            data_dir,
            model,
            ssd_capacity_bytes: 20_000_000_000,
            segment_bytes: None,
            retention_ms: kvstack_tiers::store::DEFAULT_RETENTION_MS,
            dram_pool_bytes: 2_000_000_000,
            window_ttl_ms: kvstack_tiers::window_pool::DEFAULT_TTL_MS,
            cache_bytes: 2_000_000_000,
            max_sequences: 256,
            keep_live: true,
            sessions: true,
            speed: None,
            prefill_tokens_per_s: 20_000.0,
            prefill_rate_source: "flag".into(),
            decode_tokens_per_s: 50.0,
            bucket_ms: None,
            memory: PinnedOptions::default(),
            trace_name: "<memory>".into(),
            nodes: 1,
            shared_tiers: false,
            redis_cluster: Vec::new(),
        }
    }
}

/// Where a replay is, for progress displays.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    /// Requests admitted so far.
    pub done: u64,
    /// Requests in the trace.
    pub total: u64,
    /// Trace time reached, ms from the first arrival.
    pub trace_ms: u64,
    /// Trace span, ms.
    pub span_ms: u64,
    /// Wall seconds so far.
    pub seconds: f64,
}

/// How the tiers stand in for the model's geometry.
struct Geometry {
    native: bool,
    bytes_per_token: f64,
    /// Store bytes of the model per store byte of a V4.1 block record.
    ssd_scale: f64,
    /// Pool bytes of the model per pool byte of a V4.1 snapshot slot.
    pool_scale: f64,
    has_window: bool,
    model_slot_bytes: u64,
    cfg: ModelConfig,
}

fn geometry(model: &ModelConfig) -> Result<Geometry> {
    let calc = CalcReport::compute(model, &FormatOverrides::default())?;
    let native = LayerPlan::from_config(model)
        .ok()
        .is_some_and(|plan| CacheGeometry::new(model, &plan, PAGE_TOKENS).is_ok());
    let cfg = if native {
        model.clone()
    } else {
        kvstack_spec::builtin::default_config()?
    };
    let plan = LayerPlan::from_config(&cfg)?;
    let g = CacheGeometry::new(&cfg, &plan, PAGE_TOKENS)?;
    let v41_record = record_len(block_payload_bytes(&g, PAGE_TOKENS as u64) + 4 * 256) as f64;
    let bpt = calc.persistent_bytes_per_token;
    let model_record = record_len((bpt * f64::from(PAGE_TOKENS)).ceil() as u64 + 4 * 256) as f64;
    let v41_slot = snapshot_bytes(&g).next_multiple_of(4096) as f64;
    let model_slot = if native {
        v41_slot as u64
    } else {
        (calc.per_sequence_bytes as usize + 32).next_multiple_of(4096) as u64
    };
    Ok(Geometry {
        native,
        bytes_per_token: bpt,
        ssd_scale: if native {
            1.0
        } else {
            model_record / v41_record
        },
        pool_scale: if native {
            1.0
        } else {
            model_slot as f64 / v41_slot
        },
        has_window: calc.window_bytes > 0,
        model_slot_bytes: model_slot,
        cfg,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    PrefillDone,
    DecodeDone,
}

/// A request between admission and its last unit.
struct Flight {
    seq: SequenceId,
    prompt: u64,
    reused: u64,
    output: u64,
}

/// Idle live sequences by session, least recently used first.
#[derive(Default)]
struct LiveSet {
    by_session: HashMap<u32, (SequenceId, u64)>,
    lru: BTreeMap<u64, u32>,
    stamp: u64,
}

impl LiveSet {
    fn take(&mut self, session: u32) -> Option<SequenceId> {
        let (seq, stamp) = self.by_session.remove(&session)?;
        self.lru.remove(&stamp);
        Some(seq)
    }

    fn put(&mut self, session: u32, seq: SequenceId) -> Option<SequenceId> {
        let old = self.take(session);
        self.stamp += 1;
        self.by_session.insert(session, (seq, self.stamp));
        self.lru.insert(self.stamp, session);
        old
    }

    fn pop_oldest(&mut self) -> Option<SequenceId> {
        let (_, session) = self.lru.pop_first()?;
        self.by_session.remove(&session).map(|(s, _)| s)
    }
}

fn is_room_error(e: &Error) -> bool {
    let cache = match e {
        Error::Cache(c) | Error::Tiers(kvstack_tiers::Error::Cache(c)) => c,
        _ => return false,
    };
    matches!(
        cache,
        kvstack_cache::Error::PoolExhausted { .. } | kvstack_cache::Error::TooManySequences { .. }
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Resets the process's peak RSS so that a run reports its own (best effort: `/proc`
/// may refuse; the peak then covers the process so far).
fn reset_peak_rss() {
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        log::debug!("cannot reset the peak RSS; it covers the whole process");
    }
}

/// One node's own tiers, parked while another node handles a request.
struct Node {
    tiers: Tiers,
    cache: KvCache,
    live: LiveSet,
    tickets: Vec<UnitTicket>,
    dirty: bool,
    dirty_since: Option<Instant>,
}

/// Counters of a run over several nodes.
#[derive(Default)]
struct ClusterCounts {
    requests_per_node: Vec<u64>,
    peer_fetches: u64,
    peer_fetch_failures: u64,
    peer_bytes: u64,
    windows_shared: u64,
    shared_puts: u64,
    shared_hits: u64,
}

/// The replay's state (module docs of [`super`]). With several nodes, `tiers`, `cache`,
/// `live`, `tickets`, `dirty` and `dirty_since` are the current node's (`cur`); the others
/// are parked in `parked`.
struct Replay<'a> {
    trace: &'a Trace,
    opts: &'a ReplayOptions,
    geo: Geometry,
    sessions: Sessions,
    tiers: Tiers,
    cache: KvCache,
    synth: SyntheticKv,
    clock: Arc<ManualClock>,
    tenant: Tenant,
    window_tokens: u64,
    context_limit: u64,
    now_ms: u64,
    events: BinaryHeap<Reverse<(u64, Event, u32)>>,
    flights: HashMap<u32, Flight>,
    live: LiveSet,
    tickets: Vec<UnitTicket>,
    dirty: bool,
    dirty_since: Option<Instant>,
    tokens_buf: Vec<u32>,
    // Results.
    sources: TokensBySource,
    blocks_hit: u64,
    blocks_total: u64,
    windows_from_pool: u64,
    window_replays: u64,
    ssd_read_bytes: u64,
    ssd_read_seconds: f64,
    write_seconds: f64,
    kv_bytes_written: u64,
    units_written: u64,
    refused_full: u64,
    failed: u64,
    live_dropped: u64,
    not_admitted: u64,
    lat: Samples,
    persist_ms: Vec<f64>,
    flush_ms: Vec<f64>,
    ttft_without: Vec<f64>,
    ttft_with: Vec<f64>,
    prefill_without_s: f64,
    prefill_with_s: f64,
    series: Series,
    bucket_read: Vec<u64>,
    last_written: u64,
    /// Peak SSD live, pool and paged-cache bytes at samples.
    peaks: (u64, u64, u64),
    start: Instant,
    parked: Vec<Option<Node>>,
    cur: usize,
    /// The in-process model of the shared window level (shared tiers without Redis).
    shared_pool: Option<WindowPool>,
    cluster: ClusterCounts,
}

impl Replay<'_> {
    fn bucket_of(&self, t: u64) -> usize {
        let first = self.trace.requests.first().map_or(0, |r| r.timestamp_ms);
        ((t - first.min(t)) / self.series.bucket_ms.max(1)) as usize
    }

    /// Makes room in the paged cache by dropping the least recently used idle sequence.
    fn make_room(&mut self) -> Result<bool> {
        match self.live.pop_oldest() {
            Some(seq) => {
                self.cache.drop_sequence(seq)?;
                self.live_dropped += 1;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Makes node `k` the current one (its tiers in `self`, the current one's parked).
    fn switch(&mut self, k: usize) {
        if k == self.cur {
            return;
        }
        let Some(mut n) = self.parked.get_mut(k).and_then(Option::take) else {
            return;
        };
        std::mem::swap(&mut self.tiers, &mut n.tiers);
        std::mem::swap(&mut self.cache, &mut n.cache);
        std::mem::swap(&mut self.live, &mut n.live);
        std::mem::swap(&mut self.tickets, &mut n.tickets);
        std::mem::swap(&mut self.dirty, &mut n.dirty);
        std::mem::swap(&mut self.dirty_since, &mut n.dirty_since);
        self.parked[self.cur] = Some(n);
        self.cur = k;
    }

    /// The node that serves request `req`: round-robin in arrival order.
    fn node_of(&self, req: usize) -> usize {
        req % self.parked.len().max(1)
    }

    /// The tiers and paged cache of every node, the current one first.
    fn all_nodes(&self) -> Vec<(&Tiers, &KvCache)> {
        let mut v = vec![(&self.tiers, &self.cache)];
        v.extend(self.parked.iter().flatten().map(|n| (&n.tiers, &n.cache)));
        v
    }

    /// Waits until everything queued on every node is durable and settles the tickets.
    fn flush(&mut self) -> Result<()> {
        let cur = self.cur;
        for k in 0..self.parked.len() {
            let dirty = if k == cur {
                self.dirty
            } else {
                self.parked[k].as_ref().is_some_and(|n| n.dirty)
            };
            if dirty {
                self.switch(k);
                self.flush_node()?;
            }
        }
        self.switch(cur);
        self.flush_node()
    }

    /// [`Replay::flush`] of the current node.
    fn flush_node(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let t = Instant::now();
        self.tiers.flush()?;
        self.flush_ms.push(ms(t.elapsed()));
        if let Some(since) = self.dirty_since.take() {
            self.write_seconds += since.elapsed().as_secs_f64();
        }
        let g = self.tiers.geometry().clone();
        let p = g.page_tokens as u64;
        for ticket in std::mem::take(&mut self.tickets) {
            let (tokens, new) = (ticket.tokens, ticket.new_blocks as u64);
            match ticket.wait() {
                Ok(()) => {
                    self.units_written += 1;
                    // Missing blocks are always a unit's last ones (a block is kept while any
                    // unit through it is), so the new KV is the tail's.
                    if new > 0 {
                        let blocks = tokens.div_ceil(p);
                        let last = tokens - (blocks - 1) * p;
                        self.kv_bytes_written +=
                            (new - 1) * block_payload_bytes(&g, p) + block_payload_bytes(&g, last);
                    }
                }
                Err(kvstack_tiers::Error::StoreFull { .. }) => self.refused_full += 1,
                Err(e) => {
                    log::debug!("a unit failed: {e}");
                    self.failed += 1;
                }
            }
        }
        self.dirty = false;
        Ok(())
    }

    /// Moves trace time to `t` (durability first, so every unit persisted before `t` is
    /// visible at `t`, and the writer never sees the clock move under a batch).
    fn advance(&mut self, t: u64) -> Result<()> {
        if t <= self.now_ms {
            return Ok(());
        }
        self.flush()?;
        let (b0, b1) = (self.bucket_of(self.now_ms), self.bucket_of(t));
        if b1 > b0 {
            self.sample(b0, b1);
        }
        self.now_ms = t;
        self.clock.set(EPOCH_MS + t);
        if let Some(speed) = self.opts.speed {
            let first = self.trace.requests.first().map_or(0, |r| r.timestamp_ms);
            let due = Duration::from_secs_f64((t - first.min(t)) as f64 / 1e3 / speed);
            let el = self.start.elapsed();
            if due > el {
                std::thread::sleep(due - el);
            }
        }
        Ok(())
    }

    /// Records occupancy at the end of buckets `b0 .. b1` (unchanged over skipped ones).
    fn sample(&mut self, b0: usize, b1: usize) {
        let (mut live, mut all_written, mut pool_held, mut cache) = (0, 0, 0, 0);
        for (tiers, kv) in self.all_nodes() {
            let st = tiers.store().stats();
            let pool = tiers.pool().stats();
            let usage = kv.usage();
            live += st.live_bytes;
            all_written += st.bytes_written;
            pool_held += pool.entries * pool.slot_bytes;
            cache += usage.global.in_use_bytes + usage.index.in_use_bytes;
        }
        let ssd = (live as f64 * self.geo.ssd_scale) as u64;
        let pool_bytes = pool_held as f64 * self.geo.pool_scale;
        let cache = (cache as f64 * self.geo.bytes_per_token
            / self.native_bytes_per_token().max(1.0)) as u64;
        let written = all_written - self.last_written;
        self.last_written = all_written;
        let secs = self.series.bucket_ms as f64 / 1e3;
        let s = &mut self.series;
        for b in b0..b1.min(b0 + 100_000) {
            while s.ssd_live_bytes.len() <= b {
                s.ssd_live_bytes.push(0);
                s.pool_bytes.push(0);
                s.cache_bytes.push(0);
                s.ssd_write_bytes_per_s.push(0.0);
            }
            s.ssd_live_bytes[b] = ssd;
            s.pool_bytes[b] = pool_bytes as u64;
            s.cache_bytes[b] = cache;
            s.ssd_write_bytes_per_s[b] = if b == b0 {
                written as f64 * self.geo.ssd_scale / secs
            } else {
                0.0
            };
        }
        self.peaks.0 = self.peaks.0.max(ssd);
        self.peaks.1 = self.peaks.1.max(pool_bytes as u64);
        self.peaks.2 = self.peaks.2.max(cache);
    }

    fn native_bytes_per_token(&self) -> f64 {
        let g = self.tiers.geometry();
        block_payload_bytes(g, g.page_tokens as u64) as f64 / g.page_tokens as f64
    }

    fn persist_points(&mut self, seq: SequenceId, from: u64, to: u64) -> Result<()> {
        for p in self.tiers.unit_points(from, to, true) {
            let t = Instant::now();
            let r = self.tiers.persist(&self.cache, seq, &self.tenant, p);
            self.persist_ms.push(ms(t.elapsed()));
            self.dirty_since.get_or_insert_with(Instant::now);
            self.dirty = true;
            match r {
                Ok(ticket) => {
                    // The shared level's copy of the window the node just put in its own pool
                    // (the Redis level gets it from `Tiers::persist` itself).
                    if let Some(shared) = &self.shared_pool
                        && p == self.cache.len(seq)?
                        && let Some(snap) = self.tiers.window_snapshot(&self.cache, seq)?
                    {
                        shared.put(ticket.key, &snap)?;
                        self.cluster.shared_puts += 1;
                    }
                    self.tickets.push(ticket);
                }
                // Counted by the store (`refused_queue`).
                Err(kvstack_tiers::Error::QueueFull { .. }) => {}
                Err(e) => {
                    log::debug!("persisting {p} tokens: {e}");
                    self.failed += 1;
                }
            }
            // One unit per writer batch: how the writer would group units queued together
            // depends on timing, and so would where their records land.
            self.flush()?;
        }
        Ok(())
    }

    /// Appends `tokens[len..]` to `seq` (synthetic KV), dropping idle sequences for room;
    /// false when it cannot fit.
    fn compute(&mut self, seq: SequenceId, tokens: &[u32], window_end: u64) -> Result<bool> {
        loop {
            let len = self.cache.len(seq)? as usize;
            if len >= tokens.len() {
                return Ok(true);
            }
            match self
                .synth
                .append(&mut self.cache, seq, &tokens[len..], window_end)
            {
                Ok(()) => return Ok(true),
                Err(e) if is_room_error(&e) => {
                    if !self.make_room()? {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// With shared tiers, before a local lookup: fetches the longest unit of the prompt that
    /// another node holds, when it is longer than this node's, into this node's store (its
    /// stored bytes read there, written and made durable here), and puts a window the shared
    /// level holds at the end of the unit the node then has into its DRAM pool. Returns the
    /// tokens this node held before (for counting `peer` tokens) and whether a window came
    /// from the in-process shared level.
    fn shared_lookup(&mut self, cut: &[u32]) -> Result<(u64, bool)> {
        let local = self.tiers.lookup(cut, &self.tenant);
        let before = local.tokens;
        let mut best = None;
        let mut best_tokens = before;
        for (k, n) in self.parked.iter().enumerate() {
            let Some(n) = n else { continue };
            let h = n.tiers.lookup(cut, &self.tenant);
            if h.tokens > best_tokens {
                best_tokens = h.tokens;
                best = Some((k, h));
            }
        }
        if let Some((k, h)) = best
            && let Some(holder) = self.parked[k].as_mut()
        {
            let data = holder.tiers.read_unit(cut, &h)?;
            // A read counts as a use: its touch is flushed with the holder's writes.
            holder.dirty = true;
            holder.dirty_since.get_or_insert_with(Instant::now);
            match data {
                Some(mut d) => {
                    // The window travels through the shared level, not with the unit.
                    d.window = None;
                    let unit = &cut[..h.tokens as usize];
                    let done = match self.tiers.write_unit(&self.tenant, unit, &d) {
                        Ok(ticket) => {
                            self.tiers.flush()?;
                            ticket.wait()
                        }
                        Err(e) => Err(e),
                    };
                    match done {
                        Ok(()) => {
                            self.cluster.peer_fetches += 1;
                            self.cluster.peer_bytes += d.payload_bytes();
                        }
                        Err(e) => {
                            log::debug!("peer fetch of {} tokens: {e}", h.tokens);
                            self.cluster.peer_fetch_failures += 1;
                        }
                    }
                }
                None => self.cluster.peer_fetch_failures += 1,
            }
        }
        let mut from_shared = false;
        if let Some(shared) = &self.shared_pool {
            let hit = self.tiers.lookup(cut, &self.tenant);
            if hit.tokens > 0
                && !hit.window
                && let Some(key) = hit.key()
            {
                let mut snap = Vec::new();
                if shared.get(&key, &mut snap) {
                    self.cluster.shared_hits += 1;
                    self.tiers.pool().put(key, &snap)?;
                    from_shared = true;
                }
            }
        }
        Ok((before, from_shared))
    }

    fn arrive(&mut self, req: usize) -> Result<()> {
        let node = self.node_of(req);
        self.switch(node);
        if let Some(n) = self.cluster.requests_per_node.get_mut(node) {
            *n += 1;
        }
        let r = &self.trace.requests[req];
        let mut tokens = std::mem::take(&mut self.tokens_buf);
        self.sessions.prompt(self.trace, req, &mut tokens);
        let n = tokens.len() as u64;
        let session = self.sessions.session(req);
        let mut src = TokensBySource::default();
        let admission = Instant::now();
        let mut seq = None;
        let mut reused = 0u64;
        let mut replay = None;
        if let Some(s) = self.live.take(session) {
            let held = self.cache.tokens(s)?;
            let common = held
                .iter()
                .zip(&tokens[..tokens.len() - 1])
                .take_while(|(a, b)| a == b)
                .count() as u64;
            if common == 0 {
                self.cache.drop_sequence(s)?;
            } else {
                if common < held.len() as u64 {
                    self.cache.truncate(s, common)?;
                }
                seq = Some(s);
                reused = common;
                src.live = common;
            }
        }
        let seq = match seq {
            Some(s) => s,
            None => {
                let cut = &tokens[..tokens.len() - 1];
                let (before, window_shared) = if self.opts.shared_tiers && self.parked.len() > 1 {
                    self.shared_lookup(cut)?
                } else {
                    (u64::MAX, false)
                };
                let t = Instant::now();
                let hit = self.tiers.lookup(cut, &self.tenant);
                self.lat.lookup.push(ms(t.elapsed()));
                let t = Instant::now();
                let restored = loop {
                    match self.tiers.restore(&mut self.cache, cut, &hit) {
                        Ok(x) => break Some(x),
                        Err(e) => {
                            let e = Error::Tiers(e);
                            if !is_room_error(&e) {
                                return Err(e);
                            }
                            if !self.make_room()? {
                                break None;
                            }
                        }
                    }
                };
                let took = t.elapsed();
                let Some(restored) = restored else {
                    self.not_admitted += 1;
                    self.finish_unadmitted(req, n);
                    self.tokens_buf = tokens;
                    return Ok(());
                };
                if restored.read_tokens > 0 {
                    self.lat.restore_ssd.push(ms(took));
                    self.ssd_read_bytes += restored.read_bytes;
                    self.ssd_read_seconds += took.as_secs_f64();
                    let b = self.bucket_of(r.timestamp_ms);
                    if self.bucket_read.len() <= b {
                        self.bucket_read.resize(b + 1, 0);
                    }
                    self.bucket_read[b] += restored.read_bytes;
                    // A read refreshes last uses (touch commits may follow).
                    self.dirty = true;
                } else if restored.tokens > 0 {
                    self.lat.restore_dram.push(ms(took));
                }
                reused = restored.tokens;
                let (mut mapped, mut read) = (restored.mapped_tokens, restored.read_tokens);
                let mut read_end = restored.tokens;
                if self.geo.has_window && reused > 0 {
                    let w = self.window_tokens.min(reused);
                    let from_read = w.min(read);
                    read -= from_read;
                    read_end -= from_read;
                    mapped -= w - from_read;
                    if restored.window {
                        src.dram_pool = w;
                        if restored.window_remote || window_shared {
                            self.cluster.windows_shared += 1;
                        } else {
                            self.windows_from_pool += 1;
                        }
                    } else {
                        src.replayed = w;
                        self.window_replays += 1;
                    }
                }
                replay = restored.replay;
                src.dram_cache = mapped;
                // Tokens read here that this node held only thanks to a peer fetch.
                let peer = read_end
                    .saturating_sub(before.max(restored.mapped_tokens))
                    .min(read);
                src.peer = peer;
                src.ssd = read - peer;
                restored.seq
            }
        };
        let admitted = admission.elapsed();
        self.lat.admission.push(ms(admitted));
        // The bounded replay's window KV: the model's work, which the cost model counts.
        if let Some(plan) = replay {
            self.synth.write_window(&mut self.cache, seq, plan.start)?;
        }
        src.computed = n - reused;
        if !self.compute(seq, &tokens, n)? {
            self.cache.drop_sequence(seq)?;
            self.not_admitted += 1;
        } else {
            self.flights.insert(
                req as u32,
                Flight {
                    seq,
                    prompt: n,
                    reused,
                    output: r.output_length.min(self.context_limit - n),
                },
            );
            let rate = self.opts.prefill_tokens_per_s;
            let prefill_s = (src.computed + src.replayed) as f64 / rate;
            let done = r.timestamp_ms + (prefill_s * 1e3).ceil() as u64;
            self.events
                .push(Reverse((done, Event::PrefillDone, req as u32)));
        }
        self.account(req, &src, admitted);
        self.tokens_buf = tokens;
        Ok(())
    }

    /// A request the paged cache could not hold: computed whole, nothing persisted.
    fn finish_unadmitted(&mut self, req: usize, n: u64) {
        let src = TokensBySource {
            computed: n,
            ..TokensBySource::default()
        };
        self.account(req, &src, Duration::ZERO);
    }

    fn account(&mut self, req: usize, src: &TokensBySource, admitted: Duration) {
        let r = &self.trace.requests[req];
        let rate = self.opts.prefill_tokens_per_s;
        self.sources.add(src);
        self.lat.per_request.push(*src);
        let hit = src.hits();
        self.blocks_total += r.hash_ids.len() as u64;
        self.blocks_hit += hit / TRACE_BLOCK_TOKENS;
        let without = r.input_length as f64 / rate;
        let with = (src.computed + src.replayed) as f64 / rate;
        self.prefill_without_s += without;
        self.prefill_with_s += with;
        self.ttft_without.push(without * 1e3);
        self.ttft_with.push(ms(admitted) + with * 1e3);
        let b = self.bucket_of(r.timestamp_ms);
        let s = &mut self.series.tokens;
        if s.len() <= b {
            s.resize(b + 1, TokensBySource::default());
        }
        s[b].add(src);
    }

    fn prefill_done(&mut self, req: u32) -> Result<()> {
        self.switch(self.node_of(req as usize));
        let Some(f) = self.flights.get(&req) else {
            return Ok(());
        };
        let (seq, prompt, reused, output) = (f.seq, f.prompt, f.reused, f.output);
        self.persist_points(seq, reused, prompt)?;
        if output == 0 {
            return self.finish(req);
        }
        let mut tokens = std::mem::take(&mut self.tokens_buf);
        self.sessions.prompt(self.trace, req as usize, &mut tokens);
        let mut out = Vec::new();
        self.sessions.output(self.trace, req as usize, &mut out);
        out.truncate(output as usize);
        tokens.extend_from_slice(&out);
        let ok = self.compute(seq, &tokens, prompt + output)?;
        self.tokens_buf = tokens;
        if !ok {
            // No room for the output: the prompt's units stand, the sequence goes.
            self.flights.remove(&req);
            self.cache.drop_sequence(seq)?;
            return Ok(());
        }
        let t = self.now_ms + (output as f64 / self.opts.decode_tokens_per_s * 1e3).ceil() as u64;
        self.events.push(Reverse((t, Event::DecodeDone, req)));
        Ok(())
    }

    fn decode_done(&mut self, req: u32) -> Result<()> {
        self.switch(self.node_of(req as usize));
        let Some(f) = self.flights.get(&req) else {
            return Ok(());
        };
        let (seq, prompt, output) = (f.seq, f.prompt, f.output);
        self.persist_points(seq, prompt, prompt + output)?;
        self.finish(req)
    }

    fn finish(&mut self, req: u32) -> Result<()> {
        let Some(f) = self.flights.remove(&req) else {
            return Ok(());
        };
        if self.opts.keep_live {
            let session = self.sessions.session(req as usize);
            if let Some(old) = self.live.put(session, f.seq) {
                self.cache.drop_sequence(old)?;
            }
        } else {
            self.cache.drop_sequence(f.seq)?;
        }
        Ok(())
    }

    fn run(&mut self, progress: &mut dyn FnMut(&Progress)) -> Result<()> {
        let total = self.trace.requests.len();
        let first = self.trace.requests.first().map_or(0, |r| r.timestamp_ms);
        let span = self.trace.span_ms();
        let mut next = 0usize;
        let mut shown = Instant::now();
        loop {
            let arrival = self.trace.requests.get(next).map(|r| r.timestamp_ms);
            let event = self.events.peek().map(|Reverse(e)| *e);
            // Completions first at equal times: what ended by `t` is visible at `t`.
            let take_event = match (event, arrival) {
                (Some((te, _, _)), Some(ta)) => te <= ta,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            if take_event {
                let Some(Reverse((t, kind, req))) = self.events.pop() else {
                    break;
                };
                self.advance(t)?;
                match kind {
                    Event::PrefillDone => self.prefill_done(req)?,
                    Event::DecodeDone => self.decode_done(req)?,
                }
            } else if let Some(t) = arrival {
                self.advance(t)?;
                // A unit persisted at an earlier instant is durable before this lookup.
                self.flush()?;
                self.arrive(next)?;
                next += 1;
                if shown.elapsed() > Duration::from_millis(250) || next == total {
                    shown = Instant::now();
                    progress(&Progress {
                        done: next as u64,
                        total: total as u64,
                        trace_ms: t - first,
                        span_ms: span,
                        seconds: self.start.elapsed().as_secs_f64(),
                    });
                }
            }
        }
        self.flush()?;
        let b = self.bucket_of(self.now_ms);
        self.sample(b, b + 1);
        Ok(())
    }
}

fn gb_per_s(bytes: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes / seconds / 1e9
    } else {
        0.0
    }
}

/// Replays `trace` (module docs of [`super`]); `progress` is called a few times a second.
/// The store lives in a fresh subdirectory of `opts.data_dir`, removed afterwards.
///
/// # Errors
/// [`Error::InvalidOption`] for capacities that hold nothing; the store's, the pool's and the
/// cache's errors (a data directory that cannot hold a store, memory).
pub fn replay(
    trace: &Trace,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<ReplayReport> {
    if trace.requests.is_empty() {
        return Err(Error::InvalidOption {
            field: "trace",
            reason: "has no requests".into(),
        });
    }
    for (field, v) in [
        ("prefill_tokens_per_s", opts.prefill_tokens_per_s),
        ("decode_tokens_per_s", opts.decode_tokens_per_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::InvalidOption {
                field,
                reason: format!("{v} is not a positive rate"),
            });
        }
    }
    let dir = opts.data_dir.join(format!(
        "kvstack-profile-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&opts.data_dir)
        .map_err(|e| Error::io("cannot create", &opts.data_dir, e))?;
    let result = replay_in(trace, opts, &dir, progress);
    // The run's own directory: segments and the owner file.
    if dir.exists()
        && let Err(e) = std::fs::remove_dir_all(&dir)
    {
        log::warn!("cannot remove {}: {e}", dir.display());
    }
    result
}

static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn replay_in(
    trace: &Trace,
    opts: &ReplayOptions,
    dir: &std::path::Path,
    progress: &mut dyn FnMut(&Progress),
) -> Result<ReplayReport> {
    reset_peak_rss();
    let geo = geometry(&opts.model.config)?;
    let start = Instant::now();
    let store_capacity = (opts.ssd_capacity_bytes as f64 / geo.ssd_scale) as u64;
    let segment = opts
        .segment_bytes
        .unwrap_or_else(|| (store_capacity / 32).clamp(1 << 20, 64 << 20) / (1 << 20) * (1 << 20));
    let store_capacity = store_capacity / segment * segment;
    if store_capacity < 4 * segment {
        return Err(Error::InvalidOption {
            field: "ssd_capacity",
            reason: format!(
                "{} bytes give the store {} segments of {segment} bytes; it needs at least 4",
                opts.ssd_capacity_bytes,
                store_capacity / segment
            ),
        });
    }
    let nodes = opts.nodes.max(1);
    let mut store = StoreOptions::new(StoreLocation::Directory(dir.to_path_buf()));
    store.capacity_bytes = store_capacity;
    store.segment_bytes = segment;
    store.retention_ms = opts.retention_ms;
    store.memory = opts.memory;
    let max_prompt = trace
        .requests
        .iter()
        .map(|r| r.input_length + r.output_length)
        .max()
        .unwrap_or(1);
    store.max_unit_blocks = store
        .max_unit_blocks
        .max(max_prompt.div_ceil(u64::from(PAGE_TOKENS)) as usize);
    let mut tier_opts = TierOptions::new(store);
    let plan = LayerPlan::from_config(&geo.cfg)?;
    let g = CacheGeometry::new(&geo.cfg, &plan, PAGE_TOKENS)?;
    let v41_slot = snapshot_bytes(&g).next_multiple_of(4096) as u64;
    let pool_slots = if geo.has_window {
        opts.dram_pool_bytes / geo.model_slot_bytes.max(1)
    } else {
        0
    };
    let pool_enabled = pool_slots > 0;
    tier_opts.pool = PoolOptions {
        capacity_bytes: Some(pool_slots.max(1) * v41_slot),
        // A pool that is not used never returns a snapshot.
        ttl_ms: if pool_enabled { opts.window_ttl_ms } else { 0 },
        slot_bytes: 1,
        memory: opts.memory,
    };
    tier_opts.weights_id = b"kvstack profile".to_vec();
    let shared = nodes > 1 && opts.shared_tiers;
    if shared && !opts.redis_cluster.is_empty() {
        let mut r = RedisOptions::new(opts.redis_cluster.clone());
        // This run's keys only: the run directory's name is unique on this host.
        r.key_prefix = format!(
            "{}:",
            dir.file_name().map_or_else(
                || "kvstack-profile".into(),
                |n| n.to_string_lossy().into_owned()
            )
        );
        tier_opts.remote = Some(r);
    }
    let clock = Arc::new(ManualClock::new(EPOCH_MS));
    // Node k's store is in `node-k` (one node: the run directory itself, as always).
    let open_node = |k: usize| -> Result<Tiers> {
        let mut o = tier_opts.clone();
        if nodes > 1 {
            let d = dir.join(format!("node-{k}"));
            std::fs::create_dir_all(&d).map_err(|e| Error::io("cannot create", &d, e))?;
            o.store.location = StoreLocation::Directory(d);
        }
        Ok(Tiers::open(&geo.cfg, PAGE_TOKENS, o, clock.clone())?)
    };
    let tiers = open_node(0)?;
    let cache_tokens = (opts.cache_bytes as f64 / geo.bytes_per_token) as u64;
    if cache_tokens < u64::from(PAGE_TOKENS) {
        return Err(Error::InvalidOption {
            field: "cache",
            reason: format!(
                "{} bytes hold fewer than {PAGE_TOKENS} tokens at {} B/token",
                opts.cache_bytes, geo.bytes_per_token
            ),
        });
    }
    let context_limit = max_prompt.next_multiple_of(u64::from(PAGE_TOKENS));
    let cache_opts = CacheOptions {
        context_limit,
        page_tokens: PAGE_TOKENS,
        max_sequences: opts.max_sequences.max(1),
        pool_tokens: Some(cache_tokens),
        prefix_index: true,
        memory: opts.memory,
    };
    let cache = KvCache::new(&geo.cfg, &plan, cache_opts)?;
    let mut parked = vec![None];
    for k in 1..nodes {
        parked.push(Some(Node {
            tiers: open_node(k)?,
            cache: KvCache::new(&geo.cfg, &plan, cache_opts)?,
            live: LiveSet::default(),
            tickets: Vec::new(),
            dirty: false,
            dirty_since: None,
        }));
    }
    let shared_pool = if shared && opts.redis_cluster.is_empty() {
        Some(WindowPool::new(
            PoolOptions {
                slot_bytes: snapshot_bytes(&g),
                ..tier_opts.pool
            },
            clock.clone(),
        )?)
    } else {
        None
    };
    let synth = SyntheticKv::new(&g)?;
    let sessions = if opts.sessions {
        Sessions::infer(trace)
    } else {
        Sessions::none(trace)
    };
    let bucket_ms = opts
        .bucket_ms
        .unwrap_or_else(|| (trace.span_ms() / 60).max(1000))
        .max(1);
    let first = trace.requests.first().map_or(0, |r| r.timestamp_ms);
    let engine = tiers.store().engine().clone();
    let mut r = Replay {
        trace,
        opts,
        sessions,
        tiers,
        cache,
        synth,
        clock,
        tenant: Tenant::new("profile"),
        window_tokens: g.window_tokens as u64,
        context_limit,
        now_ms: first,
        events: BinaryHeap::new(),
        flights: HashMap::new(),
        live: LiveSet::default(),
        tickets: Vec::new(),
        dirty: false,
        dirty_since: None,
        tokens_buf: Vec::new(),
        sources: TokensBySource::default(),
        blocks_hit: 0,
        blocks_total: 0,
        windows_from_pool: 0,
        window_replays: 0,
        ssd_read_bytes: 0,
        ssd_read_seconds: 0.0,
        write_seconds: 0.0,
        kv_bytes_written: 0,
        units_written: 0,
        refused_full: 0,
        failed: 0,
        live_dropped: 0,
        not_admitted: 0,
        lat: Samples::default(),
        persist_ms: Vec::new(),
        flush_ms: Vec::new(),
        ttft_without: Vec::new(),
        ttft_with: Vec::new(),
        prefill_without_s: 0.0,
        prefill_with_s: 0.0,
        series: Series {
            bucket_ms,
            ..Series::default()
        },
        bucket_read: Vec::new(),
        last_written: 0,
        peaks: (0, 0, 0),
        start,
        geo,
        parked,
        cur: 0,
        shared_pool,
        cluster: ClusterCounts {
            requests_per_node: vec![0; nodes],
            ..ClusterCounts::default()
        },
    };
    r.clock.set(EPOCH_MS + first);
    r.run(progress)?;
    let seconds = start.elapsed().as_secs_f64();
    r.switch(0);
    // Counts and volumes are the nodes' sums (capacities are each node's).
    let mut st = r.tiers.store().stats();
    let mut pool = r.tiers.pool().stats();
    let now = EPOCH_MS + r.now_ms;
    let mut past_retention = 0u64;
    let mut cache_evictions = 0u64;
    for (i, (tiers, kv)) in r.all_nodes().into_iter().enumerate() {
        past_retention += tiers
            .store()
            .units()
            .iter()
            .filter(|(_, _, last)| last.saturating_add(opts.retention_ms) <= now)
            .count() as u64;
        cache_evictions += kv.prefix_evictions();
        if i == 0 {
            continue;
        }
        let (s, p) = (tiers.store().stats(), tiers.pool().stats());
        st.bytes_written += s.bytes_written;
        st.units_evicted += s.units_evicted;
        st.segments_compacted += s.segments_compacted;
        st.refused_queue += s.refused_queue;
        st.live_bytes += s.live_bytes;
        pool.bytes_got += p.bytes_got;
        pool.bytes_put += p.bytes_put;
        pool.puts += p.puts;
        pool.hits += p.hits;
        pool.misses += p.misses;
        pool.evicted += p.evicted;
        pool.expired += p.expired;
        pool.put_nanos += p.put_nanos;
        pool.get_nanos += p.get_nanos;
    }
    let peak_rss = kvstack_driver::probe::rss()
        .map(|x| x.peak_bytes)
        .unwrap_or(0);

    // The series, bucket by bucket.
    let buckets = r
        .series
        .tokens
        .len()
        .max(r.series.ssd_live_bytes.len())
        .max(r.bucket_read.len());
    let secs = bucket_ms as f64 / 1e3;
    let ssd_scale = r.geo.ssd_scale;
    let mut series = std::mem::take(&mut r.series);
    series.tokens.resize(buckets, TokensBySource::default());
    for v in [
        &mut series.ssd_live_bytes,
        &mut series.pool_bytes,
        &mut series.cache_bytes,
    ] {
        let last = v.last().copied().unwrap_or(0);
        v.resize(buckets, last);
    }
    series.ssd_write_bytes_per_s.resize(buckets, 0.0);
    r.bucket_read.resize(buckets, 0);
    series.ssd_read_bytes_per_s = r
        .bucket_read
        .iter()
        .map(|&b| b as f64 * ssd_scale / secs)
        .collect();
    series.t_s = (0..buckets).map(|b| b as f64 * secs).collect();

    let scale = |b: u64, s: f64| (b as f64 * s) as u64;
    let pool_scale = r.geo.pool_scale;
    let native = r.geo.native;
    let requests = trace.requests.len() as u64;
    let input_tokens = trace.input_tokens();
    let src = r.sources;
    let mut measured = vec![
        "token and block hit rates and every count (requests, tokens by source, units, \
         evictions, expiries, refusals), through the real store, pool and paged cache"
            .to_owned(),
        "latencies of lookup, restore, admission, persist and flush (wall time)".to_owned(),
        "wall time, peak RSS".to_owned(),
    ];
    let mut modelled = vec![
        format!(
            "prefill time and TTFT: tokens / {:.0} tokens/s ({}); no queueing",
            opts.prefill_tokens_per_s, opts.prefill_rate_source
        ),
        format!(
            "when prefills and outputs end in trace time (the same rates, {:.0} decode \
             tokens/s)",
            opts.decode_tokens_per_s
        ),
        "KV contents (synthetic entries in the stored formats)".to_owned(),
    ];
    if opts.sessions {
        modelled.push(
            "sessions and the tokens of partial blocks and outputs (inferred from prefix \
             extension)"
                .into(),
        );
    }
    let mut notes = Vec::new();
    if native {
        measured.push("bytes read and written per tier, SSD and DRAM bandwidth".into());
    } else {
        modelled.push(format!(
            "byte volumes: the tiers held V4.1 entries at the token capacity of {} B/token \
             (store capacity / {:.3}, pool slots of {} B, paged cache {} tokens); bytes read, \
             written and held are scaled back to the model's",
            r.geo.bytes_per_token, ssd_scale, r.geo.model_slot_bytes, cache_tokens
        ));
        notes.push(
            "latencies and bandwidths are those of the V4.1-sized I/O the tiers did, not of \
             the model's volumes"
                .into(),
        );
    }
    if !r.geo.has_window {
        notes.push("the model has no window KV: no pool, no replay".into());
    }
    if !engine.direct {
        notes.push(
            "the data directory refused O_DIRECT: the store ran through the page cache".into(),
        );
    }
    let kv_written = r.kv_bytes_written;
    let cluster = (nodes > 1).then(|| {
        let c = &r.cluster;
        let level = shared.then(|| {
            if opts.redis_cluster.is_empty() {
                "in-process model".to_owned()
            } else {
                "redis-cluster".to_owned()
            }
        });
        let mut notes = vec![
            "each node has its own SSD store, DRAM window pool and paged cache of the sizes \
             given; ssd, dram_pool and dram_cache counts are the nodes' sums"
                .to_owned(),
        ];
        if shared {
            notes.push(
                "a peer's unit is found by asking every other node's store for the prompt's \
                 longest unit (what the shared prefix index answers), read there with every \
                 CRC, written and made durable here, then restored from here (peer tokens); \
                 no network in between"
                    .into(),
            );
            let (puts, hits) = match r.tiers.remote() {
                Some(redis) => {
                    let mut st = redis.stats();
                    for n in r.parked.iter().flatten() {
                        if let Some(x) = n.tiers.remote() {
                            st.puts += x.stats().puts;
                            st.hits += x.stats().hits;
                        }
                    }
                    (st.puts, st.hits)
                }
                None => (c.shared_puts, c.shared_hits),
            };
            if opts.redis_cluster.is_empty() {
                notes.push(format!(
                    "shared window level: in-process model (a window pool shared by the nodes, \
                     {} B, the TTL on trace time), not Redis",
                    opts.dram_pool_bytes
                ));
            } else {
                notes.push(
                    "shared window level: Redis Cluster; its TTL (PX) runs on wall time, not \
                     trace time"
                        .into(),
                );
            }
            return ClusterReport {
                nodes: nodes as u64,
                routing: "round-robin by arrival (request i to node i mod nodes)".into(),
                requests_per_node: c.requests_per_node.clone(),
                shared_tiers: true,
                shared_window_level: level,
                peer_fetches: c.peer_fetches,
                peer_fetch_failures: c.peer_fetch_failures,
                peer_bytes: scale(c.peer_bytes, ssd_scale),
                windows_from_shared_level: c.windows_shared,
                shared_level_puts: puts,
                shared_level_hits: hits,
                notes,
            };
        }
        ClusterReport {
            nodes: nodes as u64,
            routing: "round-robin by arrival (request i to node i mod nodes)".into(),
            requests_per_node: c.requests_per_node.clone(),
            shared_tiers: false,
            shared_window_level: None,
            notes,
            ..ClusterReport::default()
        }
    });
    let report = ReplayReport {
        trace: opts.trace_name.clone(),
        model: opts.model.name.clone(),
        model_bytes_per_token: r.geo.bytes_per_token,
        native_geometry: native,
        requests,
        input_tokens,
        output_tokens: trace.requests.iter().map(|q| q.output_length).sum(),
        sessions: u64::from(r.sessions.count()),
        continued_turns: r.sessions.continued() as u64,
        tokens_by_source: src,
        hit_rate_tokens: src.hits() as f64 / input_tokens.max(1) as f64,
        hit_rate_blocks: r.blocks_hit as f64 / r.blocks_total.max(1) as f64,
        hit_rate_by_source: src.shares(),
        windows_from_pool: r.windows_from_pool,
        window_replays: r.window_replays,
        ssd: SsdReport {
            capacity_bytes: opts.ssd_capacity_bytes,
            store_capacity_bytes: store_capacity,
            segment_bytes: segment,
            retention_ms: opts.retention_ms,
            engine: engine.kind.name().to_owned(),
            direct: engine.direct,
            bytes_read: scale(r.ssd_read_bytes, ssd_scale),
            bytes_written: scale(st.bytes_written, ssd_scale),
            kv_bytes_written: scale(kv_written, ssd_scale),
            write_amplification: st.bytes_written as f64 / kv_written.max(1) as f64,
            units_written: r.units_written,
            units_refused_full: r.refused_full,
            units_refused_queue: st.refused_queue,
            units_failed: r.failed,
            evictions: st.units_evicted,
            expiries: st.units_evicted + past_retention,
            segments_compacted: st.segments_compacted,
            live_bytes_end: scale(st.live_bytes, ssd_scale),
            live_bytes_peak: r.peaks.0,
            read_gb_per_s: gb_per_s(r.ssd_read_bytes as f64, r.ssd_read_seconds),
            write_gb_per_s: gb_per_s(st.bytes_written as f64, r.write_seconds),
        },
        dram_pool: PoolReport {
            enabled: pool_enabled,
            capacity_bytes: opts.dram_pool_bytes,
            slot_bytes: r.geo.model_slot_bytes,
            slots: pool_slots,
            ttl_ms: opts.window_ttl_ms,
            bytes_read: scale(pool.bytes_got, pool_scale),
            bytes_written: scale(pool.bytes_put, pool_scale),
            puts: pool.puts,
            hits: pool.hits,
            misses: pool.misses,
            evictions: pool.evicted,
            expiries: pool.expired,
            peak_bytes: r.peaks.1,
            gb_per_s: gb_per_s(
                (pool.bytes_got + pool.bytes_put) as f64,
                (pool.put_nanos + pool.get_nanos) as f64 / 1e9,
            ),
        },
        dram_cache: CacheReport {
            capacity_bytes: opts.cache_bytes,
            capacity_tokens: cache_tokens,
            max_sequences: opts.max_sequences as u64,
            evictions: cache_evictions,
            live_dropped: r.live_dropped,
            requests_not_admitted: r.not_admitted,
            peak_in_use_bytes: r.peaks.2,
        },
        latency_ms: Latencies {
            lookup: Percentiles::of(&mut r.lat.lookup.clone()),
            restore_ssd: Percentiles::of(&mut r.lat.restore_ssd.clone()),
            restore_dram: Percentiles::of(&mut r.lat.restore_dram.clone()),
            admission: Percentiles::of(&mut r.lat.admission.clone()),
            persist: Percentiles::of(&mut r.persist_ms),
            flush: Percentiles::of(&mut r.flush_ms),
        },
        cost_model: CostReport {
            prefill_tokens_per_s: opts.prefill_tokens_per_s,
            prefill_rate_source: opts.prefill_rate_source.clone(),
            decode_tokens_per_s: opts.decode_tokens_per_s,
            prefill_seconds_without_tiers: r.prefill_without_s,
            prefill_seconds_with_tiers: r.prefill_with_s,
            prefill_seconds_saved: r.prefill_without_s - r.prefill_with_s,
            fraction_saved: (r.prefill_without_s - r.prefill_with_s)
                / r.prefill_without_s.max(1e-12),
            ttft_ms_without_tiers: Percentiles::of(&mut r.ttft_without),
            ttft_ms_with_tiers: Percentiles::of(&mut r.ttft_with),
        },
        seconds,
        trace_seconds: trace.span_ms() as f64 / 1e3,
        requests_per_s: requests as f64 / seconds.max(1e-9),
        speed: opts.speed,
        peak_rss_bytes: peak_rss,
        series,
        measured,
        modelled,
        notes,
        cluster,
        samples: std::mem::take(&mut r.lat),
    };
    let Replay {
        tiers,
        cache,
        parked,
        ..
    } = r;
    drop(cache);
    tiers.close()?;
    for n in parked.into_iter().flatten() {
        drop(n.cache);
        n.tiers.close()?;
    }
    Ok(report)
}
