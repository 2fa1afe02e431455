//! The userspace NVMe engine: [`BlockEngine`] over the driver's [`Controller`] (docs/nvme.md,
//! "The block engine").
//!
//! Each [`IoOp`] becomes one NVMe Read or Write (NVM command set §6.9 / §6.15) on one I/O
//! queue of the controller, on the namespace the controller was brought up with; completions
//! are reaped by polling ([`Controller::poll`]); [`BlockEngine::flush`] is the Flush command
//! (§6.8). Offsets and lengths must be whole logical blocks (and whole 4 KiB pages, the
//! driver's PRP rule) inside the namespace: anything else is refused at submission with
//! [`crate::Error::BlockTarget`], before the device sees it.
//!
//! # One controller, several engines
//!
//! A controller is brought up once and shared ([`NvmeShared`]): the SSD tier runs a writer, a
//! syncer, readers on the callers' threads and recovery scans, each with its own engine, on
//! one namespace. Every engine gets an id and the I/O queue with the fewest entries already
//! promised to other engines; its command tags carry its id, so whichever engine polls the
//! controller hands the completions of the others to their mailboxes. An engine whose queue
//! is momentarily full (other engines' commands) polls until an entry frees up; it answers
//! `WouldBlock` only for its own depth. The controller sits behind a mutex taken for each
//! submission and poll, never across a wait.
//!
//! # Buffers: a bounce region, not zero copy
//!
//! The device never sees an [`IoBuf`](super::IoBuf). Each engine maps one DMA region of
//! `depth` slots of `max_bytes` each when it is built; a write copies the buffer into its slot
//! before the doorbell, a read copies the slot into the buffer after the completion is reaped
//! (volatile copies through [`crate::pinned::VolatileView`]). So the DMA contract holds
//! trivially: the `IoBuf` stays owned by the engine until its completion (as with the file
//! engines), but no memory a Rust slice can reach is ever device-visible. The cost is one
//! memory copy per operation (measured in docs/nvme.md) and `depth × max_bytes` of pinned,
//! mapped memory. Zero copy needs a [`super::BufferPool`] whose region is mapped through
//! [`crate::nvme::Dma`] itself (a `Dma` method mapping caller-owned pinned memory); not done.
//!
//! A slot whose command the controller could not stop (the controller ignored CC.EN after a
//! timeout; the driver then leaks the command's memory) is never handed out again: the device
//! might still write it.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{BlockEngine, Completion, EngineKind, IoOp, IoTarget, NamespaceTarget, OpKind};
use super::{SubmitError, buffer::BUFFER_ALIGN};
use crate::Error;
use crate::nvme::{
    Controller, ControllerStats, Dma, DmaRegion, DmaSlice, IoCompletion, IoKind, IoRequest,
    Registers,
};

/// The slot part of an engine's Flush tag (operation tags are `id << 32 | slot`).
const FLUSH_SLOT: u64 = 0xFFFF_FFFF;

const ENGINE: &str = "NVMe";

/// A namespace of a brought-up controller that engines can be made for, whatever the
/// controller's seams are (VFIO on hardware, the fake in tests): what the SSD tier holds.
pub trait NvmeNamespace: Send + Sync + std::fmt::Debug {
    /// The namespace, as operations must name it.
    fn target(&self) -> NamespaceTarget;

    /// Largest operation in bytes (the controller's transfer limit).
    fn max_bytes(&self) -> usize;

    /// A new engine on the shared controller (see [`NvmeShared::engine`]).
    ///
    /// # Errors
    /// As [`NvmeShared::engine`].
    fn engine(&self, depth: usize, max_bytes: usize) -> Result<Box<dyn BlockEngine>, Error>;

    /// The device in words (`vfio:0000:00:04.0 namespace 1`), for logs and reports.
    fn describe(&self) -> String;

    /// The controller's counters.
    fn stats(&self) -> ControllerStats;
}

/// How to bring up a namespace: what a store location names, opened when the store opens and
/// closed (the controller shut down) when the last engine on it is dropped.
pub trait NvmeOpener: Send + Sync + std::fmt::Debug {
    /// The location in words (`vfio:<pci-address>`, `fake:<image>`).
    fn name(&self) -> String;

    /// A file to take the location's lock on, if the device itself is not exclusive (VFIO
    /// groups are: a second open fails with `EBUSY`).
    fn lock_path(&self) -> Option<PathBuf>;

    /// Brings the controller up.
    ///
    /// # Errors
    /// The driver's error for the step that failed.
    fn open(&self) -> Result<Arc<dyn NvmeNamespace>, Error>;
}

/// The controller and what its engines share.
struct Inner<R: Registers, D: Dma> {
    ctrl: Controller<R, D>,
    /// Completions reaped by one engine for another, by engine id.
    mail: HashMap<u32, Vec<IoCompletion>>,
    next_id: u32,
    /// Entries of each I/O queue promised to live engines.
    promised: Vec<usize>,
}

/// A brought-up controller shared by engines (module docs). Cloning shares it; the controller
/// is shut down when the last clone and the last engine are dropped.
pub struct NvmeShared<R: Registers, D: Dma> {
    inner: Arc<Mutex<Inner<R, D>>>,
    target: NamespaceTarget,
    max_transfer: usize,
    name: String,
}

impl<R: Registers, D: Dma> Clone for NvmeShared<R, D> {
    fn clone(&self) -> Self {
        NvmeShared {
            inner: Arc::clone(&self.inner),
            target: self.target,
            max_transfer: self.max_transfer,
            name: self.name.clone(),
        }
    }
}

impl<R: Registers, D: Dma> std::fmt::Debug for NvmeShared<R, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeShared")
            .field("name", &self.name)
            .field("target", &self.target)
            .field("max_transfer", &self.max_transfer)
            .finish_non_exhaustive()
    }
}

fn lock<R: Registers, D: Dma>(m: &Mutex<Inner<R, D>>) -> MutexGuard<'_, Inner<R, D>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<R: Registers, D: Dma> NvmeShared<R, D> {
    /// Shares `ctrl` (brought up, its namespace identified); `name` says which device it is.
    ///
    /// # Errors
    /// [`Error::NvmeFailed`] for a controller without a namespace or I/O queue.
    pub fn new(ctrl: Controller<R, D>, name: String) -> Result<NvmeShared<R, D>, Error> {
        let ns = *ctrl.namespace().ok_or(Error::NvmeFailed {
            reason: "no namespace identified".into(),
        })?;
        if ctrl.io_queues() == 0 || ctrl.io_queue_capacity(0) == 0 {
            return Err(Error::NvmeFailed {
                reason: "no I/O queue".into(),
            });
        }
        let target = NamespaceTarget {
            nsid: ctrl.namespace_id(),
            block_bytes: ns.block_bytes(),
            blocks: ns.size_blocks,
        };
        let max_transfer = ctrl.max_transfer();
        let promised = vec![0; ctrl.io_queues()];
        Ok(NvmeShared {
            inner: Arc::new(Mutex::new(Inner {
                ctrl,
                mail: HashMap::new(),
                next_id: 0,
                promised,
            })),
            target,
            max_transfer,
            name,
        })
    }

    /// An engine with at most `depth` operations in flight (capped by its queue's capacity) of
    /// at most `max_bytes` each (rounded up to 4 KiB, capped by the controller's transfer
    /// limit), on the I/O queue with the fewest entries promised to other engines. Maps its
    /// bounce region (`depth × max_bytes`).
    ///
    /// # Errors
    /// [`Error::ZeroSizedRegion`] for `max_bytes` 0, and the DMA allocation's error.
    pub fn engine(&self, depth: usize, max_bytes: usize) -> Result<NvmeEngine<R, D>, Error> {
        if max_bytes == 0 {
            return Err(Error::ZeroSizedRegion);
        }
        let max_bytes = max_bytes
            .checked_next_multiple_of(BUFFER_ALIGN)
            .unwrap_or(usize::MAX)
            .min(self.max_transfer);
        let mut inner = lock(&self.inner);
        let queue = (0..inner.promised.len())
            .min_by_key(|&q| inner.promised.get(q).copied().unwrap_or(usize::MAX))
            .unwrap_or(0);
        let capacity = inner.ctrl.io_queue_capacity(queue).max(1);
        let depth = depth.clamp(1, capacity);
        let bytes = depth
            .checked_mul(max_bytes)
            .ok_or(Error::RegionTooLarge { bytes: usize::MAX })?;
        let bounce = inner.ctrl.alloc(bytes)?;
        let id = inner.next_id;
        inner.next_id = inner.next_id.wrapping_add(1);
        if let Some(p) = inner.promised.get_mut(queue) {
            *p += depth;
        }
        drop(inner);
        log::debug!(
            "NVMe block engine {id} on {} queue {queue}: depth {depth}, up to {max_bytes} bytes \
             per operation through a {bytes}-byte bounce region",
            self.name
        );
        Ok(NvmeEngine {
            shared: Arc::clone(&self.inner),
            id,
            queue,
            target: self.target,
            depth,
            max_bytes,
            bounce: Some(bounce),
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            poisoned: 0,
            outstanding: 0,
            done: VecDeque::new(),
            flush_result: None,
        })
    }

    /// The namespace, as operations must name it.
    pub fn target(&self) -> IoTarget {
        IoTarget::Namespace(self.target)
    }

    /// Runs `f` on the controller (statistics, identity), under its lock.
    pub fn with_controller<T>(&self, f: impl FnOnce(&Controller<R, D>) -> T) -> T {
        f(&lock(&self.inner).ctrl)
    }
}

impl<R: Registers + 'static, D: Dma + 'static> NvmeNamespace for NvmeShared<R, D> {
    fn target(&self) -> NamespaceTarget {
        self.target
    }

    fn max_bytes(&self) -> usize {
        self.max_transfer
    }

    fn engine(&self, depth: usize, max_bytes: usize) -> Result<Box<dyn BlockEngine>, Error> {
        Ok(Box::new(NvmeShared::engine(self, depth, max_bytes)?))
    }

    fn describe(&self) -> String {
        format!(
            "{} namespace {} ({} blocks of {} bytes)",
            self.name, self.target.nsid, self.target.blocks, self.target.block_bytes
        )
    }

    fn stats(&self) -> ControllerStats {
        self.with_controller(Controller::stats)
    }
}

/// [`BlockEngine`] over a (shared) userspace NVMe controller (module docs).
pub struct NvmeEngine<R: Registers, D: Dma> {
    shared: Arc<Mutex<Inner<R, D>>>,
    id: u32,
    queue: usize,
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
    /// This engine's commands (operations and flushes) submitted and not yet reaped.
    outstanding: usize,
    /// Completions reaped and not yet returned (a flush reaps what finishes before it).
    done: VecDeque<Completion>,
    /// The result of this engine's Flush, once reaped.
    flush_result: Option<Result<(), Error>>,
}

impl<R: Registers, D: Dma> std::fmt::Debug for NvmeEngine<R, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeEngine")
            .field("id", &self.id)
            .field("queue", &self.queue)
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

/// Waits a little between polls: spin first (completions arrive in microseconds), then yield.
fn pause(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 256 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl<R: Registers, D: Dma> NvmeEngine<R, D> {
    /// An engine that owns `ctrl` (shared with nobody): [`NvmeShared::engine`] of a new
    /// [`NvmeShared`].
    ///
    /// # Errors
    /// As [`NvmeShared::new`] and [`NvmeShared::engine`].
    pub fn new(
        ctrl: Controller<R, D>,
        depth: usize,
        max_bytes: usize,
    ) -> Result<NvmeEngine<R, D>, Error> {
        NvmeShared::new(ctrl, "NVMe".into())?.engine(depth, max_bytes)
    }

    /// The namespace, as operations must name it.
    pub fn target(&self) -> IoTarget {
        IoTarget::Namespace(self.target)
    }

    /// Largest operation in bytes.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The controller's counters.
    pub fn controller_stats(&self) -> ControllerStats {
        lock(&self.shared).ctrl.stats()
    }

    /// The I/O queue (0-based) this engine submits on.
    pub fn queue(&self) -> usize {
        self.queue
    }

    fn tag(&self, slot: u64) -> u64 {
        (u64::from(self.id) << 32) | slot
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

    /// Turns this engine's controller completions into [`Completion`]s on `self.done` (and a
    /// Flush's result into `flush_result`); returns how many it took.
    fn absorb(&mut self, mine: Vec<IoCompletion>) -> usize {
        let n = mine.len();
        for c in mine {
            self.outstanding = self.outstanding.saturating_sub(1);
            let slot = c.tag & 0xFFFF_FFFF;
            if slot == FLUSH_SLOT {
                self.flush_result = Some(c.result);
                continue;
            }
            let Some(slot) = usize::try_from(slot).ok().filter(|&s| s < self.slots.len()) else {
                log::error!(
                    "NVMe engine {}: a completion with unknown tag {}",
                    self.id,
                    c.tag
                );
                continue;
            };
            let Some(mut op) = self.slots.get_mut(slot).and_then(Option::take) else {
                log::error!("NVMe engine {}: a completion for idle slot {slot}", self.id);
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
        n
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

    /// Polls the controller once: takes this engine's mail and new completions, posts the
    /// other engines' to their mailboxes. Returns how many of this engine's it took.
    fn poll_once(&mut self) -> io::Result<usize> {
        let mut mine = Vec::new();
        let polled = {
            let mut inner = lock(&self.shared);
            if let Some(mail) = inner.mail.get_mut(&self.id) {
                mine.append(mail);
            }
            let mut all = Vec::new();
            let r = inner.ctrl.poll(&mut all);
            for c in all {
                let owner = (c.tag >> 32) as u32;
                if owner == self.id {
                    mine.push(c);
                } else {
                    inner.mail.entry(owner).or_default().push(c);
                }
            }
            r
        };
        let n = self.absorb(mine);
        polled.map_err(io_error)?;
        Ok(n)
    }

    /// Polls until `until` holds or nothing of this engine's is outstanding; the controller's
    /// command deadlines bound the wait (a late command fails the controller, which completes
    /// everything in flight).
    fn poll_until(&mut self, mut until: impl FnMut(&Self) -> bool) -> io::Result<()> {
        let mut spins = 0;
        loop {
            self.poll_once()?;
            if until(self) || self.outstanding == 0 {
                return Ok(());
            }
            pause(&mut spins);
        }
    }

    /// Submits `req` on this engine's queue, polling while the queue is full of other
    /// engines' commands.
    fn submit_request(&mut self, req: IoRequest) -> Result<(), Error> {
        let mut spins = 0;
        loop {
            {
                let mut inner = lock(&self.shared);
                // A failed controller (no room either) answers the submission with its error.
                if inner.ctrl.has_room(self.queue) || inner.ctrl.in_flight() == 0 {
                    inner.ctrl.submit(self.queue, req)?;
                    self.outstanding += 1;
                    return Ok(());
                }
            }
            if let Err(e) = self.poll_once() {
                return Err(Error::NvmeFailed {
                    reason: format!("polling for a free queue entry: {e}"),
                });
            }
            pause(&mut spins);
        }
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
        let busy = |depth: usize| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{depth} operations already in flight"),
            )
        };
        if self.in_flight() >= self.depth {
            return Err(SubmitError {
                error: busy(self.depth),
                op: Box::new(op),
            });
        }
        let (Some(slot), Some(region)) = (self.free.pop(), self.bounce.clone()) else {
            return Err(SubmitError {
                error: busy(self.depth),
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
            tag: self.tag(slot as u64),
        };
        match self.submit_request(req) {
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
        let mut got = self.done.len();
        out.extend(self.done.drain(..));
        if got < want {
            let r = self.poll_until(|e| got + e.done.len() >= want);
            got += self.done.len();
            out.extend(self.done.drain(..));
            r?;
        }
        Ok(got)
    }

    fn flush(&mut self, target: &IoTarget) -> io::Result<()> {
        self.check_target("flush", target)?;
        let req = IoRequest {
            kind: IoKind::Flush,
            lba: 0,
            buf: None,
            tag: self.tag(FLUSH_SLOT),
        };
        self.flush_result = None;
        self.submit_request(req).map_err(io_error)?;
        self.poll_until(|e| e.flush_result.is_some())?;
        match self.flush_result.take() {
            Some(result) => result.map_err(io_error),
            // Nothing of this engine's is outstanding and no result came: the Flush was lost
            // to a failure that completed nothing for it.
            None => Err(io_error(Error::NvmeFailed {
                reason: "the flush vanished".into(),
            })),
        }
    }
}

impl<R: Registers, D: Dma> Drop for NvmeEngine<R, D> {
    fn drop(&mut self) {
        // Wait for every command (the controller's deadlines bound it); the operations and
        // their buffers are then dropped. Buffers were never device-visible, so even a failed
        // wait frees nothing the device can reach; the bounce region is handled below.
        if self.outstanding > 0
            && let Err(e) = self.poll_until(|_| false)
        {
            log::error!("NVMe engine dropped while its controller failed: {e}");
        }
        let left = self.in_flight();
        if left > 0 {
            log::debug!("NVMe engine dropped with {left} operations not returned");
        }
        let mut inner = lock(&self.shared);
        inner.mail.remove(&self.id);
        if let Some(p) = inner.promised.get_mut(self.queue) {
            *p = p.saturating_sub(self.depth);
        }
        if let Some(region) = self.bounce.take() {
            if self.poisoned == 0 && self.outstanding == 0 {
                if let Err(e) = inner.ctrl.free(region) {
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
    fn engines_sharing_one_controller_get_their_own_completions() {
        let fake = Fake::new(256, 64);
        let opts = ControllerOptions {
            io_queues: 1,
            io_queue_entries: 8,
            admin_queue_entries: 8,
            command_timeout: Duration::from_millis(500),
            ..Default::default()
        };
        let ctrl = Controller::new(fake.bar(), fake.dma(), opts).unwrap();
        let shared = NvmeShared::new(ctrl, "fake".into()).unwrap();
        // Two engines on one 8-entry queue (7 commands): 6 + 4 promised, so the queue fills
        // with the other engine's commands and a submission must wait for room, not fail.
        let mut a = shared.engine(6, PAGE).unwrap();
        let mut b = shared.engine(4, PAGE).unwrap();
        assert_eq!((a.queue(), b.queue()), (0, 0));
        let pool = BufferPool::new(16, PAGE, MEM).unwrap();
        for i in 0..6u64 {
            a.submit(op(&a, &pool, OpKind::Write, i * 4096, PAGE, 10 + i as u8))
                .unwrap();
        }
        for i in 0..4u64 {
            b.submit(op(
                &b,
                &pool,
                OpKind::Write,
                (8 + i) * 4096,
                PAGE,
                20 + i as u8,
            ))
            .unwrap();
        }
        // b reaps first: a's completions go to a's mailbox, none to b.
        let got_b = reap_all(&mut b);
        assert!(
            got_b
                .iter()
                .all(|c| c.op.offset >= 8 * 4096 && c.result.is_ok())
        );
        let got_a = reap_all(&mut a);
        assert_eq!(got_a.len(), 6);
        assert!(
            got_a
                .iter()
                .all(|c| c.op.offset < 8 * 4096 && c.result.is_ok())
        );
        drop((got_a, got_b));
        // A flush from one engine while the other has reads in flight: each gets its own.
        for i in 0..4u64 {
            b.submit(op(&b, &pool, OpKind::Read, (8 + i) * 4096, PAGE, 0))
                .unwrap();
        }
        let t = a.target();
        a.flush(&t).unwrap();
        assert_eq!(a.in_flight(), 0);
        for c in reap_all(&mut b) {
            let fill = 20 + (c.op.offset / 4096 - 8) as u8;
            assert!(c.op.buf.as_slice().iter().all(|&x| x == fill));
        }
        // The controller lives until the last engine and handle are gone.
        drop(a);
        drop(shared);
        assert_eq!(fake.state().shutdowns, 0);
        drop(b);
        assert_eq!(fake.state().shutdowns, 1);
        assert_eq!(fake.mapped(), 0);
    }

    #[test]
    fn an_image_namespace_keeps_only_flushed_writes_across_a_crash() {
        let dir = std::env::temp_dir().join(format!(
            "kvstack-fake-image-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let image = dir.join("ns.img");
        let opener = crate::nvme::fake::FakeOpener::new(&image, 1 << 20);
        let pool = BufferPool::new(4, PAGE, MEM).unwrap();
        let write = |e: &mut dyn BlockEngine, t: &IoTarget, at: u64, fill: u8| {
            let mut buf = pool.try_get().unwrap();
            buf.as_mut_slice().fill(fill);
            e.submit(IoOp {
                kind: OpKind::Write,
                target: t.clone(),
                offset: at,
                len: PAGE,
                buf,
                tag: 0,
            })
            .unwrap();
            reap_all(e);
        };
        {
            let ns = opener.open().unwrap();
            let t = IoTarget::Namespace(ns.target());
            let mut e = ns.engine(2, PAGE).unwrap();
            write(e.as_mut(), &t, 0, 1);
            e.flush(&t).unwrap();
            write(e.as_mut(), &t, 4096, 2);
            // A crash: the process dies without shutting the controller down; its volatile
            // cache (the second write) is lost.
            std::mem::forget(e);
            std::mem::forget(ns);
        }
        let bytes = std::fs::read(&image).unwrap();
        assert!(bytes[..PAGE].iter().all(|&b| b == 1));
        assert!(
            bytes[PAGE..2 * PAGE].iter().all(|&b| b == 0),
            "unflushed write kept"
        );
        {
            // A normal shutdown destages the cache.
            let ns = opener.open().unwrap();
            let t = IoTarget::Namespace(ns.target());
            let mut e = ns.engine(2, PAGE).unwrap();
            write(e.as_mut(), &t, 4096, 3);
        }
        let bytes = std::fs::read(&image).unwrap();
        assert!(bytes[PAGE..2 * PAGE].iter().all(|&b| b == 3));
        std::fs::remove_dir_all(&dir).unwrap();
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
