//! The shared prefix index on Redis Cluster (`docs/cluster.md`): which kvstackd node holds
//! which unit on its SSD, so that a node that misses locally can fetch the unit's global KV
//! from the node that has it.
//!
//! - One entry per block key of a unit (every block of the unit's chain, the partial last one
//!   included), so a request that shares only the unit's first blocks still finds it: the
//!   requester computes its own chain keys (`key::chain_keys`) and reads them in one pipeline.
//! - Key `{prefix}u:{tenant id}:{model}:{block key}` (hex as in the window keys); value
//!   ([`encode_entry`]): magic `KVRI`, version, the unit's tokens, tenant, model, block key, the
//!   holder's node id, CRC-32C. Written with `PX` = the store's retention, so the entries of a
//!   node that died or evicted the unit age out; a stale entry costs the requester a miss at
//!   the peer, never wrong bytes (the peer serves only what it holds, CRC-checked).
//! - Entries are written once a unit is durable on this node's SSD (the store reports it,
//!   [`StoreHooks::unit_durable`], also for a touch commit recording a newer use, which renews
//!   the entries' TTL), and removed when a unit leaves the store (evicted past retention or
//!   for its tenant's quota, or deleted: [`StoreHooks::unit_removed`]), for the blocks no other
//!   unit of this node holds, and only where they still name this node (an atomic
//!   compare-and-delete in Redis). The store hands the events to the [`Indexer`]'s thread,
//!   which owns the Redis calls: the write path never waits for Redis; a full queue drops an
//!   event (counted in [`IndexStats::dropped`]: a missing entry is a miss, a stale one ages
//!   out).
//! - Like the window level, every failure is a miss.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvstack_firmware_interface::record::{KEY_BYTES, Key, MODEL_BYTES};
use serde::Serialize;

use crate::key::{ModelFingerprint, key_hex};
use crate::redis_pool::RedisPool;
use crate::store::{StoreHooks, UnitEvent};

/// Events the index thread may have queued; more are dropped (and counted).
pub const INDEX_QUEUE: usize = 4096;

/// Deletes `KEYS[1]` if it is an index entry naming the node `ARGV[1]` (its node id at
/// bytes 74.., its length 78 + the id's: a longer id starting with this one is another node).
const DELETE_IF_MINE: &str = "local v = redis.call('GET', KEYS[1]) \
    if v and string.len(v) == 78 + string.len(ARGV[1]) \
    and string.sub(v, 75, 74 + string.len(ARGV[1])) == ARGV[1] then \
    return redis.call('DEL', KEYS[1]) end return 0";

/// Magic of an index entry: "KVRI" (kvstack remote index).
pub const ENTRY_MAGIC: [u8; 4] = *b"KVRI";
/// Version of the entry layout.
pub const ENTRY_VERSION: u32 = 1;
/// Longest node id.
pub const MAX_NODE_ID: usize = 128;

/// What the index says about one block key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// The node that holds a unit containing the block (its configured node id).
    pub node: String,
    /// Tokens of that unit.
    pub unit_tokens: u64,
}

/// The longest prefix of a request the index knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexHit {
    /// Blocks of the request's chain matched (its first `blocks` chain keys).
    pub blocks: usize,
    /// The entry of the last matched block.
    pub entry: IndexEntry,
}

/// The value stored under a block key (little-endian):
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | magic `KVRI` |
/// | 4..8 | version (1) |
/// | 8..16 | the unit's tokens |
/// | 16..24 | tenant id |
/// | 24..40 | model fingerprint (first 16 bytes) |
/// | 40..72 | block key |
/// | 72..74 | node id length `n` (1 to 128) |
/// | 74..74+n | node id (UTF-8) |
/// | then 4 | CRC-32C of everything before |
pub fn encode_entry(
    tenant: u64,
    model: &ModelFingerprint,
    key: &Key,
    unit_tokens: u64,
    node: &str,
) -> Vec<u8> {
    let mut v = Vec::with_capacity(78 + node.len());
    v.extend_from_slice(&ENTRY_MAGIC);
    v.extend_from_slice(&ENTRY_VERSION.to_le_bytes());
    v.extend_from_slice(&unit_tokens.to_le_bytes());
    v.extend_from_slice(&tenant.to_le_bytes());
    v.extend_from_slice(&model.short());
    v.extend_from_slice(key);
    v.extend_from_slice(&(node.len() as u16).to_le_bytes());
    v.extend_from_slice(node.as_bytes());
    let crc = crc32c::crc32c(&v);
    v.extend_from_slice(&crc.to_le_bytes());
    v
}

/// The entry in `v` if it is a valid entry of (`tenant`, `model`, `key`).
pub fn decode_entry(
    tenant: u64,
    model: &ModelFingerprint,
    key: &Key,
    v: &[u8],
) -> Option<IndexEntry> {
    let (body, crc) = v.split_at_checked(v.len().checked_sub(4)?)?;
    if u32::from_le_bytes(crc.try_into().ok()?) != crc32c::crc32c(body) {
        return None;
    }
    let u64_at = |o: usize| body.get(o..o + 8)?.try_into().ok().map(u64::from_le_bytes);
    if body.get(..4)? != ENTRY_MAGIC
        || body.get(4..8)? != ENTRY_VERSION.to_le_bytes()
        || u64_at(16)? != tenant
        || body.get(24..24 + MODEL_BYTES)? != model.short()
        || body.get(40..40 + KEY_BYTES)? != key
    {
        return None;
    }
    let n = u16::from_le_bytes(body.get(72..74)?.try_into().ok()?) as usize;
    if n == 0 || n > MAX_NODE_ID || body.len() != 74 + n {
        return None;
    }
    let node = std::str::from_utf8(body.get(74..)?).ok()?.to_owned();
    Some(IndexEntry {
        node,
        unit_tokens: u64_at(8)?,
    })
}

impl RedisPool {
    /// The index key of a block key.
    pub fn index_key(&self, tenant: u64, model: &ModelFingerprint, key: &Key) -> String {
        format!(
            "{}u:{tenant:016x}:{}:{}",
            self.options().key_prefix,
            key_hex(&model.0, MODEL_BYTES),
            key_hex(key, KEY_BYTES)
        )
    }

    /// Records that `node` holds the unit whose chain keys are `keys` (`unit_tokens` tokens)
    /// for `ttl_ms`, in one pipeline; whether Redis took it.
    pub fn index_put(
        &self,
        tenant: u64,
        model: &ModelFingerprint,
        keys: &[Key],
        unit_tokens: u64,
        node: &str,
        ttl_ms: u64,
    ) -> bool {
        if keys.is_empty() || node.is_empty() || node.len() > MAX_NODE_ID || ttl_ms == 0 {
            return false;
        }
        let items: Vec<(String, Vec<u8>)> = keys
            .iter()
            .map(|k| {
                (
                    self.index_key(tenant, model, k),
                    encode_entry(tenant, model, k, unit_tokens, node),
                )
            })
            .collect();
        self.call_counted("index SET pipeline", |c| {
            let mut p = redis::cluster::cluster_pipe();
            for (k, v) in &items {
                p.cmd("SET").arg(k).arg(v).arg("PX").arg(ttl_ms).ignore();
            }
            p.exec(c)
        })
        .is_some()
    }

    /// The longest prefix of the chain `keys` (a request's, first to last) that some node
    /// holds: every key read in one pipeline, the last valid entry wins. `None` when no
    /// block is indexed or Redis is down.
    pub fn index_longest(
        &self,
        tenant: u64,
        model: &ModelFingerprint,
        keys: &[Key],
    ) -> Option<IndexHit> {
        if keys.is_empty() {
            return None;
        }
        let names: Vec<String> = keys
            .iter()
            .map(|k| self.index_key(tenant, model, k))
            .collect();
        let values = self.call_counted("index GET pipeline", |c| {
            let mut p = redis::cluster::cluster_pipe();
            for k in &names {
                p.cmd("GET").arg(k);
            }
            p.query::<Vec<Option<Vec<u8>>>>(c)
        })?;
        // Chain keys: block i's key commits to every block before it, so the last entry found
        // covers the whole prefix up to it.
        values
            .iter()
            .zip(keys)
            .enumerate()
            .rev()
            .find_map(|(i, (v, k))| {
                let e = decode_entry(tenant, model, k, v.as_deref()?)?;
                Some(IndexHit {
                    blocks: i + 1,
                    entry: e,
                })
            })
    }

    /// Removes the entries of `keys` that name `node` (another node's entries stay: it
    /// holds the unit), each compared and deleted atomically in Redis, all in one pipeline.
    /// How many were removed; `None` when Redis did not answer (best effort: the entries
    /// then age out).
    pub fn index_remove(
        &self,
        tenant: u64,
        model: &ModelFingerprint,
        keys: &[Key],
        node: &str,
    ) -> Option<u64> {
        if keys.is_empty() {
            return Some(0);
        }
        let names: Vec<String> = keys
            .iter()
            .map(|k| self.index_key(tenant, model, k))
            .collect();
        let removed = self.call_counted("index compare-and-delete pipeline", |c| {
            let mut p = redis::cluster::cluster_pipe();
            for k in &names {
                p.cmd("EVAL").arg(DELETE_IF_MINE).arg(1).arg(k).arg(node);
            }
            p.query::<Vec<u64>>(c)
        })?;
        Some(removed.iter().sum())
    }
}

/// Counters of the [`Indexer`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    /// Durable units whose entries Redis took.
    pub units_indexed: u64,
    /// Units removed from the store whose entries were handled (compare-and-delete sent).
    pub units_unindexed: u64,
    /// Entries deleted (they still named this node).
    pub entries_removed: u64,
    /// Events Redis did not take (down, refusing): the entries are missing, or left to age
    /// out.
    pub failed: u64,
    /// Events dropped because the queue was full.
    pub dropped: u64,
}

#[derive(Debug, Default)]
struct Counters {
    units_indexed: AtomicU64,
    units_unindexed: AtomicU64,
    entries_removed: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

#[derive(Debug)]
enum Job {
    Put(UnitEvent),
    Remove(UnitEvent),
    Flush(mpsc::Sender<()>),
    Stop,
}

/// The thread that keeps this node's entries of the shared prefix index (module docs): the
/// store's hooks queue units made durable or removed, the thread writes or deletes their
/// entries. Dropping it lets the thread finish what is queued, then joins it.
#[derive(Debug)]
pub struct Indexer {
    tx: SyncSender<Job>,
    counters: Arc<Counters>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The [`StoreHooks`] that feed an [`Indexer`], in front of the store's own hooks (if any).
#[derive(Debug)]
struct IndexHooks {
    tx: SyncSender<Job>,
    counters: Arc<Counters>,
    inner: Option<Arc<dyn StoreHooks>>,
}

impl IndexHooks {
    fn offer(&self, job: Job) {
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                Counters::bump(&self.counters.dropped, 1);
                log::debug!("shared prefix index queue full: an event is dropped");
            }
            // The indexer is gone (shutting down): nothing to keep.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

impl StoreHooks for IndexHooks {
    fn before_sync(&self) {
        if let Some(h) = &self.inner {
            h.before_sync();
        }
    }

    fn unit_durable(&self, unit: &UnitEvent) {
        if let Some(h) = &self.inner {
            h.unit_durable(unit);
        }
        self.offer(Job::Put(unit.clone()));
    }

    fn unit_removed(&self, unit: &UnitEvent) {
        if let Some(h) = &self.inner {
            h.unit_removed(unit);
        }
        self.offer(Job::Remove(unit.clone()));
    }
}

impl Indexer {
    /// Starts the thread that indexes units of `model` under `node` on `remote`, entries living
    /// `ttl_ms` (the store's retention); returns it and the hooks to give the store, which
    /// call `inner` (the store's own hooks) first.
    ///
    /// # Errors
    /// [`crate::Error::Io`] when the thread cannot be started.
    pub(crate) fn start(
        remote: Arc<RedisPool>,
        model: ModelFingerprint,
        node: String,
        ttl_ms: u64,
        inner: Option<Arc<dyn StoreHooks>>,
    ) -> crate::Result<(Indexer, Arc<dyn StoreHooks>)> {
        let (tx, rx) = mpsc::sync_channel::<Job>(INDEX_QUEUE);
        let counters = Arc::new(Counters::default());
        let c = Arc::clone(&counters);
        let thread = std::thread::Builder::new()
            .name("kvstack-index".into())
            .spawn(move || {
                // A unit of another model (never expected: a store is one model's), or a
                // prefix unit whose model the store did not record, counts as this model's.
                let ours = |u: &UnitEvent| u.model == model.short() || u.model == [0; 16];
                for job in rx {
                    match job {
                        Job::Put(u) if ours(&u) => {
                            let ok = remote
                                .index_put(u.tenant, &model, &u.keys, u.tokens, &node, ttl_ms);
                            Counters::bump(if ok { &c.units_indexed } else { &c.failed }, 1);
                        }
                        Job::Remove(u) if ours(&u) => {
                            match remote.index_remove(u.tenant, &model, &u.keys, &node) {
                                Some(n) => {
                                    Counters::bump(&c.units_unindexed, 1);
                                    Counters::bump(&c.entries_removed, n);
                                }
                                None => Counters::bump(&c.failed, 1),
                            }
                        }
                        Job::Put(_) | Job::Remove(_) => {}
                        Job::Flush(done) => {
                            let _ = done.send(());
                        }
                        Job::Stop => break,
                    }
                }
            })
            .map_err(|e| {
                crate::Error::io(
                    "cannot start the shared prefix index thread for",
                    "redis",
                    e,
                )
            })?;
        let hooks = Arc::new(IndexHooks {
            tx: tx.clone(),
            counters: Arc::clone(&counters),
            inner,
        });
        Ok((
            Indexer {
                tx,
                counters,
                thread: Mutex::new(Some(thread)),
            },
            hooks,
        ))
    }

    /// Queues `units` (durable units recovered from the SSD) for indexing, as many as the
    /// queue has room for (the rest are counted as dropped: indexed at their next durable
    /// commit, a touch or a put). Never waits.
    pub(crate) fn reindex(&self, units: Vec<UnitEvent>) {
        for u in units {
            if let Err(TrySendError::Full(_)) = self.tx.try_send(Job::Put(u)) {
                Counters::bump(&self.counters.dropped, 1);
            }
        }
    }

    /// Waits until every event queued before this call has been handled (written to Redis,
    /// or failed).
    pub fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        if self.tx.send(Job::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// Counters.
    pub fn stats(&self) -> IndexStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IndexStats {
            units_indexed: get(&c.units_indexed),
            units_unindexed: get(&c.units_unindexed),
            entries_removed: get(&c.entries_removed),
            failed: get(&c.failed),
            dropped: get(&c.dropped),
        }
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.tx.send(Job::Stop);
        let handle = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle
            && h.join().is_err()
        {
            log::error!("the shared prefix index thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_damage_is_refused() {
        let m = ModelFingerprint([1; 32]);
        let k = [2u8; 32];
        let v = encode_entry(9, &m, &k, 1234, "node-a");
        assert_eq!(
            decode_entry(9, &m, &k, &v),
            Some(IndexEntry {
                node: "node-a".into(),
                unit_tokens: 1234
            })
        );
        for at in 0..v.len() {
            let mut d = v.clone();
            d[at] ^= 4;
            assert_eq!(decode_entry(9, &m, &k, &d), None, "flip at {at}");
        }
        assert_eq!(decode_entry(9, &m, &k, &v[..v.len() - 1]), None);
        assert_eq!(decode_entry(8, &m, &k, &v), None);
        assert_eq!(decode_entry(9, &m, &[3; 32], &v), None);
    }
}
