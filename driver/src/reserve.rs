//! Growable host memory for cache pools: a large address-space reservation committed on
//! demand.
//!
//! A page pool must grow with the sequences it serves without over-allocating: the bytes a pool
//! reports as allocated are the bytes the process really holds. A [`GrowableRegion`] reserves
//! its whole capacity as inaccessible address space (`PROT_NONE` + `MAP_NORESERVE`: no memory,
//! no commit charge, even under strict overcommit) and commits a prefix of it, in whole
//! operating-system pages, as the owner asks for more. Committing makes the range writable,
//! faults it in (`mlock` when the locked-memory limit allows, else `MADV_POPULATE_WRITE`), so
//! the committed bytes are resident and the resident bytes never exceed the committed ones.
//! The address of the region never changes, so offsets and page ids stay valid while it grows.
//!
//! Properties shared with [`crate::PinnedRegion`]:
//! - zero-initialised: every newly committed byte reads as zero (also after
//!   [`GrowableRegion::decommit_to`] and a later commit);
//! - locked best-effort: `mlock` per committed range; on the first failure the region stays
//!   unpinned from then on and the crate's single warning says why and how to raise the limit
//!   ([`Locking::Required`] makes it an error instead);
//! - huge pages when available ([`HugePages::Auto`]): the reservation is aligned to the huge
//!   page size and advised `MADV_HUGEPAGE`. A fault only gets a transparent huge page when the
//!   whole aligned 2 MiB block lies inside the committed (writable) part, so huge pages never
//!   make the resident size exceed the committed size; a block that became complete over
//!   several small commits is collapsed with `MADV_COLLAPSE` (best-effort, Linux 6.1+).
//!   Explicit `MAP_HUGETLB` pages cannot be committed piecewise and are not used here.
//! - released on drop (`munmap`, which also unlocks).
//!
//! # DMA contract
//!
//! A `GrowableRegion` is CPU-private, like a plain [`crate::PinnedRegion`]: it hands out
//! `&[u8]` / `&mut [u8]` views of the committed prefix and nothing else. It must not be
//! registered with a device: memory a device may write is reached only through a
//! [`crate::VolatileView`] of a [`crate::DeviceSharedRegion`] (see [`crate::pinned`]).

use std::ptr::NonNull;

use nix::errno::Errno;

use crate::Error;
use crate::os::{self, Os, round_up};
use crate::pinned::{HugePages, Locking, PinnedOptions};

/// A reserved address range whose prefix is committed on demand. See the module docs.
pub struct GrowableRegion {
    /// Start of the whole mapping (for munmap).
    map_ptr: NonNull<u8>,
    /// Length of the whole mapping.
    map_len: usize,
    /// Start of the usable range (aligned to the huge page size when huge pages are used).
    base: NonNull<u8>,
    /// Usable bytes (a multiple of the page size).
    capacity: usize,
    /// Committed prefix (a multiple of the page size).
    committed: usize,
    page: usize,
    /// Huge page size when the region tries transparent huge pages.
    huge: Option<usize>,
    /// Prefix whose complete huge blocks have been collapsed (a multiple of `huge`).
    huge_checked: usize,
    /// Bytes in blocks that `MADV_COLLAPSE` reported as huge.
    huge_bytes: usize,
    locking: Locking,
    /// Committed bytes that are locked (always a prefix of the committed range).
    locked: usize,
    /// Set after the first failed mlock: the rest of the region stays unpinned.
    lock_failed: bool,
    os: &'static dyn Os,
}

// SAFETY: a GrowableRegion uniquely owns its mapping (like a Vec<u8> owns its buffer); the raw
// pointers are only dereferenced through &self / &mut self methods, so moving it to another
// thread or sharing & across threads gives the same guarantees as Vec<u8>.
unsafe impl Send for GrowableRegion {}
// SAFETY: see Send: &GrowableRegion only allows reads of CPU-private memory.
unsafe impl Sync for GrowableRegion {}

impl GrowableRegion {
    /// Reserves `capacity` bytes (rounded up to whole pages) of address space; nothing is
    /// committed yet. `opts` chooses the huge page and locking policy of later commits.
    pub fn new(capacity: usize, opts: PinnedOptions) -> Result<GrowableRegion, Error> {
        Self::new_with(&os::LINUX, capacity, opts)
    }

    pub(crate) fn new_with(
        os: &'static dyn Os,
        capacity: usize,
        opts: PinnedOptions,
    ) -> Result<GrowableRegion, Error> {
        if capacity == 0 {
            return Err(Error::ZeroSizedRegion);
        }
        let page = os.page_size();
        let too_big = || Error::RegionTooLarge { bytes: capacity };
        let capacity = round_up(capacity, page).ok_or_else(too_big)?;
        let huge = match opts.huge_pages {
            HugePages::Auto => os.huge_page_size().filter(|&h| h > page && capacity >= h),
            HugePages::Never => None,
        };
        // Reserve one extra huge page so the usable range can start on a huge boundary; the
        // slack is address space only.
        let align = huge.unwrap_or(page);
        let map_len = capacity.checked_add(align - page).ok_or_else(too_big)?;
        let map_ptr = os.reserve(map_len).map_err(|source| Error::Map {
            bytes: map_len,
            source,
        })?;
        let addr = map_ptr.as_ptr() as usize;
        let skip = round_up(addr, align).map_or(0, |a| a - addr);
        // SAFETY: skip < align <= map_len - capacity + page, so base + capacity stays inside the
        // mapping just created.
        let base = unsafe { NonNull::new_unchecked(map_ptr.as_ptr().add(skip)) };
        if huge.is_some()
            && let Err(e) = os.advise_huge(base, capacity)
        {
            log::debug!("MADV_HUGEPAGE on a {capacity}-byte reservation failed ({e})");
        }
        log::debug!(
            "growable region: {capacity} bytes reserved, huge pages: {}, locking: {:?}",
            huge.map_or_else(|| "no".to_owned(), |h| format!("{h}-byte blocks")),
            opts.locking
        );
        Ok(GrowableRegion {
            map_ptr,
            map_len,
            base,
            capacity,
            committed: 0,
            page,
            huge,
            huge_checked: 0,
            huge_bytes: 0,
            locking: opts.locking,
            locked: 0,
            lock_failed: false,
            os,
        })
    }

    /// Bytes reserved (the most the region can commit).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes committed: resident memory the region holds. Always a multiple of
    /// [`GrowableRegion::page_size`].
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// The commit granularity (the operating-system page size).
    pub fn page_size(&self) -> usize {
        self.page
    }

    /// Committed bytes that are locked in memory.
    pub fn locked_bytes(&self) -> usize {
        self.locked
    }

    /// Committed bytes that the kernel reported as collapsed into transparent huge pages.
    pub fn huge_page_bytes(&self) -> usize {
        self.huge_bytes
    }

    /// Grows the committed prefix to at least `len` bytes (rounded up to whole pages). Does
    /// nothing when `len` is already committed. On error nothing changes.
    ///
    /// # Errors
    /// [`Error::CapacityExceeded`] past the reservation, [`Error::Commit`] when the kernel
    /// refuses the memory, [`Error::Lock`] when locking is [`Locking::Required`] and fails.
    pub fn commit(&mut self, len: usize) -> Result<(), Error> {
        if len <= self.committed {
            return Ok(());
        }
        let exceeded = || Error::CapacityExceeded {
            requested: len,
            capacity: self.capacity,
        };
        let target = round_up(len, self.page).ok_or_else(exceeded)?;
        if target > self.capacity {
            return Err(exceeded());
        }
        let start = self.committed;
        let count = target - start;
        // SAFETY: start < target <= capacity, inside the reservation.
        let ptr = unsafe { NonNull::new_unchecked(self.base.as_ptr().add(start)) };
        let commit_err = |source| Error::Commit {
            offset: start,
            bytes: count,
            source,
        };
        self.os.protect(ptr, count, true).map_err(commit_err)?;
        let mut locked_now = false;
        if self.locking != Locking::Never && !self.lock_failed {
            match self.os.lock(ptr, count) {
                Ok(()) => locked_now = true,
                Err(source) if self.locking == Locking::Required => {
                    self.undo(ptr, count);
                    return Err(Error::Lock {
                        bytes: count,
                        source,
                    });
                }
                Err(e) => {
                    self.lock_failed = true;
                    crate::pinned::warn_unpinned(count, &e);
                }
            }
        }
        if !locked_now && let Err(source) = self.os.populate(ptr, count) {
            self.undo(ptr, count);
            return Err(commit_err(source));
        }
        if locked_now && self.locked == start {
            self.locked = target;
        }
        self.committed = target;
        self.collapse_complete_blocks();
        Ok(())
    }

    /// Returns a freshly committed range to the reservation after a failure.
    fn undo(&self, ptr: NonNull<u8>, count: usize) {
        if let Err(e) = self
            .os
            .discard(ptr, count)
            .and_then(|()| self.os.protect(ptr, count, false))
        {
            log::warn!("cannot return {count} bytes to the reservation after a failed commit: {e}");
        }
    }

    fn collapse_complete_blocks(&mut self) {
        let Some(h) = self.huge else { return };
        while self.huge_checked + h <= self.committed {
            // SAFETY: huge_checked + h <= committed <= capacity: inside the reservation.
            let ptr = unsafe { NonNull::new_unchecked(self.base.as_ptr().add(self.huge_checked)) };
            match self.os.collapse(ptr, h) {
                Ok(()) => self.huge_bytes += h,
                Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => {
                    log::debug!("MADV_COLLAPSE unsupported ({e}); huge pages only on fault");
                    self.huge = None;
                    return;
                }
                Err(e) => log::debug!("MADV_COLLAPSE of a {h}-byte block failed ({e})"),
            }
            self.huge_checked += h;
        }
    }

    /// Shrinks the committed prefix to `len` bytes (rounded up to whole pages), returning the
    /// rest to the reservation: its memory is freed and reads as zero when committed again.
    /// Does nothing when `len` is at least the committed size.
    ///
    /// # Errors
    /// [`Error::Commit`] if the kernel refuses to drop or protect the range; the region then
    /// keeps its committed size.
    pub fn decommit_to(&mut self, len: usize) -> Result<(), Error> {
        let Some(target) = round_up(len, self.page) else {
            return Ok(());
        };
        if target >= self.committed {
            return Ok(());
        }
        let count = self.committed - target;
        // SAFETY: target < committed <= capacity.
        let ptr = unsafe { NonNull::new_unchecked(self.base.as_ptr().add(target)) };
        let err = |source| Error::Commit {
            offset: target,
            bytes: count,
            source,
        };
        if self.locked > target {
            if let Err(e) = self.os.unlock(ptr, self.locked - target) {
                log::debug!("munlock of {} bytes failed ({e})", self.locked - target);
            }
            self.locked = target;
        }
        self.os.discard(ptr, count).map_err(err)?;
        self.os.protect(ptr, count, false).map_err(err)?;
        self.committed = target;
        if let Some(h) = self.huge {
            let kept = target / h * h;
            if self.huge_checked > kept {
                self.huge_bytes = self.huge_bytes.saturating_sub(self.huge_checked - kept);
                self.huge_checked = kept;
            }
        }
        Ok(())
    }

    /// The committed bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: base..base+committed is readable, initialised (zero-filled or written) memory
        // owned by self; only the CPU accesses it, and &self forbids writers.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.committed) }
    }

    /// The committed bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.committed) }
    }
}

impl Drop for GrowableRegion {
    fn drop(&mut self) {
        self.os.unmap(self.map_ptr, self.map_len);
    }
}

impl std::fmt::Debug for GrowableRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrowableRegion")
            .field("capacity", &self.capacity)
            .field("committed", &self.committed)
            .field("locked", &self.locked)
            .field("huge_page_bytes", &self.huge_bytes)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::FakeOs;

    const NO_LOCK: PinnedOptions = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };

    #[test]
    fn commits_grow_in_pages_and_new_bytes_are_zero() {
        let mut r = GrowableRegion::new(1 << 20, NO_LOCK).unwrap();
        assert_eq!(r.committed(), 0);
        assert!(r.as_slice().is_empty());
        r.commit(100).unwrap();
        assert_eq!(r.committed(), r.page_size());
        r.as_mut_slice()[99] = 7;
        let base = r.as_slice().as_ptr();
        r.commit(3 * r.page_size() + 1).unwrap();
        assert_eq!(r.committed(), 4 * r.page_size());
        // The address never moves and earlier contents stay.
        assert_eq!(r.as_slice().as_ptr(), base);
        assert_eq!(r.as_slice()[99], 7);
        assert!(r.as_slice()[100..].iter().all(|&b| b == 0));
        // Shrinking frees the tail; committing again yields zeros.
        r.as_mut_slice()[4 * 4096 - 1] = 9;
        r.decommit_to(1).unwrap();
        assert_eq!(r.committed(), r.page_size());
        r.commit(4 * r.page_size()).unwrap();
        assert!(r.as_slice()[r.page_size()..].iter().all(|&b| b == 0));
        assert_eq!(r.as_slice()[99], 7);
    }

    #[test]
    fn capacity_is_enforced() {
        let mut r = GrowableRegion::new(10_000, NO_LOCK).unwrap();
        assert_eq!(r.capacity() % r.page_size(), 0);
        let cap = r.capacity();
        assert!(matches!(
            r.commit(cap + 1),
            Err(Error::CapacityExceeded { requested, capacity }) if requested == cap + 1 && capacity == cap
        ));
        r.commit(cap).unwrap();
        assert!(matches!(
            GrowableRegion::new(0, NO_LOCK),
            Err(Error::ZeroSizedRegion)
        ));
    }

    #[test]
    fn lock_failure_falls_back_once_and_required_rolls_back() {
        let os = FakeOs {
            lock_fails: true,
            ..Default::default()
        }
        .leak();
        let mut r = GrowableRegion::new_with(os, 1 << 20, PinnedOptions::default()).unwrap();
        r.commit(4096).unwrap();
        r.commit(8192).unwrap();
        assert_eq!(r.locked_bytes(), 0);
        // mlock is tried once; afterwards pages are populated without it.
        let calls = os.calls();
        assert_eq!(
            calls.iter().filter(|c| c.starts_with("lock")).count(),
            1,
            "{calls:?}"
        );
        assert_eq!(
            calls.iter().filter(|c| c.starts_with("populate")).count(),
            2,
            "{calls:?}"
        );

        let required = PinnedOptions {
            huge_pages: HugePages::Never,
            locking: Locking::Required,
        };
        let mut r = GrowableRegion::new_with(os, 1 << 20, required).unwrap();
        assert!(matches!(r.commit(4096), Err(Error::Lock { .. })));
        assert_eq!(r.committed(), 0);
    }

    #[test]
    fn populate_failure_leaves_the_region_unchanged() {
        let os = FakeOs {
            populate_fails: true,
            ..Default::default()
        }
        .leak();
        let mut r = GrowableRegion::new_with(os, 1 << 20, NO_LOCK).unwrap();
        assert!(matches!(
            r.commit(4096),
            Err(Error::Commit { offset: 0, .. })
        ));
        assert_eq!(r.committed(), 0);
        assert!(os.calls().iter().any(|c| c == "protect 4096 false"));
    }

    #[test]
    fn locked_commits_are_counted_and_complete_huge_blocks_collapsed() {
        let huge = 2 << 20;
        let os = FakeOs {
            huge: Some(huge),
            ..Default::default()
        }
        .leak();
        let mut r = GrowableRegion::new_with(os, 8 << 20, PinnedOptions::default()).unwrap();
        // The usable range starts on a huge boundary.
        r.commit(1).unwrap();
        assert_eq!(r.as_slice().as_ptr() as usize % huge, 0);
        r.commit(huge - 4096).unwrap();
        assert_eq!(r.huge_page_bytes(), 0);
        r.commit(huge + 1).unwrap();
        assert_eq!(r.huge_page_bytes(), huge);
        assert_eq!(r.locked_bytes(), r.committed());
        r.commit(3 * huge).unwrap();
        assert_eq!(r.huge_page_bytes(), 3 * huge);
        r.decommit_to(huge).unwrap();
        assert_eq!(r.huge_page_bytes(), huge);
        assert_eq!(r.locked_bytes(), huge);
        let calls = os.calls();
        assert_eq!(
            calls.iter().filter(|c| c.starts_with("collapse")).count(),
            3,
            "{calls:?}"
        );
        assert!(calls.iter().any(|c| c.starts_with("advise_huge")));
        drop(r);
        assert!(os.calls().last().unwrap().starts_with("unmap"));
    }
}
