//! The DRAM window pool (spec §7): window-KV snapshots (every layer's last 128 FP8 rows plus
//! pending compressor state, about 2.7 MB at V4.1 dimensions) keyed like units, in pinned
//! memory capped at a share of the machine's RAM (10% by default), with a TTL and LRU
//! eviction.
//!
//! Rules:
//! - a snapshot expires `ttl_ms` after it was put (a later put of the same key renews it;
//!   reading does not): at `created + ttl_ms` and after, it is never returned;
//! - when the pool is full, a put first reuses an expired slot, then evicts the least
//!   recently used snapshot;
//! - the memory is one [`GrowableRegion`] reserved at the cap and committed slot by slot as the
//!   pool fills, locked when the locked-memory limit allows.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use kvstack_driver::GrowableRegion;
use kvstack_driver::pinned::PinnedOptions;
use kvstack_firmware_interface::record::Key;
use serde::Serialize;

use crate::clock::Clock;
use crate::{Error, Result};

/// Default TTL of a window snapshot: 5 minutes.
pub const DEFAULT_TTL_MS: u64 = 5 * 60 * 1000;

/// Default share of the machine's RAM: 10% (spec §7).
pub const DEFAULT_RAM_FRACTION: f64 = 0.10;

/// Options of [`WindowPool::new`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolOptions {
    /// Bytes the pool may hold; `None`: [`DEFAULT_RAM_FRACTION`] of `MemTotal`.
    pub capacity_bytes: Option<u64>,
    /// Time to live of a snapshot after its put (ms).
    pub ttl_ms: u64,
    /// Bytes of one slot (the largest snapshot); rounded up to 4 KiB.
    pub slot_bytes: usize,
    /// Huge page and locking policy.
    pub memory: PinnedOptions,
}

impl PoolOptions {
    /// Defaults for snapshots of at most `slot_bytes` bytes.
    pub fn new(slot_bytes: usize) -> PoolOptions {
        PoolOptions {
            capacity_bytes: None,
            ttl_ms: DEFAULT_TTL_MS,
            slot_bytes,
            memory: PinnedOptions::default(),
        }
    }
}

/// Counters and sizes of the pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// The cap in bytes.
    pub capacity_bytes: u64,
    /// Bytes of one slot.
    pub slot_bytes: u64,
    /// Slots at most.
    pub slots: u64,
    /// Snapshots held (expired ones included until reclaimed).
    pub entries: u64,
    /// Committed (resident) bytes.
    pub committed_bytes: u64,
    /// Committed bytes locked in memory.
    pub locked_bytes: u64,
    /// Puts.
    pub puts: u64,
    /// Gets that returned a snapshot.
    pub hits: u64,
    /// Gets that found nothing.
    pub misses: u64,
    /// Gets and `contains` checks (lookups) that found an expired snapshot and dropped it.
    pub expired: u64,
    /// Snapshots evicted to make room (least recently used).
    pub evicted: u64,
    /// Bytes copied into the pool by puts.
    pub bytes_put: u64,
    /// Bytes handed out by gets that returned a snapshot.
    pub bytes_got: u64,
    /// Time spent copying snapshots in by puts, nanoseconds (the copy only, under the lock).
    pub put_nanos: u64,
    /// Time spent in the readers of gets that returned a snapshot, nanoseconds.
    pub get_nanos: u64,
    /// Snapshots of owners at their quota that replaced one of the same owner's.
    pub quota_evicted: u64,
    /// Puts not stored: the owner was at its quota with every snapshot of its own pinned (or
    /// a quota of zero slots).
    pub quota_refused: u64,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: Key,
    /// Whose snapshot it is (`Tenant::id`; 0 for puts without an owner): what quotas count.
    owner: u64,
    len: usize,
    created: u64,
    /// LRU stamp (a counter, so ties never happen).
    stamp: u64,
}

struct Inner {
    region: GrowableRegion,
    slot_bytes: usize,
    max_slots: usize,
    slots: Vec<Option<Slot>>,
    map: HashMap<Key, usize>,
    lru: BTreeSet<(u64, usize)>,
    free: Vec<usize>,
    next_stamp: u64,
    stats: PoolStats,
    /// Pinned keys and the end of their pins: neither expired nor evicted meanwhile.
    pins: HashMap<Key, u64>,
    /// Slots held per owner.
    owned: HashMap<u64, usize>,
}

/// Whether `key` holds a pin that has not ended at `now`.
fn pinned(pins: &HashMap<Key, u64>, key: &Key, now: u64) -> bool {
    pins.get(key).is_some_and(|&until| until > now)
}

impl Inner {
    fn remove(&mut self, i: usize) {
        if let Some(Some(s)) = self.slots.get(i).copied() {
            self.disown(s.owner);
            self.map.remove(&s.key);
            self.lru.remove(&(s.stamp, i));
            self.slots[i] = None;
            self.free.push(i);
        }
    }

    /// One slot fewer for `owner`.
    fn disown(&mut self, owner: u64) {
        if let Some(n) = self.owned.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.owned.remove(&owner);
            }
        }
    }

    fn touch(&mut self, i: usize) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(Some(s)) = self.slots.get_mut(i) {
            self.lru.remove(&(s.stamp, i));
            s.stamp = stamp;
            self.lru.insert((stamp, i));
        }
    }

    fn bytes(&self, i: usize, len: usize) -> &[u8] {
        let off = i * self.slot_bytes;
        self.region
            .as_slice()
            .get(off..off + len)
            .unwrap_or_default()
    }
}

/// The DRAM window pool. See the module docs.
pub struct WindowPool {
    inner: Mutex<Inner>,
    clock: Arc<dyn Clock>,
    ttl_ms: u64,
}

impl std::fmt::Debug for WindowPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowPool")
            .field("ttl_ms", &self.ttl_ms)
            .field("stats", &self.stats())
            .finish()
    }
}

/// `MemTotal` of this machine, if readable.
pub fn machine_ram_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total = kvstack_driver::probe::parse_meminfo(&text).total_bytes;
    (total > 0).then_some(total)
}

impl WindowPool {
    /// A pool with `opts`. Reserves address space for the cap; commits nothing yet.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a zero slot size or a cap below one slot,
    /// [`Error::Memory`] when the reservation fails.
    pub fn new(opts: PoolOptions, clock: Arc<dyn Clock>) -> Result<WindowPool> {
        if opts.slot_bytes == 0 {
            return Err(Error::InvalidOption {
                field: "slot_bytes",
                reason: "is 0".into(),
            });
        }
        let slot_bytes = opts.slot_bytes.next_multiple_of(4096);
        let capacity = match opts.capacity_bytes {
            Some(c) => c,
            None => {
                let ram = machine_ram_bytes().unwrap_or(8 << 30);
                (ram as f64 * DEFAULT_RAM_FRACTION) as u64
            }
        };
        let max_slots = usize::try_from(capacity / slot_bytes as u64).unwrap_or(usize::MAX);
        if max_slots == 0 {
            return Err(Error::InvalidOption {
                field: "capacity_bytes",
                reason: format!("{capacity} bytes do not hold one {slot_bytes}-byte snapshot"),
            });
        }
        let region =
            GrowableRegion::new(max_slots * slot_bytes, opts.memory).map_err(Error::Memory)?;
        Ok(WindowPool {
            inner: Mutex::new(Inner {
                region,
                slot_bytes,
                max_slots,
                slots: Vec::new(),
                map: HashMap::new(),
                lru: BTreeSet::new(),
                free: Vec::new(),
                next_stamp: 0,
                pins: HashMap::new(),
                owned: HashMap::new(),
                stats: PoolStats {
                    capacity_bytes: capacity,
                    slot_bytes: slot_bytes as u64,
                    slots: max_slots as u64,
                    ..PoolStats::default()
                },
            }),
            clock,
            ttl_ms: opts.ttl_ms,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `s` has expired at `now`: past its TTL and not pinned.
    fn expired(&self, pins: &HashMap<Key, u64>, s: &Slot, now: u64) -> bool {
        now >= s.created.saturating_add(self.ttl_ms) && !pinned(pins, &s.key, now)
    }

    /// Pins the snapshot under `key` until `until_ms` (this pool's clock): it neither
    /// expires nor is evicted meanwhile. Pins that have ended are dropped here. At most half
    /// of the pool's slots may be pinned at once, so that pins never starve it.
    ///
    /// Returns whether the pool holds an unexpired snapshot under `key` (no pin is taken
    /// otherwise).
    ///
    /// # Errors
    /// [`Error::TooManyPins`] when half of the slots are pinned already.
    pub fn pin(&self, key: &Key, until_ms: u64) -> Result<bool> {
        let now = self.clock.now_ms();
        let mut g = self.lock();
        let inner = &mut *g;
        inner.pins.retain(|_, &mut until| until > now);
        let Some(s) = inner.map.get(key).and_then(|&i| inner.slots[i]) else {
            return Ok(false);
        };
        if self.expired(&inner.pins, &s, now) {
            return Ok(false);
        }
        let limit = inner.max_slots / 2;
        if !inner.pins.contains_key(key) && inner.pins.len() >= limit {
            return Err(Error::TooManyPins { limit });
        }
        inner.pins.insert(*key, until_ms);
        Ok(true)
    }

    /// Ends the pin of `key`; returns whether there was one that had not ended.
    pub fn unpin(&self, key: &Key) -> bool {
        let now = self.clock.now_ms();
        self.lock()
            .pins
            .remove(key)
            .is_some_and(|until| until > now)
    }

    /// Slots `owner` holds now (each takes `slot_bytes` of the cap).
    pub fn owned_slots(&self, owner: u64) -> usize {
        self.lock().owned.get(&owner).copied().unwrap_or(0)
    }

    /// Bytes of one slot: a quota in bytes allows `quota / slot_bytes` snapshots.
    pub fn slot_bytes(&self) -> usize {
        self.lock().slot_bytes
    }

    /// Stores `bytes` under `key` for `owner`, who may hold at most `quota` slots: an owner at
    /// its quota replaces its own expired snapshot, else its own least recently used unpinned
    /// one, never another owner's. Returns `false` (counted in `quota_refused`, nothing
    /// stored) when the owner has no slot it may reuse; a replacement of `key` itself always
    /// fits. `quota = None` is [`WindowPool::put`].
    ///
    /// # Errors
    /// Those of [`WindowPool::put`].
    pub fn put_owned(
        &self,
        key: Key,
        bytes: &[u8],
        owner: u64,
        quota: Option<usize>,
    ) -> Result<bool> {
        let now = self.clock.now_ms();
        let mut g = self.lock();
        let inner = &mut *g;
        // An oversized snapshot is refused by the put below before anything is evicted.
        if let Some(quota) = quota.filter(|_| bytes.len() <= inner.slot_bytes) {
            // Own snapshots go until one slot is left under the quota (more than one after
            // the quota was lowered); a replacement of `key` takes no new slot.
            while !inner.map.contains_key(&key)
                && inner.owned.get(&owner).copied().unwrap_or(0) >= quota
            {
                let own = |i: usize| inner.slots[i].filter(|s| s.owner == owner);
                let expired = (0..inner.slots.len())
                    .filter_map(|i| own(i).filter(|s| self.expired(&inner.pins, s, now)))
                    .map(|s| s.key)
                    .next();
                let victim = expired.or_else(|| {
                    inner
                        .lru
                        .iter()
                        .filter_map(|&(_, i)| own(i))
                        .find(|s| !pinned(&inner.pins, &s.key, now))
                        .map(|s| s.key)
                });
                let Some(&i) = victim.and_then(|v| inner.map.get(&v)) else {
                    inner.stats.quota_refused += 1;
                    return Ok(false);
                };
                inner.remove(i);
                inner.stats.quota_evicted += 1;
            }
        }
        self.put_locked(inner, now, key, bytes, owner)?;
        Ok(true)
    }

    /// Stores `bytes` under `key` (replacing any snapshot there).
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a snapshot larger than a slot; [`Error::Memory`] when
    /// memory cannot be committed.
    pub fn put(&self, key: Key, bytes: &[u8]) -> Result<()> {
        self.put_as(key, bytes, 0)
    }

    fn put_as(&self, key: Key, bytes: &[u8], owner: u64) -> Result<()> {
        let now = self.clock.now_ms();
        self.put_locked(&mut self.lock(), now, key, bytes, owner)
    }

    /// [`WindowPool::put`] under the pool's lock (so a quota check and its put are one step).
    fn put_locked(
        &self,
        inner: &mut Inner,
        now: u64,
        key: Key,
        bytes: &[u8],
        owner: u64,
    ) -> Result<()> {
        if bytes.len() > inner.slot_bytes {
            return Err(Error::InvalidOption {
                field: "slot_bytes",
                reason: format!(
                    "a {}-byte snapshot does not fit a {}-byte slot",
                    bytes.len(),
                    inner.slot_bytes
                ),
            });
        }
        let i = if let Some(&i) = inner.map.get(&key) {
            i
        } else if let Some(i) = inner.free.pop() {
            i
        } else if inner.slots.len() < inner.max_slots {
            let i = inner.slots.len();
            inner
                .region
                .commit((i + 1) * inner.slot_bytes)
                .map_err(Error::Memory)?;
            inner.slots.push(None);
            i
        } else {
            // Full: an expired snapshot first (oldest first), else the least recently used.
            let expired = inner
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| {
                    s.filter(|s| self.expired(&inner.pins, s, now))
                        .map(|s| (s.created, i))
                })
                .min()
                .map(|(_, i)| i);
            let victim = match expired {
                Some(i) => i,
                None => {
                    // The least recently used snapshot that is not pinned (at most half are).
                    let unpinned = inner.lru.iter().find(|&&(_, i)| {
                        inner.slots[i].is_none_or(|s| !pinned(&inner.pins, &s.key, now))
                    });
                    let Some(&(_, i)) = unpinned else {
                        return Err(Error::InvalidOption {
                            field: "capacity_bytes",
                            reason: "the pool has no slot that is not pinned".into(),
                        });
                    };
                    inner.stats.evicted += 1;
                    i
                }
            };
            inner.remove(victim);
            inner.free.retain(|&f| f != victim);
            victim
        };
        let off = i * inner.slot_bytes;
        let copy = std::time::Instant::now();
        if let Some(dst) = inner.region.as_mut_slice().get_mut(off..off + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        inner.stats.put_nanos += copy.elapsed().as_nanos() as u64;
        inner.stats.bytes_put += bytes.len() as u64;
        if let Some(Some(old)) = inner.slots.get(i).copied() {
            inner.lru.remove(&(old.stamp, i));
            inner.disown(old.owner);
        }
        *inner.owned.entry(owner).or_insert(0) += 1;
        inner.slots[i] = Some(Slot {
            key,
            owner,
            len: bytes.len(),
            created: now,
            stamp: 0,
        });
        inner.map.insert(key, i);
        inner.touch(i);
        inner.stats.puts += 1;
        Ok(())
    }

    /// Calls `f` with the snapshot under `key` if there is one that has not expired (an
    /// expired one is dropped), and counts a use for LRU.
    pub fn get_with<R>(&self, key: &Key, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let now = self.clock.now_ms();
        let mut g = self.lock();
        let inner = &mut *g;
        let Some(&i) = inner.map.get(key) else {
            inner.stats.misses += 1;
            return None;
        };
        let Some(Some(s)) = inner.slots.get(i).copied() else {
            inner.stats.misses += 1;
            return None;
        };
        if self.expired(&inner.pins, &s, now) {
            inner.remove(i);
            inner.stats.expired += 1;
            inner.stats.misses += 1;
            return None;
        }
        inner.touch(i);
        inner.stats.hits += 1;
        let copy = std::time::Instant::now();
        let out = f(inner.bytes(i, s.len));
        inner.stats.get_nanos += copy.elapsed().as_nanos() as u64;
        inner.stats.bytes_got += s.len as u64;
        Some(out)
    }

    /// Copies the snapshot under `key` into `out` (replacing its contents); false when there
    /// is none or it expired.
    pub fn get(&self, key: &Key, out: &mut Vec<u8>) -> bool {
        self.get_with(key, |b| {
            out.clear();
            out.extend_from_slice(b);
        })
        .is_some()
    }

    /// Whether an unexpired snapshot is held under `key` (not counted as a use). An expired
    /// one is dropped and counted in [`PoolStats::expired`], as by a get.
    pub fn contains(&self, key: &Key) -> bool {
        let now = self.clock.now_ms();
        let mut g = self.lock();
        let Some(&i) = g.map.get(key) else {
            return false;
        };
        let Some(s) = g.slots.get(i).copied().flatten() else {
            return false;
        };
        if self.expired(&g.pins, &s, now) {
            g.remove(i);
            g.stats.expired += 1;
            return false;
        }
        true
    }

    /// Drops the snapshot under `key`, if any, and its pin.
    pub fn remove(&self, key: &Key) {
        let mut g = self.lock();
        g.pins.remove(key);
        if let Some(&i) = g.map.get(key) {
            g.remove(i);
        }
    }

    /// The TTL in milliseconds.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Counters and sizes.
    pub fn stats(&self) -> PoolStats {
        let g = self.lock();
        PoolStats {
            entries: g.map.len() as u64,
            committed_bytes: g.region.committed() as u64,
            locked_bytes: g.region.locked_bytes() as u64,
            ..g.stats.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use kvstack_driver::pinned::{HugePages, Locking};

    const MEM: PinnedOptions = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };

    fn pool(slots: u64, ttl: u64) -> (WindowPool, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let p = WindowPool::new(
            PoolOptions {
                capacity_bytes: Some(slots * 8192),
                ttl_ms: ttl,
                slot_bytes: 8192,
                memory: MEM,
            },
            clock.clone(),
        )
        .unwrap();
        (p, clock)
    }

    #[test]
    fn ttl_boundary_is_exclusive() {
        let (p, clock) = pool(2, 1000);
        p.put([1; 32], &[7; 100]).unwrap();
        clock.advance(999);
        let mut out = Vec::new();
        assert!(p.contains(&[1; 32]) && p.get(&[1; 32], &mut out));
        assert_eq!(out, vec![7; 100]);
        clock.advance(1);
        assert!(!p.contains(&[1; 32]));
        assert!(!p.get(&[1; 32], &mut out));
        assert_eq!(p.stats().expired, 1);
        assert_eq!(p.stats().entries, 0);
        assert_eq!((p.stats().bytes_put, p.stats().bytes_got), (100, 100));
    }

    #[test]
    fn lru_eviction_prefers_expired_then_least_recent() {
        let (p, clock) = pool(2, 1000);
        p.put([1; 32], &[1]).unwrap();
        clock.advance(10);
        p.put([2; 32], &[2]).unwrap();
        // Use 1, so 2 is least recently used.
        assert!(p.get_with(&[1; 32], |_| ()).is_some());
        p.put([3; 32], &[3]).unwrap();
        assert!(p.contains(&[1; 32]) && !p.contains(&[2; 32]) && p.contains(&[3; 32]));
        assert_eq!(p.stats().evicted, 1);
        // 1 expires first (put at t0); a new put reuses its slot rather than evicting 3.
        clock.advance(995);
        p.put([4; 32], &[4]).unwrap();
        assert!(p.contains(&[3; 32]) && p.contains(&[4; 32]));
        assert_eq!(p.stats().evicted, 1);
        assert!(p.put([5; 32], &[0; 8193]).is_err());
    }

    #[test]
    fn pinned_snapshots_neither_expire_nor_get_evicted_until_the_pin_ends() {
        let (p, clock) = pool(4, 1000);
        p.put([1; 32], &[1]).unwrap();
        p.put([2; 32], &[2]).unwrap();
        let end = clock.now_ms() + 5000;
        assert!(p.pin(&[1; 32], end).unwrap());
        // Nothing to pin: no snapshot under the key.
        assert!(!p.pin(&[9; 32], end).unwrap());
        // Past the TTL: 2 expires, the pinned 1 does not.
        clock.advance(1000);
        assert!(p.contains(&[1; 32]) && !p.contains(&[2; 32]));
        // At most half of the slots (2 of 4) may be pinned.
        p.put([3; 32], &[3]).unwrap();
        p.put([4; 32], &[4]).unwrap();
        assert!(p.pin(&[3; 32], end).unwrap());
        assert!(matches!(
            p.pin(&[4; 32], end),
            Err(Error::TooManyPins { limit: 2 })
        ));
        // Re-pinning a pinned key moves its end and is not a new pin.
        assert!(p.pin(&[3; 32], end + 1).unwrap());
        // A full pool evicts the least recently used unpinned snapshot, never a pinned one,
        // though 1 is the least recently used of all.
        p.put([5; 32], &[5]).unwrap();
        p.put([6; 32], &[6]).unwrap();
        p.put([7; 32], &[7]).unwrap();
        assert!(p.contains(&[1; 32]) && p.contains(&[3; 32]));
        assert!(p.contains(&[7; 32]));
        // Unpin ends a pin once; a removed snapshot loses its pin.
        assert!(p.unpin(&[3; 32]));
        assert!(!p.unpin(&[3; 32]));
        p.remove(&[1; 32]);
        assert!(!p.unpin(&[1; 32]));
        // After its end, a pin no longer holds: the snapshot expires as usual.
        p.put([8; 32], &[8]).unwrap();
        assert!(p.pin(&[8; 32], clock.now_ms() + 10).unwrap());
        clock.advance(1000);
        assert!(!p.contains(&[8; 32]));
    }

    #[test]
    fn an_owner_at_its_quota_replaces_only_its_own_snapshots() {
        let (p, clock) = pool(6, 1000);
        let (a, b) = (11, 22);
        // b fills half the pool without a quota; a lowered quota shrinks it on its next put.
        for k in 0..3u8 {
            assert!(p.put_owned([100 + k; 32], &[k], b, None).unwrap());
        }
        // a may hold 2: its third put replaces its least recently used, never b's.
        assert!(p.put_owned([1; 32], &[1], a, Some(2)).unwrap());
        clock.advance(1);
        assert!(p.put_owned([2; 32], &[2], a, Some(2)).unwrap());
        assert!(p.get_with(&[1; 32], |_| ()).is_some());
        assert!(p.put_owned([3; 32], &[3], a, Some(2)).unwrap());
        assert_eq!((p.owned_slots(a), p.owned_slots(b)), (2, 3));
        assert!(p.contains(&[1; 32]) && !p.contains(&[2; 32]) && p.contains(&[3; 32]));
        assert!((0..3u8).all(|k| p.contains(&[100 + k; 32])));
        assert_eq!(p.stats().quota_evicted, 1);
        assert_eq!(p.stats().evicted, 0);
        // Replacing a key it holds is no new slot.
        assert!(p.put_owned([3; 32], &[9], a, Some(2)).unwrap());
        assert_eq!(p.owned_slots(a), 2);
        // With both of its snapshots pinned, a's next put is not kept (and evicts nothing).
        assert!(p.pin(&[1; 32], clock.now_ms() + 10_000).unwrap());
        assert!(p.pin(&[3; 32], clock.now_ms() + 10_000).unwrap());
        assert!(!p.put_owned([4; 32], &[4], a, Some(2)).unwrap());
        assert_eq!(p.stats().quota_refused, 1);
        assert!(!p.contains(&[4; 32]) && p.contains(&[1; 32]) && p.contains(&[3; 32]));
        // A quota of zero keeps nothing; an oversized snapshot evicts nothing before failing.
        assert!(!p.put_owned([5; 32], &[5], 33, Some(0)).unwrap());
        assert!(p.put_owned([6; 32], &[0; 8193], b, Some(3)).is_err());
        assert_eq!(p.owned_slots(b), 3);
        // Removal gives the slot back to its owner's count.
        p.remove(&[100; 32]);
        assert_eq!(p.owned_slots(b), 2);
        assert!(p.put_owned([7; 32], &[7], b, Some(1)).unwrap());
        assert_eq!(p.owned_slots(b), 1);
        assert!(p.contains(&[7; 32]) && !p.contains(&[101; 32]) && !p.contains(&[102; 32]));
    }
}
