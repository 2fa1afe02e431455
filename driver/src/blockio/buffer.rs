//! Aligned I/O buffers carved from one pinned region, owned one at a time.
//!
//! # DMA contract (io_uring fixed buffers)
//!
//! A [`BufferPool`] is one [`PinnedRegion`] cut into equal, 4 KiB-aligned slots. An io_uring
//! engine registers the whole region with the kernel (fixed buffers), but registration only
//! pins the pages: the kernel reads or writes a slot **only while an operation that names it is
//! in flight**. An [`IoBuf`] is the unique handle to one slot. The CPU reaches a slot's bytes
//! through its `IoBuf` (as `&[u8]` / `&mut [u8]`) only while the handle is in the caller's
//! hands; submitting an operation moves the `IoBuf` into the engine, and the engine hands it
//! back only in the [`super::Completion`] it builds after reaping that operation's completion
//! entry. Hence no Rust reference to a slot exists while the kernel may access it, which is what
//! [`crate::pinned`]'s contract requires of device-visible memory. An engine that cannot reap an
//! operation (its ring failed) leaks the `IoBuf` deliberately (and with it the region) rather
//! than let the slot be reused.
//!
//! # Zero copy on an NVMe controller
//!
//! The same contract lets a userspace NVMe controller reach the slots directly: the pool's
//! region is a [`LentRegion`], which `NvmeNamespace::map_pool` maps whole into the
//! controller's IOMMU domain, and the NVMe engine names a slot's pages (their IOVAs) in a
//! command only while it owns that slot's `IoBuf`. The mapping is removed when the pool's
//! memory is released (the last `BufferPool` clone and `IoBuf` dropped: no command can name a
//! slot then), or earlier by the controller's own teardown; the region is freed only after
//! both. A buffer whose command the controller could not stop is **quarantined**
//! ([`IoBuf::is_empty`] becomes true, its bytes unreachable): dropping it never returns the
//! slot to the pool and keeps the pool's memory alive for good, since the device may still
//! write it.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::pinned::{LentRegion, PinnedOptions, PinnedRegion};

/// Pool identities, never reused (a mapping is found by its pool's id).
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// What runs when a pool's memory is released (unmapping it from a device).
pub(crate) type OnRelease = Box<dyn FnOnce() + Send>;

/// The alignment of every slot (and the granularity direct I/O needs).
pub const BUFFER_ALIGN: usize = 4096;

pub(crate) struct PoolInner {
    /// Keeps the memory mapped; never accessed through a reference after construction. Shared
    /// with the device mappings of the region, which keep it alive until unmapped.
    region: Arc<LentRegion>,
    base: NonNull<u8>,
    slot_bytes: usize,
    slots: usize,
    free: Mutex<Vec<u16>>,
    available: Condvar,
    id: u64,
    /// Run on release, before the region's handle is dropped: device unmappings.
    on_release: Mutex<Vec<OnRelease>>,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Every IoBuf is gone (each holds this pool), so no operation names a slot: the
        // device mappings can go.
        let hooks = match self.on_release.get_mut() {
            Ok(h) => std::mem::take(h),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        for hook in hooks {
            hook();
        }
    }
}

// SAFETY: the region's bytes are only touched through the one IoBuf that owns a slot, or by a
// device for an operation in flight whose engine holds that IoBuf (module docs; device
// mappings share the region's handle but never read it from the CPU); the free list and the
// release hooks (Send closures) are behind Mutexes.
unsafe impl Send for PoolInner {}
// SAFETY: as for Send; &PoolInner gives access to the free list (locked) and immutable fields.
unsafe impl Sync for PoolInner {}

impl PoolInner {
    /// `(address, length)` of every slot, for registration with io_uring.
    pub(crate) fn slot_ranges(&self) -> Vec<(NonNull<u8>, usize)> {
        (0..self.slots)
            .map(|i| {
                // SAFETY: i < slots, so the slot lies inside the region (slots * slot_bytes <=
                // region length, checked at construction).
                let p =
                    unsafe { NonNull::new_unchecked(self.base.as_ptr().add(i * self.slot_bytes)) };
                (p, self.slot_bytes)
            })
            .collect()
    }

    fn release(&self, index: u16) {
        if let Ok(mut free) = self.free.lock() {
            free.push(index);
            self.available.notify_one();
        }
    }
}

/// A set of equal 4 KiB-aligned I/O buffers in one pinned region. Cloning shares the pool.
#[derive(Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("slots", &self.inner.slots)
            .field("slot_bytes", &self.inner.slot_bytes)
            .field("locked", &self.inner.region.is_locked())
            .field("id", &self.inner.id)
            .finish()
    }
}

impl BufferPool {
    /// `slots` buffers of at least `slot_bytes` bytes each (rounded up to 4 KiB).
    ///
    /// # Errors
    /// [`crate::Error::ZeroSizedRegion`] for zero slots or bytes, [`crate::Error::RegionTooLarge`]
    /// for more than 65,536 slots or an overflowing size, and the region's mapping errors.
    pub fn new(slots: usize, slot_bytes: usize, opts: PinnedOptions) -> Result<Self, crate::Error> {
        if slots == 0 || slot_bytes == 0 {
            return Err(crate::Error::ZeroSizedRegion);
        }
        let too_large = crate::Error::RegionTooLarge {
            bytes: slots.saturating_mul(slot_bytes),
        };
        if slots > usize::from(u16::MAX) + 1 {
            return Err(too_large);
        }
        let slot_bytes = slot_bytes
            .checked_next_multiple_of(BUFFER_ALIGN)
            .ok_or(crate::Error::RegionTooLarge { bytes: slot_bytes })?;
        let total = slots.checked_mul(slot_bytes).ok_or(too_large)?;
        let region = PinnedRegion::new(total, opts)?.into_lent();
        let (base, _) = region.raw_parts();
        let free = (0..slots)
            .rev()
            .filter_map(|i| u16::try_from(i).ok())
            .collect();
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                region: Arc::new(region),
                base,
                slot_bytes,
                slots,
                free: Mutex::new(free),
                available: Condvar::new(),
                id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
                on_release: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Number of buffers.
    pub fn slots(&self) -> usize {
        self.inner.slots
    }

    /// Bytes per buffer (a multiple of 4 KiB).
    pub fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes
    }

    /// Whether the pool's memory is locked.
    pub fn is_locked(&self) -> bool {
        self.inner.region.is_locked()
    }

    /// Buffers not currently handed out.
    pub fn available(&self) -> usize {
        self.inner.free.lock().map_or(0, |f| f.len())
    }

    /// A free buffer, if one is available now.
    pub fn try_get(&self) -> Option<IoBuf> {
        let index = self.inner.free.lock().ok()?.pop()?;
        Some(self.make(index))
    }

    /// A free buffer, waiting for one to be returned if none is available.
    pub fn get(&self) -> Option<IoBuf> {
        let mut free = self.inner.free.lock().ok()?;
        loop {
            if let Some(index) = free.pop() {
                drop(free);
                return Some(self.make(index));
            }
            free = self.inner.available.wait(free).ok()?;
        }
    }

    fn make(&self, index: u16) -> IoBuf {
        let off = usize::from(index) * self.inner.slot_bytes;
        // SAFETY: index < slots (it came from the free list), so the slot lies in the region.
        let ptr = unsafe { NonNull::new_unchecked(self.inner.base.as_ptr().add(off)) };
        IoBuf {
            pool: Arc::clone(&self.inner),
            index,
            ptr,
            len: self.inner.slot_bytes,
        }
    }

    pub(crate) fn inner(&self) -> &Arc<PoolInner> {
        &self.inner
    }

    /// The pool's identity, unique in the process (what a device mapping of it is keyed by).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The whole region, for mapping it for a device.
    pub(crate) fn lent_region(&self) -> &Arc<LentRegion> {
        &self.inner.region
    }

    /// Runs `f` with every buffer in the pool, none handed out meanwhile (the free list stays
    /// locked): how a device mapping of the whole region is made while no slice of it exists.
    /// `None`, without running `f`, while any buffer is handed out (the count is in the error
    /// of the caller's choosing, from [`BufferPool::available`]).
    pub(crate) fn with_all_home<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let free = match self.inner.free.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if free.len() != self.inner.slots {
            return None;
        }
        let out = f();
        drop(free);
        Some(out)
    }

    /// Runs `hook` when the pool's memory is released (the last clone and buffer dropped),
    /// before the pool lets go of the region: how a device mapping is removed.
    pub(crate) fn on_release(&self, hook: OnRelease) {
        match self.inner.on_release.lock() {
            Ok(mut h) => h.push(hook),
            Err(poisoned) => poisoned.into_inner().push(hook),
        }
    }
}

/// The unique handle to one buffer of a [`BufferPool`]; returns the buffer to the pool on drop.
/// See the module's DMA contract.
pub struct IoBuf {
    pool: Arc<PoolInner>,
    index: u16,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an IoBuf is the only handle to its slot (the pool hands each index out once until it
// is returned), like a Box<[u8]>; moving it between threads moves that exclusive access.
unsafe impl Send for IoBuf {}
// SAFETY: &IoBuf only reads the slot, and while an IoBuf is reachable from Rust code no
// operation on its slot is in flight (module docs).
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// Bytes of the buffer (the pool's slot size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// False, except for a quarantined buffer (module docs): pools refuse empty slots.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slot's index in its pool (its io_uring fixed-buffer index when registered).
    pub fn index(&self) -> u16 {
        self.index
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is this IoBuf's slot, inside the live region (the Arc keeps it
        // mapped); no operation on it is in flight while the IoBuf is held (module docs).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice; &mut self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The start address, for an engine building a submission. Using it is governed by the
    /// module's contract.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn belongs_to(&self, pool: &Arc<PoolInner>) -> bool {
        Arc::ptr_eq(&self.pool, pool)
    }

    /// The id of the pool the buffer belongs to ([`BufferPool::id`]).
    pub(crate) fn pool_id(&self) -> u64 {
        self.pool.id
    }

    /// The buffer's byte offset in its pool's region.
    pub(crate) fn region_offset(&self) -> usize {
        usize::from(self.index) * self.pool.slot_bytes
    }

    /// Makes the buffer unusable for good: a device may still write its slot (a command the
    /// controller could not stop). Its bytes become unreachable (length 0), and dropping it
    /// neither returns the slot nor lets the pool's memory be freed (module docs).
    pub(crate) fn quarantine(&mut self) {
        self.len = 0;
    }

    /// Whether the engine quarantined the buffer (module docs): a device may still write its
    /// slot, so it holds no bytes and never returns to the pool.
    pub fn is_quarantined(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if self.len == 0 {
            log::warn!(
                "buffer {} of pool {} dropped in quarantine: never reused, its pool's memory                  never freed",
                self.index,
                self.pool.id
            );
            // One reference that is never dropped: the region outlives any device access.
            std::mem::forget(Arc::clone(&self.pool));
            return;
        }
        self.pool.release(self.index);
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoBuf")
            .field("index", &self.index)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pinned::{HugePages, Locking};

    const MEM: PinnedOptions = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };

    #[test]
    fn slots_are_aligned_unique_and_returned() {
        let pool = BufferPool::new(3, 5000, MEM).unwrap();
        assert_eq!(pool.slot_bytes(), 8192);
        let mut a = pool.try_get().unwrap();
        let b = pool.try_get().unwrap();
        let c = pool.try_get().unwrap();
        assert!(pool.try_get().is_none());
        for x in [&a, &b, &c] {
            assert_eq!(x.as_slice().as_ptr() as usize % BUFFER_ALIGN, 0);
        }
        a.as_mut_slice().fill(7);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        drop(b);
        assert_eq!(pool.available(), 1);
        let again = pool.get().unwrap();
        assert_eq!(again.len(), 8192);
        assert!(BufferPool::new(0, 1, MEM).is_err());
    }
}
