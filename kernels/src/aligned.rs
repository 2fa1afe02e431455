//! f32 buffers that start on a cache line.
//!
//! The AVX-512 loops load 64 bytes (a whole vector) or 32 (a broadcast half) at a time; from a
//! `Vec<f32>`, which the allocator aligns to 16 bytes only, every other one of those loads
//! straddles two cache lines and costs two accesses. The attention's query, key rows and
//! accumulators live in these instead (measured on the key loop over rows in L2: the kernel's
//! own buffers aligned, about 6 % faster; the rows aligned too, another 15 %).

/// Cache line size the buffers align to, in bytes.
const LINE: usize = 64;
/// The most f32 elements an allocation's start is moved by to reach a line.
const SLACK: usize = LINE / 4 - 1;

/// A zero-initialised run of f32 whose first element sits on a 64-byte boundary.
#[derive(Debug, Default)]
pub struct AlignedF32 {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl AlignedF32 {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> AlignedF32 {
        let buf = vec![0f32; len + SLACK];
        // An f32 pointer is 4-byte aligned, so a line is at most `SLACK` elements on; should
        // the offset be unknown (`usize::MAX`), the buffer is used unaligned, which is only
        // slower.
        let start = buf.as_ptr().align_offset(LINE);
        let start = if start <= SLACK { start } else { 0 };
        AlignedF32 { buf, start, len }
    }

    /// The elements.
    pub fn as_slice(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The elements, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// `len` elements for a caller that writes every one: the allocation and its old
    /// contents kept when the length is unchanged, else `len` zeros.
    pub fn resize_for_overwrite(&mut self, len: usize) {
        if len != self.len || self.buf.is_empty() {
            *self = AlignedF32::zeroed(len);
        }
    }

    /// `len` zeros, reusing the allocation when the length is unchanged.
    pub fn reset(&mut self, len: usize) {
        if len == self.len && !self.buf.is_empty() {
            self.as_mut_slice().fill(0.0);
        } else {
            *self = AlignedF32::zeroed(len);
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Clone for AlignedF32 {
    // A clone's allocation has its own alignment: a fresh buffer, then the elements.
    fn clone(&self) -> AlignedF32 {
        let mut c = AlignedF32::zeroed(self.len);
        c.as_mut_slice().copy_from_slice(self.as_slice());
        c
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn buffers_start_on_a_line_and_keep_their_length() {
        for len in [0usize, 1, 15, 16, 17, 512, 4099] {
            let mut b = AlignedF32::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.is_empty(), len == 0);
            assert!(b.as_slice().iter().all(|&v| v == 0.0));
            if len > 0 {
                assert_eq!(b.as_slice().as_ptr() as usize % LINE, 0, "len {len}");
            }
            b.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f32);
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
            if len > 0 {
                assert_eq!(c.as_slice().as_ptr() as usize % LINE, 0);
            }
            b.resize_for_overwrite(len);
            assert!(b.as_slice().iter().enumerate().all(|(i, &v)| v == i as f32));
            b.reset(len);
            assert!(b.as_slice().iter().all(|&v| v == 0.0));
            b.as_mut_slice().fill(1.0);
            b.resize_for_overwrite(len + 1);
            assert_eq!(b.len(), len + 1);
            assert!(b.as_slice().iter().all(|&v| v == 0.0));
            assert_eq!(b.as_slice().as_ptr() as usize % LINE, 0);
            b.reset(len + 3);
            assert_eq!(b.len(), len + 3);
            assert!(b.as_slice().iter().all(|&v| v == 0.0));
        }
    }
}
