//! `kvstack profile plan`: the DRAM and SSD capacity and the SSD write bandwidth a workload
//! needs, from the cache arithmetic of a model (`kvstack calc`) and the store's record format.
//! Nothing is measured or tabled.
//!
//! Workload: `sessions` active at once, each of `turns_per_session` turns at `turns_per_hour`,
//! its context growing to `context_tokens`. Then (Little's law, arrival rate x residence time):
//! - a session lives `turns_per_session / turns_per_hour` hours and stays on SSD `retention`
//!   after its last turn, so `sessions x (1 + retention / lifetime)` sessions' contexts are
//!   stored, each `context x bytes per token x record overhead` (units of a session share
//!   their blocks);
//! - every context byte is written once over a session's life: the SSD write rate is
//!   `sessions x context x bytes per token x overhead / lifetime`;
//! - every turn puts two window snapshots (end of prompt, end of output) that live `ttl`:
//!   `sessions x turns_per_hour x 2 x ttl` are held; a hit needs only each session's latest,
//!   `sessions x min(1, turns_per_hour x ttl)`;
//! - live sequences of every session in the paged cache: `sessions x (context x bytes per
//!   token + per-sequence bytes)`.

use kvstack_firmware_interface::record::record_len;
use kvstack_spec::{CacheReport, FormatOverrides, ModelConfig};
use serde::Serialize;

use crate::{Error, Result};

/// A workload to size for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PlanInput {
    /// Sessions active at once.
    pub sessions: u64,
    /// Context a session reaches, tokens.
    pub context_tokens: u64,
    /// Turns per session per hour.
    pub turns_per_hour: f64,
    /// Turns of a session over its life.
    pub turns_per_session: u64,
    /// DRAM window TTL, seconds.
    pub window_ttl_s: f64,
    /// SSD retention after last use, hours.
    pub retention_h: f64,
}

/// What a workload needs of one model's tiers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// The model.
    pub model: String,
    /// Its persistent bytes per token.
    pub bytes_per_token: f64,
    /// Its per-sequence bytes (window and pending state: one snapshot).
    pub snapshot_bytes: u64,
    /// SSD bytes per KV byte (record headers and padding of 256-token blocks).
    pub record_overhead: f64,
    /// Hours a session is active.
    pub session_hours: f64,
    /// Sessions whose contexts are on SSD at once.
    pub stored_sessions: f64,
    /// SSD capacity needed, bytes.
    pub ssd_bytes: f64,
    /// SSD write bandwidth, bytes per second (mean).
    pub ssd_write_bytes_per_s: f64,
    /// Window snapshots held for their TTL.
    pub pool_snapshots: f64,
    /// DRAM pool bytes holding every snapshot for its TTL.
    pub dram_pool_bytes: f64,
    /// DRAM pool bytes holding each session's latest snapshot within its TTL.
    pub dram_pool_latest_bytes: f64,
    /// Paged cache bytes of every session's live sequence.
    pub live_cache_bytes: f64,
}

/// Sizes the tiers of `cfg` (named `name`) for `input` (module docs).
///
/// # Errors
/// [`Error::InvalidOption`] for zero turns or sessions; the config's arithmetic errors.
pub fn plan(name: &str, cfg: &ModelConfig, input: &PlanInput) -> Result<Plan> {
    if input.turns_per_hour <= 0.0 || input.turns_per_session == 0 || input.sessions == 0 {
        return Err(Error::InvalidOption {
            field: "plan",
            reason: "sessions, turns per hour and turns per session must be positive".into(),
        });
    }
    let calc = CacheReport::compute(cfg, &FormatOverrides::default())?;
    let bpt = calc.persistent_bytes_per_token;
    let block_kv = (bpt * 256.0).ceil() as u64;
    let record_overhead = record_len(block_kv + 4 * 256) as f64 / block_kv.max(1) as f64;
    let lifetime_h = input.turns_per_session as f64 / input.turns_per_hour;
    let n = input.sessions as f64;
    let context_bytes = input.context_tokens as f64 * bpt * record_overhead;
    let stored = n * (1.0 + input.retention_h / lifetime_h);
    let snapshot = if calc.window_bytes > 0 {
        (calc.per_sequence_bytes + 32).next_multiple_of(4096)
    } else {
        0
    };
    let ttl_h = input.window_ttl_s / 3600.0;
    let snapshots = n * input.turns_per_hour * 2.0 * ttl_h;
    Ok(Plan {
        model: name.to_owned(),
        bytes_per_token: bpt,
        snapshot_bytes: snapshot,
        record_overhead,
        session_hours: lifetime_h,
        stored_sessions: stored,
        ssd_bytes: stored * context_bytes,
        ssd_write_bytes_per_s: n * context_bytes / (lifetime_h * 3600.0),
        pool_snapshots: snapshots,
        dram_pool_bytes: snapshots * snapshot as f64,
        dram_pool_latest_bytes: n * (input.turns_per_hour * ttl_h).min(1.0) * snapshot as f64,
        live_cache_bytes: n * (input.context_tokens as f64 * bpt + calc.per_sequence_bytes as f64),
    })
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: f64| format!("{:.2} GB", b / 1e9);
        writeln!(
            f,
            "{} ({} B/token, {} B per window snapshot, SSD records {:.4} x KV)",
            self.model, self.bytes_per_token, self.snapshot_bytes, self.record_overhead
        )?;
        writeln!(
            f,
            "  sessions live {:.2} h; {:.0} sessions' contexts on SSD at once",
            self.session_hours, self.stored_sessions
        )?;
        writeln!(f, "  SSD capacity        {}", gb(self.ssd_bytes))?;
        writeln!(
            f,
            "  SSD write bandwidth {:.1} MB/s (mean)",
            self.ssd_write_bytes_per_s / 1e6
        )?;
        writeln!(
            f,
            "  DRAM window pool    {} ({:.0} snapshots for their TTL); {} for each session's latest",
            gb(self.dram_pool_bytes),
            self.pool_snapshots,
            gb(self.dram_pool_latest_bytes)
        )?;
        writeln!(
            f,
            "  paged cache (every session live) {}",
            gb(self.live_cache_bytes)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_follows_the_arithmetic() {
        let cfg = kvstack_spec::builtin::default_config().unwrap();
        let input = PlanInput {
            sessions: 1000,
            context_tokens: 100_000,
            turns_per_hour: 6.0,
            turns_per_session: 6,
            window_ttl_s: 300.0,
            retention_h: 72.0,
        };
        let p = plan("v4.1", &cfg, &input).unwrap();
        assert_eq!(p.bytes_per_token, 890.0);
        // 256 x 890 B of KV + 1 KiB of token ids in a 233,472-byte record.
        assert!((p.record_overhead - 233_472.0 / 227_840.0).abs() < 1e-12);
        assert!((p.session_hours - 1.0).abs() < 1e-12);
        assert!((p.stored_sessions - 73_000.0).abs() < 1e-6);
        let per = 100_000.0 * 890.0 * p.record_overhead;
        assert!((p.ssd_bytes - 73_000.0 * per).abs() < 1.0);
        assert!((p.ssd_write_bytes_per_s - 1000.0 * per / 3600.0).abs() < 1e-3);
        // 6 turns/h x 2 snapshots x 5 min = 1 snapshot per session held.
        assert!((p.pool_snapshots - 1000.0).abs() < 1e-9);
        assert!(p.dram_pool_latest_bytes <= p.dram_pool_bytes);
    }
}
