//! Pinned host memory for cache pools.
//!
//! A [`PinnedRegion`] is a page-aligned anonymous mapping: zero-initialised by the kernel, backed
//! by huge pages when it can be, locked with `mlock` when the locked-memory limit allows (else
//! left unpinned, with one warning that says why and how to raise the limit), and unmapped on
//! drop.
//!
//! # DMA contract
//!
//! While a region is a plain [`PinnedRegion`] only the CPU touches it, so it hands out ordinary
//! `&[u8]` / `&mut [u8]` slices. Memory that a device (an NVMe controller, a GPU, the kernel's
//! io_uring workers) may write at any moment must never be seen through a Rust reference: the
//! compiler may assume referenced bytes do not change behind its back, so such a reference is
//! undefined behaviour. A region that is handed to devices therefore becomes a
//! [`DeviceSharedRegion`] ([`PinnedRegion::into_device_shared`]), which offers only a
//! [`VolatileView`] (volatile copies in and out) and the raw address range for registration.
//! Turning it back into a CPU-private region is `unsafe`: the caller must first make sure that
//! every device mapping and every in-flight transfer has ended.

use std::io;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Once;

use crate::Error;
use crate::os::{self, Os, round_up};

/// Whether to try huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Explicit huge pages (`MAP_HUGETLB`) if reserved, else transparent huge pages via
    /// `madvise`, else normal pages. Regions below one huge page always use normal pages.
    #[default]
    Auto,
    /// Normal pages only.
    Never,
}

/// Whether to lock the region in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Locking {
    /// Try `mlock`; on failure keep the region unpinned and warn once.
    #[default]
    BestEffort,
    /// Fail with [`Error::Lock`] if the region cannot be locked.
    Required,
    /// Do not lock.
    Never,
}

/// How a region is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Backing {
    /// Explicit huge pages from the reserved pool (`MAP_HUGETLB`).
    HugeTlb,
    /// Normal pages with `MADV_HUGEPAGE`: the kernel may back them with transparent huge pages.
    TransparentHuge,
    /// Normal pages.
    Pages,
}

/// Options of [`PinnedRegion::new`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedOptions {
    /// Huge page policy.
    pub huge_pages: HugePages,
    /// Locking policy.
    pub locking: Locking,
}

static LOCK_WARNING: Once = Once::new();

/// Logs, once per process, that a cache pool could not be locked, why, and how to raise the
/// limit. Shared by every kind of pinned memory so the warning appears only once.
pub(crate) fn warn_unpinned(len: usize, err: &io::Error) {
    LOCK_WARNING.call_once(|| {
        let limit = crate::probe::memlock_limit()
            .ok()
            .and_then(|l| l.soft_bytes)
            .map_or_else(|| "unlimited".to_owned(), |b| format!("{} KiB", b / 1024));
        log::warn!(
            "cannot lock a {len}-byte cache pool in memory ({err}; RLIMIT_MEMLOCK is {limit}): \
             using unpinned memory, which the kernel may swap or migrate. Raise the limit with \
             `ulimit -l unlimited`, LimitMEMLOCK=infinity in the systemd unit, or \
             /etc/security/limits.conf. (This warning is shown once.)"
        );
    });
}

/// Raw ownership of one mapping; unmaps on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    requested: usize,
    backing: Backing,
    locked: bool,
}

fn map_region(os: &dyn Os, requested: usize, opts: PinnedOptions) -> Result<Mapping, Error> {
    if requested == 0 {
        return Err(Error::ZeroSizedRegion);
    }
    let page = os.page_size();
    let too_big = || Error::RegionTooLarge { bytes: requested };
    let mut mapping = None;
    if opts.huge_pages == HugePages::Auto
        && let Some(huge) = os.huge_page_size()
        && requested >= huge
    {
        let len = round_up(requested, huge).ok_or_else(too_big)?;
        match os.map(len, true) {
            Ok(ptr) => mapping = Some((ptr, len, Backing::HugeTlb)),
            // No reserved huge pages (ENOMEM) or no hugetlbfs support: fall through quietly.
            Err(e) => log::debug!("MAP_HUGETLB for {len} bytes failed ({e}); using normal pages"),
        }
    }
    let (ptr, len, backing) = match mapping {
        Some(m) => m,
        None => {
            let len = round_up(requested, page).ok_or_else(too_big)?;
            let ptr = os
                .map(len, false)
                .map_err(|source| Error::Map { bytes: len, source })?;
            let want_thp =
                opts.huge_pages == HugePages::Auto && os.huge_page_size().is_some_and(|h| len >= h);
            let backing = if want_thp && os.advise_huge(ptr, len).is_ok() {
                Backing::TransparentHuge
            } else {
                Backing::Pages
            };
            (ptr, len, backing)
        }
    };
    let mut m = Mapping {
        ptr,
        len,
        requested,
        backing,
        locked: false,
    };
    match opts.locking {
        Locking::Never => {}
        Locking::BestEffort => match os.lock(ptr, len) {
            Ok(()) => m.locked = true,
            Err(e) => warn_unpinned(len, &e),
        },
        Locking::Required => {
            if let Err(source) = os.lock(ptr, len) {
                os.unmap(ptr, len);
                return Err(Error::Lock { bytes: len, source });
            }
            m.locked = true;
        }
    }
    Ok(m)
}

/// A page-aligned, zero-initialised anonymous mapping, pinned when possible, owned by the CPU.
/// See the module docs for the DMA contract.
pub struct PinnedRegion {
    map: Mapping,
    os: &'static dyn Os,
}

// SAFETY: a PinnedRegion uniquely owns its mapping (like a Vec<u8> owns its buffer); the raw
// pointer is only dereferenced through &self / &mut self methods, so moving it to another thread
// or sharing & across threads has the same guarantees as Vec<u8>.
unsafe impl Send for PinnedRegion {}
// SAFETY: see Send: &PinnedRegion only allows reads of CPU-private memory.
unsafe impl Sync for PinnedRegion {}

impl PinnedRegion {
    /// Maps at least `bytes` bytes (rounded up to the page or huge page size).
    pub fn new(bytes: usize, opts: PinnedOptions) -> Result<PinnedRegion, Error> {
        Self::new_with(&os::LINUX, bytes, opts)
    }

    pub(crate) fn new_with(
        os: &'static dyn Os,
        bytes: usize,
        opts: PinnedOptions,
    ) -> Result<PinnedRegion, Error> {
        let map = map_region(os, bytes, opts)?;
        log::debug!(
            "pinned region: {} bytes ({} requested), {:?}, locked: {}",
            map.len,
            map.requested,
            map.backing,
            map.locked
        );
        Ok(PinnedRegion { map, os })
    }

    /// Usable length in bytes (the request rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Always false: zero-sized regions are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes that were asked for.
    pub fn requested_len(&self) -> usize {
        self.map.requested
    }

    /// How the region is backed.
    pub fn backing(&self) -> Backing {
        self.map.backing
    }

    /// Whether `mlock` succeeded.
    pub fn is_locked(&self) -> bool {
        self.map.locked
    }

    /// The region's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is one live, initialised (zero-filled) mapping owned by self; only
        // the CPU accesses it while it is a PinnedRegion, and &self forbids writers.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr(), self.map.len) }
    }

    /// The region's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.as_ptr(), self.map.len) }
    }

    /// Hands the region to devices: from now on it is reached only through volatile accesses.
    pub fn into_device_shared(self) -> DeviceSharedRegion {
        DeviceSharedRegion { inner: self }
    }

    /// Hands the region to an owner that lends parts of it to devices one at a time (a
    /// [`crate::blockio::BufferPool`]): see [`LentRegion`].
    pub fn into_lent(self) -> LentRegion {
        LentRegion { inner: self }
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        self.os.unmap(self.map.ptr, self.map.len);
    }
}

impl std::fmt::Debug for PinnedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRegion")
            .field("len", &self.map.len)
            .field("backing", &self.map.backing)
            .field("locked", &self.map.locked)
            .finish_non_exhaustive()
    }
}

/// A pinned region that devices may read and write at any time (see the module's DMA
/// contract). The CPU reaches it only through [`VolatileView`].
#[derive(Debug)]
pub struct DeviceSharedRegion {
    inner: PinnedRegion,
}

impl DeviceSharedRegion {
    /// Start address and length, for registering the region with a device (io_uring fixed
    /// buffers, `cuMemHostRegister`, VFIO DMA maps). The address stays valid until drop.
    pub fn raw_parts(&self) -> (NonNull<u8>, usize) {
        (self.inner.map.ptr, self.inner.map.len)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Always false: zero-sized regions are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// A volatile view of the whole region.
    pub fn volatile(&self) -> VolatileView<'_> {
        VolatileView {
            ptr: self.inner.map.ptr,
            len: self.inner.map.len,
            _life: PhantomData,
        }
    }

    /// Takes the region back for CPU-only use.
    ///
    /// # Safety
    /// Every device mapping of the region must have been removed and every transfer into or out
    /// of it must have completed; afterwards no device may access it until it is shared again.
    pub unsafe fn into_cpu_private(self) -> PinnedRegion {
        self.inner
    }
}

/// A pinned region whose parts an owner lends to the CPU and to devices **in turn**: a
/// [`crate::blockio::BufferPool`] hands each slot to one [`crate::blockio::IoBuf`], which the
/// CPU reads and writes as a slice while the caller holds it, and which a device reads or
/// writes only while an operation naming that slot is in flight (the engine then owns the
/// `IoBuf`, so no slice of the slot exists). The region as a whole can thus be mapped for a
/// device (an IOMMU mapping of an NVMe controller, `crate::nvme::Dma::map_lent`) while it
/// is in use, but it offers no view of its bytes of its own: the owner's handles are the only
/// way the CPU reaches them, and a device model reaches them only through
/// [`LentRegion::device_view`], whose contract is the same rule.
#[derive(Debug)]
pub struct LentRegion {
    inner: PinnedRegion,
}

impl LentRegion {
    /// Start address and length, for mapping the region for a device (VFIO DMA maps). The
    /// address stays valid until drop.
    pub fn raw_parts(&self) -> (NonNull<u8>, usize) {
        (self.inner.map.ptr, self.inner.map.len)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Always false: zero-sized regions are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `mlock` succeeded.
    pub fn is_locked(&self) -> bool {
        self.inner.is_locked()
    }

    /// The device's view of the bytes: what an emulated device (the fake NVMe controller)
    /// uses to move data in and out of the region, as hardware would by DMA.
    ///
    /// # Safety
    /// For as long as the view is used, the bytes it reads or writes must be covered by no
    /// Rust reference: only those of parts lent to an operation in flight (whose handle the
    /// engine holds), exactly the bytes a real device may touch.
    pub unsafe fn device_view(&self) -> VolatileView<'_> {
        VolatileView {
            ptr: self.inner.map.ptr,
            len: self.inner.map.len,
            _life: PhantomData,
        }
    }
}

/// A bounds-checked window onto memory a device may change concurrently. Reads and writes are
/// volatile copies (aligned machine words, single bytes at unaligned ends); no Rust reference
/// to the bytes ever exists.
#[derive(Clone, Copy, Debug)]
pub struct VolatileView<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _life: PhantomData<&'a [u8]>,
}

impl VolatileView<'_> {
    /// A view of no bytes: every access of one byte or more is refused.
    pub fn empty() -> VolatileView<'static> {
        VolatileView {
            ptr: NonNull::dangling(),
            len: 0,
            _life: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, count: usize) -> Result<(), Error> {
        match offset.checked_add(count) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                count,
                len: self.len,
            }),
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), Error> {
        self.check(offset, dst.len())?;
        // SAFETY: offset + dst.len() <= len (checked above), so the range lies inside the live
        // mapping, which outlives 'a, and no Rust reference to it exists (module docs).
        unsafe { copy_from_volatile(self.ptr.as_ptr().add(offset), dst) };
        Ok(())
    }

    /// Copies `src` into the region starting at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), Error> {
        self.check(offset, src.len())?;
        // SAFETY: as in read; the mapping is writable (PROT_WRITE), and since no Rust reference
        // to it exists a volatile store cannot invalidate one.
        unsafe { copy_to_volatile(src, self.ptr.as_ptr().add(offset)) };
        Ok(())
    }
}

/// The unit of a volatile copy: the widest integer the CPU loads or stores in one access.
type Word = usize;

/// Bytes in a [`Word`].
const WORD: usize = size_of::<Word>();

/// Bytes from address `addr` up to the next [`Word`] boundary, at most `len`: the part of a
/// copy done byte by byte before aligned words can start.
fn head_len(addr: usize, len: usize) -> usize {
    (addr.wrapping_neg() % WORD).min(len)
}

/// Copies `dst.len()` bytes out of device-visible memory at `src`: single bytes up to the first
/// word boundary of `src`, aligned word loads, then the remaining bytes. Words take a
/// [`WORD`]th of the accesses of a byte loop; every access is volatile and inside the range. A
/// device may change the bytes meanwhile, so the result is not a snapshot (nor was it byte by
/// byte).
///
/// # Safety
/// `src..src + dst.len()` must be readable memory that no Rust reference covers.
unsafe fn copy_from_volatile(src: *const u8, dst: &mut [u8]) {
    let (head, rest) = dst.split_at_mut(head_len(src.addr(), dst.len()));
    let body_at = head.len();
    let (body, tail) = rest.as_chunks_mut::<WORD>();
    let tail_at = body_at + body.len() * WORD;
    for (i, d) in head.iter_mut().enumerate() {
        // SAFETY: i < head.len() <= dst.len(), inside the caller's range; a u8 needs no
        // alignment.
        *d = unsafe { src.add(i).read_volatile() };
    }
    for (i, d) in body.iter_mut().enumerate() {
        // SAFETY: body_at + (i + 1) * WORD <= tail_at <= dst.len(), inside the caller's range;
        // src + body_at is on a word boundary (head_len), so every word is aligned.
        let w = unsafe { src.add(body_at + i * WORD).cast::<Word>().read_volatile() };
        *d = w.to_ne_bytes();
    }
    for (i, d) in tail.iter_mut().enumerate() {
        // SAFETY: tail_at + i < dst.len(), inside the caller's range; a u8 needs no alignment.
        *d = unsafe { src.add(tail_at + i).read_volatile() };
    }
}

/// Copies `src` into device-visible memory at `dst`, split as in [`copy_from_volatile`]: bytes
/// up to the first word boundary of `dst`, aligned volatile word stores, then bytes.
///
/// # Safety
/// `dst..dst + src.len()` must be writable memory that no Rust reference covers.
unsafe fn copy_to_volatile(src: &[u8], dst: *mut u8) {
    let (head, rest) = src.split_at(head_len(dst.addr(), src.len()));
    let body_at = head.len();
    let (body, tail) = rest.as_chunks::<WORD>();
    let tail_at = body_at + body.len() * WORD;
    for (i, &b) in head.iter().enumerate() {
        // SAFETY: i < head.len() <= src.len(), inside the caller's range; a u8 needs no
        // alignment.
        unsafe { dst.add(i).write_volatile(b) };
    }
    for (i, &w) in body.iter().enumerate() {
        // SAFETY: body_at + (i + 1) * WORD <= tail_at <= src.len(), inside the caller's range;
        // dst + body_at is on a word boundary (head_len), so every word is aligned.
        unsafe {
            dst.add(body_at + i * WORD)
                .cast::<Word>()
                .write_volatile(Word::from_ne_bytes(w));
        };
    }
    for (i, &b) in tail.iter().enumerate() {
        // SAFETY: tail_at + i < src.len(), inside the caller's range; a u8 needs no alignment.
        unsafe { dst.add(tail_at + i).write_volatile(b) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::FakeOs;

    fn fake(huge_tlb_fails: bool, lock_fails: bool) -> &'static FakeOs {
        FakeOs {
            huge: Some(2 << 20),
            huge_tlb_fails,
            lock_fails,
            ..Default::default()
        }
        .leak()
    }

    #[test]
    fn region_is_zeroed_page_aligned_and_writable() {
        let mut r = PinnedRegion::new(10_000, PinnedOptions::default()).unwrap();
        assert!(r.len() >= 10_000 && r.len().is_multiple_of(4096));
        assert_eq!(r.as_slice().as_ptr() as usize % 4096, 0);
        assert!(r.as_slice().iter().all(|&b| b == 0));
        r.as_mut_slice()[9_999] = 7;
        assert_eq!(r.as_slice()[9_999], 7);
    }

    #[test]
    fn zero_bytes_is_refused() {
        assert!(matches!(
            PinnedRegion::new(0, PinnedOptions::default()),
            Err(Error::ZeroSizedRegion)
        ));
    }

    #[test]
    fn lock_failure_falls_back_to_unpinned_or_fails_when_required() {
        let os = fake(true, true);
        let r = PinnedRegion::new_with(os, 4 << 20, PinnedOptions::default()).unwrap();
        assert!(!r.is_locked());
        // HUGETLB failed, so the region uses normal pages with the THP hint.
        assert_ne!(r.backing(), Backing::HugeTlb);
        drop(r);
        assert_eq!(os.unmapped(), [4 << 20]);

        let err = PinnedRegion::new_with(
            os,
            4096,
            PinnedOptions {
                locking: Locking::Required,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(matches!(err, Error::Lock { .. }), "{err}");
        // The failed region was unmapped, not leaked.
        assert_eq!(os.unmapped().len(), 2);
    }

    #[test]
    fn huge_tlb_rounds_to_whole_huge_pages() {
        // The fake "succeeds" MAP_HUGETLB with normal pages, which is enough to check sizing.
        let os = fake(false, false);
        let r = PinnedRegion::new_with(os, (2 << 20) + 1, PinnedOptions::default()).unwrap();
        assert_eq!(r.backing(), Backing::HugeTlb);
        assert_eq!(r.len(), 4 << 20);
        assert!(r.is_locked());
        let small = PinnedRegion::new_with(os, 8192, PinnedOptions::default()).unwrap();
        assert_eq!(small.backing(), Backing::Pages);
    }

    #[test]
    fn volatile_view_is_bounds_checked() {
        let r = PinnedRegion::new(4096, PinnedOptions::default())
            .unwrap()
            .into_device_shared();
        let v = r.volatile();
        v.write(4090, &[1, 2, 3, 4, 5, 6]).unwrap();
        let mut out = [0u8; 6];
        v.read(4090, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        assert!(matches!(
            v.write(4091, &[0; 6]),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            v.read(usize::MAX, &mut out),
            Err(Error::OutOfBounds { .. })
        ));
        // SAFETY: no device ever saw this region.
        let back = unsafe { r.into_cpu_private() };
        assert_eq!(&back.as_slice()[4090..], &[1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn volatile_copies_match_a_byte_model_at_odd_offsets_and_lengths() {
        let r = PinnedRegion::new(4096, PinnedOptions::default())
            .unwrap()
            .into_device_shared();
        let v = r.volatile();
        let (base, len) = r.raw_parts();
        // What the region must hold, and a byte-by-byte volatile reader to check it with.
        let mut model: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let bytes = || -> Vec<u8> {
            (0..len)
                // SAFETY: i < len lies in the live mapping; no reference to it exists.
                .map(|i| unsafe { base.as_ptr().add(i).read_volatile() })
                .collect()
        };
        v.write(0, &model).unwrap();
        assert_eq!(bytes(), model);
        let lens = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 1001];
        let mut fill = 0u8;
        for offset in (0..=2 * WORD + 1).chain([len - 1001, len - 17, len - 9, len - 1]) {
            for &n in lens.iter().filter(|&&n| offset + n <= len) {
                let mut out = vec![0xEE; n];
                v.read(offset, &mut out).unwrap();
                assert_eq!(out, model[offset..offset + n], "read {n} at {offset}");
                fill = fill.wrapping_add(37);
                let src: Vec<u8> = (0..n).map(|i| fill ^ i as u8).collect();
                v.write(offset, &src).unwrap();
                model[offset..offset + n].copy_from_slice(&src);
                // Nothing outside the written range changed.
                assert_eq!(bytes(), model, "write {n} at {offset}");
            }
        }
    }
}
