//! Read access for attention: the entries of one sequence at one layer, through its block
//! table.

use std::marker::PhantomData;
use std::ops::Range;

use kvstack_firmware_interface::WindowFp8Entry;
use zerocopy::{FromBytes, Immutable, KnownLayout};

use super::pool::{PageId, PagePool};

/// The compressed entries (or indexer keys) of one sequence at one layer, by compressed
/// position `0..len()`. Position `j` covers tokens `[j * ratio, (j + 1) * ratio)`; it is visible
/// to query position `t` when `j < (t + 1) / ratio` (spec §4).
///
/// Entries live in pages of [`EntryView::page_entries`] entries; [`EntryView::pages`] yields
/// them page by page (for scans), [`EntryView::get`] picks single positions (for top-k).
pub struct EntryView<'a, T> {
    pool: &'a PagePool,
    table: &'a [PageId],
    len: u64,
    page_entries: usize,
    _entry: PhantomData<T>,
}

impl<T> Clone for EntryView<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for EntryView<'_, T> {}

impl<T> std::fmt::Debug for EntryView<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntryView")
            .field("pool", &self.pool.name())
            .field("len", &self.len)
            .field("pages", &self.table.len())
            .finish()
    }
}

impl<'a, T: FromBytes + Immutable + KnownLayout + 'a> EntryView<'a, T> {
    pub(crate) fn new(pool: &'a PagePool, table: &'a [PageId], len: u64) -> Self {
        EntryView {
            pool,
            table,
            len,
            page_entries: pool.page_entries(),
            _entry: PhantomData,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries per page.
    pub fn page_entries(&self) -> usize {
        self.page_entries
    }

    /// The page ids of the block table (page `k` holds positions
    /// `[k * page_entries, (k + 1) * page_entries)`).
    pub fn page_ids(&self) -> &'a [PageId] {
        self.table
    }

    /// The entry at compressed position `pos`, `None` past the end.
    pub fn get(&self, pos: u64) -> Option<&'a T> {
        if pos >= self.len {
            return None;
        }
        let b = self.page_entries as u64;
        let id = *self.table.get(usize::try_from(pos / b).ok()?)?;
        let page: &'a [T] = self.pool.entries(id, self.page_entries);
        page.get((pos % b) as usize)
    }

    /// Page `k`, trimmed to the entries that exist.
    pub fn page(&self, k: usize) -> Option<&'a [T]> {
        let id = *self.table.get(k)?;
        let start = (k * self.page_entries) as u64;
        let n = (self.len.saturating_sub(start)).min(self.page_entries as u64) as usize;
        Some(self.pool.entries(id, n))
    }

    /// The entries page by page, in position order.
    pub fn pages(&self) -> impl Iterator<Item = &'a [T]> + 'a {
        let this = *self;
        (0..self.table.len()).filter_map(move |k| this.page(k))
    }

    /// Every entry in position order.
    pub fn iter(&self) -> impl Iterator<Item = &'a T> + 'a {
        self.pages().flatten()
    }
}

/// The window ring of one sequence at one layer: FP8 rows for the positions
/// [`WindowView::range`], at most `window_tokens` of them, ending at the sequence's last token.
/// The window of query `t` is `[max(0, t - 127), t]` (spec §4); after a prefix hit or a
/// truncation the range can be shorter than that until the caller rebuilds it
/// ([`super::KvCache::write_window`]).
#[derive(Clone, Copy, Debug)]
pub struct WindowView<'a> {
    ring: &'a [WindowFp8Entry],
    range: (u64, u64),
}

impl<'a> WindowView<'a> {
    pub(crate) fn new(ring: &'a [WindowFp8Entry], start: u64, end: u64) -> Self {
        WindowView {
            ring,
            range: (start, end),
        }
    }

    /// Positions with a valid row.
    pub fn range(&self) -> Range<u64> {
        self.range.0..self.range.1
    }

    /// Number of valid rows.
    pub fn len(&self) -> u64 {
        self.range.1 - self.range.0
    }

    /// Whether no row is valid.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row of position `pos`, `None` outside [`WindowView::range`].
    pub fn get(&self, pos: u64) -> Option<&'a WindowFp8Entry> {
        if !self.range().contains(&pos) || self.ring.is_empty() {
            return None;
        }
        self.ring.get((pos % self.ring.len() as u64) as usize)
    }

    /// `(position, row)` for every valid position, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &'a WindowFp8Entry)> + 'a {
        let this = *self;
        self.range()
            .filter_map(move |p| this.get(p).map(|e| (p, e)))
    }
}
