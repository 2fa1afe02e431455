//! The paged KV cache of one model plan (spec §4-§7).
//!
//! [`KvCache`] stores, for every live sequence:
//! - the **global entries** (FP4, 288 B) and **indexer keys** (MXFP4, 68 B) of every KV source
//!   layer (2, 8, 14 at ratio 2 and 20 at ratio 1 in V4.1-Flash), in fixed-size pages of one
//!   pool per source and kind, reached through per-sequence block tables;
//! - a **window slab**: every layer's ring of the last `sliding_window` (128) FP8 rows;
//! - the **pending compressor state** of each ratio-2 source (the projections of a trailing
//!   incomplete group).
//!
//! Sequences are appended to (a prefill chunk or one decoded token, as already encoded entries:
//! [`AppendData`]), forked (all pages shared, copy-on-write of a partial tail page on the first
//! divergent write), truncated and dropped. Pages carry reference counts; a full page is never
//! written again, so it can be shared by any number of sequences and by the **prefix index**, a
//! radix tree over page-sized token blocks that lets a new sequence starting with a cached
//! prefix map the same pages instead of recomputing them
//! ([`KvCache::create_sequence_with_prefix`]).
//!
//! Attention reads through [`KvCache::global_entries`], [`KvCache::index_keys`] (resolved
//! through the plan's `kv_source`) and [`KvCache::window`]. [`KvCache::usage`] and
//! [`KvCache::sequence_usage`] account for every byte, allocated and in use, by kind.
//! `kvstack bench footprint` (crate `kvstack-bench`) measures the bytes per token of a real
//! V4.1-Flash-sized sequence through this API.
//!
//! Concurrency: mutation takes `&mut self`, reads take `&self`; a server shares the cache
//! behind a lock (many readers during attention, one writer between steps).
//!
//! Byte layouts, page geometry, COW and eviction rules are written out in
//! `docs/paged-cache.md`.

mod error;
mod geometry;
mod kv;
mod pool;
mod prefix;
mod usage;
mod view;

use std::fmt;

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;

pub use error::{Error, Result};
pub use geometry::{
    CacheGeometry, CacheOptions, DEFAULT_CONTEXT_LIMIT, DEFAULT_PAGE_TOKENS, SourceGeometry,
};
pub use kv::{AppendShape, KvCache, PrefixHit};
pub use pool::PageId;
pub use usage::{CacheUsage, KindUsage, MetadataUsage, PoolUsage, SequenceUsage};
pub use view::{EntryView, WindowView};

/// Identifies one sequence of a [`KvCache`]. Ids are never reused within a cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SequenceId(pub u64);

impl fmt::Display for SequenceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

/// What a page pool stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolKind {
    /// Compressed (global) KV entries, FP4 (spec §5.2).
    Global,
    /// Indexer keys, MXFP4 (spec §5.3).
    Index,
    /// Per-sequence window slabs: every layer's FP8 ring of `sliding_window` rows (spec §5.1).
    Window,
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolKind::Global => "global-entry",
            PoolKind::Index => "index-key",
            PoolKind::Window => "window",
        })
    }
}

/// Names one page pool: its kind and, for global and index pools, the KV source layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct PoolName {
    /// What the pool stores.
    pub kind: PoolKind,
    /// The KV source layer (`None` for the window pool, which serves every layer).
    pub layer: Option<usize>,
}

impl fmt::Display for PoolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layer {
            Some(l) => write!(f, "{} pool of layer {l}", self.kind),
            None => write!(f, "{} pool", self.kind),
        }
    }
}

/// The encoded data of `n = tokens.len()` new tokens of one sequence of length `T`
/// ([`KvCache::append`]). Counts are checked exactly ([`KvCache::append_shape`] computes them):
///
/// - `global[i]`, `index[i]` for the `i`-th KV source (layer order, [`CacheGeometry::sources`])
///   of ratio `m`: the entries of the groups that complete, `floor((T + n) / m) - floor(T / m)`
///   of them (spec §4: an incomplete trailing group has no entry yet);
/// - `window`: FP8 rows of the chunk's last `k` tokens for every layer, layer-major (layer `l`'s
///   rows at `[l * k, (l + 1) * k)`), `0 <= k <= min(n, sliding_window)`. With `k < n` the
///   window restarts at token `T + n - k` (a prefill chunk whose earlier rows are never needed;
///   a decode step gives `k = n = 1`);
/// - `pending[i]`: the compressor state after the append for source `i`: the `wkv` then `wgate`
///   projections (f32, `2 * head_dim` per token) of the `(T + n) mod m` tokens of the incomplete
///   group; empty for ratio-1 sources.
#[derive(Clone, Debug, Default)]
pub struct AppendData<'a> {
    /// Token ids of the new tokens (they key completed blocks in the prefix index).
    pub tokens: &'a [u32],
    /// New global entries per KV source.
    pub global: Vec<&'a [GlobalFp4Entry]>,
    /// New indexer keys per KV source.
    pub index: Vec<&'a [IndexMxfp4Entry]>,
    /// Window rows of the last `k` new tokens, layer-major.
    pub window: &'a [WindowFp8Entry],
    /// Pending compressor state per KV source after the append.
    pub pending: Vec<&'a [f32]>,
}
