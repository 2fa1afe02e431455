//! The controller state machine: bring-up, admin commands, I/O submission and completion,
//! timeouts, reset and shutdown (NVMe base specification 1.4 §7.3, §7.6).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstack_firmware_interface::nvme::{
    CQE_BYTES, CSS_NVM, Capabilities, ControllerConfig, ControllerInfo, ControllerStatus,
    CstsFlags, NamespaceInfo, PAGE, QueuesGranted, SQE_BYTES, Shutdown, SubmissionEntry, Version,
    aqa, cns, prp_list_pages, reg,
};

use super::queue::{InFlight, QueuePair, Reaped};
use super::{
    ControllerOptions, Dma, DmaRegion, DmaSlice, IoCompletion, IoKind, IoRequest, Registers,
};
use crate::Error;
use crate::pinned::LentRegion;

/// Where the controller is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Not enabled (before bring-up, or after a failed one).
    Disabled,
    /// Enabled, queues created, accepting commands.
    Ready,
    /// A command timed out or the controller reported a fatal status: no new commands until
    /// [`Controller::reset`].
    Failed(String),
    /// Shut down (CC.SHN); [`Controller::reset`] brings it up again.
    ShutDown,
}

/// Counters of a controller's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControllerStats {
    /// I/O commands submitted.
    pub submitted: u64,
    /// I/O commands completed with an error status.
    pub errors: u64,
    /// Commands that timed out.
    pub timeouts: u64,
    /// Completions that named no command in flight or another queue (ignored).
    pub malformed: u64,
    /// Completion ring wraps (phase tag flips) over all queues.
    pub wraps: u64,
    /// Bring-ups (the first, and one per reset).
    pub bring_ups: u64,
}

/// A polled NVMe controller with one namespace and N I/O queue pairs (module docs).
pub struct Controller<R: Registers, D: Dma> {
    regs: R,
    dma: D,
    opts: ControllerOptions,
    cap: Capabilities,
    version: Version,
    state: State,
    /// Whether the controller is known not to access memory (disabled or shut down).
    stopped: bool,
    /// [`Controller::stop`] failed: the controller ignores CC.EN and CC.SHN.
    unstoppable: bool,
    admin: Option<QueuePair>,
    io: Vec<QueuePair>,
    identify_page: Option<DmaRegion>,
    info: Option<ControllerInfo>,
    namespace: Option<NamespaceInfo>,
    max_transfer: usize,
    /// Completions made by the driver itself (aborts, timeouts), handed out by the next poll.
    done: Vec<IoCompletion>,
    stats: ControllerStats,
}

impl<R: Registers, D: Dma> std::fmt::Debug for Controller<R, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("version", &self.version)
            .field("state", &self.state)
            .field("io_queues", &self.io.len())
            .field("info", &self.info)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// Waits a little between polls: spin first (completions arrive in microseconds), then yield
/// the CPU so a dead controller does not starve other threads until the deadline.
fn pause(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 256 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl<R: Registers, D: Dma> Controller<R, D> {
    /// Brings the controller up (§7.6.1): checks CAP, disables it, sets up the admin queue,
    /// enables it, identifies the controller and namespace `opts.namespace`, asks for
    /// `opts.io_queues` queue pairs and creates those granted.
    ///
    /// # Errors
    /// [`Error::NvmeUnsupported`] for a controller without the NVM command set or 4 KiB pages,
    /// [`Error::NvmeTimeout`] when CSTS.RDY does not follow CC.EN within CAP.TO,
    /// [`Error::NvmeFatal`], [`Error::NvmeFormat`] for invalid Identify data,
    /// [`Error::NvmeCommand`] for a failed admin command, [`Error::NvmeRegister`].
    pub fn new(regs: R, dma: D, opts: ControllerOptions) -> Result<Controller<R, D>, Error> {
        let cap = regs.read64(reg::CAP)?;
        if cap == u64::MAX {
            return Err(Error::NvmeRemoved);
        }
        let cap = Capabilities::decode(cap).map_err(Error::NvmeFormat)?;
        let version = Version::decode(regs.read32(reg::VS)?);
        if cap.command_sets & CSS_NVM == 0 {
            return Err(Error::NvmeUnsupported {
                what: format!("command sets {:#x} (no NVM command set)", cap.command_sets),
            });
        }
        if !cap.supports_page_size(PAGE) {
            return Err(Error::NvmeUnsupported {
                what: format!(
                    "memory pages of 2^(12+{})..2^(12+{}) bytes",
                    cap.mps_min, cap.mps_max
                ),
            });
        }
        let mut c = Controller {
            regs,
            dma,
            opts,
            cap,
            version,
            state: State::Disabled,
            stopped: false,
            unstoppable: false,
            admin: None,
            io: Vec::new(),
            identify_page: None,
            info: None,
            namespace: None,
            max_transfer: PAGE,
            done: Vec::new(),
            stats: ControllerStats::default(),
        };
        c.bring_up()?;
        log::info!(
            "NVMe controller {} (version {}, serial {}, firmware {}): namespace {} of {} blocks of \
             {} bytes, {} I/O queue pairs",
            c.info.as_ref().map_or("?", |i| i.model.as_str()),
            c.version,
            c.info.as_ref().map_or("?", |i| i.serial.as_str()),
            c.info.as_ref().map_or("?", |i| i.firmware.as_str()),
            c.opts.namespace,
            c.namespace.map_or(0, |n| n.size_blocks),
            c.namespace.map_or(0, |n| n.block_bytes()),
            c.io.len()
        );
        Ok(c)
    }

    /// The controller's identity (after a successful bring-up).
    pub fn info(&self) -> Option<&ControllerInfo> {
        self.info.as_ref()
    }

    /// The namespace in use (after a successful bring-up).
    pub fn namespace(&self) -> Option<&NamespaceInfo> {
        self.namespace.as_ref()
    }

    /// The decoded CAP register.
    pub fn capabilities(&self) -> &Capabilities {
        &self.cap
    }

    /// I/O queue pairs in use.
    pub fn io_queues(&self) -> usize {
        self.io.len()
    }

    /// The namespace in use (NSID).
    pub fn namespace_id(&self) -> u32 {
        self.opts.namespace
    }

    /// Commands I/O queue `queue` holds at once (its entries less one; 0 if it does not
    /// exist).
    pub fn io_queue_capacity(&self, queue: usize) -> usize {
        self.io.get(queue).map_or(0, QueuePair::capacity)
    }

    /// Largest transfer per command in bytes.
    pub fn max_transfer(&self) -> usize {
        self.max_transfer
    }

    /// Counters.
    pub fn stats(&self) -> ControllerStats {
        let queues = self.admin.iter().chain(&self.io);
        ControllerStats {
            malformed: self.stats.malformed + queues.clone().map(|q| q.malformed).sum::<u64>(),
            wraps: self.stats.wraps + queues.map(|q| q.wraps).sum::<u64>(),
            ..self.stats
        }
    }

    /// Commands in flight on the I/O queues.
    pub fn in_flight(&self) -> usize {
        self.io.iter().map(QueuePair::in_flight).sum()
    }

    /// Allocates a DMA region for request data (see [`Dma::alloc`]).
    ///
    /// # Errors
    /// The [`Dma`] implementation's.
    pub fn alloc(&mut self, bytes: usize) -> Result<DmaRegion, Error> {
        self.dma.alloc(bytes)
    }

    /// Maps memory lent by its owner (a buffer pool's region) for the controller (see
    /// [`Dma::map_lent`]); [`Controller::free`] unmaps it.
    ///
    /// # Errors
    /// The [`Dma`] implementation's.
    pub fn map_lent(&mut self, mem: Arc<LentRegion>) -> Result<DmaRegion, Error> {
        self.dma.map_lent(mem)
    }

    /// Unmaps a region from [`Controller::alloc`] or [`Controller::map_lent`]; refused while a
    /// command in flight uses it.
    ///
    /// # Errors
    /// [`Error::NvmeRequest`] when it is in use.
    pub fn free(&mut self, region: DmaRegion) -> Result<(), Error> {
        let busy = self.io.iter().any(|q| q.uses(&region));
        if busy {
            return Err(Error::NvmeRequest {
                reason: "the region is in use by a command in flight".into(),
            });
        }
        self.dma.free(region);
        Ok(())
    }

    fn csts(&self) -> Result<ControllerStatus, Error> {
        let raw = self.regs.read32(reg::CSTS)?;
        if ControllerStatus::is_removed(raw) {
            return Err(Error::NvmeRemoved);
        }
        Ok(ControllerStatus::decode(raw))
    }

    /// Polls CSTS until `done` holds, for at most CAP.TO. A fatal status ends the wait unless
    /// `fatal_ok` (disabling is how a fatal controller is recovered).
    fn wait_status(
        &self,
        what: &'static str,
        fatal_ok: bool,
        done: impl Fn(ControllerStatus) -> bool,
    ) -> Result<(), Error> {
        let limit = Duration::from_millis(self.cap.ready_timeout_ms());
        let start = Instant::now();
        loop {
            let s = self.csts()?;
            if done(s) {
                return Ok(());
            }
            if s.flags.contains(CstsFlags::CFS) && !fatal_ok {
                return Err(Error::NvmeFatal { during: what });
            }
            if start.elapsed() > limit {
                return Err(Error::NvmeTimeout {
                    what: what.to_owned(),
                    after: limit,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Clears CC.EN and waits for CSTS.RDY = 0 (§7.3.1): the controller stops processing and
    /// accessing memory, and forgets every queue but the admin queue's registers.
    fn disable(&mut self) -> Result<(), Error> {
        let cc = ControllerConfig::decode(self.regs.read32(reg::CC)?);
        if cc.enable {
            let off = ControllerConfig {
                enable: false,
                shutdown: Shutdown::None,
                ..cc
            };
            self.regs.write32(reg::CC, off.encode())?;
        }
        self.wait_status("waiting for CSTS.RDY = 0 after clearing CC.EN", true, |s| {
            !s.flags.contains(CstsFlags::RDY)
        })?;
        self.stopped = true;
        if self.state == State::Ready {
            self.state = State::Disabled;
        }
        Ok(())
    }

    /// Unmaps every queue region (the controller is stopped).
    fn release_queues(&mut self) {
        debug_assert!(self.stopped);
        let queues = self.admin.take().into_iter().chain(self.io.drain(..));
        let regions: Vec<DmaRegion> = queues
            .flat_map(QueuePair::regions)
            .chain(self.identify_page.take())
            .collect();
        for r in regions {
            self.dma.free(r);
        }
    }

    /// Allocates `N` regions, or none: on a failure the ones already made are freed (no
    /// command has seen them).
    fn alloc_all<const N: usize>(&mut self, sizes: [usize; N]) -> Result<[DmaRegion; N], Error> {
        let mut made = Vec::with_capacity(N);
        for bytes in sizes {
            match self.dma.alloc(bytes) {
                Ok(r) => made.push(r),
                Err(e) => {
                    for r in made {
                        self.dma.free(r);
                    }
                    return Err(e);
                }
            }
        }
        made.try_into().map_err(|_| Error::NvmeFailed {
            reason: "region count".into(),
        })
    }

    fn bring_up(&mut self) -> Result<(), Error> {
        self.disable()?;
        self.release_queues();
        self.stats.bring_ups += 1;
        let dstrd = self.cap.doorbell_stride_shift;
        let mqes = self.cap.max_queue_entries.min(u32::from(u16::MAX));
        let admin_entries =
            u32::from(self.opts.admin_queue_entries).clamp(2, mqes.min(4096)) as u16;
        let [asq, acq, page] = self.alloc_all([
            usize::from(admin_entries) * SQE_BYTES,
            usize::from(admin_entries) * CQE_BYTES,
            PAGE,
        ])?;
        let (asq_iova, acq_iova) = (asq.iova(), acq.iova());
        self.identify_page = Some(page);
        self.admin = Some(QueuePair::new(0, admin_entries, asq, acq, None, 0, dstrd)?);
        let aqa = aqa(u32::from(admin_entries), u32::from(admin_entries)).ok_or(
            Error::NvmeUnsupported {
                what: format!("an admin queue of {admin_entries} entries"),
            },
        )?;
        self.regs.write32(reg::AQA, aqa)?;
        self.regs.write64(reg::ASQ, asq_iova)?;
        self.regs.write64(reg::ACQ, acq_iova)?;
        self.stopped = false;
        self.regs
            .write32(reg::CC, ControllerConfig::enabled().encode())?;
        self.wait_status("waiting for CSTS.RDY = 1 after setting CC.EN", false, |s| {
            s.flags.contains(CstsFlags::RDY)
        })?;
        self.state = State::Ready;

        let page = self.identify(cns::CONTROLLER, 0)?;
        let info = ControllerInfo::decode(&page).map_err(Error::NvmeFormat)?;
        let nsid = self.opts.namespace;
        if nsid == 0 || nsid > info.namespaces {
            return Err(Error::NvmeUnsupported {
                what: format!("namespace {nsid} (the controller has {})", info.namespaces),
            });
        }
        let page = self.identify(cns::NAMESPACE, nsid)?;
        let ns = NamespaceInfo::decode(&page).map_err(Error::NvmeFormat)?;
        if ns.format.metadata_bytes != 0 {
            return Err(Error::NvmeUnsupported {
                what: format!(
                    "namespace {nsid} with {} metadata bytes per block",
                    ns.format.metadata_bytes
                ),
            });
        }
        let min_page = (PAGE as u64) << self.cap.mps_min;
        let mdts = info.max_transfer(min_page).unwrap_or(u64::MAX);
        let want = (self.opts.max_transfer / PAGE).max(1) * PAGE;
        self.max_transfer = want
            .min(usize::try_from(mdts).unwrap_or(usize::MAX))
            .max(PAGE);
        self.info = Some(info);
        self.namespace = Some(ns);

        let want = self.opts.io_queues.max(1);
        let dw0 = self.admin_command(
            "Set Features (Number of Queues)",
            SubmissionEntry::set_number_of_queues(want, want),
            None,
        )?;
        let granted = QueuesGranted::decode(dw0);
        let n = u32::from(want).min(granted.sq).min(granted.cq) as u16;
        let entries = u32::from(self.opts.io_queue_entries).clamp(2, mqes) as u16;
        let lists_per_cmd = prp_list_pages(self.max_transfer / PAGE);
        for qid in 1..=n {
            let [sq, cq] = self.alloc_all([
                usize::from(entries) * SQE_BYTES,
                usize::from(entries) * CQE_BYTES,
            ])?;
            let lists = match lists_per_cmd {
                0 => None,
                k => match self.dma.alloc(usize::from(entries) * k * PAGE) {
                    Ok(l) => Some(l),
                    Err(e) => {
                        self.dma.free(sq);
                        self.dma.free(cq);
                        return Err(e);
                    }
                },
            };
            let (sq_iova, cq_iova) = (sq.iova(), cq.iova());
            // Kept before creation, so the regions are released whatever happens next.
            self.io.push(QueuePair::new(
                qid,
                entries,
                sq,
                cq,
                lists,
                lists_per_cmd,
                dstrd,
            )?);
            self.admin_command(
                "Create I/O Completion Queue",
                SubmissionEntry::create_io_cq(qid, entries, cq_iova),
                None,
            )?;
            self.admin_command(
                "Create I/O Submission Queue",
                SubmissionEntry::create_io_sq(qid, entries, sq_iova, qid),
                None,
            )?;
        }
        if n < want {
            log::info!("NVMe controller granted {n} of {want} I/O queue pairs");
        }
        Ok(())
    }

    fn identify(&mut self, which: u8, nsid: u32) -> Result<Vec<u8>, Error> {
        let page = self.identify_page.clone().ok_or(Error::NvmeFailed {
            reason: "no Identify buffer".into(),
        })?;
        let what = if which == cns::NAMESPACE {
            "Identify Namespace"
        } else {
            "Identify Controller"
        };
        let slice = DmaSlice {
            region: page.clone(),
            offset: 0,
            len: PAGE,
        };
        self.admin_command(what, SubmissionEntry::identify(which, nsid, 0), Some(slice))?;
        let mut out = vec![0u8; PAGE];
        page.volatile().read(0, &mut out)?;
        Ok(out)
    }

    fn check_ready(&self) -> Result<(), Error> {
        match &self.state {
            State::Ready => Ok(()),
            State::Failed(reason) => Err(Error::NvmeFailed {
                reason: reason.clone(),
            }),
            State::Disabled => Err(Error::NvmeFailed {
                reason: "the controller is disabled".into(),
            }),
            State::ShutDown => Err(Error::NvmeFailed {
                reason: "the controller is shut down".into(),
            }),
        }
    }

    /// Runs one admin command to completion; returns its DW0.
    fn admin_command(
        &mut self,
        what: &'static str,
        entry: SubmissionEntry,
        buf: Option<DmaSlice>,
    ) -> Result<u32, Error> {
        self.check_ready()?;
        let deadline = Instant::now() + self.opts.command_timeout;
        let admin = self.admin.as_mut().ok_or(Error::NvmeFailed {
            reason: "no admin queue".into(),
        })?;
        let cmd = InFlight {
            command: what,
            tag: 0,
            deadline,
            buf,
        };
        admin.submit(&self.regs, entry, cmd)?;
        let mut spins = 0;
        let mut out = Vec::with_capacity(1);
        loop {
            admin.reap(&self.regs, &mut out)?;
            // One admin command at a time, so the first completion is this command's.
            if let Some(r) = out.pop() {
                return if r.status.is_success() {
                    Ok(r.dw0)
                } else {
                    Err(Error::NvmeCommand {
                        command: what,
                        status: r.status,
                    })
                };
            }
            if Instant::now() > deadline {
                self.stats.timeouts += 1;
                let after = self.opts.command_timeout;
                self.fail(
                    format!("admin command {what} timed out after {after:?}"),
                    None,
                );
                return Err(Error::NvmeTimeout {
                    what: what.to_owned(),
                    after,
                });
            }
            pause(&mut spins);
        }
    }

    /// Declares the controller failed: disables it (so it stops accessing memory) and turns
    /// every command in flight into a completion with an error. If the controller cannot be
    /// disabled, the commands' memory is leaked on purpose (module docs).
    fn fail(&mut self, reason: String, timed_out: Option<(u16, u64)>) {
        log::error!("NVMe controller failed: {reason}; disabling it");
        if let Err(e) = self.disable() {
            log::error!("NVMe controller does not stop ({e}): its DMA memory is leaked, not freed");
        }
        self.state = State::Failed(reason.clone());
        self.abort_all(&reason, timed_out);
    }

    fn abort_all(&mut self, reason: &str, timed_out: Option<(u16, u64)>) {
        let timeout = self.opts.command_timeout;
        if let Some(a) = self.admin.as_mut() {
            a.drain();
        }
        for q in &mut self.io {
            let qid = q.qid;
            for cmd in q.drain() {
                let result = if timed_out == Some((qid, cmd.tag)) {
                    Err(Error::NvmeTimeout {
                        what: format!("{} (tag {})", cmd.command, cmd.tag),
                        after: timeout,
                    })
                } else {
                    Err(Error::NvmeAborted {
                        command: cmd.command,
                        reason: reason.to_owned(),
                    })
                };
                let buf = if self.stopped {
                    cmd.buf
                } else {
                    // The controller may still write it: keep the memory mapped forever.
                    std::mem::forget(cmd.buf);
                    None
                };
                self.done.push(IoCompletion {
                    tag: cmd.tag,
                    buf,
                    result,
                });
            }
        }
    }

    /// Builds the command for `req`, checking it against the namespace and transfer limits.
    fn command_for(&self, req: &IoRequest) -> Result<SubmissionEntry, Error> {
        let bad = |reason: String| Err(Error::NvmeRequest { reason });
        let nsid = self.opts.namespace;
        let Some(ns) = self.namespace else {
            return bad("no namespace".into());
        };
        let buf = match (req.kind, &req.buf) {
            (IoKind::Flush, None) => return Ok(SubmissionEntry::flush(nsid)),
            (IoKind::Flush, Some(_)) => return bad("a flush takes no buffer".into()),
            (_, None) => return bad(format!("a {} needs a buffer", req.kind.name())),
            (_, Some(b)) => b,
        };
        // A freed region (or another controller's) has no IOVA mapping: the device's DMA would
        // fault in the IOMMU (docs/nvme.md "The QEMU rig") and the command time out.
        if !self.dma.is_mapped(&buf.region) {
            return bad(format!(
                "the buffer's region (IOVA {:#x}) is not mapped for this controller",
                buf.region.iova()
            ));
        }
        if buf.len == 0 || buf.offset % PAGE != 0 || buf.len % PAGE != 0 {
            return bad(format!(
                "buffer range {}+{} is not whole {PAGE}-byte pages",
                buf.offset, buf.len
            ));
        }
        if buf
            .offset
            .checked_add(buf.len)
            .is_none_or(|end| end > buf.region.len())
        {
            return bad(format!(
                "buffer range {}+{} exceeds its {}-byte region",
                buf.offset,
                buf.len,
                buf.region.len()
            ));
        }
        if buf.len > self.max_transfer {
            return bad(format!(
                "{} bytes exceed the {}-byte transfer limit",
                buf.len, self.max_transfer
            ));
        }
        let block = ns.block_bytes();
        if !(buf.len as u64).is_multiple_of(block) {
            return bad(format!(
                "{} bytes are not whole {block}-byte blocks",
                buf.len
            ));
        }
        let blocks = buf.len as u64 / block;
        if blocks > 1 << 16 {
            return bad(format!("{blocks} blocks exceed the 65536 of one command"));
        }
        if req
            .lba
            .checked_add(blocks)
            .is_none_or(|end| end > ns.size_blocks)
        {
            return bad(format!(
                "blocks {}..+{blocks} are outside the namespace's {} blocks",
                req.lba, ns.size_blocks
            ));
        }
        Ok(match req.kind {
            IoKind::Read => SubmissionEntry::read(nsid, req.lba, blocks as u32),
            _ => SubmissionEntry::write(nsid, req.lba, blocks as u32),
        })
    }

    /// Queues `req` on I/O queue `queue` (0-based) and rings its doorbell.
    ///
    /// # Errors
    /// [`Error::NvmeRequest`] for a malformed request, [`Error::NvmeQueueFull`],
    /// [`Error::NvmeFailed`] until [`Controller::reset`] after a failure.
    pub fn submit(&mut self, queue: usize, req: IoRequest) -> Result<(), Error> {
        self.check_ready()?;
        let entry = self.command_for(&req)?;
        let q = self.io.get_mut(queue).ok_or(Error::NvmeRequest {
            reason: format!("I/O queue {queue} does not exist"),
        })?;
        let cmd = InFlight {
            command: req.kind.name(),
            tag: req.tag,
            deadline: Instant::now() + self.opts.command_timeout,
            buf: req.buf,
        };
        q.submit(&self.regs, entry, cmd)?;
        self.stats.submitted += 1;
        Ok(())
    }

    /// Whether I/O queue `queue` can take another command now.
    pub fn has_room(&self, queue: usize) -> bool {
        self.state == State::Ready && self.io.get(queue).is_some_and(QueuePair::has_room)
    }

    /// Appends every finished request to `out` (completions of all I/O queues, and those the
    /// driver made when it aborted commands); returns how many. A command past its deadline
    /// fails the controller: it is disabled and every command in flight completes with an
    /// error ([`Error::NvmeTimeout`] for the late one, [`Error::NvmeAborted`] for the rest).
    ///
    /// # Errors
    /// A register or memory access failed.
    pub fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, Error> {
        let before = out.len();
        let mut reaped: Vec<Reaped> = Vec::new();
        for q in &mut self.io {
            q.reap(&self.regs, &mut reaped)?;
        }
        for r in reaped {
            let result = if r.status.is_success() {
                Ok(())
            } else {
                self.stats.errors += 1;
                Err(Error::NvmeCommand {
                    command: r.cmd.command,
                    status: r.status,
                })
            };
            out.push(IoCompletion {
                tag: r.cmd.tag,
                buf: r.cmd.buf,
                result,
            });
        }
        let now = Instant::now();
        let late = self
            .io
            .iter()
            .filter_map(|q| q.next_deadline().map(|(d, cid)| (d, q.qid, cid)))
            .min();
        if let Some((deadline, qid, cid)) = late
            && now > deadline
        {
            let tag = self
                .io
                .iter()
                .find(|q| q.qid == qid)
                .and_then(|q| q.tag_of(cid));
            self.stats.timeouts += 1;
            let reason = format!(
                "I/O command (queue {qid}, command id {cid}) timed out after {:?}",
                self.opts.command_timeout
            );
            self.fail(reason, tag.map(|t| (qid, t)));
        }
        out.append(&mut self.done);
        Ok(out.len() - before)
    }

    /// Polls until at least `min` requests have finished (capped at those in flight) or
    /// nothing is in flight; deadlines bound the wait.
    ///
    /// # Errors
    /// As [`Controller::poll`].
    pub fn wait(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> Result<usize, Error> {
        let mut got = self.poll(out)?;
        let mut spins = 0;
        while got < min && self.in_flight() > 0 {
            pause(&mut spins);
            got += self.poll(out)?;
        }
        Ok(got)
    }

    /// Runs one request to completion on queue 0 (nothing else may be in flight).
    ///
    /// # Errors
    /// The request's error, or [`Controller::submit`]'s.
    pub fn run(&mut self, req: IoRequest) -> Result<(), Error> {
        if self.in_flight() != 0 {
            return Err(Error::NvmeRequest {
                reason: "run() with other commands in flight".into(),
            });
        }
        self.submit(0, req)?;
        let mut out = Vec::with_capacity(1);
        self.wait(1, &mut out)?;
        match out.pop() {
            Some(c) => c.result,
            None => Err(Error::NvmeFailed {
                reason: "the request vanished".into(),
            }),
        }
    }

    /// Resets the controller (§7.3): disables it (every command in flight completes with
    /// [`Error::NvmeAborted`]; [`Controller::poll`] hands them out) and brings it up again.
    ///
    /// # Errors
    /// As [`Controller::new`].
    pub fn reset(&mut self) -> Result<(), Error> {
        log::warn!("NVMe controller reset");
        let result = self.disable().and_then(|()| {
            self.abort_all("the controller was reset", None);
            self.bring_up()
        });
        if let Err(e) = &result {
            // Commands still in flight (the controller did not stop) are aborted and their
            // memory kept; nothing runs until another reset succeeds.
            self.abort_all("the controller was reset", None);
            self.state = State::Failed(format!("reset failed: {e}"));
        }
        result
    }

    /// Shuts the controller down (§7.6.2): waits for commands in flight, deletes the I/O
    /// queues, sets CC.SHN to normal and waits for CSTS.SHST = shutdown complete.
    ///
    /// # Errors
    /// [`Error::NvmeTimeout`] when the controller does not complete the shutdown in CAP.TO.
    pub fn shutdown(&mut self) -> Result<(), Error> {
        if self.state == State::Ready {
            let mut out = Vec::new();
            self.wait(usize::MAX, &mut out)?;
            self.done.extend(out);
        }
        if self.state == State::Ready {
            for qid in (1..=self.io.len() as u16).rev() {
                let r = self
                    .admin_command(
                        "Delete I/O Submission Queue",
                        SubmissionEntry::delete_io_sq(qid),
                        None,
                    )
                    .and_then(|_| {
                        self.admin_command(
                            "Delete I/O Completion Queue",
                            SubmissionEntry::delete_io_cq(qid),
                            None,
                        )
                    });
                if let Err(e) = r {
                    log::warn!("NVMe shutdown: deleting I/O queue {qid}: {e}");
                }
            }
        }
        let cc = ControllerConfig::decode(self.regs.read32(reg::CC)?);
        if !cc.enable {
            return self.disable();
        }
        let shn = ControllerConfig {
            shutdown: Shutdown::Normal,
            ..cc
        };
        self.regs.write32(reg::CC, shn.encode())?;
        self.wait_status("waiting for CSTS.SHST = shutdown complete", true, |s| {
            s.shutdown == Shutdown::AbruptOrComplete
        })?;
        self.stopped = true;
        self.state = State::ShutDown;
        log::info!("NVMe controller shut down");
        Ok(())
    }
}

impl<R: Registers, D: Dma> Controller<R, D> {
    /// Stops the controller's memory accesses for good, as its drop does: shuts it down, or
    /// disables it if the shutdown fails. Returns whether it is known to be stopped (else it
    /// ignored CC.EN, and memory it may reach must stay mapped).
    pub fn stop(&mut self) -> bool {
        if self.unstoppable {
            return false;
        }
        if !self.stopped
            && let Err(e) = self.shutdown()
        {
            log::warn!("NVMe shutdown failed ({e}); disabling the controller");
            if let Err(e) = self.disable() {
                log::error!("NVMe controller does not stop ({e}): its DMA memory is leaked");
            }
        }
        // Asked once: a controller that ignored it is not waited for again (drop after stop).
        self.unstoppable = !self.stopped;
        self.stopped
    }
}

impl<R: Registers, D: Dma> Drop for Controller<R, D> {
    fn drop(&mut self) {
        if self.stop() {
            self.release_queues();
        } else {
            // Never unmapped: the queues' memory stays mapped for a device that may write it.
            self.admin.take();
            self.io.clear();
            self.identify_page.take();
        }
    }
}
