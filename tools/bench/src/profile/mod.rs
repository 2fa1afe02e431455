//! `kvstack profile`: request traces replayed end to end through the real tiers.
//!
//! [`replay()`] takes a trace ([`trace`]: the Mooncake JSONL format) and runs each request as
//! the engine admits one (`docs/engine.md`): the session's live sequence in the paged cache,
//! else `Tiers::lookup` and `Tiers::restore` (blocks mapped from the paged cache's prefix
//! index, the rest read from the SSD store with real `O_DIRECT` I/O and CRC checks, the window
//! from the DRAM pool or a bounded replay), then the rest "computed": synthetic KV in the
//! stored formats appended to the paged cache. Units are persisted where the engine persists
//! them (`Tiers::unit_points`: the end of each prompt and output, every 4096 tokens), with
//! window snapshots into the pool, and are durable before trace time moves on, so a replay is
//! deterministic. Trace time is an injected clock: TTLs and the retention hold in trace time
//! while the replay runs as fast as it can (or at `speed`). When prefills and outputs end is
//! modelled from token rates; so are the prefill times saved and the TTFTs (module
//! [`report`] says which figures are measured and which modelled).
//!
//! [`plan`] sizes the tiers for a workload from the cache arithmetic alone; [`plot`] draws
//! a report.

pub mod calibrate;
pub mod plan;
pub mod plot;
mod replay;
pub mod report;
pub mod tokens;
pub mod trace;

pub use replay::{ModelSpec, Progress, ReplayOptions, replay};
pub use report::ReplayReport;
pub use trace::{Trace, TraceRequest, parse_trace, parse_trace_str, read_trace};
