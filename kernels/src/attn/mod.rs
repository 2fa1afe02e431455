//! CPU decode kernels of CSA2 attention (spec §4): the indexer scan, top-k selection, the
//! hierarchical candidate pool and the sparse attention over window (FP8) and selected global
//! (FP4) entries, at the real V4.1-Flash dimensions (64 query heads x 512, indexer 32 x 128).
//!
//! Every fast kernel has a plain scalar reference in [`mod@reference`] that the tests compare it
//! with; the scoring and attention entry points have a `_with(level, ..)` form that forces a
//! [`SimdLevel`] (selection picks its level itself; its result does not depend on it).
//!
//! # Indexer ([`indexer_scores`], [`indexer_scores_at`])
//!
//! `I(s) = sum_h w[h] * relu(q[h] . k[s])` with the query heads and the keys in MXFP4 (spec
//! §5.3). Each `q[h] . k[s]` is the exact dot product rounded once to f32, bit for bit
//! [`crate::dot_mxfp4_mxfp4`]; `relu(x) = max(x, 0)`; the products `T_h = w[h] * relu(..)`
//! are rounded to f32 and summed in f32 in head order starting from the first head's term
//! (`s = T_0; s = s + T_h`, the order the public reference's recorded scores have). The fast
//! path therefore returns exactly the scores of [`reference::indexer_scores_ref`] (and of
//! `csa2::indexer::IndexQuery::score`), on every level and for every thread count.
//!
//! The AVX2 path multiplies `2 * e2m1` values as 8-bit integers (`vpmaddubsw`, 32 products
//! per instruction, exact; the 32 heads in the lanes, each key group broadcast) and applies the
//! power-of-two block scales in f32 where that is provably exact; a tile of keys whose scale
//! exponents fall outside that window (never for real activations) takes the f64 path of the
//! reference instead. See [`IndexQuery`].
//!
//! # Selection ([`topk`], [`topk_positions`], [`candidate_blocks`])
//!
//! Scores are ranked by `f32::total_cmp` (highest first, `-0` below `+0`); equal scores go to
//! the **lower** index or position; NaN and `-inf` are never selected. The result is the set
//! of the `k` best, written in ascending order and padded with `-1`; a selected `+inf` (only
//! from an overflow) is written as `-1`, as the reference does with non-finite picks. This is
//! the rule of `csa2::topk::topk` and `csa2::candidates::candidate_pool`, and the sets are
//! equal to theirs.
//!
//! # Sparse attention ([`sparse_attention_decode`])
//!
//! One decode token: 64 heads x 512 f32 queries attend over the window's FP8 entries and the
//! selected FP4 entries (`-1` slots skipped), `V = K`, logits `q . k * 512^-0.5`, a per-head
//! sink adding `exp(sink)` to the softmax denominator only. Each entry is dequantized once per
//! task into an f32 tile shared by the task's heads; register-blocked FMA micro-kernels compute
//! the logits (AVX2: 16 heads x 6 entries; AVX-512: 32 heads x 12 entries) and the `P . V`
//! update (6 heads x 16 channels; 12 heads x 32 channels), with an online (flash-style)
//! softmax between them. Threads split the heads first, in groups of 32,
//! each group computed exactly as one thread computes it (so up to one thread per group the
//! bits do not depend on the thread count); threads beyond that split a group's entries and
//! merge their partial softmax states at the end.

mod index;
pub mod reference;
mod select;
mod sparse;

use std::fmt;
use std::ops::Range;

pub use index::{
    IndexQuery, indexer_scores, indexer_scores_at, indexer_scores_at_with, indexer_scores_with,
};
pub use select::{candidate_blocks, topk, topk_positions};
pub use sparse::{SparseAttnInput, sparse_attention_decode, sparse_attention_decode_with};

use crate::SimdLevel;

/// Query heads of the core attention (spec §2).
pub const HEADS: usize = 64;
/// Width of a query head and of a KV entry.
pub const HEAD_DIM: usize = 512;
/// Indexer heads.
pub const INDEX_HEADS: usize = 32;
/// Width of an indexer head and key.
pub const INDEX_DIM: usize = 128;
/// Entries the indexer selects per query.
pub const TOPK: usize = 512;
/// Sliding-window length.
pub const WINDOW: usize = 128;
/// Blocks kept in the hierarchical candidate pool.
pub const POOL_BLOCKS: usize = 2048;
/// Compressed positions per candidate block.
pub const POOL_BLOCK: usize = 8;

/// The attention kernels' errors: the crate's one error type, under the name these kernels
/// have always used (attention uses [`crate::Error::LengthMismatch`],
/// [`crate::Error::PositionOutOfRange`], [`crate::Error::PageLayout`] and the level errors).
pub type AttnError = crate::Error;

/// Stored entries by position, either one contiguous slice or fixed-size pages (the paged KV
/// cache's block table: page `k` holds positions `[k * page_entries, (k + 1) * page_entries)`).
///
/// Scans walk the pages as contiguous runs; gathers find a position's page with a shift where
/// the page size is a power of two (the runtime's are), else one division. A paged cache
/// builds one from its block table: collect the page slices into a `Vec<&[E]>` and pass it
/// with the page size, `Paged::pages(&pages, page_entries)`.
pub struct Paged<'a, E> {
    repr: Repr<'a, E>,
    len: usize,
}

enum Repr<'a, E> {
    Contiguous(&'a [E]),
    Pages {
        pages: &'a [&'a [E]],
        page_entries: usize,
        /// `log2(page_entries)` when that is a power of two: a gathered scan finds a page per
        /// pool block, and a shift and mask cost far less than a 64-bit division.
        shift: Option<u32>,
    },
}

impl<E> Repr<'_, E> {
    /// Page index and offset of `pos` in a paged representation (`page_entries >= 1`).
    #[inline]
    fn locate(page_entries: usize, shift: Option<u32>, pos: usize) -> (usize, usize) {
        match shift {
            Some(s) => (pos >> s, pos & (page_entries - 1)),
            None => (pos / page_entries, pos % page_entries),
        }
    }
}

impl<E> Clone for Repr<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Repr<'_, E> {}
impl<E> Clone for Paged<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Paged<'_, E> {}

impl<E> fmt::Debug for Paged<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Paged");
        d.field("len", &self.len);
        if let Repr::Pages {
            pages,
            page_entries,
            ..
        } = self.repr
        {
            d.field("pages", &pages.len())
                .field("page_entries", &page_entries);
        }
        d.finish()
    }
}

impl<'a, E> Paged<'a, E> {
    /// One contiguous run of entries, position `i` at `entries[i]`.
    pub fn contiguous(entries: &'a [E]) -> Self {
        Paged {
            repr: Repr::Contiguous(entries),
            len: entries.len(),
        }
    }

    /// Fixed-size pages: every page but the last must hold exactly `page_entries` entries, the
    /// last at most that many.
    ///
    /// # Errors
    ///
    /// [`AttnError::PageLayout`] for a page of another size (or `page_entries == 0` with a
    /// non-empty page).
    pub fn pages(pages: &'a [&'a [E]], page_entries: usize) -> Result<Self, AttnError> {
        let last = pages.len().saturating_sub(1);
        let mut len = 0usize;
        for (k, p) in pages.iter().enumerate() {
            let ok = if k == last {
                p.len() <= page_entries
            } else {
                p.len() == page_entries
            };
            if !ok || (page_entries == 0 && !p.is_empty()) {
                return Err(AttnError::PageLayout {
                    page: k,
                    len: p.len(),
                    page_entries,
                });
            }
            len += p.len();
        }
        let page_entries = page_entries.max(1);
        Ok(Paged {
            repr: Repr::Pages {
                pages,
                page_entries,
                shift: page_entries
                    .is_power_of_two()
                    .then(|| page_entries.trailing_zeros()),
            },
            len,
        })
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slice that holds position `pos` (its page, or the one run) and the offset of `pos`
    /// in it; `None` past the last page.
    #[inline]
    fn slice_of(&self, pos: usize) -> Option<(&'a [E], usize)> {
        match self.repr {
            Repr::Contiguous(s) => Some((s, pos)),
            Repr::Pages {
                pages,
                page_entries,
                shift,
            } => {
                let (page, off) = Repr::<E>::locate(page_entries, shift, pos);
                Some((pages.get(page)?, off))
            }
        }
    }

    /// The entry at `pos`, `None` past the end.
    #[inline]
    pub fn get(&self, pos: usize) -> Option<&'a E> {
        let (s, off) = self.slice_of(pos)?;
        s.get(off)
    }

    /// The `N` entries from `pos` when they lie in one page (or the one run), else `None`.
    #[inline]
    pub(crate) fn array<const N: usize>(&self, pos: usize) -> Option<&'a [E; N]> {
        let (s, off) = self.slice_of(pos)?;
        s.get(off..off.checked_add(N)?)?.try_into().ok()
    }

    /// The entries of `range` (clamped to [`Paged::len`]) as contiguous runs, in position
    /// order, each with the position of its first entry.
    pub fn runs(&self, range: Range<usize>) -> impl Iterator<Item = (usize, &'a [E])> + 'a {
        let end = range.end.min(self.len);
        let mut pos = range.start.min(end);
        let this = *self;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let (s, off) = this.slice_of(pos)?;
            let n = s.len().saturating_sub(off).min(end - pos);
            let run = s.get(off..off + n)?;
            if run.is_empty() {
                return None;
            }
            let start = pos;
            pos += run.len();
            Some((start, run))
        })
    }
}

/// Checks a thread count: at least one, and one inside a task of [`crate::par::run_tasks`]
/// (the pool is already shared out; the results do not depend on it, see each kernel).
///
/// `threads` is how many chunks the work is cut into: the caller's thread runs the first and
/// rayon's global pool (one worker per CPU, started once) the others, so a decode step pays a
/// wake-up of a parked worker, not the start of an OS thread (70-400 us on the VMs measured).
fn thread_count(threads: usize) -> usize {
    if crate::par::in_task() {
        1
    } else {
        threads.max(1)
    }
}

/// `level` checked against the CPU, or the detected level.
fn verified(level: Option<SimdLevel>) -> Result<crate::level::Verified, AttnError> {
    match level {
        None => Ok(crate::level::Verified::detected()),
        Some(l) => Ok(crate::level::Verified::new(l)?),
    }
}

#[cfg(test)]
mod tests;
