//! Deleting a unit: `delete_unit` queues a delete, the write-behind thread writes a delete
//! record (a tombstone) in the commits' phase, the syncer makes it durable and only then
//! removes the unit from the index and acknowledges the ticket. (Spec §7 keeps a unit at least
//! 72 hours after its last use; a delete ends that on request, e.g. when a tenant withdraws
//! its data.)
//!
//! A delete record must outlive every older commit of its key on disk: recovery restores a
//! unit only from a commit newer than the key's newest delete (its horizon), so forgetting the
//! delete while an older commit and its blocks remain would bring the unit back. The store
//! therefore keeps a delete (counts it live in its segment, copies it when compacting) while
//! any segment that held a commit of the key when it was deleted is still on disk, and drops it
//! once those frees are durable. A later commit of the key (the unit put again) supersedes it.

use std::sync::mpsc;

use kvstack_firmware_interface::record::Key;

use super::SsdStore;
use super::index::{Loc, State, TombMeta, add_seg, remove_unit};
use super::put::{Job, UnitJob};

use crate::key::{ModelFingerprint, Tenant, chain_keys, root_key};
use crate::{Error, Result};

/// What an acknowledged delete found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteOutcome {
    /// A unit ended there; it is gone (lookups miss the blocks only it held, and a restart
    /// does not bring it back).
    Deleted,
    /// No unit ended there (never stored, already deleted, or evicted). The delete is durable
    /// all the same: a commit of the key still on disk (an evicted unit's, say) does not come
    /// back at a restart either.
    NotStored,
}

/// The outcome of a delete; [`DeleteTicket::wait`] blocks until it is durable.
#[derive(Debug)]
pub struct DeleteTicket {
    /// The unit's key (the key of its last block).
    pub key: Key,
    rx: Option<mpsc::Receiver<Result<DeleteOutcome>>>,
}

impl DeleteTicket {
    /// Waits until the delete is on stable storage (and the unit out of the index), or failed.
    ///
    /// # Errors
    /// The write's error ([`Error::Poisoned`], [`Error::WriteFailed`], [`Error::StoreFull`]),
    /// or [`Error::Closed`].
    pub fn wait(self) -> Result<DeleteOutcome> {
        match self.rx {
            None => Ok(DeleteOutcome::NotStored),
            Some(rx) => rx.recv().unwrap_or(Err(Error::Closed)),
        }
    }
}

impl SsdStore {
    /// Deletes the unit that ends after `tokens` (the unit [`SsdStore::put_unit`] stored for
    /// them: same model, tenant and page size) and returns at once; the ticket says when the
    /// delete is durable and what it found. Until then the unit is still served; afterwards
    /// lookups miss every block that no other unit holds (blocks shared with a longer or
    /// sibling unit stay, as that unit's), before and after a restart. A later put of the same
    /// tokens stores the unit again. Deleting a unit that is not stored is not an error: the
    /// ticket answers [`DeleteOutcome::NotStored`].
    ///
    /// A prefix that ends on a block boundary inside a longer unit is read from that unit's
    /// blocks, and reading it gives it a unit of its own again (docs/tiers.md, "Retention").
    ///
    /// # Errors
    /// [`Error::ReadOnly`], [`Error::Poisoned`], [`Error::Closed`].
    pub fn delete_unit(
        &self,
        model: &ModelFingerprint,
        tenant: &Tenant,
        tokens: &[u32],
        page_tokens: usize,
    ) -> Result<DeleteTicket> {
        let sh = &self.shared;
        if sh.opts.read_only {
            return Err(Error::ReadOnly);
        }
        let keys = chain_keys(tokens, page_tokens.max(1), model, tenant);
        let Some(&end) = keys.last() else {
            // No tokens: no unit can end there.
            return Ok(DeleteTicket {
                key: root_key(model, tenant),
                rx: None,
            });
        };
        let now = sh.clock.now_ms();
        {
            let mut st = sh.lock();
            if let Some(reason) = &st.poisoned {
                return Err(Error::Poisoned {
                    reason: reason.clone(),
                });
            }
            *st.deleting.entry(end).or_default() += 1;
        }
        let (tx, rx) = mpsc::channel();
        let job = UnitJob {
            end,
            keys: Vec::new(),
            tokens: tokens.len() as u64,
            tenant_id: tenant.id(),
            model: model.short(),
            created: now,
            touch: false,
            part: false,
            new_blocks: Vec::new(),
            queued: 0,
            reply: None,
            delete: Some(tx),
            last_used: now,
        };
        if let Err(e) = sh.send(Job::Unit(Box::new(job))) {
            end_deleting(&mut sh.lock(), &end);
            return Err(e);
        }
        Ok(DeleteTicket {
            key: end,
            rx: Some(rx),
        })
    }
}

/// A queued delete of `end` is settled (applied or failed).
pub(super) fn end_deleting(st: &mut State, end: &Key) {
    if let Some(n) = st.deleting.get_mut(end) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            st.deleting.remove(end);
        }
    }
}

/// Applies a durable delete record at `loc`: the unit (if any) leaves the index, its blocks
/// that nothing else needs become dead space, and the record is kept as long as an older
/// commit of the key may be on disk.
pub(super) fn apply_delete(st: &mut State, job: &UnitJob, loc: Loc) -> DeleteOutcome {
    let end = job.end;
    let (outcome, mut deps, tokens) = match remove_unit(st, &end) {
        Some(u) => (DeleteOutcome::Deleted, u.commit_segs, u.tokens),
        None => (
            DeleteOutcome::NotStored,
            st.orphans.remove(&end).unwrap_or_default(),
            job.tokens,
        ),
    };
    // An older delete of the key: this one covers all it covered.
    if let Some(old) = take_delete(st, &end) {
        for seg in old.deps {
            add_seg(&mut deps, seg);
        }
    }
    let t = TombMeta {
        loc,
        horizon: loc.seq,
        deps,
        tokens: tokens as u32,
        tenant_id: job.tenant_id,
        model: job.model,
        created: job.created,
    };
    if needed(st, &t) {
        if let Some(s) = st.segments.get_mut(&loc.seg) {
            s.live += loc.len;
            s.tombs.insert(end);
        }
        st.tombstones.insert(end, t);
    }
    outcome
}

/// Drops the kept delete of `end` (superseded by a newer commit of the key) and returns the
/// segments it had to outlive.
pub(super) fn supersede_delete(st: &mut State, end: &Key) -> Vec<u64> {
    take_delete(st, end).map(|t| t.deps).unwrap_or_default()
}

fn take_delete(st: &mut State, end: &Key) -> Option<TombMeta> {
    let t = st.tombstones.remove(end)?;
    if let Some(s) = st.segments.get_mut(&t.loc.seg)
        && s.tombs.remove(end)
    {
        s.live = s.live.saturating_sub(t.loc.len);
    }
    Some(t)
}

/// Whether segment `seg` may still be on disk (held, retired but leased, or freed without
/// the free being made durable).
fn on_disk(st: &State, seg: u64) -> bool {
    st.segments.contains_key(&seg)
        || st.retired.iter().any(|f| f.id == seg)
        || st.unsynced_frees.contains(&seg)
}

/// Whether a delete still has an older commit to outlive. One in its own segment does not
/// count: they are freed together.
fn needed(st: &State, t: &TombMeta) -> bool {
    t.deps
        .iter()
        .any(|&seg| seg != t.loc.seg && on_disk(st, seg))
}

/// Drops every kept delete that has nothing left to outlive (after segments were freed and
/// the frees made durable); their records become dead space.
pub(super) fn settle_deletes(st: &mut State) {
    let done: Vec<Key> = st
        .tombstones
        .iter()
        .filter(|(_, t)| !needed(st, t))
        .map(|(k, _)| *k)
        .collect();
    for k in done {
        take_delete(st, &k);
    }
}
