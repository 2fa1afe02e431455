//! The IOVA space of one VFIO container: where [`super::vfio::VfioDma`] maps each region.
//!
//! Two rules pull against each other. A range freed (unmapped) and handed out again at once
//! would let a late device access to the old buffer (a device bug, or a command the driver
//! believes finished) land in the new one instead of faulting in the IOMMU. A range never
//! handed out again exhausts the IOMMU's address width in a long-running process: every
//! reader the SSD tier makes beyond its cache maps a buffer pool (about 8 MiB), and the
//! emulated Intel IOMMU translates 39 bits (512 GiB). So freed ranges cool first: they are
//! reused only once [`QUARANTINE_BYTES`] of later frees have followed them, first fit, with
//! free neighbours merged. The space in use stays bounded by the live mappings plus the
//! quarantine plus fragmentation, however long the process runs (tested over a million
//! map/unmap cycles).

use std::collections::{BTreeMap, VecDeque};

/// Freed IOVA space kept out of reuse, newest frees first to be held.
pub(crate) const QUARANTINE_BYTES: u64 = 64 << 30;

/// Free and cooling ranges of one container's IOVA space (module docs).
#[derive(Debug)]
pub(crate) struct IovaSpace {
    /// Above every range ever handed out.
    next: u64,
    /// Freed ranges, oldest first, not yet reusable.
    cooling: VecDeque<(u64, u64)>,
    cooling_bytes: u64,
    quarantine: u64,
    /// Reusable ranges, start -> length, adjacent ones merged.
    free: BTreeMap<u64, u64>,
}

impl IovaSpace {
    /// A space from `first` up, freed ranges held back for `quarantine` bytes of later frees.
    pub(crate) fn new(first: u64, quarantine: u64) -> IovaSpace {
        IovaSpace {
            next: first,
            cooling: VecDeque::new(),
            cooling_bytes: 0,
            quarantine,
            free: BTreeMap::new(),
        }
    }

    /// A range of `len` bytes: the lowest reusable one that fits, or new space above every
    /// range handed out. `None` when the 64-bit space is exhausted.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let fit = self
            .free
            .iter()
            .find(|&(_, &l)| l >= len)
            .map(|(&s, &l)| (s, l));
        if let Some((start, l)) = fit {
            self.free.remove(&start);
            if l > len {
                self.free.insert(start + len, l - len);
            }
            return Some(start);
        }
        let start = self.next;
        self.next = start.checked_add(len)?;
        Some(start)
    }

    /// Gives back a range that was handed out but never mapped: reusable at once.
    pub(crate) fn unreserve(&mut self, start: u64, len: u64) {
        self.insert_free(start, len);
    }

    /// A range whose mapping was removed: reusable once the quarantine has passed it.
    pub(crate) fn release(&mut self, start: u64, len: u64) {
        self.cooling.push_back((start, len));
        self.cooling_bytes += len;
        while self.cooling_bytes > self.quarantine {
            let Some((s, l)) = self.cooling.pop_front() else {
                break;
            };
            self.cooling_bytes -= l;
            self.insert_free(s, l);
        }
    }

    /// The end of the highest range ever handed out.
    #[cfg(test)]
    pub(crate) fn high_water(&self) -> u64 {
        self.next
    }

    fn insert_free(&mut self, mut start: u64, mut len: u64) {
        if let Some((&s, &l)) = self.free.range(..start).next_back()
            && s + l == start
        {
            self.free.remove(&s);
            start = s;
            len += l;
        }
        if let Some(&l) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += l;
        }
        if start + len == self.next {
            // The top of the space: lower the bump pointer instead of listing it.
            self.next = start;
        } else {
            self.free.insert(start, len);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_freed_range_is_not_reused_before_the_quarantine_passes_it() {
        let mut s = IovaSpace::new(1 << 32, 64 * MIB);
        let a = s.alloc(8 * MIB).unwrap();
        let keep = s.alloc(8 * MIB).unwrap();
        s.release(a, 8 * MIB);
        // 56 MiB of later frees: still cooling.
        for _ in 0..7 {
            let b = s.alloc(8 * MIB).unwrap();
            assert_ne!(b, a, "reused while cooling");
            s.release(b, 8 * MIB);
        }
        let b = s.alloc(8 * MIB).unwrap();
        assert_ne!(b, a);
        // 64 MiB of frees after it: out of the quarantine.
        s.release(b, 8 * MIB);
        assert_eq!(
            s.alloc(8 * MIB),
            Some(a),
            "the oldest freed range, first fit"
        );
        assert_ne!(keep, a);
    }

    #[test]
    fn ranges_split_and_merge() {
        let mut s = IovaSpace::new(0, 0);
        let a = s.alloc(4 * MIB).unwrap();
        let b = s.alloc(4 * MIB).unwrap();
        let top = s.alloc(4 * MIB).unwrap();
        s.release(a, 4 * MIB);
        s.release(b, 4 * MIB);
        // a and b merged: an 8 MiB request fits where they were.
        assert_eq!(s.alloc(8 * MIB), Some(a));
        s.release(a, 8 * MIB);
        // A small request splits the range; the rest stays free.
        assert_eq!(s.alloc(MIB), Some(a));
        assert_eq!(s.alloc(7 * MIB), Some(a + MIB));
        // Freeing the top lowers the high-water mark.
        s.release(top, 4 * MIB);
        assert_eq!(s.high_water(), top);
        // A range never mapped is reusable at once.
        let d = s.alloc(2 * MIB).unwrap();
        s.unreserve(d, 2 * MIB);
        assert_eq!(s.alloc(2 * MIB), Some(d));
    }

    /// A long-running process (readers made and dropped, pools of varied sizes) stays within
    /// the live mappings, the quarantine and some fragmentation: never the growth without
    /// bound of handing out new space each time.
    #[test]
    fn a_million_map_unmap_cycles_stay_bounded() {
        let q = QUARANTINE_BYTES;
        let first = 1 << 32;
        let mut s = IovaSpace::new(first, q);
        let mut live: VecDeque<(u64, u64)> = VecDeque::new();
        let mut x = 0x9e37_79b9_u64;
        for _ in 0..1_000_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (1 + x % 16) * MIB / 2;
            live.push_back((s.alloc(len).unwrap(), len));
            if live.len() > 8 {
                let (a, l) = live.pop_front().unwrap();
                s.release(a, l);
            }
        }
        // Without reuse: about 4.25 TB handed out. With it: under the quarantine plus 1 GiB.
        let used = s.high_water() - first;
        assert!(used < q + (1 << 30), "{used} bytes of IOVA space");
    }
}
