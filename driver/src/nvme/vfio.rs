//! The driver's two seams on real hardware: an NVMe controller bound to `vfio-pci`, reached
//! through the `vfio-ioctls` crate (rust-vmm). [`open`] opens the device's VFIO group in a new
//! container, enables memory decoding and bus mastering in its PCI command register, and maps
//! BAR0; [`VfioDma`] maps pinned regions into the container's IOMMU domain at IOVAs it hands
//! out in increasing order (never reused).
//!
//! This needs a machine with an IOMMU (or QEMU's `intel-iommu`) and the controller bound to
//! `vfio-pci`; the unit tests cover what runs without one (address parsing, the MMIO accessors
//! over ordinary memory). The ignored test `vfio_nvme_round_trip` runs the driver on a real
//! device named by `KVSTACK_VFIO_NVME`.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;

use nix::sys::mman::{self, MapFlags, ProtFlags};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps};

use super::{Dma, DmaRegion, Registers};
use crate::Error;
use crate::pinned::{HugePages, Locking, PinnedOptions, PinnedRegion};

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
    next_iova: u64,
    /// Every region mapped, by IOVA: the clone keeps its memory alive while it is mapped.
    mapped: BTreeMap<u64, DmaRegion>,
}

impl std::fmt::Debug for VfioDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioDma")
            .field("next_iova", &self.next_iova)
            .field("mapped", &self.mapped.len())
            .finish_non_exhaustive()
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
        let iova = self.next_iova;
        // SAFETY: the region is device-shared memory that no Rust reference covers (it is
        // reached only through VolatileView), and `mapped` keeps a clone of it until
        // vfio_dma_unmap succeeds, so the memory outlives the IOMMU mapping.
        unsafe { self.container.vfio_dma_map(iova, len, ptr.as_ptr()) }
            .map_err(|e| vfio_err("VFIO_IOMMU_MAP_DMA", e))?;
        self.next_iova = iova.checked_add(len as u64).ok_or(Error::Vfio {
            what: "IOVA space",
            reason: "exhausted".into(),
        })?;
        let region = DmaRegion::new(mem, iova);
        self.mapped.insert(iova, region.clone());
        Ok(region)
    }

    fn free(&mut self, region: DmaRegion) {
        let iova = region.iova();
        match self.container.vfio_dma_unmap(iova, region.len()) {
            Ok(()) => {
                self.mapped.remove(&iova);
            }
            // Still mapped: keep the memory (in `mapped`) rather than free it under the device.
            Err(e) => log::error!("VFIO_IOMMU_UNMAP_DMA at {iova:#x} failed ({e}); memory kept"),
        }
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
    let device = Arc::new(
        VfioDevice::new(&path, ops, false).map_err(|e| vfio_err("opening the VFIO device", e))?,
    );

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
        next_iova: FIRST_IOVA,
        mapped: BTreeMap::new(),
    };
    Ok((bar, dma))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::{Controller, ControllerOptions, DmaSlice, IoKind, IoRequest};

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

    /// Writes and reads back 64 KiB through a real controller. Needs the controller named by
    /// `KVSTACK_VFIO_NVME` (a PCI address) bound to `vfio-pci`, an IOMMU, and a namespace 1
    /// whose first 16 blocks may be overwritten.
    #[test]
    #[ignore = "needs an NVMe controller bound to vfio-pci (KVSTACK_VFIO_NVME=DDDD:BB:DD.F)"]
    fn vfio_nvme_round_trip() {
        let address = std::env::var("KVSTACK_VFIO_NVME").unwrap();
        let (bar, dma) = open(&address).unwrap();
        let mut c = Controller::new(bar, dma, ControllerOptions::default()).unwrap();
        let buf = c.alloc(64 << 10).unwrap();
        let data: Vec<u8> = (0..64 << 10).map(|i: usize| (i * 7) as u8).collect();
        buf.volatile().write(0, &data).unwrap();
        let slice = |r: &DmaRegion| {
            Some(DmaSlice {
                region: r.clone(),
                offset: 0,
                len: 64 << 10,
            })
        };
        c.run(IoRequest {
            kind: IoKind::Write,
            lba: 0,
            buf: slice(&buf),
            tag: 1,
        })
        .unwrap();
        c.run(IoRequest {
            kind: IoKind::Flush,
            lba: 0,
            buf: None,
            tag: 2,
        })
        .unwrap();
        let back = c.alloc(64 << 10).unwrap();
        c.run(IoRequest {
            kind: IoKind::Read,
            lba: 0,
            buf: slice(&back),
            tag: 3,
        })
        .unwrap();
        let mut got = vec![0u8; 64 << 10];
        back.volatile().read(0, &mut got).unwrap();
        assert!(got == data);
    }
}
