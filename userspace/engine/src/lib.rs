//! The serving engine and the one API every face of kvstack drives.
//!
//! - [`Service`]: opens a model, the paged cache and the tiers from [`ServiceOptions`] and
//!   serves sessions of tenants through one [`Engine`]; `kvstack run` drives it today, the
//!   appliance daemon and the C ABI are to drive the same type.
//! - [`Engine`]: sessions, requests, chunked prefill, continuous batching of decode steps, the
//!   paged cache for live sequences, and prefix reuse through the tiers with bounded replay
//!   (spec §7, `docs/engine.md`).
//! - [`EngineStats`]: counters and time to first token by kind of reuse.
//!
//! Dependencies: the model (`kvstack-model`), the cache (`kvstack-cache`) and the tiers
//! (`kvstack-tiers`) below; nothing here knows about HTTP, C or the command line.

mod engine;
mod error;
mod service;
mod stats;

pub use engine::{Completion, Engine, EngineOptions, Event, RequestId, RequestSpec, SessionId};
pub use error::{Error, Result};
pub use service::{ModelSource, Service, ServiceOptions, ServiceReport, TtftLine};
pub use stats::{EngineStats, Reuse, ReuseKind, TtftMean, TtftSample};
