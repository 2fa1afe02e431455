//! [`KvStore`] over the paged cache ([`kvstack_cache::KvCache`]) at the deployed dimensions
//! (512-wide FP8 window rows and FP4 entries, 128-wide MXFP4 keys).
//!
//! Reads go straight to the cache's views (block tables, window ring). A step's writes are
//! staged in a [`PagedStage`] and reach the cache in one [`KvCache::append`], which is the
//! cache's unit of update (all or nothing, one call per prefill chunk or decoded token);
//! until then the staged compressed entries and keys are served from the stage, so the layers
//! that reuse a KV source see its new entries within the step. Only the last
//! `sliding_window` window rows of a step are handed to the cache (earlier ones are never read
//! again).
//!
//! Two ways to drive it:
//! - [`PagedStore`]: one sequence, holding the cache mutably; `commit` applies the step;
//! - [`PagedView`] over a shared `&KvCache`, one per sequence of a batched step (continuous
//!   batching runs several sequences through the layers together, and they all read the
//!   cache at once): `commit` only closes the stage, and the caller applies every stage with
//!   [`PagedStage::apply`] after the step.
//!
//! A bounded replay ([`KvStore::begin_replay`], spec §7) writes the replayed positions'
//! window rows with [`KvCache::write_window`] and appends only the new tokens.

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use zerocopy::{FromBytes, IntoBytes};

use kvstack_cache::{AppendData, KvCache, SequenceId};

use super::store::KvStore;
use crate::Error;

/// One sequence's staged step (see the module docs).
#[derive(Debug)]
pub struct PagedStage {
    seq: SequenceId,
    tokens: Vec<u32>,
    /// Per layer: window rows of the step.
    window: Vec<Vec<u8>>,
    /// Per cache source (geometry order): staged entries, keys, and the new pending state.
    entries: Vec<Vec<u8>>,
    keys: Vec<Vec<u8>>,
    pending: Vec<Option<Vec<f32>>>,
    /// Start of the current step when it replays.
    replay_from: Option<u64>,
    /// Tokens of a closed step not yet applied.
    closed: Option<u64>,
}

/// A [`KvStore`] of one sequence over a shared cache; its step is applied afterwards with
/// [`PagedStage::apply`].
#[derive(Debug)]
pub struct PagedView<'a> {
    cache: &'a KvCache,
    stage: &'a mut PagedStage,
}

/// A [`KvStore`] view of one sequence of a [`KvCache`] that applies each step at `commit`.
#[derive(Debug)]
pub struct PagedStore<'c> {
    cache: &'c mut KvCache,
    stage: PagedStage,
}

fn state(layer: usize, reason: impl Into<String>) -> Error {
    Error::State {
        layer,
        reason: reason.into(),
    }
}

impl PagedStage {
    /// An empty stage for sequence `seq` of `cache`.
    ///
    /// # Errors
    /// [`Error::State`] when `seq` is not in the cache.
    pub fn new(cache: &KvCache, seq: SequenceId) -> Result<PagedStage, Error> {
        cache.len(seq).map_err(|e| state(0, e.to_string()))?;
        let g = cache.geometry();
        let (layers, sources) = (g.num_layers, g.sources.len());
        Ok(PagedStage {
            seq,
            tokens: Vec::new(),
            window: vec![Vec::new(); layers],
            entries: vec![Vec::new(); sources],
            keys: vec![Vec::new(); sources],
            pending: vec![None; sources],
            replay_from: None,
            closed: None,
        })
    }

    /// The sequence.
    pub fn seq(&self) -> SequenceId {
        self.seq
    }

    /// A [`KvStore`] over this stage and a shared cache.
    pub fn view<'a>(&'a mut self, cache: &'a KvCache) -> PagedView<'a> {
        PagedView { cache, stage: self }
    }

    /// Sets the token ids of the next step (the cache keys its prefix index by them); must be
    /// called before the step's [`KvStore::commit`] with as many ids as the step has tokens.
    /// Rows a failed step left behind are dropped here.
    pub fn begin_step(&mut self, tokens: &[u32]) {
        for v in self
            .window
            .iter_mut()
            .chain(&mut self.entries)
            .chain(&mut self.keys)
        {
            v.clear();
        }
        self.pending.iter_mut().for_each(|p| *p = None);
        self.closed = None;
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
    }

    fn source(&self, cache: &KvCache, layer: usize) -> Option<usize> {
        cache
            .geometry()
            .sources
            .iter()
            .position(|s| s.layer == layer)
    }

    fn cached_entries(&self, cache: &KvCache, layer: usize) -> u64 {
        cache.global_entries(self.seq, layer).map_or(0, |v| v.len())
    }

    fn len(&self, cache: &KvCache) -> u64 {
        cache.len(self.seq).unwrap_or(0)
    }

    fn step_start(&self, cache: &KvCache) -> u64 {
        self.replay_from.unwrap_or_else(|| self.len(cache))
    }

    fn window_floor(&self, cache: &KvCache) -> u64 {
        self.replay_from
            .unwrap_or_else(|| cache.window(self.seq, 0).map_or(0, |v| v.range().start))
    }

    fn window_row<'a>(&'a self, cache: &'a KvCache, layer: usize, pos: u64) -> Option<&'a [u8]> {
        if pos >= self.step_start(cache) {
            return None;
        }
        let view = cache.window(self.seq, layer).ok()?;
        view.get(pos).map(|e| e.as_bytes())
    }

    fn compressed_len(&self, cache: &KvCache, layer: usize) -> u64 {
        let staged =
            self.source(cache, layer)
                .map_or(0, |i| self.entries[i].len() / GlobalFp4Entry::BYTES) as u64;
        self.cached_entries(cache, layer) + staged
    }

    fn compressed_row<'a>(&'a self, cache: &'a KvCache, layer: usize, j: u64) -> Option<&'a [u8]> {
        let cached = self.cached_entries(cache, layer);
        if j < cached {
            let view = cache.global_entries(self.seq, layer).ok()?;
            return view.get(j).map(|e| e.as_bytes());
        }
        let i = self.source(cache, layer)?;
        let k = usize::try_from(j - cached).ok()?;
        self.entries[i].get(k * GlobalFp4Entry::BYTES..(k + 1) * GlobalFp4Entry::BYTES)
    }

    fn index_key_row<'a>(&'a self, cache: &'a KvCache, layer: usize, j: u64) -> Option<&'a [u8]> {
        let cached = self.cached_entries(cache, layer);
        if j < cached {
            let view = cache.index_keys(self.seq, layer).ok()?;
            return view.get(j).map(|e| e.as_bytes());
        }
        let i = self.source(cache, layer)?;
        let k = usize::try_from(j - cached).ok()?;
        self.keys[i].get(k * IndexMxfp4Entry::BYTES..(k + 1) * IndexMxfp4Entry::BYTES)
    }

    fn index_key_runs<'a>(&'a self, cache: &'a KvCache, layer: usize) -> Vec<&'a [u8]> {
        let mut runs: Vec<&[u8]> = cache
            .index_keys(self.seq, layer)
            .map(|v| v.pages().map(|p| p.as_bytes()).collect())
            .unwrap_or_default();
        if let Some(staged) = self.source(cache, layer).and_then(|i| self.keys.get(i)) {
            runs.push(staged);
        }
        runs
    }

    fn pending<'a>(&'a self, cache: &'a KvCache, layer: usize) -> &'a [f32] {
        if let Some(Some(p)) = self.source(cache, layer).map(|i| &self.pending[i]) {
            return p;
        }
        match cache.pending(self.seq, layer) {
            Ok(Some(p)) => p,
            _ => &[],
        }
    }

    fn push_window(
        &mut self,
        cache: &KvCache,
        layer: usize,
        first: u64,
        rows: &[u8],
    ) -> Result<(), Error> {
        let start = self.step_start(cache);
        let staged = self
            .window
            .get_mut(layer)
            .ok_or_else(|| state(layer, "layer outside the cache"))?;
        if first != start || !staged.is_empty() || !rows.len().is_multiple_of(WindowFp8Entry::BYTES)
        {
            return Err(state(
                layer,
                format!(
                    "window rows pushed at {first} ({} bytes); the step starts at {start}",
                    rows.len()
                ),
            ));
        }
        staged.extend_from_slice(rows);
        Ok(())
    }

    fn push_compressed(
        &mut self,
        cache: &KvCache,
        layer: usize,
        entries: &[u8],
        keys: &[u8],
    ) -> Result<(), Error> {
        let i = self
            .source(cache, layer)
            .ok_or_else(|| state(layer, "not a KV source of the cache"))?;
        if !entries.len().is_multiple_of(GlobalFp4Entry::BYTES)
            || keys.len() / IndexMxfp4Entry::BYTES != entries.len() / GlobalFp4Entry::BYTES
        {
            return Err(state(
                layer,
                "entries and keys of different counts or sizes",
            ));
        }
        self.entries[i].extend_from_slice(entries);
        self.keys[i].extend_from_slice(keys);
        Ok(())
    }

    fn set_pending(&mut self, cache: &KvCache, layer: usize, pending: &[f32]) -> Result<(), Error> {
        let i = self
            .source(cache, layer)
            .ok_or_else(|| state(layer, "not a KV source of the cache"))?;
        self.pending[i] = Some(pending.to_vec());
        Ok(())
    }

    fn begin_replay(&mut self, cache: &KvCache, from: u64) -> Result<(), Error> {
        let len = self.len(cache);
        let w = cache.geometry().window_tokens as u64;
        if from > len || len - from > w || self.closed.is_some() {
            return Err(state(
                0,
                format!(
                    "replay from {from} with {len} tokens committed (at most the window of {w}, outside a step)"
                ),
            ));
        }
        self.replay_from = Some(from);
        Ok(())
    }

    /// Closes the step of `tokens` tokens (checks only; [`PagedStage::apply`] writes it).
    fn close(&mut self, cache: &KvCache, tokens: u64) -> Result<(), Error> {
        if self.tokens.len() as u64 != tokens {
            return Err(state(
                0,
                format!(
                    "{} token ids given for a step of {tokens} (begin_step)",
                    self.tokens.len()
                ),
            ));
        }
        let (start, len) = (self.step_start(cache), self.len(cache));
        if start + tokens < len {
            return Err(state(
                0,
                format!("a replay step from {start} of {tokens} tokens ends before {len}"),
            ));
        }
        for (l, rows) in self.window.iter().enumerate() {
            if rows.len() != tokens as usize * WindowFp8Entry::BYTES {
                return Err(state(
                    l,
                    format!("{} window bytes staged for {tokens} tokens", rows.len()),
                ));
            }
        }
        self.closed = Some(tokens);
        Ok(())
    }

    fn clear(&mut self) {
        for v in self
            .window
            .iter_mut()
            .chain(&mut self.entries)
            .chain(&mut self.keys)
        {
            v.clear();
        }
        self.pending.iter_mut().for_each(|p| *p = None);
        self.tokens.clear();
        self.replay_from = None;
        self.closed = None;
    }

    /// Drops a step that will not be applied (after an error in the forward pass).
    pub fn discard(&mut self) {
        self.clear();
    }

    /// Writes a closed step into the cache: a replay's window rows, then one
    /// [`KvCache::append`] of the new tokens. Does nothing when no step is closed.
    ///
    /// # Errors
    /// [`Error::Cache`] (the stage is discarded either way).
    pub fn apply(&mut self, cache: &mut KvCache) -> Result<(), Error> {
        let Some(tokens) = self.closed else {
            return Ok(());
        };
        let r = self.write(cache, tokens);
        self.clear();
        r
    }

    fn write(&self, cache: &mut KvCache, tokens: u64) -> Result<(), Error> {
        let g = cache.geometry().clone();
        let w = g.window_tokens;
        let len = self.len(cache);
        let start = self.step_start(cache);
        let n = tokens as usize;
        // Positions start .. len are replayed; len .. start + n are new.
        let replayed = (len - start) as usize;
        let new = n - replayed;
        let row = |l: usize, i: usize| -> Result<&WindowFp8Entry, Error> {
            let b = self.window[l]
                .get(i * WindowFp8Entry::BYTES..(i + 1) * WindowFp8Entry::BYTES)
                .ok_or_else(|| state(l, "window row missing"))?;
            WindowFp8Entry::ref_from_bytes(b).map_err(|_| state(l, "window row size"))
        };
        if replayed > 0 && new < w {
            // The replayed rows still inside the window after the new tokens.
            let keep = (w - new).min(replayed);
            let mut rows = Vec::with_capacity(keep * g.num_layers);
            for l in 0..g.num_layers {
                for i in replayed - keep..replayed {
                    rows.push(*row(l, i)?);
                }
            }
            cache
                .write_window(self.seq, len - keep as u64, &rows)
                .map_err(Error::Cache)?;
        }
        if new == 0 {
            return Ok(());
        }
        let k = new.min(w);
        let mut window: Vec<WindowFp8Entry> = Vec::with_capacity(k * g.num_layers);
        for l in 0..g.num_layers {
            for i in n - k..n {
                window.push(*row(l, i)?);
            }
        }
        let mut global = Vec::with_capacity(self.entries.len());
        let mut index = Vec::with_capacity(self.keys.len());
        for (e, kk) in self.entries.iter().zip(&self.keys) {
            global.push(
                <[GlobalFp4Entry]>::ref_from_bytes(e)
                    .map_err(|_| state(0, "staged entries are not whole"))?,
            );
            index.push(
                <[IndexMxfp4Entry]>::ref_from_bytes(kk)
                    .map_err(|_| state(0, "staged keys are not whole"))?,
            );
        }
        let pending: Vec<&[f32]> = self
            .pending
            .iter()
            .map(|p| p.as_deref().unwrap_or(&[]))
            .collect();
        let data = AppendData {
            tokens: &self.tokens[replayed..],
            global,
            index,
            window: &window,
            pending,
        };
        cache.append(self.seq, &data).map_err(Error::Cache)
    }
}

/// The [`KvStore`] methods of both front ends, reading through `$cache` and `$stage`.
macro_rules! paged_kv_store {
    ($ty:ty, $cache:ident, $stage:ident, $commit:expr) => {
        impl KvStore for $ty {
            fn len(&self) -> u64 {
                self.$stage.len(&*self.$cache)
            }

            fn window_row(&self, layer: usize, pos: u64) -> Option<&[u8]> {
                self.$stage.window_row(&*self.$cache, layer, pos)
            }

            fn compressed_len(&self, source: usize) -> u64 {
                self.$stage.compressed_len(&*self.$cache, source)
            }

            fn compressed_row(&self, source: usize, j: u64) -> Option<&[u8]> {
                self.$stage.compressed_row(&*self.$cache, source, j)
            }

            fn index_key_row(&self, source: usize, j: u64) -> Option<&[u8]> {
                self.$stage.index_key_row(&*self.$cache, source, j)
            }

            fn index_key_runs(&self, source: usize) -> Vec<&[u8]> {
                self.$stage.index_key_runs(&*self.$cache, source)
            }

            fn pending(&self, source: usize) -> &[f32] {
                self.$stage.pending(&*self.$cache, source)
            }

            fn push_window(&mut self, layer: usize, first: u64, rows: &[u8]) -> Result<(), Error> {
                self.$stage.push_window(&*self.$cache, layer, first, rows)
            }

            fn push_compressed(
                &mut self,
                source: usize,
                entries: &[u8],
                keys: &[u8],
            ) -> Result<(), Error> {
                self.$stage
                    .push_compressed(&*self.$cache, source, entries, keys)
            }

            fn set_pending(&mut self, source: usize, pending: &[f32]) -> Result<(), Error> {
                self.$stage.set_pending(&*self.$cache, source, pending)
            }

            fn commit(&mut self, tokens: u64) -> Result<(), Error> {
                self.$stage.close(&*self.$cache, tokens)?;
                #[allow(clippy::redundant_closure_call)]
                ($commit)(self)
            }

            fn step_start(&self) -> u64 {
                self.$stage.step_start(&*self.$cache)
            }

            fn window_floor(&self) -> u64 {
                self.$stage.window_floor(&*self.$cache)
            }

            fn begin_replay(&mut self, from: u64) -> Result<(), Error> {
                self.$stage.begin_replay(&*self.$cache, from)
            }
        }
    };
}

paged_kv_store!(PagedView<'_>, cache, stage, |_: &mut PagedView<'_>| Ok(()));
paged_kv_store!(PagedStore<'_>, cache, stage, |s: &mut PagedStore<'_>| s
    .stage
    .apply(s.cache));

impl<'a> PagedView<'a> {
    /// Sets the token ids of the next step (see [`PagedStage::begin_step`]).
    pub fn begin_step(&mut self, tokens: &[u32]) {
        self.stage.begin_step(tokens);
    }
}

impl<'c> PagedStore<'c> {
    /// A store over sequence `seq` of `cache`.
    ///
    /// # Errors
    /// [`Error::State`] when `seq` is not in the cache.
    pub fn new(cache: &'c mut KvCache, seq: SequenceId) -> Result<PagedStore<'c>, Error> {
        let stage = PagedStage::new(cache, seq)?;
        Ok(PagedStore { cache, stage })
    }

    /// Sets the token ids of the next step (the cache keys its prefix index by them); must be
    /// called before the step's [`KvStore::commit`] with as many ids as the step has tokens.
    pub fn begin_step(&mut self, tokens: &[u32]) {
        self.stage.begin_step(tokens);
    }

    /// The cache.
    pub fn cache(&self) -> &KvCache {
        self.cache
    }
}
