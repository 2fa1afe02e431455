//! Reads: prefix lookups, block reads under leases (every block checked before its bytes are
//! handed out), and recording last uses.

use std::collections::HashMap;
use std::sync::Arc;

use kvstack_driver::blockio::{BlockEngine, Completion, IoOp, OpKind};
use kvstack_firmware_interface::record::{ALIGN, Key, RecordFlags, RecordHeader, RecordKind};

use super::SsdStore;
use super::index::{BlockMeta, Loc, ReadCtx, State, UnitMeta, bump, chain_of};
use super::open::engine_for;
use super::put::{Job, UnitJob};

use crate::key::{ModelFingerprint, Tenant, block_key, chain_keys, root_key};
use crate::{Error, Result};

/// The longest stored prefix of a token sequence.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreHit {
    /// Keys of the matched blocks, first to last.
    pub keys: Vec<Key>,
    /// Tokens of each matched block.
    pub block_tokens: Vec<u32>,
    /// Tokens matched.
    pub tokens: u64,
}

impl StoreHit {
    /// The key of the last matched block (the unit key of the prefix), if any.
    pub fn end(&self) -> Option<Key> {
        self.keys.last().copied()
    }
}

/// How a read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Every block was delivered.
    Complete,
    /// Blocks before `at` were delivered; block `at` is not (or no longer) stored.
    Miss {
        /// First block not delivered.
        at: usize,
    },
    /// Blocks before `at` were delivered; block `at` failed its checks (reported, counted,
    /// and no longer visible).
    Damaged {
        /// First block not delivered.
        at: usize,
    },
}

impl SsdStore {
    /// The longest stored prefix of `tokens` for `model` and `tenant`: whole blocks of
    /// `page_tokens`, then possibly one shorter block that ends a stored unit. Does not count
    /// as a use; reading the blocks does.
    pub fn lookup(
        &self,
        model: &ModelFingerprint,
        tenant: &Tenant,
        tokens: &[u32],
        page_tokens: usize,
    ) -> StoreHit {
        let sh = &self.shared;
        bump(&sh.counters.lookups, 1);
        let p = page_tokens.max(1);
        let full = tokens.len() / p;
        // Hash outside the lock.
        let keys = chain_keys(&tokens[..full * p], p, model, tenant);
        let root = root_key(model, tenant);
        let st = sh.lock();
        let mut hit = StoreHit::default();
        for k in keys {
            if !st.blocks.get(&k).is_some_and(BlockMeta::visible) {
                break;
            }
            hit.keys.push(k);
            hit.block_tokens.push(p as u32);
        }
        let matched = hit.keys.len() * p;
        let parent = hit.keys.last().copied().unwrap_or(root);
        let rest = &tokens[matched..];
        if let Some(kids) = st.children.get(&parent) {
            let mut cands: Vec<(u32, Key)> = kids
                .iter()
                .filter(|(t, _)| (*t as usize) < p && (*t as usize) <= rest.len())
                .copied()
                .collect();
            cands.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
            for (t, k) in cands {
                if st.blocks.get(&k).is_some_and(BlockMeta::visible)
                    && block_key(&parent, &rest[..t as usize], model, tenant) == k
                {
                    hit.keys.push(k);
                    hit.block_tokens.push(t);
                    break;
                }
            }
        }
        drop(st);
        hit.tokens = hit.block_tokens.iter().map(|&t| u64::from(t)).sum();
        if hit.tokens > 0 {
            bump(&sh.counters.hits, 1);
        }
        hit
    }

    /// Reads the blocks `keys` (a prefix chain from [`SsdStore::lookup`]) and hands each
    /// block's KV bytes, in order, to `sink(index, header, kv_bytes)`. Every block is checked
    /// before it is handed out. Reading counts as a use of the prefix (its last-use time is
    /// refreshed). Several reads are in flight at once; segments are leased meanwhile.
    ///
    /// # Errors
    /// I/O set-up failures and the sink's errors. Missing or damaged blocks are not errors:
    /// they end the read with [`ReadOutcome::Miss`] or [`ReadOutcome::Damaged`].
    pub fn read_blocks(
        &self,
        keys: &[Key],
        mut sink: impl FnMut(usize, &RecordHeader, &[u8]) -> Result<()>,
    ) -> Result<ReadOutcome> {
        let sh = &self.shared;
        // Locations and leases, under the lock.
        let mut plan = Vec::with_capacity(keys.len());
        let mut outcome = ReadOutcome::Complete;
        {
            let st = sh.lock();
            for (i, k) in keys.iter().enumerate() {
                let found = st.blocks.get(k).filter(|b| b.visible()).and_then(|b| {
                    let l = b.loc()?;
                    let seg = st.segments.get(&l.seg)?;
                    Some((l, Arc::clone(&seg.file), b.tokens))
                });
                match found {
                    Some(f) => plan.push(f),
                    None => {
                        outcome = ReadOutcome::Miss { at: i };
                        break;
                    }
                }
            }
        }
        let mut ctx = self.reader()?;
        // At most `queue_depth` reads in flight, up to the pool's slots delivered-or-pending.
        let depth = self.shared.opts.queue_depth.min(ctx.engine.depth()).max(1);
        let window = ctx.pool.slots().max(depth);
        let mut next_submit = 0usize;
        let mut next_deliver = 0usize;
        let mut ready: HashMap<usize, Completion> = HashMap::new();
        let mut result = Ok(());
        let mut stop_at: Option<(usize, bool)> = None;
        while next_deliver < plan.len() && stop_at.is_none() {
            let submitted = next_submit;
            while next_submit < plan.len()
                && next_submit < next_deliver + window
                && ctx.engine.in_flight() < depth
            {
                let Some(buf) = ctx.pool.try_get() else {
                    break;
                };
                let (l, seg, _) = &plan[next_submit];
                let op = IoOp {
                    kind: OpKind::Read,
                    target: seg.media.target(),
                    offset: seg.base + l.offset,
                    len: l.len as usize,
                    buf,
                    tag: next_submit as u64,
                };
                if let Err(e) = ctx.engine.submit(op) {
                    result = Err(Error::io("cannot read from", seg.path.clone(), e.error));
                    break;
                }
                next_submit += 1;
            }
            if result.is_err() {
                break;
            }
            // Hand the new reads to the kernel before checking and delivering a block (about
            // 50 us each): `submit` only queues them. `wait(0)` never blocks.
            if next_submit > submitted
                && let Err(e) = collect_reads(ctx.engine.as_mut(), 0, &mut ready)
            {
                result = Err(e);
                break;
            }
            if let Some(c) = ready.remove(&next_deliver) {
                let (l, seg, tokens) = &plan[next_deliver];
                let checked = check_block(&c, &keys[next_deliver], l, *tokens);
                match checked {
                    Ok(h) => {
                        let kv_len = h.payload_len as usize - 4 * h.tokens as usize;
                        let kv =
                            c.op.buf
                                .as_slice()
                                .get(ALIGN..ALIGN + kv_len)
                                .unwrap_or_default();
                        if let Err(e) = sink(next_deliver, &h, kv) {
                            result = Err(e);
                            break;
                        }
                        next_deliver += 1;
                    }
                    Err(reason) => {
                        log::warn!(
                            "damaged block in {} at offset {}: {reason}; served as a miss",
                            seg.path.display(),
                            seg.base + l.offset
                        );
                        bump(&sh.counters.damaged_reads, 1);
                        let mut st = sh.lock();
                        if let Some(b) = st.blocks.get_mut(&keys[next_deliver]) {
                            b.damaged = true;
                        }
                        stop_at = Some((next_deliver, true));
                    }
                }
                continue;
            }
            if let Err(e) = collect_reads(ctx.engine.as_mut(), 1, &mut ready) {
                result = Err(e);
                break;
            }
        }
        // Reap what is still in flight before the buffers and engine are reused.
        let mut out = Vec::new();
        while ctx.engine.in_flight() > 0 {
            if ctx.engine.wait(ctx.engine.in_flight(), &mut out).is_err() {
                // The ring is broken: do not return this context to the cache.
                return result.and(Err(Error::Closed));
            }
            out.clear();
        }
        drop(ready);
        drop(plan);
        self.return_reader(ctx);
        result?;
        if let Some((at, damaged)) = stop_at {
            return Ok(if damaged {
                ReadOutcome::Damaged { at }
            } else {
                ReadOutcome::Miss { at }
            });
        }
        let delivered = match outcome {
            ReadOutcome::Miss { at } => at,
            _ => keys.len(),
        };
        if let Some(&end) = keys.get(..delivered).and_then(<[Key]>::last) {
            self.touch_end(end, sh.clock.now_ms());
        }
        Ok(outcome)
    }

    fn reader(&self) -> Result<ReadCtx> {
        let cached = self
            .shared
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        if let Some(c) = cached {
            return Ok(c);
        }
        // Twice the queue depth in buffers: blocks are delivered in order, so completions that
        // overtake the oldest read wait in their buffers while the queue stays full.
        let (engine, pool, _) = engine_for(
            &self.shared.opts,
            self.shared.namespace.as_deref(),
            2 * self.shared.opts.queue_depth,
            self.shared.opts.io_buffer_bytes(),
            self.shared.read_preference,
        )?;
        Ok(ReadCtx { engine, pool })
    }

    fn return_reader(&self, ctx: ReadCtx) {
        let mut r = self
            .shared
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if r.len() < 4 {
            r.push(ctx);
        }
    }

    /// Records a use of the prefix that ends with block `end` (its chain is found through the
    /// blocks' parent links). Creates a prefix unit there when none ends there, so the use is
    /// remembered across restarts; writes a touch commit when the use is `touch_interval_ms`
    /// newer than the one on disk.
    pub(super) fn touch_end(&self, end: Key, now: u64) {
        let sh = &self.shared;
        let mut st = sh.lock();
        if st.deleting.contains_key(&end) {
            // Being deleted: neither a touch commit nor a new prefix unit there (either would
            // be a commit newer than the delete).
            return;
        }
        let keys = chain_of(&st, &end);
        let State {
            units,
            by_age,
            blocks,
            tenant_bytes,
            ..
        } = &mut *st;
        let job = match units.get_mut(&end) {
            Some(u) => {
                by_age.remove(&(u.last_used, end));
                u.last_used = u.last_used.max(now);
                by_age.insert((u.last_used, end));
                let due = u.last_used.saturating_sub(u.persisted_used) >= sh.opts.touch_interval_ms;
                if due && !u.touch_queued && !sh.opts.read_only {
                    u.touch_queued = true;
                    Some((u.tokens, u.tenant_id, u.model, u.created))
                } else {
                    None
                }
            }
            None => {
                // A prefix that ends inside a longer unit: give it a unit of its own.
                let complete = keys
                    .first()
                    .and_then(|k| blocks.get(k))
                    .is_some_and(|b| b.depth == 1)
                    && keys
                        .iter()
                        .all(|k| blocks.get(k).is_some_and(BlockMeta::visible));
                if !complete {
                    return;
                }
                let tokens: u64 = keys
                    .iter()
                    .filter_map(|k| blocks.get(k))
                    .map(|b| u64::from(b.tokens))
                    .sum();
                for k in &keys {
                    if let Some(b) = blocks.get_mut(k) {
                        super::quota::cover(b, tenant_bytes);
                    }
                }
                units.insert(
                    end,
                    UnitMeta {
                        tokens,
                        created: now,
                        last_used: now,
                        persisted_used: 0,
                        loc: None,
                        touch_queued: !sh.opts.read_only,
                        tenant_id: 0,
                        model: [0; 16],
                        commit_segs: Vec::new(),
                    },
                );
                by_age.insert((now, end));
                (!sh.opts.read_only).then_some((tokens, 0, [0; 16], now))
            }
        };
        drop(st);
        if let Some((tokens, tenant_id, model, created)) = job {
            let j = UnitJob {
                end,
                keys,
                tokens,
                tenant_id,
                model,
                created,
                touch: true,
                part: false,
                new_blocks: Vec::new(),
                queued: 0,
                reply: None,
                delete: None,
                last_used: now,
            };
            // A closed store simply forgets the touch.
            let _ = sh.send(Job::Unit(Box::new(j)));
        }
    }

    /// Queues a touch commit for every use not yet on disk (what a clean close does), so a
    /// restart keeps every unit's last use; [`SsdStore::flush`] waits for them.
    ///
    /// # Errors
    /// [`Error::ReadOnly`]; [`Error::Closed`] when the writer has stopped.
    pub fn persist_uses(&self) -> Result<()> {
        if self.shared.opts.read_only {
            return Err(Error::ReadOnly);
        }
        if self.writer.is_none() {
            return Err(Error::Closed);
        }
        self.queue_uses();
        Ok(())
    }

    pub(super) fn queue_uses(&self) {
        let due: Vec<(Key, Vec<Key>)> = {
            let st = self.shared.lock();
            st.units
                .iter()
                .filter(|(k, u)| {
                    u.last_used > u.persisted_used
                        && !u.touch_queued
                        && !st.deleting.contains_key(*k)
                })
                .map(|(k, _)| (*k, chain_of(&st, k)))
                .collect()
        };
        for (_, keys) in due {
            let mut st = self.shared.lock();
            let Some(end) = keys.last() else { continue };
            let Some(u) = st.units.get_mut(end) else {
                continue;
            };
            u.touch_queued = true;
            let j = UnitJob {
                end: *end,
                tokens: u.tokens,
                tenant_id: u.tenant_id,
                model: u.model,
                created: u.created,
                touch: true,
                part: false,
                new_blocks: Vec::new(),
                queued: 0,
                reply: None,
                delete: None,
                last_used: 0,
                keys,
            };
            drop(st);
            let _ = self.shared.send(Job::Unit(Box::new(j)));
        }
    }
}

/// Waits for at least `min` reads (0: only pushes queued ones to the kernel) and files every
/// completed one under its plan index.
pub(super) fn collect_reads(
    engine: &mut dyn BlockEngine,
    min: usize,
    ready: &mut HashMap<usize, Completion>,
) -> Result<()> {
    let mut out = Vec::new();
    engine
        .wait(min, &mut out)
        .map_err(|e| Error::io("block I/O failed on", "store", e))?;
    for c in out {
        ready.insert(c.op.tag as usize, c);
    }
    Ok(())
}

/// Checks a completed block read: transfer, header, identity, location and payload CRC.
pub(super) fn check_block(
    c: &Completion,
    key: &Key,
    loc: &Loc,
    tokens: u32,
) -> std::result::Result<RecordHeader, String> {
    let got = c.result.as_ref().map_err(|e| format!("read failed: {e}"))?;
    if (*got as u64) < loc.len {
        return Err(format!("short read: {got} of {} bytes", loc.len));
    }
    let bytes = c.op.buf.as_slice();
    let h = RecordHeader::decode(bytes).map_err(|e| e.to_string())?;
    if h.kind != RecordKind::Block
        || h.key != *key
        || h.segment != loc.seg
        || h.seq != loc.seq
        || h.tokens != tokens
    {
        return Err("record at the block's location is a different record".to_owned());
    }
    if h.record_len() != loc.len || !h.flags.contains(RecordFlags::TOKEN_IDS) {
        return Err("record length or flags differ from the index".to_owned());
    }
    if h.payload_len < 4 * u64::from(h.tokens) {
        return Err("payload shorter than its token ids".to_owned());
    }
    let payload = bytes
        .get(ALIGN..ALIGN + h.payload_len as usize)
        .ok_or("payload outside the buffer")?;
    h.verify_payload(payload).map_err(|e| e.to_string())?;
    Ok(h)
}

// ---------------------------------------------------------------------------------------------
// The write-behind thread
