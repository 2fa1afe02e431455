//! Reading input files with bounds: only regular files, at most a stated number of bytes, so
//! that a wrong path (`/dev/zero`, a FIFO, a directory, a multi-gigabyte file given as a
//! config) is refused with a clear error instead of hanging or exhausting memory.

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Most bytes of a model config file (real ones are a few kilobytes).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Why a file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// It could not be opened or read.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// It is not a regular file.
    #[error("not a regular file ({kind})")]
    NotAFile {
        /// What it is: `directory`, `character device`, `FIFO`, ...
        kind: &'static str,
    },
    /// It is larger than the limit for its kind.
    #[error("{bytes} bytes is more than the {limit}-byte limit")]
    TooLarge {
        /// Its size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// Opens `path` for reading if it is a regular file (symbolic links followed) of at most
/// `limit` bytes; returns the file and its size.
///
/// # Errors
/// [`FileError`].
pub fn open_regular(path: &Path, limit: u64) -> Result<(File, u64), FileError> {
    let file = File::open(path)?;
    // The type and size of the opened file, not of the path: it cannot change in between.
    let meta = file.metadata()?;
    let ft = meta.file_type();
    if !ft.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            "directory"
        } else if ft.is_char_device() {
            "character device"
        } else if ft.is_block_device() {
            "block device"
        } else if ft.is_fifo() {
            "FIFO"
        } else if ft.is_socket() {
            "socket"
        } else {
            "special file"
        };
        return Err(FileError::NotAFile { kind });
    }
    if meta.len() > limit {
        return Err(FileError::TooLarge {
            bytes: meta.len(),
            limit,
        });
    }
    Ok((file, meta.len()))
}

/// Reads a whole regular file of at most `limit` bytes (a file that grows while it is read
/// is cut at the limit and refused).
///
/// # Errors
/// [`FileError`].
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    let (file, len) = open_regular(path, limit)?;
    let mut buf = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut buf)?;
    let read = buf.len() as u64;
    if read > limit {
        return Err(FileError::TooLarge { bytes: read, limit });
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_and_large_files_are_refused() {
        assert!(matches!(
            read_regular(Path::new("/dev/zero"), 1 << 20),
            Err(FileError::NotAFile {
                kind: "character device"
            })
        ));
        assert!(matches!(
            read_regular(Path::new("/"), 1 << 20),
            Err(FileError::NotAFile { kind: "directory" })
        ));
        let p = std::env::temp_dir().join(format!("kvstack-files-{}", std::process::id()));
        std::fs::write(&p, vec![b'x'; 100]).unwrap();
        assert_eq!(read_regular(&p, 100).unwrap().len(), 100);
        assert!(matches!(
            read_regular(&p, 99),
            Err(FileError::TooLarge {
                bytes: 100,
                limit: 99
            })
        ));
        let _ = std::fs::remove_file(&p);
    }
}
