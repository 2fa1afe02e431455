//! Prefix units: what the runtime persists and finds again (spec §7, §8).
//!
//! A **unit** is a token prefix of one tenant whose global KV is stored on SSD, as a chain of
//! blocks of one page (`page_tokens`, 256) each; the last may be shorter, since a unit ends
//! where it was persisted (a multiple of the largest compress ratio, 2). Units are persisted,
//! as the DeepSeek API does, at the end of each prompt and each output and every
//! `unit_interval_tokens` (4096) tokens of a long input ([`Tiers::unit_points`]). When a unit
//! is persisted at the end of a sequence, its window (every layer's last 128 FP8 rows plus the
//! pending compressor state) goes to the DRAM pool under the unit's key.
//!
//! [`Tiers::lookup`] returns the longest stored prefix (ending at a block end) and whether a
//! window snapshot exists exactly there. [`Tiers::restore`] rebuilds the prefix in a
//! [`KvCache`]: blocks the cache's own prefix index still holds are mapped without I/O, the
//! rest are read from SSD and appended; the window comes from the snapshot, or, on a global
//! hit without one, the result says which tokens the runtime must replay (spec §7 bounded
//! replay: the last 128 tokens of the prefix, regenerating window KV only).
//!
//! Block payload (`docs/ssd-format.md`): for each KV source in layer order, its global entries
//! of the block's tokens (`tokens / ratio` x 288 bytes), then its indexer keys (x 68 bytes).

use std::collections::HashMap;
use std::sync::Arc;

use kvstack_firmware_interface::record::{KEY_BYTES, Key};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;
use zerocopy::{FromBytes, IntoBytes};

use crate::clock::Clock;
use crate::key::{ModelFingerprint, Tenant};
use crate::redis_pool::{RedisOptions, RedisPool, SnapshotId};
use crate::shared_index::{IndexStats, Indexer};
use crate::store::{
    BlockSource, ReadOutcome, SsdStore, StoreHit, StoreOptions, UnitTicket, UnitWrite,
};
use crate::window_pool::{PoolOptions, WindowPool};
use crate::{Error, Result};
use kvstack_cache::{AppendData, CacheGeometry, KvCache, SequenceId};
use kvstack_spec::config::ModelConfig;

/// Default interval of units within a long input, in tokens.
pub const DEFAULT_UNIT_INTERVAL: u64 = 4096;

/// Magic of a window snapshot in the pool.
const SNAPSHOT_MAGIC: [u8; 8] = *b"KVWSNAP1";
const SNAPSHOT_HEADER: usize = 32;

/// Options of [`Tiers::open`].
#[derive(Clone, Debug)]
pub struct TierOptions {
    /// The SSD store.
    pub store: StoreOptions,
    /// The DRAM pool (its slot size is set from the model by [`Tiers::open`]).
    pub pool: PoolOptions,
    /// The window pool's second level on Redis Cluster, shared by a deployment's nodes
    /// (`docs/cluster.md`); `None`: the DRAM pool alone. Its snapshots live the DRAM pool's
    /// TTL.
    pub remote: Option<RedisOptions>,
    /// A unit every this many tokens of a long input.
    pub unit_interval_tokens: u64,
    /// Identity of the model's weights, mixed into the model fingerprint
    /// ([`ModelFingerprint::with_weights`]); empty: the config alone.
    pub weights_id: Vec<u8>,
}

impl TierOptions {
    /// Defaults around a store location.
    pub fn new(store: StoreOptions) -> TierOptions {
        TierOptions {
            store,
            pool: PoolOptions::new(1),
            remote: None,
            unit_interval_tokens: DEFAULT_UNIT_INTERVAL,
            weights_id: Vec::new(),
        }
    }
}

/// What [`Tiers::lookup`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierHit {
    /// Tokens of the longest stored prefix.
    pub tokens: u64,
    /// Whether the window pool (its DRAM level, or its Redis level when there is one) holds a
    /// window snapshot exactly at its end.
    pub window: bool,
    /// The matched blocks.
    pub store: StoreHit,
    /// `Tenant::id` of the tenant looked up for (the Redis level keys by it).
    pub tenant: u64,
}

impl TierHit {
    /// The unit key of the prefix (its last block's key).
    pub fn key(&self) -> Option<Key> {
        self.store.end()
    }
}

/// Which tokens to replay to rebuild the window after a global hit without a snapshot (spec
/// §7): positions `[start, end)`, whose replay regenerates window KV only and never
/// overwrites the restored global KV. The uncached suffix follows as usual.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ReplayPlan {
    /// First position to replay (`end - sliding_window`, at least 0).
    pub start: u64,
    /// End of the restored prefix.
    pub end: u64,
}

/// What [`Tiers::restore`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Restored {
    /// The new sequence (possibly empty when nothing could be restored).
    pub seq: SequenceId,
    /// Tokens it holds.
    pub tokens: u64,
    /// Of those, tokens mapped from the paged cache's own prefix index (no I/O).
    pub mapped_tokens: u64,
    /// Tokens read from SSD.
    pub read_tokens: u64,
    /// Bytes of block payload read from SSD.
    pub read_bytes: u64,
    /// Whether the window (and pending state) came from a snapshot of the window pool.
    pub window: bool,
    /// Whether that snapshot came from the pool's Redis level (another node put it, or this
    /// node's DRAM level had dropped it).
    pub window_remote: bool,
    /// When it did not: the replay that rebuilds it.
    pub replay: Option<ReplayPlan>,
    /// Whether a damaged block cut the restore short (the rest is a miss).
    pub damaged: bool,
}

/// The SSD store and the DRAM pool of one model. See the module docs.
#[derive(Debug)]
pub struct Tiers {
    store: SsdStore,
    pool: WindowPool,
    /// The window pool's Redis level, if configured (shared with the index thread).
    remote: Option<Arc<RedisPool>>,
    /// Whether the DRAM pool is the first level in front of `remote` (always, without one).
    local_level: bool,
    model: ModelFingerprint,
    geometry: CacheGeometry,
    interval: u64,
    align: u64,
    /// DRAM pool quotas in bytes by tenant id (`Tenant::id`); a tenant absent has none.
    dram_quotas: std::sync::RwLock<HashMap<u64, u64>>,
    /// The thread keeping this node's shared prefix index entries, with a Redis level and a
    /// node id. Last: dropped after the store, whose shutdown may still report units.
    indexer: Option<Indexer>,
}

/// Bytes of one block payload of `tokens` tokens (a multiple of every ratio).
pub fn block_payload_bytes(g: &CacheGeometry, tokens: u64) -> u64 {
    g.sources
        .iter()
        .map(|s| tokens / u64::from(s.ratio) * (g.global_entry_bytes + g.index_entry_bytes) as u64)
        .sum()
}

/// Bytes of a window snapshot of a sequence of this geometry.
pub fn snapshot_bytes(g: &CacheGeometry) -> usize {
    let pending: usize = g
        .sources
        .iter()
        .map(|s| 4 + s.max_pending_tokens * g.pending_token_floats * 4)
        .sum();
    SNAPSHOT_HEADER + g.num_layers * g.window_tokens * g.window_entry_bytes + pending
}

/// The [`BlockSource`] of a sequence in a paged cache: page `k` of every pool covers the same
/// tokens as block `k`.
struct CacheBlocks<'a> {
    cache: &'a KvCache,
    seq: SequenceId,
}

impl BlockSource for CacheBlocks<'_> {
    fn block_payload(
        &self,
        index: usize,
        first_token: u64,
        tokens: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let g = self.cache.geometry();
        let bad = |reason: String| Error::Payload {
            block: index,
            tokens: tokens as u64,
            reason,
        };
        if first_token != (index * g.page_tokens) as u64 {
            return Err(bad("block does not start at its page".into()));
        }
        for s in &g.sources {
            let m = s.ratio as usize;
            let n = tokens / m;
            let global = self
                .cache
                .global_entries(self.seq, s.layer)
                .map_err(Error::Cache)?;
            let page = global
                .page(index)
                .and_then(|p| p.get(..n))
                .ok_or_else(|| bad(format!("layer {}: global entries missing", s.layer)))?;
            out.extend_from_slice(page.as_bytes());
            let keys = self
                .cache
                .index_keys(self.seq, s.layer)
                .map_err(Error::Cache)?;
            let page = keys
                .page(index)
                .and_then(|p| p.get(..n))
                .ok_or_else(|| bad(format!("layer {}: indexer keys missing", s.layer)))?;
            out.extend_from_slice(page.as_bytes());
        }
        Ok(())
    }
}

impl Tiers {
    /// Opens the store and the pool for `cfg` stored in pages of `page_tokens` tokens.
    ///
    /// # Errors
    /// Config, plan and geometry errors; the store's and pool's errors.
    pub fn open(
        cfg: &ModelConfig,
        page_tokens: u32,
        mut opts: TierOptions,
        clock: Arc<dyn Clock>,
    ) -> Result<Tiers> {
        let plan = kvstack_spec::plan::LayerPlan::from_config(cfg).map_err(Error::Config)?;
        let geometry = CacheGeometry::new(cfg, &plan, page_tokens).map_err(Error::Cache)?;
        let model = ModelFingerprint::new(cfg, geometry.page_tokens).with_weights(&opts.weights_id);
        let block = block_payload_bytes(&geometry, geometry.page_tokens as u64) as usize
            + 4 * geometry.page_tokens;
        opts.store.max_block_payload = opts.store.max_block_payload.max(block);
        opts.pool.slot_bytes = snapshot_bytes(&geometry);
        let align = geometry
            .sources
            .iter()
            .map(|s| u64::from(s.ratio))
            .max()
            .unwrap_or(1);
        let remote = match &opts.remote {
            Some(r) => Some(Arc::new(RedisPool::new(r.clone(), opts.pool.ttl_ms)?)),
            None => None,
        };
        let local_level = opts.remote.as_ref().is_none_or(|r| r.local_level);
        // Entries live the store's retention; the store reports units durable or removed.
        let indexer = match (
            &remote,
            opts.remote.as_ref().and_then(|r| r.node_id.clone()),
        ) {
            (Some(r), Some(node)) => {
                let (ix, hooks) = Indexer::start(
                    Arc::clone(r),
                    model,
                    node,
                    opts.store.retention_ms,
                    opts.store.hooks.take(),
                )?;
                opts.store.hooks = Some(hooks);
                Some(ix)
            }
            _ => None,
        };
        let store = SsdStore::open(opts.store, Arc::clone(&clock))?;
        // What recovery found is this node's again (entries written before a restart may have
        // expired or been taken over): the most recently used units, within the queue.
        if let Some(ix) = &indexer {
            ix.reindex(store.durable_units(crate::shared_index::INDEX_QUEUE / 2));
        }
        let pool = WindowPool::new(opts.pool, clock)?;
        Ok(Tiers {
            store,
            pool,
            remote,
            local_level,
            model,
            geometry,
            interval: opts.unit_interval_tokens.max(1),
            align,
            dram_quotas: Default::default(),
            indexer,
        })
    }

    /// Replaces every tenant's DRAM pool quota: a tenant listed may hold at most
    /// `bytes / slot_bytes` window snapshots in the pool (a new one replaces its own least
    /// recently used; 0 keeps none of its snapshots), a tenant not listed is bounded by the
    /// pool's cap alone. The SSD is not affected. A tenant over a lowered quota keeps its
    /// snapshots until its next put, which drops its least recently used down to the quota.
    pub fn set_dram_quotas<'a>(&self, quotas: impl IntoIterator<Item = (&'a Tenant, u64)>) {
        let map = quotas.into_iter().map(|(t, b)| (t.id(), b)).collect();
        *self.dram_quotas.write().unwrap_or_else(|e| e.into_inner()) = map;
    }

    /// Replaces every tenant's SSD byte quota: a tenant listed keeps at most that many bytes
    /// of KV blocks on the SSD (its own least recently used unpinned units make way for a new
    /// one, of any age; a unit that cannot fit is refused with [`crate::Error::QuotaExceeded`]),
    /// a tenant not listed is bounded by the store alone. A tenant over a lowered quota is
    /// brought under it at once (`docs/tiers.md`, "Quotas").
    pub fn set_ssd_quotas<'a>(&self, quotas: impl IntoIterator<Item = (&'a Tenant, u64)>) {
        self.store
            .set_quotas(quotas.into_iter().map(|(t, b)| (t.id(), b)).collect());
    }

    /// `tenant`'s SSD byte quota, if it has one.
    pub fn ssd_quota(&self, tenant: &Tenant) -> Option<u64> {
        self.store.quota(tenant.id())
    }

    /// Bytes of KV blocks `tenant` keeps on the SSD (their records as laid out on disk).
    pub fn ssd_bytes(&self, tenant: &Tenant) -> u64 {
        self.store.tenant_bytes(tenant.id())
    }

    /// `tenant`'s DRAM pool quota in bytes, if it has one.
    pub fn dram_quota(&self, tenant: &Tenant) -> Option<u64> {
        self.dram_quotas
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&tenant.id())
            .copied()
    }

    /// Bytes of the DRAM pool `tenant`'s snapshots take (whole slots).
    pub fn dram_bytes(&self, tenant: &Tenant) -> u64 {
        (self.pool.owned_slots(tenant.id()) * self.pool.slot_bytes()) as u64
    }

    /// Puts `tenant`'s window snapshot under `key`: into the Redis level when there is one,
    /// and into the DRAM level within the tenant's quota when that is in front (or alone);
    /// whether a level kept it.
    pub(crate) fn put_window(&self, tenant: &Tenant, key: Key, snap: &[u8]) -> Result<bool> {
        let remote = self.remote.as_ref().is_some_and(|r| {
            r.put(
                SnapshotId {
                    tenant: tenant.id(),
                    model: &self.model,
                    key: &key,
                },
                snap,
            )
        });
        if !self.local_level {
            return Ok(remote);
        }
        Ok(self.put_window_local(tenant.id(), key, snap)? || remote)
    }

    /// The DRAM level of [`Tiers::put_window`].
    fn put_window_local(&self, tenant: u64, key: Key, snap: &[u8]) -> Result<bool> {
        let slot = self.pool.slot_bytes().max(1) as u64;
        let quota = self
            .dram_quotas
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&tenant)
            .map(|&b| usize::try_from(b / slot).unwrap_or(usize::MAX));
        let kept = self.pool.put_owned(key, snap, tenant, quota)?;
        if !kept {
            log::debug!(
                "tenant {tenant:016x} is at its DRAM pool quota with every snapshot pinned: \
                 window not kept"
            );
        }
        Ok(kept)
    }

    /// Unit lengths must be a multiple of this (the largest compress ratio, spec §8).
    pub fn align(&self) -> u64 {
        self.align
    }

    /// The SSD store.
    pub fn store(&self) -> &SsdStore {
        &self.store
    }

    /// The DRAM window pool.
    pub fn pool(&self) -> &WindowPool {
        &self.pool
    }

    /// The window pool's Redis level, when configured.
    pub fn remote(&self) -> Option<&RedisPool> {
        self.remote.as_deref()
    }

    /// Waits until the shared prefix index has been told of every unit made durable or
    /// removed before this call (written to Redis, or failed); at once without an index.
    /// For tests and tools: the write path never waits for the index.
    pub fn flush_index(&self) {
        if let Some(ix) = &self.indexer {
            ix.flush();
        }
    }

    /// Counters of the shared prefix index thread, when there is one.
    pub fn index_stats(&self) -> Option<IndexStats> {
        self.indexer.as_ref().map(Indexer::stats)
    }

    fn snapshot_id<'a>(&'a self, tenant: u64, key: &'a Key) -> SnapshotId<'a> {
        SnapshotId {
            tenant,
            model: &self.model,
            key,
        }
    }

    /// Whether either level of the window pool holds a snapshot under `key`.
    fn has_window(&self, tenant: u64, key: &Key) -> bool {
        self.pool.contains(key)
            || self
                .remote
                .as_ref()
                .is_some_and(|r| r.contains(self.snapshot_id(tenant, key)))
    }

    /// Copies the window snapshot under `key` into `out`: from the DRAM level, else from the
    /// Redis level (checked there: a damaged value is a miss). `None`: neither holds one;
    /// `Some(true)`: it came from Redis.
    pub(crate) fn get_window(&self, tenant: u64, key: &Key, out: &mut Vec<u8>) -> Option<bool> {
        if self.pool.get(key, out) {
            return Some(false);
        }
        let r = self.remote.as_ref()?;
        r.get(self.snapshot_id(tenant, key), out).then_some(true)
    }

    /// The longest prefix of `tokens` that the shared prefix index says some node holds for
    /// `tenant` (this node included), and which node; `None` without an index, when nothing
    /// is indexed, or when Redis is down (`docs/cluster.md`).
    pub fn cluster_lookup(
        &self,
        tokens: &[u32],
        tenant: &Tenant,
    ) -> Option<crate::shared_index::IndexHit> {
        let r = self.remote.as_ref()?;
        let keys = crate::key::chain_keys(tokens, self.geometry.page_tokens, &self.model, tenant);
        r.index_longest(tenant.id(), &self.model, &keys)
    }

    /// Drops the window snapshot under `key` from both levels.
    pub(crate) fn remove_window(&self, tenant: u64, key: &Key) {
        self.pool.remove(key);
        if let Some(r) = &self.remote {
            r.remove(self.snapshot_id(tenant, key));
        }
    }

    /// The model fingerprint keys are derived from.
    pub fn model(&self) -> &ModelFingerprint {
        &self.model
    }

    /// The page geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Where units are persisted while a sequence grows from `start` to `end` tokens: every
    /// multiple of `unit_interval_tokens` in `(start, end]`, and `end` itself when
    /// `end_of_turn` (the end of a prompt or an output), at any length: its window snapshot
    /// carries the compressor state of a trailing incomplete group (module docs).
    pub fn unit_points(&self, start: u64, end: u64, end_of_turn: bool) -> Vec<u64> {
        let mut points: Vec<u64> = ((start / self.interval + 1)..=(end / self.interval))
            .map(|k| k * self.interval)
            .collect();
        if end_of_turn && end > 0 && points.last() != Some(&end) && end > start {
            points.push(end);
        }
        points
    }

    /// Persists the first `upto` tokens of `seq` as a unit (write-behind: returns at once
    /// with a ticket). When `upto` is the sequence's length and its window is complete, the
    /// window snapshot goes to the DRAM pool under the unit's key.
    ///
    /// # Errors
    /// [`Error::UnitRange`] (empty, or past the sequence's end), cache errors, and those of
    /// [`SsdStore::put_unit`].
    pub fn persist(
        &self,
        cache: &KvCache,
        seq: SequenceId,
        tenant: &Tenant,
        upto: u64,
    ) -> Result<UnitTicket> {
        let len = cache.len(seq).map_err(Error::Cache)?;
        if upto == 0 || upto > len {
            return Err(Error::UnitRange { tokens: upto, len });
        }
        let tokens = cache.tokens(seq).map_err(Error::Cache)?;
        let source = CacheBlocks { cache, seq };
        let ticket = self.store.put_unit(&UnitWrite {
            model: &self.model,
            tenant,
            tokens: &tokens[..upto as usize],
            page_tokens: self.geometry.page_tokens,
            // Any length: blocks hold complete compress groups only, and the trailing group's
            // state goes to the window snapshot.
            align: 1,
            source: &source,
        })?;
        if upto == len
            && let Some(snap) = self.window_snapshot(cache, seq)?
        {
            self.put_window(tenant, ticket.key, &snap)?;
        }
        Ok(ticket)
    }

    /// The window snapshot of `seq` (rows and pending state), or `None` when its window does
    /// not hold every row it should (after a prefix hit whose window was not rebuilt).
    pub fn window_snapshot(&self, cache: &KvCache, seq: SequenceId) -> Result<Option<Vec<u8>>> {
        let g = &self.geometry;
        let len = cache.len(seq).map_err(Error::Cache)?;
        let rows = len.min(g.window_tokens as u64);
        let mut out = Vec::with_capacity(snapshot_bytes(g));
        out.extend_from_slice(&SNAPSHOT_MAGIC);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(g.num_layers as u32).to_le_bytes());
        out.extend_from_slice(&(rows as u32).to_le_bytes());
        out.extend_from_slice(&(g.sources.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for l in 0..g.num_layers {
            let w = cache.window(seq, l).map_err(Error::Cache)?;
            if w.range() != (len - rows..len) {
                return Ok(None);
            }
            for (_, row) in w.iter() {
                out.extend_from_slice(row.as_bytes());
            }
        }
        for s in &g.sources {
            let pending: &[f32] = if s.ratio > 1 {
                match cache.pending(seq, s.layer).map_err(Error::Cache)? {
                    Some(p) => p,
                    None => return Ok(None),
                }
            } else {
                &[]
            };
            out.extend_from_slice(&(pending.len() as u32).to_le_bytes());
            for v in pending {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(Some(out))
    }

    /// The longest stored prefix of `tokens` for `tenant`, and whether a window snapshot
    /// exists exactly at its end.
    pub fn lookup(&self, tokens: &[u32], tenant: &Tenant) -> TierHit {
        let store = self
            .store
            .lookup(&self.model, tenant, tokens, self.geometry.page_tokens);
        let window = store
            .end()
            .is_some_and(|k| self.has_window(tenant.id(), &k));
        TierHit {
            tokens: store.tokens,
            window,
            store,
            tenant: tenant.id(),
        }
    }

    /// Creates a sequence in `cache` holding the prefix `hit` found for `tokens` (module
    /// docs). A prefix that ends inside a compress group is restored whole when the pool holds
    /// its window snapshot (which carries the group's compressor state), else up to the last
    /// group boundary before it. A damaged or vanished block cuts the restore short: the
    /// sequence then holds the prefix before it, and the result says so.
    ///
    /// # Errors
    /// Cache errors (no room, too many sequences), I/O set-up failures.
    pub fn restore(&self, cache: &mut KvCache, tokens: &[u32], hit: &TierHit) -> Result<Restored> {
        let g = self.geometry.clone();
        let p = g.page_tokens as u64;
        let mut want = hit.tokens.min(tokens.len() as u64);
        // The snapshot at the prefix's end, read before the blocks: an unaligned end needs
        // its pending compressor state to append the last block.
        let mut snap = Vec::new();
        let mut from_remote = false;
        let got = |key: &Key, snap: &mut Vec<u8>, from_remote: &mut bool| {
            self.get_window(hit.tenant, key, snap)
                .map(|remote| *from_remote = remote)
                .is_some()
        };
        let snapshot = match hit.key() {
            Some(key)
                if hit.window && want == hit.tokens && got(&key, &mut snap, &mut from_remote) =>
            {
                match parse_snapshot(&snap, &g) {
                    Some(s) if s.tokens == want => Some(s),
                    Some(_) => None,
                    None => {
                        log::warn!("window snapshot does not match the model; ignored");
                        None
                    }
                }
            }
            _ => None,
        };
        if snapshot.is_none() {
            want = want / self.align * self.align;
        }
        // Whole blocks the cache's own prefix index still holds cost no I/O.
        let mapped = cache
            .lookup_prefix(&tokens[..want as usize])
            .min(want / p * p);
        let created = cache
            .create_sequence_with_prefix(tokens, mapped)
            .map_err(Error::Cache)?;
        let seq = created.seq;
        let mapped = created.tokens;
        let first_block = (mapped / p) as usize;
        let last_block = want.div_ceil(p) as usize;
        let keys = hit
            .store
            .keys
            .get(first_block..last_block.max(first_block))
            .unwrap_or_default();
        let mut read_bytes = 0u64;
        let empty: Vec<&[f32]> = vec![&[]; g.sources.len()];
        let tail_pending: Vec<&[f32]> = match &snapshot {
            Some(s) => s.pending.iter().map(Vec::as_slice).collect(),
            None => empty.clone(),
        };
        let read = self.store.read_blocks(keys, |i, h, kv| {
            let idx = (first_block + i) as u64;
            let first = idx * p;
            let stored = u64::from(h.tokens);
            let expect = block_payload_bytes(&g, stored);
            let bad = |reason: String| Error::Payload {
                block: idx as usize,
                tokens: stored,
                reason,
            };
            if kv.len() as u64 != expect {
                return Err(bad(format!(
                    "{} payload bytes, expected {expect}",
                    kv.len()
                )));
            }
            // The block's tokens that are restored (the last one may end earlier: at the
            // group boundary before an unaligned end without a snapshot).
            let n = stored.min(want.saturating_sub(first));
            let tok = tokens
                .get(first as usize..(first + n) as usize)
                .ok_or_else(|| bad("block past the request's tokens".into()))?;
            let mut global = Vec::with_capacity(g.sources.len());
            let mut index = Vec::with_capacity(g.sources.len());
            let mut rest = kv;
            for s in &g.sources {
                let m = u64::from(s.ratio);
                let (stored_e, e) = ((stored / m) as usize, (n / m) as usize);
                let (a, r) = rest.split_at(stored_e * g.global_entry_bytes);
                let (b, r) = r.split_at(stored_e * g.index_entry_bytes);
                rest = r;
                global.push(
                    <[GlobalFp4Entry]>::ref_from_bytes(&a[..e * g.global_entry_bytes])
                        .map_err(|_| bad("global entries".into()))?,
                );
                index.push(
                    <[IndexMxfp4Entry]>::ref_from_bytes(&b[..e * g.index_entry_bytes])
                        .map_err(|_| bad("indexer keys".into()))?,
                );
            }
            let pending = if first + n == want && !want.is_multiple_of(self.align) {
                tail_pending.clone()
            } else {
                empty.clone()
            };
            cache
                .append(
                    seq,
                    &AppendData {
                        tokens: tok,
                        global,
                        index,
                        window: &[],
                        pending,
                    },
                )
                .map_err(Error::Cache)?;
            read_bytes += kv.len() as u64;
            Ok(())
        });
        let outcome = match read {
            Ok(o) => o,
            Err(e) => {
                // Leave no half-restored sequence behind.
                let _ = cache.drop_sequence(seq);
                return Err(e);
            }
        };
        let len = cache.len(seq).map_err(Error::Cache)?;
        let mut window = false;
        if let Some(s) = &snapshot
            && len == want
            && len > 0
        {
            cache
                .write_window(seq, len - s.rows, s.window)
                .map_err(Error::Cache)?;
            if len.is_multiple_of(self.align) {
                // An aligned end has no pending state in its blocks' appends; set it (empty
                // for every source at an aligned end, so this only checks the snapshot).
                for (src, values) in g.sources.iter().zip(&s.pending) {
                    if src.ratio > 1 && !values.is_empty() {
                        cache
                            .set_pending(seq, src.layer, values)
                            .map_err(Error::Cache)?;
                    }
                }
            }
            window = true;
        }
        if window && from_remote && self.local_level {
            // The next turn on this node finds it in DRAM (best effort: a tenant at its quota
            // with every snapshot pinned keeps it in Redis only).
            if let Some(key) = hit.key()
                && let Err(e) = self.put_window_local(hit.tenant, key, &snap)
            {
                log::debug!("window snapshot from redis not kept in DRAM: {e}");
            }
        }
        let replay = (!window && len > 0).then(|| ReplayPlan {
            start: len.saturating_sub(g.window_tokens as u64),
            end: len,
        });
        Ok(Restored {
            seq,
            tokens: len,
            mapped_tokens: mapped,
            read_tokens: len - mapped,
            read_bytes,
            window,
            window_remote: window && from_remote,
            replay,
            damaged: matches!(outcome, ReadOutcome::Damaged { .. }),
        })
    }

    /// Waits until every persisted unit is durable.
    ///
    /// # Errors
    /// As [`SsdStore::flush`].
    pub fn flush(&self) -> Result<()> {
        self.store.flush()
    }

    /// Closes the store (see [`SsdStore::close`]).
    ///
    /// # Errors
    /// As [`SsdStore::close`].
    pub fn close(self) -> Result<()> {
        self.store.close()
    }
}

/// A parsed window snapshot.
pub(crate) struct Snapshot<'a> {
    /// Length of the sequence it was taken of.
    pub(crate) tokens: u64,
    /// Window rows per layer.
    pub(crate) rows: u64,
    /// The rows, layer-major.
    pub(crate) window: &'a [WindowFp8Entry],
    /// Pending compressor state per KV source.
    pub(crate) pending: Vec<Vec<f32>>,
    /// Bytes the snapshot spans (a valid one is exactly its buffer).
    pub(crate) bytes: usize,
}

/// Parses a snapshot of geometry `g`; `None` when its header does not match `g` or it is cut
/// short.
pub(crate) fn parse_snapshot<'a>(b: &'a [u8], g: &CacheGeometry) -> Option<Snapshot<'a>> {
    let u32_at =
        |o: usize| -> Option<u32> { Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?)) };
    if b.get(..8)? != SNAPSHOT_MAGIC {
        return None;
    }
    let tokens = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
    let layers = u32_at(16)? as usize;
    let rows = u32_at(20)? as usize;
    let sources = u32_at(24)? as usize;
    if layers != g.num_layers || rows > g.window_tokens || sources != g.sources.len() {
        return None;
    }
    let wbytes = layers * rows * g.window_entry_bytes;
    let window =
        <[WindowFp8Entry]>::ref_from_bytes(b.get(SNAPSHOT_HEADER..SNAPSHOT_HEADER + wbytes)?)
            .ok()?;
    let mut at = SNAPSHOT_HEADER + wbytes;
    let mut pending = Vec::with_capacity(sources);
    for _ in 0..sources {
        let n = u32_at(at)? as usize;
        at += 4;
        let vals = b
            .get(at..at + 4 * n)?
            .chunks_exact(4)
            .filter_map(|c| c.try_into().ok().map(f32::from_le_bytes))
            .collect();
        at += 4 * n;
        pending.push(vals);
    }
    Some(Snapshot {
        tokens,
        rows: rows as u64,
        window,
        pending,
        bytes: at,
    })
}

/// Hex of a whole key (for tools).
pub fn key_to_hex(key: &Key) -> String {
    crate::key::key_hex(key, KEY_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_block_payload_is_a_full_v41_flash_block() {
        let cfg = kvstack_spec::builtin::default_config().unwrap();
        let plan = kvstack_spec::plan::LayerPlan::from_config(&cfg).unwrap();
        let g = CacheGeometry::new(&cfg, &plan, 256).unwrap();
        let with_tokens = block_payload_bytes(&g, 256) as usize + 4 * 256;
        assert_eq!(with_tokens, crate::store::V41_BLOCK_PAYLOAD);
    }
}
