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
//! # Buffers: zero copy for a mapped pool, a bounce slot for anything else
//!
//! A [`BufferPool`] can be mapped for the controller ([`NvmeShared::map_pool`]): its whole
//! region goes into the controller's IOMMU domain at an IOVA the driver chooses
//! ([`crate::nvme::Dma::map_lent`]). An operation whose [`IoBuf`] belongs to a
//! mapped pool is **zero copy**: its command's PRPs name the slot's own pages (each 4 KiB
//! page's IOVA inside the pool's mapping), and the device reads or writes the slot directly.
//! The [`IoBuf`] is owned by the engine from `submit` until `wait` returns it,
//! so no slice of the slot exists while the device may touch it (the pool's DMA contract,
//! [`super::buffer`]); the queue's fences order the CPU's stores into the slot before the
//! doorbell and the completion's phase tag before the CPU's loads.
//!
//! Any other buffer goes through a **bounce slot**: the engine maps a region of `depth` slots
//! of `max_bytes` each the first time it needs one; a write copies the buffer into its slot
//! before the doorbell, a read copies the slot into the buffer after the completion is reaped
//! (volatile copies through [`crate::pinned::VolatileView`]). [`CopyStats`] counts both kinds.
//!
//! A command the controller could not stop (it ignored CC.EN after a timeout; the driver then
//! leaks the command's memory) leaves its memory unusable for good: a bounce slot is never
//! handed out again (nor its region unmapped), and a pool buffer comes back **quarantined**
//! (empty, never returned to its pool, the pool's memory never freed), since the device might
//! still write it.
//!
//! A pool's mapping lives until the pool's memory is released (its last clone and buffer
//! dropped, so no command can name it) or until the controller is closed (the last engine
//! and [`NvmeShared`] handle dropped), whichever comes first; the mapping's own handle keeps
//! the region's memory alive until it is unmapped.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use std::sync::atomic::{AtomicU64, Ordering};

use super::{BlockEngine, BufferPool, Completion, EngineKind, IoOp, IoTarget, NamespaceTarget};
use super::{IoBuf, OpKind, SubmitError, buffer::BUFFER_ALIGN};
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

    /// Maps `pool` for the controller, so that its buffers move zero copy (see
    /// [`NvmeShared::map_pool`]).
    ///
    /// # Errors
    /// As [`NvmeShared::map_pool`].
    fn map_pool(&self, pool: &BufferPool) -> Result<(), Error>;

    /// How the engines' operations moved their data, over every engine made so far.
    fn copy_stats(&self) -> CopyStats;
}

/// How NVMe engine operations moved their data (module docs, "Buffers").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CopyStats {
    /// Reads and writes whose buffer the controller reached directly (a mapped pool's).
    pub zero_copy_ops: u64,
    /// Reads and writes copied through a bounce slot.
    pub bounced_ops: u64,
    /// Bytes copied between buffers and bounce slots.
    pub bounce_bytes: u64,
}

/// [`CopyStats`] shared by the engines of one controller.
#[derive(Debug, Default)]
struct CopyCounters {
    zero_copy_ops: AtomicU64,
    bounced_ops: AtomicU64,
    bounce_bytes: AtomicU64,
}

impl CopyCounters {
    fn get(&self) -> CopyStats {
        CopyStats {
            zero_copy_ops: self.zero_copy_ops.load(Ordering::Relaxed),
            bounced_ops: self.bounced_ops.load(Ordering::Relaxed),
            bounce_bytes: self.bounce_bytes.load(Ordering::Relaxed),
        }
    }
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
    /// The mapping of each pool mapped for the controller, by pool id.
    pools: HashMap<u64, DmaRegion>,
}

impl<R: Registers, D: Dma> Drop for Inner<R, D> {
    fn drop(&mut self) {
        // Pools that outlive the controller: stopped first (shut down), then unmapped. A
        // controller that cannot be stopped keeps them mapped (the Dma's own clone keeps the
        // memory alive), as it keeps its queues.
        if self.pools.is_empty() {
            return;
        }
        let stopped = self.ctrl.stop();
        for (id, region) in self.pools.drain() {
            if !stopped {
                log::error!("NVMe: buffer pool {id} left mapped: the controller did not stop");
            } else if let Err(e) = self.ctrl.free(region) {
                log::error!("NVMe: buffer pool {id} not unmapped: {e}");
            }
        }
    }
}

/// A brought-up controller shared by engines (module docs). Cloning shares it; the controller
/// is shut down when the last clone and the last engine are dropped.
pub struct NvmeShared<R: Registers, D: Dma> {
    inner: Arc<Mutex<Inner<R, D>>>,
    copies: Arc<CopyCounters>,
    target: NamespaceTarget,
    max_transfer: usize,
    name: String,
}

impl<R: Registers, D: Dma> Clone for NvmeShared<R, D> {
    fn clone(&self) -> Self {
        NvmeShared {
            inner: Arc::clone(&self.inner),
            copies: Arc::clone(&self.copies),
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

/// A reference to a shared controller that does not keep it up (see
/// [`NvmeShared::downgrade`]): what a process-wide table of brought-up controllers holds, so
/// the controller still shuts down when its last user goes.
pub struct WeakNvmeShared<R: Registers, D: Dma> {
    inner: Weak<Mutex<Inner<R, D>>>,
    copies: Arc<CopyCounters>,
    target: NamespaceTarget,
    max_transfer: usize,
    name: String,
}

impl<R: Registers, D: Dma> WeakNvmeShared<R, D> {
    /// The controller, if something still holds it up.
    pub fn upgrade(&self) -> Option<NvmeShared<R, D>> {
        Some(NvmeShared {
            inner: self.inner.upgrade()?,
            copies: Arc::clone(&self.copies),
            target: self.target,
            max_transfer: self.max_transfer,
            name: self.name.clone(),
        })
    }

    /// Whether the controller has been dropped (shut down).
    pub fn is_gone(&self) -> bool {
        self.inner.strong_count() == 0
    }

    /// The namespace the controller was brought up with.
    pub fn target(&self) -> NamespaceTarget {
        self.target
    }
}

impl<R: Registers, D: Dma> std::fmt::Debug for WeakNvmeShared<R, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeakNvmeShared")
            .field("name", &self.name)
            .field("target", &self.target)
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
                pools: HashMap::new(),
            })),
            copies: Arc::default(),
            target,
            max_transfer,
            name,
        })
    }

    /// A reference that does not keep the controller up ([`WeakNvmeShared::upgrade`] gets
    /// it back while any clone or engine lives).
    pub fn downgrade(&self) -> WeakNvmeShared<R, D> {
        WeakNvmeShared {
            inner: Arc::downgrade(&self.inner),
            copies: Arc::clone(&self.copies),
            target: self.target,
            max_transfer: self.max_transfer,
            name: self.name.clone(),
        }
    }

    /// An engine with at most `depth` operations in flight (capped by its queue's capacity) of
    /// at most `max_bytes` each (rounded up to 4 KiB, capped by the controller's transfer
    /// limit), on the I/O queue with the fewest entries promised to other engines. Its bounce
    /// region (`depth × max_bytes`) is mapped when a buffer of no mapped pool first needs it.
    ///
    /// # Errors
    /// [`Error::ZeroSizedRegion`] for `max_bytes` 0, [`Error::RegionTooLarge`] when the
    /// bounce region's size overflows.
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
        let id = inner.next_id;
        inner.next_id = inner.next_id.wrapping_add(1);
        if let Some(p) = inner.promised.get_mut(queue) {
            *p += depth;
        }
        drop(inner);
        log::debug!(
            "NVMe block engine {id} on {} queue {queue}: depth {depth}, up to {max_bytes} bytes \
             per operation, zero copy for mapped pools, else through a {bytes}-byte bounce \
             region",
            self.name
        );
        Ok(NvmeEngine {
            shared: Arc::clone(&self.inner),
            shared_copies: Arc::clone(&self.copies),
            copies: CopyStats::default(),
            id,
            queue,
            target: self.target,
            depth,
            max_bytes,
            bounce: None,
            lent: None,
            slots: (0..depth).map(|_| None).collect(),
            bounced: vec![false; depth],
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

    /// Maps `pool`'s region for the controller (once; mapping a pool again does nothing), so
    /// that operations on its buffers move zero copy (module docs). The mapping is removed
    /// when the pool's memory is released or the controller is closed, whichever comes first.
    /// Every buffer must be in the pool: none may be in the caller's hands (as a slice) while
    /// the region becomes device-visible.
    ///
    /// # Errors
    /// [`Error::NvmeRequest`] while buffers are handed out; the mapping's error.
    pub fn map_pool(&self, pool: &BufferPool) -> Result<(), Error>
    where
        R: 'static,
        D: 'static,
    {
        let id = pool.id();
        let mut inner = lock(&self.inner);
        if inner.pools.contains_key(&id) {
            return Ok(());
        }
        // The pool's free list stays locked while the region is mapped, so no buffer (and no
        // slice of the region) can be taken meanwhile. Lock order: the controller, then the
        // pool (nothing takes the controller while holding a pool's free list).
        let Some(mapped) =
            pool.with_all_home(|| inner.ctrl.map_lent(Arc::clone(pool.lent_region())))
        else {
            return Err(Error::NvmeRequest {
                reason: format!(
                    "buffer pool {id} has {} of its {} buffers handed out; map it before \
                     taking any",
                    pool.slots().saturating_sub(pool.available()),
                    pool.slots()
                ),
            });
        };
        let region = mapped?;
        log::debug!(
            "NVMe {}: buffer pool {id} ({} buffers of {} bytes) mapped at IOVA {:#x}",
            self.name,
            pool.slots(),
            pool.slot_bytes(),
            region.iova()
        );
        inner.pools.insert(id, region);
        drop(inner);
        let weak = Arc::downgrade(&self.inner);
        pool.on_release(Box::new(move || {
            // The controller may be gone already (its teardown unmapped the pool).
            let Some(shared) = weak.upgrade() else { return };
            let mut inner = lock(&shared);
            if let Some(region) = inner.pools.remove(&id)
                && let Err(e) = inner.ctrl.free(region)
            {
                log::error!("NVMe: buffer pool {id} not unmapped: {e}");
            }
        }));
        Ok(())
    }

    /// How the engines' operations moved their data, over every engine made so far.
    pub fn copy_stats(&self) -> CopyStats {
        self.copies.get()
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

    fn map_pool(&self, pool: &BufferPool) -> Result<(), Error> {
        NvmeShared::map_pool(self, pool)
    }

    fn copy_stats(&self) -> CopyStats {
        NvmeShared::copy_stats(self)
    }
}

/// [`BlockEngine`] over a (shared) userspace NVMe controller (module docs).
pub struct NvmeEngine<R: Registers, D: Dma> {
    shared: Arc<Mutex<Inner<R, D>>>,
    /// The controller's copy counters, and this engine's own.
    shared_copies: Arc<CopyCounters>,
    copies: CopyStats,
    id: u32,
    queue: usize,
    target: NamespaceTarget,
    depth: usize,
    max_bytes: usize,
    /// `depth` slots of `max_bytes`; slot `i` starts at `i * max_bytes`. Mapped when first
    /// needed.
    bounce: Option<DmaRegion>,
    /// The mapping of the pool last used zero copy (pool ids are never reused, so it stays
    /// right for that pool's buffers).
    lent: Option<(u64, DmaRegion)>,
    /// The operation using each slot (its tag), until its completion is reaped.
    slots: Vec<Option<IoOp>>,
    /// Whether each slot's operation uses the slot's bounce space.
    bounced: Vec<bool>,
    free: Vec<usize>,
    /// Bounce slots the device may still write (their command was leaked by the driver).
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

    /// How this engine's operations moved their data.
    pub fn copy_stats(&self) -> CopyStats {
        self.copies
    }

    /// Counts one operation submitted, zero copy or through a bounce slot.
    fn count_op(&mut self, zero_copy: bool) {
        let (mine, shared) = if zero_copy {
            (
                &mut self.copies.zero_copy_ops,
                &self.shared_copies.zero_copy_ops,
            )
        } else {
            (
                &mut self.copies.bounced_ops,
                &self.shared_copies.bounced_ops,
            )
        };
        *mine += 1;
        shared.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `bytes` copied between a buffer and a bounce slot.
    fn count_copy(&mut self, bytes: usize) {
        self.copies.bounce_bytes += bytes as u64;
        self.shared_copies
            .bounce_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The mapping of `buf`'s pool, if it is mapped for this controller.
    fn lent_region(&mut self, buf: &IoBuf) -> Option<DmaRegion> {
        let id = buf.pool_id();
        if let Some((cached, region)) = &self.lent
            && *cached == id
        {
            return Some(region.clone());
        }
        let region = lock(&self.shared).pools.get(&id).cloned()?;
        self.lent = Some((id, region.clone()));
        Some(region)
    }

    /// The bounce region, mapped on first use.
    fn bounce_region(&mut self) -> Result<DmaRegion, Error> {
        if let Some(r) = &self.bounce {
            return Ok(r.clone());
        }
        let bytes = self.depth * self.max_bytes;
        let region = lock(&self.shared).ctrl.alloc(bytes)?;
        log::debug!(
            "NVMe block engine {}: {bytes}-byte bounce region mapped",
            self.id
        );
        self.bounce = Some(region.clone());
        Ok(region)
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
            let bounced = self.bounced.get(slot).copied().unwrap_or(true);
            if c.buf.is_some() {
                self.free.push(slot);
            } else if bounced {
                // The driver kept the command's memory for a device that may still write it.
                self.poisoned += 1;
            } else {
                // The device may still write the pool buffer itself: it never comes back as
                // usable memory (the slot index, a tag, is free again).
                op.buf.quarantine();
                self.free.push(slot);
            }
            let result = match c.result {
                Ok(()) if op.kind == OpKind::Read && bounced => {
                    self.copy_out(slot, &mut op).map(|()| op.len)
                }
                Ok(()) => Ok(op.len),
                Err(e) => Err(io_error(e)),
            };
            self.done.push_back(Completion { op, result });
        }
        n
    }

    /// Copies a finished read from its bounce slot into the operation's buffer.
    fn copy_out(&mut self, slot: usize, op: &mut IoOp) -> io::Result<()> {
        let region = self
            .bounce
            .as_ref()
            .ok_or_else(|| io::Error::other("no bounce region"))?;
        let dst = op.buf.as_mut_slice().get_mut(..op.len).unwrap_or_default();
        region
            .volatile()
            .read(slot * self.max_bytes, dst)
            .map_err(io_error)?;
        self.count_copy(op.len);
        Ok(())
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
        let Some(slot) = self.free.pop() else {
            return Err(SubmitError {
                error: busy(self.depth),
                op: Box::new(op),
            });
        };
        let data = match self.lent_region(&op.buf) {
            // Zero copy: the slot's own pages, at their offset in the pool's mapping.
            Some(region) => DmaSlice {
                region,
                offset: op.buf.region_offset(),
                len: op.len,
            },
            None => {
                let offset = slot * self.max_bytes;
                let staged = self.bounce_region().and_then(|region| {
                    if op.kind == OpKind::Write {
                        let src = op.buf.as_slice().get(..op.len).unwrap_or_default();
                        region.volatile().write(offset, src)?;
                    }
                    Ok(region)
                });
                match staged {
                    Ok(region) => DmaSlice {
                        region,
                        offset,
                        len: op.len,
                    },
                    Err(e) => {
                        self.free.push(slot);
                        return Err(SubmitError {
                            error: io_error(e),
                            op: Box::new(op),
                        });
                    }
                }
            }
        };
        let zero_copy = data.region.is_lent();
        let req = IoRequest {
            kind: match op.kind {
                OpKind::Read => IoKind::Read,
                OpKind::Write => IoKind::Write,
            },
            lba,
            buf: Some(data),
            tag: self.tag(slot as u64),
        };
        match self.submit_request(req) {
            Ok(()) => {
                self.count_op(zero_copy);
                // A bounced read's copy is counted when it is made.
                if !zero_copy && op.kind == OpKind::Write {
                    self.count_copy(op.len);
                }
                if let Some(b) = self.bounced.get_mut(slot) {
                    *b = !zero_copy;
                }
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
        // their buffers are then dropped. If the wait fails, the commands still in flight may
        // yet be run by the device: their pool buffers are quarantined (never reused) and
        // their bounce slots poisoned (the region is kept mapped, below).
        if self.outstanding > 0
            && let Err(e) = self.poll_until(|_| false)
        {
            log::error!("NVMe engine dropped while its controller failed: {e}");
            for (op, bounced) in self.slots.iter_mut().zip(&self.bounced) {
                if let Some(op) = op {
                    if *bounced {
                        self.poisoned += 1;
                    } else {
                        op.buf.quarantine();
                    }
                }
            }
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

    /// A controller over `fake` shared by engines: one I/O queue of `entries` entries, 1 MiB
    /// transfers, 1 s deadlines.
    fn shared(fake: &Fake, entries: u16) -> NvmeShared<FakeBar, FakeDma> {
        let opts = ControllerOptions {
            io_queues: 1,
            io_queue_entries: entries,
            admin_queue_entries: 8,
            command_timeout: Duration::from_millis(1000),
            ..Default::default()
        };
        let ctrl = Controller::new(fake.bar(), fake.dma(), opts).unwrap();
        NvmeShared::new(ctrl, "fake".into()).unwrap()
    }

    /// Bytes that differ from page to page and from one `seed` to another.
    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u64 / 8).wrapping_mul(0x9E37_79B9) ^ seed.wrapping_mul(31)) as u8)
            .collect()
    }

    fn one(e: &mut dyn BlockEngine, o: IoOp) -> Completion {
        e.submit(o).unwrap();
        let mut c = reap_all(e);
        assert_eq!(c.len(), 1);
        c.pop().unwrap()
    }

    #[test]
    fn pool_buffers_round_trip_zero_copy_from_1_to_128_pages() {
        let fake = Fake::new(1024, 64);
        let ns = shared(&fake, 16);
        let pool = BufferPool::new(2, 128 * PAGE, MEM).unwrap();
        ns.map_pool(&pool).unwrap();
        // Mapping twice is one mapping.
        ns.map_pool(&pool).unwrap();
        assert_eq!((fake.mapped_lent(), fake.state().lent_maps), (1, 1));
        let mut e = ns.engine(2, 128 * PAGE).unwrap();
        let mapped = fake.mapped();
        let t = e.target();
        let mut moved = 0u64;
        for pages in 1..=128usize {
            let len = pages * PAGE;
            let at = ((pages * 37) % (1024 - 128) * PAGE) as u64;
            let data = pattern(pages as u64, len);
            let mut buf = pool.try_get().unwrap();
            buf.as_mut_slice()[..len].copy_from_slice(&data);
            let w = IoOp {
                kind: OpKind::Write,
                target: t.clone(),
                offset: at,
                len,
                buf,
                tag: 0,
            };
            let c = one(&mut e, w);
            assert_eq!(c.result.as_ref().ok(), Some(&len), "write of {pages} pages");
            assert!(
                fake.state().disk[at as usize..at as usize + len] == data[..],
                "{pages} pages on the device"
            );
            drop(c);
            let mut buf = pool.try_get().unwrap();
            buf.as_mut_slice().fill(0xEE);
            let r = IoOp {
                kind: OpKind::Read,
                target: t.clone(),
                offset: at,
                len,
                buf,
                tag: 1,
            };
            let c = one(&mut e, r);
            assert_eq!(c.result.as_ref().ok(), Some(&len), "read of {pages} pages");
            assert!(c.op.buf.as_slice()[..len] == data[..], "{pages} pages read");
            // Bytes past the transfer are untouched: the PRPs named exactly its pages.
            assert!(c.op.buf.as_slice()[len..].iter().all(|&b| b == 0xEE));
            moved += 2 * len as u64;
        }
        let copies = e.copy_stats();
        assert_eq!(
            copies,
            CopyStats {
                zero_copy_ops: 256,
                bounced_ops: 0,
                bounce_bytes: 0
            }
        );
        assert_eq!(ns.copy_stats(), copies);
        // The device moved every byte straight to or from the pool's pages, through PRP lists
        // for more than two pages, and the engine never mapped a bounce region.
        assert_eq!(fake.lent_bytes(), moved);
        assert!(fake.state().max_list_pages >= 1);
        assert_eq!(fake.mapped(), mapped);
        assert_eq!(pool.available(), 2);
    }

    #[test]
    fn pool_and_other_buffers_mix_and_only_the_others_bounce() {
        let fake = Fake::new(1024, 64);
        let ns = shared(&fake, 32);
        let mapped_pool = BufferPool::new(8, 16 * PAGE, MEM).unwrap();
        let other_pool = BufferPool::new(8, 16 * PAGE, MEM).unwrap();
        ns.map_pool(&mapped_pool).unwrap();
        let mut e = ns.engine(16, 16 * PAGE).unwrap();
        let t = e.target();
        let (mut zero_bytes, mut bounce_bytes) = (0u64, 0u64);
        // Writes from both pools in flight together, then reads crosswise: what a pool buffer
        // wrote is read into another pool's buffer and the other way round.
        let sizes = [1usize, 3, 16, 2, 8, 5, 16, 4];
        let mut written = Vec::new();
        for (i, &pages) in sizes.iter().enumerate() {
            let len = pages * PAGE;
            let data = pattern(100 + i as u64, len);
            let from = if i % 2 == 0 {
                &mapped_pool
            } else {
                &other_pool
            };
            let mut buf = from.try_get().unwrap();
            buf.as_mut_slice()[..len].copy_from_slice(&data);
            e.submit(IoOp {
                kind: OpKind::Write,
                target: t.clone(),
                offset: (i * 16 * PAGE) as u64,
                len,
                buf,
                tag: i as u64,
            })
            .unwrap();
            if i % 2 == 0 {
                zero_bytes += len as u64;
            } else {
                bounce_bytes += len as u64;
            }
            written.push(data);
        }
        assert!(reap_all(&mut e).iter().all(|c| c.result.is_ok()));
        for (i, &pages) in sizes.iter().enumerate() {
            let len = pages * PAGE;
            let into = if i % 2 == 0 {
                &other_pool
            } else {
                &mapped_pool
            };
            let mut buf = into.try_get().unwrap();
            buf.as_mut_slice().fill(0x5A);
            e.submit(IoOp {
                kind: OpKind::Read,
                target: t.clone(),
                offset: (i * 16 * PAGE) as u64,
                len,
                buf,
                tag: i as u64,
            })
            .unwrap();
            if i % 2 == 0 {
                bounce_bytes += len as u64;
            } else {
                zero_bytes += len as u64;
            }
        }
        for c in reap_all(&mut e) {
            let i = c.op.tag as usize;
            assert_eq!(c.result.as_ref().ok(), Some(&written[i].len()));
            assert!(
                c.op.buf.as_slice()[..written[i].len()] == written[i][..],
                "op {i}"
            );
        }
        let copies = e.copy_stats();
        assert_eq!(copies.zero_copy_ops, 8);
        assert_eq!(copies.bounced_ops, 8);
        assert_eq!(copies.bounce_bytes, bounce_bytes);
        assert_eq!(fake.lent_bytes(), zero_bytes);
        assert_eq!((mapped_pool.available(), other_pool.available()), (8, 8));
    }

    #[test]
    fn a_pool_mapped_for_another_controller_bounces_here() {
        let (fa, fb) = (Fake::new(64, 64), Fake::new(64, 64));
        let (a, b) = (shared(&fa, 8), shared(&fb, 8));
        let pool = BufferPool::new(2, PAGE, MEM).unwrap();
        a.map_pool(&pool).unwrap();
        let mut eb = b.engine(2, PAGE).unwrap();
        let mut ea = a.engine(2, PAGE).unwrap();
        for e in [&mut eb, &mut ea] {
            let o = op(e, &pool, OpKind::Write, 0, PAGE, 9);
            let c = one(e, o);
            assert!(c.result.is_ok());
        }
        assert_eq!(
            (eb.copy_stats().bounced_ops, eb.copy_stats().zero_copy_ops),
            (1, 0)
        );
        assert_eq!(
            (ea.copy_stats().bounced_ops, ea.copy_stats().zero_copy_ops),
            (0, 1)
        );
        assert_eq!((fa.lent_bytes(), fb.lent_bytes()), (PAGE as u64, 0));
        assert!(fa.state().disk[..PAGE].iter().all(|&x| x == 9));
        assert!(fb.state().disk[..PAGE].iter().all(|&x| x == 9));
    }

    #[test]
    fn a_pool_is_mapped_only_with_every_buffer_home() {
        let fake = Fake::new(64, 64);
        let ns = shared(&fake, 8);
        let pool = BufferPool::new(2, PAGE, MEM).unwrap();
        let held = pool.try_get().unwrap();
        let err = ns.map_pool(&pool).unwrap_err();
        assert!(err.to_string().contains("1 of its 2 buffers"), "{err}");
        assert_eq!(fake.mapped_lent(), 0);
        drop(held);
        ns.map_pool(&pool).unwrap();
        assert_eq!(fake.mapped_lent(), 1);
        // A lent region has no CPU view through the driver: its bytes are the IoBufs'.
        let region = fake.lent_region().unwrap();
        assert!(region.volatile().read(0, &mut [0u8; 1]).is_err());
    }

    /// A zero-copy command times out and the controller then ignores CC.EN: its pool buffer
    /// comes back quarantined (empty, with the error), is never handed out again, and the
    /// pool's memory stays mapped and alive; a bounced command beside it poisons its slot.
    #[test]
    fn a_command_the_controller_cannot_stop_quarantines_its_pool_buffer() {
        let fake = Fake::new(64, 64);
        let ns = shared(&fake, 8);
        let pool = BufferPool::new(3, PAGE, MEM).unwrap();
        ns.map_pool(&pool).unwrap();
        let mut e = ns.engine(4, PAGE).unwrap();
        fake.state().inject.push_back(Inject::Swallow);
        let o = op(&e, &pool, OpKind::Read, 0, PAGE, 1);
        let index = o.buf.index();
        e.submit(o).unwrap();
        fake.state().dead = true;
        let mut out = Vec::new();
        e.wait(1, &mut out).unwrap();
        let c = out.pop().unwrap();
        let err = c.result.as_ref().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(c.op.buf.is_quarantined() && c.op.buf.as_slice().is_empty());
        drop(c);
        // The slot never returns: two buffers left, and neither is the quarantined one.
        assert_eq!(pool.available(), 2);
        let rest: Vec<_> = std::iter::from_fn(|| pool.try_get()).collect();
        assert!(rest.iter().all(|b| b.index() != index));
        drop(rest);
        drop(e);
        drop(pool);
        drop(ns);
        // Neither the pool's mapping nor its memory was released under the device.
        assert_eq!(fake.mapped_lent(), 1);
    }

    /// The same timeout on a controller that does stop: the buffer comes back usable (the
    /// device can no longer reach it) and returns to its pool.
    #[test]
    fn a_timed_out_command_on_a_stopped_controller_returns_its_buffer() {
        let fake = Fake::new(64, 64);
        let ns = shared(&fake, 8);
        let pool = BufferPool::new(2, PAGE, MEM).unwrap();
        ns.map_pool(&pool).unwrap();
        let mut e = ns.engine(2, PAGE).unwrap();
        fake.state().inject.push_back(Inject::Swallow);
        e.submit(op(&e, &pool, OpKind::Read, 0, PAGE, 1)).unwrap();
        let mut out = Vec::new();
        e.wait(1, &mut out).unwrap();
        let c = out.pop().unwrap();
        assert_eq!(
            c.result.as_ref().unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );
        assert!(!c.op.buf.is_quarantined());
        assert_eq!(c.op.buf.len(), PAGE);
        drop(c);
        assert_eq!(pool.available(), 2);
        drop(e);
        drop(pool);
        assert_eq!(fake.mapped_lent(), 0);
    }

    #[test]
    fn the_mapping_outlives_its_users_in_any_drop_order() {
        // Engine, then pool, then controller: the pool is unmapped when it goes, while the
        // controller still runs.
        let fake = Fake::new(64, 64);
        let ns = shared(&fake, 8);
        let pool = BufferPool::new(2, PAGE, MEM).unwrap();
        ns.map_pool(&pool).unwrap();
        let mut e = ns.engine(2, PAGE).unwrap();
        // A completion (and its buffer) kept past the engine keeps the pool alive.
        let o = op(&e, &pool, OpKind::Write, 0, PAGE, 3);
        let kept = one(&mut e, o);
        drop(e);
        drop(pool);
        assert_eq!(fake.mapped_lent(), 1);
        drop(kept);
        assert_eq!(fake.mapped_lent(), 0);
        assert_eq!(fake.state().shutdowns, 0);
        drop(ns);
        assert_eq!((fake.mapped(), fake.state().shutdowns), (0, 1));

        // Pool first, while an engine lives: unmapped at once; the engine goes on with others.
        let fake = Fake::new(64, 64);
        let ns = shared(&fake, 8);
        let pool = BufferPool::new(2, PAGE, MEM).unwrap();
        ns.map_pool(&pool).unwrap();
        let mut e = ns.engine(2, PAGE).unwrap();
        let o = op(&e, &pool, OpKind::Write, 0, PAGE, 4);
        assert!(one(&mut e, o).result.is_ok());
        drop(pool);
        assert_eq!(fake.mapped_lent(), 0);
        let other = BufferPool::new(1, PAGE, MEM).unwrap();
        ns.map_pool(&other).unwrap();
        let o = op(&e, &other, OpKind::Read, 0, PAGE, 0);
        let c = one(&mut e, o);
        assert!(c.op.buf.as_slice().iter().all(|&x| x == 4));
        assert_eq!(e.copy_stats().zero_copy_ops, 2);
        drop(c);

        // Controller (last engine and handle) before the pool: shut down, then unmapped; the
        // pool is still good memory afterwards, and dropping it later does nothing more.
        drop(e);
        drop(ns);
        assert_eq!(fake.state().shutdowns, 1);
        assert_eq!(fake.mapped(), 0);
        let mut b = other.try_get().unwrap();
        b.as_mut_slice().fill(1);
        drop(b);
        drop(other);
        assert_eq!(fake.mapped(), 0);
    }

    /// The engine's cost per operation on the fake, bounce against zero copy: the same reads
    /// and writes through an unmapped pool and through a mapped one, on two engines of one
    /// controller, in the order bounce, zero copy, zero copy, bounce for each workload (each
    /// mode's figure is the mean of its two runs, so warm-up and drift weigh on both alike);
    /// wall and CPU time per operation. The fake moves every byte itself (a `Vec` copy per
    /// transfer), so both modes carry that; the difference is the bounce copy.
    #[test]
    #[ignore = "measurement: cargo test -p kvstack-driver --features fake-nvme --lib nvme_engine_per_op_cost -- --ignored --nocapture"]
    fn nvme_engine_per_op_cost() {
        let fake = Fake::new(4096, 1024);
        let opts = ControllerOptions {
            io_queues: 1,
            io_queue_entries: 128,
            admin_queue_entries: 8,
            ..Default::default()
        };
        let ctrl = Controller::new(fake.bar(), fake.dma(), opts).unwrap();
        let ns = NvmeShared::new(ctrl, "fake".into()).unwrap();
        let unmapped = BufferPool::new(64, 128 << 10, MEM).unwrap();
        let mapped = BufferPool::new(64, 128 << 10, MEM).unwrap();
        ns.map_pool(&mapped).unwrap();
        let mut bounce = ns.engine(64, 128 << 10).unwrap();
        let mut zero = ns.engine(64, 128 << 10).unwrap();
        // Returns (wall µs, CPU µs, bounce bytes) per operation.
        let run = |e: &mut Engine, pool: &BufferPool, kind, bytes: usize, depth: usize| {
            let n = 10_000usize.min((256 << 20) / bytes);
            let before = e.copy_stats().bounce_bytes;
            let mut out = Vec::new();
            let cpu = crate::blockio::bench::cpu_seconds();
            let start = std::time::Instant::now();
            let (mut sent, mut done) = (0usize, 0usize);
            while done < n {
                while sent < n && e.in_flight() < depth {
                    let lba = ((sent * bytes / PAGE) % (4096 - bytes / PAGE)) as u64;
                    e.submit(IoOp {
                        kind,
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
            let wall = start.elapsed().as_secs_f64() * 1e6 / n as f64;
            let cpu = (crate::blockio::bench::cpu_seconds() - cpu) * 1e6 / n as f64;
            (wall, cpu, (e.copy_stats().bounce_bytes - before) / n as u64)
        };
        println!(
            "| op | transfer | depth | bounce: µs / CPU µs per op | zero copy: µs / CPU µs per op | CPU ratio | bounce bytes per op, bounce / zero copy |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (kind, bytes, depth) in [
            (OpKind::Read, 4096usize, 1usize),
            (OpKind::Read, 4096, 16),
            (OpKind::Write, 4096, 16),
            (OpKind::Read, 128 << 10, 16),
            (OpKind::Write, 128 << 10, 16),
        ] {
            let b1 = run(&mut bounce, &unmapped, kind, bytes, depth);
            let z1 = run(&mut zero, &mapped, kind, bytes, depth);
            let z2 = run(&mut zero, &mapped, kind, bytes, depth);
            let b2 = run(&mut bounce, &unmapped, kind, bytes, depth);
            let (bw, bc) = ((b1.0 + b2.0) / 2.0, (b1.1 + b2.1) / 2.0);
            let (zw, zc) = ((z1.0 + z2.0) / 2.0, (z1.1 + z2.1) / 2.0);
            println!(
                "| {} | {} KiB | {depth} | {bw:.2} / {bc:.2} | {zw:.2} / {zc:.2} | {:.2} | {} / {} |",
                kind.name(),
                bytes >> 10,
                zc / bc,
                b1.2,
                z1.2
            );
        }
        assert_eq!(zero.copy_stats().bounced_ops, 0);
        assert_eq!(bounce.copy_stats().zero_copy_ops, 0);
    }
}
