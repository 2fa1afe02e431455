//! The tiers' errors: the SSD store, the DRAM window pool and the prefix units.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the SSD store, the window pool and the prefix units.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file operation of the tiers failed.
    #[error("{what} {}", path.display())]
    Io {
        /// What was being done (`cannot open segment`, ...).
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error (errno kept).
        #[source]
        source: std::io::Error,
    },

    /// Bringing up the NVMe controller of a namespace location failed.
    #[error("NVMe namespace {location}")]
    Nvme {
        /// The location (`vfio:<pci-address>`).
        location: String,
        /// The driver's error.
        #[source]
        source: kvstack_driver::Error,
    },

    /// Pinned memory or a buffer pool of the tiers could not be set up.
    #[error("cannot set up pinned memory")]
    Memory(#[source] kvstack_driver::Error),

    /// An option of the tiers is out of range.
    #[error("invalid option `{field}`: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// Another process holds the data location (a second writer would lose the first one's
    /// acknowledged units; a writer cannot start while a reader holds it either).
    #[error("{what} {} is in use by {holders}", path.display())]
    InUse {
        /// `data directory` or `store device`.
        what: &'static str,
        /// The location.
        path: PathBuf,
        /// Who holds it: `pid P (command, for N s)`, from `/proc/locks` and the owner file.
        holders: String,
    },

    /// The data location could not be opened or locked.
    #[error("cannot lock the store location")]
    Lock(#[source] kvstack_driver::Error),

    /// The store was opened read-only.
    #[error("the store is open read-only")]
    ReadOnly,

    /// A pin was refused: as many pins as allowed are held already.
    #[error("too many pins: at most {limit} are held at once")]
    TooManyPins {
        /// The limit.
        limit: usize,
    },

    /// A write was refused: no space is free and nothing may be reclaimed (every block is
    /// younger than the retention period, or too live to compact). Counted in the stats.
    #[error(
        "store full: {needed} bytes needed and nothing may be reclaimed (every block is within \
         its retention period)"
    )]
    StoreFull {
        /// Bytes the write needed.
        needed: u64,
    },

    /// A unit write was refused: its tenant's SSD byte quota cannot hold its new blocks even
    /// after the tenant's own unpinned units made way. Counted in the stats.
    #[error(
        "SSD quota exceeded: the tenant keeps {used} bytes, the unit needs up to {needed} more, \
         the quota is {quota} (what is left is pinned or being written)"
    )]
    QuotaExceeded {
        /// Bytes the tenant keeps.
        used: u64,
        /// Bytes the unit's new blocks may take.
        needed: u64,
        /// The tenant's quota.
        quota: u64,
    },

    /// The write-behind queue is full: persisting was refused rather than block the caller.
    /// Counted in the stats.
    #[error("write-behind queue full ({queued} bytes queued, limit {limit})")]
    QueueFull {
        /// Bytes queued.
        queued: u64,
        /// The limit.
        limit: u64,
    },

    /// An earlier write or `fdatasync` failed; the store no longer trusts its files for
    /// writing (reads of data made durable before continue).
    #[error("writes disabled after an I/O failure: {reason}")]
    Poisoned {
        /// The failure.
        reason: String,
    },

    /// A unit write failed.
    #[error("unit write failed: {reason}")]
    WriteFailed {
        /// Why.
        reason: String,
    },

    /// A unit is longer than the store's records can describe.
    #[error("unit of {blocks} blocks exceeds the limit of {max}")]
    UnitTooLong {
        /// Blocks of the unit.
        blocks: usize,
        /// The configured limit.
        max: usize,
    },

    /// A block payload larger than the store's I/O buffers.
    #[error("block payload of {bytes} bytes exceeds the limit of {max}")]
    BlockTooLarge {
        /// The payload size.
        bytes: usize,
        /// The configured limit.
        max: usize,
    },

    /// A unit whose length is not a multiple of the largest compress ratio (spec §8).
    #[error("unit of {tokens} tokens is not a multiple of {align} tokens")]
    Unaligned {
        /// Tokens of the unit.
        tokens: u64,
        /// The required multiple.
        align: u64,
    },

    /// A unit that is empty or longer than the sequence it is cut from.
    #[error("a unit of {tokens} tokens does not fit a sequence of {len}")]
    UnitRange {
        /// Tokens asked for.
        tokens: u64,
        /// The sequence's length.
        len: u64,
    },

    /// The store has shut down.
    #[error("the store is closed")]
    Closed,

    /// A location that is not a store or cannot hold one.
    #[error("{}: {reason}", path.display())]
    Location {
        /// The directory or device.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A block payload does not match the model's geometry.
    #[error("block {block} of {tokens} tokens: {reason}")]
    Payload {
        /// Block index in the unit.
        block: usize,
        /// Tokens of the block.
        tokens: u64,
        /// What does not match.
        reason: String,
    },

    /// The store's own bookkeeping is inconsistent (a bug; found by
    /// [`crate::SsdStore::check_index`]).
    #[error("internal store invariant violated: {what}")]
    Internal {
        /// Which invariant, and where.
        what: String,
    },

    /// A paged-cache operation failed during persist or restore (the source is the cache's
    /// error).
    #[error("paged cache")]
    Cache(#[source] kvstack_cache::Error),

    /// The Redis Cluster level of the window pool cannot be set up (its seed node URLs).
    /// Failures while running are misses, not errors (`docs/cluster.md`).
    #[error("redis cluster: {what}")]
    Redis {
        /// What failed.
        what: &'static str,
        /// The client's error.
        #[source]
        source: redis::RedisError,
    },

    /// The tiers cannot use the model's config (the source is the config or plan error).
    #[error("model config")]
    Config(#[source] kvstack_spec::Error),
}

impl Error {
    /// [`Error::Io`]: a file operation of the tiers failed.
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Error {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
