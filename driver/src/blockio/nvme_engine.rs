//! The userspace NVMe engine: [`BlockEngine`] over the driver's [`Controller`] (docs/nvme.md,
//! "The block engine").
//!
//! Each [`IoOp`] becomes one NVMe Read or Write (NVM command set §6.9 / §6.15) on I/O queue 0
//! of the controller, on the namespace the controller was brought up with; completions are
//! reaped by polling ([`Controller::wait`]); [`BlockEngine::flush`] is the Flush command (§6.8).
//! Offsets and lengths must be whole logical blocks (and whole 4 KiB pages, the driver's PRP
//! rule) inside the namespace: anything else is refused at submission with
//! [`crate::Error::BlockTarget`], before the device sees it.
//!
//! # Buffers: a bounce region, not zero copy
//!
//! The device never sees an [`IoBuf`](super::IoBuf). The engine maps one DMA region of `depth` slots of
//! `max_bytes` each when it is built; a write copies the buffer into its slot before the doorbell,
//! a read copies the slot into the buffer after the completion is reaped (volatile copies through
//! [`crate::pinned::VolatileView`]). So the DMA contract holds trivially: the `IoBuf` stays
//! owned by the engine until its completion (as with the file engines), but no memory a Rust
//! slice can reach is ever device-visible. The cost is one memory copy per operation (measured
//! in docs/nvme.md) and `depth × max_bytes` of pinned, mapped memory. Zero copy needs a [`super::BufferPool`]
//! whose region is mapped through [`crate::nvme::Dma`] itself (a `Dma` method mapping
//! caller-owned pinned memory); not done.
//!
//! A slot whose command the controller could not stop (the controller ignored CC.EN after a
//! timeout; the driver then leaks the command's memory) is never handed out again: the device
//! might still write it.

use std::collections::VecDeque;
use std::io;

use super::{BlockEngine, Completion, EngineKind, IoOp, IoTarget, NamespaceTarget, OpKind};
use super::{SubmitError, buffer::BUFFER_ALIGN};
use crate::Error;
use crate::nvme::{
    Controller, Dma, DmaRegion, DmaSlice, IoCompletion, IoKind, IoRequest, Registers,
};

/// The tag of the engine's own Flush commands (operation tags are slot indices).
const FLUSH_TAG: u64 = u64::MAX;

const ENGINE: &str = "NVMe";

/// [`BlockEngine`] over a userspace NVMe controller (module docs).
pub struct NvmeEngine<R: Registers, D: Dma> {
    target: NamespaceTarget,
    depth: usize,
    max_bytes: usize,
    /// `depth` slots of `max_bytes`; slot `i` starts at `i * max_bytes`.
    bounce: Option<DmaRegion>,
    /// The operation using each slot, until its completion is reaped.
    slots: Vec<Option<IoOp>>,
    free: Vec<usize>,
    /// Slots the device may still write (their command was leaked by the driver).
    poisoned: usize,
    /// Completions reaped and not yet returned (a flush reaps what finishes before it).
    done: VecDeque<Completion>,
    scratch: Vec<IoCompletion>,
    /// Declared last: dropped after the engine has waited for its operations.
    ctrl: Controller<R, D>,
}

impl<R: Registers, D: Dma> std::fmt::Debug for NvmeEngine<R, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeEngine")
            .field("target", &self.target)
            .field("depth", &self.depth)
            .field("max_bytes", &self.max_bytes)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

fn io_error(e: Error) -> io::Error {
    let kind = match &e {
        Error::NvmeQueueFull { .. } => io::ErrorKind::WouldBlock,
        Error::NvmeRequest { .. } | Error::BlockTarget { .. } => io::ErrorKind::InvalidInput,
        Error::NvmeTimeout { .. } => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

fn refused(op: &'static str, reason: String) -> io::Error {
    io_error(Error::BlockTarget {
        op,
        engine: ENGINE,
        reason,
    })
}

impl<R: Registers, D: Dma> NvmeEngine<R, D> {
    /// An engine over `ctrl` (brought up, its namespace identified) with at most `depth`
    /// operations in flight (capped by I/O queue 0's capacity) of at most `max_bytes` each
    /// (rounded up to 4 KiB, capped by the controller's transfer limit). Maps the bounce region
    /// (`depth × max_bytes`).
    ///
    /// # Errors
    /// [`Error::NvmeFailed`] for a controller without a namespace or I/O queue,
    /// [`Error::ZeroSizedRegion`] for `max_bytes` 0, and the DMA allocation's error.
    pub fn new(
        mut ctrl: Controller<R, D>,
        depth: usize,
        max_bytes: usize,
    ) -> Result<NvmeEngine<R, D>, Error> {
        let ns = *ctrl.namespace().ok_or(Error::NvmeFailed {
            reason: "no namespace identified".into(),
        })?;
        let capacity = ctrl.io_queue_capacity(0);
        if capacity == 0 {
            return Err(Error::NvmeFailed {
                reason: "no I/O queue".into(),
            });
        }
        if max_bytes == 0 {
            return Err(Error::ZeroSizedRegion);
        }
        let depth = depth.clamp(1, capacity);
        let max_bytes = max_bytes
            .checked_next_multiple_of(BUFFER_ALIGN)
            .unwrap_or(usize::MAX)
            .min(ctrl.max_transfer());
        let bytes = depth
            .checked_mul(max_bytes)
            .ok_or(Error::RegionTooLarge { bytes: usize::MAX })?;
        let bounce = ctrl.alloc(bytes)?;
        let target = NamespaceTarget {
            nsid: ctrl.namespace_id(),
            block_bytes: ns.block_bytes(),
            blocks: ns.size_blocks,
        };
        log::info!(
            "NVMe block engine: namespace {} ({} blocks of {} bytes), depth {depth}, up to \
             {max_bytes} bytes per operation through a {bytes}-byte bounce region",
            target.nsid,
            target.blocks,
            target.block_bytes
        );
        Ok(NvmeEngine {
            target,
            depth,
            max_bytes,
            bounce: Some(bounce),
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            poisoned: 0,
            done: VecDeque::new(),
            scratch: Vec::new(),
            ctrl,
        })
    }

    /// The namespace, as operations must name it.
    pub fn target(&self) -> IoTarget {
        IoTarget::Namespace(self.target)
    }

    /// Largest operation in bytes.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The controller (statistics, identity).
    pub fn controller(&self) -> &Controller<R, D> {
        &self.ctrl
    }

    /// Why `target` is not this engine's namespace, if it is not.
    fn check_target(&self, op: &'static str, target: &IoTarget) -> Result<(), io::Error> {
        match target {
            IoTarget::Namespace(ns) if *ns == self.target => Ok(()),
            other => Err(refused(
                op,
                format!(
                    "it drives NVMe namespace {} only, not {}",
                    self.target.nsid,
                    other.describe()
                ),
            )),
        }
    }

    /// Checks `op` against the namespace and the engine's limits; returns its first LBA.
    fn check(&self, op: &IoOp) -> Result<u64, io::Error> {
        let name = op.kind.name();
        self.check_target(name, &op.target)?;
        let block = self.target.block_bytes;
        let len = op.len as u64;
        if op.len == 0 || op.len > op.buf.len() {
            return Err(refused(
                name,
                format!("length {} outside 1..={}", op.len, op.buf.len()),
            ));
        }
        if !op.offset.is_multiple_of(block) || !len.is_multiple_of(block) {
            return Err(refused(
                name,
                format!(
                    "offset {} and length {} are not whole logical blocks of {block} bytes",
                    op.offset, op.len
                ),
            ));
        }
        if !op.len.is_multiple_of(BUFFER_ALIGN) {
            return Err(refused(
                name,
                format!("length {} is not whole {BUFFER_ALIGN}-byte pages", op.len),
            ));
        }
        if op.len > self.max_bytes {
            return Err(refused(
                name,
                format!(
                    "length {} exceeds {} bytes per operation",
                    op.len, self.max_bytes
                ),
            ));
        }
        let capacity = self.target.capacity();
        if op.offset.checked_add(len).is_none_or(|end| end > capacity) {
            return Err(refused(
                name,
                format!(
                    "bytes {}+{} reach past the namespace's {capacity} bytes",
                    op.offset, op.len
                ),
            ));
        }
        Ok(op.offset / block)
    }

    /// Turns the controller's completions into [`Completion`]s on `self.done`; returns the
    /// result of an engine Flush among them, if any.
    fn absorb(&mut self) -> Option<Result<(), Error>> {
        let mut flush = None;
        for c in std::mem::take(&mut self.scratch) {
            if c.tag == FLUSH_TAG {
                flush = Some(c.result);
                continue;
            }
            let Some(slot) = usize::try_from(c.tag)
                .ok()
                .filter(|&s| s < self.slots.len())
            else {
                log::error!("NVMe engine: a completion with unknown tag {}", c.tag);
                continue;
            };
            let Some(mut op) = self.slots.get_mut(slot).and_then(Option::take) else {
                log::error!("NVMe engine: a completion for idle slot {slot}");
                continue;
            };
            if c.buf.is_some() {
                self.free.push(slot);
            } else {
                // The driver kept the command's memory for a device that may still write it.
                self.poisoned += 1;
            }
            let result = match c.result {
                Ok(()) if op.kind == OpKind::Read => self.copy_out(slot, &mut op).map(|()| op.len),
                Ok(()) => Ok(op.len),
                Err(e) => Err(io_error(e)),
            };
            self.done.push_back(Completion { op, result });
        }
        flush
    }

    /// Copies a finished read from its bounce slot into the operation's buffer.
    fn copy_out(&self, slot: usize, op: &mut IoOp) -> io::Result<()> {
        let region = self
            .bounce
            .as_ref()
            .ok_or_else(|| io::Error::other("no bounce region"))?;
        let dst = op.buf.as_mut_slice().get_mut(..op.len).unwrap_or_default();
        region
            .volatile()
            .read(slot * self.max_bytes, dst)
            .map_err(io_error)
    }

    /// Polls the controller for at least `min` completions (capped at its commands in flight).
    fn reap(&mut self, min: usize) -> io::Result<Option<Result<(), Error>>> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let r = self.ctrl.wait(min, &mut scratch);
        self.scratch = scratch;
        let flush = self.absorb();
        r.map_err(io_error)?;
        Ok(flush)
    }
}

impl<R: Registers, D: Dma> BlockEngine for NvmeEngine<R, D> {
    fn kind(&self) -> EngineKind {
        EngineKind::Nvme
    }

    fn direct(&self) -> bool {
        true
    }

    fn registered(&self) -> bool {
        false
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count() + self.done.len()
    }

    fn submit(&mut self, op: IoOp) -> Result<(), SubmitError> {
        let lba = match self.check(&op) {
            Ok(lba) => lba,
            Err(error) => {
                return Err(SubmitError {
                    op: Box::new(op),
                    error,
                });
            }
        };
        let busy = || {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} operations already in flight", self.depth),
            )
        };
        if self.in_flight() >= self.depth || !self.ctrl.has_room(0) {
            return Err(SubmitError {
                error: busy(),
                op: Box::new(op),
            });
        }
        let (Some(slot), Some(region)) = (self.free.pop(), self.bounce.clone()) else {
            return Err(SubmitError {
                error: busy(),
                op: Box::new(op),
            });
        };
        let offset = slot * self.max_bytes;
        if op.kind == OpKind::Write {
            let src = op.buf.as_slice().get(..op.len).unwrap_or_default();
            if let Err(e) = region.volatile().write(offset, src) {
                self.free.push(slot);
                return Err(SubmitError {
                    error: io_error(e),
                    op: Box::new(op),
                });
            }
        }
        let req = IoRequest {
            kind: match op.kind {
                OpKind::Read => IoKind::Read,
                OpKind::Write => IoKind::Write,
            },
            lba,
            buf: Some(DmaSlice {
                region,
                offset,
                len: op.len,
            }),
            tag: slot as u64,
        };
        match self.ctrl.submit(0, req) {
            Ok(()) => {
                if let Some(s) = self.slots.get_mut(slot) {
                    *s = Some(op);
                }
                Ok(())
            }
            Err(e) => {
                self.free.push(slot);
                Err(SubmitError {
                    error: io_error(e),
                    op: Box::new(op),
                })
            }
        }
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<usize> {
        let want = min.min(self.in_flight());
        let mut got = 0;
        loop {
            got += self.done.len();
            out.extend(self.done.drain(..));
            if got >= want || self.ctrl.in_flight() == 0 {
                break;
            }
            self.reap(want - got)?;
        }
        Ok(got)
    }

    fn flush(&mut self, target: &IoTarget) -> io::Result<()> {
        self.check_target("flush", target)?;
        // Room for the Flush on queue 0: reap operations until a slot frees up.
        while !self.ctrl.has_room(0) && self.ctrl.in_flight() > 0 {
            self.reap(1)?;
        }
        let req = IoRequest {
            kind: IoKind::Flush,
            lba: 0,
            buf: None,
            tag: FLUSH_TAG,
        };
        self.ctrl.submit(0, req).map_err(io_error)?;
        loop {
            if let Some(result) = self.reap(1)? {
                return result.map_err(io_error);
            }
            if self.ctrl.in_flight() == 0 {
                // The controller's completions are all reaped: the Flush was lost to a failure
                // that completed nothing for it.
                return Err(io_error(Error::NvmeFailed {
                    reason: "the flush vanished".into(),
                }));
            }
        }
    }
}

impl<R: Registers, D: Dma> Drop for NvmeEngine<R, D> {
    fn drop(&mut self) {
        // Wait for every command (the controller's deadlines bound it); the operations and
        // their buffers are then dropped. Buffers were never device-visible, so even a failed
        // wait frees nothing the device can reach; the bounce region is handled below.
        while self.ctrl.in_flight() > 0 {
            if let Err(e) = self.reap(self.ctrl.in_flight()) {
                log::error!("NVMe engine dropped while its controller failed: {e}");
                break;
            }
        }
        let left = self.in_flight();
        if left > 0 {
            log::warn!("NVMe engine dropped with {left} operations not reaped");
        }
        if let Some(region) = self.bounce.take() {
            if self.poisoned == 0 && self.ctrl.in_flight() == 0 {
                if let Err(e) = self.ctrl.free(region) {
                    log::error!("NVMe engine: bounce region not unmapped: {e}");
                }
            } else {
                // The device may still write it: never unmapped.
                std::mem::forget(region);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockio::BufferPool;
    use crate::nvme::ControllerOptions;
    use crate::nvme::Status;
    use crate::nvme::fake::{Fake, FakeBar, FakeDma, Inject};
    use crate::pinned::{HugePages, Locking, PinnedOptions};
    use kvstack_firmware_interface::nvme::{StatusCodeType, nvm_opcode};
    use std::time::Duration;

    const MEM: PinnedOptions = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };
    const PAGE: usize = 4096;

    type Engine = NvmeEngine<FakeBar, FakeDma>;

    /// An engine over a fake of 256 blocks of 4 KiB with I/O queues of `entries` entries.
    fn engine(fake: &Fake, entries: u16, depth: usize) -> Engine {
        let opts = ControllerOptions {
            io_queues: 1,
            io_queue_entries: entries,
            admin_queue_entries: 8,
            command_timeout: Duration::from_millis(100),
            ..Default::default()
        };
        let ctrl = Controller::new(fake.bar(), fake.dma(), opts).unwrap();
        NvmeEngine::new(ctrl, depth, 4 * PAGE).unwrap()
    }

    fn op(e: &Engine, pool: &BufferPool, kind: OpKind, offset: u64, len: usize, fill: u8) -> IoOp {
        let mut buf = pool.try_get().unwrap();
        buf.as_mut_slice().fill(fill);
        IoOp {
            kind,
            target: e.target(),
            offset,
            len,
            buf,
            tag: offset,
        }
    }

    fn reap_all(e: &mut dyn BlockEngine) -> Vec<Completion> {
        let mut out = Vec::new();
        let n = e.in_flight();
        e.wait(n, &mut out).unwrap();
        assert_eq!(out.len(), n);
        out
    }

    #[test]
    fn writes_and_reads_round_trip_through_the_block_engine_trait() {
        let fake = Fake::new(256, 64);
        let pool = BufferPool::new(8, 4 * PAGE, MEM).unwrap();
        let mut ne = engine(&fake, 16, 8);
        let mut ops = Vec::new();
        for i in 0..4u64 {
            ops.push(op(&ne, &pool, OpKind::Write, i * 16384, 16384, i as u8 + 1));
        }
        let e: &mut dyn BlockEngine = &mut ne;
        assert_eq!(e.kind(), EngineKind::Nvme);
        for o in ops {
            e.submit(o).unwrap();
        }
        let done = reap_all(e);
        assert!(done.iter().all(|c| c.result.as_ref().ok() == Some(&16384)));
        drop(done);
        // The data is on the device, block by block.
        {
            let s = fake.state();
            for i in 0..4usize {
                assert!(
                    s.disk[i * 16384..(i + 1) * 16384]
                        .iter()
                        .all(|&b| b == i as u8 + 1)
                );
            }
        }
        // Read back in another order into garbage-filled buffers.
        let mut ops = Vec::new();
        for i in [3u64, 1, 0, 2] {
            ops.push(op(&ne, &pool, OpKind::Read, i * 16384, 16384, 0xEE));
        }
        let e: &mut dyn BlockEngine = &mut ne;
        for o in ops {
            e.submit(o).unwrap();
        }
        for c in reap_all(e) {
            let fill = (c.op.offset / 16384) as u8 + 1;
            assert_eq!(*c.result.as_ref().unwrap(), 16384);
            assert!(
                c.op.buf.as_slice().iter().all(|&b| b == fill),
                "op {}",
                c.op.tag
            );
        }
        assert_eq!(pool.available(), 8);
        // One command per operation.
        let s = fake.state();
        let rw = s.log.iter().filter(|&&(q, _)| q == 1).count();
        assert_eq!(rw, 8);
    }

    #[test]
    fn byte_offsets_become_lbas_of_the_namespace_block_size() {
        // 512-byte logical blocks: 2,048 of them in the fake's 1 MiB.
        let fake = Fake::new(256, 64);
        fake.state().block_shift = 9;
        let pool = BufferPool::new(2, PAGE, MEM).unwrap();
        let mut e = engine(&fake, 16, 2);
        assert_eq!(
            e.target,
            NamespaceTarget {
                nsid: 1,
                block_bytes: 512,
                blocks: 2048
            }
        );
        // Offset 1,536 is LBA 3: whole blocks, though not a whole page.
        let mut o = op(&e, &pool, OpKind::Write, 1536, PAGE, 0);
        let data: Vec<u8> = (0..PAGE).map(|i| (i / 512) as u8 + 1).collect();
        o.buf.as_mut_slice().copy_from_slice(&data);
        e.submit(o).unwrap();
        assert!(reap_all(&mut e)[0].result.is_ok());
        {
            let s = fake.state();
            assert!(s.disk[..1536].iter().all(|&b| b == 0));
            assert_eq!(&s.disk[1536..1536 + PAGE], &data[..]);
            assert!(s.disk[1536 + PAGE..].iter().all(|&b| b == 0));
        }
        // Read from LBA 4: the last seven blocks written, then one never written.
        e.submit(op(&e, &pool, OpKind::Read, 2048, PAGE, 0xEE))
            .unwrap();
        let c = reap_all(&mut e).pop().unwrap();
        assert_eq!(&c.op.buf.as_slice()[..PAGE - 512], &data[512..]);
        assert!(c.op.buf.as_slice()[PAGE - 512..].iter().all(|&b| b == 0));
        // Half a block is refused.
        let r = e
            .submit(op(&e, &pool, OpKind::Read, 256, PAGE, 0))
            .unwrap_err();
        assert!(
            r.error.to_string().contains("logical blocks of 512"),
            "{}",
            r.error
        );
    }

    #[test]
    fn ranges_that_are_not_whole_blocks_or_outside_the_namespace_are_refused() {
        let fake = Fake::new(256, 64);
        let pool = BufferPool::new(2, 8 * PAGE, MEM).unwrap();
        let mut e = engine(&fake, 16, 4);
        let commands = fake.state().log.len();
        let cases = [
            (512, PAGE, "not whole logical blocks"),
            (0, 1000, "not whole logical blocks"),
            (255 * PAGE as u64, 2 * PAGE, "past the namespace"),
            (0, 8 * PAGE, "exceeds"),
            (0, 0, "outside"),
        ];
        for (offset, len, why) in cases {
            let o = op(&e, &pool, OpKind::Write, offset, len, 1);
            let r = e.submit(o).unwrap_err();
            assert_eq!(r.error.kind(), io::ErrorKind::InvalidInput, "{}", r.error);
            assert!(
                r.error.to_string().contains(why),
                "{offset}+{len}: {}",
                r.error
            );
            assert!(matches!(
                r.error.get_ref().and_then(|e| e.downcast_ref::<Error>()),
                Some(Error::BlockTarget { op: "write", .. })
            ));
        }
        // A file target, and another namespace.
        let mut o = op(&e, &pool, OpKind::Read, 0, PAGE, 0);
        o.target = IoTarget::File(std::sync::Arc::new(
            std::fs::File::open("/dev/null").unwrap(),
        ));
        assert!(
            e.submit(o)
                .unwrap_err()
                .error
                .to_string()
                .contains("not a file")
        );
        let mut other = e.target;
        other.nsid = 2;
        let err = e.flush(&IoTarget::Namespace(other)).unwrap_err();
        assert!(err.to_string().contains("NVMe namespace 2"), "{err}");
        assert_eq!(
            fake.state().log.len(),
            commands,
            "nothing reached the device"
        );
        assert_eq!(e.in_flight(), 0);
    }

    #[test]
    fn depth_is_bounded_by_the_engine_and_the_queue() {
        let fake = Fake::new(256, 64);
        let pool = BufferPool::new(16, PAGE, MEM).unwrap();
        // A queue of 4 entries holds 3 commands: depth 8 is capped to 3.
        let mut e = engine(&fake, 4, 8);
        assert_eq!(e.depth(), 3);
        for i in 0..3u64 {
            e.submit(op(&e, &pool, OpKind::Write, i * 4096, PAGE, 1))
                .unwrap();
        }
        let r = e
            .submit(op(&e, &pool, OpKind::Write, 3 * 4096, PAGE, 1))
            .unwrap_err();
        assert_eq!(r.error.kind(), io::ErrorKind::WouldBlock);
        // Completed but not reaped still counts: the caller has not got the buffers back.
        let mut out = Vec::new();
        assert_eq!(e.wait(1, &mut out).unwrap(), 3);
        e.submit(*r.op).unwrap();
        assert_eq!(e.in_flight(), 1);
        // 12 operations through depth 3, wrapping the 4-entry rings three times.
        let mut total = 0;
        for i in 0..12u64 {
            let mut o = op(&e, &pool, OpKind::Read, (i % 8) * 4096, PAGE, 0);
            loop {
                match e.submit(o) {
                    Ok(()) => break,
                    Err(r) => {
                        assert_eq!(r.error.kind(), io::ErrorKind::WouldBlock);
                        o = *r.op;
                        total += e.wait(1, &mut out).unwrap();
                    }
                }
                assert!(e.in_flight() <= 3);
            }
        }
        total += e.wait(usize::MAX, &mut out).unwrap();
        assert_eq!(total, 13);
        assert!(out.iter().all(|c| c.result.is_ok()));
    }

    #[test]
    fn a_failed_command_reports_its_status_in_its_completion() {
        let fake = Fake::new(256, 64);
        let pool = BufferPool::new(4, PAGE, MEM).unwrap();
        let mut e = engine(&fake, 16, 4);
        fake.state().inject.push_back(Inject::Status(Status::new(
            StatusCodeType::MediaError,
            0x81,
        )));
        e.submit(op(&e, &pool, OpKind::Read, 0, PAGE, 0)).unwrap();
        e.submit(op(&e, &pool, OpKind::Read, 4096, PAGE, 0))
            .unwrap();
        let mut out = reap_all(&mut e);
        out.sort_by_key(|c| c.op.offset);
        let err = out[0].result.as_ref().unwrap_err();
        assert!(err.to_string().contains("Unrecovered Read Error"), "{err}");
        assert!(matches!(
            err.get_ref().and_then(|e| e.downcast_ref::<Error>()),
            Some(Error::NvmeCommand {
                command: "read",
                ..
            })
        ));
        assert_eq!(out[1].result.as_ref().ok(), Some(&PAGE));
        // The engine goes on.
        e.submit(op(&e, &pool, OpKind::Write, 0, PAGE, 5)).unwrap();
        assert!(reap_all(&mut e)[0].result.is_ok());
    }

    #[test]
    fn flush_sends_the_flush_command_and_keeps_other_completions() {
        let fake = Fake::new(256, 64);
        let pool = BufferPool::new(4, PAGE, MEM).unwrap();
        let mut e = engine(&fake, 16, 4);
        e.submit(op(&e, &pool, OpKind::Write, 0, PAGE, 3)).unwrap();
        let t = e.target();
        e.flush(&t).unwrap();
        assert_eq!(fake.state().flushes, 1);
        let last = fake.state().log.last().copied();
        assert_eq!(last, Some((1, nvm_opcode::FLUSH)));
        // The write completed during the flush is still handed out by wait.
        let out = reap_all(&mut e);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].op.tag, 0);
        // A failed flush is an error.
        fake.state()
            .inject
            .push_back(Inject::Status(Status::new(StatusCodeType::Generic, 0x06)));
        assert!(e.flush(&t).is_err());
    }

    #[test]
    fn drop_with_operations_in_flight_waits_returns_buffers_and_unmaps() {
        let fake = Fake::new(256, 64);
        let pool = BufferPool::new(4, PAGE, MEM).unwrap();
        let mut e = engine(&fake, 16, 4);
        e.submit(op(&e, &pool, OpKind::Write, 0, PAGE, 7)).unwrap();
        // The second command never completes: the controller's deadline ends the wait.
        fake.state().inject.push_back(Inject::Swallow);
        e.submit(op(&e, &pool, OpKind::Write, 4096, PAGE, 8))
            .unwrap();
        e.submit(op(&e, &pool, OpKind::Write, 8192, PAGE, 9))
            .unwrap();
        assert_eq!(e.in_flight(), 3);
        assert_eq!(pool.available(), 1);
        let start = std::time::Instant::now();
        drop(e);
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(pool.available(), 4);
        assert_eq!(fake.mapped(), 0);
        assert!(fake.state().disk[..PAGE].iter().all(|&b| b == 7));
    }

    #[test]
    #[ignore = "measurement: cargo test -p kvstack-driver --lib nvme_engine_per_op_cost -- --ignored --nocapture"]
    fn nvme_engine_per_op_cost() {
        let fake = Fake::new(4096, 1024);
        let opts = ControllerOptions {
            io_queues: 1,
            io_queue_entries: 128,
            admin_queue_entries: 8,
            ..Default::default()
        };
        let ctrl = Controller::new(fake.bar(), fake.dma(), opts).unwrap();
        let mut e = NvmeEngine::new(ctrl, 64, 128 << 10).unwrap();
        let pool = BufferPool::new(64, 128 << 10, MEM).unwrap();
        println!("| transfer | depth | operations | us per operation | MB/s |");
        for (bytes, depth) in [(4096usize, 1usize), (4096, 16), (4096, 64), (128 << 10, 16)] {
            let n = 20_000usize.min((256 << 20) / bytes);
            let mut out = Vec::new();
            let start = std::time::Instant::now();
            let (mut sent, mut done) = (0usize, 0usize);
            while done < n {
                while sent < n && e.in_flight() < depth {
                    let lba = ((sent * bytes / PAGE) % (4096 - bytes / PAGE)) as u64;
                    e.submit(IoOp {
                        kind: OpKind::Read,
                        target: e.target(),
                        offset: lba * PAGE as u64,
                        len: bytes,
                        buf: pool.try_get().unwrap(),
                        tag: sent as u64,
                    })
                    .unwrap();
                    sent += 1;
                }
                done += e.wait(1, &mut out).unwrap();
                assert!(out.iter().all(|c| c.result.is_ok()));
                // Buffers back to the pool before the next submissions.
                out.clear();
            }
            let t = start.elapsed().as_secs_f64();
            println!(
                "| {} KiB | {depth} | {n} | {:.2} | {:.0} |",
                bytes >> 10,
                t * 1e6 / n as f64,
                (n * bytes) as f64 / t / 1e6
            );
        }
    }
}
