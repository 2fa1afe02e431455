//! The synchronous fallback engine: each operation runs with `pread`/`pwrite` on the calling
//! thread inside [`BlockEngine::submit`]; [`BlockEngine::wait`] hands back the finished ones.
//! Used where the file system refuses `O_DIRECT` (tmpfs: buffered I/O) or io_uring is
//! unavailable.

use std::collections::VecDeque;
use std::io;
use std::os::unix::fs::FileExt;

use super::{
    BlockEngine, Completion, EngineKind, IoOp, IoTarget, OpKind, SubmitError, flush_file,
    wrong_target,
};

/// Synchronous `pread`/`pwrite` engine.
#[derive(Debug)]
pub struct SyncEngine {
    depth: usize,
    direct: bool,
    done: VecDeque<Completion>,
}

impl SyncEngine {
    /// An engine that holds up to `depth` finished operations until they are reaped; `direct`
    /// says whether its files are opened with `O_DIRECT`.
    pub fn new(depth: usize, direct: bool) -> SyncEngine {
        SyncEngine {
            depth: depth.max(1),
            direct,
            done: VecDeque::new(),
        }
    }
}

fn run(op: &mut IoOp) -> io::Result<usize> {
    let Some(file) = op.target.file().cloned() else {
        return Err(wrong_target(op.kind.name(), "pread/pwrite", &op.target));
    };
    let mut done = 0;
    while done < op.len {
        let off = op.offset + done as u64;
        let r = match op.kind {
            OpKind::Read => {
                let dst = op
                    .buf
                    .as_mut_slice()
                    .get_mut(done..op.len)
                    .unwrap_or_default();
                file.read_at(dst, off)
            }
            OpKind::Write => {
                let src = op.buf.as_slice().get(done..op.len).unwrap_or_default();
                file.write_at(src, off)
            }
        };
        match r {
            Ok(0) if op.kind == OpKind::Read => break,
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write made no progress",
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl BlockEngine for SyncEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Sync
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn registered(&self) -> bool {
        false
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn submit(&mut self, mut op: IoOp) -> Result<(), SubmitError> {
        if op.len > op.buf.len() || op.len == 0 {
            return Err(SubmitError {
                error: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("length {} outside 1..={}", op.len, op.buf.len()),
                ),
                op: Box::new(op),
            });
        }
        if self.done.len() >= self.depth {
            return Err(SubmitError {
                error: io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} operations already in flight", self.depth),
                ),
                op: Box::new(op),
            });
        }
        let result = run(&mut op);
        self.done.push_back(Completion { op, result });
        Ok(())
    }

    fn wait(&mut self, _min: usize, out: &mut Vec<Completion>) -> io::Result<usize> {
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }

    fn flush(&mut self, target: &IoTarget) -> io::Result<()> {
        flush_file("pread/pwrite", target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockio::{BufferPool, OpenMode, open_file};
    use crate::pinned::{HugePages, Locking, PinnedOptions};
    use std::sync::Arc;

    #[test]
    fn writes_and_reads_back_and_reports_end_of_file() {
        let path = std::env::temp_dir().join(format!("kvstack-sync-test-{}", std::process::id()));
        let f = Arc::new(
            open_file(
                &path,
                OpenMode {
                    write: true,
                    create: true,
                    direct: false,
                },
            )
            .unwrap(),
        );
        let pool = BufferPool::new(
            2,
            8192,
            PinnedOptions {
                huge_pages: HugePages::Never,
                locking: Locking::Never,
            },
        )
        .unwrap();
        let mut e = SyncEngine::new(1, false);
        let mut buf = pool.try_get().unwrap();
        buf.as_mut_slice().fill(9);
        let op = |kind, buf, len| IoOp {
            kind,
            target: Arc::clone(&f).into(),
            offset: 0,
            len,
            buf,
            tag: 1,
        };
        e.submit(op(OpKind::Write, buf, 4096)).unwrap();
        // Depth 1: a second operation waits until the first is reaped.
        let b2 = pool.try_get().unwrap();
        let refused = e.submit(op(OpKind::Read, b2, 8192)).unwrap_err();
        let mut out = Vec::new();
        assert_eq!(e.wait(1, &mut out).unwrap(), 1);
        assert_eq!(*out[0].result.as_ref().unwrap(), 4096);
        out.clear();
        e.submit(*refused.op).unwrap();
        e.wait(1, &mut out).unwrap();
        // The file holds 4096 bytes: the 8192-byte read stops at its end.
        assert_eq!(*out[0].result.as_ref().unwrap(), 4096);
        assert!(out[0].op.buf.as_slice()[..4096].iter().all(|&b| b == 9));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn flushes_files_and_refuses_namespaces_by_name() {
        let path = std::env::temp_dir().join(format!("kvstack-sync-flush-{}", std::process::id()));
        let mode = OpenMode {
            write: true,
            create: true,
            direct: false,
        };
        let f: IoTarget = Arc::new(open_file(&path, mode).unwrap()).into();
        let mut e = SyncEngine::new(2, false);
        e.flush(&f).unwrap();
        let ns = IoTarget::Namespace(crate::blockio::NamespaceTarget {
            nsid: 3,
            block_bytes: 4096,
            blocks: 16,
        });
        let err = e.flush(&ns).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("NVMe namespace 3"), "{err}");
        let pool = BufferPool::new(
            1,
            4096,
            PinnedOptions {
                huge_pages: HugePages::Never,
                locking: Locking::Never,
            },
        )
        .unwrap();
        let op = IoOp {
            kind: OpKind::Write,
            target: ns,
            offset: 0,
            len: 4096,
            buf: pool.try_get().unwrap(),
            tag: 7,
        };
        e.submit(op).unwrap();
        let mut out = Vec::new();
        e.wait(1, &mut out).unwrap();
        let err = out[0].result.as_ref().unwrap_err();
        assert!(
            matches!(
                err.get_ref().and_then(|e| e.downcast_ref::<crate::Error>()),
                Some(crate::Error::BlockTarget { op: "write", .. })
            ),
            "{err}"
        );
        let _ = std::fs::remove_file(&path);
    }
}
