//! `GET /metrics`: Prometheus text exposition through `prometheus-client`. Counters are
//! updated where things happen (the engine thread, the HTTP handlers); the tiers' gauges are
//! read from the store and the pool at scrape time.

use std::sync::atomic::AtomicU64;

use kvstack_engine::{Reuse, Service};
use kvstack_tiers::Tiers;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels: tenant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// The tenant.
    pub tenant: String,
}

/// Labels: tenant and tier.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    /// The tenant.
    pub tenant: String,
    /// `live`, `paged_cache`, `ssd`, `dram_window`, `replayed`, `computed`.
    pub tier: String,
}

/// Labels: tenant and where a restored window came from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WindowLabel {
    /// The tenant.
    pub tenant: String,
    /// `dram` (this node's pool) or `redis_cluster` (the shared level).
    pub source: String,
}

/// Labels: tenant and outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// The tenant.
    pub tenant: String,
    /// `ok`, `failed`, `cancelled`, `timeout`, `rejected`.
    pub outcome: String,
}

/// Every metric of the daemon.
pub struct Metrics {
    registry: Registry,
    /// Context tokens served, by tier.
    pub tokens_by_tier: Family<TierLabel, Counter>,
    /// Generated tokens.
    pub generated: Family<TenantLabel, Counter>,
    /// Requests by outcome.
    pub requests: Family<OutcomeLabel, Counter>,
    /// Time to first token (seconds).
    pub ttft: Histogram,
    /// Time between tokens (seconds).
    pub inter_token: Histogram,
    /// Requests waiting for their first token.
    pub queue_depth: Gauge,
    /// Sequences live in the paged cache.
    pub running_sequences: Gauge,
    /// Paged-cache pages in use / committed-but-free.
    pub pages_used: Gauge,
    /// Pages the pools may still hand out.
    pub pages_free: Gauge,
    /// Named sessions open.
    pub sessions: Gauge,
    /// KV-cache API lookups and hits.
    pub kv_lookups: Family<TenantLabel, Counter>,
    /// KV-cache API lookups that found a prefix.
    pub kv_hits: Family<TenantLabel, Counter>,
    /// KV-cache API bytes read (get) and written (put).
    pub kv_bytes_read: Counter,
    /// KV-cache API bytes written.
    pub kv_bytes_written: Counter,
    /// Puts answered 202 (not durable) whose write failed afterwards.
    pub kv_put_failures: Counter,
    /// Windows restored from the window pool, by level.
    pub windows_restored: Family<WindowLabel, Counter>,
    /// Units fetched from peer nodes and stored here.
    pub peer_fetches: Counter,
    /// Peer fetches that failed (a miss).
    pub peer_fetch_failures: Counter,
    /// Frame bytes fetched from peers.
    pub peer_fetched_bytes: Counter,
    redis_up: Gauge,
    redis_puts: Gauge,
    redis_put_failures: Gauge,
    redis_gets: Gauge,
    redis_hits: Gauge,
    redis_misses: Gauge,
    redis_damaged: Gauge,
    redis_skipped: Gauge,
    redis_errors: Gauge,
    redis_incidents: Gauge,
    redis_bytes_put: Gauge,
    redis_bytes_got: Gauge,
    index_units: Gauge,
    index_unindexed: Gauge,
    index_removed: Gauge,
    index_failed: Gauge,
    index_dropped: Gauge,
    pool_bytes: Gauge,
    pool_entries: Gauge,
    pool_expired: Gauge,
    pool_evicted: Gauge,
    pool_hits: Gauge,
    pool_misses: Gauge,
    ssd_units: Gauge,
    ssd_bytes: Gauge,
    ssd_evicted: Gauge,
    ssd_quota_evicted: Gauge,
    ssd_quota_refused: Gauge,
    ssd_damaged: Gauge,
    ssd_backlog: Gauge,
    ssd_lookups: Gauge,
    ssd_hits: Gauge,
    ssd_bytes_written: Gauge,
    tenant_pool_bytes: Family<TenantLabel, Gauge>,
    tenant_pool_quota: Family<TenantLabel, Gauge>,
    tenant_ssd_bytes: Family<TenantLabel, Gauge>,
    tenant_ssd_quota: Family<TenantLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A registry with every metric, prefixed `kvstack_`.
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("kvstack");
        let buckets = || Histogram::new(exponential_buckets(0.0005, 2.0, 20));
        let m = Metrics {
            tokens_by_tier: Family::default(),
            generated: Family::default(),
            requests: Family::default(),
            ttft: buckets(),
            inter_token: buckets(),
            queue_depth: Gauge::default(),
            running_sequences: Gauge::default(),
            pages_used: Gauge::default(),
            pages_free: Gauge::default(),
            sessions: Gauge::default(),
            kv_lookups: Family::default(),
            kv_hits: Family::default(),
            kv_bytes_read: Counter::default(),
            kv_bytes_written: Counter::default(),
            kv_put_failures: Counter::default(),
            windows_restored: Family::default(),
            peer_fetches: Counter::default(),
            peer_fetch_failures: Counter::default(),
            peer_fetched_bytes: Counter::default(),
            redis_up: Gauge::default(),
            redis_puts: Gauge::default(),
            redis_put_failures: Gauge::default(),
            redis_gets: Gauge::default(),
            redis_hits: Gauge::default(),
            redis_misses: Gauge::default(),
            redis_damaged: Gauge::default(),
            redis_skipped: Gauge::default(),
            redis_errors: Gauge::default(),
            redis_incidents: Gauge::default(),
            redis_bytes_put: Gauge::default(),
            redis_bytes_got: Gauge::default(),
            index_units: Gauge::default(),
            index_unindexed: Gauge::default(),
            index_removed: Gauge::default(),
            index_failed: Gauge::default(),
            index_dropped: Gauge::default(),
            pool_bytes: Gauge::default(),
            pool_entries: Gauge::default(),
            pool_expired: Gauge::default(),
            pool_evicted: Gauge::default(),
            pool_hits: Gauge::default(),
            pool_misses: Gauge::default(),
            ssd_units: Gauge::default(),
            ssd_bytes: Gauge::default(),
            ssd_evicted: Gauge::default(),
            ssd_quota_evicted: Gauge::default(),
            ssd_quota_refused: Gauge::default(),
            ssd_damaged: Gauge::default(),
            ssd_backlog: Gauge::default(),
            ssd_lookups: Gauge::default(),
            ssd_hits: Gauge::default(),
            ssd_bytes_written: Gauge::default(),
            tenant_pool_bytes: Family::default(),
            tenant_pool_quota: Family::default(),
            tenant_ssd_bytes: Family::default(),
            tenant_ssd_quota: Family::default(),
            registry: Registry::default(),
        };
        r.register(
            "context_tokens",
            "Context tokens served, by tier",
            m.tokens_by_tier.clone(),
        );
        r.register("generated_tokens", "Tokens generated", m.generated.clone());
        r.register(
            "requests",
            "Completion requests by outcome",
            m.requests.clone(),
        );
        r.register("ttft_seconds", "Time to first token", m.ttft.clone());
        r.register(
            "inter_token_seconds",
            "Time between generated tokens",
            m.inter_token.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting for their first token",
            m.queue_depth.clone(),
        );
        r.register(
            "running_sequences",
            "Sequences live in the paged cache",
            m.running_sequences.clone(),
        );
        r.register(
            "paged_cache_pages_used",
            "Paged-cache pages in use",
            m.pages_used.clone(),
        );
        r.register(
            "paged_cache_pages_free",
            "Paged-cache pages still available",
            m.pages_free.clone(),
        );
        r.register("named_sessions", "Named sessions open", m.sessions.clone());
        r.register("kv_lookups", "KV-cache API lookups", m.kv_lookups.clone());
        r.register(
            "kv_hits",
            "KV-cache API lookups that found a prefix",
            m.kv_hits.clone(),
        );
        r.register(
            "kv_read_bytes",
            "KV-cache API bytes read",
            m.kv_bytes_read.clone(),
        );
        r.register(
            "kv_written_bytes",
            "KV-cache API bytes written",
            m.kv_bytes_written.clone(),
        );
        r.register(
            "kv_put_failures",
            "KV-cache API puts answered 202 (not durable) whose write failed afterwards",
            m.kv_put_failures.clone(),
        );
        r.register(
            "windows_restored",
            "Window snapshots restored, by tenant and pool level (dram, redis_cluster)",
            m.windows_restored.clone(),
        );
        r.register(
            "peer_fetches",
            "Units fetched from the node the shared prefix index names and stored here",
            m.peer_fetches.clone(),
        );
        r.register(
            "peer_fetch_failures",
            "Peer fetches that failed (served as a miss)",
            m.peer_fetch_failures.clone(),
        );
        r.register(
            "peer_fetched_bytes",
            "Frame bytes fetched from peer nodes",
            m.peer_fetched_bytes.clone(),
        );
        let redis: [(&str, &str, &Gauge); 17] = [
            (
                "redis_window_up",
                "1 while the window pool's Redis Cluster level answers (0 when down or not configured)",
                &m.redis_up,
            ),
            (
                "redis_window_puts",
                "Window snapshots written to Redis Cluster",
                &m.redis_puts,
            ),
            (
                "redis_window_put_failures",
                "Window snapshot writes to Redis Cluster that failed",
                &m.redis_put_failures,
            ),
            (
                "redis_window_gets",
                "Window snapshot gets and existence checks sent to Redis Cluster",
                &m.redis_gets,
            ),
            (
                "redis_window_hits",
                "Redis Cluster gets that returned a valid snapshot",
                &m.redis_hits,
            ),
            (
                "redis_window_misses",
                "Redis Cluster gets that returned no valid snapshot (absent, damaged or down)",
                &m.redis_misses,
            ),
            (
                "redis_window_damaged",
                "Redis Cluster values refused by their length, identity or CRC-32C check",
                &m.redis_damaged,
            ),
            (
                "redis_window_skipped",
                "Calls answered as misses without I/O while Redis Cluster was down",
                &m.redis_skipped,
            ),
            (
                "redis_window_errors",
                "Redis Cluster calls that failed",
                &m.redis_errors,
            ),
            (
                "redis_window_incidents",
                "Redis Cluster outages seen (runs of failures, each logged once)",
                &m.redis_incidents,
            ),
            (
                "cluster_index_units_indexed",
                "Units made durable whose shared prefix index entries Redis took",
                &m.index_units,
            ),
            (
                "cluster_index_units_unindexed",
                "Units evicted or deleted whose shared prefix index entries were removed",
                &m.index_unindexed,
            ),
            (
                "cluster_index_entries_removed",
                "Shared prefix index entries removed (they still named this node)",
                &m.index_removed,
            ),
            (
                "cluster_index_failed",
                "Shared prefix index updates Redis did not take (entries missing or left to expire)",
                &m.index_failed,
            ),
            (
                "cluster_index_dropped",
                "Shared prefix index updates dropped because the index thread's queue was full",
                &m.index_dropped,
            ),
            (
                "redis_window_put_bytes",
                "Snapshot bytes written to Redis Cluster",
                &m.redis_bytes_put,
            ),
            (
                "redis_window_got_bytes",
                "Snapshot bytes read from Redis Cluster",
                &m.redis_bytes_got,
            ),
        ];
        for (name, help, g) in redis {
            r.register(name, help, g.clone());
        }
        r.register(
            "dram_pool_bytes",
            "DRAM window pool committed bytes",
            m.pool_bytes.clone(),
        );
        r.register(
            "dram_pool_entries",
            "DRAM window pool snapshots",
            m.pool_entries.clone(),
        );
        r.register(
            "dram_pool_expired",
            "DRAM window pool snapshots expired",
            m.pool_expired.clone(),
        );
        r.register(
            "dram_pool_evicted",
            "DRAM window pool snapshots evicted",
            m.pool_evicted.clone(),
        );
        r.register(
            "dram_pool_hits",
            "DRAM window pool gets that hit",
            m.pool_hits.clone(),
        );
        r.register(
            "dram_pool_misses",
            "DRAM window pool gets that missed",
            m.pool_misses.clone(),
        );
        r.register("ssd_units", "SSD store units", m.ssd_units.clone());
        r.register(
            "ssd_live_bytes",
            "SSD store live record bytes",
            m.ssd_bytes.clone(),
        );
        r.register(
            "ssd_units_evicted",
            "SSD units evicted (past retention, or by their tenant's SSD quota)",
            m.ssd_evicted.clone(),
        );
        r.register(
            "ssd_quota_evicted_units",
            "SSD units evicted to keep their tenant within its SSD quota (counted in \
             ssd_units_evicted too)",
            m.ssd_quota_evicted.clone(),
        );
        r.register(
            "ssd_quota_refused_puts",
            "SSD unit writes refused by their tenant's SSD quota",
            m.ssd_quota_refused.clone(),
        );
        r.register(
            "ssd_crc_failures",
            "SSD block reads that found damage",
            m.ssd_damaged.clone(),
        );
        r.register(
            "ssd_write_backlog_bytes",
            "Payload bytes waiting to be written",
            m.ssd_backlog.clone(),
        );
        r.register("ssd_lookups", "SSD store lookups", m.ssd_lookups.clone());
        r.register(
            "ssd_hits",
            "SSD store lookups that found a block",
            m.ssd_hits.clone(),
        );
        r.register(
            "ssd_written_bytes",
            "SSD record bytes written",
            m.ssd_bytes_written.clone(),
        );
        r.register(
            "tenant_dram_pool_bytes",
            "DRAM window pool bytes a tenant's snapshots take (whole slots)",
            m.tenant_pool_bytes.clone(),
        );
        r.register(
            "tenant_dram_pool_quota_bytes",
            "A tenant's DRAM window pool quota (only tenants that have one)",
            m.tenant_pool_quota.clone(),
        );
        r.register(
            "tenant_ssd_bytes",
            "SSD bytes a tenant's KV blocks take (their records as laid out on disk)",
            m.tenant_ssd_bytes.clone(),
        );
        r.register(
            "tenant_ssd_quota_bytes",
            "A tenant's SSD quota (only tenants that have one)",
            m.tenant_ssd_quota.clone(),
        );
        Metrics { registry: r, ..m }
    }

    /// A finished request: its context tokens by tier and its generated tokens.
    pub fn completed(&self, tenant: &str, reuse: &Reuse, generated: u64) {
        let add = |tier: &str, n: u64| {
            if n > 0 {
                self.tokens_by_tier
                    .get_or_create(&TierLabel {
                        tenant: tenant.into(),
                        tier: tier.into(),
                    })
                    .inc_by(n);
            }
        };
        add("live", reuse.live_tokens);
        add("paged_cache", reuse.mapped_tokens);
        add("ssd", reuse.ssd_tokens);
        add("replayed", reuse.replayed_tokens);
        add("computed", reuse.computed_tokens);
        if reuse.window_from_pool {
            let source = if reuse.window_from_remote {
                "redis_cluster"
            } else {
                "dram"
            };
            self.windows_restored
                .get_or_create(&WindowLabel {
                    tenant: tenant.into(),
                    source: source.into(),
                })
                .inc();
        }
        self.generated
            .get_or_create(&TenantLabel {
                tenant: tenant.into(),
            })
            .inc_by(generated);
        self.request_done(tenant, "ok");
    }

    /// Counts a request's outcome.
    pub fn request_done(&self, tenant: &str, outcome: &str) {
        self.requests
            .get_or_create(&OutcomeLabel {
                tenant: tenant.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Gauges of the engine (set by the engine thread after each step).
    pub fn engine_gauges(&self, svc: &Service, sessions: usize) {
        let u = svc.engine().cache().usage();
        let used: u64 = u.pools.iter().map(|p| p.usage.pages_in_use).sum();
        let cap: u64 = u.pools.iter().map(|p| p.capacity_pages).sum();
        self.pages_used.set(to_i64(used));
        self.pages_free.set(to_i64(cap.saturating_sub(used)));
        self.running_sequences.set(to_i64(u.sequences));
        self.sessions.set(to_i64(sessions as u64));
    }

    /// The text exposition, with the tiers' gauges read now; `tenants` are the current
    /// config's tenant names, whose DRAM pool and SSD bytes (and quotas) are read per tenant.
    pub fn encode(
        &self,
        tiers: Option<&Tiers>,
        tenants: &[String],
        queue_depth: &AtomicU64,
    ) -> String {
        self.queue_depth.set(to_i64(
            queue_depth.load(std::sync::atomic::Ordering::Acquire),
        ));
        if let Some(t) = tiers {
            let p = t.pool().stats();
            self.pool_bytes.set(to_i64(p.committed_bytes));
            self.pool_entries.set(to_i64(p.entries));
            self.pool_expired.set(to_i64(p.expired));
            self.pool_evicted.set(to_i64(p.evicted));
            self.pool_hits.set(to_i64(p.hits));
            self.pool_misses.set(to_i64(p.misses));
            let s = t.store().stats();
            self.ssd_units.set(to_i64(s.units));
            self.ssd_bytes.set(to_i64(s.live_bytes));
            self.ssd_evicted.set(to_i64(s.units_evicted));
            self.ssd_quota_evicted.set(to_i64(s.quota_evicted));
            self.ssd_quota_refused.set(to_i64(s.refused_quota));
            self.ssd_damaged.set(to_i64(s.damaged_reads));
            self.ssd_backlog.set(to_i64(s.queued_bytes));
            self.ssd_lookups.set(to_i64(s.lookups));
            self.ssd_hits.set(to_i64(s.hits));
            self.ssd_bytes_written.set(to_i64(s.bytes_written));
            self.tenant_gauges(t, tenants);
            if let Some(r) = t.remote() {
                let s = r.stats();
                self.redis_up.set(i64::from(r.health().up));
                for (g, v) in [
                    (&self.redis_puts, s.puts),
                    (&self.redis_put_failures, s.put_failures),
                    (&self.redis_gets, s.gets),
                    (&self.redis_hits, s.hits),
                    (&self.redis_misses, s.misses),
                    (&self.redis_damaged, s.damaged),
                    (&self.redis_skipped, s.skipped),
                    (&self.redis_errors, s.errors),
                    (&self.redis_incidents, s.incidents),
                    (&self.redis_bytes_put, s.bytes_put),
                    (&self.redis_bytes_got, s.bytes_got),
                ] {
                    g.set(to_i64(v));
                }
            }
            if let Some(ix) = t.index_stats() {
                for (g, v) in [
                    (&self.index_units, ix.units_indexed),
                    (&self.index_unindexed, ix.units_unindexed),
                    (&self.index_removed, ix.entries_removed),
                    (&self.index_failed, ix.failed),
                    (&self.index_dropped, ix.dropped),
                ] {
                    g.set(to_i64(v));
                }
            }
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Metrics {
    /// Per-tenant gauges, rebuilt at each scrape so a tenant removed by `SIGHUP` (or a quota
    /// dropped) leaves no stale series behind.
    fn tenant_gauges(&self, t: &Tiers, tenants: &[String]) {
        for f in [
            &self.tenant_pool_bytes,
            &self.tenant_pool_quota,
            &self.tenant_ssd_bytes,
            &self.tenant_ssd_quota,
        ] {
            f.clear();
        }
        for name in tenants {
            let cache = kvstack_tiers::Tenant::new(name);
            let label = TenantLabel {
                tenant: name.clone(),
            };
            let set = |f: &Family<TenantLabel, Gauge>, v: u64| {
                f.get_or_create(&label).set(to_i64(v));
            };
            set(&self.tenant_pool_bytes, t.dram_bytes(&cache));
            set(&self.tenant_ssd_bytes, t.ssd_bytes(&cache));
            if let Some(q) = t.dram_quota(&cache) {
                set(&self.tenant_pool_quota, q);
            }
            if let Some(q) = t.ssd_quota(&cache) {
                set(&self.tenant_ssd_quota, q);
            }
        }
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
