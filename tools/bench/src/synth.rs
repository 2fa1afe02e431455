//! Synthetic KV for the harnesses that fill caches and stores: entries in the stored formats
//! (FP4 global entries, MXFP4 indexer keys, FP8 window rows, encoded once by
//! `kvstack_kernels::quantize` from synthetic values) and sliced for every append, so filling
//! a cache costs a copy per byte and no encoding. The bytes do not matter to what the
//! harnesses measure (stores, pools, paged memory), only their sizes and formats do.

use kvstack_cache::{AppendData, CacheGeometry, KvCache, SequenceId};
use kvstack_firmware_interface::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use zerocopy::{FromBytes, IntoBytes};

use crate::rng::Rng;
use crate::{Error, Result};

/// Tokens per append of [`SyntheticKv::append`] (bounds the entry buffers).
pub(crate) const CHUNK_TOKENS: usize = 4096;

/// Bytes of `n` pseudo-random values (xorshift64), for payloads whose content does not matter.
pub(crate) fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    (0..n).map(|_| rng.next() as u8).collect()
}

/// Encoded entries of one geometry, enough for one append of [`CHUNK_TOKENS`] tokens.
pub(crate) struct SyntheticKv {
    global: Vec<GlobalFp4Entry>,
    index: Vec<IndexMxfp4Entry>,
    /// `num_layers x window_tokens` rows, layer-major.
    window: Vec<WindowFp8Entry>,
    /// Pending compressor state of a source's open group (`(ratio - 1) x pending floats`).
    pending: Vec<f32>,
    layers: usize,
    window_tokens: usize,
}

fn encoded<T: FromBytes + IntoBytes + Clone>(
    rng: &mut Rng,
    format: EntryFormat,
    rows: usize,
) -> Result<Vec<T>> {
    let values: Vec<f32> = (0..rows * format.dim()).map(|_| rng.normal(4.0)).collect();
    let mut out = vec![T::new_zeroed(); rows];
    kvstack_kernels::quantize(format, &values, out.as_mut_bytes()).map_err(|source| {
        Error::Codec {
            what: format.name(),
            source,
        }
    })?;
    Ok(out)
}

impl SyntheticKv {
    /// Entries for a cache of geometry `g`.
    ///
    /// # Errors
    /// [`Error::Codec`] if the codec refuses the synthetic values (a bug).
    pub(crate) fn new(g: &CacheGeometry) -> Result<SyntheticKv> {
        let mut rng = Rng(0x5EED_CAFE_F00D_D00D);
        let max_pending = g.sources.iter().map(|s| s.max_pending_tokens).max();
        Ok(SyntheticKv {
            global: encoded(&mut rng, EntryFormat::GlobalFp4, CHUNK_TOKENS)?,
            index: encoded(&mut rng, EntryFormat::IndexMxfp4, CHUNK_TOKENS)?,
            window: encoded(
                &mut rng,
                EntryFormat::WindowFp8,
                g.num_layers * g.window_tokens,
            )?,
            pending: vec![0.5; max_pending.unwrap_or(0) * g.pending_token_floats],
            layers: g.num_layers,
            window_tokens: g.window_tokens,
        })
    }

    /// Appends `tokens` to `seq`, in chunks of at most [`CHUNK_TOKENS`], with window rows for
    /// the appended positions that fall in `[window_end - window, window_end)`: a prefill
    /// keeps only the rows its sequence will still hold at `window_end`, so a sequence that
    /// reaches `window_end` has a complete window.
    ///
    /// # Errors
    /// The cache's errors ([`kvstack_cache::Error::PoolExhausted`] and others); the chunks
    /// before the failing one stay appended.
    pub(crate) fn append(
        &self,
        cache: &mut KvCache,
        seq: SequenceId,
        tokens: &[u32],
        window_end: u64,
    ) -> Result<()> {
        let window_start = window_end.saturating_sub(self.window_tokens as u64);
        let mut at = 0usize;
        while at < tokens.len() {
            let end = (at + CHUNK_TOKENS).min(tokens.len());
            let shape = cache.append_shape(seq, (end - at) as u64)?;
            let first = shape.len;
            let last = first + (end - at) as u64;
            let k = last.saturating_sub(first.max(window_start)) as usize;
            let data = AppendData {
                tokens: &tokens[at..end],
                global: shape
                    .entries
                    .iter()
                    .map(|&e| self.global.get(..e as usize).unwrap_or_default())
                    .collect(),
                index: shape
                    .entries
                    .iter()
                    .map(|&e| self.index.get(..e as usize).unwrap_or_default())
                    .collect(),
                window: self.window.get(..self.layers * k).unwrap_or_default(),
                pending: shape
                    .pending_tokens
                    .iter()
                    .map(|&p| {
                        let n = (p * shape.pending_token_floats) as usize;
                        self.pending.get(..n).unwrap_or_default()
                    })
                    .collect(),
            };
            cache.append(seq, &data)?;
            at = end;
        }
        Ok(())
    }

    /// Writes window rows for positions `[first, len)` of `seq` (what a bounded replay
    /// regenerates after a restore without a window snapshot).
    ///
    /// # Errors
    /// The cache's errors.
    pub(crate) fn write_window(
        &self,
        cache: &mut KvCache,
        seq: SequenceId,
        first: u64,
    ) -> Result<()> {
        let len = cache.len(seq)?;
        let k = len.saturating_sub(first).min(self.window_tokens as u64) as usize;
        if k == 0 {
            return Ok(());
        }
        let rows = self.window.get(..self.layers * k).unwrap_or_default();
        cache.write_window(seq, len - k as u64, rows)?;
        Ok(())
    }
}
