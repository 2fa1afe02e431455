//! The driver's two seams on real hardware: an NVMe controller bound to `vfio-pci`, reached
//! through the `vfio-ioctls` crate (rust-vmm). [`open`] opens the device's VFIO group in a new
//! container, enables memory decoding and bus mastering in its PCI command register, and maps
//! BAR0; [`VfioDma`] maps pinned regions into the container's IOMMU domain at IOVAs it hands
//! out in increasing order (never reused).
//!
//! This needs a machine with an IOMMU (or QEMU's `intel-iommu`) and the controller bound to
//! `vfio-pci`; the unit tests cover what runs without one (address parsing, the MMIO accessors
//! over ordinary memory). The ignored `vfio_nvme_*` tests run the driver on a real device
//! named by `KVSTACK_VFIO_NVME`; `scripts/vfio-rig` runs them in a QEMU guest.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use nix::sys::mman::{self, MapFlags, ProtFlags};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps};

use super::iova::{IovaSpace, QUARANTINE_BYTES};
use super::{Controller, ControllerOptions, Dma, DmaRegion, Registers};
use crate::Error;
use crate::blockio::{NvmeNamespace, NvmeOpener, NvmeShared, WeakNvmeShared};
use crate::pinned::{HugePages, LentRegion, Locking, PinnedOptions, PinnedRegion};

/// `VFIO_PCI_BAR0_REGION_INDEX` (`include/uapi/linux/vfio.h`).
const BAR0_REGION: u32 = 0;
/// `VFIO_PCI_CONFIG_REGION_INDEX`.
const CONFIG_REGION: u32 = 7;
/// `VFIO_REGION_INFO_FLAG_MMAP`: the region can be mapped.
const REGION_MMAP: u32 = 1 << 2;
/// PCI command register offset in config space, and its memory space and bus master bits
/// (PCI Local Bus Specification 3.0, §6.2.2).
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// The first IOVA handed out (low addresses are left unused so a stray zero pointer faults).
const FIRST_IOVA: u64 = 1 << 32;

fn vfio_err(what: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Vfio {
        what,
        reason: e.to_string(),
    }
}

/// Checks a PCI address in the `DDDD:BB:DD.F` form sysfs uses (hex digits) and returns the
/// device's sysfs directory.
///
/// # Errors
/// [`Error::Vfio`] naming the address.
pub fn sysfs_path(address: &str) -> Result<PathBuf, Error> {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let ok = match address.split(':').collect::<Vec<_>>()[..] {
        [domain, bus, devfn] => match devfn.split_once('.') {
            Some((dev, func)) => {
                hex(domain, 4)
                    && hex(bus, 2)
                    && hex(dev, 2)
                    && func.len() == 1
                    && func.bytes().all(|b| (b'0'..=b'7').contains(&b))
            }
            None => false,
        },
        _ => false,
    };
    if !ok {
        return Err(Error::Vfio {
            what: "PCI address",
            reason: format!("{address:?} is not of the form DDDD:BB:DD.F"),
        });
    }
    Ok(PathBuf::from("/sys/bus/pci/devices").join(address))
}

/// 32/64-bit volatile accesses to a mapped register window.
#[derive(Debug)]
struct Mmio {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mmio {
    fn at(&self, offset: usize, width: usize) -> Result<*mut u8, Error> {
        match offset.checked_add(width) {
            Some(end) if end <= self.len && offset.is_multiple_of(width) => {
                // SAFETY: offset + width <= len, so the pointer stays inside the mapping.
                Ok(unsafe { self.ptr.as_ptr().add(offset) })
            }
            _ => Err(Error::NvmeRegister { offset, width }),
        }
    }

    fn read32(&self, offset: usize) -> Result<u32, Error> {
        let p = self.at(offset, 4)?.cast::<u32>();
        // SAFETY: `at` checked bounds and 4-byte alignment (the mapping is page aligned); the
        // window is device memory never seen through a reference, so a volatile load is the
        // one access that reaches the register.
        Ok(u32::from_le(unsafe { p.read_volatile() }))
    }

    fn write32(&self, offset: usize, value: u32) -> Result<(), Error> {
        let p = self.at(offset, 4)?.cast::<u32>();
        // SAFETY: as in read32; the mapping is writable.
        unsafe { p.write_volatile(value.to_le()) };
        Ok(())
    }

    fn read64(&self, offset: usize) -> Result<u64, Error> {
        let p = self.at(offset, 8)?.cast::<u64>();
        // SAFETY: as in read32, with 8-byte alignment checked.
        Ok(u64::from_le(unsafe { p.read_volatile() }))
    }

    fn write64(&self, offset: usize, value: u64) -> Result<(), Error> {
        let p = self.at(offset, 8)?.cast::<u64>();
        // SAFETY: as in read64; the mapping is writable.
        unsafe { p.write_volatile(value.to_le()) };
        Ok(())
    }
}

/// BAR0 of a VFIO device, mapped; unmapped on drop (the device is kept open until then).
pub struct VfioBar {
    mmio: Mmio,
    _device: Arc<VfioDevice>,
}

impl std::fmt::Debug for VfioBar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioBar")
            .field("len", &self.mmio.len)
            .finish_non_exhaustive()
    }
}

// SAFETY: the mapping is owned by this value and only reached through volatile accesses of
// &self methods, which the device tolerates from any thread (MMIO has no thread affinity).
unsafe impl Send for VfioBar {}

impl Registers for VfioBar {
    fn read32(&self, offset: usize) -> Result<u32, Error> {
        self.mmio.read32(offset)
    }
    fn write32(&self, offset: usize, value: u32) -> Result<(), Error> {
        self.mmio.write32(offset, value)
    }
    fn read64(&self, offset: usize) -> Result<u64, Error> {
        self.mmio.read64(offset)
    }
    fn write64(&self, offset: usize, value: u64) -> Result<(), Error> {
        self.mmio.write64(offset, value)
    }
}

impl Drop for VfioBar {
    fn drop(&mut self) {
        // SAFETY: ptr..ptr+len is exactly the mapping made in `open`, and nothing refers to it
        // once its owner is dropped.
        if let Err(e) = unsafe { mman::munmap(self.mmio.ptr.cast(), self.mmio.len) } {
            log::error!("munmap of BAR0 failed: {e}");
        }
    }
}

/// Pinned regions mapped into the device's IOMMU domain.
pub struct VfioDma {
    container: Arc<VfioContainer>,
    /// Where each mapping goes (freed ranges reused only after a quarantine: `super::iova`).
    iovas: IovaSpace,
    /// Every region mapped, by IOVA: the clone keeps its memory alive while it is mapped.
    mapped: BTreeMap<u64, DmaRegion>,
}

impl std::fmt::Debug for VfioDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioDma")
            .field("iovas", &self.iovas)
            .field("mapped", &self.mapped.len())
            .finish_non_exhaustive()
    }
}

impl VfioDma {
    /// An IOVA range for `len` bytes.
    fn reserve(&mut self, len: usize) -> Result<u64, Error> {
        self.iovas.alloc(len as u64).ok_or(Error::Vfio {
            what: "IOVA space",
            reason: "exhausted".into(),
        })
    }
}

impl Dma for VfioDma {
    fn alloc(&mut self, bytes: usize) -> Result<DmaRegion, Error> {
        // VFIO_IOMMU_MAP_DMA pins the pages itself (and charges RLIMIT_MEMLOCK), so the region
        // is not mlocked a second time.
        let opts = PinnedOptions {
            huge_pages: HugePages::Auto,
            locking: Locking::Never,
        };
        let mem = Arc::new(PinnedRegion::new(bytes, opts)?.into_device_shared());
        let (ptr, len) = mem.raw_parts();
        let iova = self.reserve(len)?;
        // SAFETY: the region is device-shared memory that no Rust reference covers (it is
        // reached only through VolatileView), and `mapped` keeps a clone of it until
        // vfio_dma_unmap succeeds, so the memory outlives the IOMMU mapping.
        if let Err(e) = unsafe { self.container.vfio_dma_map(iova, len, ptr.as_ptr()) } {
            self.iovas.unreserve(iova, len as u64);
            return Err(vfio_err("VFIO_IOMMU_MAP_DMA", e));
        }
        let region = DmaRegion::new(mem, iova);
        self.mapped.insert(iova, region.clone());
        Ok(region)
    }

    fn map_lent(&mut self, mem: Arc<LentRegion>) -> Result<DmaRegion, Error> {
        // The same steps as `alloc`, on memory the caller allocated (a buffer pool's region:
        // page aligned, whole pages, kept alive by the clone in `mapped`). VFIO pins the pages
        // itself; if the pool also mlocked them, both count against RLIMIT_MEMLOCK.
        let (ptr, len) = mem.raw_parts();
        let iova = self.reserve(len)?;
        // SAFETY: the region's bytes are reached by the CPU only through its pool's IoBufs,
        // never while an operation naming them is in flight (LentRegion's contract), so the
        // device's writes alias no Rust reference; `mapped` keeps a clone of the region until
        // vfio_dma_unmap succeeds, so the memory outlives the IOMMU mapping.
        if let Err(e) = unsafe { self.container.vfio_dma_map(iova, len, ptr.as_ptr()) } {
            self.iovas.unreserve(iova, len as u64);
            return Err(vfio_err("VFIO_IOMMU_MAP_DMA of a buffer pool", e));
        }
        let region = DmaRegion::lent(mem, iova);
        self.mapped.insert(iova, region.clone());
        Ok(region)
    }

    fn free(&mut self, region: DmaRegion) {
        let iova = region.iova();
        match self.container.vfio_dma_unmap(iova, region.len()) {
            Ok(()) => {
                self.mapped.remove(&iova);
                self.iovas.release(iova, region.len() as u64);
            }
            // Still mapped: keep the memory (in `mapped`) rather than free it under the device.
            Err(e) => log::error!("VFIO_IOMMU_UNMAP_DMA at {iova:#x} failed ({e}); memory kept"),
        }
    }

    fn is_mapped(&self, region: &DmaRegion) -> bool {
        self.mapped
            .get(&region.iova())
            .is_some_and(|r| r.same(region))
    }
}

impl Drop for VfioDma {
    fn drop(&mut self) {
        for (iova, region) in std::mem::take(&mut self.mapped) {
            if let Err(e) = self.container.vfio_dma_unmap(iova, region.len()) {
                log::error!("VFIO_IOMMU_UNMAP_DMA at {iova:#x} failed ({e}); memory leaked");
                std::mem::forget(region);
            }
        }
    }
}

/// Opens the NVMe controller at PCI address `address` (bound to `vfio-pci`): its group in a new
/// container, bus mastering on, BAR0 mapped.
///
/// # Errors
/// [`Error::Vfio`] naming the step that failed.
pub fn open(address: &str) -> Result<(VfioBar, VfioDma), Error> {
    let path = sysfs_path(address)?;
    let container =
        Arc::new(VfioContainer::new(None).map_err(|e| vfio_err("opening /dev/vfio/vfio", e))?);
    let ops: Arc<dyn VfioOps> = container.clone();
    let device = Arc::new(VfioDevice::new(&path, ops, false).map_err(|e| {
        let mut reason = e.to_string();
        // EBUSY on the group: another process holds it.
        if matches!(&e, vfio_ioctls::VfioError::OpenGroup(io, _)
            if io.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32))
        {
            reason.push_str(
                ": another process holds this device (a VFIO group opens in one process at a \
                 time; within a process kvstack shares it)",
            );
        }
        Error::Vfio {
            what: "opening the VFIO device",
            reason,
        }
    })?);

    let mut cmd = [0u8; 2];
    device.region_read(CONFIG_REGION, &mut cmd, PCI_COMMAND);
    let want = u16::from_le_bytes(cmd) | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
    device.region_write(CONFIG_REGION, &want.to_le_bytes(), PCI_COMMAND);
    device.region_read(CONFIG_REGION, &mut cmd, PCI_COMMAND);
    if u16::from_le_bytes(cmd) & want != want {
        return Err(Error::Vfio {
            what: "PCI command register",
            reason: "memory space and bus master could not be enabled".into(),
        });
    }

    if device.get_region_flags(BAR0_REGION) & REGION_MMAP == 0 {
        return Err(Error::Vfio {
            what: "BAR0",
            reason: "the region cannot be mapped".into(),
        });
    }
    let size = device.get_region_size(BAR0_REGION);
    let offset = device.get_region_offset(BAR0_REGION);
    let len = usize::try_from(size)
        .ok()
        .and_then(NonZeroUsize::new)
        .ok_or(Error::Vfio {
            what: "BAR0",
            reason: format!("size {size}"),
        })?;
    let offset = i64::try_from(offset).map_err(|e| vfio_err("BAR0 offset", e))?;
    // SAFETY: the device's file descriptor stays open while `device` lives, and `device`
    // outlives this borrow (it is kept in the returned VfioBar).
    let fd = unsafe { BorrowedFd::borrow_raw(device.as_raw_fd()) };
    // SAFETY: a shared mapping of the device's BAR0 region at an address the kernel chooses;
    // it aliases no Rust object and is reached only through volatile accesses (Mmio).
    let ptr = unsafe {
        mman::mmap(
            None,
            len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd,
            offset,
        )
    }
    .map_err(|e| vfio_err("mmap of BAR0", e))?;
    let bar = VfioBar {
        mmio: Mmio {
            ptr: ptr.cast(),
            len: len.get(),
        },
        _device: device,
    };
    let dma = VfioDma {
        container,
        iovas: IovaSpace::new(FIRST_IOVA, QUARANTINE_BYTES),
        mapped: BTreeMap::new(),
    };
    Ok((bar, dma))
}

/// Opens the NVMe controller at a PCI address through VFIO and brings it up: the store
/// location `vfio:<pci-address>`.
#[derive(Clone, Debug)]
pub struct VfioOpener {
    /// `DDDD:BB:DD.F`, the device bound to `vfio-pci`.
    pub address: String,
    /// Options of the bring-up (namespace, queues, deadlines).
    pub options: ControllerOptions,
}

impl VfioOpener {
    /// An opener of namespace 1 of the controller at `address`, with eight I/O queue pairs of
    /// 256 entries. The address is checked now.
    ///
    /// # Errors
    /// [`Error::Vfio`] for a malformed address.
    pub fn new(address: &str) -> Result<VfioOpener, Error> {
        sysfs_path(address)?;
        Ok(VfioOpener {
            address: address.to_owned(),
            options: ControllerOptions {
                io_queues: 8,
                ..ControllerOptions::default()
            },
        })
    }
}

/// The controllers this process has brought up through VFIO, by PCI address. A VFIO group
/// opens once per process (a second open fails with `EBUSY`), so every store, reader and fsck
/// of this process on a device shares the one controller brought up first, as a store's own
/// engines do; the entry does not keep it up (the last user's drop still shuts it down).
static BROUGHT_UP: Mutex<Vec<(String, WeakNvmeShared<VfioBar, VfioDma>)>> = Mutex::new(Vec::new());

impl NvmeOpener for VfioOpener {
    fn name(&self) -> String {
        format!("vfio:{}", self.address)
    }

    fn lock_path(&self) -> Option<PathBuf> {
        // The VFIO group keeps other processes out (EBUSY) but not this one's second store on
        // the shared controller: the location lock (one writer, or readers) is a file lock,
        // which also names the holder to whoever is refused. /run/lock is the system's lock
        // directory; the temporary directory where there is none (a minimal guest).
        let dir = Path::new("/run/lock");
        let dir = if dir.is_dir() {
            dir.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let path = dir.join(format!("kvstack-vfio-{}.lock", self.address));
        // Created if missing; a failure shows when the lock is taken.
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path);
        Some(path)
    }

    fn open(&self) -> Result<Arc<dyn NvmeNamespace>, Error> {
        let mut up = BROUGHT_UP
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        up.retain(|(_, w)| !w.is_gone());
        if let Some((nsid, shared)) = up
            .iter()
            .find(|(a, _)| *a == self.address)
            .and_then(|(_, w)| Some((w.target().nsid, w.upgrade()?)))
        {
            if nsid != self.options.namespace {
                return Err(Error::Vfio {
                    what: "opening the VFIO device",
                    reason: format!(
                        "{} is up in this process for namespace {nsid}, not {}",
                        self.address, self.options.namespace
                    ),
                });
            }
            return Ok(Arc::new(shared));
        }
        // Brought up under the table's lock: two threads never both open the group.
        let (bar, dma) = open(&self.address)?;
        let ctrl = Controller::new(bar, dma, self.options)?;
        let shared = NvmeShared::new(ctrl, self.name())?;
        up.push((self.address.clone(), shared.downgrade()));
        Ok(Arc::new(shared))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::{DmaSlice, IoKind, IoRequest};
    use kvstack_firmware_interface::nvme::PAGE;

    #[test]
    fn pci_addresses_are_checked() {
        assert_eq!(
            sysfs_path("0000:00:04.0").unwrap(),
            PathBuf::from("/sys/bus/pci/devices/0000:00:04.0")
        );
        for bad in [
            "00:04.0",
            "0000:00:04",
            "0000:00:04.8",
            "0000:0g:04.0",
            "../../x",
        ] {
            let err = sysfs_path(bad).unwrap_err();
            assert!(err.to_string().contains("DDDD:BB:DD.F"), "{bad}: {err}");
        }
    }

    #[test]
    fn mmio_accesses_are_little_endian_bounded_and_aligned() {
        let region = PinnedRegion::new(4096, PinnedOptions::default())
            .unwrap()
            .into_device_shared();
        let (ptr, len) = region.raw_parts();
        let m = Mmio { ptr, len };
        m.write64(0x28, 0x1122_3344_5566_7788).unwrap();
        m.write32(0x14, 0x0046_0001).unwrap();
        let mut b = [0u8; 8];
        region.volatile().read(0x28, &mut b).unwrap();
        assert_eq!(b, 0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(m.read32(0x28).unwrap(), 0x5566_7788);
        assert_eq!(m.read64(0x28).unwrap(), 0x1122_3344_5566_7788);
        assert_eq!(m.read32(0x14).unwrap(), 0x0046_0001);
        assert!(matches!(m.read32(4096), Err(Error::NvmeRegister { .. })));
        assert!(matches!(m.read64(4092), Err(Error::NvmeRegister { .. })));
        assert!(matches!(
            m.write32(0x16, 0),
            Err(Error::NvmeRegister { .. })
        ));
        assert!(matches!(
            m.read64(usize::MAX - 3),
            Err(Error::NvmeRegister { .. })
        ));
    }

    /// The controller the hardware tests use: `KVSTACK_VFIO_NVME` (a PCI address, the device
    /// bound to `vfio-pci`), or `None`, printed, when it is unset. `KVSTACK_VFIO_REQUIRE=1`
    /// (which `scripts/vfio-rig` sets in its guest) turns that skip into a failure, so the rig
    /// cannot pass by skipping.
    fn device() -> Option<String> {
        match std::env::var("KVSTACK_VFIO_NVME") {
            Ok(address) => Some(address),
            Err(_) => {
                assert!(
                    std::env::var_os("KVSTACK_VFIO_REQUIRE").is_none(),
                    "KVSTACK_VFIO_REQUIRE is set but KVSTACK_VFIO_NVME is not"
                );
                eprintln!("skipped: KVSTACK_VFIO_NVME is unset (scripts/vfio-rig sets it)");
                None
            }
        }
    }

    type VfioController = Controller<VfioBar, VfioDma>;

    fn bring_up(address: &str, opts: ControllerOptions) -> VfioController {
        let (bar, dma) = open(address).unwrap();
        Controller::new(bar, dma, opts).unwrap()
    }

    /// Bytes that differ with `seed` and position (a xorshift stream), so a block read back
    /// from the wrong LBA or an unwritten one (zeros) does not match.
    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn io(kind: IoKind, lba: u64, region: &DmaRegion, offset: usize, len: usize) -> IoRequest {
        IoRequest {
            kind,
            lba,
            buf: Some(DmaSlice {
                region: region.clone(),
                offset,
                len,
            }),
            tag: lba,
        }
    }

    fn flush() -> IoRequest {
        IoRequest {
            kind: IoKind::Flush,
            lba: 0,
            buf: None,
            tag: u64::MAX,
        }
    }

    fn read_back(c: &mut VfioController, lba: u64, len: usize) -> Vec<u8> {
        let buf = c.alloc(len).unwrap();
        // Garbage first, so a read that moved nothing cannot match.
        buf.volatile().write(0, &vec![0xA5; len]).unwrap();
        c.run(io(IoKind::Read, lba, &buf, 0, len)).unwrap();
        let mut got = vec![0u8; len];
        buf.volatile().read(0, &mut got).unwrap();
        c.free(buf).unwrap();
        got
    }

    /// Writes, flushes and reads back transfers of 1, 2 (PRP2 a data page), 3 (a PRP list),
    /// 16 pages and the largest the controller takes (MDTS) at scattered LBAs, each through a
    /// buffer at a page offset inside its region (PRP1 not the region's first page).
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_round_trip() {
        let Some(address) = device() else { return };
        let mut c = bring_up(&address, ControllerOptions::default());
        let block = c.namespace().unwrap().block_bytes() as u64;
        let max = c.max_transfer();
        eprintln!(
            "{:?}: blocks of {block} bytes, max transfer {max} bytes",
            c.info().unwrap()
        );
        let mut done = Vec::new();
        let mut lba = 8u64;
        for pages in [1usize, 2, 3, 16, max / PAGE] {
            let len = pages * PAGE;
            let buf = c.alloc(len + PAGE).unwrap();
            let data = pattern(lba, len);
            buf.volatile().write(PAGE, &data).unwrap();
            c.run(io(IoKind::Write, lba, &buf, PAGE, len)).unwrap();
            c.free(buf.clone()).unwrap();
            // Unmapped now: refused before the device could fault on it in the IOMMU.
            let err = c.run(io(IoKind::Write, lba, &buf, PAGE, len)).unwrap_err();
            assert!(err.to_string().contains("not mapped"), "{err}");
            done.push((lba, data));
            lba += len as u64 / block + 24;
        }
        c.run(flush()).unwrap();
        for (lba, data) in &done {
            assert!(
                read_back(&mut c, *lba, data.len()) == *data,
                "LBA {lba}, {} bytes",
                data.len()
            );
        }
        assert_eq!(c.stats().errors, 0);
        assert_eq!(c.stats().malformed, 0);
    }

    /// Four I/O queue pairs with 31 commands in flight on each at once (4 KiB writes to
    /// distinct LBAs), then the same as reads, compared: doorbells of every queue (CAP.DSTRD
    /// stride), completions reaped across queues, CQ heads wrapping (the phase tag flips).
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_queues() {
        let Some(address) = device() else { return };
        let opts = ControllerOptions {
            io_queues: 4,
            io_queue_entries: 32,
            ..ControllerOptions::default()
        };
        let mut c = bring_up(&address, opts);
        assert_eq!(c.io_queues(), 4, "the controller granted fewer queues");
        let per_block = PAGE as u64 / c.namespace().unwrap().block_bytes() as u64;
        let (queues, depth, rounds) = (4usize, 31usize, 3usize);
        let n = queues * depth;
        let wbuf = c.alloc(n * PAGE).unwrap();
        let rbuf = c.alloc(n * PAGE).unwrap();
        let base = 4096u64;
        for round in 0..rounds {
            let data = pattern(round as u64 + 1000, n * PAGE);
            wbuf.volatile().write(0, &data).unwrap();
            rbuf.volatile().write(0, &vec![0x5A; n * PAGE]).unwrap();
            for kind in [IoKind::Write, IoKind::Read] {
                let buf = if kind == IoKind::Write { &wbuf } else { &rbuf };
                for i in 0..n {
                    let lba = base + i as u64 * per_block;
                    c.submit(i % queues, io(kind, lba, buf, i * PAGE, PAGE))
                        .unwrap();
                }
                assert_eq!(c.in_flight(), n);
                let mut out = Vec::new();
                c.wait(n, &mut out).unwrap();
                assert_eq!(out.len(), n);
                for done in &out {
                    assert!(
                        done.result.is_ok(),
                        "{kind:?} tag {}: {:?}",
                        done.tag,
                        done.result
                    );
                }
            }
            let mut got = vec![0u8; n * PAGE];
            rbuf.volatile().read(0, &mut got).unwrap();
            assert!(got == data, "round {round}: data read back differs");
        }
        let stats = c.stats();
        assert_eq!(stats.submitted, (2 * n * rounds) as u64);
        assert!(stats.wraps > 0, "no completion queue wrapped: {stats:?}");
        assert_eq!((stats.errors, stats.malformed), (0, 0));
    }

    /// Data survives a controller reset, a shutdown (CC.SHN) followed by a bring-up, and
    /// closing the VFIO device and opening it again.
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_reset_shutdown_reopen() {
        let Some(address) = device() else { return };
        let (lba, len) = (20_000u64, 8 * PAGE);
        let data = pattern(7, len);
        let mut c = bring_up(&address, ControllerOptions::default());
        let buf = c.alloc(len).unwrap();
        buf.volatile().write(0, &data).unwrap();
        c.run(io(IoKind::Write, lba, &buf, 0, len)).unwrap();
        c.run(flush()).unwrap();
        c.reset().unwrap();
        assert!(read_back(&mut c, lba, len) == data, "after reset");
        c.shutdown().unwrap();
        c.reset().unwrap();
        assert!(
            read_back(&mut c, lba, len) == data,
            "after shutdown and bring-up"
        );
        assert_eq!(c.stats().bring_ups, 3);
        drop(c);
        let mut c = bring_up(&address, ControllerOptions::default());
        assert!(
            read_back(&mut c, lba, len) == data,
            "after reopening the device"
        );
    }

    /// Bring-up refusals on the real device are named, and leave it usable: namespace 2 is
    /// inactive on the rig's controller (Identify Namespace returns zeros: NSZE = 0), a
    /// namespace above Identify Controller's NN does not exist; a bring-up after both works.
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_bring_up_refusals() {
        let Some(address) = device() else { return };
        let chain = |namespace: u32| {
            let (bar, dma) = open(&address).unwrap();
            let opts = ControllerOptions {
                namespace,
                ..ControllerOptions::default()
            };
            let err = Controller::new(bar, dma, opts).unwrap_err();
            let source = std::error::Error::source(&err).map(|e| e.to_string());
            format!("{err}: {}", source.unwrap_or_default())
        };
        let inactive = chain(2);
        assert!(inactive.contains("NSZE"), "{inactive}");
        let nn = bring_up(&address, ControllerOptions::default())
            .info()
            .unwrap()
            .namespaces;
        let missing = chain(nn + 1);
        assert!(
            missing.contains(&format!("namespace {}", nn + 1)),
            "{missing}"
        );
        let mut c = bring_up(&address, ControllerOptions::default());
        let len = 4 * PAGE;
        let buf = c.alloc(len).unwrap();
        c.run(io(IoKind::Read, 0, &buf, 0, len)).unwrap();
    }

    /// The block engine on the real device: eight 16 KiB writes in flight at once through
    /// `BlockEngine`, the Flush command, the same ranges read back into garbage-filled pool
    /// buffers and compared; byte offsets become LBAs of the device's block size (512 bytes on
    /// QEMU's controller); ranges that are not whole blocks or pages are refused by name.
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_block_engine() {
        use crate::blockio::{BlockEngine, BufferPool, IoOp, NvmeEngine, OpKind};
        use crate::pinned::{HugePages, Locking, PinnedOptions};
        let Some(address) = device() else { return };
        let c = bring_up(&address, ControllerOptions::default());
        let mut e = NvmeEngine::new(c, 8, 64 << 10).unwrap();
        let mem = PinnedOptions {
            huge_pages: HugePages::Never,
            locking: Locking::Never,
        };
        let pool = BufferPool::new(8, 16 << 10, mem).unwrap();
        // 8 MiB in: LBA 16,384 on 512-byte blocks, below the 21,000 the tests may overwrite.
        let base = 8u64 << 20;
        let op = |e: &NvmeEngine<VfioBar, VfioDma>, kind, i: u64, fill: Option<&[u8]>| {
            let mut buf = pool.try_get().unwrap();
            match fill {
                Some(d) => buf.as_mut_slice().copy_from_slice(d),
                None => buf.as_mut_slice().fill(0xA5),
            }
            IoOp {
                kind,
                target: e.target(),
                offset: base + i * (16 << 10),
                len: 16 << 10,
                buf,
                tag: i,
            }
        };
        let data: Vec<Vec<u8>> = (0..8).map(|i| pattern(1000 + i, 16 << 10)).collect();
        for i in 0..8u64 {
            let o = op(&e, OpKind::Write, i, Some(&data[i as usize]));
            e.submit(o).unwrap();
        }
        let mut out = Vec::new();
        assert_eq!(e.wait(8, &mut out).unwrap(), 8);
        assert!(
            out.iter()
                .all(|c| c.result.as_ref().ok() == Some(&(16 << 10)))
        );
        out.clear();
        let t = e.target();
        e.flush(&t).unwrap();
        for i in (0..8u64).rev() {
            let o = op(&e, OpKind::Read, i, None);
            e.submit(o).unwrap();
        }
        assert_eq!(e.wait(8, &mut out).unwrap(), 8);
        for c in &out {
            assert_eq!(c.result.as_ref().ok(), Some(&(16 << 10)));
            assert!(
                c.op.buf.as_slice() == data[c.op.tag as usize],
                "op {}",
                c.op.tag
            );
        }
        out.clear();
        // A read straddling two writes, 4 KiB into the first: offsets are converted to LBAs
        // of the device's block size, not of some other unit.
        let mut o = op(&e, OpKind::Read, 0, None);
        o.offset = base + 4096;
        e.submit(o).unwrap();
        assert_eq!(e.wait(1, &mut out).unwrap(), 1);
        let got = out[0].op.buf.as_slice();
        assert!(got[..12 << 10] == data[0][4096..] && got[12 << 10..] == data[1][..4096]);
        out.clear();
        for (offset, len, why) in [(base + 256, PAGE, "logical blocks"), (base, 512, "pages")] {
            let mut o = op(&e, OpKind::Read, 0, None);
            o.offset = offset;
            o.len = len;
            let r = e.submit(o).unwrap_err();
            assert!(r.error.to_string().contains(why), "{}", r.error);
        }
        assert_eq!(e.controller_stats().errors, 0);
        drop(e);
        assert_eq!(pool.available(), 8);
    }

    /// Zero copy on the real IOMMU: a buffer pool mapped for the controller
    /// (VFIO_IOMMU_MAP_DMA of the pool's own pages), writes of 1 to 32 pages from it (PRP
    /// lists into the pool's mapping beyond two pages), read back into mapped buffers and into
    /// an unmapped pool's (through the bounce region) and compared; the copy counters say
    /// which way each went. Then the pool is dropped while the controller runs (its mapping
    /// removed by VFIO_IOMMU_UNMAP_DMA), and a second pool is mapped at a fresh IOVA and used.
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_zero_copy() {
        use crate::blockio::{BlockEngine, BufferPool, IoOp, IoTarget, OpKind};
        use crate::pinned::{HugePages, Locking, PinnedOptions};
        let Some(address) = device() else { return };
        let mem = PinnedOptions {
            huge_pages: HugePages::Never,
            locking: Locking::Never,
        };
        let ns = VfioOpener::new(&address).unwrap().open().unwrap();
        let t = IoTarget::Namespace(ns.target());
        let mapped = BufferPool::new(8, 32 * PAGE, mem).unwrap();
        let other = BufferPool::new(8, 32 * PAGE, mem).unwrap();
        ns.map_pool(&mapped).unwrap();
        let mut e = ns.engine(8, 32 * PAGE).unwrap();
        // 12 MiB in, 128 KiB apart: clear of the other tests' LBAs.
        let base = 12u64 << 20;
        let sizes = [1usize, 2, 3, 8, 17, 31, 32, 4];
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &p)| pattern(3000 + i as u64, p * PAGE))
            .collect();
        let run = |e: &mut dyn BlockEngine, pool: &BufferPool, kind, i: usize| {
            let len = data[i].len();
            let mut buf = pool.try_get().unwrap();
            match kind {
                OpKind::Write => buf.as_mut_slice()[..len].copy_from_slice(&data[i]),
                OpKind::Read => buf.as_mut_slice().fill(0xA5),
            }
            e.submit(IoOp {
                kind,
                target: t.clone(),
                offset: base + (i as u64) * (128 << 10),
                len,
                buf,
                tag: i as u64,
            })
            .unwrap();
        };
        for i in 0..sizes.len() {
            run(e.as_mut(), &mapped, OpKind::Write, i);
        }
        let mut out = Vec::new();
        assert_eq!(e.wait(8, &mut out).unwrap(), 8);
        assert!(out.iter().all(|c| c.result.is_ok()), "{out:?}");
        out.clear();
        e.flush(&t).unwrap();
        for pool in [&mapped, &other] {
            for i in 0..sizes.len() {
                run(e.as_mut(), pool, OpKind::Read, i);
            }
            assert_eq!(e.wait(8, &mut out).unwrap(), 8);
            for c in &out {
                let want = &data[c.op.tag as usize];
                assert_eq!(c.result.as_ref().ok(), Some(&want.len()));
                assert!(
                    c.op.buf.as_slice()[..want.len()] == want[..],
                    "op {} read back differs",
                    c.op.tag
                );
            }
            out.clear();
        }
        let copies = ns.copy_stats();
        assert_eq!(
            (copies.zero_copy_ops, copies.bounced_ops),
            (16, 8),
            "{copies:?}"
        );
        let read_bytes: usize = data.iter().map(Vec::len).sum();
        assert_eq!(copies.bounce_bytes, read_bytes as u64);
        // The pool goes while the controller runs: unmapped from the IOMMU; a new pool is
        // mapped at a fresh IOVA and works.
        drop(mapped);
        let again = BufferPool::new(2, 32 * PAGE, mem).unwrap();
        ns.map_pool(&again).unwrap();
        run(e.as_mut(), &again, OpKind::Read, 6);
        assert_eq!(e.wait(1, &mut out).unwrap(), 1);
        assert!(out[0].op.buf.as_slice() == &data[6][..]);
        out.clear();
        assert_eq!(ns.copy_stats().zero_copy_ops, 17);
        assert_eq!(ns.stats().errors, 0);
        // Engine, then handle: the controller shuts down and unmaps `again` (still alive)
        // before the VFIO container goes.
        drop(e);
        drop(ns);
        let mut b = again.try_get().unwrap();
        b.as_mut_slice().fill(0);
    }

    /// 4 KiB random-ish reads at queue depth 1 and 16 on one queue: latency (QD 1) and IOPS.
    /// Prints a table; asserts only that every read succeeded. The device's numbers are set by
    /// whatever implements it (QEMU's emulation in the rig).
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_latency() {
        let Some(address) = device() else { return };
        let mut c = bring_up(&address, ControllerOptions::default());
        let per_block = PAGE as u64 / c.namespace().unwrap().block_bytes() as u64;
        let span = (c.namespace().unwrap().size_blocks / per_block).min(4096);
        let buf = c.alloc(16 * PAGE).unwrap();
        let lba = |i: usize| (i as u64 * 2_654_435_761 % span) * per_block;
        let mut lat = Vec::with_capacity(4000);
        let start = std::time::Instant::now();
        for i in 0..4000 {
            let t = std::time::Instant::now();
            c.run(io(IoKind::Read, lba(i), &buf, 0, PAGE)).unwrap();
            lat.push(t.elapsed());
        }
        let qd1 = start.elapsed();
        lat.sort();
        let n = 40_000usize;
        let (mut sent, mut done) = (0usize, 0usize);
        let mut out = Vec::new();
        let start = std::time::Instant::now();
        while done < n {
            while sent < n && sent - done < 16 {
                c.submit(
                    0,
                    io(IoKind::Read, lba(sent), &buf, (sent % 16) * PAGE, PAGE),
                )
                .unwrap();
                sent += 1;
            }
            out.clear();
            done += c.wait(1, &mut out).unwrap();
            assert!(out.iter().all(|c| c.result.is_ok()));
        }
        let qd16 = start.elapsed();
        println!("| queue depth | reads | mean us | p50 us | p99 us | IOPS |");
        println!(
            "| 1 | {} | {:.1} | {:.1} | {:.1} | {:.0} |",
            lat.len(),
            qd1.as_secs_f64() * 1e6 / lat.len() as f64,
            lat[lat.len() / 2].as_secs_f64() * 1e6,
            lat[lat.len() * 99 / 100].as_secs_f64() * 1e6,
            lat.len() as f64 / qd1.as_secs_f64()
        );
        println!(
            "| 16 | {n} | {:.1} | - | - | {:.0} |",
            qd16.as_secs_f64() * 1e6 / n as f64,
            n as f64 / qd16.as_secs_f64()
        );
    }

    #[test]
    #[ignore = "measurement in the QEMU rig: KVSTACK_VFIO_RIG_BENCH=1 scripts/vfio-rig"]
    fn bench_vfio_engine() {
        let Some(address) = device() else {
            return;
        };
        let ns = VfioOpener::new(&address).unwrap().open().unwrap();
        let target = crate::blockio::IoTarget::Namespace(ns.target());
        // Through the bounce region (the pool not mapped), then zero copy (the pool mapped for
        // the controller): the same workloads, so the rows compare the bounce copy's cost.
        crate::blockio::bench::measure(
            |_| ns.engine(64, 128 << 10).unwrap(),
            &target,
            "userspace NVMe (VFIO, bounce)",
        );
        crate::blockio::bench::measure(
            |pool| {
                ns.map_pool(pool).unwrap();
                ns.engine(64, 128 << 10).unwrap()
            },
            &target,
            "userspace NVMe (VFIO, zero copy)",
        );
        let copies = ns.copy_stats();
        println!("copies: {copies:?}");
        assert!(copies.zero_copy_ops > 0 && copies.bounced_ops > 0);
    }
}
