//! [`KvStore`] over the paged cache ([`crate::cache::KvCache`]) at the deployed dimensions
//! (512-wide FP8 window rows and FP4 entries, 128-wide MXFP4 keys).
//!
//! Reads go straight to the cache's views (block tables, window ring). A step's writes are
//! staged here and reach the cache in one [`KvCache::append`] at [`KvStore::commit`], which is
//! the cache's unit of update (all or nothing, one call per prefill chunk or decoded token);
//! until then the staged compressed entries and keys are served from the stage, so the layers
//! that reuse a KV source see its new entries within the step. Only the last `sliding_window`
//! window rows of a step are handed to the cache (earlier ones are never read again).

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use zerocopy::{FromBytes, IntoBytes};

use crate::cache::{AppendData, KvCache, SequenceId};

use super::error::Error;
use super::store::KvStore;

/// A [`KvStore`] view of one sequence of a [`KvCache`].
#[derive(Debug)]
pub struct PagedStore<'c> {
    cache: &'c mut KvCache,
    seq: SequenceId,
    tokens: Vec<u32>,
    /// Per layer: window rows of the step.
    window: Vec<Vec<u8>>,
    /// Per cache source (geometry order): staged entries, keys, and the new pending state.
    entries: Vec<Vec<u8>>,
    keys: Vec<Vec<u8>>,
    pending: Vec<Option<Vec<f32>>>,
}

fn state(layer: usize, reason: impl Into<String>) -> Error {
    Error::State {
        layer,
        reason: reason.into(),
    }
}

impl<'c> PagedStore<'c> {
    /// A store over sequence `seq` of `cache`.
    pub fn new(cache: &'c mut KvCache, seq: SequenceId) -> Result<PagedStore<'c>, Error> {
        cache.len(seq).map_err(|e| state(0, e.to_string()))?;
        let g = cache.geometry();
        let (layers, sources) = (g.num_layers, g.sources.len());
        Ok(PagedStore {
            cache,
            seq,
            tokens: Vec::new(),
            window: vec![Vec::new(); layers],
            entries: vec![Vec::new(); sources],
            keys: vec![Vec::new(); sources],
            pending: vec![None; sources],
        })
    }

    /// Sets the token ids of the next step (the cache keys its prefix index by them); must be
    /// called before the step's [`KvStore::commit`] with as many ids as the step has tokens.
    pub fn begin_step(&mut self, tokens: &[u32]) {
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
    }

    /// The cache.
    pub fn cache(&self) -> &KvCache {
        self.cache
    }

    /// The cache source index of KV source `layer`.
    fn source(&self, layer: usize) -> Option<usize> {
        self.cache
            .geometry()
            .sources
            .iter()
            .position(|s| s.layer == layer)
    }

    fn cached_entries(&self, layer: usize) -> u64 {
        self.cache
            .global_entries(self.seq, layer)
            .map_or(0, |v| v.len())
    }
}

impl KvStore for PagedStore<'_> {
    fn len(&self) -> u64 {
        self.cache.len(self.seq).unwrap_or(0)
    }

    fn window_row(&self, layer: usize, pos: u64) -> Option<&[u8]> {
        let view = self.cache.window(self.seq, layer).ok()?;
        view.get(pos).map(|e| e.as_bytes())
    }

    fn compressed_len(&self, source: usize) -> u64 {
        let staged =
            self.source(source)
                .map_or(0, |i| self.entries[i].len() / GlobalFp4Entry::BYTES) as u64;
        self.cached_entries(source) + staged
    }

    fn compressed_row(&self, source: usize, j: u64) -> Option<&[u8]> {
        let cached = self.cached_entries(source);
        if j < cached {
            let view = self.cache.global_entries(self.seq, source).ok()?;
            return view.get(j).map(|e| e.as_bytes());
        }
        let i = self.source(source)?;
        let k = usize::try_from(j - cached).ok()?;
        self.entries[i].get(k * GlobalFp4Entry::BYTES..(k + 1) * GlobalFp4Entry::BYTES)
    }

    fn index_key_row(&self, source: usize, j: u64) -> Option<&[u8]> {
        let cached = self.cached_entries(source);
        if j < cached {
            let view = self.cache.index_keys(self.seq, source).ok()?;
            return view.get(j).map(|e| e.as_bytes());
        }
        let i = self.source(source)?;
        let k = usize::try_from(j - cached).ok()?;
        self.keys[i].get(k * IndexMxfp4Entry::BYTES..(k + 1) * IndexMxfp4Entry::BYTES)
    }

    fn pending(&self, source: usize) -> &[f32] {
        if let Some(Some(p)) = self.source(source).map(|i| &self.pending[i]) {
            return p;
        }
        match self.cache.pending(self.seq, source) {
            Ok(Some(p)) => p,
            _ => &[],
        }
    }

    fn push_window(&mut self, layer: usize, first: u64, rows: &[u8]) -> Result<(), Error> {
        let len = self.len();
        let staged = self
            .window
            .get_mut(layer)
            .ok_or_else(|| state(layer, "layer outside the cache"))?;
        if first != len || !staged.is_empty() || !rows.len().is_multiple_of(WindowFp8Entry::BYTES) {
            return Err(state(
                layer,
                format!(
                    "window rows pushed at {first} ({} bytes); the step starts at {len}",
                    rows.len()
                ),
            ));
        }
        staged.extend_from_slice(rows);
        Ok(())
    }

    fn push_compressed(&mut self, source: usize, entries: &[u8], keys: &[u8]) -> Result<(), Error> {
        let i = self
            .source(source)
            .ok_or_else(|| state(source, "not a KV source of the cache"))?;
        if !entries.len().is_multiple_of(GlobalFp4Entry::BYTES)
            || keys.len() / IndexMxfp4Entry::BYTES != entries.len() / GlobalFp4Entry::BYTES
        {
            return Err(state(
                source,
                "entries and keys of different counts or sizes",
            ));
        }
        self.entries[i].extend_from_slice(entries);
        self.keys[i].extend_from_slice(keys);
        Ok(())
    }

    fn set_pending(&mut self, source: usize, pending: &[f32]) -> Result<(), Error> {
        let i = self
            .source(source)
            .ok_or_else(|| state(source, "not a KV source of the cache"))?;
        self.pending[i] = Some(pending.to_vec());
        Ok(())
    }

    fn commit(&mut self, tokens: u64) -> Result<(), Error> {
        if self.tokens.len() as u64 != tokens {
            return Err(state(
                0,
                format!(
                    "{} token ids given for a step of {tokens} (PagedStore::begin_step)",
                    self.tokens.len()
                ),
            ));
        }
        let g = self.cache.geometry();
        let n = tokens as usize;
        let k = n.min(g.window_tokens);
        // Window rows: the last k of every layer, layer-major.
        let mut window: Vec<WindowFp8Entry> = Vec::with_capacity(k * self.window.len());
        for (l, rows) in self.window.iter().enumerate() {
            let all = <[WindowFp8Entry]>::ref_from_bytes(rows)
                .map_err(|_| state(l, "window rows are not whole entries"))?;
            if all.len() != n {
                return Err(state(
                    l,
                    format!("{} window rows staged for {n} tokens", all.len()),
                ));
            }
            window.extend_from_slice(&all[n - k..]);
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
            tokens: &self.tokens,
            global,
            index,
            window: &window,
            pending,
        };
        self.cache.append(self.seq, &data).map_err(Error::Cache)?;
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
        Ok(())
    }
}
