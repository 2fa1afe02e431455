//! The io_uring engine.
//!
//! The ring's system calls sit behind the small [`Ring`] trait: [`LinuxRing`] is the real one
//! (the `io-uring` crate), and the tests' fake ring simulates the kernel (completions out of
//! order, short transfers, `EAGAIN`, errors, completions that arrive only after several waits),
//! so the in-flight bookkeeping above it is tested without a kernel.

use std::io;
use std::os::fd::AsRawFd;

use nix::errno::Errno;

use super::buffer::{BufferPool, PoolInner};
use super::{
    BlockEngine, Completion, EngineKind, IoOp, IoTarget, OpKind, SubmitError, flush_file,
    wrong_target,
};
use std::sync::Arc;

/// One submission as the engine describes it to a [`Ring`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sqe {
    pub kind: OpKind,
    pub fd: i32,
    pub addr: *mut u8,
    pub len: u32,
    pub offset: u64,
    /// Fixed-buffer index when the buffer is registered.
    pub buf_index: Option<u16>,
    pub user_data: u64,
}

/// The system calls of a ring.
pub(crate) trait Ring: Send {
    /// Registers `ranges` as fixed buffers `0..ranges.len()`.
    ///
    /// # Safety
    /// Every range must stay valid memory until the ring is dropped.
    unsafe fn register_buffers(
        &mut self,
        ranges: &[(std::ptr::NonNull<u8>, usize)],
    ) -> io::Result<()>;

    /// Queues one submission; false when the submission queue is full.
    ///
    /// # Safety
    /// `sqe.addr..sqe.addr + sqe.len` must stay valid, and untouched by anything else, until
    /// the completion carrying `sqe.user_data` has been popped; `sqe.fd` must stay open as long.
    unsafe fn push(&mut self, sqe: &Sqe) -> bool;

    /// Submits queued entries and waits for at least `want` completions.
    fn submit_and_wait(&mut self, want: usize) -> io::Result<usize>;

    /// Pops one completion: `(user_data, result)` with a negative errno on failure.
    fn pop(&mut self) -> Option<(u64, i32)>;
}

/// The real ring.
pub(crate) struct LinuxRing {
    ring: io_uring::IoUring,
}

impl LinuxRing {
    pub(crate) fn new(entries: u32) -> io::Result<LinuxRing> {
        Ok(LinuxRing {
            ring: io_uring::IoUring::new(entries)?,
        })
    }
}

impl Ring for LinuxRing {
    unsafe fn register_buffers(
        &mut self,
        ranges: &[(std::ptr::NonNull<u8>, usize)],
    ) -> io::Result<()> {
        // Raw libc: the io-uring crate takes its own `libc::iovec` type.
        let iovecs: Vec<libc::iovec> = ranges
            .iter()
            .map(|&(p, len)| libc::iovec {
                iov_base: p.as_ptr().cast(),
                iov_len: len,
            })
            .collect();
        // SAFETY: the caller guarantees every range stays valid until the ring is dropped,
        // which is register_buffers' contract; the iovec array itself is only read during the
        // call.
        unsafe { self.ring.submitter().register_buffers(&iovecs) }
    }

    unsafe fn push(&mut self, sqe: &Sqe) -> bool {
        use io_uring::{opcode, types};
        let fd = types::Fd(sqe.fd);
        let entry = match (sqe.kind, sqe.buf_index) {
            (OpKind::Read, Some(i)) => opcode::ReadFixed::new(fd, sqe.addr, sqe.len, i)
                .offset(sqe.offset)
                .build(),
            (OpKind::Write, Some(i)) => opcode::WriteFixed::new(fd, sqe.addr, sqe.len, i)
                .offset(sqe.offset)
                .build(),
            (OpKind::Read, None) => opcode::Read::new(fd, sqe.addr, sqe.len)
                .offset(sqe.offset)
                .build(),
            (OpKind::Write, None) => opcode::Write::new(fd, sqe.addr, sqe.len)
                .offset(sqe.offset)
                .build(),
        }
        .user_data(sqe.user_data);
        // SAFETY: the caller guarantees the buffer and descriptor stay valid and untouched
        // until this entry's completion is popped, which is exactly push's contract.
        unsafe { self.ring.submission().push(&entry).is_ok() }
    }

    fn submit_and_wait(&mut self, want: usize) -> io::Result<usize> {
        self.ring.submit_and_wait(want)
    }

    fn pop(&mut self) -> Option<(u64, i32)> {
        self.ring
            .completion()
            .next()
            .map(|c| (c.user_data(), c.result()))
    }
}

/// One operation in flight.
struct InFlight {
    op: IoOp,
    /// Bytes already moved (a short transfer is resubmitted for the rest).
    done: usize,
}

/// The engine's state machine over any [`Ring`] (the real one or the tests' fake).
pub(crate) struct RingEngine<R: Ring> {
    ring: R,
    depth: usize,
    /// Slot `i` is the operation with user_data `i`.
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    in_flight: usize,
    /// The registered pool, if registration succeeded; its Arc keeps the memory mapped for as
    /// long as the ring may access it.
    registered: Option<Arc<PoolInner>>,
    /// Entries pushed but not yet submitted.
    unsubmitted: usize,
}

/// The io_uring engine. See the module docs of [`super`].
pub struct UringEngine(RingEngine<LinuxRing>);

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("depth", &self.0.depth)
            .field("in_flight", &self.0.in_flight)
            .field("registered", &self.0.registered.is_some())
            .finish()
    }
}

impl UringEngine {
    /// A ring of `depth` entries. When `pool` is given its buffers are registered as fixed
    /// buffers; if the kernel refuses (memlock accounting, old kernel) the engine logs it and
    /// uses plain reads and writes.
    ///
    /// # Errors
    /// Ring creation failures.
    pub fn new(depth: usize, pool: Option<&BufferPool>) -> io::Result<UringEngine> {
        let depth = depth.clamp(1, 4096);
        let entries = u32::try_from(depth.next_power_of_two()).unwrap_or(4096);
        let ring = LinuxRing::new(entries)?;
        Ok(UringEngine(RingEngine::with_ring(ring, depth, pool)))
    }
}

impl BlockEngine for UringEngine {
    fn kind(&self) -> EngineKind {
        self.0.kind()
    }
    fn direct(&self) -> bool {
        self.0.direct()
    }
    fn registered(&self) -> bool {
        self.0.registered()
    }
    fn depth(&self) -> usize {
        self.0.depth()
    }
    fn in_flight(&self) -> usize {
        self.0.in_flight()
    }
    fn submit(&mut self, op: IoOp) -> Result<(), SubmitError> {
        self.0.submit(op)
    }
    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<usize> {
        self.0.wait(min, out)
    }
    fn flush(&mut self, target: &IoTarget) -> io::Result<()> {
        self.0.flush(target)
    }
}

impl<R: Ring> RingEngine<R> {
    pub(crate) fn with_ring(mut ring: R, depth: usize, pool: Option<&BufferPool>) -> Self {
        let registered = pool.and_then(|p| {
            let inner = Arc::clone(p.inner());
            let ranges = inner.slot_ranges();
            // SAFETY: the ranges are slots of the pool's region; the engine keeps `inner` (an
            // Arc of the pool) until after the ring is dropped, so they stay mapped for the
            // ring's whole life.
            match unsafe { ring.register_buffers(&ranges) } {
                Ok(()) => Some(inner),
                Err(e) => {
                    log::warn!(
                        "io_uring refused to register {} buffers of {} bytes ({e}); using \
                         unregistered reads and writes",
                        p.slots(),
                        p.slot_bytes()
                    );
                    None
                }
            }
        });
        RingEngine {
            ring,
            depth,
            slots: (0..depth).map(|_| None).collect(),
            free_slots: (0..depth).rev().collect(),
            in_flight: 0,
            registered,
            unsubmitted: 0,
        }
    }

    /// The submission for the part of `op` after its first `done` bytes.
    fn sqe(&self, op: &mut IoOp, done: usize, slot: usize) -> Sqe {
        let fixed = self
            .registered
            .as_ref()
            .is_some_and(|p| op.buf.belongs_to(p));
        let remaining = op.len.saturating_sub(done);
        Sqe {
            kind: op.kind,
            // Only file targets pass submit; -1 would make the kernel answer EBADF.
            fd: op.target.file().map_or(-1, |f| f.as_raw_fd()),
            // SAFETY: done < op.len <= buf.len() (checked at submit; `done` grows only while
            // below `len`), so the pointer stays inside the buffer.
            addr: unsafe { op.buf.as_mut_ptr().add(done) },
            len: u32::try_from(remaining).unwrap_or(u32::MAX),
            offset: op.offset + done as u64,
            buf_index: fixed.then(|| op.buf.index()),
            user_data: slot as u64,
        }
    }

    /// Pushes `sqe`, submitting queued entries first if the queue is full.
    ///
    /// # Safety
    /// As [`Ring::push`]: the operation `sqe` describes must be kept in `self.slots` (or
    /// leaked) until its completion is popped.
    unsafe fn push(&mut self, sqe: &Sqe) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        if !unsafe { self.ring.push(sqe) } {
            // The queue holds at least `depth` entries and at most `depth` operations are in
            // flight, so it can only be full of unsubmitted entries: submit them and retry.
            self.ring.submit_and_wait(0)?;
            self.unsubmitted = 0;
            // SAFETY: forwarded from the caller.
            if !unsafe { self.ring.push(sqe) } {
                return Err(io::Error::other("io_uring submission queue stays full"));
            }
        }
        self.unsubmitted += 1;
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) -> io::Result<usize> {
        let mut finished = 0;
        while let Some((user, res)) = self.ring.pop() {
            let slot = usize::try_from(user).unwrap_or(usize::MAX);
            let Some(entry) = self.slots.get_mut(slot) else {
                log::error!("io_uring completion for unknown user_data {user}");
                continue;
            };
            let Some(mut f) = entry.take() else {
                log::error!("io_uring completion for idle slot {slot}");
                continue;
            };
            let result = if res < 0 {
                let errno = -res;
                if matches!(Errno::from_raw(errno), Errno::EAGAIN | Errno::EINTR) {
                    None
                } else {
                    Some(Err(io::Error::from_raw_os_error(errno)))
                }
            } else {
                let n = res as usize;
                f.done += n;
                if f.done >= f.op.len || (n == 0 && f.op.kind == OpKind::Read) {
                    // Complete, or a read that reached the end of the file.
                    Some(Ok(f.done))
                } else if n == 0 {
                    Some(Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "write made no progress",
                    )))
                } else {
                    None
                }
            };
            match result {
                Some(result) => {
                    self.in_flight -= 1;
                    self.free_slots.push(slot);
                    out.push(Completion { op: f.op, result });
                    finished += 1;
                }
                None => {
                    // Short transfer or EAGAIN: resubmit the rest.
                    let sqe = self.sqe(&mut f.op, f.done, slot);
                    self.slots[slot] = Some(f);
                    // SAFETY: the operation stays in `self.slots[slot]` until this user_data
                    // completes (or is leaked by Drop if the ring fails).
                    unsafe { self.push(&sqe)? };
                }
            }
        }
        Ok(finished)
    }
}

impl<R: Ring> BlockEngine for RingEngine<R> {
    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }

    fn direct(&self) -> bool {
        true
    }

    fn registered(&self) -> bool {
        self.registered.is_some()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn submit(&mut self, op: IoOp) -> Result<(), SubmitError> {
        if op.len > op.buf.len() || op.len == 0 {
            return Err(SubmitError {
                error: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("length {} outside 1..={}", op.len, op.buf.len()),
                ),
                op: Box::new(op),
            });
        }
        if op.target.file().is_none() {
            return Err(SubmitError {
                error: wrong_target(op.kind.name(), "io_uring", &op.target),
                op: Box::new(op),
            });
        }
        let Some(slot) = self.free_slots.pop().filter(|&s| s < self.slots.len()) else {
            return Err(SubmitError {
                error: io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} operations already in flight", self.depth),
                ),
                op: Box::new(op),
            });
        };
        let mut op = op;
        let sqe = self.sqe(&mut op, 0, slot);
        // Store first: from the push on, the kernel may use the buffer, so the operation must
        // already live where only a completion (or Drop's leak) removes it. Moving the IoOp
        // does not move the buffer memory it points to.
        self.slots[slot] = Some(InFlight { op, done: 0 });
        self.in_flight += 1;
        // SAFETY: the operation is stored in `self.slots[slot]` until its completion.
        if let Err(error) = unsafe { self.push(&sqe) } {
            // Not queued: nothing can reference the buffer, take the operation back.
            self.in_flight -= 1;
            self.free_slots.push(slot);
            if let Some(f) = self.slots[slot].take() {
                return Err(SubmitError {
                    op: Box::new(f.op),
                    error,
                });
            }
        }
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<usize> {
        let want = min.min(self.in_flight);
        let mut got = self.reap(out)?;
        while got < want || self.unsubmitted > 0 {
            let need = want.saturating_sub(got);
            match self.ring.submit_and_wait(need) {
                Ok(_) => self.unsubmitted = 0,
                Err(e) if e.raw_os_error() == Some(Errno::EINTR as i32) => {}
                Err(e) => return Err(e),
            }
            got += self.reap(out)?;
        }
        Ok(got)
    }

    fn flush(&mut self, target: &IoTarget) -> io::Result<()> {
        flush_file("io_uring", target)
    }
}

impl<R: Ring> Drop for RingEngine<R> {
    fn drop(&mut self) {
        let mut out = Vec::new();
        while self.in_flight > 0 {
            if let Err(e) = self.wait(1, &mut out) {
                // The kernel may still write these buffers: never free or reuse them.
                let leaked: Vec<IoOp> = self
                    .slots
                    .iter_mut()
                    .filter_map(Option::take)
                    .map(|f| f.op)
                    .collect();
                log::error!(
                    "io_uring engine dropped with {} operations in flight and the ring failed \
                     ({e}); leaking their buffers so they are never reused",
                    leaked.len()
                );
                std::mem::forget(leaked);
                // The registered pool must outlive any access as well.
                std::mem::forget(self.registered.take());
                break;
            }
            out.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockio::OpKind;
    use crate::pinned::{HugePages, Locking, PinnedOptions};
    use std::collections::VecDeque;
    use std::fs::File;
    use std::ptr::NonNull;
    use std::sync::Mutex;

    const MEM: PinnedOptions = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };

    /// A simulated kernel: a byte array for a disk, a submission queue, and completions that
    /// can come short, out of order, late, as EAGAIN or as errors.
    #[derive(Default)]
    struct Behaviour {
        /// The first transfer of every operation moves half the bytes (rounded to 4 KiB).
        short_first: bool,
        /// The first attempt of every operation completes with EAGAIN.
        eagain_first: bool,
        /// Operations at this offset fail with EIO.
        fail_offset: Option<u64>,
        /// Completions are delivered newest first.
        reverse: bool,
        /// Completions are held back for this many submit_and_wait calls.
        delay_calls: usize,
        /// submit_and_wait fails (a broken ring).
        broken: bool,
        /// register_buffers fails.
        refuse_registration: bool,
        /// Queue entries.
        capacity: usize,
    }

    struct FakeRing {
        b: Behaviour,
        disk: Arc<Mutex<Vec<u8>>>,
        queued: Vec<Sqe>,
        held: VecDeque<(u64, i32, usize)>,
        ready: VecDeque<(u64, i32)>,
        seen: std::collections::HashSet<u64>,
        registered: Arc<Mutex<Vec<(usize, usize)>>>,
        fixed_ops: Arc<Mutex<usize>>,
        calls: usize,
    }

    // SAFETY: the fake's raw pointers (inside queued Sqes) point into buffers owned by the
    // engine that owns the fake; they are only dereferenced on the engine's thread.
    unsafe impl Send for FakeRing {}

    impl FakeRing {
        fn new(b: Behaviour, disk: Arc<Mutex<Vec<u8>>>) -> FakeRing {
            FakeRing {
                b,
                disk,
                queued: Vec::new(),
                held: VecDeque::new(),
                ready: VecDeque::new(),
                seen: Default::default(),
                registered: Default::default(),
                fixed_ops: Default::default(),
                calls: 0,
            }
        }

        fn execute(&mut self, sqe: Sqe) -> i32 {
            let first = self.seen.insert(sqe.user_data);
            if self.b.eagain_first && first {
                return -(Errno::EAGAIN as i32);
            }
            if Some(sqe.offset) == self.b.fail_offset {
                return -(Errno::EIO as i32);
            }
            if sqe.buf_index.is_some() {
                *self.fixed_ops.lock().unwrap() += 1;
            }
            let mut len = sqe.len as usize;
            if self.b.short_first && first && len > 4096 {
                len = (len / 2).next_multiple_of(4096).min(len - 4096).max(4096);
            }
            let mut disk = self.disk.lock().unwrap();
            let off = sqe.offset as usize;
            match sqe.kind {
                OpKind::Write => {
                    if disk.len() < off + len {
                        disk.resize(off + len, 0);
                    }
                    // SAFETY: push's contract: addr..addr+len is a live buffer until completion.
                    let src = unsafe { std::slice::from_raw_parts(sqe.addr, len) };
                    disk[off..off + len].copy_from_slice(src);
                }
                OpKind::Read => {
                    let avail = disk.len().saturating_sub(off).min(len);
                    // SAFETY: as above, and the engine does not touch the buffer meanwhile.
                    let dst = unsafe { std::slice::from_raw_parts_mut(sqe.addr, avail) };
                    dst.copy_from_slice(&disk[off..off + avail]);
                    len = avail;
                }
            }
            len as i32
        }
    }

    impl Ring for FakeRing {
        unsafe fn register_buffers(&mut self, ranges: &[(NonNull<u8>, usize)]) -> io::Result<()> {
            if self.b.refuse_registration {
                return Err(Errno::ENOMEM.into());
            }
            *self.registered.lock().unwrap() = ranges
                .iter()
                .map(|(p, l)| (p.as_ptr() as usize, *l))
                .collect();
            Ok(())
        }

        unsafe fn push(&mut self, sqe: &Sqe) -> bool {
            if self.queued.len() >= self.b.capacity.max(1) {
                return false;
            }
            if let Some(i) = sqe.buf_index {
                let regs = self.registered.lock().unwrap();
                let (base, len) = regs[i as usize];
                let a = sqe.addr as usize;
                assert!(
                    a >= base && a + sqe.len as usize <= base + len,
                    "fixed buffer range"
                );
            }
            self.queued.push(*sqe);
            true
        }

        fn submit_and_wait(&mut self, want: usize) -> io::Result<usize> {
            if self.b.broken {
                return Err(Errno::EBADF.into());
            }
            self.calls += 1;
            let n = self.queued.len();
            for sqe in std::mem::take(&mut self.queued) {
                let res = self.execute(sqe);
                self.held
                    .push_back((sqe.user_data, res, self.calls + self.b.delay_calls));
            }
            let calls = self.calls;
            let mut now: Vec<(u64, i32)> = Vec::new();
            self.held.retain(|&(u, r, at)| {
                if at <= calls {
                    now.push((u, r));
                    false
                } else {
                    true
                }
            });
            if self.b.reverse {
                now.reverse();
            }
            self.ready.extend(now);
            let _ = want;
            Ok(n)
        }

        fn pop(&mut self) -> Option<(u64, i32)> {
            self.ready.pop_front()
        }
    }

    fn engine(b: Behaviour, pool: &BufferPool) -> (RingEngine<FakeRing>, Arc<Mutex<Vec<u8>>>) {
        let disk = Arc::new(Mutex::new(Vec::new()));
        let ring = FakeRing::new(b, Arc::clone(&disk));
        (RingEngine::with_ring(ring, 4, Some(pool)), disk)
    }

    fn file() -> Arc<File> {
        Arc::new(File::open("/dev/null").unwrap())
    }

    fn write_op(pool: &BufferPool, offset: u64, len: usize, fill: u8, tag: u64) -> IoOp {
        let mut buf = pool.try_get().unwrap();
        buf.as_mut_slice().fill(fill);
        IoOp {
            kind: OpKind::Write,
            target: file().into(),
            offset,
            len,
            buf,
            tag,
        }
    }

    #[test]
    fn a_namespace_target_is_refused_with_the_operation_returned() {
        let pool = BufferPool::new(4, 16384, MEM).unwrap();
        let (mut e, _disk) = engine(Behaviour::default(), &pool);
        let mut op = write_op(&pool, 0, 4096, 1, 9);
        op.target = IoTarget::Namespace(crate::blockio::NamespaceTarget {
            nsid: 1,
            block_bytes: 512,
            blocks: 8,
        });
        let refused = e.submit(op).unwrap_err();
        assert_eq!(refused.op.tag, 9);
        assert_eq!(e.in_flight(), 0);
        assert!(
            refused.error.to_string().contains("io_uring"),
            "{}",
            refused.error
        );
        assert!(e.flush(&refused.op.target).is_err());
    }

    fn run_all(b: Behaviour) -> Vec<u8> {
        let pool = BufferPool::new(4, 16384, MEM).unwrap();
        let (mut e, disk) = engine(b, &pool);
        for i in 0..4u64 {
            e.submit(write_op(&pool, i * 16384, 16384, i as u8 + 1, i))
                .unwrap();
        }
        assert_eq!(e.in_flight(), 4);
        // Full: a fifth submission is refused and handed back.
        let extra = BufferPool::new(1, 4096, MEM).unwrap();
        let err = e.submit(write_op(&extra, 0, 4096, 9, 99)).unwrap_err();
        assert_eq!(err.op.tag, 99);
        let mut out = Vec::new();
        while out.len() < 4 {
            e.wait(1, &mut out).unwrap();
        }
        assert_eq!(e.in_flight(), 0);
        let mut tags: Vec<u64> = out.iter().map(|c| c.op.tag).collect();
        tags.sort_unstable();
        assert_eq!(tags, [0, 1, 2, 3]);
        for c in &out {
            assert_eq!(*c.result.as_ref().unwrap(), 16384);
        }
        drop(out);
        assert_eq!(pool.available(), 4, "every buffer came back");
        disk.lock().unwrap().clone()
    }

    #[test]
    fn writes_complete_with_buffers_returned_in_any_order() {
        let expect: Vec<u8> = (0..4u8).flat_map(|i| vec![i + 1; 16384]).collect();
        let plain = run_all(Behaviour {
            capacity: 8,
            ..Default::default()
        });
        assert_eq!(plain, expect);
        let odd = run_all(Behaviour {
            capacity: 2,
            reverse: true,
            short_first: true,
            eagain_first: true,
            delay_calls: 2,
            ..Default::default()
        });
        assert_eq!(odd, expect);
    }

    #[test]
    fn fixed_buffers_are_used_when_registered_and_not_otherwise() {
        for refuse in [false, true] {
            let pool = BufferPool::new(4, 8192, MEM).unwrap();
            let disk = Arc::new(Mutex::new(Vec::new()));
            let ring = FakeRing::new(
                Behaviour {
                    capacity: 8,
                    refuse_registration: refuse,
                    ..Default::default()
                },
                Arc::clone(&disk),
            );
            let fixed = Arc::clone(&ring.fixed_ops);
            let mut e = RingEngine::with_ring(ring, 4, Some(&pool));
            assert_eq!(e.registered(), !refuse);
            e.submit(write_op(&pool, 0, 8192, 5, 0)).unwrap();
            // A buffer of another pool is never sent as a fixed buffer.
            let other = BufferPool::new(1, 8192, MEM).unwrap();
            e.submit(write_op(&other, 8192, 8192, 6, 1)).unwrap();
            let mut out = Vec::new();
            while out.len() < 2 {
                e.wait(2, &mut out).unwrap();
            }
            assert_eq!(*fixed.lock().unwrap(), usize::from(!refuse));
        }
    }

    #[test]
    fn errors_and_end_of_file_are_reported_with_the_buffer() {
        let pool = BufferPool::new(4, 8192, MEM).unwrap();
        let (mut e, disk) = engine(
            Behaviour {
                capacity: 8,
                fail_offset: Some(1 << 20),
                ..Default::default()
            },
            &pool,
        );
        disk.lock().unwrap().resize(12288, 3);
        e.submit(write_op(&pool, 1 << 20, 4096, 1, 7)).unwrap();
        let mut read = write_op(&pool, 8192, 8192, 0, 8);
        read.kind = OpKind::Read;
        e.submit(read).unwrap();
        let mut out = Vec::new();
        while out.len() < 2 {
            e.wait(2, &mut out).unwrap();
        }
        for c in &out {
            match c.op.tag {
                7 => assert_eq!(
                    c.result.as_ref().unwrap_err().raw_os_error(),
                    Some(Errno::EIO as i32)
                ),
                8 => {
                    // Only 4096 bytes exist past offset 8192: a short read at end of file.
                    assert_eq!(*c.result.as_ref().unwrap(), 4096);
                    assert!(c.op.buf.as_slice()[..4096].iter().all(|&b| b == 3));
                }
                t => panic!("unexpected tag {t}"),
            }
        }
        // Malformed operations are refused before anything is queued.
        let too_long = write_op(&pool, 0, 8193, 0, 9);
        assert_eq!(e.submit(too_long).unwrap_err().op.tag, 9);
    }

    #[test]
    fn drop_waits_for_operations_in_flight() {
        let pool = BufferPool::new(4, 8192, MEM).unwrap();
        let (mut e, disk) = engine(
            Behaviour {
                capacity: 8,
                delay_calls: 3,
                ..Default::default()
            },
            &pool,
        );
        e.submit(write_op(&pool, 0, 8192, 4, 0)).unwrap();
        drop(e);
        assert_eq!(pool.available(), 4);
        assert_eq!(disk.lock().unwrap().len(), 8192);
    }

    #[test]
    fn drop_with_a_broken_ring_leaks_the_buffers() {
        let pool = BufferPool::new(4, 8192, MEM).unwrap();
        let (mut e, _disk) = engine(
            Behaviour {
                capacity: 8,
                broken: true,
                ..Default::default()
            },
            &pool,
        );
        e.submit(write_op(&pool, 0, 8192, 4, 0)).unwrap();
        drop(e);
        // The in-flight buffer is never returned: the kernel might still write it.
        assert_eq!(pool.available(), 3);
    }

    #[test]
    fn real_ring_roundtrip_with_direct_io() {
        use crate::blockio::{OpenMode, open_file};
        let Ok(ring) = LinuxRing::new(8) else {
            eprintln!("io_uring unavailable; skipping");
            return;
        };
        let dir = std::env::temp_dir();
        let path = dir.join(format!("kvstack-uring-test-{}", std::process::id()));
        let direct = crate::probe::probe_o_direct(&dir).available;
        let f = Arc::new(
            open_file(
                &path,
                OpenMode {
                    write: true,
                    create: true,
                    direct,
                },
            )
            .unwrap(),
        );
        let pool = BufferPool::new(4, 65536, MEM).unwrap();
        let mut e = RingEngine::with_ring(ring, 4, Some(&pool));
        for i in 0..4u64 {
            let mut op = write_op(&pool, i * 65536, 65536, i as u8 + 10, i);
            op.target = Arc::clone(&f).into();
            e.submit(op).unwrap();
        }
        let mut out = Vec::new();
        while out.len() < 4 {
            e.wait(1, &mut out).unwrap();
        }
        assert!(out.iter().all(|c| c.result.as_ref().ok() == Some(&65536)));
        out.clear();
        for i in 0..4u64 {
            let mut op = write_op(&pool, i * 65536, 65536, 0, i);
            op.kind = OpKind::Read;
            op.target = Arc::clone(&f).into();
            e.submit(op).unwrap();
        }
        while out.len() < 4 {
            e.wait(4, &mut out).unwrap();
        }
        for c in &out {
            assert!(
                c.op.buf
                    .as_slice()
                    .iter()
                    .all(|&b| b == c.op.tag as u8 + 10)
            );
        }
        drop(out);
        drop(e);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    #[ignore = "measurement in the QEMU rig: KVSTACK_VFIO_RIG_BENCH=1 scripts/vfio-rig"]
    fn bench_uring_block_device() {
        let Ok(path) = std::env::var("KVSTACK_BENCH_BLOCKDEV") else {
            eprintln!("skipped: KVSTACK_BENCH_BLOCKDEV is unset");
            return;
        };
        let mode = crate::blockio::OpenMode {
            write: true,
            create: false,
            direct: true,
        };
        let f = crate::blockio::open_file(std::path::Path::new(&path), mode).unwrap();
        let target = IoTarget::File(std::sync::Arc::new(f));
        crate::blockio::bench::measure(
            |pool| Box::new(UringEngine::new(64, Some(pool)).unwrap()),
            &target,
            "io_uring O_DIRECT",
        );
    }
}
