//! Pins: a unit the KV-cache API's `pin` names is not evicted past its retention until the
//! pin ends (`docs/tiers.md`, "Pins").
//!
//! A pin is a bounded lease, not a change of what is stored: it has an end on this store's
//! clock (the caller bounds it; the appliance by `limits.max_pin_ttl_ms`), lives in memory
//! only (a restart drops every pin, as it would a read lease), and an explicit delete still
//! removes a pinned unit. The eviction loops skip pinned units and take the next oldest, so a
//! pin can only keep space in use, never stop other units from being evicted.

use super::SsdStore;
use super::index::State;
use kvstack_firmware_interface::record::Key;

/// Whether `end` is pinned at `now`.
pub(super) fn is_pinned(st: &State, end: &Key, now: u64) -> bool {
    st.pins.get(end).is_some_and(|&until| until > now)
}

/// The oldest unit past `retention` at `now` that is not pinned: (last use, key).
pub(super) fn first_evictable(st: &State, now: u64, retention: u64) -> Option<(u64, Key)> {
    st.by_age
        .iter()
        .take_while(|(used, _)| used.saturating_add(retention) <= now)
        .find(|(_, end)| !is_pinned(st, end, now))
        .copied()
}

impl SsdStore {
    /// Now on this store's clock, ms: what pin ends and retention are measured on.
    pub fn now_ms(&self) -> u64 {
        self.shared.clock.now_ms()
    }

    /// Pins the unit ending at `end` until `until_ms` (this store's clock; a later pin of
    /// the same unit replaces the end). Pins that have ended are dropped here. Returns
    /// whether such a unit is stored (no pin is taken otherwise).
    pub fn pin(&self, end: &Key, until_ms: u64) -> bool {
        let now = self.shared.clock.now_ms();
        let mut st = self.shared.lock();
        st.pins.retain(|_, &mut until| until > now);
        if !st.units.contains_key(end) {
            return false;
        }
        st.pins.insert(*end, until_ms);
        true
    }

    /// Ends the pin of `end`; returns whether there was one that had not ended.
    pub fn unpin(&self, end: &Key) -> bool {
        let now = self.shared.clock.now_ms();
        self.shared
            .lock()
            .pins
            .remove(end)
            .is_some_and(|until| until > now)
    }

    /// Pins that have not ended.
    pub fn pins(&self) -> usize {
        let now = self.shared.clock.now_ms();
        self.shared
            .lock()
            .pins
            .values()
            .filter(|&&until| until > now)
            .count()
    }
}
