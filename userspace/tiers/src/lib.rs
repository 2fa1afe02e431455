//! Tiered persistence of the KV cache (spec §7): an SSD store for global KV and a DRAM pool
//! for window KV.
//!
//! - [`store`]: [`SsdStore`], content-addressed blocks of global KV in segments on an SSD
//!   (a directory of segment files, a preallocated file or a raw block device), written by a
//!   write-behind thread through the `kvstack-driver` block I/O engine, recovered on open,
//!   retained at least 72 hours after last use, compacted, read under leases.
//! - [`window_pool`]: [`WindowPool`], window-KV snapshots in pinned DRAM (10% of RAM by default) with
//!   a TTL and LRU eviction.
//! - [`redis_pool`]: [`RedisPool`], the window pool's second level on Redis Cluster, shared by
//!   the nodes of a deployment (`docs/cluster.md`); [`shared_index`]: which node holds which
//!   unit, on the same cluster.
//! - [`unit`](mod@unit): [`Tiers`], the prefix units the runtime persists and looks up:
//!   building block payloads from the paged cache, restoring them into it, the window snapshot
//!   or the bounded replay that a global hit needs.
//! - [`external`]: units as bytes in their stored formats, for engines outside kvstack
//!   ([`UnitData`], [`Tiers::read_unit`], [`Tiers::read_unit_with`], [`Tiers::write_unit`]).
//! - [`clock`]: injected time, so retention and TTL rules are tested instantly.
//!
//! The on-disk bytes are drawn in `docs/ssd-format.md`; the rules in `docs/tiers.md`.

pub mod clock;
mod error;
pub mod external;
pub mod fsck;
pub mod key;
pub mod redis_pool;
mod scan;
mod segment;
pub mod shared_index;
pub mod store;
pub mod unit;
pub mod window_pool;

pub use clock::{Clock, HOUR_MS, ManualClock, SystemClock};
pub use error::{Error, Result};
pub use external::{Pinned, UnitData, UnitRead};
pub use key::{ModelFingerprint, Tenant};
pub use redis_pool::{RedisOptions, RedisPool, RemoteHealth, RemoteStats};
pub use scan::Damage;
pub use segment::{NamespaceLocation, StoreLocation};
pub use store::{
    BlockSource, DeleteOutcome, DeleteTicket, ReadOutcome, ReclaimReport, RecoveryReport, SsdStore,
    StoreHit, StoreHooks, StoreOptions, StoreStats, UnitEvent, UnitTicket, UnitWrite,
};
pub use unit::{Restored, TierHit, TierOptions, Tiers};
pub use window_pool::{PoolOptions, PoolStats, WindowPool};
