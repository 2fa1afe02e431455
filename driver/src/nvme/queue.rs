//! One submission/completion queue pair (NVMe base specification 1.4 §4.1): the rings in DMA
//! memory, the host's tail, head and phase, and the table of commands in flight by command
//! identifier.

use std::sync::atomic::{Ordering, fence};
use std::time::Instant;

use kvstack_firmware_interface::nvme::{
    CQE_BYTES, CompletionEntry, PAGE, PRPS_PER_LIST, SQE_BYTES, Status, SubmissionEntry,
    build_prps, doorbell_offset, prp_list_pages,
};
use zerocopy::{FromBytes, IntoBytes};

use super::{DmaRegion, DmaSlice, Registers};
use crate::Error;

/// A command the controller owns until its completion is reaped.
#[derive(Debug)]
pub(super) struct InFlight {
    /// What it is, for errors (`read`, `Identify`, ...).
    pub command: &'static str,
    /// The caller's tag.
    pub tag: u64,
    /// When it times out.
    pub deadline: Instant,
    /// Its data, held so the memory stays mapped while the controller may write it.
    pub buf: Option<DmaSlice>,
}

/// A reaped completion.
#[derive(Debug)]
pub(super) struct Reaped {
    /// The command.
    pub cmd: InFlight,
    /// Its status.
    pub status: Status,
    /// Completion DW0.
    pub dw0: u32,
}

/// One queue pair. Invariants: `sq_tail`, `sq_head` and `cq_head` are `< entries`; the
/// submission ring holds `(sq_tail - sq_head) mod entries` commands, at most `entries - 1`
/// (full when advancing the tail would reach the head, §4.1.2); `slots[cid]` is `Some`
/// exactly for the command identifiers in flight.
#[derive(Debug)]
pub(super) struct QueuePair {
    pub qid: u16,
    entries: u16,
    pub sq: DmaRegion,
    pub cq: DmaRegion,
    /// `lists_per_cmd` PRP list pages for each command identifier.
    pub lists: Option<DmaRegion>,
    lists_per_cmd: usize,
    sq_tail: u16,
    sq_head: u16,
    cq_head: u16,
    /// The phase tag that marks a new completion: starts at 1, flips at each wrap (§4.6).
    phase: bool,
    sq_doorbell: usize,
    cq_doorbell: usize,
    slots: Vec<Option<InFlight>>,
    free: Vec<u16>,
    /// Scratch for a command's data page addresses, list page addresses and list entries
    /// (kept so a submission allocates nothing).
    pages: Vec<u64>,
    list_iovas: Vec<u64>,
    scratch: Vec<u64>,
    /// Times the completion ring wrapped (phase flips), for tests and stats.
    pub wraps: u64,
    /// Completions that named no command in flight, or another queue.
    pub malformed: u64,
}

impl QueuePair {
    /// A queue pair over zeroed rings `sq` and `cq` of `entries` entries each.
    pub fn new(
        qid: u16,
        entries: u16,
        sq: DmaRegion,
        cq: DmaRegion,
        lists: Option<DmaRegion>,
        lists_per_cmd: usize,
        dstrd: u8,
    ) -> Result<QueuePair, Error> {
        let doorbell = |cq| {
            doorbell_offset(qid, cq, dstrd).ok_or(Error::NvmeUnsupported {
                what: format!("doorbell of queue {qid} with stride shift {dstrd}"),
            })
        };
        Ok(QueuePair {
            qid,
            entries,
            sq,
            cq,
            lists,
            lists_per_cmd,
            sq_tail: 0,
            sq_head: 0,
            cq_head: 0,
            phase: true,
            sq_doorbell: doorbell(false)?,
            cq_doorbell: doorbell(true)?,
            // Command identifiers 0..entries-1, handed out lowest first.
            slots: (0..entries).map(|_| None).collect(),
            free: (0..entries).rev().collect(),
            pages: Vec::new(),
            list_iovas: Vec::with_capacity(lists_per_cmd),
            scratch: vec![0; lists_per_cmd * PRPS_PER_LIST],
            wraps: 0,
            malformed: 0,
        })
    }

    /// Commands in flight.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Commands the ring holds at once.
    pub fn capacity(&self) -> usize {
        usize::from(self.entries).saturating_sub(1)
    }

    /// Whether another command fits in the submission ring.
    pub fn has_room(&self) -> bool {
        (self.sq_tail + 1) % self.entries != self.sq_head && !self.free.is_empty()
    }

    /// The earliest deadline of a command in flight.
    pub fn next_deadline(&self) -> Option<(Instant, u16)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(cid, s)| Some((s.as_ref()?.deadline, cid as u16)))
            .min()
    }

    /// Sets the data pointer of `entry` for `buf` (pages contiguous in IOVA space), writing
    /// PRP list pages into command slot `cid`'s list area when more than two pages.
    fn set_data(
        &mut self,
        entry: &mut SubmissionEntry,
        cid: u16,
        buf: &DmaSlice,
    ) -> Result<(), Error> {
        let start = buf.region.iova() + buf.offset as u64;
        self.pages.clear();
        self.pages
            .extend((0..buf.len / PAGE).map(|i| start + (i * PAGE) as u64));
        let needed = prp_list_pages(self.pages.len());
        if needed > self.lists_per_cmd {
            return Err(Error::NvmeRequest {
                reason: format!(
                    "{} bytes need {needed} PRP list pages, more than configured",
                    buf.len
                ),
            });
        }
        // This command slot's list pages: `lists_per_cmd` pages from `cid * lists_per_cmd`.
        let list_base = usize::from(cid) * self.lists_per_cmd * PAGE;
        self.list_iovas.clear();
        match (&self.lists, needed) {
            (_, 0) => {}
            (Some(l), _) => self
                .list_iovas
                .extend((0..needed).map(|i| l.iova() + (list_base + i * PAGE) as u64)),
            (None, _) => {
                return Err(Error::NvmeRequest {
                    reason: "a transfer of more than two pages on a queue without PRP lists".into(),
                });
            }
        }
        let prps = build_prps(&self.pages, &self.list_iovas, &mut self.scratch)
            .map_err(Error::NvmeFormat)?;
        if let (Some(l), 1..) = (&self.lists, needed) {
            let entries = &mut self.scratch[..needed * PRPS_PER_LIST];
            // PRP entries are little-endian in memory (§4.3).
            entries.iter_mut().for_each(|e| *e = e.to_le());
            l.volatile().write(list_base, entries.as_bytes())?;
        }
        entry.set_prps(prps);
        Ok(())
    }

    /// Places `entry` in the ring with a fresh command identifier and rings the tail doorbell.
    pub fn submit(
        &mut self,
        regs: &dyn Registers,
        mut entry: SubmissionEntry,
        cmd: InFlight,
    ) -> Result<u16, Error> {
        if !self.has_room() {
            return Err(Error::NvmeQueueFull { queue: self.qid });
        }
        let Some(cid) = self.free.pop() else {
            return Err(Error::NvmeQueueFull { queue: self.qid });
        };
        let placed = (|| {
            if let Some(buf) = &cmd.buf {
                self.set_data(&mut entry, cid, buf)?;
            }
            entry.set_cid(cid);
            let at = usize::from(self.sq_tail) * SQE_BYTES;
            self.sq.volatile().write(at, entry.as_bytes())
        })();
        if let Err(e) = placed {
            self.free.push(cid);
            return Err(e);
        }
        self.slots[usize::from(cid)] = Some(cmd);
        self.sq_tail = (self.sq_tail + 1) % self.entries;
        // The entry (and its PRP list) must be in memory before the controller reads the new
        // tail: order the stores before the doorbell write.
        fence(Ordering::SeqCst);
        regs.write32(self.sq_doorbell, u32::from(self.sq_tail))?;
        Ok(cid)
    }

    /// Reaps every new completion (phase tag equal to the expected phase), advancing the head
    /// and ringing the head doorbell once. Malformed entries (another queue's SQID, a command
    /// identifier not in flight, an SQ head out of range) are consumed, counted and logged;
    /// the command they may have meant then times out. At most one ring's worth of entries is
    /// taken per call, so a controller that never clears its phase tags cannot keep the host
    /// here.
    pub fn reap(&mut self, regs: &dyn Registers, out: &mut Vec<Reaped>) -> Result<usize, Error> {
        let mut reaped = 0;
        let mut advanced = false;
        for _ in 0..self.entries {
            let at = usize::from(self.cq_head) * CQE_BYTES;
            let mut status = [0u8; 2];
            self.cq.volatile().read(at + 14, &mut status)?;
            if (u16::from_le_bytes(status) & 1 != 0) != self.phase {
                break;
            }
            // The rest of the entry is read only after its phase tag shows it complete.
            fence(Ordering::SeqCst);
            let mut raw = [0u8; CQE_BYTES];
            self.cq.volatile().read(at, &mut raw)?;
            let Ok(cqe) = CompletionEntry::read_from_bytes(&raw) else {
                break;
            };
            self.cq_head = (self.cq_head + 1) % self.entries;
            if self.cq_head == 0 {
                self.phase = !self.phase;
                self.wraps += 1;
            }
            advanced = true;
            let cid = cqe.cid.get();
            let sq_head = cqe.sq_head.get();
            if cqe.sq_id.get() != self.qid || sq_head >= self.entries {
                self.malformed += 1;
                log::warn!(
                    "NVMe queue {}: completion with SQID {} and SQ head {} ignored",
                    self.qid,
                    cqe.sq_id.get(),
                    sq_head
                );
                continue;
            }
            let Some(cmd) = self.slots.get_mut(usize::from(cid)).and_then(Option::take) else {
                self.malformed += 1;
                log::warn!(
                    "NVMe queue {}: completion for command id {cid}, not in flight",
                    self.qid
                );
                continue;
            };
            self.sq_head = sq_head;
            self.free.push(cid);
            out.push(Reaped {
                cmd,
                status: cqe.status(),
                dw0: cqe.dw0.get(),
            });
            reaped += 1;
        }
        if advanced {
            regs.write32(self.cq_doorbell, u32::from(self.cq_head))?;
        }
        Ok(reaped)
    }

    /// Whether a command in flight uses `region`.
    pub fn uses(&self, region: &DmaRegion) -> bool {
        self.slots
            .iter()
            .flatten()
            .any(|c| c.buf.as_ref().is_some_and(|b| b.region.same(region)))
    }

    /// The tag of the command in flight with identifier `cid`.
    pub fn tag_of(&self, cid: u16) -> Option<u64> {
        self.slots.get(usize::from(cid))?.as_ref().map(|c| c.tag)
    }

    /// Takes every command in flight (the controller has been stopped).
    pub fn drain(&mut self) -> Vec<InFlight> {
        let mut taken = Vec::new();
        for (cid, slot) in self.slots.iter_mut().enumerate() {
            if let Some(cmd) = slot.take() {
                self.free.push(cid as u16);
                taken.push(cmd);
            }
        }
        taken
    }

    /// The regions the queue owns.
    pub fn regions(self) -> impl Iterator<Item = DmaRegion> {
        [Some(self.sq), Some(self.cq), self.lists]
            .into_iter()
            .flatten()
    }
}
