//! Where the attention layer reads and writes the persistent CSA2 state of one sequence
//! (spec §4, §6): the window rows of every layer, the compressed entries and index keys of
//! every KV source, and each ratio-2 source's pending compressor tokens.
//!
//! The layer talks to the state through the [`KvStore`] trait only, so the same layer code
//! runs over [`ContiguousStore`] (plain vectors at any dimensions: verification, tests) and
//! over a paged cache at the deployed dimensions (`kvstack_cache::KvCache`, whose views hand
//! out `&GlobalFp4Entry` / `&IndexMxfp4Entry` / `&WindowFp8Entry`, i.e. exactly these row
//! bytes; an adapter needs to buffer a step's writes until `commit`, which `KvCache::append`
//! takes in one call).
//!
//! Per-token selection state (top-k, candidates) is not persistent: it lives for one forward
//! step and is threaded through [`super::StepState`].
//!
//! Protocol of one forward step over `n` tokens at positions `len() .. len() + n`: every
//! layer reads rows before `len()` and writes its own new rows (`push_window`,
//! `push_compressed`, `set_pending`); KV sources push before the layers that reuse them run,
//! and those read the new entries in the same step; then `commit(n)`.
//!
//! **Bounded replay** (spec §7): after a prefix was restored with its global KV but without
//! its window, [`KvStore::begin_replay`]`(s)` makes the next step start at `s < len()`
//! ([`KvStore::step_start`]): it runs the replayed tokens `s .. len()` and then the new ones.
//! The layers push window rows from `s`, but push only compressed entries past those the store
//! already holds (replayed tokens never overwrite cached global KV), and attention never reads
//! window rows below [`KvStore::window_floor`] (which is `s` from then on).

use crate::Error;

/// Access to the persistent CSA2 state of one sequence. Rows are the encoded bytes of the
/// entry formats of spec §5 at the model's widths (FP8 window rows, FP4 entries, MXFP4 keys).
pub trait KvStore {
    /// Tokens committed so far (the position of the next step's first token).
    fn len(&self) -> u64;

    /// Whether no token is committed.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The window row of `layer` at `pos` (`pos < len()`), if still held.
    fn window_row(&self, layer: usize, pos: u64) -> Option<&[u8]>;

    /// Compressed entries of KV source `source` (including those pushed in this step).
    fn compressed_len(&self, source: usize) -> u64;

    /// Compressed entry `j` of `source`.
    fn compressed_row(&self, source: usize, j: u64) -> Option<&[u8]>;

    /// Index key `j` of `source`.
    fn index_key_row(&self, source: usize, j: u64) -> Option<&[u8]>;

    /// The index keys of `source` ([`KvStore::compressed_len`] rows) as byte runs in position
    /// order, so that a scan reads them in place: a paged store's pages, then the rows pushed
    /// in this step. The default asks [`KvStore::index_key_row`] for every row.
    fn index_key_runs(&self, source: usize) -> Vec<&[u8]> {
        (0..self.compressed_len(source))
            .map_while(|j| self.index_key_row(source, j))
            .collect()
    }

    /// The pending compressor projections of `source` (see
    /// `kvstack_kernels::csa2::compress::CompressorState`).
    fn pending(&self, source: usize) -> &[f32];

    /// Appends the window rows of `layer` for positions `first ..` (`first == len()`).
    fn push_window(&mut self, layer: usize, first: u64, rows: &[u8]) -> Result<(), Error>;

    /// Appends compressed entries and their index keys (same count) of `source`.
    fn push_compressed(&mut self, source: usize, entries: &[u8], keys: &[u8]) -> Result<(), Error>;

    /// Replaces the pending compressor projections of `source`.
    fn set_pending(&mut self, source: usize, pending: &[f32]) -> Result<(), Error>;

    /// Ends a step of `tokens` tokens (counted from [`KvStore::step_start`], so a replay step
    /// counts its replayed tokens too).
    fn commit(&mut self, tokens: u64) -> Result<(), Error>;

    /// The position of the current step's first token: `len()`, or the replay start after
    /// [`KvStore::begin_replay`] until the step commits.
    fn step_start(&self) -> u64 {
        self.len()
    }

    /// The lowest position whose window row exists: attention truncates every window there
    /// (spec §7: after a replay from `s`, query `i` attends window keys `[max(s, i - w + 1), i]`).
    fn window_floor(&self) -> u64 {
        0
    }

    /// Makes the next step a bounded replay starting at `from` (`from <= len()`, a multiple
    /// of every compress ratio): see the module docs.
    ///
    /// # Errors
    /// [`Error::State`] when the store cannot replay or `from` is out of range.
    fn begin_replay(&mut self, from: u64) -> Result<(), Error> {
        Err(Error::State {
            layer: 0,
            reason: format!("this store cannot replay (asked to replay from {from})"),
        })
    }
}

#[derive(Clone, Debug, Default)]
struct LayerRows {
    /// Window rows for positions `window_first ..`.
    window: Vec<u8>,
    window_first: u64,
    /// Window rows pushed in the current step (positions `len ..`).
    staged: Vec<u8>,
    compressed: Vec<u8>,
    keys: Vec<u8>,
    pending: Vec<f32>,
}

/// A [`KvStore`] in plain vectors, at any row widths. Keeps every compressed entry and, per
/// layer, the last `keep_window` window rows (all of them with `None`).
#[derive(Clone, Debug)]
pub struct ContiguousStore {
    len: u64,
    window_bytes: usize,
    entry_bytes: usize,
    key_bytes: usize,
    keep_window: Option<usize>,
    layers: Vec<LayerRows>,
    /// Start of the current step when it is a replay.
    replay_from: Option<u64>,
    /// [`KvStore::window_floor`].
    floor: u64,
}

impl ContiguousStore {
    /// An empty store for `layers` layers with rows of the given byte sizes.
    pub fn new(
        layers: usize,
        window_bytes: usize,
        entry_bytes: usize,
        key_bytes: usize,
        keep_window: Option<usize>,
    ) -> ContiguousStore {
        ContiguousStore {
            len: 0,
            window_bytes,
            entry_bytes,
            key_bytes,
            keep_window,
            layers: vec![LayerRows::default(); layers],
            replay_from: None,
            floor: 0,
        }
    }

    /// Forgets every window row, keeping the global entries, index keys and pending state:
    /// the state a restore from the global tier without a window snapshot leaves (spec §7).
    /// The next step should be a replay ([`KvStore::begin_replay`]).
    pub fn drop_window(&mut self) {
        for l in &mut self.layers {
            l.window.clear();
            l.staged.clear();
            l.window_first = self.len;
        }
        self.floor = self.len;
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut LayerRows, Error> {
        let n = self.layers.len();
        self.layers.get_mut(layer).ok_or_else(|| Error::State {
            layer,
            reason: format!("the store holds {n} layers"),
        })
    }

    /// Every compressed entry of `source`, contiguous.
    pub fn compressed_rows(&self, source: usize) -> &[u8] {
        self.layers.get(source).map_or(&[], |l| &l.compressed)
    }

    /// Every index key of `source`, contiguous.
    pub fn index_key_rows(&self, source: usize) -> &[u8] {
        self.layers.get(source).map_or(&[], |l| &l.keys)
    }
}

fn row(bytes: &[u8], size: usize, i: u64) -> Option<&[u8]> {
    let i = usize::try_from(i).ok()?;
    bytes.get(i.checked_mul(size)?..(i + 1).checked_mul(size)?)
}

impl KvStore for ContiguousStore {
    fn len(&self) -> u64 {
        self.len
    }

    fn window_row(&self, layer: usize, pos: u64) -> Option<&[u8]> {
        let l = self.layers.get(layer)?;
        if pos >= self.step_start() {
            return None;
        }
        row(
            &l.window,
            self.window_bytes,
            pos.checked_sub(l.window_first)?,
        )
    }

    fn compressed_len(&self, source: usize) -> u64 {
        self.layers
            .get(source)
            .map_or(0, |l| (l.compressed.len() / self.entry_bytes.max(1)) as u64)
    }

    fn compressed_row(&self, source: usize, j: u64) -> Option<&[u8]> {
        row(&self.layers.get(source)?.compressed, self.entry_bytes, j)
    }

    fn index_key_row(&self, source: usize, j: u64) -> Option<&[u8]> {
        row(&self.layers.get(source)?.keys, self.key_bytes, j)
    }

    fn index_key_runs(&self, source: usize) -> Vec<&[u8]> {
        vec![self.index_key_rows(source)]
    }

    fn pending(&self, source: usize) -> &[f32] {
        self.layers.get(source).map_or(&[], |l| &l.pending)
    }

    fn push_window(&mut self, layer: usize, first: u64, rows: &[u8]) -> Result<(), Error> {
        let (len, wb) = (self.step_start(), self.window_bytes);
        let l = self.layer_mut(layer)?;
        if first != len || !l.staged.is_empty() || !rows.len().is_multiple_of(wb.max(1)) {
            return Err(Error::State {
                layer,
                reason: format!(
                    "window rows pushed at position {first} ({} bytes) but the step starts at {len} with rows of {wb} bytes (pushed once per step)",
                    rows.len()
                ),
            });
        }
        l.staged.extend_from_slice(rows);
        Ok(())
    }

    fn push_compressed(&mut self, source: usize, entries: &[u8], keys: &[u8]) -> Result<(), Error> {
        let (eb, kb) = (self.entry_bytes.max(1), self.key_bytes.max(1));
        let l = self.layer_mut(source)?;
        if !entries.len().is_multiple_of(eb)
            || keys.len() / kb != entries.len() / eb
            || !keys.len().is_multiple_of(kb)
        {
            return Err(Error::State {
                layer: source,
                reason: format!(
                    "{} entry bytes and {} key bytes are not the same number of rows of {eb} and {kb} bytes",
                    entries.len(),
                    keys.len()
                ),
            });
        }
        l.compressed.extend_from_slice(entries);
        l.keys.extend_from_slice(keys);
        Ok(())
    }

    fn set_pending(&mut self, source: usize, pending: &[f32]) -> Result<(), Error> {
        let l = self.layer_mut(source)?;
        l.pending.clear();
        l.pending.extend_from_slice(pending);
        Ok(())
    }

    fn commit(&mut self, tokens: u64) -> Result<(), Error> {
        let wb = self.window_bytes.max(1);
        let start = self.step_start();
        let new_len = start + tokens;
        if new_len < self.len {
            return Err(Error::State {
                layer: 0,
                reason: format!(
                    "a replay step from {start} of {tokens} tokens ends before the {} committed",
                    self.len
                ),
            });
        }
        for (i, l) in self.layers.iter_mut().enumerate() {
            let staged = (l.staged.len() / wb) as u64;
            if staged != 0 && staged != tokens {
                return Err(Error::State {
                    layer: i,
                    reason: format!("{staged} window rows pushed in a step of {tokens} tokens"),
                });
            }
            if start < self.len {
                // Replay: the step's rows replace whatever this layer held from `start` on.
                if l.window_first >= start {
                    l.window.clear();
                    l.window_first = start;
                } else {
                    l.window.truncate((start - l.window_first) as usize * wb);
                }
            }
            l.window.append(&mut l.staged);
            if let Some(keep) = self.keep_window {
                let held = (l.window.len() / wb) as u64;
                let drop = held.saturating_sub(keep as u64);
                if drop > 0 {
                    l.window.drain(..drop as usize * wb);
                    l.window_first += drop;
                }
            }
        }
        if let Some(from) = self.replay_from.take() {
            self.floor = self.floor.max(from);
        }
        self.len = new_len;
        Ok(())
    }

    fn step_start(&self) -> u64 {
        self.replay_from.unwrap_or(self.len)
    }

    fn window_floor(&self) -> u64 {
        self.replay_from.unwrap_or(self.floor)
    }

    fn begin_replay(&mut self, from: u64) -> Result<(), Error> {
        if from > self.len || self.layers.iter().any(|l| !l.staged.is_empty()) {
            return Err(Error::State {
                layer: 0,
                reason: format!(
                    "replay from {from} with {} tokens committed (or inside a step)",
                    self.len
                ),
            });
        }
        self.replay_from = Some(from);
        Ok(())
    }
}
