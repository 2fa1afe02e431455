//! Ownership of a data location: an advisory `flock` on the data directory (or on the device
//! file of a device store), exclusive for the one process that writes, shared for readers.
//!
//! The lock is taken on the location itself, not on a pid file: the kernel releases it when the
//! holder exits or is killed, so a stale lock cannot outlive its process and nothing has to
//! guess whether a recorded pid is still alive. The exclusive holder of a directory also
//! writes [`OWNER_FILE`] (pid, start time, command) so that a refused opener can say who holds
//! the directory; which processes really hold a lock is read from `/proc/locks`, so a stale
//! owner file is never believed.
//!
//! `flock` locks belong to the open file description: they are not inherited across `exec`
//! (the descriptor is opened close-on-exec) and are independent of other descriptors of the
//! same file in this process, so two stores opened on one directory in one process also
//! exclude each other.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};

use crate::Error;

/// The file in a data directory where its exclusive holder records itself.
pub const OWNER_FILE: &str = "kvstack.lock";

/// Most bytes of the owner file that are read (it holds three short lines).
const OWNER_FILE_LIMIT: u64 = 4096;

/// How a location is locked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    /// One writer: no other process may hold any lock on the location.
    Exclusive,
    /// A reader: any number may hold it together, but no writer.
    Shared,
}

/// A process that holds a lock on a location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Its process id.
    pub pid: u32,
    /// Whether it holds the exclusive (write) lock.
    pub exclusive: bool,
    /// What it is (`kvstackd ...`, `kvstack run ...`): from the owner file when that names
    /// this pid, else from `/proc/PID/cmdline`; empty when neither can be read.
    pub command: String,
    /// Seconds since it took the lock, when the owner file records it.
    pub held_seconds: Option<u64>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}", self.pid)?;
        let mut parts = Vec::new();
        if !self.command.is_empty() {
            parts.push(self.command.clone());
        }
        if !self.exclusive {
            parts.push("reading".to_owned());
        }
        if let Some(s) = self.held_seconds {
            parts.push(format!("for {s} s"));
        }
        if !parts.is_empty() {
            write!(f, " ({})", parts.join(", "))?;
        }
        Ok(())
    }
}

/// A held lock on a data location; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct LocationLock {
    _lock: Flock<File>,
    path: PathBuf,
    mode: LockMode,
}

impl LocationLock {
    /// The locked location.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How it is locked.
    pub fn mode(&self) -> LockMode {
        self.mode
    }
}

/// What [`try_lock`] found.
#[derive(Debug)]
pub enum LockOutcome {
    /// The lock is held by this process now.
    Locked(LocationLock),
    /// Another process holds a conflicting lock (the holders that `/proc/locks` names; empty
    /// when it cannot be read).
    Busy(Vec<Holder>),
}

/// Takes a lock on `path` (a directory, or the file or block device of a device store)
/// without waiting. With [`LockMode::Exclusive`] on a directory, also records this process in
/// its [`OWNER_FILE`].
///
/// # Errors
/// [`Error::LockIo`] when the location cannot be opened or locked for a reason other than
/// another holder (no such directory, permissions, a file system without `flock`).
pub fn try_lock(path: &Path, mode: LockMode) -> Result<LockOutcome, Error> {
    let io = |what: &'static str| {
        let path = path.to_path_buf();
        move |source: std::io::Error| Error::LockIo { what, path, source }
    };
    // O_RDONLY suffices for flock on any file type, a directory included; O_CLOEXEC (std's
    // default) keeps the lock out of spawned tools.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(io("cannot open for locking"))?;
    let arg = match mode {
        LockMode::Exclusive => FlockArg::LockExclusiveNonblock,
        LockMode::Shared => FlockArg::LockSharedNonblock,
    };
    let lock = match Flock::lock(file, arg) {
        Ok(l) => l,
        Err((file, Errno::EWOULDBLOCK)) => {
            let holders = holders_of(path, &file);
            return Ok(LockOutcome::Busy(holders));
        }
        Err((_, e)) => return Err(io("cannot lock")(e.into())),
    };
    if mode == LockMode::Exclusive && path.is_dir() {
        record_owner(&path.join(OWNER_FILE)).map_err(io("cannot record the owner in"))?;
    }
    Ok(LockOutcome::Locked(LocationLock {
        _lock: lock,
        path: path.to_path_buf(),
        mode,
    }))
}

/// Writes this process's pid, start time and command line to the owner file.
fn record_owner(file: &Path) -> std::io::Result<()> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut command: String = std::env::args().collect::<Vec<_>>().join(" ");
    command.retain(|c| c != '\n');
    command.truncate(200);
    let text = format!(
        "pid={}\nlocked_at_unix={now}\ncommand={command}\n",
        std::process::id()
    );
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(OFlag::O_NOFOLLOW.bits())
        .open(file)?;
    f.write_all(text.as_bytes())
}

/// The owner file's record: `(pid, locked_at_unix, command)`.
fn read_owner(file: &Path) -> Option<(u32, u64, String)> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(OFlag::O_NOFOLLOW.bits())
        .open(file)
        .ok()?;
    let mut text = String::new();
    f.take(OWNER_FILE_LIMIT).read_to_string(&mut text).ok()?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
            .map(str::to_owned)
    };
    Some((
        field("pid")?.parse().ok()?,
        field("locked_at_unix")?.parse().ok()?,
        field("command").unwrap_or_default(),
    ))
}

/// The processes that hold a `flock` on `file` (the file at `path`), from `/proc/locks`.
fn holders_of(path: &Path, file: &File) -> Vec<Holder> {
    let Ok(meta) = file.metadata() else {
        return Vec::new();
    };
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    let owner = if path.is_dir() {
        read_owner(&path.join(OWNER_FILE))
    } else {
        None
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let dev = meta.dev();
    let dev_id = format!(
        "{:02x}:{:02x}:{}",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev),
        meta.ino()
    );
    let mut holders: Vec<Holder> = parse_proc_locks(&locks, &dev_id)
        .into_iter()
        .map(|(pid, exclusive)| {
            let (command, held_seconds) = match &owner {
                Some((p, at, cmd)) if *p == pid && exclusive => {
                    (cmd.clone(), Some(now.saturating_sub(*at)))
                }
                _ => (cmdline(pid), None),
            };
            Holder {
                pid,
                exclusive,
                command,
                held_seconds,
            }
        })
        .collect();
    holders.sort_by_key(|h| (!h.exclusive, h.pid));
    holders.dedup_by_key(|h| h.pid);
    holders
}

/// `(pid, exclusive)` of every granted `FLOCK` entry of `/proc/locks` on the inode `dev_id`
/// (`MAJOR:MINOR:INODE`, the numbers in hex, hex, decimal as the kernel prints them).
/// Waiting requests (`->` lines) hold nothing and are skipped.
fn parse_proc_locks(text: &str, dev_id: &str) -> Vec<(u32, bool)> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // "1: FLOCK ADVISORY WRITE 1234 fd:01:5678 0 EOF"
            if f.get(1) != Some(&"FLOCK") || f.get(5) != Some(&dev_id) {
                return None;
            }
            let exclusive = *f.get(3)? == "WRITE";
            Some((f.get(4)?.parse().ok()?, exclusive))
        })
        .collect()
}

/// `/proc/PID/cmdline` with its NULs as spaces, shortened; empty when unreadable.
fn cmdline(pid: u32) -> String {
    let mut s = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .trim_end_matches('\0')
                .replace('\0', " ")
        })
        .unwrap_or_default();
    s.truncate(200);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_locks_lines_name_the_holders_of_one_inode() {
        let text = "1: FLOCK  ADVISORY  WRITE 4242 fd:01:123 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 4343 fd:01:123 0 EOF\n\
                    2: FLOCK  ADVISORY  READ  77 fd:01:123 0 EOF\n\
                    3: POSIX  ADVISORY  WRITE 88 fd:01:123 0 EOF\n\
                    4: FLOCK  ADVISORY  WRITE 99 fd:01:1234 0 EOF\n";
        assert_eq!(
            parse_proc_locks(text, "fd:01:123"),
            vec![(4242, true), (77, false)]
        );
    }

    #[test]
    fn a_second_exclusive_lock_in_one_process_is_refused_and_names_this_process() {
        let dir = std::env::temp_dir().join(format!("kvstack-lock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let LockOutcome::Locked(first) = try_lock(&dir, LockMode::Exclusive).unwrap() else {
            panic!("the first lock must be taken");
        };
        assert_eq!(first.mode(), LockMode::Exclusive);
        let owner = read_owner(&dir.join(OWNER_FILE)).unwrap();
        assert_eq!(owner.0, std::process::id());
        match try_lock(&dir, LockMode::Shared).unwrap() {
            LockOutcome::Busy(h) => {
                // /proc/locks is there on Linux; the holder is this very process.
                if std::path::Path::new("/proc/locks").exists() {
                    assert_eq!(h.len(), 1, "{h:?}");
                    assert_eq!(h[0].pid, std::process::id());
                    assert!(h[0].exclusive);
                    assert!(h[0].held_seconds.is_some());
                }
            }
            LockOutcome::Locked(_) => panic!("a reader must not get past a writer"),
        }
        drop(first);
        let LockOutcome::Locked(a) = try_lock(&dir, LockMode::Shared).unwrap() else {
            panic!("released");
        };
        let LockOutcome::Locked(_b) = try_lock(&dir, LockMode::Shared).unwrap() else {
            panic!("readers share");
        };
        assert!(matches!(
            try_lock(&dir, LockMode::Exclusive).unwrap(),
            LockOutcome::Busy(_)
        ));
        drop(a);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_location_is_an_error_naming_it() {
        let e = try_lock(Path::new("/nonexistent/kvstack"), LockMode::Shared).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/kvstack"), "{e}");
    }
}
