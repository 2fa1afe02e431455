//! kvstack's device and memory layer.
//!
//! This crate answers "what does this machine offer the stack?" ([`probe`]): memory,
//! locked-memory limit, huge pages, io_uring, O_DIRECT on a data directory and the CUDA driver.
//! Pinned host buffers ([`pinned`], [`reserve`]), the block I/O engines of the SSD tier
//! ([`blockio`]: io_uring with registered buffers, or synchronous pread/pwrite) and GPU memory
//! build on these probes: features decide what is compiled, a probe decides what runs, and the
//! choice is logged.
//!
//! Nothing here requires special hardware: every probe reports absence plainly instead of
//! failing.

pub mod blockio;
pub mod lock;
pub mod nvme;
mod os;
pub mod pinned;
pub mod probe;
pub mod reserve;

pub use pinned::{DeviceSharedRegion, PinnedOptions, PinnedRegion, VolatileView};
pub use probe::{HostReport, probe_host};
pub use reserve::GrowableRegion;

/// Errors of the driver layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A data location could not be opened or locked (not because another process holds it:
    /// that is [`lock::LockOutcome::Busy`]).
    #[error("{what} {}", path.display())]
    LockIo {
        /// What was being done.
        what: &'static str,
        /// The location.
        path: std::path::PathBuf,
        /// The OS error (errno kept).
        #[source]
        source: std::io::Error,
    },
    /// A pinned region of zero bytes was requested.
    #[error("a pinned region must not be empty")]
    ZeroSizedRegion,
    /// The requested size overflows when rounded up to whole pages.
    #[error("a pinned region of {bytes} bytes is too large to map")]
    RegionTooLarge {
        /// Bytes requested.
        bytes: usize,
    },
    /// `mmap` failed.
    #[error("cannot map {bytes} bytes of anonymous memory")]
    Map {
        /// Bytes asked of mmap.
        bytes: usize,
        /// The OS error (errno kept).
        #[source]
        source: std::io::Error,
    },
    /// `mlock` failed and locking was required.
    #[error(
        "cannot lock {bytes} bytes in memory (raise RLIMIT_MEMLOCK: `ulimit -l`, LimitMEMLOCK=)"
    )]
    Lock {
        /// Bytes to lock.
        bytes: usize,
        /// The OS error (errno kept).
        #[source]
        source: std::io::Error,
    },
    /// A growable region was asked to commit more than it reserved.
    #[error("cannot commit {requested} bytes of a region that reserved {capacity}")]
    CapacityExceeded {
        /// Bytes asked for.
        requested: usize,
        /// Bytes reserved.
        capacity: usize,
    },
    /// The kernel refused to commit (or decommit) a range of a growable region.
    #[error("cannot commit {bytes} bytes at offset {offset} of a reserved region")]
    Commit {
        /// Start of the range within the region.
        offset: usize,
        /// Length of the range.
        bytes: usize,
        /// The OS error (errno kept).
        #[source]
        source: std::io::Error,
    },
    /// A BAR access outside the BAR, or misaligned for its width.
    #[error("register access of {width} bytes at offset {offset:#x} is outside BAR0 or misaligned")]
    NvmeRegister {
        /// Byte offset in the BAR.
        offset: usize,
        /// Bytes accessed.
        width: usize,
    },
    /// The NVMe controller lacks something the driver needs.
    #[error("NVMe controller: unsupported {what}")]
    NvmeUnsupported {
        /// What.
        what: String,
    },
    /// The NVMe controller did not answer in time.
    #[error("NVMe {what}: no answer after {after:?}")]
    NvmeTimeout {
        /// What was awaited.
        what: String,
        /// How long.
        after: std::time::Duration,
    },
    /// CSTS.CFS: the controller reports a fatal error; only a reset recovers it.
    #[error("NVMe controller fatal status (CSTS.CFS) while {during}")]
    NvmeFatal {
        /// What the driver was doing.
        during: &'static str,
    },
    /// Register reads return all ones: the device is gone.
    #[error("NVMe controller registers read as all ones: the device was removed")]
    NvmeRemoved,
    /// The controller returned data that does not decode (CAP, Identify).
    #[error("NVMe controller returned invalid data")]
    NvmeFormat(#[source] kvstack_firmware_interface::Error),
    /// A command completed with an error status.
    #[error("NVMe {command} failed: {status}")]
    NvmeCommand {
        /// The command.
        command: &'static str,
        /// Its status (type and code).
        status: kvstack_firmware_interface::nvme::Status,
    },
    /// A command was aborted by the driver (reset, or another command's timeout).
    #[error("NVMe {command} aborted: {reason}")]
    NvmeAborted {
        /// The command.
        command: &'static str,
        /// Why.
        reason: String,
    },
    /// The controller failed earlier and must be reset before new commands.
    #[error("NVMe controller unusable: {reason}")]
    NvmeFailed {
        /// What happened.
        reason: String,
    },
    /// A request the driver refuses before sending it.
    #[error("NVMe request refused: {reason}")]
    NvmeRequest {
        /// Why.
        reason: String,
    },
    /// The queue has no free entry.
    #[error("NVMe I/O queue {queue} is full")]
    NvmeQueueFull {
        /// Queue id.
        queue: u16,
    },
    /// A VFIO step failed (opening the device, mapping BAR0, an IOMMU mapping).
    #[error("VFIO {what}: {reason}")]
    Vfio {
        /// The step.
        what: &'static str,
        /// Why (the ioctl's error).
        reason: String,
    },
    /// A volatile access outside its view.
    #[error("access of {count} bytes at offset {offset} is outside a {len}-byte region")]
    OutOfBounds {
        /// Start of the access.
        offset: usize,
        /// Bytes accessed.
        count: usize,
        /// Length of the view.
        len: usize,
    },
    /// A block-I/O operation the engine cannot carry out on its target (a file engine given
    /// an NVMe namespace, or the reverse), or whose range does not fit the target's blocks.
    #[error("block I/O {op} refused by the {engine} engine: {reason}")]
    BlockTarget {
        /// The operation (`read`, `write`, `flush`).
        op: &'static str,
        /// The engine's name.
        engine: &'static str,
        /// Why, with the numbers.
        reason: String,
    },
}
