//! The synchronous fallback engine: each operation runs with `pread`/`pwrite` on the calling
//! thread inside [`BlockEngine::submit`]; [`BlockEngine::wait`] hands back the finished ones.
//! Used where the file system refuses `O_DIRECT` (tmpfs: buffered I/O) or io_uring is
//! unavailable.

use std::collections::VecDeque;
use std::io;
use std::os::unix::fs::FileExt;

use super::{BlockEngine, Completion, EngineKind, IoOp, OpKind, SubmitError};

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
                op.file.read_at(dst, off)
            }
            OpKind::Write => {
                let src = op.buf.as_slice().get(done..op.len).unwrap_or_default();
                op.file.write_at(src, off)
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
}
