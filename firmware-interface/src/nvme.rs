//! NVMe structures a userspace driver needs (`docs/nvme.md`), after the NVM Express Base
//! Specification, revision 1.4 (section numbers below are that revision's; 2.0 keeps every
//! layout used here).
//!
//! Everything the device reads or writes is a `zerocopy` struct of explicitly little-endian
//! fields with a compile-time size check: the controller register block ([`RawRegisters`],
//! whose field offsets are the register offsets), the 64-byte submission queue entry
//! ([`SubmissionEntry`]), the 16-byte completion queue entry ([`CompletionEntry`]) and the
//! 4096-byte Identify data ([`RawIdentifyController`], [`RawIdentifyNamespace`]). Values read
//! from the device are decoded into validated domain structs ([`Capabilities`],
//! [`ControllerInfo`], [`NamespaceInfo`], [`Status`]) before any arithmetic on them, as the SSD
//! record headers are. Commands are built by constructors on [`SubmissionEntry`]; data pointers
//! are PRPs, built by [`build_prps`] for buffers made of whole 4 KiB pages.

use std::fmt;
use std::mem::offset_of;

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::Error;

/// The memory page size this crate's PRP helpers and the driver use (CC.MPS = 0, §3.1.5):
/// 2^(12 + 0) bytes. Every controller supports it unless CAP.MPSMIN is larger, which
/// [`Capabilities::supports_page_size`] reports.
pub const PAGE: usize = 4096;

/// Bytes of a submission queue entry (§4.2); CC.IOSQES = log2 of it.
pub const SQE_BYTES: usize = 64;
/// Bytes of a completion queue entry (§4.6); CC.IOCQES = log2 of it.
pub const CQE_BYTES: usize = 16;
/// log2 of [`SQE_BYTES`], the CC.IOSQES value.
pub const SQE_SHIFT: u8 = 6;
/// log2 of [`CQE_BYTES`], the CC.IOCQES value.
pub const CQE_SHIFT: u8 = 4;

// ---------------------------------------------------------------------------------------------
// Controller registers (§3.1)

/// The controller registers at the start of BAR0, exactly as laid out (§3.1):
/// CAP, VS, INTMS, INTMC, CC, CSTS, NSSR, AQA, ASQ, ACQ. The block is never read as a whole
/// (registers are read one at a time with accesses of their own width); it exists so the
/// offsets below are derived from one declared layout.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned)]
#[repr(C)]
pub struct RawRegisters {
    /// Controller Capabilities (§3.1.1), decoded by [`Capabilities`].
    pub cap: U64,
    /// Version (§3.1.2), decoded by [`Version`].
    pub vs: U32,
    /// Interrupt Mask Set (§3.1.3); unused (the driver polls).
    pub intms: U32,
    /// Interrupt Mask Clear (§3.1.4); unused.
    pub intmc: U32,
    /// Controller Configuration (§3.1.5), [`ControllerConfig`].
    pub cc: U32,
    /// Reserved.
    pub reserved: U32,
    /// Controller Status (§3.1.6), [`ControllerStatus`].
    pub csts: U32,
    /// NVM Subsystem Reset (§3.1.7); unused.
    pub nssr: U32,
    /// Admin Queue Attributes (§3.1.8): [`aqa`].
    pub aqa: U32,
    /// Admin Submission Queue base address (§3.1.9), 4 KiB aligned.
    pub asq: U64,
    /// Admin Completion Queue base address (§3.1.10), 4 KiB aligned.
    pub acq: U64,
}

const _: () = assert!(size_of::<RawRegisters>() == 0x38);

/// Register offsets in BAR0 (§3.1), from [`RawRegisters`]' layout.
pub mod reg {
    use super::RawRegisters;
    use std::mem::offset_of;

    /// CAP, 64 bits.
    pub const CAP: usize = offset_of!(RawRegisters, cap);
    /// VS, 32 bits.
    pub const VS: usize = offset_of!(RawRegisters, vs);
    /// CC, 32 bits.
    pub const CC: usize = offset_of!(RawRegisters, cc);
    /// CSTS, 32 bits.
    pub const CSTS: usize = offset_of!(RawRegisters, csts);
    /// AQA, 32 bits.
    pub const AQA: usize = offset_of!(RawRegisters, aqa);
    /// ASQ, 64 bits.
    pub const ASQ: usize = offset_of!(RawRegisters, asq);
    /// ACQ, 64 bits.
    pub const ACQ: usize = offset_of!(RawRegisters, acq);
    /// The first doorbell (SQ 0 tail), §3.1.24.
    pub const DOORBELLS: usize = 0x1000;
}

const _: () = assert!(reg::CAP == 0x00 && reg::VS == 0x08 && reg::CC == 0x14);
const _: () = assert!(reg::CSTS == 0x1C && reg::AQA == 0x24);
const _: () = assert!(reg::ASQ == 0x28 && reg::ACQ == 0x30);
const _: () = assert!(offset_of!(RawRegisters, intms) == 0x0C);

/// Offset of queue `qid`'s submission tail doorbell (`cq` false, SQyTDBL, §3.1.24) or
/// completion head doorbell (`cq` true, CQyHDBL, §3.1.25): `0x1000 + (2 qid + cq) * (4 <<
/// CAP.DSTRD)`. `None` for a DSTRD wider than its 4 bits or an offset beyond `usize`.
pub fn doorbell_offset(qid: u16, cq: bool, dstrd: u8) -> Option<usize> {
    if dstrd > 0xF {
        return None;
    }
    let stride = 4usize << dstrd;
    let index = 2 * usize::from(qid) + usize::from(cq);
    index.checked_mul(stride)?.checked_add(reg::DOORBELLS)
}

bitflags::bitflags! {
    /// Single-bit fields of CAP (§3.1.1).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct CapFlags: u64 {
        /// CQR: I/O queues must be physically contiguous (the driver always makes them so).
        const CQR = 1 << 16;
        /// NSSRS: NVM subsystem reset supported.
        const NSSRS = 1 << 36;
        /// BPS: boot partitions supported.
        const BPS = 1 << 45;
        /// PMRS: persistent memory region supported.
        const PMRS = 1 << 56;
        /// CMBS: controller memory buffer supported.
        const CMBS = 1 << 57;
    }
}

/// CAP.CSS bit 0: the NVM command set (§3.1.1).
pub const CSS_NVM: u8 = 1 << 0;

/// Controller Capabilities (CAP, §3.1.1), decoded and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// MQES + 1: entries the largest I/O queue may have (MQES is 0's based, at least 1).
    pub max_queue_entries: u32,
    /// Single-bit capabilities.
    pub flags: CapFlags,
    /// AMS: optional arbitration mechanisms (bit 0 weighted round robin, bit 1 vendor).
    pub arbitration: u8,
    /// TO: worst-case time for CSTS.RDY to change after CC.EN changes, in 500 ms units.
    pub timeout_500ms: u8,
    /// DSTRD: doorbell stride is `4 << dstrd` bytes.
    pub doorbell_stride_shift: u8,
    /// CSS: command sets supported (bit 0 NVM, [`CSS_NVM`]).
    pub command_sets: u8,
    /// MPSMIN: smallest memory page size is 2^(12 + mpsmin).
    pub mps_min: u8,
    /// MPSMAX: largest memory page size is 2^(12 + mpsmax).
    pub mps_max: u8,
}

impl Capabilities {
    /// Decodes CAP.
    ///
    /// # Errors
    /// [`Error::NvmeField`] for MQES 0 (a queue needs two entries) or MPSMIN > MPSMAX.
    pub fn decode(cap: u64) -> Result<Capabilities, Error> {
        let field = |shift: u32, bits: u32| (cap >> shift) & ((1 << bits) - 1);
        let mqes = field(0, 16);
        if mqes == 0 {
            return Err(Error::NvmeField {
                structure: "CAP",
                field: "MQES",
                value: mqes,
                reason: "0 (queues need at least two entries)",
            });
        }
        let c = Capabilities {
            max_queue_entries: mqes as u32 + 1,
            flags: CapFlags::from_bits_truncate(cap),
            arbitration: field(17, 2) as u8,
            timeout_500ms: field(24, 8) as u8,
            doorbell_stride_shift: field(32, 4) as u8,
            command_sets: field(37, 8) as u8,
            mps_min: field(48, 4) as u8,
            mps_max: field(52, 4) as u8,
        };
        if c.mps_min > c.mps_max {
            return Err(Error::NvmeField {
                structure: "CAP",
                field: "MPSMIN",
                value: u64::from(c.mps_min),
                reason: "larger than MPSMAX",
            });
        }
        Ok(c)
    }

    /// Encodes the fields back into a CAP value (for fakes and tests).
    pub fn encode(&self) -> u64 {
        u64::from(self.max_queue_entries.saturating_sub(1) & 0xFFFF)
            | self.flags.bits()
            | u64::from(self.arbitration & 0x3) << 17
            | u64::from(self.timeout_500ms) << 24
            | u64::from(self.doorbell_stride_shift & 0xF) << 32
            | u64::from(self.command_sets) << 37
            | u64::from(self.mps_min & 0xF) << 48
            | u64::from(self.mps_max & 0xF) << 52
    }

    /// Whether memory pages of `bytes` (a power of two) are within MPSMIN..=MPSMAX.
    pub fn supports_page_size(&self, bytes: usize) -> bool {
        (12 + u32::from(self.mps_min)..=12 + u32::from(self.mps_max))
            .any(|s| 1usize.checked_shl(s) == Some(bytes))
    }

    /// CAP.TO in milliseconds (at least 500: a zero field would mean no wait at all, which no
    /// controller can honour).
    pub fn ready_timeout_ms(&self) -> u64 {
        u64::from(self.timeout_500ms.max(1)) * 500
    }
}

/// Version (VS, §3.1.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// MJR.
    pub major: u16,
    /// MNR.
    pub minor: u8,
    /// TER.
    pub tertiary: u8,
}

impl Version {
    /// Decodes VS.
    pub fn decode(vs: u32) -> Version {
        Version {
            major: (vs >> 16) as u16,
            minor: (vs >> 8) as u8,
            tertiary: vs as u8,
        }
    }

    /// Encodes VS.
    pub fn encode(&self) -> u32 {
        u32::from(self.major) << 16 | u32::from(self.minor) << 8 | u32::from(self.tertiary)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.tertiary)
    }
}

/// CC.SHN / CSTS.SHST values (§3.1.5, §3.1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// SHN 00b: no notification. SHST 00b: normal operation.
    None,
    /// SHN 01b: normal shutdown. SHST 01b: shutdown processing occurring.
    Normal,
    /// SHN 10b: abrupt shutdown. SHST 10b: shutdown processing complete.
    AbruptOrComplete,
    /// 11b: reserved.
    Reserved,
}

impl Shutdown {
    fn from_bits(b: u32) -> Shutdown {
        match b & 0x3 {
            0 => Shutdown::None,
            1 => Shutdown::Normal,
            2 => Shutdown::AbruptOrComplete,
            _ => Shutdown::Reserved,
        }
    }

    fn bits(self) -> u32 {
        match self {
            Shutdown::None => 0,
            Shutdown::Normal => 1,
            Shutdown::AbruptOrComplete => 2,
            Shutdown::Reserved => 3,
        }
    }
}

/// Controller Configuration (CC, §3.1.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControllerConfig {
    /// EN: enable; clearing it resets the controller.
    pub enable: bool,
    /// CSS: I/O command set (000b NVM).
    pub command_set: u8,
    /// MPS: memory page size is 2^(12 + mps).
    pub mps: u8,
    /// AMS: arbitration (000b round robin).
    pub arbitration: u8,
    /// SHN: shutdown notification.
    pub shutdown: Shutdown,
    /// IOSQES: log2 of the I/O submission entry size ([`SQE_SHIFT`]).
    pub iosqes: u8,
    /// IOCQES: log2 of the I/O completion entry size ([`CQE_SHIFT`]).
    pub iocqes: u8,
}

impl ControllerConfig {
    /// What the driver writes to enable a controller: NVM command set, 4 KiB pages, round
    /// robin, 64/16-byte entries.
    pub const fn enabled() -> ControllerConfig {
        ControllerConfig {
            enable: true,
            command_set: 0,
            mps: 0,
            arbitration: 0,
            shutdown: Shutdown::None,
            iosqes: SQE_SHIFT,
            iocqes: CQE_SHIFT,
        }
    }

    /// Decodes CC.
    pub fn decode(cc: u32) -> ControllerConfig {
        ControllerConfig {
            enable: cc & 1 != 0,
            command_set: ((cc >> 4) & 0x7) as u8,
            mps: ((cc >> 7) & 0xF) as u8,
            arbitration: ((cc >> 11) & 0x7) as u8,
            shutdown: Shutdown::from_bits(cc >> 14),
            iosqes: ((cc >> 16) & 0xF) as u8,
            iocqes: ((cc >> 20) & 0xF) as u8,
        }
    }

    /// Encodes CC (fields wider than theirs are truncated).
    pub fn encode(&self) -> u32 {
        u32::from(self.enable)
            | u32::from(self.command_set & 0x7) << 4
            | u32::from(self.mps & 0xF) << 7
            | u32::from(self.arbitration & 0x7) << 11
            | self.shutdown.bits() << 14
            | u32::from(self.iosqes & 0xF) << 16
            | u32::from(self.iocqes & 0xF) << 20
    }
}

bitflags::bitflags! {
    /// Single-bit fields of CSTS (§3.1.6).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct CstsFlags: u32 {
        /// RDY: the controller is ready to process commands (follows CC.EN).
        const RDY = 1 << 0;
        /// CFS: controller fatal status; only a reset recovers.
        const CFS = 1 << 1;
        /// NSSRO: an NVM subsystem reset occurred.
        const NSSRO = 1 << 4;
        /// PP: processing paused.
        const PP = 1 << 5;
    }
}

/// Controller Status (CSTS, §3.1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControllerStatus {
    /// Single-bit fields.
    pub flags: CstsFlags,
    /// SHST: shutdown status.
    pub shutdown: Shutdown,
}

impl ControllerStatus {
    /// Decodes CSTS. All ones is what a read of a removed device returns: see
    /// [`ControllerStatus::is_removed`].
    pub fn decode(csts: u32) -> ControllerStatus {
        ControllerStatus {
            flags: CstsFlags::from_bits_truncate(csts),
            shutdown: Shutdown::from_bits(csts >> 2),
        }
    }

    /// Encodes CSTS.
    pub fn encode(&self) -> u32 {
        self.flags.bits() | self.shutdown.bits() << 2
    }

    /// Whether a raw CSTS value is all ones: a PCIe read of a device that is gone.
    pub fn is_removed(csts: u32) -> bool {
        csts == u32::MAX
    }
}

/// AQA (§3.1.8): admin SQ and CQ sizes, each 0's based in 12 bits. `None` unless both are in
/// 2..=4096 entries.
pub fn aqa(sq_entries: u32, cq_entries: u32) -> Option<u32> {
    let ok = |n: u32| (2..=4096).contains(&n);
    (ok(sq_entries) && ok(cq_entries)).then(|| (sq_entries - 1) | (cq_entries - 1) << 16)
}

/// The `(sq_entries, cq_entries)` an AQA value declares.
pub fn aqa_decode(aqa: u32) -> (u32, u32) {
    ((aqa & 0xFFF) + 1, ((aqa >> 16) & 0xFFF) + 1)
}

// ---------------------------------------------------------------------------------------------
// Submission queue entry (§4.2)

/// Admin command opcodes (§5).
pub mod admin_opcode {
    /// Delete I/O Submission Queue (§5.6).
    pub const DELETE_IO_SQ: u8 = 0x00;
    /// Create I/O Submission Queue (§5.4).
    pub const CREATE_IO_SQ: u8 = 0x01;
    /// Delete I/O Completion Queue (§5.5).
    pub const DELETE_IO_CQ: u8 = 0x04;
    /// Create I/O Completion Queue (§5.3).
    pub const CREATE_IO_CQ: u8 = 0x05;
    /// Identify (§5.15).
    pub const IDENTIFY: u8 = 0x06;
    /// Set Features (§5.21).
    pub const SET_FEATURES: u8 = 0x09;
}

/// NVM command set opcodes (§6).
pub mod nvm_opcode {
    /// Flush (§6.8).
    pub const FLUSH: u8 = 0x00;
    /// Write (§6.15).
    pub const WRITE: u8 = 0x01;
    /// Read (§6.9).
    pub const READ: u8 = 0x02;
}

/// Identify CNS values (§5.15).
pub mod cns {
    /// The Identify Namespace data structure of CDW1.NSID.
    pub const NAMESPACE: u8 = 0x00;
    /// The Identify Controller data structure.
    pub const CONTROLLER: u8 = 0x01;
}

/// Feature identifier of Number of Queues (§5.21.1.7).
pub const FEATURE_NUMBER_OF_QUEUES: u8 = 0x07;

/// A submission queue entry (§4.2): 64 bytes, the common command format. The
/// constructors set every field a command uses; the driver sets the command identifier with
/// [`SubmissionEntry::set_cid`] when it places the entry in a queue.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    Immutable,
    KnownLayout,
    Unaligned,
)]
#[repr(C)]
pub struct SubmissionEntry {
    /// CDW0: OPC bits 7:0, FUSE 9:8, PSDT 15:14 (00b: PRPs), CID 31:16.
    pub cdw0: U32,
    /// NSID.
    pub nsid: U32,
    /// CDW2-3: reserved for the commands used here.
    pub cdw2: U32,
    /// CDW3.
    pub cdw3: U32,
    /// MPTR: metadata pointer (unused: namespaces with separate metadata are refused).
    pub mptr: U64,
    /// DPTR, first PRP entry.
    pub prp1: U64,
    /// DPTR, second PRP entry or PRP list pointer (§4.3).
    pub prp2: U64,
    /// CDW10, command specific.
    pub cdw10: U32,
    /// CDW11.
    pub cdw11: U32,
    /// CDW12.
    pub cdw12: U32,
    /// CDW13.
    pub cdw13: U32,
    /// CDW14.
    pub cdw14: U32,
    /// CDW15.
    pub cdw15: U32,
}

const _: () = assert!(size_of::<SubmissionEntry>() == SQE_BYTES);
const _: () = assert!(offset_of!(SubmissionEntry, prp1) == 24);
const _: () = assert!(offset_of!(SubmissionEntry, cdw10) == 40);

impl SubmissionEntry {
    fn new(opcode: u8, nsid: u32) -> SubmissionEntry {
        SubmissionEntry {
            cdw0: U32::new(u32::from(opcode)),
            nsid: U32::new(nsid),
            ..Default::default()
        }
    }

    /// OPC.
    pub fn opcode(&self) -> u8 {
        self.cdw0.get() as u8
    }

    /// CID.
    pub fn cid(&self) -> u16 {
        (self.cdw0.get() >> 16) as u16
    }

    /// Sets CID (bits 31:16 of CDW0), keeping the opcode.
    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = U32::new(self.cdw0.get() & 0xFFFF | u32::from(cid) << 16);
    }

    /// Sets the data pointer.
    pub fn set_prps(&mut self, prps: Prps) {
        self.prp1 = U64::new(prps.prp1);
        self.prp2 = U64::new(prps.prp2);
    }

    /// Identify (§5.15): `cns` ([`cns`]) for namespace `nsid`, into the 4 KiB page at `page`.
    pub fn identify(cns: u8, nsid: u32, page: u64) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::IDENTIFY, nsid);
        e.prp1 = U64::new(page);
        e.cdw10 = U32::new(u32::from(cns));
        e
    }

    /// Create I/O Completion Queue (§5.3): queue `qid` of `entries` entries at `base`
    /// (physically contiguous, interrupts disabled: the driver polls).
    pub fn create_io_cq(qid: u16, entries: u16, base: u64) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::CREATE_IO_CQ, 0);
        e.prp1 = U64::new(base);
        e.cdw10 = U32::new(u32::from(qid) | u32::from(entries.saturating_sub(1)) << 16);
        // PC (bit 0) set, IEN (bit 1) clear, IV 0.
        e.cdw11 = U32::new(1);
        e
    }

    /// Create I/O Submission Queue (§5.4): queue `qid` of `entries` entries at `base`
    /// (physically contiguous, medium priority) completing into CQ `cqid`.
    pub fn create_io_sq(qid: u16, entries: u16, base: u64, cqid: u16) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::CREATE_IO_SQ, 0);
        e.prp1 = U64::new(base);
        e.cdw10 = U32::new(u32::from(qid) | u32::from(entries.saturating_sub(1)) << 16);
        // PC (bit 0) set, QPRIO (bits 2:1) 00b, CQID (bits 31:16).
        e.cdw11 = U32::new(1 | u32::from(cqid) << 16);
        e
    }

    /// Delete I/O Submission Queue `qid` (§5.6).
    pub fn delete_io_sq(qid: u16) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::DELETE_IO_SQ, 0);
        e.cdw10 = U32::new(u32::from(qid));
        e
    }

    /// Delete I/O Completion Queue `qid` (§5.5).
    pub fn delete_io_cq(qid: u16) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::DELETE_IO_CQ, 0);
        e.cdw10 = U32::new(u32::from(qid));
        e
    }

    /// Set Features, Number of Queues (§5.21.1.7): asks for `sq` I/O submission and `cq` I/O
    /// completion queues (each at least 1; the fields are 0's based). The completion's DW0
    /// holds what was granted ([`QueuesGranted::decode`]).
    pub fn set_number_of_queues(sq: u16, cq: u16) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(admin_opcode::SET_FEATURES, 0);
        e.cdw10 = U32::new(u32::from(FEATURE_NUMBER_OF_QUEUES));
        e.cdw11 = U32::new(u32::from(sq.saturating_sub(1)) | u32::from(cq.saturating_sub(1)) << 16);
        e
    }

    /// The common fields of Read and Write.
    fn rw(opcode: u8, nsid: u32, slba: u64, blocks: u32) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(opcode, nsid);
        e.cdw10 = U32::new(slba as u32);
        e.cdw11 = U32::new((slba >> 32) as u32);
        // NLB (bits 15:0) is 0's based; PRINFO, FUA and LR stay 0.
        e.cdw12 = U32::new(blocks.saturating_sub(1) & 0xFFFF);
        e
    }

    /// Read (§6.9) of `blocks` logical blocks (1..=65536) from `slba` of namespace `nsid`; the
    /// data pointer is set with [`SubmissionEntry::set_prps`].
    pub fn read(nsid: u32, slba: u64, blocks: u32) -> SubmissionEntry {
        SubmissionEntry::rw(nvm_opcode::READ, nsid, slba, blocks)
    }

    /// Write (§6.15), fields as [`SubmissionEntry::read`].
    pub fn write(nsid: u32, slba: u64, blocks: u32) -> SubmissionEntry {
        SubmissionEntry::rw(nvm_opcode::WRITE, nsid, slba, blocks)
    }

    /// Flush (§6.8) of namespace `nsid`'s volatile write cache.
    pub fn flush(nsid: u32) -> SubmissionEntry {
        SubmissionEntry::new(nvm_opcode::FLUSH, nsid)
    }

    /// SLBA of a Read or Write (CDW11:CDW10).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw11.get()) << 32 | u64::from(self.cdw10.get())
    }

    /// Logical blocks of a Read or Write (NLB + 1).
    pub fn blocks(&self) -> u32 {
        (self.cdw12.get() & 0xFFFF) + 1
    }
}

/// What Set Features Number of Queues granted (§5.21.1.7, completion DW0): NSQA and NCQA,
/// 0's based.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuesGranted {
    /// I/O submission queues allocated.
    pub sq: u32,
    /// I/O completion queues allocated.
    pub cq: u32,
}

impl QueuesGranted {
    /// Decodes the completion's DW0.
    pub fn decode(dw0: u32) -> QueuesGranted {
        QueuesGranted {
            sq: (dw0 & 0xFFFF) + 1,
            cq: (dw0 >> 16) + 1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Completion queue entry (§4.6)

/// A completion queue entry (§4.6): 16 bytes.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    Immutable,
    KnownLayout,
    Unaligned,
)]
#[repr(C)]
pub struct CompletionEntry {
    /// DW0, command specific.
    pub dw0: U32,
    /// DW1, reserved.
    pub dw1: U32,
    /// SQHD: the submission queue head the controller has consumed up to.
    pub sq_head: U16,
    /// SQID: the submission queue the command came from.
    pub sq_id: U16,
    /// CID: the command's identifier.
    pub cid: U16,
    /// Bit 0 P (phase tag), bits 15:1 the status field (§4.6.1).
    pub status: U16,
}

const _: () = assert!(size_of::<CompletionEntry>() == CQE_BYTES);
const _: () = assert!(offset_of!(CompletionEntry, cid) == 12);

impl CompletionEntry {
    /// The phase tag: inverted by the controller on each pass through the queue, so an entry
    /// whose tag equals the host's expected phase is new.
    pub fn phase(&self) -> bool {
        self.status.get() & 1 != 0
    }

    /// The decoded status field.
    pub fn status(&self) -> Status {
        Status::decode(self.status.get() >> 1)
    }

    /// The status word for `status` and phase `phase` (for fakes and tests).
    pub fn status_word(status: Status, phase: bool) -> u16 {
        status.encode() << 1 | u16::from(phase)
    }
}

/// Status Code Type (§4.6.1.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusCodeType {
    /// 0h: generic command status.
    Generic,
    /// 1h: command specific status.
    CommandSpecific,
    /// 2h: media and data integrity errors.
    MediaError,
    /// 3h: path related status.
    Path,
    /// 7h: vendor specific.
    Vendor,
    /// 4h-6h: reserved.
    Reserved(u8),
}

impl StatusCodeType {
    /// The 3-bit SCT value.
    pub fn code(self) -> u8 {
        match self {
            StatusCodeType::Generic => 0,
            StatusCodeType::CommandSpecific => 1,
            StatusCodeType::MediaError => 2,
            StatusCodeType::Path => 3,
            StatusCodeType::Vendor => 7,
            StatusCodeType::Reserved(c) => c & 0x7,
        }
    }

    /// The type of a 3-bit SCT value.
    pub fn from_code(code: u8) -> StatusCodeType {
        match code & 0x7 {
            0 => StatusCodeType::Generic,
            1 => StatusCodeType::CommandSpecific,
            2 => StatusCodeType::MediaError,
            3 => StatusCodeType::Path,
            7 => StatusCodeType::Vendor,
            c => StatusCodeType::Reserved(c),
        }
    }

    /// Name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            StatusCodeType::Generic => "generic",
            StatusCodeType::CommandSpecific => "command specific",
            StatusCodeType::MediaError => "media and data integrity",
            StatusCodeType::Path => "path related",
            StatusCodeType::Vendor => "vendor specific",
            StatusCodeType::Reserved(_) => "reserved",
        }
    }
}

/// The status field of a completion (§4.6.1): type, code and retry hints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Status {
    /// SCT.
    pub code_type: StatusCodeType,
    /// SC.
    pub code: u8,
    /// CRD: command retry delay selector.
    pub retry_delay: u8,
    /// M: more information in the Error Information log page.
    pub more: bool,
    /// DNR: do not retry; the same command would fail again.
    pub do_not_retry: bool,
}

impl Status {
    /// Successful Completion.
    pub const SUCCESS: Status = Status::new(StatusCodeType::Generic, 0);

    /// A status of type `code_type` and code `code`, no hints.
    pub const fn new(code_type: StatusCodeType, code: u8) -> Status {
        Status {
            code_type,
            code,
            retry_delay: 0,
            more: false,
            do_not_retry: false,
        }
    }

    /// Decodes the 15-bit status field (the status word shifted right by one).
    pub fn decode(field: u16) -> Status {
        Status {
            code: field as u8,
            code_type: StatusCodeType::from_code((field >> 8) as u8),
            retry_delay: ((field >> 11) & 0x3) as u8,
            more: field & 1 << 13 != 0,
            do_not_retry: field & 1 << 14 != 0,
        }
    }

    /// Encodes the 15-bit status field.
    pub fn encode(&self) -> u16 {
        u16::from(self.code)
            | u16::from(self.code_type.code()) << 8
            | u16::from(self.retry_delay & 0x3) << 11
            | u16::from(self.more) << 13
            | u16::from(self.do_not_retry) << 14
    }

    /// Whether the command succeeded (SCT 0, SC 0).
    pub fn is_success(&self) -> bool {
        self.code_type == StatusCodeType::Generic && self.code == 0
    }

    /// The specification's name of the code, for the codes a driver of this kind meets
    /// (§4.6.1.2.1 generic, §4.6.1.2.2 command specific, §4.6.1.2.3 media; NVM command set
    /// values 80h+ of each); `None` for others.
    pub fn name(&self) -> Option<&'static str> {
        use StatusCodeType as T;
        Some(match (self.code_type, self.code) {
            (T::Generic, 0x00) => "Successful Completion",
            (T::Generic, 0x01) => "Invalid Command Opcode",
            (T::Generic, 0x02) => "Invalid Field in Command",
            (T::Generic, 0x03) => "Command ID Conflict",
            (T::Generic, 0x04) => "Data Transfer Error",
            (T::Generic, 0x05) => "Commands Aborted due to Power Loss Notification",
            (T::Generic, 0x06) => "Internal Error",
            (T::Generic, 0x07) => "Command Abort Requested",
            (T::Generic, 0x08) => "Command Aborted due to SQ Deletion",
            (T::Generic, 0x0B) => "Invalid Namespace or Format",
            (T::Generic, 0x0C) => "Command Sequence Error",
            (T::Generic, 0x13) => "PRP Offset Invalid",
            (T::Generic, 0x80) => "LBA Out of Range",
            (T::Generic, 0x81) => "Capacity Exceeded",
            (T::Generic, 0x82) => "Namespace Not Ready",
            (T::CommandSpecific, 0x00) => "Completion Queue Invalid",
            (T::CommandSpecific, 0x01) => "Invalid Queue Identifier",
            (T::CommandSpecific, 0x02) => "Invalid Queue Size",
            (T::CommandSpecific, 0x0C) => "Invalid Queue Deletion",
            (T::MediaError, 0x80) => "Write Fault",
            (T::MediaError, 0x81) => "Unrecovered Read Error",
            (T::MediaError, 0x86) => "Access Denied",
            (T::MediaError, 0x87) => "Deallocated or Unwritten Logical Block",
            _ => return None,
        })
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "status code type {:#x} ({}), status code {:#04x}",
            self.code_type.code(),
            self.code_type.name(),
            self.code
        )?;
        if let Some(name) = self.name() {
            write!(f, " ({name})")?;
        }
        if self.do_not_retry {
            f.write_str(", do not retry")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Identify data (§5.15)

/// The Identify Controller data structure (§5.15), 4096 bytes: the fields the
/// driver reads, the rest kept as reserved bytes.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned)]
#[repr(C)]
pub struct RawIdentifyController {
    /// VID: PCI vendor id.
    pub vid: U16,
    /// SSVID: PCI subsystem vendor id.
    pub ssvid: U16,
    /// SN: serial number, ASCII, space padded.
    pub sn: [u8; 20],
    /// MN: model number, ASCII, space padded.
    pub mn: [u8; 40],
    /// FR: firmware revision, ASCII, space padded.
    pub fr: [u8; 8],
    /// RAB: recommended arbitration burst.
    pub rab: u8,
    /// IEEE OUI.
    pub ieee: [u8; 3],
    /// CMIC.
    pub cmic: u8,
    /// MDTS: maximum data transfer size, 2^MDTS units of CAP.MPSMIN pages; 0: no limit.
    pub mdts: u8,
    /// CNTLID: controller id.
    pub cntlid: U16,
    /// VER: version (as VS).
    pub ver: U32,
    /// Bytes 84..512.
    pub reserved84: [u8; 428],
    /// SQES: bits 3:0 required (minimum) and 7:4 maximum log2 submission entry size.
    pub sqes: u8,
    /// CQES: the same for completion entries.
    pub cqes: u8,
    /// MAXCMD: outstanding commands limit (fabrics); 0 here.
    pub maxcmd: U16,
    /// NN: number of namespaces (the largest valid NSID).
    pub nn: U32,
    /// ONCS: optional NVM commands supported.
    pub oncs: U16,
    /// FUSES.
    pub fuses: U16,
    /// FNA.
    pub fna: u8,
    /// VWC: bit 0, a volatile write cache is present (Flush has work to do).
    pub vwc: u8,
    /// Bytes 526..4096.
    pub reserved526: [u8; 3570],
}

const _: () = assert!(size_of::<RawIdentifyController>() == PAGE);
const _: () = assert!(offset_of!(RawIdentifyController, mdts) == 77);
const _: () = assert!(offset_of!(RawIdentifyController, sqes) == 512);
const _: () = assert!(offset_of!(RawIdentifyController, nn) == 516);
const _: () = assert!(offset_of!(RawIdentifyController, vwc) == 525);

/// What the driver uses of Identify Controller, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerInfo {
    /// PCI vendor id.
    pub vendor_id: u16,
    /// Serial number, trailing spaces removed.
    pub serial: String,
    /// Model number, trailing spaces removed.
    pub model: String,
    /// Firmware revision, trailing spaces removed.
    pub firmware: String,
    /// MDTS as a power of two of minimum pages; `None` for no limit.
    pub mdts: Option<u8>,
    /// Controller id.
    pub controller_id: u16,
    /// Number of namespaces.
    pub namespaces: u32,
    /// Whether a volatile write cache is present.
    pub volatile_write_cache: bool,
}

fn ascii_field(structure: &'static str, field: &'static str, raw: &[u8]) -> Result<String, Error> {
    match std::str::from_utf8(raw) {
        Ok(s) if s.bytes().all(|b| (0x20..0x7F).contains(&b) || b == 0) => {
            Ok(s.trim_end_matches([' ', '\0']).to_owned())
        }
        _ => Err(Error::NvmeField {
            structure,
            field,
            value: 0,
            reason: "not printable ASCII",
        }),
    }
}

impl ControllerInfo {
    /// Decodes and checks Identify Controller data: the entry sizes the driver uses (64 and
    /// 16 bytes) must be within SQES/CQES, and the strings printable ASCII.
    ///
    /// # Errors
    /// [`Error::NvmeLength`] for fewer than 4096 bytes, [`Error::NvmeField`].
    pub fn decode(bytes: &[u8]) -> Result<ControllerInfo, Error> {
        let raw = read_page::<RawIdentifyController>("Identify Controller", bytes)?;
        let sizes_ok = |v: u8, want: u8| (v & 0xF) <= want && want <= (v >> 4);
        if !sizes_ok(raw.sqes, SQE_SHIFT) {
            return Err(Error::NvmeField {
                structure: "Identify Controller",
                field: "SQES",
                value: u64::from(raw.sqes),
                reason: "does not allow 64-byte submission entries",
            });
        }
        if !sizes_ok(raw.cqes, CQE_SHIFT) {
            return Err(Error::NvmeField {
                structure: "Identify Controller",
                field: "CQES",
                value: u64::from(raw.cqes),
                reason: "does not allow 16-byte completion entries",
            });
        }
        Ok(ControllerInfo {
            vendor_id: raw.vid.get(),
            serial: ascii_field("Identify Controller", "SN", &raw.sn)?,
            model: ascii_field("Identify Controller", "MN", &raw.mn)?,
            firmware: ascii_field("Identify Controller", "FR", &raw.fr)?,
            mdts: (raw.mdts != 0).then_some(raw.mdts),
            controller_id: raw.cntlid.get(),
            namespaces: raw.nn.get(),
            volatile_write_cache: raw.vwc & 1 != 0,
        })
    }

    /// Largest transfer in bytes for minimum pages of `min_page` bytes, `None` for no limit
    /// (or a limit beyond `u64`).
    pub fn max_transfer(&self, min_page: u64) -> Option<u64> {
        self.mdts
            .and_then(|m| 1u64.checked_shl(u32::from(m)))
            .and_then(|p| p.checked_mul(min_page))
    }
}

/// The Identify Namespace data structure (§5.15), 4096 bytes.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout, Unaligned)]
#[repr(C)]
pub struct RawIdentifyNamespace {
    /// NSZE: namespace size in logical blocks.
    pub nsze: U64,
    /// NCAP: namespace capacity in logical blocks.
    pub ncap: U64,
    /// NUSE: namespace utilization.
    pub nuse: U64,
    /// NSFEAT.
    pub nsfeat: u8,
    /// NLBAF: number of LBA formats, 0's based.
    pub nlbaf: u8,
    /// FLBAS: bits 3:0 the format in use (2.0: bits 6:5 its upper bits), bit 4 metadata at
    /// the end of each block.
    pub flbas: u8,
    /// MC.
    pub mc: u8,
    /// DPC.
    pub dpc: u8,
    /// DPS.
    pub dps: u8,
    /// Bytes 30..128.
    pub reserved30: [u8; 98],
    /// LBAF0..63 (2.0; 1.4 has 16 and reserves the rest): bits 15:0 MS (metadata bytes),
    /// 23:16 LBADS (log2 of the block size), 25:24 RP.
    pub lbaf: [U32; 64],
    /// Bytes 384..4096.
    pub reserved384: [u8; 3712],
}

const _: () = assert!(size_of::<RawIdentifyNamespace>() == PAGE);
const _: () = assert!(offset_of!(RawIdentifyNamespace, flbas) == 26);
const _: () = assert!(offset_of!(RawIdentifyNamespace, lbaf) == 128);

/// An LBA format (§5.15).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbaFormat {
    /// MS: metadata bytes per block.
    pub metadata_bytes: u16,
    /// LBADS: log2 of the block size (9..=16 accepted).
    pub block_shift: u8,
    /// RP: relative performance (0 best).
    pub relative_performance: u8,
}

impl LbaFormat {
    /// Decodes an LBAF entry.
    pub fn decode(v: u32) -> LbaFormat {
        LbaFormat {
            metadata_bytes: v as u16,
            block_shift: (v >> 16) as u8,
            relative_performance: ((v >> 24) & 0x3) as u8,
        }
    }

    /// Encodes an LBAF entry.
    pub fn encode(&self) -> u32 {
        u32::from(self.metadata_bytes)
            | u32::from(self.block_shift) << 16
            | u32::from(self.relative_performance & 0x3) << 24
    }
}

/// What the driver uses of Identify Namespace, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Size in logical blocks.
    pub size_blocks: u64,
    /// Capacity in logical blocks.
    pub capacity_blocks: u64,
    /// The format in use.
    pub format: LbaFormat,
    /// Whether metadata is transferred at the end of each block (FLBAS bit 4).
    pub extended_metadata: bool,
}

impl NamespaceInfo {
    /// Decodes and checks Identify Namespace data: a non-zero size (an inactive namespace
    /// reads as zeros), capacity within size, a format index within NLBAF, a block size of
    /// 512 B to 64 KiB.
    ///
    /// # Errors
    /// [`Error::NvmeLength`], [`Error::NvmeField`].
    pub fn decode(bytes: &[u8]) -> Result<NamespaceInfo, Error> {
        let raw = read_page::<RawIdentifyNamespace>("Identify Namespace", bytes)?;
        let bad = |field, value: u64, reason| Error::NvmeField {
            structure: "Identify Namespace",
            field,
            value,
            reason,
        };
        let size = raw.nsze.get();
        if size == 0 {
            return Err(bad("NSZE", 0, "0: the namespace is not active"));
        }
        let cap = raw.ncap.get();
        if cap > size {
            return Err(bad("NCAP", cap, "larger than NSZE"));
        }
        let index = (raw.flbas & 0xF) | ((raw.flbas >> 5) & 0x3) << 4;
        if index > raw.nlbaf || usize::from(index) >= raw.lbaf.len() {
            return Err(bad(
                "FLBAS",
                u64::from(raw.flbas),
                "names a format beyond NLBAF",
            ));
        }
        let format = LbaFormat::decode(raw.lbaf[usize::from(index)].get());
        if !(9..=16).contains(&format.block_shift) {
            return Err(bad(
                "LBADS",
                u64::from(format.block_shift),
                "block size outside 512 B..64 KiB",
            ));
        }
        Ok(NamespaceInfo {
            size_blocks: size,
            capacity_blocks: cap,
            format,
            extended_metadata: raw.flbas & 1 << 4 != 0,
        })
    }

    /// Bytes per logical block.
    pub fn block_bytes(&self) -> u64 {
        1 << self.format.block_shift
    }
}

fn read_page<T: FromBytes>(structure: &'static str, bytes: &[u8]) -> Result<T, Error> {
    let short = || Error::NvmeLength {
        structure,
        needed: PAGE,
        available: bytes.len(),
    };
    let page = bytes.get(..PAGE).ok_or_else(short)?;
    T::read_from_bytes(page).map_err(|_| short())
}

// ---------------------------------------------------------------------------------------------
// PRPs (§4.3)

/// PRP entries per PRP list page: a page of 8-byte entries.
pub const PRPS_PER_LIST: usize = PAGE / 8;

/// The data pointer of a command (§4.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prps {
    /// PRP1: the first data page.
    pub prp1: u64,
    /// PRP2: zero (one page), the second page (two pages) or the first PRP list page.
    pub prp2: u64,
}

/// PRP list pages needed for a transfer of `pages` whole pages starting on a page boundary:
/// none for one or two pages, else enough for `pages - 1` entries where each list page but
/// the last gives its final entry to the pointer to the next list page (§4.3).
pub fn prp_list_pages(pages: usize) -> usize {
    if pages <= 2 {
        0
    } else {
        (pages - 2).div_ceil(PRPS_PER_LIST - 1)
    }
}

/// Builds the PRPs of a transfer of the pages at `data` (each a page-aligned IOVA; the
/// transfer starts at offset 0 of the first and covers each whole page), with PRP list pages
/// at `lists` (exactly [`prp_list_pages`]`(data.len())` page-aligned IOVAs). The list pages'
/// entries are written into `entries` ([`PRPS_PER_LIST`] per list page, in list order; unused
/// tail entries zero), which the caller copies into the list pages.
///
/// # Errors
/// [`Error::NvmePrp`] for no pages, a misaligned address, the wrong number of list pages or a
/// too short `entries`.
pub fn build_prps(data: &[u64], lists: &[u64], entries: &mut [u64]) -> Result<Prps, Error> {
    let misaligned = |what, iova: u64| Error::NvmePrp {
        reason: format!("{what} address {iova:#x} is not {PAGE}-byte aligned"),
    };
    let Some((&first, rest)) = data.split_first() else {
        return Err(Error::NvmePrp {
            reason: "a transfer of no pages".to_owned(),
        });
    };
    if let Some(&p) = data.iter().find(|&&p| p % PAGE as u64 != 0) {
        return Err(misaligned("data page", p));
    }
    if let Some(&p) = lists.iter().find(|&&p| p % PAGE as u64 != 0) {
        return Err(misaligned("PRP list page", p));
    }
    let needed = prp_list_pages(data.len());
    if lists.len() != needed {
        return Err(Error::NvmePrp {
            reason: format!(
                "{} data pages need {needed} PRP list pages, {} given",
                data.len(),
                lists.len()
            ),
        });
    }
    if entries.len() < needed * PRPS_PER_LIST {
        return Err(Error::NvmePrp {
            reason: format!(
                "{} list entries given, {} needed",
                entries.len(),
                needed * PRPS_PER_LIST
            ),
        });
    }
    let prp2 = match (rest, lists.first()) {
        ([], _) => 0,
        ([second], _) => *second,
        (_, Some(&list)) => list,
        (_, None) => 0, // unreachable: checked by `needed` above
    };
    let mut remaining = rest;
    for (i, page) in entries[..needed * PRPS_PER_LIST]
        .chunks_exact_mut(PRPS_PER_LIST)
        .enumerate()
    {
        page.fill(0);
        let last_list = i + 1 == needed;
        let take = if last_list {
            remaining.len()
        } else {
            PRPS_PER_LIST - 1
        };
        let (now, later) = remaining.split_at(take);
        page[..take].copy_from_slice(now);
        if !last_list {
            page[PRPS_PER_LIST - 1] = lists[i + 1];
        }
        remaining = later;
    }
    Ok(Prps { prp1: first, prp2 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use zerocopy::FromZeros;

    #[test]
    fn register_offsets_and_doorbells_follow_the_spec() {
        // §3.1.
        assert_eq!((reg::CAP, reg::VS, reg::CC, reg::CSTS), (0, 8, 0x14, 0x1C));
        assert_eq!((reg::AQA, reg::ASQ, reg::ACQ), (0x24, 0x28, 0x30));
        // §3.1.24/25: stride 4 << DSTRD.
        assert_eq!(doorbell_offset(0, false, 0), Some(0x1000));
        assert_eq!(doorbell_offset(0, true, 0), Some(0x1004));
        assert_eq!(doorbell_offset(3, false, 0), Some(0x1018));
        assert_eq!(doorbell_offset(3, true, 2), Some(0x1000 + 7 * 16));
        assert_eq!(doorbell_offset(1, false, 16), None);
    }

    #[test]
    fn cap_decodes_each_field() {
        // MQES 0x3FF, CQR, AMS 01b, TO 0x14, DSTRD 1, NSSRS, CSS NVM, MPSMIN 0, MPSMAX 4.
        let raw: u64 =
            0x3FF | 1 << 16 | 1 << 17 | 0x14 << 24 | 1 << 32 | 1 << 36 | 1 << 37 | 4 << 52;
        let c = Capabilities::decode(raw).unwrap();
        assert_eq!(c.max_queue_entries, 1024);
        assert_eq!(c.flags, CapFlags::CQR | CapFlags::NSSRS);
        assert_eq!(c.arbitration, 1);
        assert_eq!(c.timeout_500ms, 0x14);
        assert_eq!(c.ready_timeout_ms(), 10_000);
        assert_eq!(c.doorbell_stride_shift, 1);
        assert_eq!(c.command_sets, CSS_NVM);
        assert_eq!((c.mps_min, c.mps_max), (0, 4));
        assert!(c.supports_page_size(4096) && c.supports_page_size(65536));
        assert!(!c.supports_page_size(1 << 17));
        assert_eq!(c.encode(), raw);
        let err = Capabilities::decode(raw & !0xFFFF).unwrap_err();
        assert!(err.to_string().contains("MQES"), "{err}");
        let err = Capabilities::decode(raw | 5 << 48).unwrap_err();
        assert!(err.to_string().contains("MPSMIN"), "{err}");
    }

    #[test]
    fn cc_csts_aqa_vs_encode_as_the_spec_draws_them() {
        // EN, IOSQES 6 at 19:16, IOCQES 4 at 23:20.
        assert_eq!(ControllerConfig::enabled().encode(), 0x0046_0001);
        let cc = ControllerConfig {
            shutdown: Shutdown::Normal,
            mps: 2,
            arbitration: 1,
            command_set: 6,
            ..ControllerConfig::enabled()
        };
        assert_eq!(cc.encode(), 0x0046_4961);
        assert_eq!(ControllerConfig::decode(cc.encode()), cc);
        let s = ControllerStatus::decode(0b1001);
        assert_eq!(s.flags, CstsFlags::RDY);
        assert_eq!(s.shutdown, Shutdown::AbruptOrComplete);
        assert!(ControllerStatus::is_removed(u32::MAX));
        assert_eq!(aqa(32, 64), Some(31 | 63 << 16));
        assert_eq!(aqa_decode(31 | 63 << 16), (32, 64));
        assert_eq!(aqa(1, 64), None);
        assert_eq!(aqa(32, 4097), None);
        let v = Version::decode(0x0001_0400);
        assert_eq!(v.to_string(), "1.4.0");
        assert_eq!(v.encode(), 0x0001_0400);
    }

    #[test]
    fn commands_place_their_fields_at_the_spec_offsets() {
        let mut e = SubmissionEntry::read(1, 0x1_2345_6789, 8);
        e.set_cid(0xBEEF);
        e.set_prps(Prps {
            prp1: 0x1000,
            prp2: 0x2000,
        });
        let b = e.as_bytes();
        assert_eq!(b[0], 0x02); // OPC
        assert_eq!(&b[2..4], &[0xEF, 0xBE]); // CID
        assert_eq!(&b[4..8], &1u32.to_le_bytes()); // NSID
        assert_eq!(&b[24..32], &0x1000u64.to_le_bytes()); // PRP1
        assert_eq!(&b[32..40], &0x2000u64.to_le_bytes()); // PRP2
        assert_eq!(&b[40..48], &0x1_2345_6789u64.to_le_bytes()); // SLBA
        assert_eq!(&b[48..52], &7u32.to_le_bytes()); // NLB, 0's based
        assert_eq!(
            (e.opcode(), e.cid(), e.slba(), e.blocks()),
            (2, 0xBEEF, 0x1_2345_6789, 8)
        );
        assert_eq!(SubmissionEntry::write(1, 0, 1).opcode(), 0x01);
        assert_eq!(
            SubmissionEntry::flush(3).as_bytes()[..8],
            [0, 0, 0, 0, 3, 0, 0, 0]
        );

        let id = SubmissionEntry::identify(cns::CONTROLLER, 0, 0x5000);
        assert_eq!(
            (id.opcode(), id.cdw10.get(), id.prp1.get()),
            (0x06, 1, 0x5000)
        );
        let cq = SubmissionEntry::create_io_cq(2, 256, 0x8000);
        assert_eq!(
            (cq.opcode(), cq.cdw10.get(), cq.cdw11.get()),
            (0x05, 2 | 255 << 16, 1)
        );
        let sq = SubmissionEntry::create_io_sq(2, 256, 0x9000, 2);
        assert_eq!(
            (sq.opcode(), sq.cdw10.get(), sq.cdw11.get()),
            (0x01, 2 | 255 << 16, 1 | 2 << 16)
        );
        assert_eq!(SubmissionEntry::delete_io_sq(5).cdw10.get(), 5);
        assert_eq!(SubmissionEntry::delete_io_cq(5).opcode(), 0x04);
        let nq = SubmissionEntry::set_number_of_queues(4, 4);
        assert_eq!(
            (nq.opcode(), nq.cdw10.get(), nq.cdw11.get()),
            (0x09, 7, 3 | 3 << 16)
        );
        assert_eq!(
            QueuesGranted::decode(3 | 1 << 16),
            QueuesGranted { sq: 4, cq: 2 }
        );
    }

    #[test]
    fn completion_status_decodes_type_code_and_phase() {
        // Status word: P=1, SC 0x80, SCT 0, DNR.
        let word: u16 = 1 | 0x80 << 1 | 1 << 15;
        let mut raw = [0u8; 16];
        raw[12..14].copy_from_slice(&7u16.to_le_bytes());
        raw[14..16].copy_from_slice(&word.to_le_bytes());
        let c = CompletionEntry::read_from_bytes(&raw).unwrap();
        assert!(c.phase());
        assert_eq!(c.cid.get(), 7);
        let s = c.status();
        assert_eq!(
            (s.code_type, s.code, s.do_not_retry),
            (StatusCodeType::Generic, 0x80, true)
        );
        assert_eq!(s.name(), Some("LBA Out of Range"));
        assert!(s.to_string().contains("LBA Out of Range"), "{s}");
        assert_eq!(CompletionEntry::status_word(s, true), word);
        let media = Status::new(StatusCodeType::MediaError, 0x81);
        assert_eq!(
            CompletionEntry::status_word(media, false),
            (2 << 8 | 0x81) << 1
        );
        assert!(Status::SUCCESS.is_success() && !media.is_success());
        assert_eq!(Status::new(StatusCodeType::Vendor, 0xC0).name(), None);
    }

    fn controller_page() -> Vec<u8> {
        let mut raw = RawIdentifyController::new_zeroed();
        raw.vid = U16::new(0x1B36);
        raw.sn = *b"SN0001              ";
        raw.mn[..9].copy_from_slice(b"QEMU NVMe");
        raw.mn[9..].fill(b' ');
        raw.fr = *b"1.0     ";
        raw.mdts = 5;
        raw.sqes = 0x66;
        raw.cqes = 0x44;
        raw.nn = U32::new(1);
        raw.vwc = 1;
        raw.as_bytes().to_vec()
    }

    #[test]
    fn identify_controller_is_read_and_checked() {
        let page = controller_page();
        // Hand-computed offsets: VID 0, SN 4, MN 24, MDTS 77, SQES 512, NN 516, VWC 525.
        assert_eq!(&page[0..2], &[0x36, 0x1B]);
        assert_eq!(&page[4..6], b"SN");
        assert_eq!(&page[24..28], b"QEMU");
        assert_eq!(
            (page[77], page[512], page[513], page[516], page[525]),
            (5, 0x66, 0x44, 1, 1)
        );
        let info = ControllerInfo::decode(&page).unwrap();
        assert_eq!(info.serial, "SN0001");
        assert_eq!(info.model, "QEMU NVMe");
        assert_eq!(info.firmware, "1.0");
        assert_eq!(info.max_transfer(4096), Some(128 * 1024));
        assert!(info.volatile_write_cache);
        let mut bad = page.clone();
        bad[512] = 0x77;
        assert!(
            ControllerInfo::decode(&bad)
                .unwrap_err()
                .to_string()
                .contains("SQES")
        );
        bad = page.clone();
        bad[30] = 0xFF;
        assert!(
            ControllerInfo::decode(&bad)
                .unwrap_err()
                .to_string()
                .contains("MN")
        );
        assert!(matches!(
            ControllerInfo::decode(&page[..100]),
            Err(Error::NvmeLength {
                needed: 4096,
                available: 100,
                ..
            })
        ));
    }

    #[test]
    fn identify_namespace_is_read_and_checked() {
        let mut raw = RawIdentifyNamespace::new_zeroed();
        raw.nsze = U64::new(1 << 20);
        raw.ncap = U64::new(1 << 20);
        raw.nlbaf = 1;
        raw.flbas = 1;
        raw.lbaf[0] = U32::new(9 << 16);
        raw.lbaf[1] = U32::new(12 << 16);
        let page = raw.as_bytes().to_vec();
        // NSZE 0, NLBAF 25, FLBAS 26, LBAF1 at 132 (LBADS in its third byte).
        assert_eq!((page[2], page[25], page[26], page[134]), (0x10, 1, 1, 12));
        let ns = NamespaceInfo::decode(&page).unwrap();
        assert_eq!(ns.block_bytes(), 4096);
        assert_eq!(ns.size_blocks, 1 << 20);
        assert!(!ns.extended_metadata);
        let mut bad = raw;
        bad.flbas = 2;
        assert!(
            NamespaceInfo::decode(bad.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("FLBAS")
        );
        bad = raw;
        bad.nsze = U64::new(0);
        assert!(
            NamespaceInfo::decode(bad.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("NSZE")
        );
        bad = raw;
        bad.ncap = U64::new(2 << 20);
        assert!(
            NamespaceInfo::decode(bad.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("NCAP")
        );
        bad = raw;
        bad.lbaf[1] = U32::new(8 << 16);
        assert!(
            NamespaceInfo::decode(bad.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("LBADS")
        );
    }

    #[test]
    fn prps_for_one_two_and_many_pages() {
        let page = PAGE as u64;
        let mut entries = vec![0u64; 2 * PRPS_PER_LIST];
        let one = build_prps(&[page], &[], &mut entries).unwrap();
        assert_eq!(
            one,
            Prps {
                prp1: page,
                prp2: 0
            }
        );
        let two = build_prps(&[page, 5 * page], &[], &mut entries).unwrap();
        assert_eq!(
            two,
            Prps {
                prp1: page,
                prp2: 5 * page
            }
        );
        // Three pages: PRP2 points at a list with the second and third.
        let three = build_prps(&[page, 2 * page, 7 * page], &[100 * page], &mut entries).unwrap();
        assert_eq!(
            three,
            Prps {
                prp1: page,
                prp2: 100 * page
            }
        );
        assert_eq!(&entries[..3], &[2 * page, 7 * page, 0]);
        // 514 pages: 513 entries, 511 in the first list + a pointer, 2 in the second.
        assert_eq!(prp_list_pages(513), 1);
        assert_eq!(prp_list_pages(514), 2);
        let data: Vec<u64> = (1..=514).map(|i| i * page).collect();
        let p = build_prps(&data, &[1000 * page, 2000 * page], &mut entries).unwrap();
        assert_eq!(p.prp2, 1000 * page);
        assert_eq!(entries[0], 2 * page);
        assert_eq!(entries[510], 512 * page);
        assert_eq!(entries[511], 2000 * page);
        assert_eq!(&entries[512..515], &[513 * page, 514 * page, 0]);
    }

    #[test]
    fn bad_prp_inputs_are_refused_with_reasons() {
        let mut entries = vec![0u64; PRPS_PER_LIST];
        let err = |r: Result<Prps, Error>| r.unwrap_err().to_string();
        assert!(err(build_prps(&[], &[], &mut entries)).contains("no pages"));
        assert!(err(build_prps(&[0x1001], &[], &mut entries)).contains("0x1001"));
        assert!(err(build_prps(&[0x1000; 3], &[], &mut entries)).contains("need 1 PRP list"));
        assert!(err(build_prps(&[0x1000; 3], &[0x10], &mut entries)).contains("list page"));
        assert!(err(build_prps(&[0x1000; 3], &[0x2000], &mut [])).contains("entries"));
    }

    proptest! {
        /// Walking the PRPs as a controller does gives back the data pages, in order.
        #[test]
        fn prp_walk_returns_the_pages(n in 1usize..1600) {
            let data: Vec<u64> = (0..n as u64).map(|i| (i * 3 + 1) * PAGE as u64).collect();
            let k = prp_list_pages(n);
            let lists: Vec<u64> = (0..k as u64).map(|i| (1 << 30) + i * PAGE as u64).collect();
            let mut entries = vec![0u64; k * PRPS_PER_LIST];
            let p = build_prps(&data, &lists, &mut entries).unwrap();
            let mut walked = vec![p.prp1];
            if n == 2 {
                walked.push(p.prp2);
            } else if n > 2 {
                let mut list = lists.iter().position(|&l| l == p.prp2).unwrap();
                loop {
                    let page = &entries[list * PRPS_PER_LIST..(list + 1) * PRPS_PER_LIST];
                    let left = n - walked.len();
                    if left <= PRPS_PER_LIST {
                        walked.extend_from_slice(&page[..left]);
                        break;
                    }
                    walked.extend_from_slice(&page[..PRPS_PER_LIST - 1]);
                    list = lists.iter().position(|&l| l == page[PRPS_PER_LIST - 1]).unwrap();
                }
            }
            prop_assert_eq!(walked, data);
        }

        #[test]
        fn registers_round_trip(cc in any::<u32>(), csts in any::<u32>(), field in 0u16..0x8000) {
            let mask = 0x00FF_FFF1; // CC bits 23:0 less the reserved 3:1
            let c = ControllerConfig::decode(cc);
            prop_assert_eq!(ControllerConfig::decode(c.encode()), c);
            prop_assert_eq!(c.encode(), cc & mask);
            let s = ControllerStatus::decode(csts);
            prop_assert_eq!(s.encode(), csts & 0x3F);
            prop_assert_eq!(Status::decode(field).encode(), field);
        }
    }
}
