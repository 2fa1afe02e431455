//! Queuing a unit: `put_unit` checks it, copies its new blocks into the write-behind queue and
//! returns a ticket; it never waits for the disk (a full queue refuses).

use std::sync::mpsc;

use kvstack_firmware_interface::record::{Key, crc32c};

use super::SsdStore;
use super::delete::DeleteOutcome;
use super::index::{BlockMeta, BlockState, Shared, State, bump, unpin};
use super::options::ReclaimReport;

use crate::key::{ModelFingerprint, Tenant, chain_keys, root_key};

use crate::{Error, Result};

/// Blocks per queued part of a long unit.
pub(super) const PART_BLOCKS: usize = 32;

/// A block a job must write.
pub(super) struct NewBlock {
    pub(super) key: Key,
    pub(super) parent: Key,
    pub(super) depth: u32,
    pub(super) tokens: u32,
    /// KV bytes followed by the token ids.
    pub(super) payload: Vec<u8>,
    /// CRC-32C of `payload`, computed by `put_unit` right after filling it (so the writer
    /// thread, which keeps the disk's queue full, only copies it).
    pub(super) crc: u32,
}

pub(super) struct UnitJob {
    pub(super) end: Key,
    pub(super) keys: Vec<Key>,
    pub(super) tokens: u64,
    pub(super) tenant_id: u64,
    pub(super) model: [u8; 16],
    pub(super) created: u64,
    pub(super) touch: bool,
    /// Blocks only: an earlier part of a long unit, whose last part commits it.
    pub(super) part: bool,
    pub(super) new_blocks: Vec<NewBlock>,
    pub(super) queued: u64,
    pub(super) reply: Option<mpsc::Sender<Result<()>>>,
    /// A delete of the unit (no blocks, no commit: a delete record) and where its outcome goes.
    pub(super) delete: Option<mpsc::Sender<Result<DeleteOutcome>>>,
    /// The last use its commit records (set by the writer).
    pub(super) last_used: u64,
}

impl UnitJob {
    pub(super) fn is_delete(&self) -> bool {
        self.delete.is_some()
    }
}

pub(super) enum Job {
    Unit(Box<UnitJob>),
    Flush(mpsc::Sender<()>),
    Reclaim(mpsc::Sender<Result<ReclaimReport>>),
    Shutdown,
}

/// The outcome of a unit write; [`UnitTicket::wait`] blocks until it is durable.
#[derive(Debug)]
pub struct UnitTicket {
    /// The unit's key (the key of its last block).
    pub key: Key,
    /// Tokens of the unit.
    pub tokens: u64,
    /// Blocks the unit shares with stored ones (not written again).
    pub shared_blocks: usize,
    /// Blocks queued for writing.
    pub new_blocks: usize,
    pub(super) rx: Option<mpsc::Receiver<Result<()>>>,
}

impl UnitTicket {
    /// Waits until the unit is durable (its commit is on stable storage) or failed.
    ///
    /// # Errors
    /// The write's error ([`Error::StoreFull`], [`Error::Poisoned`], [`Error::WriteFailed`]),
    /// or [`Error::Closed`].
    pub fn wait(self) -> Result<()> {
        match self.rx {
            None => Ok(()),
            Some(rx) => rx.recv().unwrap_or(Err(Error::Closed)),
        }
    }
}

/// Produces the KV payload of a unit's blocks on demand (only for blocks not yet stored).
pub trait BlockSource {
    /// Appends the KV bytes of block `index` (tokens `[first_token, first_token + tokens)`)
    /// to `out`.
    ///
    /// # Errors
    /// Whatever prevents building it; the unit is then not queued.
    fn block_payload(
        &self,
        index: usize,
        first_token: u64,
        tokens: usize,
        out: &mut Vec<u8>,
    ) -> Result<()>;
}

/// A unit to persist.
pub struct UnitWrite<'a> {
    /// The model whose KV it is.
    pub model: &'a ModelFingerprint,
    /// Its tenant.
    pub tenant: &'a Tenant,
    /// Every token of the unit (the prefix it covers).
    pub tokens: &'a [u32],
    /// Tokens per block.
    pub page_tokens: usize,
    /// The unit length must be a multiple of this (the largest compress ratio).
    pub align: usize,
    /// Block payloads.
    pub source: &'a dyn BlockSource,
}

impl SsdStore {
    /// Queues a unit for writing and returns at once (module docs). Blocks already stored (or
    /// queued) are shared, not written again; a unit that is already stored is only touched.
    ///
    /// # Errors
    /// [`Error::Unaligned`], [`Error::UnitTooLong`], [`Error::BlockTooLarge`],
    /// [`Error::QueueFull`] and [`Error::QuotaExceeded`] (counted), [`Error::ReadOnly`],
    /// [`Error::Poisoned`],
    /// [`Error::Closed`], and the source's errors.
    pub fn put_unit(&self, unit: &UnitWrite<'_>) -> Result<UnitTicket> {
        let sh = &self.shared;
        if sh.opts.read_only {
            return Err(Error::ReadOnly);
        }
        let n = unit.tokens.len() as u64;
        let align = unit.align.max(1) as u64;
        if n == 0 || !n.is_multiple_of(align) {
            return Err(Error::Unaligned { tokens: n, align });
        }
        let p = unit.page_tokens.max(1);
        let keys = chain_keys(unit.tokens, p, unit.model, unit.tenant);
        if keys.len() > sh.opts.max_unit_blocks {
            return Err(Error::UnitTooLong {
                blocks: keys.len(),
                max: sh.opts.max_unit_blocks,
            });
        }
        let Some(&end) = keys.last() else {
            return Err(Error::Unaligned { tokens: n, align });
        };
        let now = sh.clock.now_ms();
        let root = root_key(unit.model, unit.tenant);
        // Phase 1 (locked): share what exists, claim what does not.
        let mut missing = Vec::new();
        {
            let mut st = sh.lock();
            if let Some(reason) = &st.poisoned {
                return Err(Error::Poisoned {
                    reason: reason.clone(),
                });
            }
            // With a delete of it queued, the unit is written again (its commit then follows
            // the delete), not merely touched.
            let intact = st.units.contains_key(&end)
                && !st.deleting.contains_key(&end)
                && keys
                    .iter()
                    .all(|k| st.blocks.get(k).is_some_and(BlockMeta::visible));
            if intact {
                drop(st);
                self.touch_end(end, now);
                return Ok(UnitTicket {
                    key: end,
                    tokens: n,
                    shared_blocks: keys.len(),
                    new_blocks: 0,
                    rx: None,
                });
            }
            for (i, k) in keys.iter().enumerate() {
                let State {
                    blocks, segments, ..
                } = &mut *st;
                match blocks.get_mut(k) {
                    Some(b) if b.state != BlockState::Failed && !b.damaged => b.pinned += 1,
                    Some(b) => {
                        // Damaged or never written: write it again under the same key (the
                        // units that cover it become readable again once it is). Its old
                        // record, if any, is dead space.
                        if let Some(l) = b.loc()
                            && let Some(s) = segments.get_mut(&l.seg)
                            && s.blocks.remove(k)
                        {
                            s.live = s.live.saturating_sub(l.len);
                        }
                        b.state = BlockState::Pending;
                        b.damaged = false;
                        b.pinned += 1;
                        missing.push(i);
                    }
                    None => {
                        let first = (i * p) as u64;
                        let tokens = (n - first).min(p as u64) as u32;
                        let parent = if i == 0 { root } else { keys[i - 1] };
                        blocks.insert(
                            *k,
                            BlockMeta {
                                parent,
                                depth: i as u32 + 1,
                                tokens,
                                state: BlockState::Pending,
                                covered: 0,
                                pinned: 1,
                                damaged: false,
                                tenant: unit.tenant.id(),
                                charged: 0,
                            },
                        );
                        missing.push(i);
                    }
                }
            }
            // Within the tenant's SSD quota (`quota.rs`): its own oldest units make way.
            let needed = missing
                .iter()
                .map(|&i| {
                    let tokens = (n - (i * p) as u64).min(p as u64);
                    super::quota::block_record_bytes(sh, tokens, p as u64)
                })
                .sum();
            if let Err(e) = super::quota::make_room(&mut st, unit.tenant.id(), needed, &end, sh) {
                unpin(&mut st, &keys);
                return Err(e);
            }
        }
        // Phase 2 (unlocked): build the new blocks' payloads, and queue them in parts of
        // `PART_BLOCKS` so the writer starts on a long unit while the rest is being copied.
        // Parts carry blocks only; the last one carries the commit and the reply.
        let mut part = Vec::new();
        let mut part_bytes = 0u64;
        let mut new_count = 0usize;
        let job =
            |blocks: Vec<NewBlock>, queued: u64, reply: Option<mpsc::Sender<Result<()>>>| UnitJob {
                end,
                tokens: n,
                tenant_id: unit.tenant.id(),
                model: unit.model.short(),
                created: now,
                touch: false,
                part: reply.is_none(),
                new_blocks: blocks,
                queued,
                reply,
                delete: None,
                keys: keys.clone(),
                last_used: now,
            };
        // Reserves queue room for `bytes`, or explains why not.
        let reserve = |bytes: u64| -> Result<()> {
            let mut st = sh.lock();
            if bytes > 0 && st.queued_bytes + bytes > sh.opts.write_queue_bytes {
                bump(&sh.counters.refused_queue, 1);
                return Err(Error::QueueFull {
                    queued: st.queued_bytes,
                    limit: sh.opts.write_queue_bytes,
                });
            }
            st.queued_bytes += bytes;
            Ok(())
        };
        let undo = |e: Error| -> Error {
            // Parts already queued still write their blocks; with the pins gone those
            // records are dead space.
            let mut st = sh.lock();
            unpin(&mut st, &keys);
            e
        };
        for &i in &missing {
            let first = (i * p) as u64;
            let count = (n - first).min(p as u64) as usize;
            let mut payload = sh.payload_buffer();
            unit.source
                .block_payload(i, first, count, &mut payload)
                .map_err(undo)?;
            for t in &unit.tokens[first as usize..first as usize + count] {
                payload.extend_from_slice(&t.to_le_bytes());
            }
            if payload.len() > sh.opts.max_block_payload {
                return Err(undo(Error::BlockTooLarge {
                    bytes: payload.len(),
                    max: sh.opts.max_block_payload,
                }));
            }
            part_bytes += payload.len() as u64;
            part.push(NewBlock {
                key: keys[i],
                parent: if i == 0 { root } else { keys[i - 1] },
                depth: i as u32 + 1,
                tokens: count as u32,
                crc: crc32c(&payload),
                payload,
            });
            new_count += 1;
            if part.len() == PART_BLOCKS && new_count < missing.len() {
                reserve(part_bytes).map_err(undo)?;
                if let Err(e) = sh.send(Job::Unit(Box::new(job(
                    std::mem::take(&mut part),
                    part_bytes,
                    None,
                )))) {
                    return Err(undo(e));
                }
                part_bytes = 0;
            }
        }
        // Phase 3: the last part, with the commit.
        reserve(part_bytes).map_err(undo)?;
        bump(&sh.counters.blocks_shared, (keys.len() - new_count) as u64);
        let (tx, rx) = mpsc::channel();
        if let Err(e) = sh.send(Job::Unit(Box::new(job(part, part_bytes, Some(tx))))) {
            let mut st = sh.lock();
            st.queued_bytes = st.queued_bytes.saturating_sub(part_bytes);
            drop(st);
            return Err(undo(e));
        }
        Ok(UnitTicket {
            key: end,
            tokens: n,
            shared_blocks: keys.len() - new_count,
            new_blocks: new_count,
            rx: Some(rx),
        })
    }
}

/// Marks blocks a job will not write as failed (their pins are released with the job's).
pub(super) fn fail_blocks(shared: &Shared, blocks: &[NewBlock]) {
    let mut st = shared.lock();
    for b in blocks {
        if let Some(m) = st.blocks.get_mut(&b.key)
            && m.state == BlockState::Pending
        {
            m.state = BlockState::Failed;
        }
    }
}
