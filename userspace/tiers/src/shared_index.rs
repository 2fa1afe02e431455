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
//! - Entries are written when a unit is persisted (queued for the SSD, not yet durable: a
//!   peer asked before it is durable answers with the shorter prefix it has) and removed when
//!   this node deletes the unit, if they still name this node.
//! - Like the window level, every failure is a miss.

use kvstack_firmware_interface::record::{KEY_BYTES, Key, MODEL_BYTES};

use crate::key::{ModelFingerprint, key_hex};
use crate::redis_pool::RedisPool;

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
    /// still holds the unit). Best effort.
    pub fn index_remove(&self, tenant: u64, model: &ModelFingerprint, keys: &[Key], node: &str) {
        for k in keys {
            let name = self.index_key(tenant, model, k);
            let mine = self
                .call_counted("index GET", |c| {
                    redis::cmd("GET").arg(&name).query::<Option<Vec<u8>>>(c)
                })
                .flatten()
                .and_then(|v| decode_entry(tenant, model, k, &v))
                .is_some_and(|e| e.node == node);
            if mine {
                let _ = self.call_counted("index DEL", |c| redis::cmd("DEL").arg(&name).exec(c));
            }
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
