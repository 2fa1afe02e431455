//! A userspace NVMe driver: the controller and queue state machine (`docs/nvme.md`).
//!
//! The driver talks to a controller through two small seams, so the same code runs against
//! hardware (a VFIO device, the `vfio` module: BAR0 mapped, DMA through the IOMMU) and against the
//! in-process fake controller of the tests:
//! - [`Registers`]: 32- and 64-bit volatile reads and writes of BAR0 at byte offsets (the
//!   controller registers and the doorbells);
//! - [`Dma`]: pinned memory the controller may read and write, each region at an I/O virtual
//!   address (IOVA) the driver chooses the use of. The CPU reaches it only through
//!   [`crate::pinned::VolatileView`] (the crate's DMA contract): never as a Rust slice.
//!
//! [`Controller`] brings a controller up (NVMe base specification 1.4 §7.6.1: disable, admin
//! queue, enable, Identify, Set Features Number of Queues, I/O queue pairs), submits reads,
//! writes and flushes with PRPs for any buffer of whole 4 KiB pages, polls completions by phase
//! tag, enforces a timeout per command, and shuts the controller down (CC.SHN, §7.6.2) on
//! drop. Interrupts are not used: the driver polls, as SPDK does.
//!
//! # Memory a command may touch
//!
//! A command's data and PRP list pages may be written by the controller until its completion
//! has been reaped, or until the controller has been disabled or shut down (which stops all
//! DMA). The driver holds a clone of every such region in its in-flight table until then; if a
//! controller cannot be stopped (it stopped answering and ignores CC.EN), those clones are
//! leaked on purpose, so the memory is never unmapped under a device that may still write it.
//! A [`Dma`] implementation keeps its own clone of every region it mapped until
//! [`Dma::free`]; the driver frees a region only once no command can reach it.
//!
//! Regions are of two kinds: memory the [`Dma`] implementation allocated itself
//! ([`Dma::alloc`]: queues, PRP lists, the block engine's bounce slots), which the CPU reaches
//! through [`DmaRegion::volatile`], and memory lent by its owner ([`Dma::map_lent`]: a
//! [`crate::blockio::BufferPool`]'s region, for zero-copy I/O), which the driver maps and
//! names in commands but never reads or writes itself: the pool's `IoBuf`s are the CPU's only
//! way to it (docs/nvme.md, "Buffers").

mod controller;
#[cfg(any(test, feature = "vfio"))]
mod iova;
mod queue;

#[cfg(feature = "vfio")]
pub mod vfio;

#[cfg(any(test, feature = "fake-nvme"))]
pub mod fake;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

pub use controller::{Controller, ControllerStats};
pub use kvstack_firmware_interface::nvme::{ControllerInfo, NamespaceInfo, Status, Version};

use crate::Error;
use crate::pinned::{DeviceSharedRegion, LentRegion, VolatileView};

/// Access to a controller's BAR0. Offsets are bytes from the start of the BAR; an
/// implementation refuses an access outside the BAR ([`Error::NvmeRegister`]) rather than
/// touch other memory. Reads and writes are single volatile accesses of their width, in
/// program order (MMIO).
pub trait Registers: Send {
    /// Reads the 32-bit register at `offset` (4-byte aligned).
    ///
    /// # Errors
    /// [`Error::NvmeRegister`] outside the BAR or misaligned.
    fn read32(&self, offset: usize) -> Result<u32, Error>;
    /// Writes the 32-bit register at `offset`.
    ///
    /// # Errors
    /// As [`Registers::read32`].
    fn write32(&self, offset: usize, value: u32) -> Result<(), Error>;
    /// Reads the 64-bit register at `offset` (8-byte aligned).
    ///
    /// # Errors
    /// As [`Registers::read32`].
    fn read64(&self, offset: usize) -> Result<u64, Error>;
    /// Writes the 64-bit register at `offset`.
    ///
    /// # Errors
    /// As [`Registers::read32`].
    fn write64(&self, offset: usize, value: u64) -> Result<(), Error>;
}

/// Memory the controller can address. Regions are zero-filled, page aligned, contiguous in
/// IOVA space (byte `i` of a region is at `iova() + i`), and stay mapped for the device until
/// [`Dma::free`].
pub trait Dma: Send {
    /// Allocates and maps at least `bytes` bytes (rounded up to whole 4 KiB pages).
    ///
    /// # Errors
    /// The allocation or the mapping failed.
    fn alloc(&mut self, bytes: usize) -> Result<DmaRegion, Error>;
    /// Maps memory lent by its owner (a buffer pool's whole region, page aligned) at an IOVA
    /// the implementation chooses, as [`Dma::alloc`] maps its own: contiguous in IOVA space,
    /// kept alive (a clone of the region) until [`Dma::free`] has unmapped it.
    ///
    /// # Errors
    /// The mapping failed.
    fn map_lent(&mut self, mem: Arc<LentRegion>) -> Result<DmaRegion, Error>;
    /// Unmaps a region from the device. The caller guarantees that no command can still reach
    /// it (module docs).
    fn free(&mut self, region: DmaRegion);
    /// Whether `region` is one this implementation mapped and has not freed.
    fn is_mapped(&self, region: &DmaRegion) -> bool;
}

/// The memory behind a [`DmaRegion`].
#[derive(Clone, Debug)]
enum Memory {
    /// Allocated by the [`Dma`] implementation; the CPU uses volatile copies.
    Own(Arc<DeviceSharedRegion>),
    /// Lent by its owner (a buffer pool); the CPU reaches it only through the owner.
    Lent(Arc<LentRegion>),
}

/// A pinned region mapped for a device at an IOVA. Cloning shares the region (the memory
/// stays mapped in this process while any clone is alive).
#[derive(Clone, Debug)]
pub struct DmaRegion {
    mem: Memory,
    iova: u64,
}

impl DmaRegion {
    /// Wraps a region that a [`Dma`] implementation has allocated and mapped at `iova`.
    pub fn new(mem: Arc<DeviceSharedRegion>, iova: u64) -> DmaRegion {
        DmaRegion {
            mem: Memory::Own(mem),
            iova,
        }
    }

    /// Wraps lent memory that a [`Dma`] implementation has mapped at `iova`
    /// ([`Dma::map_lent`]).
    pub fn lent(mem: Arc<LentRegion>, iova: u64) -> DmaRegion {
        DmaRegion {
            mem: Memory::Lent(mem),
            iova,
        }
    }

    /// Whether the memory is lent (a buffer pool's) rather than the [`Dma`]'s own.
    pub fn is_lent(&self) -> bool {
        matches!(self.mem, Memory::Lent(_))
    }

    /// Start address and length in this process, for mapping the region (VFIO DMA maps).
    pub fn raw_parts(&self) -> (std::ptr::NonNull<u8>, usize) {
        match &self.mem {
            Memory::Own(m) => m.raw_parts(),
            Memory::Lent(m) => m.raw_parts(),
        }
    }

    /// The device address of byte 0.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.mem {
            Memory::Own(m) => m.len(),
            Memory::Lent(m) => m.len(),
        }
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The CPU's view of the bytes (volatile copies only). A lent region has none here: its
    /// bytes belong to its owner's handles (an `IoBuf` while the caller holds it), so the view
    /// is empty and every access is refused ([`Error::OutOfBounds`]).
    pub fn volatile(&self) -> VolatileView<'_> {
        match &self.mem {
            Memory::Own(m) => m.volatile(),
            Memory::Lent(_) => VolatileView::empty(),
        }
    }

    /// The device's view of the whole region, own or lent: what an emulated device (the fake
    /// controller) moves data through, as hardware does by DMA.
    ///
    /// # Safety
    /// As [`LentRegion::device_view`]: the bytes accessed must be those of a command in
    /// flight (for lent memory, a part whose handle the engine holds).
    pub unsafe fn device_view(&self) -> VolatileView<'_> {
        match &self.mem {
            Memory::Own(m) => m.volatile(),
            // SAFETY: the caller's contract is LentRegion::device_view's.
            Memory::Lent(m) => unsafe { m.device_view() },
        }
    }

    /// Whether two handles name the same mapping.
    pub fn same(&self, other: &DmaRegion) -> bool {
        let same_mem = match (&self.mem, &other.mem) {
            (Memory::Own(a), Memory::Own(b)) => Arc::ptr_eq(a, b),
            (Memory::Lent(a), Memory::Lent(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        same_mem && self.iova == other.iova
    }
}

/// A byte range of a [`DmaRegion`]: the data of one read or write. `offset` and `len` must be
/// multiples of 4 KiB and `len` a multiple of the namespace's block size.
#[derive(Clone, Debug)]
pub struct DmaSlice {
    /// The region.
    pub region: DmaRegion,
    /// Start within the region.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// Device to memory.
    Read,
    /// Memory to device.
    Write,
    /// Make every completed write durable (the namespace's volatile write cache).
    Flush,
}

impl IoKind {
    /// Lower-case name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            IoKind::Read => "read",
            IoKind::Write => "write",
            IoKind::Flush => "flush",
        }
    }
}

/// One I/O request on the configured namespace.
#[derive(Clone, Debug)]
pub struct IoRequest {
    /// Read, write or flush.
    pub kind: IoKind,
    /// First logical block (ignored by a flush).
    pub lba: u64,
    /// The data (required for reads and writes, `None` for a flush).
    pub buf: Option<DmaSlice>,
    /// The caller's tag, returned in the completion.
    pub tag: u64,
}

/// A finished request, with its buffer handed back.
#[derive(Debug)]
pub struct IoCompletion {
    /// The request's tag.
    pub tag: u64,
    /// The request's buffer.
    pub buf: Option<DmaSlice>,
    /// Success, or the controller's status ([`Error::NvmeCommand`]), a timeout, or an abort
    /// because the controller was reset.
    pub result: Result<(), Error>,
}

/// Options of [`Controller::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControllerOptions {
    /// The namespace to use (NSID, 1-based).
    pub namespace: u32,
    /// I/O queue pairs to ask for (the controller may grant fewer; at least 1).
    pub io_queues: u16,
    /// Entries per I/O queue (capped at CAP.MQES + 1; at least 2). A queue holds one entry
    /// fewer commands than it has entries.
    pub io_queue_entries: u16,
    /// Entries of the admin queue pair (2..=4096, capped at CAP.MQES + 1).
    pub admin_queue_entries: u16,
    /// Largest transfer per command in bytes (a multiple of 4 KiB; capped by MDTS): sizes the
    /// PRP list pages kept per command slot.
    pub max_transfer: usize,
    /// How long a command may take before the controller is declared failed.
    pub command_timeout: Duration,
}

impl Default for ControllerOptions {
    fn default() -> ControllerOptions {
        ControllerOptions {
            namespace: 1,
            io_queues: 1,
            io_queue_entries: 256,
            admin_queue_entries: 32,
            max_transfer: 1 << 20,
            command_timeout: Duration::from_secs(5),
        }
    }
}
