//! What the engine counts: where each request's context came from, throughput, time to first
//! token by kind of reuse.

use std::time::Duration;

use serde::Serialize;

/// Where a request's context came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub enum ReuseKind {
    /// Nothing reused: every token computed.
    #[default]
    None,
    /// The session's live sequence.
    Live,
    /// A unit from the tiers, with its window from the DRAM pool.
    TiersWithWindow,
    /// A unit from the tiers without a window: bounded replay (spec §7).
    TiersReplay,
}

impl ReuseKind {
    /// Every kind, in report order.
    pub const ALL: [ReuseKind; 4] = [
        ReuseKind::None,
        ReuseKind::Live,
        ReuseKind::TiersWithWindow,
        ReuseKind::TiersReplay,
    ];

    /// A short label.
    pub fn label(self) -> &'static str {
        match self {
            ReuseKind::None => "computed from scratch",
            ReuseKind::Live => "live session",
            ReuseKind::TiersWithWindow => "tiers, window from DRAM",
            ReuseKind::TiersReplay => "tiers, window replayed",
        }
    }
}

/// Where one request's context tokens came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Reuse {
    /// The kind.
    pub kind: ReuseKind,
    /// Tokens held by the session's live sequence.
    pub live_tokens: u64,
    /// Tokens mapped from blocks the paged cache still held (no I/O).
    pub mapped_tokens: u64,
    /// Tokens whose global KV was read from SSD.
    pub ssd_tokens: u64,
    /// Bytes read from SSD.
    pub ssd_bytes: u64,
    /// Whether the window came from the window pool (either level).
    pub window_from_pool: bool,
    /// Whether it came from the pool's Redis Cluster level (another node put it).
    pub window_from_remote: bool,
    /// Cached tokens run again to rebuild the window.
    pub replayed_tokens: u64,
    /// New tokens computed by the prefill.
    pub computed_tokens: u64,
    /// Time of the lookup and restore.
    #[serde(skip)]
    pub restore_time: Duration,
}

/// Counters of an engine.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    /// Requests finished.
    pub requests: u64,
    /// Requests failed.
    pub failed: u64,
    /// Requests cancelled ([`crate::Engine::cancel`]).
    pub cancelled: u64,
    /// Context tokens of admitted requests.
    pub context_tokens: u64,
    /// Of those: from live sessions.
    pub live_tokens: u64,
    /// From the paged cache's blocks (mapped after a tier hit).
    pub mapped_tokens: u64,
    /// From SSD.
    pub ssd_tokens: u64,
    /// Bytes read from SSD.
    pub ssd_bytes: u64,
    /// Windows restored from the DRAM pool.
    pub pool_windows: u64,
    /// Tokens replayed.
    pub replayed_tokens: u64,
    /// Tokens computed by prefills (not counting replays).
    pub computed_tokens: u64,
    /// Rows run by prefill steps (computed plus replayed).
    pub prefill_rows: u64,
    /// Prefill steps.
    pub prefill_steps: u64,
    /// Time in prefill rows (a mixed step's time is split by rows).
    pub prefill_time: Duration,
    /// Tokens decoded.
    pub decode_tokens: u64,
    /// Steps with decode rows.
    pub decode_steps: u64,
    /// Decode rows summed over those steps (mean batch = this / steps).
    pub decode_batch_rows: u64,
    /// Time in decode rows.
    pub decode_time: Duration,
    /// Units persisted.
    pub units_persisted: u64,
    /// Units the tiers refused or failed to take.
    pub persist_failures: u64,
    /// Restores cut short by a damaged block.
    pub damaged_restores: u64,
    /// Tokens of finished requests' sequences.
    pub finished_tokens: u64,
    /// Bytes of their global entries and indexer keys (measured bytes/token = this /
    /// `finished_tokens`).
    pub finished_entry_bytes: u64,
    /// Time to first token of every request that has one.
    pub ttft: Vec<TtftSample>,
}

/// One request's time to first token, split into waiting and being served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TtftSample {
    /// Where its context came from.
    pub kind: ReuseKind,
    /// Arrival to first token.
    pub total: Duration,
    /// Of that, waiting: for admission (a sequence to free up, earlier requests to be
    /// admitted), then for its first prefill step while older requests held the prefill slot.
    pub queued: Duration,
}

impl TtftSample {
    /// Of the total, the request's own work: its lookup and restore, its prefill steps (with
    /// the decode rows batched into them) and the sampling of its first token.
    pub fn service(&self) -> Duration {
        self.total.saturating_sub(self.queued)
    }
}

/// Means of the time to first token of one kind of reuse ([`EngineStats::mean_ttft`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TtftMean {
    /// Requests of that kind.
    pub requests: usize,
    /// Mean arrival to first token.
    pub total: Duration,
    /// Mean waiting ([`TtftSample::queued`]).
    pub queued: Duration,
    /// Mean service ([`TtftSample::service`]).
    pub service: Duration,
}

impl EngineStats {
    pub(super) fn add_reuse(&mut self, r: &Reuse, context: u64) {
        self.context_tokens += context;
        self.live_tokens += r.live_tokens;
        self.mapped_tokens += r.mapped_tokens;
        self.ssd_tokens += r.ssd_tokens;
        self.ssd_bytes += r.ssd_bytes;
        self.pool_windows += u64::from(r.window_from_pool);
        self.replayed_tokens += r.replayed_tokens;
        self.computed_tokens += r.computed_tokens;
    }

    pub(super) fn record_ttft(&mut self, sample: TtftSample) {
        self.ttft.push(sample);
    }

    /// Mean time to first token of requests of `kind` (with its queueing and service parts),
    /// `None` when there were none.
    pub fn mean_ttft(&self, kind: ReuseKind) -> Option<TtftMean> {
        let v: Vec<&TtftSample> = self.ttft.iter().filter(|s| s.kind == kind).collect();
        let n = u32::try_from(v.len()).ok().filter(|&n| n > 0)?;
        let total: Duration = v.iter().map(|s| s.total).sum();
        let queued: Duration = v.iter().map(|s| s.queued).sum();
        Some(TtftMean {
            requests: v.len(),
            total: total / n,
            queued: queued / n,
            service: total.saturating_sub(queued) / n,
        })
    }

    /// Prefill rows per second.
    pub fn prefill_rate(&self) -> f64 {
        self.prefill_rows as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Decoded tokens per second.
    pub fn decode_rate(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}
