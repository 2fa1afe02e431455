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

use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex};

use crate::pinned::{PinnedOptions, PinnedRegion};

/// The alignment of every slot (and the granularity direct I/O needs).
pub const BUFFER_ALIGN: usize = 4096;

pub(crate) struct PoolInner {
    /// Keeps the memory mapped; never accessed through a reference after construction.
    region: PinnedRegion,
    base: NonNull<u8>,
    slot_bytes: usize,
    slots: usize,
    free: Mutex<Vec<u16>>,
    available: Condvar,
}

// SAFETY: the region is uniquely owned by the pool; slot bytes are only touched through the one
// IoBuf that owns the slot (module docs), and the free list is behind a Mutex.
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
        let mut region = PinnedRegion::new(total, opts)?;
        let base = NonNull::new(region.as_mut_slice().as_mut_ptr())
            .ok_or(crate::Error::ZeroSizedRegion)?;
        let free = (0..slots)
            .rev()
            .filter_map(|i| u16::try_from(i).ok())
            .collect();
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                region,
                base,
                slot_bytes,
                slots,
                free: Mutex::new(free),
                available: Condvar::new(),
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

    /// Always false: pools refuse empty slots.
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
}

impl Drop for IoBuf {
    fn drop(&mut self) {
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
