//! The window pool's second level on Redis Cluster (`docs/cluster.md`): window snapshots
//! shared by every kvstackd node of a deployment, so a session whose next turn lands on
//! another node finds its window there instead of replaying it (spec §7).
//!
//! - A snapshot is one Redis string, written with `SET key value PX ttl` (the pool's TTL is
//!   the key's expiry: Redis drops it, nobody has to sweep) and read with `GET`; several are
//!   read in one pipeline ([`RedisPool::get_many`]).
//! - Keys: `{prefix}w:{tenant id, 16 hex}:{model fingerprint, first 16 bytes in hex}:{unit
//!   key, 64 hex}` ([`RedisPool::value_key`]). The unit key is derived from the tenant's
//!   full hash already; the tenant id and the model are in the key as well, so that one
//!   tenant's or one model's keys can be listed, and so that a key names whose it is.
//! - Values: a [`HEADER_BYTES`]-byte header and the snapshot ([`encode_value`]); the header
//!   repeats the tenant, model and unit key, and a CRC-32C covers header and snapshot. A value
//!   whose length, magic, version, identity or CRC does not match is a miss (counted in
//!   [`RemoteStats::damaged`]), never served.
//! - Failures are misses, never errors: the first failure of an incident is logged once
//!   (warning), the connection dropped, and further calls are misses without network I/O
//!   ([`RemoteStats::skipped`]) until `retry_ms` has passed; then one call reconnects. The
//!   first success after an incident is logged (info). [`RedisPool::health`] tells the state.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvstack_firmware_interface::record::{KEY_BYTES, Key, MODEL_BYTES};
use redis::cluster::{ClusterClient, ClusterConnection};
use serde::Serialize;

use crate::key::{ModelFingerprint, key_hex};
use crate::{Error, Result};

/// Magic of a value: "KVRW" (kvstack remote window).
pub const VALUE_MAGIC: [u8; 4] = *b"KVRW";
/// Version of the value layout.
pub const VALUE_VERSION: u32 = 1;
/// Bytes of a value's header.
pub const HEADER_BYTES: usize = 80;

/// Default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "kvstack:";

/// Options of [`RedisPool::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// Seed nodes, `redis://HOST:PORT` (any reachable node of the cluster will do; the client
    /// learns the others and the slot map from it).
    pub nodes: Vec<String>,
    /// Prepended to every key (several deployments can share one cluster).
    pub key_prefix: String,
    /// Time to connect to one node (ms).
    pub connect_timeout_ms: u64,
    /// Time to wait for one reply (ms).
    pub io_timeout_ms: u64,
    /// After a failure, calls are misses without network I/O for this long (ms), then one
    /// reconnects.
    pub retry_ms: u64,
    /// Whether the local DRAM pool stays in front as the first level (puts go to both, reads
    /// try it first); off, puts go to Redis only and the local pool only stages a snapshot
    /// read from Redis until the restore that asked for it.
    pub local_level: bool,
    /// This node's id in the shared prefix index (`crate::shared_index`): when set, units
    /// this node persists are indexed under it; `None`: no index entries are written.
    pub node_id: Option<String>,
}

impl RedisOptions {
    /// Defaults around the seed nodes `nodes`.
    pub fn new(nodes: Vec<String>) -> RedisOptions {
        RedisOptions {
            nodes,
            key_prefix: DEFAULT_KEY_PREFIX.into(),
            connect_timeout_ms: 500,
            io_timeout_ms: 1000,
            retry_ms: 1000,
            local_level: true,
            node_id: None,
        }
    }
}

/// Counters of the Redis level.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RemoteStats {
    /// Snapshots written (acknowledged by Redis).
    pub puts: u64,
    /// Puts that failed (Redis unreachable or refusing).
    pub put_failures: u64,
    /// Gets (and existence checks) sent.
    pub gets: u64,
    /// Gets that returned a valid snapshot.
    pub hits: u64,
    /// Gets that found no key (never stored, expired, or lost in a failover).
    pub misses: u64,
    /// Gets whose value was damaged or truncated (a miss, never served).
    pub damaged: u64,
    /// Calls answered as misses without network I/O while Redis was down.
    pub skipped: u64,
    /// Calls that failed (each counts once; a failed get is also a miss).
    pub errors: u64,
    /// Incidents: runs of failures between successes (each logged once).
    pub incidents: u64,
    /// Bytes of snapshots written.
    pub bytes_put: u64,
    /// Bytes of valid snapshots read.
    pub bytes_got: u64,
    /// Time in gets that returned a snapshot, nanoseconds (network and checks).
    pub get_nanos: u64,
    /// Time in puts, nanoseconds.
    pub put_nanos: u64,
    /// Successful calls of the shared prefix index (`crate::shared_index`).
    pub index_calls: u64,
}

/// The state of the Redis level, for `/readyz` and `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RemoteHealth {
    /// Whether the last call succeeded (true before the first call).
    pub up: bool,
    /// Since when it has been down (ms), when it is.
    pub down_for_ms: Option<u64>,
    /// The failure that started the current incident.
    pub last_error: Option<String>,
    /// The seed nodes.
    pub nodes: Vec<String>,
}

/// An outage of the cluster as this node sees it.
struct Incident {
    since: Instant,
    next_try: Instant,
    error: String,
}

struct State {
    conn: Option<ClusterConnection>,
    down: Option<Incident>,
    stats: RemoteStats,
}

/// Whose snapshot a value is: tenant id, model and unit key (all in its key and header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotId<'a> {
    /// `Tenant::id` of its tenant.
    pub tenant: u64,
    /// The model fingerprint.
    pub model: &'a ModelFingerprint,
    /// The unit key.
    pub key: &'a Key,
}

/// The window pool's Redis Cluster level. See the module docs.
pub struct RedisPool {
    client: ClusterClient,
    opts: RedisOptions,
    ttl_ms: u64,
    state: Mutex<State>,
}

impl std::fmt::Debug for RedisPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPool")
            .field("opts", &self.opts)
            .field("ttl_ms", &self.ttl_ms)
            .field("stats", &self.stats())
            .finish()
    }
}

/// The value stored for `id`: header (little-endian, `docs/cluster.md`) then `snapshot`.
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | magic `KVRW` |
/// | 4..8 | version (1) |
/// | 8..16 | snapshot length |
/// | 16..24 | tenant id |
/// | 24..40 | model fingerprint (first 16 bytes) |
/// | 40..72 | unit key |
/// | 72..76 | CRC-32C of bytes 0..72 and the snapshot |
/// | 76..80 | zero |
pub fn encode_value(id: SnapshotId<'_>, snapshot: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_BYTES + snapshot.len());
    v.extend_from_slice(&VALUE_MAGIC);
    v.extend_from_slice(&VALUE_VERSION.to_le_bytes());
    v.extend_from_slice(&(snapshot.len() as u64).to_le_bytes());
    v.extend_from_slice(&id.tenant.to_le_bytes());
    v.extend_from_slice(&id.model.short());
    v.extend_from_slice(id.key);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&v), snapshot);
    v.extend_from_slice(&crc.to_le_bytes());
    v.extend_from_slice(&[0; 4]);
    v.extend_from_slice(snapshot);
    v
}

/// The snapshot in `value` if it is a valid value of `id` (module docs); why not otherwise.
pub fn decode_value<'v>(
    id: SnapshotId<'_>,
    value: &'v [u8],
) -> std::result::Result<&'v [u8], String> {
    let (h, snapshot) = value
        .split_at_checked(HEADER_BYTES)
        .ok_or_else(|| format!("{} bytes, shorter than the header", value.len()))?;
    let u32_at = |o: usize| {
        h.get(o..o + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |o: usize| {
        h.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if h.get(..4) != Some(&VALUE_MAGIC[..]) {
        return Err("bad magic".into());
    }
    if u32_at(4) != Some(VALUE_VERSION) {
        return Err(format!("version {:?}, expected {VALUE_VERSION}", u32_at(4)));
    }
    if u64_at(8) != Some(snapshot.len() as u64) {
        return Err(format!(
            "header says {:?} snapshot bytes, the value holds {}",
            u64_at(8),
            snapshot.len()
        ));
    }
    if u64_at(16) != Some(id.tenant)
        || h.get(24..24 + MODEL_BYTES) != Some(&id.model.short()[..])
        || h.get(40..40 + KEY_BYTES) != Some(&id.key[..])
    {
        return Err("tenant, model or unit key differ from the key's".into());
    }
    let crc = crc32c::crc32c_append(crc32c::crc32c(&h[..72]), snapshot);
    if u32_at(72) != Some(crc) {
        return Err("CRC-32C mismatch".into());
    }
    Ok(snapshot)
}

/// Whether `e` means the cluster (or the part of it serving a slot) is unreachable, rather
/// than one command being refused.
fn is_outage(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    match e.kind() {
        K::Server(
            S::ClusterDown | S::TryAgain | S::MasterDown | S::BusyLoading | S::Moved | S::Ask,
        ) => true,
        K::Server(_) | K::Parse | K::UnexpectedReturnType | K::InvalidClientConfig => false,
        // I/O, no connection to the slot's node, timeouts.
        _ => true,
    }
}

impl RedisPool {
    /// A pool on the cluster of `opts.nodes` whose snapshots live `ttl_ms`. Connects lazily
    /// (on the first call), so a node starts while the cluster is down.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for no seed node, an empty or oversized key prefix, zero
    /// timeouts or TTL; [`Error::Redis`] for a seed URL the client refuses.
    pub fn new(opts: RedisOptions, ttl_ms: u64) -> Result<RedisPool> {
        let bad = |field: &'static str, reason: &str| Error::InvalidOption {
            field,
            reason: reason.into(),
        };
        if opts.nodes.is_empty() {
            return Err(bad("nodes", "no seed node"));
        }
        if opts.key_prefix.is_empty() || opts.key_prefix.len() > 64 {
            return Err(bad("key_prefix", "must be 1 to 64 bytes"));
        }
        if opts.connect_timeout_ms == 0 || opts.io_timeout_ms == 0 || opts.retry_ms == 0 {
            return Err(bad(
                "timeouts",
                "connect, I/O and retry times must be above 0",
            ));
        }
        if ttl_ms == 0 {
            return Err(bad("ttl_ms", "is 0"));
        }
        if let Some(n) = &opts.node_id
            && (n.is_empty()
                || n.len() > crate::shared_index::MAX_NODE_ID
                || !n.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(bad(
                "node_id",
                "must be 1 to 128 printable ASCII characters",
            ));
        }
        let client = ClusterClient::builder(opts.nodes.iter().map(String::as_str))
            .connection_timeout(Duration::from_millis(opts.connect_timeout_ms))
            .response_timeout(Duration::from_millis(opts.io_timeout_ms))
            // One retry (a MOVED after a failover is followed); more would stall the engine
            // while the cluster is down, and a miss costs only a replay.
            .retries(1)
            .min_retry_wait(10)
            .max_retry_wait(100)
            .build()
            .map_err(|source| Error::Redis {
                what: "invalid seed nodes",
                source,
            })?;
        Ok(RedisPool {
            client,
            opts,
            ttl_ms,
            state: Mutex::new(State {
                conn: None,
                down: None,
                stats: RemoteStats::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The options.
    pub fn options(&self) -> &RedisOptions {
        &self.opts
    }

    /// The key of `id`'s snapshot (module docs).
    pub fn value_key(&self, id: SnapshotId<'_>) -> String {
        format!(
            "{}w:{:016x}:{}:{}",
            self.opts.key_prefix,
            id.tenant,
            key_hex(&id.model.0, MODEL_BYTES),
            key_hex(id.key, KEY_BYTES)
        )
    }

    /// Runs `f` on the connection (made first when there is none), unless an incident's
    /// retry time has not come. `None` on any failure, handled as the module docs say.
    fn call<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut ClusterConnection) -> redis::RedisResult<T>,
    ) -> Option<(T, MutexGuard<'_, State>)> {
        let mut st = self.lock();
        let now = Instant::now();
        if st.down.as_ref().is_some_and(|d| now < d.next_try) {
            st.stats.skipped += 1;
            return None;
        }
        if st.conn.is_none() {
            match self.client.get_connection() {
                Ok(c) => st.conn = Some(c),
                Err(e) => {
                    self.failed(&mut st, what, &e);
                    return None;
                }
            }
        }
        let conn = st.conn.as_mut()?;
        match f(conn) {
            Ok(v) => {
                if let Some(d) = st.down.take() {
                    log::info!(
                        "redis cluster reachable again after {:.1} s; shared window pool back",
                        d.since.elapsed().as_secs_f64()
                    );
                }
                Some((v, st))
            }
            Err(e) => {
                self.failed(&mut st, what, &e);
                None
            }
        }
    }

    /// [`RedisPool::call`] for the shared index: counts the call as a get and gives the
    /// result only.
    pub(crate) fn call_counted<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut ClusterConnection) -> redis::RedisResult<T>,
    ) -> Option<T> {
        let (v, mut st) = self.call(what, f)?;
        st.stats.index_calls += 1;
        Some(v)
    }

    fn failed(&self, st: &mut State, what: &str, e: &redis::RedisError) {
        st.stats.errors += 1;
        if !is_outage(e) {
            // One command refused (a bug or a misconfigured cluster): not an incident.
            log::debug!("redis {what} failed: {e}");
            return;
        }
        st.conn = None;
        let now = Instant::now();
        let next_try = now + Duration::from_millis(self.opts.retry_ms);
        match &mut st.down {
            Some(d) => d.next_try = next_try,
            None => {
                st.stats.incidents += 1;
                log::warn!(
                    "redis cluster unreachable ({what}: {e}); window snapshots are local-only \
                     until it is back (retrying every {} ms)",
                    self.opts.retry_ms
                );
                st.down = Some(Incident {
                    since: now,
                    next_try,
                    error: e.to_string(),
                });
            }
        }
    }

    /// Stores `snapshot` for `id` with the pool's TTL as its expiry; whether Redis took it.
    pub fn put(&self, id: SnapshotId<'_>, snapshot: &[u8]) -> bool {
        let t = Instant::now();
        let key = self.value_key(id);
        let value = encode_value(id, snapshot);
        let ttl = self.ttl_ms;
        match self.call("SET", |c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(&value)
                .arg("PX")
                .arg(ttl)
                .exec(c)
        }) {
            Some(((), mut st)) => {
                st.stats.puts += 1;
                st.stats.bytes_put += snapshot.len() as u64;
                st.stats.put_nanos += t.elapsed().as_nanos() as u64;
                true
            }
            None => {
                self.lock().stats.put_failures += 1;
                false
            }
        }
    }

    /// Whether a snapshot of `id` exists (not checked: a damaged one is found a miss by the
    /// get that follows).
    pub fn contains(&self, id: SnapshotId<'_>) -> bool {
        let key = self.value_key(id);
        match self.call("EXISTS", |c| redis::cmd("EXISTS").arg(&key).query::<u64>(c)) {
            Some((n, mut st)) => {
                st.stats.gets += 1;
                n > 0
            }
            None => false,
        }
    }

    /// Copies `id`'s snapshot into `out` (replacing its contents) when Redis holds a valid
    /// one; false otherwise (absent, damaged, or Redis down).
    pub fn get(&self, id: SnapshotId<'_>, out: &mut Vec<u8>) -> bool {
        let t = Instant::now();
        let key = self.value_key(id);
        let Some((value, mut st)) = self.call("GET", |c| {
            redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(c)
        }) else {
            self.lock().stats.misses += 1;
            return false;
        };
        st.stats.gets += 1;
        let found = Self::check(&mut st.stats, id, &key, value.as_deref());
        if let Some(s) = found {
            out.clear();
            out.extend_from_slice(s);
            st.stats.get_nanos += t.elapsed().as_nanos() as u64;
        }
        found.is_some()
    }

    /// The snapshots of `ids`, read in one pipeline (one round trip per node serving them);
    /// `None` for each that is absent or damaged, every one `None` when Redis is down.
    pub fn get_many(&self, ids: &[SnapshotId<'_>]) -> Vec<Option<Vec<u8>>> {
        if ids.is_empty() {
            return Vec::new();
        }
        let t = Instant::now();
        let keys: Vec<String> = ids.iter().map(|&id| self.value_key(id)).collect();
        let Some((values, mut st)) = self.call("GET pipeline", |c| {
            let mut p = redis::cluster::cluster_pipe();
            for k in &keys {
                p.cmd("GET").arg(k);
            }
            p.query::<Vec<Option<Vec<u8>>>>(c)
        }) else {
            self.lock().stats.misses += ids.len() as u64;
            return vec![None; ids.len()];
        };
        st.stats.gets += ids.len() as u64;
        let mut out = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let v = values.get(i).and_then(|v| v.as_deref());
            out.push(Self::check(&mut st.stats, id, &keys[i], v).map(<[u8]>::to_vec));
        }
        if out.iter().any(Option::is_some) {
            st.stats.get_nanos += t.elapsed().as_nanos() as u64;
        }
        out
    }

    /// The snapshot in `value` if valid, counted as a hit, miss or damaged.
    fn check<'v>(
        stats: &mut RemoteStats,
        id: SnapshotId<'_>,
        key: &str,
        value: Option<&'v [u8]>,
    ) -> Option<&'v [u8]> {
        let Some(v) = value else {
            stats.misses += 1;
            return None;
        };
        match decode_value(id, v) {
            Ok(s) => {
                stats.hits += 1;
                stats.bytes_got += s.len() as u64;
                Some(s)
            }
            Err(why) => {
                stats.damaged += 1;
                stats.misses += 1;
                log::warn!("redis window snapshot {key} is damaged ({why}); treated as a miss");
                None
            }
        }
    }

    /// Deletes `id`'s snapshot (best effort: a failure leaves it to its TTL).
    pub fn remove(&self, id: SnapshotId<'_>) {
        let key = self.value_key(id);
        let _ = self.call("DEL", |c| redis::cmd("DEL").arg(&key).exec(c));
    }

    /// The TTL of snapshots (ms).
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Counters.
    pub fn stats(&self) -> RemoteStats {
        self.lock().stats.clone()
    }

    /// Up or down, since when, and why.
    pub fn health(&self) -> RemoteHealth {
        let st = self.lock();
        RemoteHealth {
            up: st.down.is_none(),
            down_for_ms: st
                .down
                .as_ref()
                .map(|d| d.since.elapsed().as_millis() as u64),
            last_error: st.down.as_ref().map(|d| d.error.clone()),
            nodes: self.opts.nodes.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_every_damage_is_refused() {
        let model = ModelFingerprint([7; 32]);
        let key = [3u8; 32];
        let id = SnapshotId {
            tenant: 42,
            model: &model,
            key: &key,
        };
        let snap: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let v = encode_value(id, &snap);
        assert_eq!(v.len(), HEADER_BYTES + snap.len());
        assert_eq!(decode_value(id, &v), Ok(&snap[..]));
        // Truncated, extended, one bit flipped anywhere: refused.
        assert!(decode_value(id, &v[..v.len() - 1]).is_err());
        assert!(decode_value(id, &v[..10]).is_err());
        let mut longer = v.clone();
        longer.push(0);
        assert!(decode_value(id, &longer).is_err());
        for at in [0, 5, 9, 17, 30, 50, 73, HEADER_BYTES, v.len() - 1] {
            let mut d = v.clone();
            d[at] ^= 0x10;
            assert!(decode_value(id, &d).is_err(), "flip at {at} accepted");
        }
        // Another tenant, model or key never accepts it.
        let other = SnapshotId { tenant: 43, ..id };
        assert!(decode_value(other, &v).is_err());
        let m2 = ModelFingerprint([8; 32]);
        assert!(decode_value(SnapshotId { model: &m2, ..id }, &v).is_err());
        let k2 = [4u8; 32];
        assert!(decode_value(SnapshotId { key: &k2, ..id }, &v).is_err());
    }

    #[test]
    fn options_are_checked() {
        assert!(RedisPool::new(RedisOptions::new(vec![]), 1000).is_err());
        let mut o = RedisOptions::new(vec!["redis://127.0.0.1:1".into()]);
        assert!(RedisPool::new(o.clone(), 0).is_err());
        o.key_prefix = String::new();
        assert!(RedisPool::new(o.clone(), 1000).is_err());
        o.key_prefix = "p:".into();
        o.retry_ms = 0;
        assert!(RedisPool::new(o, 1000).is_err());
        let bad = RedisOptions::new(vec!["http://nowhere".into()]);
        assert!(matches!(
            RedisPool::new(bad, 1000),
            Err(Error::Redis { .. })
        ));
    }
}
