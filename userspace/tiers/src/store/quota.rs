//! Per-tenant SSD byte quotas (`docs/tiers.md`, "Quotas").
//!
//! What counts: the records of the blocks a tenant's units cover (header page and payload,
//! as laid out on disk). Commit and delete records are not counted: a commit names 32 bytes
//! per block against a block's ~230 KB, so leaving them out moves the total by < 0.1%. Blocks
//! are never shared across tenants (chained keys are salted by tenant), so each block is
//! charged to exactly one tenant, once however many of its units share it.
//!
//! A block is charged when a unit first covers it and released when the last one stops; the
//! index keeps the charge on the block, so what is released is exactly what was charged even if
//! compaction has moved the record since. Recovery rebuilds the totals from the records.
//!
//! Enforcement, in two places:
//! - `put_unit` (before queuing): a unit whose new blocks alone exceed the quota is refused
//!   ([`Error::QuotaExceeded`]); otherwise the tenant's own least recently used units that are
//!   not pinned are evicted (any age: a quota is the tenant's bound, not the store's
//!   retention) until the new blocks fit, and the put is refused if they still do not;
//! - publishing a unit: puts in flight together can still take the tenant past its quota, so
//!   once a unit is durable its tenant's other units make way in the same order. A unit is
//!   never evicted by its own publication; with every other unit pinned the tenant stays over
//!   (logged) until a pin ends.
//!
//! Another tenant's units are never touched.

use std::collections::HashMap;

use kvstack_firmware_interface::record::{Key, record_len};

use super::SsdStore;
use super::index::{BlockMeta, Shared, State, bump};
use super::pin::is_pinned;
use super::reclaim::evict_unit;
use crate::{Error, Result};

/// `b` is covered by one more unit; the first charges its record to its tenant.
pub(super) fn cover(b: &mut BlockMeta, tenant_bytes: &mut HashMap<u64, u64>) {
    b.covered += 1;
    if b.covered == 1 {
        b.charged = b.loc().map_or(0, |l| l.len);
        *tenant_bytes.entry(b.tenant).or_default() += b.charged;
    }
}

/// `b` is covered by one unit fewer; the last releases its charge.
pub(super) fn uncover(b: &mut BlockMeta, tenant_bytes: &mut HashMap<u64, u64>) {
    if b.covered == 0 {
        return;
    }
    b.covered -= 1;
    if b.covered == 0 {
        if let Some(t) = tenant_bytes.get_mut(&b.tenant) {
            *t = t.saturating_sub(b.charged);
            if *t == 0 {
                tenant_bytes.remove(&b.tenant);
            }
        }
        b.charged = 0;
    }
}

/// The bytes a new block of `tokens` of `page_tokens` may take on disk: the largest payload
/// scaled to its share of a page (a block's KV and token ids grow with its tokens), as a
/// record. Exact for a full block at the model's own block size; an upper bound otherwise.
pub(super) fn block_record_bytes(shared: &Shared, tokens: u64, page_tokens: u64) -> u64 {
    let max = shared.opts.max_block_payload as u64;
    let payload = (max * tokens.min(page_tokens)).div_ceil(page_tokens.max(1));
    record_len(payload)
}

/// The tenant of the unit ending at `end` (its last block's).
fn unit_tenant(st: &State, end: &Key) -> Option<u64> {
    st.blocks.get(end).map(|b| b.tenant)
}

/// The least recently used unit of `tenant` that may make way: not `keep`, not pinned at
/// `now`, not being deleted.
fn oldest_of(st: &State, tenant: u64, keep: Option<&Key>, now: u64) -> Option<Key> {
    st.by_age
        .iter()
        .map(|(_, k)| k)
        .find(|k| {
            Some(*k) != keep
                && unit_tenant(st, k) == Some(tenant)
                && !is_pinned(st, k, now)
                && !st.deleting.contains_key(*k)
        })
        .copied()
}

/// `tenant`'s used bytes and quota, if it has one.
fn usage(st: &State, tenant: u64) -> Option<(u64, u64)> {
    let quota = *st.quotas.get(&tenant)?;
    Some((st.tenant_bytes.get(&tenant).copied().unwrap_or(0), quota))
}

/// Evicts `tenant`'s least recently used units (not `keep`) until `needed` more bytes fit in
/// its quota; whether they do (always, for a tenant without a quota).
fn evict_until(
    st: &mut State,
    tenant: u64,
    needed: u64,
    keep: Option<&Key>,
    shared: &Shared,
) -> bool {
    let now = shared.clock.now_ms();
    loop {
        let Some((used, quota)) = usage(st, tenant) else {
            return true;
        };
        if used.saturating_add(needed) <= quota {
            return true;
        }
        let Some(victim) = oldest_of(st, tenant, keep, now) else {
            return false;
        };
        evict_unit(st, &victim, shared);
        bump(&shared.counters.quota_evicted, 1);
    }
}

/// Makes room in `tenant`'s quota for `needed` more bytes, for a put of the unit `keep`
/// (module docs). Refusals are counted.
///
/// # Errors
/// [`Error::QuotaExceeded`] when `needed` alone is over the quota (nothing is evicted then),
/// or when every unit that could make way is gone and it still does not fit.
pub(super) fn make_room(
    st: &mut State,
    tenant: u64,
    needed: u64,
    keep: &Key,
    shared: &Shared,
) -> Result<()> {
    let fits = match usage(st, tenant) {
        None => return Ok(()),
        Some((_, quota)) => needed <= quota && evict_until(st, tenant, needed, Some(keep), shared),
    };
    if fits {
        return Ok(());
    }
    bump(&shared.counters.refused_quota, 1);
    let (used, quota) = usage(st, tenant).unwrap_or_default();
    Err(Error::QuotaExceeded {
        used,
        needed,
        quota,
    })
}

/// After `end` of `tenant` is published: its tenant's other units make way until it is
/// within its quota again (see the module docs).
pub(super) fn settle(st: &mut State, tenant: u64, end: &Key, shared: &Shared) {
    let fits = evict_until(st, tenant, 0, Some(end), shared);
    over_quota_warning(st, tenant, fits);
}

fn over_quota_warning(st: &State, tenant: u64, fits: bool) {
    if !fits {
        let (used, quota) = usage(st, tenant).unwrap_or_default();
        log::warn!(
            "tenant {tenant:016x} is over its SSD quota ({used} bytes of {quota}) with every \
             unit that could make way pinned"
        );
    }
}

impl SsdStore {
    /// Replaces every tenant's SSD byte quota (by [`crate::Tenant::id`]): a tenant listed may
    /// keep at most that many bytes of blocks (module docs of `quota.rs`; `docs/tiers.md`), a
    /// tenant not listed is bounded by the store alone. A tenant over its quota (a lowered
    /// one, or units evicted by a quota that recovery found on disk again) is brought under it
    /// at once, its least recently used unpinned units first; with those all pinned it stays
    /// over until a pin ends (logged).
    pub fn set_quotas(&self, quotas: HashMap<u64, u64>) {
        let mut st = self.shared.lock();
        st.quotas = quotas;
        let tenants: Vec<u64> = st.quotas.keys().copied().collect();
        for t in tenants {
            let fits = evict_until(&mut st, t, 0, None, &self.shared);
            over_quota_warning(&st, t, fits);
        }
    }

    /// The SSD byte quota of the tenant with id `tenant`, if it has one.
    pub fn quota(&self, tenant: u64) -> Option<u64> {
        self.shared.lock().quotas.get(&tenant).copied()
    }

    /// Bytes of blocks the tenant with id `tenant` keeps on this store.
    pub fn tenant_bytes(&self, tenant: u64) -> u64 {
        self.shared
            .lock()
            .tenant_bytes
            .get(&tenant)
            .copied()
            .unwrap_or(0)
    }
}
