//! The operating-system calls behind pinned and growable memory, in one place.
//!
//! [`Os`] is the seam: [`LinuxOs`] makes the real system calls, and the tests' `FakeOs` stands
//! in for the kernel (it fails huge pages, `mlock` or page population on demand, as a kernel
//! without reserved huge pages or with a low memlock limit would, and records every call), so
//! the policies above it ([`crate::pinned`], [`crate::reserve`]) are unit-tested without special
//! hardware or privileges.

use std::ffi::c_int;
use std::io;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

use nix::errno::Errno;
use nix::sys::mman::{self, MapFlags, MmapAdvise, ProtFlags};
use nix::unistd::{SysconfVar, sysconf};

/// The system calls a region needs. Every range passed in lies inside one mapping that the
/// caller created with [`Os::map`] or [`Os::reserve`] and still owns.
pub(crate) trait Os: Send + Sync {
    /// The operating-system page size: the granularity of mapping, protection and locking.
    fn page_size(&self) -> usize;
    /// The default explicit huge page size, when the kernel has huge pages.
    fn huge_page_size(&self) -> Option<usize>;
    /// Maps `len` bytes of zeroed, readable and writable anonymous memory, from the reserved
    /// huge page pool (`MAP_HUGETLB`) when `huge_tlb` is set.
    fn map(&self, len: usize, huge_tlb: bool) -> io::Result<NonNull<u8>>;
    /// Reserves `len` bytes of inaccessible address space (no memory, no commit charge).
    fn reserve(&self, len: usize) -> io::Result<NonNull<u8>>;
    /// Makes a range readable and writable (or inaccessible again).
    fn protect(&self, ptr: NonNull<u8>, len: usize, writable: bool) -> io::Result<()>;
    /// Faults a writable range in.
    fn populate(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Locks a range in memory.
    fn lock(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Unlocks a range.
    fn unlock(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Drops the contents of a range (it reads as zero when faulted in again).
    fn discard(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Asks for transparent huge pages on a range.
    fn advise_huge(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Collapses a huge-page-aligned block into one transparent huge page.
    fn collapse(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Unmaps a whole mapping (which also unlocks it). Failures are logged: the owner is
    /// being dropped and cannot act on them.
    fn unmap(&self, ptr: NonNull<u8>, len: usize);
}

/// `MADV_COLLAPSE` (Linux 6.1, `include/uapi/asm-generic/mman-common.h`): nix's `MmapAdvise`
/// lacks it, and `libc` defines it for glibc targets only.
const MADV_COLLAPSE: c_int = 25;

/// `len` as the non-zero length mmap needs; a zero length is refused as the kernel would.
fn map_len(len: usize) -> io::Result<NonZeroUsize> {
    NonZeroUsize::new(len).ok_or_else(|| Errno::EINVAL.into())
}

/// The real system calls.
pub(crate) struct LinuxOs;

/// The one real [`Os`], for regions made outside tests.
pub(crate) static LINUX: LinuxOs = LinuxOs;

impl Os for LinuxOs {
    fn page_size(&self) -> usize {
        sysconf(SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .and_then(|v| usize::try_from(v).ok())
            .filter(|&p| p > 0)
            .unwrap_or(4096)
    }

    fn huge_page_size(&self) -> Option<usize> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let m = crate::probe::parse_meminfo(&text);
        (m.huge_page_bytes > 0)
            .then(|| usize::try_from(m.huge_page_bytes).ok())
            .flatten()
    }

    fn map(&self, len: usize, huge_tlb: bool) -> io::Result<NonNull<u8>> {
        let mut flags = MapFlags::MAP_PRIVATE;
        if huge_tlb {
            flags |= MapFlags::MAP_HUGETLB;
        }
        // SAFETY: an anonymous private mapping at an address the kernel chooses; it aliases no
        // existing Rust object.
        let p = unsafe {
            mman::mmap_anonymous(
                None,
                map_len(len)?,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                flags,
            )
        }?;
        Ok(p.cast())
    }

    fn reserve(&self, len: usize) -> io::Result<NonNull<u8>> {
        let flags = MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE;
        // SAFETY: an anonymous, inaccessible mapping at an address the kernel chooses; it
        // aliases no Rust object.
        let p = unsafe { mman::mmap_anonymous(None, map_len(len)?, ProtFlags::PROT_NONE, flags) }?;
        Ok(p.cast())
    }

    fn protect(&self, ptr: NonNull<u8>, len: usize, writable: bool) -> io::Result<()> {
        let prot = if writable {
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE
        } else {
            ProtFlags::PROT_NONE
        };
        // SAFETY: the range lies inside a reservation this process owns (checked by the
        // caller); no Rust reference to bytes that become inaccessible is alive (the region
        // only lends references to its committed prefix through &self / &mut self).
        Ok(unsafe { mman::mprotect(ptr.cast(), len, prot) }?)
    }

    fn populate(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: the range is writable memory of our own mapping; MADV_POPULATE_WRITE only
        // faults pages in (fresh anonymous pages are zero), it does not change contents.
        match unsafe { mman::madvise(ptr.cast(), len, MmapAdvise::MADV_POPULATE_WRITE) } {
            Ok(()) => Ok(()),
            Err(Errno::EINVAL) => {
                // Kernels before 5.14: fault each page in by writing a zero to it (the page is
                // fresh, so it already reads as zero and the write changes nothing).
                let page = self.page_size();
                for off in (0..len).step_by(page) {
                    // SAFETY: off < len lies in the writable, exclusively owned range; no
                    // reference to it exists while the owner holds &mut self.
                    unsafe { ptr.as_ptr().add(off).write_volatile(0) };
                }
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn lock(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: the range is mapped memory of our own; mlock faults it in and pins it without
        // changing its contents.
        Ok(unsafe { mman::mlock(ptr.cast(), len) }?)
    }

    fn unlock(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: as in lock; munlock only unpins.
        Ok(unsafe { mman::munlock(ptr.cast(), len) }?)
    }

    fn discard(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: the range is part of our private anonymous mapping and no Rust reference to it
        // is alive (the caller holds &mut self); MADV_DONTNEED frees the pages, which read as
        // zero when faulted in again.
        Ok(unsafe { mman::madvise(ptr.cast(), len, MmapAdvise::MADV_DONTNEED) }?)
    }

    fn advise_huge(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: the range is our own mapping; MADV_HUGEPAGE only changes paging policy.
        Ok(unsafe { mman::madvise(ptr.cast(), len, MmapAdvise::MADV_HUGEPAGE) }?)
    }

    fn collapse(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
        // Raw libc: nix has no MADV_COLLAPSE (see the constant).
        // SAFETY: the range is committed memory of our own mapping; MADV_COLLAPSE copies its
        // pages into a huge page in place, preserving contents.
        let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_COLLAPSE) };
        Ok(Errno::result(rc).map(drop)?)
    }

    fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: `ptr..ptr+len` is exactly one mapping created by `map` or `reserve` with this
        // length, and its owner is being dropped, so nothing refers to it any more.
        if let Err(e) = unsafe { mman::munmap(ptr.cast(), len) } {
            log::error!("munmap of {len} bytes failed: {}", io::Error::from(e));
        }
    }
}

/// `len` rounded up to a multiple of `to` (a non-zero size), or `None` on overflow.
pub(crate) fn round_up(len: usize, to: usize) -> Option<usize> {
    len.checked_add(to - 1).map(|v| v / to * to)
}

#[cfg(test)]
pub(crate) use fake::FakeOs;

#[cfg(test)]
mod fake {
    use super::{LINUX, Os};
    use std::io;
    use std::ptr::NonNull;
    use std::sync::Mutex;

    /// A fake kernel on top of the real one: memory is real (so regions can be written and
    /// read back, and discarded ranges read as zero), but huge pages, `mlock` and page
    /// population fail on demand and every call is recorded.
    ///
    /// `MAP_HUGETLB` "succeeds" with normal pages (enough to check sizing), `mlock`,
    /// `munlock` and `MADV_HUGEPAGE` succeed without touching the real kernel (no memlock
    /// limit, no THP policy needed), and `MADV_COLLAPSE` checks that its block is aligned.
    #[derive(Default)]
    pub(crate) struct FakeOs {
        /// The huge page size the fake kernel reports.
        pub huge: Option<usize>,
        /// `MAP_HUGETLB` fails with `ENOMEM` (no reserved huge pages).
        pub huge_tlb_fails: bool,
        /// `mlock` fails with `ENOMEM` (the memlock limit is too low).
        pub lock_fails: bool,
        /// Faulting pages in fails with `ENOMEM`.
        pub populate_fails: bool,
        /// Every call so far (see [`FakeOs::calls`]).
        pub calls: Mutex<Vec<String>>,
    }

    impl FakeOs {
        /// A fake that lives as long as the regions built on it.
        pub(crate) fn leak(self) -> &'static FakeOs {
            Box::leak(Box::new(self))
        }

        fn log(&self, s: String) {
            self.calls.lock().unwrap().push(s);
        }

        /// Every call so far, in order, as `"name arguments"`.
        pub(crate) fn calls(&self) -> Vec<String> {
            self.calls.lock().unwrap().clone()
        }

        /// Lengths of the mappings unmapped so far, in order.
        pub(crate) fn unmapped(&self) -> Vec<usize> {
            self.calls()
                .iter()
                .filter_map(|c| c.strip_prefix("unmap ")?.parse().ok())
                .collect()
        }
    }

    fn enomem() -> io::Error {
        nix::errno::Errno::ENOMEM.into()
    }

    impl Os for FakeOs {
        fn page_size(&self) -> usize {
            LINUX.page_size()
        }
        fn huge_page_size(&self) -> Option<usize> {
            self.huge
        }
        fn map(&self, len: usize, huge_tlb: bool) -> io::Result<NonNull<u8>> {
            self.log(format!("map {len} {huge_tlb}"));
            if huge_tlb && self.huge_tlb_fails {
                return Err(enomem());
            }
            LINUX.map(len, false)
        }
        fn reserve(&self, len: usize) -> io::Result<NonNull<u8>> {
            self.log(format!("reserve {len}"));
            LINUX.reserve(len)
        }
        fn protect(&self, ptr: NonNull<u8>, len: usize, writable: bool) -> io::Result<()> {
            self.log(format!("protect {len} {writable}"));
            LINUX.protect(ptr, len, writable)
        }
        fn populate(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
            self.log(format!("populate {len}"));
            if self.populate_fails {
                return Err(enomem());
            }
            LINUX.populate(ptr, len)
        }
        fn lock(&self, _: NonNull<u8>, len: usize) -> io::Result<()> {
            self.log(format!("lock {len}"));
            if self.lock_fails {
                Err(enomem())
            } else {
                Ok(())
            }
        }
        fn unlock(&self, _: NonNull<u8>, len: usize) -> io::Result<()> {
            self.log(format!("unlock {len}"));
            Ok(())
        }
        fn discard(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
            self.log(format!("discard {len}"));
            LINUX.discard(ptr, len)
        }
        fn advise_huge(&self, _: NonNull<u8>, len: usize) -> io::Result<()> {
            self.log(format!("advise_huge {len}"));
            Ok(())
        }
        fn collapse(&self, ptr: NonNull<u8>, len: usize) -> io::Result<()> {
            assert_eq!(
                ptr.as_ptr() as usize % len,
                0,
                "collapse of an unaligned block"
            );
            self.log(format!("collapse {len}"));
            Ok(())
        }
        fn unmap(&self, ptr: NonNull<u8>, len: usize) {
            self.log(format!("unmap {len}"));
            LINUX.unmap(ptr, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_size_is_a_power_of_two() {
        let p = LINUX.page_size();
        assert!(p >= 4096 && p.is_power_of_two(), "{p}");
    }

    #[test]
    fn rounding_is_to_whole_units_and_overflow_is_none() {
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(usize::MAX, 4096), None);
    }

    #[test]
    fn reserved_memory_commits_discards_to_zero_and_unmaps() {
        let os = FakeOs::default().leak();
        let page = os.page_size();
        let p = os.reserve(4 * page).unwrap();
        os.protect(p, 2 * page, true).unwrap();
        os.populate(p, 2 * page).unwrap();
        // SAFETY: the first two pages are writable and nothing else refers to them.
        unsafe { p.as_ptr().add(page + 1).write_volatile(7) };
        os.discard(p, 2 * page).unwrap();
        // SAFETY: as above; a discarded private anonymous page reads as zero again.
        assert_eq!(unsafe { p.as_ptr().add(page + 1).read_volatile() }, 0);
        os.unmap(p, 4 * page);
        assert_eq!(os.unmapped(), [4 * page]);
    }
}
