//! An in-process NVMe controller for tests: the register and queue protocol over ordinary
//! (pinned) memory, with a namespace backed by a `Vec` or by an image file behind a volatile
//! write cache. Compiled for the driver's own tests and, with the `fake-nvme` feature, for
//! other crates' tests (the SSD tier's suite runs its store on it).
//!
//! The fake acts synchronously: a doorbell write runs every command the new tail makes
//! visible and posts its completion (while the completion queue has room; the rest wait for a
//! head doorbell), so tests are deterministic. It reads queues, PRP lists and data only through
//! the IOVAs the driver gave it, as a device would, and models the failures a driver must
//! survive: error statuses, completions with a wrong command id or SQ id, a command that never
//! completes, and a controller that stops answering altogether. Lent regions (a buffer pool
//! mapped with [`Dma::map_lent`]) are reached like the driver's own, and the bytes moved
//! straight to or from them are counted ([`Fake::lent_bytes`]): how tests see zero copy.
//!
//! With an image file ([`Fake::with_image`]) the namespace outlives the process, as a real
//! one does: written blocks go to a volatile write cache (Identify Controller reports VWC = 1)
//! and reach the file only on Flush, on a normal shutdown (CC.SHN), or when the cache holds
//! more than [`WRITE_CACHE_BLOCKS`] blocks (then all of it is destaged, as a full cache
//! would). A process killed with unflushed writes loses them, exactly what a power loss does
//! to a drive's volatile cache, so crash tests over the fake check that durability really
//! comes from Flush.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use kvstack_firmware_interface::nvme::{
    CSS_NVM, CapFlags, Capabilities, CompletionEntry, ControllerConfig, ControllerStatus,
    CstsFlags, LbaFormat, PAGE, PRPS_PER_LIST, RawIdentifyController, RawIdentifyNamespace,
    SQE_BYTES, Shutdown, Status, StatusCodeType, SubmissionEntry, Version, admin_opcode,
    aqa_decode, nvm_opcode, reg,
};
use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use super::{Controller, ControllerOptions, Dma, DmaRegion, Registers};
use crate::Error;
use crate::blockio::{NvmeNamespace, NvmeOpener, NvmeShared};
use crate::pinned::{HugePages, LentRegion, Locking, PinnedOptions, PinnedRegion};

/// Blocks the write cache of an image-backed fake holds before it destages them all.
pub const WRITE_CACHE_BLOCKS: usize = 4096;

/// A fault to inject into the next I/O command's completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inject {
    /// Complete with this status.
    Status(Status),
    /// Complete with a command id that is not the command's.
    WrongCid,
    /// Complete naming another submission queue.
    BadSqid,
    /// Never complete.
    Swallow,
}

#[derive(Debug)]
struct Sq {
    base: u64,
    entries: u16,
    head: u16,
    tail: u16,
    cqid: u16,
}

#[derive(Debug)]
struct Cq {
    base: u64,
    entries: u16,
    tail: u16,
    head: u16,
    phase: bool,
}

/// A namespace kept in an image file, behind a volatile write cache.
#[derive(Debug)]
struct Image {
    file: File,
    bytes: usize,
    /// Written blocks not yet in the file, by block index.
    cache: BTreeMap<usize, Vec<u8>>,
}

/// The fake's state; tests read the public fields.
#[derive(Debug)]
pub struct State {
    /// CAP as reported.
    pub cap: Capabilities,
    cc: u32,
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    /// CSTS reads left before RDY follows an enable.
    ready_in: u32,
    /// Mapped regions by IOVA.
    mem: BTreeMap<u64, DmaRegion>,
    next_iova: u64,
    sqs: BTreeMap<u16, Sq>,
    cqs: BTreeMap<u16, Cq>,
    /// Most I/O queue pairs granted.
    pub max_io_queues: u16,
    /// Namespace 1's blocks (empty when an image file holds them).
    pub disk: Vec<u8>,
    image: Option<Image>,
    /// Bytes per logical block, log2.
    pub block_shift: u8,
    /// MDTS as reported (transfer limit 2^MDTS pages).
    pub mdts: u8,
    /// Identify Namespace reports NSZE 0 (an inactive namespace).
    pub inactive_namespace: bool,
    /// Faults for the next I/O commands, in order.
    pub inject: VecDeque<Inject>,
    /// Ignores every register write and doorbell (a hung controller).
    pub dead: bool,
    /// Reads return all ones, as from a device that left the bus.
    pub removed: bool,
    /// DMA allocations made so far, and the one (0-based) that fails, if any.
    pub allocs: usize,
    /// The allocation that fails (0-based), if any.
    pub fail_alloc: Option<usize>,
    /// CSTS.RDY takes this many CSTS reads to follow CC.EN.
    pub ready_delay: u32,
    /// Opcodes of every command run, per queue id.
    pub log: Vec<(u16, u8)>,
    /// Flush commands run.
    pub flushes: u64,
    /// Most PRP list pages one command used.
    pub max_list_pages: usize,
    /// Completion queue wraps per queue id.
    pub cq_wraps: BTreeMap<u16, u64>,
    /// Normal shutdowns (CC.SHN) seen.
    pub shutdowns: u64,
    /// A write to the image file failed: the error, kept for tests (the command failed).
    pub image_error: Option<String>,
    /// Lent regions (buffer pools) mapped so far ([`Dma::map_lent`]).
    pub lent_maps: u64,
    /// Data bytes the device moved straight to or from lent regions (zero-copy transfers).
    lent_bytes: std::cell::Cell<u64>,
}

/// The fake controller; [`Fake::bar`] and [`Fake::dma`] give the driver its two seams.
#[derive(Clone, Debug)]
pub struct Fake(Arc<Mutex<State>>);

impl Fake {
    /// A controller with one namespace of `blocks` blocks of 4 KiB, MQES + 1 = `mqes`, four
    /// I/O queue pairs at most, MDTS 2^8 pages (1 MiB), CAP.TO 1 (500 ms).
    pub fn new(blocks: usize, mqes: u32) -> Fake {
        let cap = Capabilities {
            max_queue_entries: mqes,
            flags: CapFlags::CQR,
            arbitration: 0,
            timeout_500ms: 1,
            doorbell_stride_shift: 0,
            command_sets: CSS_NVM,
            mps_min: 0,
            mps_max: 4,
        };
        Fake(Arc::new(Mutex::new(State {
            cap,
            cc: 0,
            csts: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            ready_in: 0,
            mem: BTreeMap::new(),
            next_iova: 0x1_0000_0000,
            sqs: BTreeMap::new(),
            cqs: BTreeMap::new(),
            max_io_queues: 4,
            disk: vec![0; blocks * PAGE],
            image: None,
            block_shift: 12,
            mdts: 8,
            inactive_namespace: false,
            inject: VecDeque::new(),
            dead: false,
            removed: false,
            allocs: 0,
            fail_alloc: None,
            ready_delay: 3,
            log: Vec::new(),
            flushes: 0,
            max_list_pages: 0,
            cq_wraps: BTreeMap::new(),
            shutdowns: 0,
            image_error: None,
            lent_maps: 0,
            lent_bytes: std::cell::Cell::new(0),
        })))
    }

    /// A controller like [`Fake::new`] whose namespace is the image file `path` (created, and
    /// extended to `bytes` if shorter; a multiple of 4 KiB) behind a volatile write cache
    /// (module docs), with eight I/O queue pairs at most.
    ///
    /// # Errors
    /// Opening or sizing the file.
    pub fn with_image(path: &Path, bytes: u64, mqes: u32) -> std::io::Result<Fake> {
        let bytes_usize = usize::try_from(bytes)
            .ok()
            .filter(|b| *b > 0 && b.is_multiple_of(PAGE))
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("image size {bytes} is not a positive multiple of 4096"),
                )
            })?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if file.metadata()?.len() < bytes {
            file.set_len(bytes)?;
        }
        let fake = Fake::new(0, mqes);
        {
            let mut s = fake.state();
            s.max_io_queues = 8;
            s.image = Some(Image {
                file,
                bytes: bytes_usize,
                cache: BTreeMap::new(),
            });
        }
        Ok(fake)
    }

    /// Blocks written and not yet destaged to the image file.
    pub fn cached_blocks(&self) -> usize {
        self.state().image.as_ref().map_or(0, |i| i.cache.len())
    }

    /// The state, for tests to read or change.
    pub fn state(&self) -> MutexGuard<'_, State> {
        match self.0.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// BAR0 of the fake.
    pub fn bar(&self) -> FakeBar {
        FakeBar(self.clone())
    }

    /// The fake's DMA memory.
    pub fn dma(&self) -> FakeDma {
        FakeDma(self.clone())
    }

    /// I/O submission queues that exist.
    pub fn io_queues(&self) -> usize {
        self.state().sqs.keys().filter(|&&q| q != 0).count()
    }

    /// Regions still mapped.
    pub fn mapped(&self) -> usize {
        self.state().mem.len()
    }

    /// Lent regions (buffer pools) still mapped.
    pub fn mapped_lent(&self) -> usize {
        self.state().mem.values().filter(|r| r.is_lent()).count()
    }

    /// The lent region mapped at the lowest IOVA, if any.
    pub fn lent_region(&self) -> Option<DmaRegion> {
        self.state().mem.values().find(|r| r.is_lent()).cloned()
    }

    /// Data bytes the device moved straight to or from lent regions (zero-copy transfers).
    pub fn lent_bytes(&self) -> u64 {
        self.state().lent_bytes.get()
    }
}

/// The fake's registers.
#[derive(Debug)]
pub struct FakeBar(Fake);

/// The fake's DMA allocator: real pinned memory at increasing IOVAs (never reused).
#[derive(Debug)]
pub struct FakeDma(Fake);

/// Opens a fresh fake controller over an image file each time (what a store location over a
/// fake namespace uses): `name` is `fake:<image path>`.
#[derive(Clone, Debug)]
pub struct FakeOpener {
    /// The image file.
    pub image: PathBuf,
    /// Its size in bytes (a multiple of 4 KiB).
    pub bytes: u64,
    /// Options of each controller brought up.
    pub options: ControllerOptions,
}

impl FakeOpener {
    /// An opener over `image` of `bytes` bytes, with queues of 256 entries (eight pairs) and
    /// 5 s command deadlines.
    pub fn new(image: &Path, bytes: u64) -> FakeOpener {
        FakeOpener {
            image: image.to_path_buf(),
            bytes,
            options: ControllerOptions {
                io_queues: 8,
                ..ControllerOptions::default()
            },
        }
    }
}

impl NvmeOpener for FakeOpener {
    fn name(&self) -> String {
        format!("fake:{}", self.image.display())
    }

    fn lock_path(&self) -> Option<PathBuf> {
        // The directory holding the image (which need not exist yet).
        Some(
            self.image
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
        )
    }

    fn open(&self) -> Result<Arc<dyn NvmeNamespace>, Error> {
        let fake = Fake::with_image(&self.image, self.bytes, 256).map_err(|e| Error::Vfio {
            what: "fake controller image",
            reason: format!("{}: {e}", self.image.display()),
        })?;
        let ctrl = Controller::new(fake.bar(), fake.dma(), self.options)?;
        Ok(Arc::new(NvmeShared::new(ctrl, self.name())?))
    }
}

const BAR_BYTES: usize = 0x2000;

fn check(offset: usize, width: usize) -> Result<(), Error> {
    if !offset.is_multiple_of(width) || offset + width > BAR_BYTES {
        return Err(Error::NvmeRegister { offset, width });
    }
    Ok(())
}

impl Registers for FakeBar {
    fn read32(&self, offset: usize) -> Result<u32, Error> {
        check(offset, 4)?;
        let mut s = self.0.state();
        if s.removed {
            return Ok(u32::MAX);
        }
        Ok(match offset {
            reg::VS => Version {
                major: 1,
                minor: 4,
                tertiary: 0,
            }
            .encode(),
            reg::CC => s.cc,
            reg::CSTS => {
                if s.ready_in > 0 && !s.dead {
                    s.ready_in -= 1;
                    if s.ready_in == 0 {
                        s.csts |= CstsFlags::RDY.bits();
                    }
                }
                s.csts
            }
            reg::AQA => s.aqa,
            _ => 0,
        })
    }

    fn write32(&self, offset: usize, value: u32) -> Result<(), Error> {
        check(offset, 4)?;
        let mut s = self.0.state();
        if s.dead {
            return Ok(());
        }
        match offset {
            reg::CC => s.write_cc(value),
            reg::AQA => s.aqa = value,
            o if o >= reg::DOORBELLS => s.doorbell(o, value),
            _ => {}
        }
        Ok(())
    }

    fn read64(&self, offset: usize) -> Result<u64, Error> {
        check(offset, 8)?;
        let s = self.0.state();
        if s.removed {
            return Ok(u64::MAX);
        }
        Ok(match offset {
            reg::CAP => s.cap.encode(),
            reg::ASQ => s.asq,
            reg::ACQ => s.acq,
            _ => 0,
        })
    }

    fn write64(&self, offset: usize, value: u64) -> Result<(), Error> {
        check(offset, 8)?;
        let mut s = self.0.state();
        if s.dead {
            return Ok(());
        }
        match offset {
            reg::ASQ => s.asq = value,
            reg::ACQ => s.acq = value,
            _ => {}
        }
        Ok(())
    }
}

impl Dma for FakeDma {
    fn alloc(&mut self, bytes: usize) -> Result<DmaRegion, Error> {
        {
            let mut s = self.0.state();
            s.allocs += 1;
            if s.fail_alloc == Some(s.allocs - 1) {
                return Err(Error::ZeroSizedRegion);
            }
        }
        let opts = PinnedOptions {
            huge_pages: HugePages::Never,
            locking: Locking::Never,
        };
        let mem = Arc::new(PinnedRegion::new(bytes.max(1), opts)?.into_device_shared());
        let mut s = self.0.state();
        let iova = s.next_iova;
        // A guard page between regions, so an overrun faults instead of landing in the next.
        s.next_iova += (mem.len() + PAGE) as u64;
        let region = DmaRegion::new(mem, iova);
        s.mem.insert(iova, region.clone());
        Ok(region)
    }

    fn map_lent(&mut self, mem: Arc<LentRegion>) -> Result<DmaRegion, Error> {
        let mut s = self.0.state();
        s.allocs += 1;
        if s.fail_alloc == Some(s.allocs - 1) {
            return Err(Error::ZeroSizedRegion);
        }
        let iova = s.next_iova;
        // A guard page between regions, as for `alloc`.
        s.next_iova += (mem.len() + PAGE) as u64;
        s.lent_maps += 1;
        let region = DmaRegion::lent(mem, iova);
        s.mem.insert(iova, region.clone());
        Ok(region)
    }

    fn free(&mut self, region: DmaRegion) {
        self.0.state().mem.remove(&region.iova());
    }

    fn is_mapped(&self, region: &DmaRegion) -> bool {
        self.0
            .state()
            .mem
            .get(&region.iova())
            .is_some_and(|r| r.same(region))
    }
}

type Outcome = Result<u32, Status>;

const fn generic(code: u8) -> Status {
    Status::new(StatusCodeType::Generic, code)
}
const fn specific(code: u8) -> Status {
    Status::new(StatusCodeType::CommandSpecific, code)
}
const INVALID_OPCODE: Status = generic(0x01);
const INVALID_FIELD: Status = generic(0x02);
const DATA_TRANSFER: Status = generic(0x04);
const INVALID_NAMESPACE: Status = generic(0x0B);
const SEQUENCE_ERROR: Status = generic(0x0C);
const PRP_OFFSET: Status = generic(0x13);
const LBA_RANGE: Status = generic(0x80);
const CQ_INVALID: Status = specific(0x00);
const INVALID_QID: Status = specific(0x01);
const INVALID_QSIZE: Status = specific(0x02);
const INVALID_DELETION: Status = specific(0x0C);

impl State {
    /// Bytes of namespace 1.
    fn namespace_bytes(&self) -> usize {
        self.image.as_ref().map_or(self.disk.len(), |i| i.bytes)
    }

    /// Writes every cached block to the image file (Flush, shutdown, a full cache).
    fn destage(&mut self) -> Result<(), Status> {
        let block = 1usize << self.block_shift;
        let Some(img) = self.image.as_mut() else {
            return Ok(());
        };
        for (index, data) in std::mem::take(&mut img.cache) {
            if let Err(e) = img.file.write_all_at(&data, (index * block) as u64) {
                self.image_error = Some(e.to_string());
                return Err(DATA_TRANSFER);
            }
        }
        Ok(())
    }

    /// Reads `out.len()` bytes of the namespace at byte `at` (whole blocks).
    fn media_read(&mut self, at: usize, out: &mut [u8]) -> Result<(), Status> {
        let block = 1usize << self.block_shift;
        let Some(img) = self.image.as_ref() else {
            let src = self.disk.get(at..at + out.len()).ok_or(LBA_RANGE)?;
            out.copy_from_slice(src);
            return Ok(());
        };
        for (i, chunk) in out.chunks_mut(block).enumerate() {
            let index = at / block + i;
            if let Some(data) = img.cache.get(&index) {
                chunk.copy_from_slice(data.get(..chunk.len()).ok_or(DATA_TRANSFER)?);
                continue;
            }
            chunk.fill(0);
            let mut done = 0;
            while done < chunk.len() {
                match img
                    .file
                    .read_at(&mut chunk[done..], (index * block + done) as u64)
                {
                    Ok(0) => break, // beyond the file's end: zeros
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return Err(DATA_TRANSFER),
                }
            }
        }
        Ok(())
    }

    /// Writes `data` (whole blocks) at byte `at` of the namespace: into the write cache when
    /// the namespace is an image.
    fn media_write(&mut self, at: usize, data: &[u8]) -> Result<(), Status> {
        let block = 1usize << self.block_shift;
        let Some(img) = self.image.as_mut() else {
            let dst = self.disk.get_mut(at..at + data.len()).ok_or(LBA_RANGE)?;
            dst.copy_from_slice(data);
            return Ok(());
        };
        for (i, chunk) in data.chunks(block).enumerate() {
            img.cache.insert(at / block + i, chunk.to_vec());
        }
        if img.cache.len() > WRITE_CACHE_BLOCKS {
            self.destage()?;
        }
        Ok(())
    }

    fn write_cc(&mut self, value: u32) {
        let old = ControllerConfig::decode(self.cc);
        let new = ControllerConfig::decode(value);
        self.cc = value;
        if old.enable && !new.enable {
            // Controller reset (§7.3.1): queues gone, not ready.
            self.sqs.clear();
            self.cqs.clear();
            self.csts = 0;
            self.ready_in = 0;
            return;
        }
        if !old.enable && new.enable {
            let (sq_entries, cq_entries) = aqa_decode(self.aqa);
            let sane = new.iosqes == 6
                && new.iocqes == 4
                && new.mps == 0
                && new.command_set == 0
                && self.asq != 0
                && self.acq != 0
                && (self.asq | self.acq).is_multiple_of(PAGE as u64);
            if !sane {
                self.csts |= CstsFlags::CFS.bits();
                return;
            }
            self.sqs.insert(
                0,
                Sq {
                    base: self.asq,
                    entries: sq_entries as u16,
                    head: 0,
                    tail: 0,
                    cqid: 0,
                },
            );
            self.cqs.insert(
                0,
                Cq {
                    base: self.acq,
                    entries: cq_entries as u16,
                    tail: 0,
                    head: 0,
                    phase: true,
                },
            );
            self.ready_in = self.ready_delay.max(1);
        }
        if new.enable && new.shutdown != Shutdown::None && old.shutdown == Shutdown::None {
            self.shutdowns += 1;
            // A normal shutdown writes the volatile cache back (§7.6.2).
            if self.destage().is_err() {
                log::error!("fake NVMe: destaging the write cache at shutdown failed");
            }
            let status = ControllerStatus {
                flags: CstsFlags::from_bits_truncate(self.csts),
                shutdown: Shutdown::AbruptOrComplete,
            };
            self.csts = status.encode();
        }
    }

    fn doorbell(&mut self, offset: usize, value: u32) {
        if self.csts & CstsFlags::RDY.bits() == 0 {
            return;
        }
        let stride = 4usize << self.cap.doorbell_stride_shift;
        let index = (offset - reg::DOORBELLS) / stride;
        let qid = (index / 2) as u16;
        let Ok(value) = u16::try_from(value) else {
            return;
        };
        if index.is_multiple_of(2) {
            let Some(sq) = self.sqs.get_mut(&qid) else {
                return;
            };
            if value >= sq.entries {
                return;
            }
            sq.tail = value;
            self.process(qid);
        } else {
            let Some(cq) = self.cqs.get_mut(&qid) else {
                return;
            };
            if value >= cq.entries {
                return;
            }
            cq.head = value;
            let waiting: Vec<u16> = self
                .sqs
                .iter()
                .filter(|(_, s)| s.cqid == qid)
                .map(|(&q, _)| q)
                .collect();
            for q in waiting {
                self.process(q);
            }
        }
    }

    fn region(&self, iova: u64, len: usize) -> Option<(&DmaRegion, usize)> {
        let (&base, r) = self.mem.range(..=iova).next_back()?;
        let off = usize::try_from(iova - base).ok()?;
        (off.checked_add(len)? <= r.len()).then_some((r, off))
    }

    fn count_lent(&self, r: &DmaRegion, bytes: usize) {
        if r.is_lent() {
            self.lent_bytes
                .set(self.lent_bytes.get().saturating_add(bytes as u64));
        }
    }

    fn dma_read(&self, iova: u64, out: &mut [u8]) -> Result<(), Status> {
        let (r, off) = self.region(iova, out.len()).ok_or(DATA_TRANSFER)?;
        self.count_lent(r, out.len());
        // SAFETY: the fake is the device: it reaches an IOVA only for the command it runs
        // (its queue entries, PRP lists and data pages, all named by the driver), and the
        // driver names a lent region's pages only while its engine owns their IoBuf, so no
        // Rust reference covers them.
        let view = unsafe { r.device_view() };
        view.read(off, out).map_err(|_| DATA_TRANSFER)
    }

    fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), Status> {
        let (r, off) = self.region(iova, data.len()).ok_or(DATA_TRANSFER)?;
        self.count_lent(r, data.len());
        // SAFETY: as in dma_read.
        let view = unsafe { r.device_view() };
        view.write(off, data).map_err(|_| DATA_TRANSFER)
    }

    /// Runs the commands of submission queue `qid` between head and tail while its
    /// completion queue has room.
    fn process(&mut self, qid: u16) {
        loop {
            let Some(sq) = self.sqs.get(&qid) else { return };
            let (cqid, head, tail, base, entries) =
                (sq.cqid, sq.head, sq.tail, sq.base, sq.entries);
            if head == tail {
                return;
            }
            let Some(cq) = self.cqs.get(&cqid) else {
                return;
            };
            if (cq.tail + 1) % cq.entries == cq.head {
                return; // full: wait for a head doorbell
            }
            let mut raw = [0u8; SQE_BYTES];
            let at = base + u64::from(head) * SQE_BYTES as u64;
            let new_head = (head + 1) % entries;
            if let Some(sq) = self.sqs.get_mut(&qid) {
                sq.head = new_head;
            }
            if self.dma_read(at, &mut raw).is_err() {
                continue;
            }
            let Ok(cmd) = SubmissionEntry::read_from_bytes(&raw) else {
                continue;
            };
            self.log.push((qid, cmd.opcode()));
            let outcome = if qid == 0 {
                self.admin(&cmd)
            } else {
                self.io(&cmd)
            };
            let mut cid = cmd.cid();
            let mut sq_id = qid;
            let mut outcome = outcome;
            if qid != 0 {
                match self.inject.pop_front() {
                    None => {}
                    Some(Inject::Status(s)) => outcome = Err(s),
                    Some(Inject::WrongCid) => cid = cid.wrapping_add(1000),
                    Some(Inject::BadSqid) => sq_id = qid + 7,
                    Some(Inject::Swallow) => continue,
                }
            }
            let (dw0, status) = match outcome {
                Ok(dw0) => (dw0, Status::SUCCESS),
                Err(s) => (0, s),
            };
            self.post(cqid, sq_id, new_head, cid, dw0, status);
        }
    }

    fn post(&mut self, cqid: u16, sq_id: u16, sq_head: u16, cid: u16, dw0: u32, status: Status) {
        let Some(cq) = self.cqs.get(&cqid) else {
            return;
        };
        let (base, tail, phase, entries) = (cq.base, cq.tail, cq.phase, cq.entries);
        let entry = CompletionEntry {
            dw0: U32::new(dw0),
            dw1: U32::new(0),
            sq_head: U16::new(sq_head),
            sq_id: U16::new(sq_id),
            cid: U16::new(cid),
            status: U16::new(CompletionEntry::status_word(status, phase)),
        };
        let _ = self.dma_write(base + u64::from(tail) * 16, entry.as_bytes());
        if let Some(cq) = self.cqs.get_mut(&cqid) {
            cq.tail = (tail + 1) % entries;
            if cq.tail == 0 {
                cq.phase = !cq.phase;
                *self.cq_wraps.entry(cqid).or_default() += 1;
            }
        }
    }

    fn admin(&mut self, cmd: &SubmissionEntry) -> Outcome {
        let cdw10 = cmd.cdw10.get();
        let cdw11 = cmd.cdw11.get();
        let qid = cdw10 as u16;
        let entries = (cdw10 >> 16) as u16 as u32 + 1;
        let valid_qid = (1..=self.max_io_queues).contains(&qid);
        match cmd.opcode() {
            admin_opcode::IDENTIFY => {
                let page = match (cdw10 & 0xFF, cmd.nsid.get()) {
                    (1, _) => self.identify_controller(),
                    (0, 1) => self.identify_namespace(),
                    (0, _) => return Err(INVALID_NAMESPACE),
                    _ => return Err(INVALID_FIELD),
                };
                if !cmd.prp1.get().is_multiple_of(PAGE as u64) {
                    return Err(PRP_OFFSET);
                }
                self.dma_write(cmd.prp1.get(), &page)?;
                Ok(0)
            }
            admin_opcode::SET_FEATURES if cdw10 & 0xFF == 0x07 => {
                if self.sqs.len() > 1 {
                    return Err(SEQUENCE_ERROR);
                }
                let n = u32::from(self.max_io_queues) - 1;
                Ok((cdw11 & 0xFFFF).min(n) | ((cdw11 >> 16).min(n)) << 16)
            }
            admin_opcode::CREATE_IO_CQ => {
                if !valid_qid || self.cqs.contains_key(&qid) {
                    return Err(INVALID_QID);
                }
                if entries < 2 || entries > self.cap.max_queue_entries {
                    return Err(INVALID_QSIZE);
                }
                if cdw11 & 1 == 0 {
                    return Err(INVALID_FIELD);
                }
                self.cqs.insert(
                    qid,
                    Cq {
                        base: cmd.prp1.get(),
                        entries: entries as u16,
                        tail: 0,
                        head: 0,
                        phase: true,
                    },
                );
                Ok(0)
            }
            admin_opcode::CREATE_IO_SQ => {
                if !valid_qid || self.sqs.contains_key(&qid) {
                    return Err(INVALID_QID);
                }
                if entries < 2 || entries > self.cap.max_queue_entries {
                    return Err(INVALID_QSIZE);
                }
                let cqid = (cdw11 >> 16) as u16;
                if cqid == 0 || !self.cqs.contains_key(&cqid) {
                    return Err(CQ_INVALID);
                }
                self.sqs.insert(
                    qid,
                    Sq {
                        base: cmd.prp1.get(),
                        entries: entries as u16,
                        head: 0,
                        tail: 0,
                        cqid,
                    },
                );
                Ok(0)
            }
            admin_opcode::DELETE_IO_SQ => {
                if qid == 0 || self.sqs.remove(&qid).is_none() {
                    return Err(INVALID_QID);
                }
                Ok(0)
            }
            admin_opcode::DELETE_IO_CQ => {
                if qid == 0 || !self.cqs.contains_key(&qid) {
                    return Err(INVALID_QID);
                }
                if self.sqs.values().any(|s| s.cqid == qid) {
                    return Err(INVALID_DELETION);
                }
                self.cqs.remove(&qid);
                Ok(0)
            }
            _ => Err(INVALID_OPCODE),
        }
    }

    fn identify_controller(&self) -> Vec<u8> {
        let mut id = RawIdentifyController::new_zeroed();
        id.vid = U16::new(0x1B36);
        id.sn = *b"FAKE0001            ";
        id.mn.fill(b' ');
        id.mn[..15].copy_from_slice(b"kvstack fake ns");
        id.fr = *b"0.1     ";
        id.mdts = self.mdts;
        id.sqes = 0x66;
        id.cqes = 0x44;
        id.nn = U32::new(1);
        id.vwc = 1;
        id.as_bytes().to_vec()
    }

    fn identify_namespace(&self) -> Vec<u8> {
        let mut ns = RawIdentifyNamespace::new_zeroed();
        let blocks = if self.inactive_namespace {
            0
        } else {
            (self.namespace_bytes() >> self.block_shift) as u64
        };
        ns.nsze = U64::new(blocks);
        ns.ncap = U64::new(blocks);
        ns.nuse = U64::new(blocks);
        ns.lbaf[0] = U32::new(
            LbaFormat {
                metadata_bytes: 0,
                block_shift: self.block_shift,
                relative_performance: 0,
            }
            .encode(),
        );
        ns.as_bytes().to_vec()
    }

    /// Walks a command's PRPs (§4.3) for `bytes` bytes, as a controller does.
    fn prp_pages(&mut self, cmd: &SubmissionEntry, bytes: usize) -> Result<Vec<u64>, Status> {
        let n = bytes.div_ceil(PAGE);
        let prp1 = cmd.prp1.get();
        if !prp1.is_multiple_of(PAGE as u64) {
            return Err(PRP_OFFSET);
        }
        let mut pages = vec![prp1];
        match n {
            0 | 1 => {}
            2 => pages.push(cmd.prp2.get()),
            _ => {
                let mut list = cmd.prp2.get();
                let mut lists = 0;
                while pages.len() < n {
                    lists += 1;
                    let mut raw = vec![0u8; PAGE];
                    self.dma_read(list, &mut raw)?;
                    let entries = <[U64]>::ref_from_bytes(&raw).map_err(|_| DATA_TRANSFER)?;
                    let left = n - pages.len();
                    if left <= PRPS_PER_LIST {
                        pages.extend(entries[..left].iter().map(|e| e.get()));
                    } else {
                        pages.extend(entries[..PRPS_PER_LIST - 1].iter().map(|e| e.get()));
                        list = entries[PRPS_PER_LIST - 1].get();
                    }
                }
                self.max_list_pages = self.max_list_pages.max(lists);
            }
        }
        if pages.iter().any(|p| p % PAGE as u64 != 0) {
            return Err(PRP_OFFSET);
        }
        Ok(pages)
    }

    fn io(&mut self, cmd: &SubmissionEntry) -> Outcome {
        if cmd.nsid.get() != 1 {
            return Err(INVALID_NAMESPACE);
        }
        match cmd.opcode() {
            nvm_opcode::FLUSH => {
                self.flushes += 1;
                self.destage()?;
                Ok(0)
            }
            op @ (nvm_opcode::READ | nvm_opcode::WRITE) => {
                let block = 1usize << self.block_shift;
                let total = self.namespace_bytes() / block;
                let (slba, blocks) = (cmd.slba(), cmd.blocks() as usize);
                let start = usize::try_from(slba).map_err(|_| LBA_RANGE)?;
                if start.checked_add(blocks).is_none_or(|end| end > total) {
                    return Err(LBA_RANGE);
                }
                let bytes = blocks * block;
                let pages = self.prp_pages(cmd, bytes)?;
                let at = start * block;
                let mut page = vec![0u8; PAGE];
                for (i, &iova) in pages.iter().enumerate() {
                    let range = at + i * PAGE..at + ((i + 1) * PAGE).min(bytes);
                    let len = range.len();
                    if op == nvm_opcode::READ {
                        self.media_read(range.start, &mut page[..len])?;
                        self.dma_write(iova, &page[..len])?;
                    } else {
                        self.dma_read(iova, &mut page[..len])?;
                        self.media_write(range.start, &page[..len])?;
                    }
                }
                Ok(0)
            }
            _ => Err(INVALID_OPCODE),
        }
    }
}
