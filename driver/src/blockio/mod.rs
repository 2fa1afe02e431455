//! Block I/O engines for the SSD tier: io_uring with `O_DIRECT` and registered (pinned)
//! buffers, a synchronous `pread`/`pwrite` fallback, and [`NvmeEngine`] over the userspace NVMe
//! driver's queues (docs/nvme.md, "The block engine").
//!
//! An engine moves whole, 4 KiB-aligned records between [`IoBuf`]s and an [`IoTarget`]: a file
//! (segment files, a preallocated file or a raw block device) or a namespace of an NVMe
//! controller driven from userspace. Its interface is submit/complete with **owned
//! buffers**: [`BlockEngine::submit`] takes an [`IoOp`] (buffer and target included) and the
//! engine keeps it in its in-flight table until the operation's completion has been reaped;
//! [`BlockEngine::wait`] hands the buffer back in a [`Completion`]. A buffer can therefore never
//! be reused, freed or read by the CPU while the kernel may still write it (see the DMA
//! contract in [`buffer`]). Dropping an engine with operations in flight waits for them; if it
//! cannot (the ring failed), it leaks their buffers on purpose and logs it.
//!
//! Which engine runs is decided by probes ([`choose_engine`]), and the choice is logged:
//! - io_uring ring creation works and the file system accepts `O_DIRECT`: [`EngineKind::Uring`]
//!   with direct I/O and the buffer pool registered as fixed buffers (plain reads and writes if
//!   registration is refused);
//! - the file system refuses `O_DIRECT` (tmpfs): [`EngineKind::Sync`], buffered;
//! - no io_uring (old kernel, `io_uring_disabled`, seccomp): [`EngineKind::Sync`] with direct
//!   I/O where the file system allows it.

#[cfg(test)]
pub(crate) mod bench;
pub mod buffer;
pub mod file;
mod nvme_engine;
mod sync;
mod uring;

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

pub use buffer::{BUFFER_ALIGN, BufferPool, IoBuf};
pub use file::{OpenMode, file_size, open_file, preallocate, sync_dir};
pub use nvme_engine::{
    CopyStats, NvmeEngine, NvmeNamespace, NvmeOpener, NvmeShared, WeakNvmeShared,
};
pub use sync::SyncEngine;
pub use uring::UringEngine;

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum OpKind {
    /// File to buffer.
    Read,
    /// Buffer to file.
    Write,
}

impl OpKind {
    /// Lower-case name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
        }
    }
}

/// A namespace of an NVMe controller that a userspace engine drives: the geometry an
/// operation on it must fit (whole logical blocks below the capacity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct NamespaceTarget {
    /// Namespace identifier (NSID, 1-based).
    pub nsid: u32,
    /// Bytes per logical block (LBA size).
    pub block_bytes: u64,
    /// Logical blocks in the namespace (NSZE).
    pub blocks: u64,
}

impl NamespaceTarget {
    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.blocks.saturating_mul(self.block_bytes)
    }
}

/// Where an operation's bytes go or come from. A file engine (io_uring, sync) accepts only
/// [`IoTarget::File`]; the NVMe engine only its own controller's [`IoTarget::Namespace`].
#[derive(Clone, Debug)]
pub enum IoTarget {
    /// A kernel file; the engine holds it open until completion, so its descriptor cannot be
    /// reused for another file while the operation is in flight.
    File(Arc<File>),
    /// A namespace of a controller driven by the userspace NVMe driver.
    Namespace(NamespaceTarget),
}

impl IoTarget {
    /// The file, when the target is one.
    pub fn file(&self) -> Option<&Arc<File>> {
        match self {
            IoTarget::File(f) => Some(f),
            IoTarget::Namespace(_) => None,
        }
    }

    /// The target in words, for errors.
    pub fn describe(&self) -> String {
        match self {
            IoTarget::File(_) => "a file".to_owned(),
            IoTarget::Namespace(ns) => format!("NVMe namespace {}", ns.nsid),
        }
    }
}

impl From<Arc<File>> for IoTarget {
    fn from(file: Arc<File>) -> IoTarget {
        IoTarget::File(file)
    }
}

/// One operation: `len` bytes between the start of `buf` and `target` at `offset`. With direct
/// I/O, `offset` and `len` must be multiples of 4 KiB (the buffer always is aligned); on an
/// NVMe namespace, multiples of its block size.
#[derive(Debug)]
pub struct IoOp {
    /// Direction.
    pub kind: OpKind,
    /// Where the bytes go or come from; held by the engine until completion.
    pub target: IoTarget,
    /// Byte offset in the target.
    pub offset: u64,
    /// Bytes to move (at most `buf.len()`).
    pub len: usize,
    /// The buffer, owned by the engine until completion.
    pub buf: IoBuf,
    /// The caller's tag, returned in the completion.
    pub tag: u64,
}

/// A finished operation, with its buffer and target handed back.
#[derive(Debug)]
pub struct Completion {
    /// The submitted operation (buffer included).
    pub op: IoOp,
    /// Bytes moved (less than `op.len` only for a read that reached the end of the file), or
    /// the error (errno kept).
    pub result: io::Result<usize>,
}

/// A submission that was not accepted, with ownership of the operation returned.
#[derive(Debug)]
pub struct SubmitError {
    /// The operation, untouched.
    pub op: Box<IoOp>,
    /// Why.
    pub error: io::Error,
}

/// Which engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum EngineKind {
    /// io_uring, several operations in flight.
    Uring,
    /// Synchronous `pread`/`pwrite` on the calling thread.
    Sync,
    /// The userspace NVMe driver: commands on a controller's queues, completions polled.
    Nvme,
}

impl EngineKind {
    /// Lower-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "io_uring",
            EngineKind::Sync => "pread/pwrite",
            EngineKind::Nvme => "userspace NVMe",
        }
    }
}

/// The engine interface: submit owned operations, reap completions.
pub trait BlockEngine: Send {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;

    /// Whether files should be opened with `O_DIRECT` for this engine.
    fn direct(&self) -> bool;

    /// Whether the engine uses registered (fixed) buffers for `pool`'s buffers.
    fn registered(&self) -> bool;

    /// Most operations in flight at once.
    fn depth(&self) -> usize;

    /// Operations submitted and not yet returned by [`BlockEngine::wait`].
    fn in_flight(&self) -> usize;

    /// Queues `op`. The engine owns it (buffer and file) until [`BlockEngine::wait`] returns
    /// it. Fails, returning the operation, when `depth` operations are already in flight or
    /// the operation is malformed (`len` larger than its buffer).
    ///
    /// # Errors
    /// [`SubmitError`] with the operation.
    fn submit(&mut self, op: IoOp) -> Result<(), SubmitError>;

    /// Pushes queued submissions to the kernel, waits until at least `min` operations have
    /// completed (capped at the number in flight) and appends every completed operation to
    /// `out`. Returns how many were appended.
    ///
    /// # Errors
    /// The ring's own failure (not an operation's: those are in [`Completion::result`]).
    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<usize>;

    /// Makes every write to `target` that completed before this call durable: `fdatasync` for
    /// a file, the NVMe Flush command for a namespace. Operations still in flight are not
    /// covered (reap them first). Blocks until done.
    ///
    /// # Errors
    /// The flush's own error, or [`crate::Error::BlockTarget`] (kind `InvalidInput`) for a
    /// target this engine cannot reach.
    fn flush(&mut self, target: &IoTarget) -> io::Result<()>;
}

/// [`BlockEngine::flush`] of the file engines: `fdatasync`, exactly what the SSD tier called
/// before targets existed.
pub(crate) fn flush_file(engine: &'static str, target: &IoTarget) -> io::Result<()> {
    match target {
        IoTarget::File(f) => f.sync_data(),
        IoTarget::Namespace(_) => Err(wrong_target("flush", engine, target)),
    }
}

/// The error of a file engine given a target that is not a file.
pub(crate) fn wrong_target(op: &'static str, engine: &'static str, target: &IoTarget) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        crate::Error::BlockTarget {
            op,
            engine,
            reason: format!("it moves data to files only, not to {}", target.describe()),
        },
    )
}

/// What to run, as configured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum EnginePreference {
    /// Decide by probes (module docs).
    #[default]
    Auto,
    /// io_uring with direct I/O; fails if either is unavailable.
    Uring,
    /// Synchronous, buffered I/O.
    SyncBuffered,
    /// Synchronous direct I/O.
    SyncDirect,
}

/// The engine [`choose_engine`] chose and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineChoice {
    /// The engine.
    pub kind: EngineKind,
    /// Direct I/O.
    pub direct: bool,
    /// Fixed buffers registered.
    pub registered: bool,
    /// Why, in words (the probe results).
    pub reason: String,
}

/// Builds the engine for files under `dir` (or the directory holding a device file): probes
/// io_uring and `O_DIRECT` as described in the module docs, logs the choice, and registers
/// `pool` with the ring when the engine is io_uring.
///
/// # Errors
/// Only when a specific engine was required ([`EnginePreference::Uring`]) and is unavailable,
/// or a ring the probe created cannot be created again.
pub fn choose_engine(
    dir: &Path,
    depth: usize,
    pool: &BufferPool,
    preference: EnginePreference,
) -> io::Result<(Box<dyn BlockEngine>, EngineChoice)> {
    let depth = depth.max(1);
    let (engine, reason): (Box<dyn BlockEngine>, String) = match preference {
        EnginePreference::SyncBuffered => (
            Box::new(SyncEngine::new(depth, false)),
            "configured: synchronous buffered I/O".to_owned(),
        ),
        EnginePreference::SyncDirect => (
            Box::new(SyncEngine::new(depth, true)),
            "configured: synchronous direct I/O".to_owned(),
        ),
        EnginePreference::Uring => {
            let e = UringEngine::new(depth, Some(pool))?;
            (Box::new(e), "configured: io_uring with O_DIRECT".to_owned())
        }
        EnginePreference::Auto => {
            let direct = crate::probe::probe_o_direct(dir);
            let ring = crate::probe::probe_io_uring();
            if !direct.available {
                (
                    Box::new(SyncEngine::new(depth, false)),
                    format!(
                        "O_DIRECT unavailable on {} ({}): synchronous buffered pread/pwrite",
                        dir.display(),
                        direct.detail
                    ),
                )
            } else if !ring.available {
                (
                    Box::new(SyncEngine::new(depth, true)),
                    format!(
                        "io_uring unavailable ({}): synchronous pread/pwrite with O_DIRECT",
                        ring.detail
                    ),
                )
            } else {
                match UringEngine::new(depth, Some(pool)) {
                    Ok(e) => (
                        Box::new(e),
                        format!(
                            "io_uring ({}) and O_DIRECT ({})",
                            ring.detail, direct.detail
                        ),
                    ),
                    Err(err) => (
                        Box::new(SyncEngine::new(depth, true)),
                        format!(
                            "io_uring ring of depth {depth} failed ({err}): synchronous \
                             pread/pwrite with O_DIRECT"
                        ),
                    ),
                }
            }
        }
    };
    let choice = EngineChoice {
        kind: engine.kind(),
        direct: engine.direct(),
        registered: engine.registered(),
        reason,
    };
    log::info!(
        "block I/O engine for {}: {} (direct I/O: {}, fixed buffers: {}, depth {}): {}",
        dir.display(),
        choice.kind.name(),
        choice.direct,
        choice.registered,
        depth,
        choice.reason
    );
    Ok((engine, choice))
}
