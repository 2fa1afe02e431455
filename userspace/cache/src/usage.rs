//! Accounting: bytes allocated and bytes in use, by kind and per sequence.

use serde::Serialize;

use super::PoolName;
use super::SequenceId;

/// Bytes of one kind of cache memory.
///
/// - `allocated_bytes`: memory the cache holds from the operating system for this kind
///   (committed pool memory, or heap capacity for pending state).
/// - `in_use_bytes`: the part of it referenced by a sequence or the prefix index (whole pages).
/// - `entry_bytes`: bytes of valid entries inside the pages in use (a page shared by several
///   holders counts once, with the most entries any holder sees).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KindUsage {
    /// Bytes held from the operating system.
    pub allocated_bytes: u64,
    /// Bytes of pages (or buffers) referenced.
    pub in_use_bytes: u64,
    /// Bytes of valid entries.
    pub entry_bytes: u64,
    /// Pages committed (the pools' watermarks); sequences for pending state.
    pub pages_allocated: u64,
    /// Pages referenced.
    pub pages_in_use: u64,
}

impl KindUsage {
    pub(crate) fn add(&mut self, o: &KindUsage) {
        self.allocated_bytes += o.allocated_bytes;
        self.in_use_bytes += o.in_use_bytes;
        self.entry_bytes += o.entry_bytes;
        self.pages_allocated += o.pages_allocated;
        self.pages_in_use += o.pages_in_use;
    }
}

/// One pool's numbers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PoolUsage {
    /// The pool.
    pub pool: PoolName,
    /// Bytes per page.
    pub page_bytes: u64,
    /// Entries per page.
    pub page_entries: u64,
    /// The most pages the pool may hold.
    pub capacity_pages: u64,
    /// Address space reserved (not memory).
    pub reserved_bytes: u64,
    /// Committed bytes that are locked in memory.
    pub locked_bytes: u64,
    /// Committed bytes backed by transparent huge pages (as reported by `MADV_COLLAPSE`).
    pub huge_page_bytes: u64,
    /// Allocated / in use / entries.
    pub usage: KindUsage,
}

/// Heap bytes of the cache's own bookkeeping. Vectors are counted by capacity; hash-map and
/// B-tree entries are estimated at key + value + 8 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MetadataUsage {
    /// Block tables of every sequence.
    pub block_tables: u64,
    /// Token ids kept per sequence beyond its prefix-index chain (all of them without a prefix
    /// index); the chain's tokens are the prefix index's keys.
    pub token_ids: u64,
    /// The prefix index (nodes, keys, child maps, LRU set).
    pub prefix_index: u64,
    /// The pools' reference counts and free sets.
    pub pools: u64,
    /// Sequence records and the sequence map.
    pub sequences: u64,
}

impl MetadataUsage {
    /// Sum of the parts.
    pub fn total(&self) -> u64 {
        self.block_tables + self.token_ids + self.prefix_index + self.pools + self.sequences
    }
}

/// The whole cache's accounting ([`super::KvCache::usage`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CacheUsage {
    /// Live sequences.
    pub sequences: u64,
    /// Sum of their lengths in tokens.
    pub tokens: u64,
    /// Blocks in the prefix index.
    pub prefix_blocks: u64,
    /// Global (compressed KV) entries, all sources.
    pub global: KindUsage,
    /// Indexer keys, all sources.
    pub index: KindUsage,
    /// Window slabs (one per live sequence).
    pub window: KindUsage,
    /// Pending compressor state (heap buffers of `ratio - 1` tokens per ratio > 1 source and
    /// sequence).
    pub pending: KindUsage,
    /// Bookkeeping.
    pub metadata: MetadataUsage,
    /// Every pool, global and index pools in source order, then the window pool.
    pub pools: Vec<PoolUsage>,
}

impl CacheUsage {
    /// Allocated bytes of the persistent cache: global entries + index keys.
    pub fn persistent_allocated_bytes(&self) -> u64 {
        self.global.allocated_bytes + self.index.allocated_bytes
    }

    /// Bytes of valid persistent entries: global entries + index keys.
    pub fn persistent_entry_bytes(&self) -> u64 {
        self.global.entry_bytes + self.index.entry_bytes
    }

    /// Everything allocated: pools, pending state and metadata.
    pub fn total_allocated_bytes(&self) -> u64 {
        self.persistent_allocated_bytes()
            + self.window.allocated_bytes
            + self.pending.allocated_bytes
            + self.metadata.total()
    }
}

/// One sequence's accounting ([`super::KvCache::sequence_usage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SequenceUsage {
    /// The sequence.
    pub seq: SequenceId,
    /// Its length in tokens.
    pub tokens: u64,
    /// Bytes of its global entries (`floor(tokens / ratio) * 288` per source).
    pub global_entry_bytes: u64,
    /// Bytes of its indexer keys (`floor(tokens / ratio) * 68` per source).
    pub index_entry_bytes: u64,
    /// Pages in its block tables (global and index).
    pub pages: u64,
    /// Of those, pages also referenced by another sequence or the prefix index.
    pub shared_pages: u64,
    /// Bytes of the pages in its block tables.
    pub page_bytes: u64,
    /// Bytes of the pages only it references (freed when it is dropped).
    pub exclusive_page_bytes: u64,
    /// Bytes of its window slab (`layers * window * 528`).
    pub window_bytes: u64,
    /// Window rows valid at the last layer (the same at every layer).
    pub window_rows: u64,
    /// Bytes of its pending-state buffers.
    pub pending_bytes: u64,
    /// Bytes of its block tables and token ids.
    pub metadata_bytes: u64,
}

impl SequenceUsage {
    /// The per-sequence constant: window slab + pending-state buffers.
    pub fn per_sequence_bytes(&self) -> u64 {
        self.window_bytes + self.pending_bytes
    }
}
