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

mod controller;
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
use crate::pinned::{DeviceSharedRegion, VolatileView};

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
    /// Unmaps a region from the device. The caller guarantees that no command can still reach
    /// it (module docs).
    fn free(&mut self, region: DmaRegion);
    /// Whether `region` is one this implementation mapped and has not freed.
    fn is_mapped(&self, region: &DmaRegion) -> bool;
}

/// A pinned region mapped for a device at an IOVA. Cloning shares the region (the memory
/// stays mapped in this process while any clone is alive).
#[derive(Clone, Debug)]
pub struct DmaRegion {
    mem: Arc<DeviceSharedRegion>,
    iova: u64,
}

impl DmaRegion {
    /// Wraps a region that a [`Dma`] implementation has mapped at `iova`.
    pub fn new(mem: Arc<DeviceSharedRegion>, iova: u64) -> DmaRegion {
        DmaRegion { mem, iova }
    }

    /// The device address of byte 0.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The CPU's view of the bytes (volatile copies only).
    pub fn volatile(&self) -> VolatileView<'_> {
        self.mem.volatile()
    }

    /// The shared memory (for a [`Dma`] implementation's own bookkeeping).
    pub fn memory(&self) -> &Arc<DeviceSharedRegion> {
        &self.mem
    }

    /// Whether two handles name the same mapping.
    pub fn same(&self, other: &DmaRegion) -> bool {
        Arc::ptr_eq(&self.mem, &other.mem) && self.iova == other.iova
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
