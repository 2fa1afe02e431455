//! [`KvCache`]: sequences, block tables, copy-on-write, the prefix index and accounting.

use std::collections::HashMap;

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;
use zerocopy::IntoBytes;

use super::geometry::{CacheGeometry, CacheOptions};
use super::pool::{PageId, PagePool};
use super::prefix::{NodeId, PrefixIndex, ROOT};
use super::usage::{CacheUsage, KindUsage, MetadataUsage, PoolUsage, SequenceUsage};
use super::view::{EntryView, WindowView};
use super::{AppendData, SequenceId};
use super::{PoolKind, PoolName};
use crate::{Error, Result};
use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::LayerPlan;

/// Pending compressor state of one source of one sequence.
#[derive(Clone)]
struct Pending {
    /// `wkv` then `wgate` projections of each pending token.
    values: Vec<f32>,
    /// False after a truncation into an incomplete group, until [`KvCache::set_pending`].
    valid: bool,
}

/// One live sequence.
struct Sequence {
    len: u64,
    /// Token ids after the published chain: tokens `[depth(tip) * page_tokens, len)`. Earlier
    /// tokens are the keys of the chain's nodes, so the prefix index and the sequence do not
    /// both store them. Without a prefix index: every token id.
    tail: Vec<u32>,
    /// One block table per entry pool: page `k` holds entries `[k * B, (k + 1) * B)`.
    tables: Vec<Vec<PageId>>,
    /// Its window slab in the window pool.
    slab: PageId,
    /// First window position written since the window last restarted (clipped to
    /// `len - window` when read).
    window_from: u64,
    /// One per KV source (empty and always valid for ratio-1 sources).
    pending: Vec<Pending>,
    /// Prefix-index node of its last published block (the root when none); pinned.
    tip: NodeId,
}

/// The result of [`KvCache::create_sequence_with_prefix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PrefixHit {
    /// The new sequence.
    pub seq: SequenceId,
    /// Tokens it starts with (a multiple of `page_tokens`): their global entries and indexer
    /// keys are mapped from the cache; their window is empty and their pending state complete.
    pub tokens: u64,
}

/// What an append of `tokens` tokens to a sequence must carry ([`KvCache::append_shape`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AppendShape {
    /// The sequence's length before the append.
    pub len: u64,
    /// New global entries (and as many indexer keys) per KV source.
    pub entries: Vec<u64>,
    /// Pending tokens per KV source after the append.
    pub pending_tokens: Vec<u64>,
    /// f32 values per pending token.
    pub pending_token_floats: u64,
    /// Layers (window rows are given for each).
    pub layers: u64,
    /// The most window rows per layer the append may carry.
    pub max_window_rows: u64,
}

/// The paged KV cache of one model plan. See the module docs.
pub struct KvCache {
    geometry: CacheGeometry,
    options: CacheOptions,
    /// Global-entry pool `2 i` and index-key pool `2 i + 1` of source `i`.
    pools: Vec<PagePool>,
    window: PagePool,
    seqs: HashMap<SequenceId, Sequence>,
    prefix: Option<PrefixIndex>,
    next_id: u64,
    /// Prefix blocks evicted because a pool was full (not those `clear_prefix_index` drops).
    prefix_evictions: u64,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("geometry", &self.geometry)
            .field("options", &self.options)
            .field("sequences", &self.seqs.len())
            .finish_non_exhaustive()
    }
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

fn exhausted(pool: &PagePool, requested: u64) -> Error {
    Error::PoolExhausted {
        pool: pool.name(),
        requested,
        in_use: u64::from(pool.in_use()),
        free: u64::from(pool.free_count()),
        capacity: u64::from(pool.capacity()),
        page_bytes: pool.page_bytes() as u64,
    }
}

/// A page of pool `p`, evicting cached prefix blocks while the pool is full (counted in
/// `evictions`).
fn alloc_page(
    pools: &mut [PagePool],
    prefix: &mut Option<PrefixIndex>,
    p: usize,
    evictions: &mut u64,
) -> Result<Option<PageId>> {
    loop {
        let Some(pool) = pools.get_mut(p) else {
            return Err(Error::Internal {
                what: "pool index out of range",
            });
        };
        if let Some(id) = pool.alloc()? {
            return Ok(Some(id));
        }
        let Some(pages) = prefix.as_mut().and_then(PrefixIndex::evict_lru) else {
            return Ok(None);
        };
        *evictions += 1;
        release_all(pools, &pages);
    }
}

/// Releases one page per pool (a prefix node's or a block row's pages).
fn release_all(pools: &mut [PagePool], pages: &[PageId]) {
    for (pool, &id) in pools.iter_mut().zip(pages) {
        pool.release(id);
    }
}

/// Writes `bytes` (whole entries) at entry position `first` of a block table, taking new pages
/// (and a copy-on-write target) from `spares`.
fn write_entries(
    pool: &mut PagePool,
    table: &mut Vec<PageId>,
    first: u64,
    mut bytes: &[u8],
    spares: &mut Vec<PageId>,
) -> Result<()> {
    let eb = pool.entry_bytes();
    let b = pool.page_entries();
    let mut e = first;
    while !bytes.is_empty() {
        let k = (e / b as u64) as usize;
        let off = (e % b as u64) as usize;
        let id = if k == table.len() {
            let id = spares.pop().ok_or(Error::Internal {
                what: "no spare page for append",
            })?;
            table.push(id);
            id
        } else {
            let old = *table.get(k).ok_or(Error::Internal {
                what: "block table too short",
            })?;
            if pool.refcount(old) > 1 {
                // Copy-on-write: the tail page is shared (fork or prefix index).
                let new = spares.pop().ok_or(Error::Internal {
                    what: "no spare page for COW",
                })?;
                pool.copy_prefix(old, new, off * eb)?;
                pool.release(old);
                table[k] = new;
                new
            } else {
                old
            }
        };
        let take = (b - off).min(bytes.len() / eb);
        let (now, rest) = bytes.split_at(take * eb);
        pool.page_mut(id)
            .get_mut(off * eb..(off + take) * eb)
            .ok_or(Error::Internal {
                what: "page above the watermark",
            })?
            .copy_from_slice(now);
        bytes = rest;
        e += take as u64;
    }
    Ok(())
}

impl KvCache {
    /// A cache for `cfg`, building and validating its layer plan.
    ///
    /// # Errors
    /// Config and plan errors, and the cache errors of [`KvCache::new`] for options or a model
    /// the cache cannot store.
    pub fn for_config(cfg: &ModelConfig, options: CacheOptions) -> Result<KvCache> {
        let plan = LayerPlan::from_config(cfg)?;
        KvCache::new(cfg, &plan, options)
    }

    /// A cache for the plan `plan` of `cfg`. Reserves address space for every pool; memory is
    /// committed as pages are first used.
    ///
    /// # Errors
    /// [`Error::UnsupportedModel`] (not CSA2, or dimensions other than the V4.1 formats),
    /// [`Error::PageSize`], [`Error::InvalidOption`], [`Error::Memory`].
    pub fn new(cfg: &ModelConfig, plan: &LayerPlan, options: CacheOptions) -> Result<KvCache> {
        let geometry = CacheGeometry::new(cfg, plan, options.page_tokens)?;
        if options.context_limit == 0 {
            return Err(Error::InvalidOption {
                field: "context_limit",
                reason: "is 0".into(),
            });
        }
        if options.max_sequences == 0 {
            return Err(Error::InvalidOption {
                field: "max_sequences",
                reason: "is 0".into(),
            });
        }
        let seqs = options.max_sequences as u64;
        let mut pools = Vec::with_capacity(geometry.entry_pools());
        for s in &geometry.sources {
            let b = s.page_entries as u64;
            let per_seq = div_ceil(options.context_limit / u64::from(s.ratio), b);
            let capacity = match options.pool_tokens {
                Some(t) => div_ceil(t / u64::from(s.ratio), b),
                None => seqs.saturating_mul(per_seq + 1),
            };
            for (kind, entry, page) in [
                (
                    PoolKind::Global,
                    geometry.global_entry_bytes,
                    s.global_page_bytes,
                ),
                (
                    PoolKind::Index,
                    geometry.index_entry_bytes,
                    s.index_page_bytes,
                ),
            ] {
                let name = PoolName {
                    kind,
                    layer: Some(s.layer),
                };
                pools.push(PagePool::new(
                    name,
                    entry,
                    page,
                    geometry.page_tokens as u64,
                    capacity,
                    options.memory,
                )?);
            }
        }
        let window = PagePool::new(
            PoolName {
                kind: PoolKind::Window,
                layer: None,
            },
            geometry.window_entry_bytes,
            geometry.window_slab_bytes(),
            geometry.window_tokens as u64,
            seqs,
            options.memory,
        )?;
        Ok(KvCache {
            prefix: options.prefix_index.then(PrefixIndex::new),
            geometry,
            options,
            pools,
            window,
            seqs: HashMap::new(),
            next_id: 0,
            prefix_evictions: 0,
        })
    }

    /// The page geometry.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// The options the cache was built with.
    pub fn options(&self) -> &CacheOptions {
        &self.options
    }

    /// Live sequences, in no particular order.
    pub fn sequences(&self) -> impl Iterator<Item = SequenceId> + '_ {
        self.seqs.keys().copied()
    }

    fn seq(&self, seq: SequenceId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or(Error::UnknownSequence { seq })
    }

    fn ratio(&self, source: usize) -> u64 {
        self.geometry
            .sources
            .get(source)
            .map_or(1, |s| u64::from(s.ratio))
    }

    /// Starts an empty sequence.
    ///
    /// # Errors
    /// [`Error::TooManySequences`], or the window pool's [`Error::Memory`].
    pub fn create_sequence(&mut self) -> Result<SequenceId> {
        if self.seqs.len() >= self.options.max_sequences {
            return Err(Error::TooManySequences {
                limit: self.options.max_sequences,
            });
        }
        let slab = self
            .window
            .alloc()?
            .ok_or_else(|| exhausted(&self.window, 1))?;
        let pending = self
            .geometry
            .sources
            .iter()
            .map(|s| Pending {
                values: Vec::with_capacity(
                    s.max_pending_tokens * self.geometry.pending_token_floats,
                ),
                valid: true,
            })
            .collect();
        let id = SequenceId(self.next_id);
        self.next_id += 1;
        if let Some(ix) = &mut self.prefix {
            ix.pin(ROOT);
        }
        self.seqs.insert(
            id,
            Sequence {
                len: 0,
                tail: Vec::new(),
                tables: vec![Vec::new(); self.pools.len()],
                slab,
                window_from: 0,
                pending,
                tip: ROOT,
            },
        );
        Ok(id)
    }

    /// Tokens of the longest cached block-aligned prefix of `tokens`.
    pub fn lookup_prefix(&self, tokens: &[u32]) -> u64 {
        let p = self.geometry.page_tokens;
        self.prefix
            .as_ref()
            .map_or(0, |ix| (ix.lookup(tokens, p, usize::MAX).len() * p) as u64)
    }

    /// Starts a sequence with the longest cached block-aligned prefix of `tokens`, at most
    /// `max_tokens` long, mapped from the prefix index (the pages gain a reference; nothing is
    /// copied). The caller computes the rest and rebuilds the window
    /// ([`KvCache::write_window`]): window rows are per sequence and never cached. A block
    /// boundary is a multiple of every compress ratio, so no pending state is needed.
    ///
    /// # Errors
    /// As [`KvCache::create_sequence`].
    pub fn create_sequence_with_prefix(
        &mut self,
        tokens: &[u32],
        max_tokens: u64,
    ) -> Result<PrefixHit> {
        let id = self.create_sequence()?;
        let p = self.geometry.page_tokens;
        let KvCache {
            prefix,
            pools,
            seqs,
            ..
        } = self;
        let (Some(ix), Some(s)) = (prefix.as_mut(), seqs.get_mut(&id)) else {
            return Ok(PrefixHit { seq: id, tokens: 0 });
        };
        let limit = usize::try_from(max_tokens)
            .unwrap_or(usize::MAX)
            .min(tokens.len());
        let path = ix.lookup(tokens, p, limit / p);
        for &node in &path {
            for ((pool, table), &page) in pools.iter_mut().zip(&mut s.tables).zip(ix.pages(node)) {
                pool.retain(page);
                table.push(page);
            }
            ix.touch(node);
        }
        let matched = path.len() * p;
        if let Some(&last) = path.last() {
            ix.pin(last);
            ix.unpin(s.tip);
            s.tip = last;
        }
        s.len = matched as u64;
        s.window_from = s.len;
        Ok(PrefixHit {
            seq: id,
            tokens: s.len,
        })
    }

    /// What an append of `tokens` tokens to `seq` must carry.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn append_shape(&self, seq: SequenceId, tokens: u64) -> Result<AppendShape> {
        let t = self.seq(seq)?.len;
        let g = &self.geometry;
        let end = t.saturating_add(tokens);
        Ok(AppendShape {
            len: t,
            entries: g
                .sources
                .iter()
                .map(|s| end / u64::from(s.ratio) - t / u64::from(s.ratio))
                .collect(),
            pending_tokens: g.sources.iter().map(|s| end % u64::from(s.ratio)).collect(),
            pending_token_floats: g.pending_token_floats as u64,
            layers: g.num_layers as u64,
            max_window_rows: tokens.min(g.window_tokens as u64),
        })
    }

    fn check_append(&self, seq: SequenceId, data: &AppendData<'_>) -> Result<(u64, u64, usize)> {
        let s = self.seq(seq)?;
        let n = data.tokens.len() as u64;
        let t = s.len;
        if t.checked_add(n)
            .is_none_or(|e| e > self.options.context_limit)
        {
            return Err(Error::ContextLimit {
                seq,
                len: t,
                appended: n,
                limit: self.options.context_limit,
            });
        }
        let shape = self.append_shape(seq, n)?;
        let bad = |what: String, expected: u64, got: usize| Error::Shape {
            seq,
            what,
            expected,
            got: got as u64,
        };
        let sources = self.geometry.sources.len();
        for (what, got) in [
            ("global entry lists", data.global.len()),
            ("index key lists", data.index.len()),
            ("pending state lists", data.pending.len()),
        ] {
            if got != sources {
                return Err(bad(
                    format!("{what} (one per KV source)"),
                    sources as u64,
                    got,
                ));
            }
        }
        for (i, src) in self.geometry.sources.iter().enumerate() {
            let e = shape.entries[i];
            if data.global[i].len() as u64 != e {
                return Err(bad(
                    format!("global entries of layer {}", src.layer),
                    e,
                    data.global[i].len(),
                ));
            }
            if data.index[i].len() as u64 != e {
                return Err(bad(
                    format!("index keys of layer {}", src.layer),
                    e,
                    data.index[i].len(),
                ));
            }
            let pf = shape.pending_tokens[i] * shape.pending_token_floats;
            if data.pending[i].len() as u64 != pf {
                return Err(bad(
                    format!("pending state floats of layer {}", src.layer),
                    pf,
                    data.pending[i].len(),
                ));
            }
        }
        let layers = self.geometry.num_layers;
        let rows = data.window.len();
        let k = rows / layers.max(1);
        if !rows.is_multiple_of(layers.max(1)) || k as u64 > shape.max_window_rows {
            return Err(bad(
                format!(
                    "window rows ({layers} layers x at most {} rows, layer-major)",
                    shape.max_window_rows
                ),
                layers as u64 * shape.max_window_rows,
                rows,
            ));
        }
        Ok((t, n, k))
    }

    /// Appends `data.tokens.len()` tokens with their encoded entries (see [`AppendData`]).
    /// Completed token blocks enter the prefix index. All or nothing: on error the sequence is
    /// unchanged.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::ContextLimit`], [`Error::Shape`],
    /// [`Error::PoolExhausted`], [`Error::Memory`].
    pub fn append(&mut self, seq: SequenceId, data: &AppendData<'_>) -> Result<()> {
        let (t, n, k) = self.check_append(seq, data)?;
        if n == 0 {
            return Ok(());
        }
        let end = t + n;
        let KvCache {
            geometry: g,
            pools,
            window,
            seqs,
            prefix,
            prefix_evictions,
            ..
        } = self;
        let s = seqs.get_mut(&seq).ok_or(Error::UnknownSequence { seq })?;

        // Pages each pool needs: new tail pages, plus a copy-on-write target when the current
        // partial tail page is shared and will be written.
        let mut need = vec![0u64; pools.len()];
        for (p, pool) in pools.iter().enumerate() {
            let r = g.sources.get(p / 2).map_or(1, |s| u64::from(s.ratio));
            let b = pool.page_entries() as u64;
            let (old_e, new_e) = (t / r, end / r);
            let (old_pages, new_pages) = (div_ceil(old_e, b), div_ceil(new_e, b));
            let cow = new_e > old_e
                && old_e % b != 0
                && s.tables[p].last().is_some_and(|&id| pool.refcount(id) > 1);
            need[p] = new_pages - old_pages + u64::from(cow);
        }
        let mut spares: Vec<Vec<PageId>> = vec![Vec::new(); pools.len()];
        for (p, &count) in need.iter().enumerate() {
            for got in 0..count {
                let page = match alloc_page(pools, prefix, p, prefix_evictions) {
                    Ok(Some(id)) => id,
                    other => {
                        for (q, ids) in spares.iter().enumerate() {
                            for &id in ids {
                                pools[q].release(id);
                            }
                        }
                        return Err(match other {
                            Err(e) => e,
                            _ => exhausted(&pools[p], count - got),
                        });
                    }
                };
                spares[p].push(page);
            }
        }

        // From here on nothing can fail but an internal invariant.
        for (p, pool) in pools.iter_mut().enumerate() {
            let i = p / 2;
            let r = g.sources.get(i).map_or(1, |s| u64::from(s.ratio));
            let bytes = if p % 2 == 0 {
                data.global[i].as_bytes()
            } else {
                data.index[i].as_bytes()
            };
            write_entries(pool, &mut s.tables[p], t / r, bytes, &mut spares[p])?;
            for id in spares[p].drain(..) {
                pool.release(id);
            }
        }
        if k > 0 {
            let w = g.window_tokens as u64;
            let eb = g.window_entry_bytes;
            let slab = window.page_mut(s.slab);
            for (l, rows) in data.window.chunks_exact(k).enumerate() {
                for (j, row) in rows.iter().enumerate() {
                    let pos = end - k as u64 + j as u64;
                    let off = (l * g.window_tokens + (pos % w) as usize) * eb;
                    if let Some(dst) = slab.get_mut(off..off + eb) {
                        dst.copy_from_slice(row.as_bytes());
                    }
                }
            }
        }
        if (k as u64) < n {
            s.window_from = end - k as u64;
        }
        for (state, values) in s.pending.iter_mut().zip(&data.pending) {
            state.values.clear();
            state.values.extend_from_slice(values);
            state.valid = true;
        }
        s.tail.extend_from_slice(data.tokens);
        s.len = end;
        if let Some(ix) = prefix {
            publish(ix, pools, s, g.page_tokens);
        }
        Ok(())
    }

    /// Shares every page of `seq` with a new sequence (same tokens, window and pending state).
    /// The first write that diverges copies the shared partial tail page of each pool.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::TooManySequences`], the window pool's errors.
    pub fn fork(&mut self, seq: SequenceId) -> Result<SequenceId> {
        self.seq(seq)?;
        if self.seqs.len() >= self.options.max_sequences {
            return Err(Error::TooManySequences {
                limit: self.options.max_sequences,
            });
        }
        let slab = self
            .window
            .alloc()?
            .ok_or_else(|| exhausted(&self.window, 1))?;
        let KvCache {
            pools,
            window,
            seqs,
            prefix,
            ..
        } = self;
        let Some(parent) = seqs.get(&seq) else {
            window.release(slab);
            return Err(Error::UnknownSequence { seq });
        };
        window.copy_prefix(parent.slab, slab, window.page_bytes())?;
        for (pool, table) in pools.iter_mut().zip(&parent.tables) {
            for &id in table {
                pool.retain(id);
            }
        }
        let child = Sequence {
            len: parent.len,
            tail: parent.tail.clone(),
            tables: parent.tables.clone(),
            slab,
            window_from: parent.window_from,
            pending: parent.pending.clone(),
            tip: parent.tip,
        };
        if let Some(ix) = prefix {
            ix.pin(child.tip);
        }
        let id = SequenceId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, child);
        Ok(id)
    }

    /// Shortens `seq` to `to` tokens, releasing the pages past it. Window rows of positions
    /// below `to` that are still in the ring stay valid. If `to` ends inside an incomplete group
    /// of a ratio > 1 source, that source's pending state is unknown until
    /// [`KvCache::set_pending`] gives it again ([`KvCache::pending`] returns `None`).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::TruncateBeyondEnd`].
    pub fn truncate(&mut self, seq: SequenceId, to: u64) -> Result<()> {
        let KvCache {
            geometry: g,
            pools,
            seqs,
            prefix,
            ..
        } = self;
        let s = seqs.get_mut(&seq).ok_or(Error::UnknownSequence { seq })?;
        if to > s.len {
            return Err(Error::TruncateBeyondEnd {
                seq,
                len: s.len,
                to,
            });
        }
        if to == s.len {
            return Ok(());
        }
        for (p, (pool, table)) in pools.iter_mut().zip(&mut s.tables).enumerate() {
            let r = g.sources.get(p / 2).map_or(1, |s| u64::from(s.ratio));
            let keep = div_ceil(to / r, pool.page_entries() as u64) as usize;
            for id in table.drain(keep.min(table.len())..) {
                pool.release(id);
            }
        }
        let w = g.window_tokens as u64;
        s.window_from = s.window_from.max(s.len.saturating_sub(w)).min(to);
        for (state, src) in s.pending.iter_mut().zip(&g.sources) {
            state.values.clear();
            state.valid = to.is_multiple_of(u64::from(src.ratio));
        }
        s.len = to;
        match prefix {
            None => s.tail.truncate(to as usize),
            Some(ix) => {
                let p = g.page_tokens as u64;
                let depth = (to / p) as u32;
                let tip_depth = ix.depth(s.tip);
                if tip_depth > depth {
                    // The new tail comes back from the key of the chain's block at `depth`.
                    let block = ix.ancestor(s.tip, depth + 1);
                    let keep = (to - u64::from(depth) * p) as usize;
                    s.tail.clear();
                    s.tail
                        .extend_from_slice(ix.key(block).get(..keep).unwrap_or(&[]));
                    let up = ix.ancestor(s.tip, depth);
                    ix.pin(up);
                    ix.unpin(s.tip);
                    s.tip = up;
                } else {
                    s.tail.truncate((to - u64::from(tip_depth) * p) as usize);
                }
            }
        }
        Ok(())
    }

    /// Ends `seq`, releasing its pages, window slab and pending state.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn drop_sequence(&mut self, seq: SequenceId) -> Result<()> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        for (pool, table) in self.pools.iter_mut().zip(&s.tables) {
            for &id in table {
                pool.release(id);
            }
        }
        self.window.release(s.slab);
        if let Some(ix) = &mut self.prefix {
            ix.unpin(s.tip);
        }
        Ok(())
    }

    /// Writes window rows for positions `[first, len)` of `seq`, every layer, layer-major
    /// (`rows.len() = layers * (len - first)`): the window rebuild after a prefix hit or a
    /// truncation (spec §7, bounded replay). `first` must be at least `len - sliding_window`.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::Shape`], [`Error::WindowRange`].
    pub fn write_window(
        &mut self,
        seq: SequenceId,
        first: u64,
        rows: &[WindowFp8Entry],
    ) -> Result<()> {
        let KvCache {
            geometry: g,
            window,
            seqs,
            ..
        } = self;
        let s = seqs.get_mut(&seq).ok_or(Error::UnknownSequence { seq })?;
        let layers = g.num_layers;
        let w = g.window_tokens as u64;
        if !rows.len().is_multiple_of(layers) {
            return Err(Error::Shape {
                seq,
                what: format!("window rows (a multiple of {layers} layers)"),
                expected: (layers as u64) * s.len.saturating_sub(first),
                got: rows.len() as u64,
            });
        }
        let k = (rows.len() / layers) as u64;
        let oldest = s.len.saturating_sub(w);
        if first.checked_add(k) != Some(s.len) || first < oldest {
            return Err(Error::WindowRange {
                seq,
                first,
                end: first.saturating_add(k),
                len: s.len,
                oldest,
            });
        }
        if k == 0 {
            return Ok(());
        }
        let eb = g.window_entry_bytes;
        let slab = window.page_mut(s.slab);
        for (l, layer_rows) in rows.chunks_exact(k as usize).enumerate() {
            for (j, row) in layer_rows.iter().enumerate() {
                let pos = first + j as u64;
                let off = (l * g.window_tokens + (pos % w) as usize) * eb;
                if let Some(dst) = slab.get_mut(off..off + eb) {
                    dst.copy_from_slice(row.as_bytes());
                }
            }
        }
        s.window_from = s.window_from.min(first);
        Ok(())
    }

    fn pending_source(&self, layer: usize) -> Result<usize> {
        self.geometry
            .sources
            .iter()
            .position(|s| s.layer == layer && s.ratio > 1)
            .ok_or(Error::NoPendingState { layer })
    }

    /// Sets the pending compressor state of KV source `layer` (ratio > 1) of `seq`:
    /// `(len mod ratio) * 2 * head_dim` values (after a truncation into an incomplete group).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::NoPendingState`], [`Error::Shape`].
    pub fn set_pending(&mut self, seq: SequenceId, layer: usize, values: &[f32]) -> Result<()> {
        let i = self.pending_source(layer)?;
        let floats = self.geometry.pending_token_floats as u64;
        let r = self.ratio(i);
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        let expected = (s.len % r) * floats;
        if values.len() as u64 != expected {
            return Err(Error::Shape {
                seq,
                what: format!("pending state floats of layer {layer}"),
                expected,
                got: values.len() as u64,
            });
        }
        if let Some(state) = s.pending.get_mut(i) {
            state.values.clear();
            state.values.extend_from_slice(values);
            state.valid = true;
        }
        Ok(())
    }

    /// The pending compressor state of KV source `layer` (ratio > 1) of `seq`; `None` when a
    /// truncation made it unknown.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::NoPendingState`].
    pub fn pending(&self, seq: SequenceId, layer: usize) -> Result<Option<&[f32]>> {
        let i = self.pending_source(layer)?;
        let s = self.seq(seq)?;
        Ok(s.pending.get(i).filter(|p| p.valid).map(|p| &p.values[..]))
    }

    /// Length of `seq` in tokens.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn len(&self, seq: SequenceId) -> Result<u64> {
        Ok(self.seq(seq)?.len)
    }

    /// The token ids of `seq` (gathered from its prefix-index chain and its tail).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn tokens(&self, seq: SequenceId) -> Result<Vec<u32>> {
        let s = self.seq(seq)?;
        let mut out = Vec::with_capacity(s.len as usize);
        if let Some(ix) = &self.prefix {
            let mut chain = Vec::new();
            let mut at = s.tip;
            while at != ROOT {
                chain.push(at);
                at = ix.parent(at);
            }
            for &node in chain.iter().rev() {
                out.extend_from_slice(ix.key(node));
            }
        }
        out.extend_from_slice(&s.tail);
        Ok(out)
    }

    fn source_of(&self, layer: usize) -> Result<usize> {
        match self.geometry.layer_source.get(layer) {
            None => Err(Error::UnknownLayer {
                layer,
                layers: self.geometry.num_layers,
            }),
            Some(None) => Err(Error::NoCompressedKv { layer }),
            Some(Some(i)) => Ok(*i),
        }
    }

    fn entry_view<T>(&self, seq: SequenceId, layer: usize, kind: usize) -> Result<EntryView<'_, T>>
    where
        T: zerocopy::FromBytes + zerocopy::Immutable + zerocopy::KnownLayout + 'static,
    {
        let i = self.source_of(layer)?;
        let s = self.seq(seq)?;
        let p = 2 * i + kind;
        let (Some(pool), Some(table)) = (self.pools.get(p), s.tables.get(p)) else {
            return Err(Error::Internal {
                what: "missing pool or block table",
            });
        };
        Ok(EntryView::new(pool, table, s.len / self.ratio(i)))
    }

    /// The compressed (global) entries layer `layer` attends for `seq`: those of its KV source
    /// (the plan's `kv_source`), `floor(len / ratio)` of them.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::UnknownLayer`], [`Error::NoCompressedKv`].
    pub fn global_entries(
        &self,
        seq: SequenceId,
        layer: usize,
    ) -> Result<EntryView<'_, GlobalFp4Entry>> {
        self.entry_view(seq, layer, 0)
    }

    /// The indexer keys layer `layer` scores for `seq`. Keys are owned by KV sources (spec §4:
    /// Reindex layers reuse their source's keys with their own query), so this resolves through
    /// the plan's `kv_source` as well.
    ///
    /// # Errors
    /// As [`KvCache::global_entries`].
    pub fn index_keys(
        &self,
        seq: SequenceId,
        layer: usize,
    ) -> Result<EntryView<'_, IndexMxfp4Entry>> {
        self.entry_view(seq, layer, 1)
    }

    fn window_range(&self, s: &Sequence) -> (u64, u64) {
        let start = s
            .window_from
            .max(s.len.saturating_sub(self.geometry.window_tokens as u64));
        (start.min(s.len), s.len)
    }

    /// The window ring of `layer` for `seq` (every layer has one, window-only layers included).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::UnknownLayer`].
    pub fn window(&self, seq: SequenceId, layer: usize) -> Result<WindowView<'_>> {
        let layers = self.geometry.num_layers;
        if layer >= layers {
            return Err(Error::UnknownLayer { layer, layers });
        }
        let s = self.seq(seq)?;
        let w = self.geometry.window_tokens;
        let slab: &[WindowFp8Entry] = self.window.entries(s.slab, layers * w);
        let ring = slab.get(layer * w..(layer + 1) * w).unwrap_or(&[]);
        let (start, end) = self.window_range(s);
        Ok(WindowView::new(ring, start, end))
    }

    /// Cached prefix blocks evicted so far because a pool was full (least recently used
    /// first); blocks dropped by [`KvCache::clear_prefix_index`] are not counted.
    pub fn prefix_evictions(&self) -> u64 {
        self.prefix_evictions
    }

    /// Tokens of the blocks the prefix index holds now (0 without an index).
    pub fn prefix_cached_tokens(&self) -> u64 {
        self.prefix
            .as_ref()
            .map_or(0, |ix| (ix.blocks() * self.geometry.page_tokens) as u64)
    }

    /// Drops every cached prefix block that no live sequence pins (least recently used first);
    /// returns how many were dropped. Pages that no sequence uses return to their pools.
    pub fn clear_prefix_index(&mut self) -> u64 {
        let mut n = 0;
        if let Some(ix) = &mut self.prefix {
            while let Some(pages) = ix.evict_lru() {
                release_all(&mut self.pools, &pages);
                n += 1;
            }
        }
        n
    }

    /// Returns the free pages at the top of every pool to the operating system; returns the
    /// bytes released.
    ///
    /// # Errors
    /// [`Error::Memory`] if the kernel refuses.
    pub fn trim(&mut self) -> Result<u64> {
        let mut released = 0;
        for pool in self
            .pools
            .iter_mut()
            .chain(std::iter::once(&mut self.window))
        {
            released += pool.trim()?;
        }
        Ok(released)
    }

    fn pool_usage(&self, p: usize, pool: &PagePool) -> PoolUsage {
        let b = pool.page_entries() as u64;
        let mut entries = vec![0u64; pool.watermark() as usize];
        let mut mark = |id: PageId, n: u64| {
            if let Some(e) = entries.get_mut(id as usize) {
                *e = (*e).max(n);
            }
        };
        if p == usize::MAX {
            for s in self.seqs.values() {
                let (start, end) = self.window_range(s);
                mark(s.slab, (end - start) * self.geometry.num_layers as u64);
            }
        } else {
            let r = self.ratio(p / 2);
            for s in self.seqs.values() {
                let e = s.len / r;
                if let Some(table) = s.tables.get(p) {
                    for (k, &id) in table.iter().enumerate() {
                        mark(id, e.saturating_sub(k as u64 * b).min(b));
                    }
                }
            }
            if let Some(ix) = &self.prefix {
                for pages in ix.all_pages() {
                    if let Some(&id) = pages.get(p) {
                        mark(id, b);
                    }
                }
            }
        }
        let entry_bytes = entries.iter().sum::<u64>() * pool.entry_bytes() as u64;
        PoolUsage {
            pool: pool.name(),
            page_bytes: pool.page_bytes() as u64,
            page_entries: b,
            capacity_pages: u64::from(pool.capacity()),
            reserved_bytes: pool.reserved_bytes(),
            locked_bytes: pool.locked_bytes(),
            huge_page_bytes: pool.huge_page_bytes(),
            usage: KindUsage {
                allocated_bytes: pool.allocated_bytes(),
                in_use_bytes: u64::from(pool.in_use()) * pool.page_bytes() as u64,
                entry_bytes,
                pages_allocated: u64::from(pool.watermark()),
                pages_in_use: u64::from(pool.in_use()),
            },
        }
    }

    /// The whole cache's accounting: allocated and in-use bytes by kind, metadata, every pool.
    pub fn usage(&self) -> CacheUsage {
        let mut global = KindUsage::default();
        let mut index = KindUsage::default();
        let mut pools = Vec::with_capacity(self.pools.len() + 1);
        for (p, pool) in self.pools.iter().enumerate() {
            let u = self.pool_usage(p, pool);
            if p % 2 == 0 {
                global.add(&u.usage)
            } else {
                index.add(&u.usage)
            }
            pools.push(u);
        }
        let w = self.pool_usage(usize::MAX, &self.window);
        let window = w.usage;
        pools.push(w);

        let mut pending = KindUsage::default();
        let mut metadata = MetadataUsage::default();
        for s in self.seqs.values() {
            for st in &s.pending {
                pending.allocated_bytes += (st.values.capacity() * size_of::<f32>()) as u64;
                pending.in_use_bytes += (st.values.len() * size_of::<f32>()) as u64;
            }
            pending.pages_allocated += 1;
            pending.pages_in_use += 1;
            metadata.block_tables += table_bytes(s);
            metadata.token_ids += (s.tail.capacity() * size_of::<u32>()) as u64;
        }
        pending.entry_bytes = pending.in_use_bytes;
        metadata.prefix_index = self.prefix.as_ref().map_or(0, PrefixIndex::metadata_bytes);
        metadata.pools = self
            .pools
            .iter()
            .chain(std::iter::once(&self.window))
            .map(PagePool::metadata_bytes)
            .sum();
        metadata.sequences = (self.seqs.capacity()
            * (size_of::<SequenceId>() + size_of::<Sequence>() + 8)
            + self.seqs.len() * self.geometry.sources.len() * size_of::<Pending>())
            as u64;
        CacheUsage {
            sequences: self.seqs.len() as u64,
            tokens: self.seqs.values().map(|s| s.len).sum(),
            prefix_blocks: self.prefix.as_ref().map_or(0, |ix| ix.blocks() as u64),
            global,
            index,
            window,
            pending,
            metadata,
            pools,
        }
    }

    /// One sequence's accounting.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn sequence_usage(&self, seq: SequenceId) -> Result<SequenceUsage> {
        let s = self.seq(seq)?;
        let g = &self.geometry;
        let mut u = SequenceUsage {
            seq,
            tokens: s.len,
            global_entry_bytes: 0,
            index_entry_bytes: 0,
            pages: 0,
            shared_pages: 0,
            page_bytes: 0,
            exclusive_page_bytes: 0,
            window_bytes: self.window.page_bytes() as u64,
            window_rows: {
                let (a, b) = self.window_range(s);
                b - a
            },
            pending_bytes: s
                .pending
                .iter()
                .map(|p| (p.values.capacity() * size_of::<f32>()) as u64)
                .sum(),
            metadata_bytes: table_bytes(s) + (s.tail.capacity() * size_of::<u32>()) as u64,
        };
        for src in &g.sources {
            let e = s.len / u64::from(src.ratio);
            u.global_entry_bytes += e * g.global_entry_bytes as u64;
            u.index_entry_bytes += e * g.index_entry_bytes as u64;
        }
        for (pool, table) in self.pools.iter().zip(&s.tables) {
            for &id in table {
                let pb = pool.page_bytes() as u64;
                u.pages += 1;
                u.page_bytes += pb;
                if pool.refcount(id) > 1 {
                    u.shared_pages += 1;
                } else {
                    u.exclusive_page_bytes += pb;
                }
            }
        }
        Ok(u)
    }

    /// The reference count of every page of every entry pool (index = page id), for checks.
    pub fn page_refcounts(&self) -> Vec<Vec<u32>> {
        self.pools
            .iter()
            .map(|p| (0..p.watermark()).map(|id| p.refcount(id)).collect())
            .collect()
    }

    /// The block tables of `seq`, one per entry pool (global `2 i`, index `2 i + 1` for source
    /// `i`), for checks and device upload.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn block_tables(&self, seq: SequenceId) -> Result<Vec<&[PageId]>> {
        Ok(self.seq(seq)?.tables.iter().map(Vec::as_slice).collect())
    }

    /// The pages the prefix index holds, one row of entry-pool page ids per cached block.
    pub fn prefix_pages(&self) -> Vec<Vec<PageId>> {
        self.prefix
            .as_ref()
            .map(|ix| {
                ix.all_pages()
                    .filter(|p| !p.is_empty())
                    .map(<[PageId]>::to_vec)
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn table_bytes(s: &Sequence) -> u64 {
    (s.tables.capacity() * size_of::<Vec<PageId>>()
        + s.tables
            .iter()
            .map(|t| t.capacity() * size_of::<PageId>())
            .sum::<usize>()) as u64
}

/// Enters the complete blocks of `s`'s tail into the prefix index, extending the chain from its
/// tip, and drops their tokens from the tail (the nodes' keys hold them now). A block already
/// cached (another sequence computed the same tokens) is followed, not replaced.
fn publish(ix: &mut PrefixIndex, pools: &mut [PagePool], s: &mut Sequence, page_tokens: usize) {
    let p = page_tokens;
    let mut done = 0;
    for key in s.tail.chunks_exact(p) {
        let j = ix.depth(s.tip) as usize;
        let next = match ix.child(s.tip, key) {
            Some(c) => c,
            None => {
                let pages: Option<Box<[PageId]>> =
                    s.tables.iter().map(|t| t.get(j).copied()).collect();
                let Some(pages) = pages else { break };
                for (pool, &id) in pools.iter_mut().zip(pages.iter()) {
                    pool.retain(id);
                }
                ix.insert(s.tip, key, pages)
            }
        };
        ix.pin(next);
        ix.unpin(s.tip);
        ix.touch(next);
        s.tip = next;
        done += p;
    }
    s.tail.drain(..done);
}
