//! Opening, sizing, preallocating and syncing the files an engine works on: segment files in a
//! directory, one preallocated file, or a raw block device.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, OFlag, fallocate};

/// How to open a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenMode {
    /// Open for writing too.
    pub write: bool,
    /// Create it if missing (implies `write`).
    pub create: bool,
    /// `O_DIRECT`.
    pub direct: bool,
}

/// Opens `path` as `mode` says.
///
/// # Errors
/// The OS error of `open(2)` (errno kept).
pub fn open_file(path: &Path, mode: OpenMode) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true)
        .write(mode.write || mode.create)
        .create(mode.create);
    if mode.direct {
        o.custom_flags(OFlag::O_DIRECT.bits());
    }
    o.open(path)
}

/// Size of a regular file or a block device, in bytes (a block device's size is where a seek
/// to its end lands).
///
/// # Errors
/// The OS error of `fstat` or `lseek`.
pub fn file_size(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

/// Reserves `len` bytes of blocks for a regular file (`fallocate`), so later writes do not
/// allocate; falls back to extending the file with `set_len` where the file system has no
/// `fallocate`.
///
/// # Errors
/// The OS error of `fallocate` or `ftruncate`.
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    let Ok(off_len) = len.try_into() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "length too large",
        ));
    };
    match fallocate(file, FallocateFlags::empty(), 0, off_len) {
        Ok(()) => Ok(()),
        Err(Errno::EOPNOTSUPP | Errno::ENOSYS) => file.set_len(len),
        Err(e) => Err(e.into()),
    }
}

/// Makes a directory's entries durable (after creating, renaming or removing files in it).
///
/// # Errors
/// The OS error of `open` or `fsync`.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}
