//! A pool of fixed-size pages in one growable host region, with reference counts.
//!
//! Pages are numbered from 0 in address order. The pool commits memory for page `k` only when
//! page `k` is first needed (a watermark), so the bytes it reports as allocated are the bytes it
//! really holds: `round_up(watermark * page_bytes, os_page)`. Freed pages go to a free set and
//! are reused lowest-first, which keeps the pages in use packed at the bottom so that
//! [`PagePool::trim`] can return the free top of the pool to the operating system.

use std::collections::BTreeSet;

use kvstack_driver::{GrowableRegion, PinnedOptions};
use zerocopy::{FromBytes, Immutable, KnownLayout};

use super::PoolName;
use crate::{Error, Result};

/// A page id within one pool.
pub type PageId = u32;

pub(crate) struct PagePool {
    name: PoolName,
    entry_bytes: usize,
    page_entries: usize,
    page_bytes: usize,
    capacity: u32,
    region: GrowableRegion,
    /// Reference count of every page below the watermark (0 = free).
    refs: Vec<u32>,
    /// Free pages below the watermark.
    free: BTreeSet<PageId>,
    in_use: u32,
}

impl PagePool {
    /// A pool of at most `capacity` pages of `page_bytes` bytes, each a whole number of
    /// `entry_bytes`-byte entries. Reserves address space only.
    pub(crate) fn new(
        name: PoolName,
        entry_bytes: usize,
        page_bytes: usize,
        page_tokens: u64,
        capacity: u64,
        memory: PinnedOptions,
    ) -> Result<PagePool> {
        if entry_bytes == 0 || page_bytes == 0 || !page_bytes.is_multiple_of(entry_bytes) {
            return Err(Error::PageSize {
                pool: name,
                page_tokens,
                page_bytes: page_bytes as u64,
                entry_bytes: entry_bytes as u64,
            });
        }
        let capacity = u32::try_from(capacity.max(1)).map_err(|_| Error::InvalidOption {
            field: "max_sequences",
            reason: format!("{name} would need {capacity} pages, more than a page id can count"),
        })?;
        let reserve =
            (capacity as usize)
                .checked_mul(page_bytes)
                .ok_or_else(|| Error::InvalidOption {
                    field: "max_sequences",
                    reason: format!("{name}: {capacity} pages of {page_bytes} bytes overflow"),
                })?;
        let region = GrowableRegion::new(reserve, memory)
            .map_err(|source| Error::Memory { pool: name, source })?;
        Ok(PagePool {
            name,
            entry_bytes,
            page_entries: page_bytes / entry_bytes,
            page_bytes,
            capacity,
            region,
            refs: Vec::new(),
            free: BTreeSet::new(),
            in_use: 0,
        })
    }

    pub(crate) fn name(&self) -> PoolName {
        self.name
    }

    pub(crate) fn entry_bytes(&self) -> usize {
        self.entry_bytes
    }

    pub(crate) fn page_entries(&self) -> usize {
        self.page_entries
    }

    pub(crate) fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Pages below the watermark (committed).
    pub(crate) fn watermark(&self) -> u32 {
        self.refs.len() as u32
    }

    pub(crate) fn in_use(&self) -> u32 {
        self.in_use
    }

    pub(crate) fn free_count(&self) -> u32 {
        self.capacity - self.in_use
    }

    pub(crate) fn allocated_bytes(&self) -> u64 {
        self.region.committed() as u64
    }

    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.region.capacity() as u64
    }

    pub(crate) fn locked_bytes(&self) -> u64 {
        self.region.locked_bytes() as u64
    }

    pub(crate) fn huge_page_bytes(&self) -> u64 {
        self.region.huge_page_bytes() as u64
    }

    /// Heap bytes of the pool's own bookkeeping (estimate for the B-tree: 8 bytes per page).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        (self.refs.capacity() * size_of::<u32>() + self.free.len() * 8 + size_of::<Self>()) as u64
    }

    /// A page with reference count 1: the lowest free page, else a newly committed one.
    /// `Ok(None)` when the pool is at capacity.
    pub(crate) fn alloc(&mut self) -> Result<Option<PageId>> {
        if let Some(id) = self.free.pop_first() {
            if let Some(r) = self.refs.get_mut(id as usize) {
                *r = 1;
                self.in_use += 1;
                return Ok(Some(id));
            }
            return Err(Error::Internal {
                what: "free page above the watermark",
            });
        }
        let next = self.refs.len();
        if next >= self.capacity as usize {
            return Ok(None);
        }
        let end = (next + 1) * self.page_bytes;
        self.region.commit(end).map_err(|source| Error::Memory {
            pool: self.name,
            source,
        })?;
        self.refs.push(1);
        self.in_use += 1;
        Ok(Some(next as PageId))
    }

    pub(crate) fn refcount(&self, id: PageId) -> u32 {
        self.refs.get(id as usize).copied().unwrap_or(0)
    }

    /// Adds a reference to a page in use.
    pub(crate) fn retain(&mut self, id: PageId) {
        match self.refs.get_mut(id as usize) {
            Some(r) if *r > 0 => *r += 1,
            _ => debug_assert!(false, "retain of a free page {id} in {}", self.name),
        }
    }

    /// Drops a reference; the page returns to the free set at zero.
    pub(crate) fn release(&mut self, id: PageId) {
        match self.refs.get_mut(id as usize) {
            Some(r) if *r > 0 => {
                *r -= 1;
                if *r == 0 {
                    self.free.insert(id);
                    self.in_use -= 1;
                }
            }
            _ => debug_assert!(false, "release of a free page {id} in {}", self.name),
        }
    }

    fn range(&self, id: PageId) -> std::ops::Range<usize> {
        let start = id as usize * self.page_bytes;
        start..start + self.page_bytes
    }

    /// The bytes of a page (empty for an id above the watermark).
    pub(crate) fn page(&self, id: PageId) -> &[u8] {
        self.region.as_slice().get(self.range(id)).unwrap_or(&[])
    }

    /// The bytes of a page, mutably (empty for an id above the watermark).
    pub(crate) fn page_mut(&mut self, id: PageId) -> &mut [u8] {
        let r = self.range(id);
        self.region.as_mut_slice().get_mut(r).unwrap_or(&mut [])
    }

    /// The first `entries` entries of a page as typed entries.
    pub(crate) fn entries<T: FromBytes + Immutable + KnownLayout>(
        &self,
        id: PageId,
        entries: usize,
    ) -> &[T] {
        let bytes = self
            .page(id)
            .get(..entries * self.entry_bytes)
            .unwrap_or(&[]);
        <[T]>::ref_from_bytes(bytes).unwrap_or(&[])
    }

    /// Copies the first `bytes` bytes of page `src` to page `dst`.
    pub(crate) fn copy_prefix(&mut self, src: PageId, dst: PageId, bytes: usize) -> Result<()> {
        let bytes = bytes.min(self.page_bytes);
        let s = self.range(src);
        let d = self.range(dst).start;
        let region = self.region.as_mut_slice();
        if s.end > region.len() || d + bytes > region.len() {
            return Err(Error::Internal {
                what: "copy of a page above the watermark",
            });
        }
        region.copy_within(s.start..s.start + bytes, d);
        Ok(())
    }

    /// Returns the free pages at the top of the pool to the operating system. Returns the
    /// bytes released.
    pub(crate) fn trim(&mut self) -> Result<u64> {
        let before = self.region.committed();
        while let Some(&last) = self.free.last() {
            if last as usize + 1 != self.refs.len() {
                break;
            }
            self.free.pop_last();
            self.refs.pop();
        }
        self.region
            .decommit_to(self.refs.len() * self.page_bytes)
            .map_err(|source| Error::Memory {
                pool: self.name,
                source,
            })?;
        self.refs.shrink_to_fit();
        Ok((before - self.region.committed()) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolKind;
    use kvstack_driver::pinned::{HugePages, Locking};

    fn pool(cap: u64) -> PagePool {
        let name = PoolName {
            kind: PoolKind::Global,
            layer: Some(2),
        };
        let mem = PinnedOptions {
            huge_pages: HugePages::Never,
            locking: Locking::Never,
        };
        PagePool::new(name, 288, 288 * 16, 32, cap, mem).unwrap()
    }

    #[test]
    fn pages_are_counted_reused_lowest_first_and_trimmed() {
        let mut p = pool(4);
        let a = p.alloc().unwrap().unwrap();
        let b = p.alloc().unwrap().unwrap();
        assert_eq!((a, b), (0, 1));
        // Two pages of 4608 bytes, committed in whole 4 KiB OS pages.
        assert_eq!(p.allocated_bytes(), 12_288);
        p.retain(a);
        p.release(a);
        assert_eq!(p.refcount(a), 1);
        p.release(a);
        assert_eq!(p.in_use(), 1);
        assert_eq!(p.alloc().unwrap(), Some(0));
        p.alloc().unwrap();
        p.alloc().unwrap();
        assert_eq!(p.alloc().unwrap(), None);
        p.page_mut(1)[..3].copy_from_slice(&[1, 2, 3]);
        p.copy_prefix(1, 3, 2).unwrap();
        assert_eq!(&p.page(3)[..3], &[1, 2, 0]);
        for id in [2, 3] {
            p.release(id);
        }
        assert_eq!(p.trim().unwrap(), 8192);
        assert_eq!(p.watermark(), 2);
        assert_eq!(p.alloc().unwrap(), Some(2));
    }

    #[test]
    fn page_must_hold_whole_entries() {
        let name = PoolName {
            kind: PoolKind::Index,
            layer: Some(2),
        };
        let err = PagePool::new(name, 68, 2142, 63, 4, PinnedOptions::default())
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                Error::PageSize {
                    page_bytes: 2142,
                    entry_bytes: 68,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("index-key pool of layer 2"),
            "{err}"
        );
    }
}
