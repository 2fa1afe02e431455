//! Units in their stored byte formats, for engines outside kvstack (the KV-cache API of the
//! appliance, the C ABI): read a cached prefix's KV as bytes, store KV that another engine
//! computed, with every size checked against the model's geometry.
//!
//! A unit's bytes are its blocks' KV payloads, one block per `page_tokens` tokens (the last may
//! be shorter): for every KV source in layer order, the block's FP4 global entries (288 B each,
//! spec §5.2) then its MXFP4 indexer keys (68 B each, spec §5.3), one entry per `ratio` tokens;
//! and optionally the window snapshot at its end (`docs/tiers.md`, "DRAM window pool"). These
//! are exactly the bytes the SSD records hold (`docs/ssd-format.md`), without the token ids,
//! which the caller already has.

use crate::store::{BlockSource, DeleteTicket, ReadOutcome, UnitTicket, UnitWrite};
use crate::unit::{TierHit, block_payload_bytes, parse_snapshot};
use crate::{Error, Result, Tenant, Tiers};

/// A unit's KV in its stored byte formats.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnitData {
    /// Tokens the unit covers.
    pub tokens: u64,
    /// The KV payload of each block, first to last.
    pub blocks: Vec<Vec<u8>>,
    /// The window snapshot at the unit's end, when there is one.
    pub window: Option<Vec<u8>>,
}

impl UnitData {
    /// Bytes of KV payload.
    pub fn payload_bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.len() as u64).sum()
    }
}

/// The blocks of a [`UnitData`], handed to the store on demand.
struct GivenBlocks<'a>(&'a [Vec<u8>]);

impl BlockSource for GivenBlocks<'_> {
    fn block_payload(&self, index: usize, _: u64, _: usize, out: &mut Vec<u8>) -> Result<()> {
        let b = self.0.get(index).ok_or(Error::Payload {
            block: index,
            tokens: 0,
            reason: "no such block".into(),
        })?;
        out.extend_from_slice(b);
        Ok(())
    }
}

/// A pin taken by [`Tiers::pin_unit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinned {
    /// Tokens of the pinned unit (the longest stored prefix of the tokens asked for).
    pub tokens: u64,
    /// When the pin ends (the tiers' clock, ms).
    pub until_ms: u64,
    /// Whether its window snapshot is pinned in the DRAM pool too (the pool held one).
    pub window: bool,
}

/// What [`Tiers::read_unit_with`] read: the unit's length and its window snapshot; the blocks
/// went to the caller's sink.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnitRead {
    /// Tokens the unit covers.
    pub tokens: u64,
    /// Blocks handed to the sink.
    pub blocks: usize,
    /// Bytes handed to the sink.
    pub payload_bytes: u64,
    /// The window snapshot at the unit's end, when there is one.
    pub window: Option<Vec<u8>>,
}

impl Tiers {
    /// The bytes of the prefix `hit` found for `tokens` ([`Tiers::lookup`]): every block read
    /// and checked (header, key, CRC) under a lease, and the window snapshot when the pool
    /// holds one at its end. Reading counts as a use of the prefix.
    ///
    /// `Ok(None)` when a block has vanished (evicted since the lookup) or is damaged: a miss,
    /// never partial or damaged bytes.
    ///
    /// # Errors
    /// As [`Tiers::read_unit_with`].
    pub fn read_unit(&self, tokens: &[u32], hit: &TierHit) -> Result<Option<UnitData>> {
        let mut blocks = Vec::with_capacity(hit.store.keys.len());
        let read = self.read_unit_with(tokens, hit, |_, kv| {
            blocks.push(kv.to_vec());
            Ok(())
        })?;
        Ok(read.map(|r| UnitData {
            tokens: r.tokens,
            blocks,
            window: r.window,
        }))
    }

    /// As [`Tiers::read_unit`], but each block's bytes go to `sink(index, bytes)`, in order, as
    /// soon as the block is read and checked, so that a caller with a buffer of its own copies
    /// them once. Only checked bytes of this tenant's prefix reach the sink, but on a miss
    /// (`Ok(None)`) it may already have been given the blocks before the missing or damaged
    /// one: the caller discards them, as the unit is not complete.
    ///
    /// # Errors
    /// I/O set-up failures, the sink's errors; [`Error::Payload`] for a stored block whose
    /// size does not match the model (a store written for other dimensions).
    pub fn read_unit_with(
        &self,
        tokens: &[u32],
        hit: &TierHit,
        mut sink: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<Option<UnitRead>> {
        let g = self.geometry();
        if hit.tokens == 0 || hit.tokens > tokens.len() as u64 {
            return Ok(None);
        }
        let mut payload_bytes = 0u64;
        let outcome = self.store().read_blocks(&hit.store.keys, |i, h, kv| {
            let want = block_payload_bytes(g, u64::from(h.tokens));
            if kv.len() as u64 != want {
                return Err(Error::Payload {
                    block: i,
                    tokens: u64::from(h.tokens),
                    reason: format!("{} payload bytes, expected {want}", kv.len()),
                });
            }
            payload_bytes += want;
            sink(i, kv)
        })?;
        if outcome != ReadOutcome::Complete {
            return Ok(None);
        }
        let mut window = None;
        if let Some(key) = hit.key() {
            let mut snap = Vec::new();
            if self.get_window(hit.tenant, &key, &mut snap).is_some()
                && parse_snapshot(&snap, g).is_some_and(|s| s.tokens == hit.tokens)
            {
                window = Some(snap);
            }
        }
        Ok(Some(UnitRead {
            tokens: hit.tokens,
            blocks: hit.store.keys.len(),
            payload_bytes,
            window,
        }))
    }

    /// Stores `data` as the unit `tokens` of `tenant`, written behind like any unit: the
    /// returned ticket's [`UnitTicket::wait`] returns once it is durable. Blocks already stored
    /// are shared. Everything is checked before anything is queued: the unit length (`tokens`
    /// and `data.tokens` agree, not empty), the number of blocks and each block's size for its
    /// tokens, and the window snapshot (this model's layout, taken at the unit's end, nothing
    /// after it). A unit may end at any token; one that ends inside a compress group is only
    /// restored whole together with its window snapshot.
    ///
    /// # Errors
    /// [`Error::UnitRange`], [`Error::Payload`] naming the block and what is wrong, and the
    /// errors of [`crate::SsdStore::put_unit`] and of the window pool.
    pub fn write_unit(
        &self,
        tenant: &Tenant,
        tokens: &[u32],
        data: &UnitData,
    ) -> Result<UnitTicket> {
        let g = self.geometry();
        let n = tokens.len() as u64;
        let bad = |block: usize, tokens: u64, reason: String| Error::Payload {
            block,
            tokens,
            reason,
        };
        if n == 0 || n != data.tokens {
            return Err(Error::UnitRange {
                tokens: data.tokens,
                len: n,
            });
        }
        let p = g.page_tokens as u64;
        let want_blocks = n.div_ceil(p) as usize;
        if data.blocks.len() != want_blocks {
            return Err(bad(
                data.blocks.len().min(want_blocks),
                n,
                format!(
                    "{} blocks given, a unit of {n} tokens has {want_blocks} of {p} tokens",
                    data.blocks.len()
                ),
            ));
        }
        for (i, b) in data.blocks.iter().enumerate() {
            let t = (n - i as u64 * p).min(p);
            let want = block_payload_bytes(g, t);
            if b.len() as u64 != want {
                return Err(bad(
                    i,
                    t,
                    format!("{} payload bytes, expected {want}", b.len()),
                ));
            }
        }
        if let Some(w) = &data.window {
            let ok = parse_snapshot(w, g).is_some_and(|s| s.tokens == n && s.bytes == w.len());
            if !ok {
                return Err(bad(
                    want_blocks,
                    n,
                    "the window snapshot does not match the model or does not end at the unit"
                        .into(),
                ));
            }
        }
        let ticket = self.store().put_unit(&UnitWrite {
            model: self.model(),
            tenant,
            tokens,
            page_tokens: g.page_tokens,
            align: 1,
            source: &GivenBlocks(&data.blocks),
        })?;
        if let Some(w) = &data.window {
            self.put_window(tenant, ticket.key, w)?;
        }
        Ok(ticket)
    }

    /// Deletes the unit `tokens` of `tenant` ([`crate::SsdStore::delete_unit`]: durable once
    /// the ticket's `wait` returns) and drops its window snapshot from the DRAM pool at once,
    /// so nothing of the unit is served from either tier afterwards. Blocks it shares with
    /// longer units stay.
    ///
    /// # Errors
    /// As [`crate::SsdStore::delete_unit`].
    pub fn delete_unit(&self, tenant: &Tenant, tokens: &[u32]) -> Result<DeleteTicket> {
        let ticket =
            self.store()
                .delete_unit(self.model(), tenant, tokens, self.geometry().page_tokens)?;
        // Its shared prefix index entries go once the delete is durable (the store reports
        // the unit removed).
        self.remove_window(tenant.id(), &ticket.key);
        Ok(ticket)
    }

    /// Pins the longest stored prefix of `tokens` for `tenant` for `ttl_ms`: on the SSD it is
    /// not evicted past its retention, and its window snapshot, when the DRAM pool holds one,
    /// neither expires nor is evicted, until the pin ends (a later pin replaces the end). A
    /// delete still removes it. Pins live in memory only. `Ok(None)` when nothing is stored.
    ///
    /// # Errors
    /// [`Error::TooManyPins`] when the pool has half of its slots pinned already (the unit is
    /// then not pinned on the SSD either).
    pub fn pin_unit(&self, tenant: &Tenant, tokens: &[u32], ttl_ms: u64) -> Result<Option<Pinned>> {
        let hit = self.lookup(tokens, tenant);
        let Some(key) = hit.key().filter(|_| hit.tokens > 0) else {
            return Ok(None);
        };
        let until_ms = self.store().now_ms().saturating_add(ttl_ms);
        let window = self.pool().pin(&key, until_ms)?;
        if !self.store().pin(&key, until_ms) {
            // Evicted or deleted since the lookup.
            self.pool().unpin(&key);
            return Ok(None);
        }
        Ok(Some(Pinned {
            tokens: hit.tokens,
            until_ms,
            window,
        }))
    }

    /// Ends the pin of the longest stored prefix of `tokens` for `tenant`; returns whether
    /// one was held.
    pub fn unpin_unit(&self, tenant: &Tenant, tokens: &[u32]) -> bool {
        let hit = self.lookup(tokens, tenant);
        let Some(key) = hit.key().filter(|_| hit.tokens > 0) else {
            return false;
        };
        let window = self.pool().unpin(&key);
        self.store().unpin(&key) || window
    }
}
