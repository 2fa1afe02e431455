//! Host probes: every question is answered with a value or a plain reason, never a crash.
//!
//! The probes that read kernel files are split into a reader and a pure parser so the parsers are
//! unit-tested on fixed text (the values a kernel would write).

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, rlim_t};
use serde::Serialize;

/// Memory facts from `/proc/meminfo`, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemInfo {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable`.
    pub available_bytes: u64,
    /// `Hugepagesize` (the default explicit huge page size).
    pub huge_page_bytes: u64,
    /// `HugePages_Total`: explicit huge pages reserved by the administrator.
    pub huge_pages_total: u64,
    /// `HugePages_Free`.
    pub huge_pages_free: u64,
}

/// Parses `/proc/meminfo` text. Missing keys read as 0.
pub fn parse_meminfo(text: &str) -> MemInfo {
    let mut m = MemInfo::default();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(key), Some(value)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(value) = value.parse::<u64>() else {
            continue;
        };
        // Sizes carry a "kB" unit (meaning KiB); counts have none.
        let kib = |v: u64| v.saturating_mul(1024);
        match key {
            "MemTotal:" => m.total_bytes = kib(value),
            "MemAvailable:" => m.available_bytes = kib(value),
            "Hugepagesize:" => m.huge_page_bytes = kib(value),
            "HugePages_Total:" => m.huge_pages_total = value,
            "HugePages_Free:" => m.huge_pages_free = value,
            _ => {}
        }
    }
    m
}

/// Parses `/sys/kernel/mm/transparent_hugepage/enabled` (e.g. `always [madvise] never`) and
/// returns the selected mode.
pub fn parse_thp_mode(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = text[start..].find(']')? + start;
    Some(text[start + 1..end].to_owned())
}

/// The CPU as the first processor's block of `/proc/cpuinfo` names it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CpuIdentity {
    /// `model name` (x86; absent on e.g. aarch64).
    pub model_name: Option<String>,
    /// `cpu family` (decimal). On VMs the model name is often generic ("AMD EPYC"); family
    /// and model still tell the microarchitecture apart.
    pub family: Option<u32>,
    /// `model` (decimal).
    pub model: Option<u32>,
}

/// Parses `/proc/cpuinfo` text: the first processor's `model name`, `cpu family` and `model`.
/// Missing or malformed fields read as `None`.
pub fn parse_cpuinfo(text: &str) -> CpuIdentity {
    let first = text.split("\n\n").next().unwrap_or_default();
    let field = |name: &str| {
        first.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim())
        })
    };
    let num = |name: &str| field(name).and_then(|v| v.parse::<u32>().ok());
    CpuIdentity {
        model_name: field("model name")
            .filter(|v| !v.is_empty())
            .map(str::to_owned),
        family: num("cpu family"),
        model: num("model"),
    }
}

/// This machine's [`CpuIdentity`]; all `None` if `/proc/cpuinfo` cannot be read.
pub fn cpu_identity() -> CpuIdentity {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|t| parse_cpuinfo(&t))
        .unwrap_or_default()
}

/// Resident-set sizes of this process from `/proc/self/status`, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Rss {
    /// `VmRSS`: resident now.
    pub current_bytes: u64,
    /// `VmHWM`: the peak ("high water mark") since the process started.
    pub peak_bytes: u64,
}

/// Parses `/proc/self/status` text for `VmRSS` and `VmHWM`.
pub fn parse_rss(text: &str) -> Rss {
    let mut r = Rss::default();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(key), Some(Ok(kib))) = (parts.next(), parts.next().map(str::parse::<u64>)) else {
            continue;
        };
        match key {
            "VmRSS:" => r.current_bytes = kib.saturating_mul(1024),
            "VmHWM:" => r.peak_bytes = kib.saturating_mul(1024),
            _ => {}
        }
    }
    r
}

/// Reads this process's current and peak resident set size.
pub fn rss() -> io::Result<Rss> {
    Ok(parse_rss(&std::fs::read_to_string("/proc/self/status")?))
}

/// The `RLIMIT_MEMLOCK` limits of this process; `None` means unlimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemlockLimit {
    /// Soft limit in bytes (what `mlock` is checked against).
    pub soft_bytes: Option<u64>,
    /// Hard limit in bytes (how far the soft limit may be raised without privilege).
    pub hard_bytes: Option<u64>,
}

/// Reads the locked-memory limit with `getrlimit`.
pub fn memlock_limit() -> io::Result<MemlockLimit> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_MEMLOCK)?;
    let conv = |v: rlim_t| (v != RLIM_INFINITY).then_some(v);
    Ok(MemlockLimit {
        soft_bytes: conv(soft),
        hard_bytes: conv(hard),
    })
}

/// Outcome of one capability probe: available or not, with the reason when not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Capability {
    /// Whether the capability can be used.
    pub available: bool,
    /// What was found (on success) or why not (on failure), in words.
    pub detail: String,
}

impl Capability {
    fn yes(detail: impl Into<String>) -> Self {
        Capability {
            available: true,
            detail: detail.into(),
        }
    }
    fn no(detail: impl Into<String>) -> Self {
        Capability {
            available: false,
            detail: detail.into(),
        }
    }
}

/// Probes io_uring by creating (and dropping) a small ring.
///
/// io_uring may be missing (old kernel: `ENOSYS`), disabled by `kernel.io_uring_disabled`
/// (`EPERM`) or blocked by a seccomp policy (often `EPERM` or `ENOSYS` too).
pub fn probe_io_uring() -> Capability {
    match io_uring::IoUring::new(4) {
        Ok(ring) => {
            let p = ring.params();
            Capability::yes(format!(
                "ring created (sq {} entries, features {:#x})",
                p.sq_entries(),
                features_bits(p)
            ))
        }
        Err(e) => Capability::no(match e.raw_os_error().map(Errno::from_raw) {
            Some(Errno::ENOSYS) => format!("kernel has no io_uring ({e})"),
            Some(Errno::EPERM) => {
                format!("io_uring refused ({e}): check sysctl kernel.io_uring_disabled or seccomp")
            }
            _ => format!("io_uring_setup failed: {e}"),
        }),
    }
}

bitflags::bitflags! {
    /// The `IORING_FEAT_*` bits (`include/uapi/linux/io_uring.h`) the stack cares about.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct RingFeatures: u32 {
        /// `IORING_FEAT_NODROP`: completions are never dropped when the queue overflows.
        const NODROP = 1 << 1;
        /// `IORING_FEAT_SUBMIT_STABLE`: submitted data may be reused once submit returns.
        const SUBMIT_STABLE = 1 << 2;
        /// `IORING_FEAT_FAST_POLL`: internal polling instead of worker threads where possible.
        const FAST_POLL = 1 << 5;
    }
}

/// The feature bits of `p` that [`RingFeatures`] names; the io-uring crate reports each with its
/// own accessor.
fn features_bits(p: &io_uring::Parameters) -> u32 {
    let mut f = RingFeatures::empty();
    f.set(RingFeatures::NODROP, p.is_feature_nodrop());
    f.set(RingFeatures::SUBMIT_STABLE, p.is_feature_submit_stable());
    f.set(RingFeatures::FAST_POLL, p.is_feature_fast_poll());
    f.bits()
}

/// Probes whether files in `dir` accept `O_DIRECT` reads and writes of one aligned 4 KiB block.
///
/// Creates a hidden scratch file, writes and reads one block with `O_DIRECT`, and removes it.
/// `EINVAL` at open or at the first I/O is how file systems such as tmpfs refuse direct I/O.
/// If `dir` does not exist yet, its nearest existing ancestor is probed (that is the file system
/// the directory will be created on) and the detail says so.
pub fn probe_o_direct(dir: &Path) -> Capability {
    let mut target = dir.to_path_buf();
    while !target.is_dir() {
        match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => target = p.to_path_buf(),
            _ => {
                target = PathBuf::from(".");
                break;
            }
        }
    }
    let via = if target == dir {
        String::new()
    } else {
        format!(
            " (probed {} since {} does not exist yet)",
            target.display(),
            dir.display()
        )
    };
    let path = target.join(format!(".kvstack-odirect-probe-{}", std::process::id()));
    let result = direct_io_roundtrip(&path);
    // Best effort: a leftover scratch file is harmless, and the probe result matters more.
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(()) => Capability::yes(format!("4 KiB O_DIRECT write+read succeeded{via}")),
        Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => Capability::no(format!(
            "file system refuses O_DIRECT ({e}){via}; kvstack falls back to buffered I/O there"
        )),
        Err(e) => Capability::no(format!("O_DIRECT probe failed: {e}{via}")),
    }
}

fn direct_io_roundtrip(path: &Path) -> io::Result<()> {
    const BLOCK: usize = 4096;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(OFlag::O_DIRECT.bits())
        .open(path)?;
    // An over-allocated Vec gives a 4 KiB-aligned window without unsafe code.
    let mut buf = vec![0u8; 2 * BLOCK];
    let off = buf.as_ptr().align_offset(BLOCK);
    let block = buf
        .get_mut(off..off + BLOCK)
        .ok_or_else(|| io::Error::other("could not align a probe buffer"))?;
    block.fill(0xA5);
    file.write_all_at(block, 0)?;
    block.fill(0);
    file.read_exact_at(block, 0)?;
    if block.iter().any(|&b| b != 0xA5) {
        return Err(io::Error::other(
            "O_DIRECT read returned different bytes than written",
        ));
    }
    Ok(())
}

/// What the CUDA probe found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CudaReport {
    /// Whether this build includes CUDA support (the `cuda` feature).
    pub compiled: bool,
    /// Whether the CUDA driver library (libcuda) can be loaded.
    pub driver_library: bool,
    /// Number of CUDA devices, when the driver initialised.
    pub devices: Option<u32>,
    /// The driver's CUDA version as `major.minor`, when the driver initialised.
    pub driver_version: Option<String>,
    /// Why no device is usable, in words (None when devices were found).
    pub detail: Option<String>,
}

/// Probes the CUDA driver. Asks cudarc's `is_culib_present()` first: any other cudarc call
/// panics when libcuda is missing.
pub fn probe_cuda() -> CudaReport {
    #[cfg(feature = "cuda")]
    {
        cuda::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        CudaReport {
            compiled: false,
            driver_library: false,
            devices: None,
            driver_version: None,
            detail: Some("built without the `cuda` feature".to_owned()),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::CudaReport;
    use cudarc::driver::sys;

    pub(super) fn probe() -> CudaReport {
        let mut report = CudaReport {
            compiled: true,
            driver_library: false,
            devices: None,
            driver_version: None,
            detail: None,
        };
        // SAFETY: `is_culib_present` only tries to dlopen the driver library by its usual
        // names; loading libcuda runs its initialisers, which is the documented way to use it.
        report.driver_library = unsafe { sys::is_culib_present() };
        if !report.driver_library {
            report.detail = Some("no CUDA driver library (libcuda.so) on this machine".to_owned());
            return report;
        }
        // Error codes are reported as numbers: formatting them through the driver would call
        // back into a library that just failed.
        // SAFETY: the library is present (checked above); `cuInit` takes flags by value.
        let rc = unsafe { sys::cuInit(0) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            report.detail = Some(format!("cuInit failed with CUresult {}", rc as u32));
            return report;
        }
        let mut version: std::ffi::c_int = 0;
        // SAFETY: driver initialised; the pointer is valid for one c_int write.
        if unsafe { sys::cuDriverGetVersion(&mut version) } == sys::CUresult::CUDA_SUCCESS {
            report.driver_version = Some(format!("{}.{}", version / 1000, (version % 1000) / 10));
        }
        let mut count: std::ffi::c_int = 0;
        // SAFETY: driver initialised; the pointer is valid for one c_int write.
        let rc = unsafe { sys::cuDeviceGetCount(&mut count) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            report.detail = Some(format!(
                "cuDeviceGetCount failed with CUresult {}",
                rc as u32
            ));
            return report;
        }
        report.devices = u32::try_from(count).ok();
        if count == 0 {
            report.detail = Some("driver loaded but no CUDA device is visible".to_owned());
        }
        report
    }
}

/// Everything [`probe_host`] found.
#[derive(Clone, Debug, Serialize)]
pub struct HostReport {
    /// CPU model name from `/proc/cpuinfo`, if readable.
    pub cpu_model: Option<String>,
    /// CPUs this process may run on.
    pub logical_cpus: usize,
    /// Memory and explicit huge pages; None (with `meminfo_error`) if unreadable.
    pub memory: Option<MemInfo>,
    /// Why `/proc/meminfo` could not be read.
    pub meminfo_error: Option<String>,
    /// Transparent huge page mode (`always`, `madvise`, `never`), if the kernel has THP.
    pub transparent_huge_pages: Option<String>,
    /// Locked-memory limit; None (with `memlock_error`) if `getrlimit` failed.
    pub memlock: Option<MemlockLimit>,
    /// Why the locked-memory limit could not be read.
    pub memlock_error: Option<String>,
    /// io_uring availability.
    pub io_uring: Capability,
    /// The data directory that was probed for O_DIRECT.
    pub data_dir: PathBuf,
    /// O_DIRECT on the data directory's file system.
    pub o_direct: Capability,
    /// CUDA driver and devices.
    pub cuda: CudaReport,
}

/// Runs every host probe. `data_dir` is where kvstack would keep its SSD tier.
pub fn probe_host(data_dir: &Path) -> HostReport {
    let cpu_model = cpu_identity().model_name;
    let logical_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let (memory, meminfo_error) = match std::fs::read_to_string("/proc/meminfo") {
        Ok(t) => (Some(parse_meminfo(&t)), None),
        Err(e) => (None, Some(format!("cannot read /proc/meminfo: {e}"))),
    };
    let transparent_huge_pages =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .ok()
            .and_then(|t| parse_thp_mode(&t));
    let (memlock, memlock_error) = match memlock_limit() {
        Ok(m) => (Some(m), None),
        Err(e) => (None, Some(format!("getrlimit(RLIMIT_MEMLOCK) failed: {e}"))),
    };
    let io_uring = probe_io_uring();
    let o_direct = probe_o_direct(data_dir);
    let cuda = probe_cuda();
    log::debug!("io_uring: {io_uring:?}; O_DIRECT: {o_direct:?}; CUDA: {cuda:?}");
    HostReport {
        cpu_model,
        logical_cpus,
        memory,
        meminfo_error,
        transparent_huge_pages,
        memlock,
        memlock_error,
        io_uring,
        data_dir: data_dir.to_path_buf(),
        o_direct,
        cuda,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24589948 kB\nMemFree:        23000000 kB\n\
MemAvailable:   23500000 kB\nHugePages_Total:       4\nHugePages_Free:        3\n\
Hugepagesize:       2048 kB\n";

    #[test]
    fn meminfo_parses_sizes_and_counts() {
        let m = parse_meminfo(MEMINFO);
        assert_eq!(m.total_bytes, 24589948 * 1024);
        assert_eq!(m.available_bytes, 23500000 * 1024);
        assert_eq!(m.huge_pages_total, 4);
        assert_eq!(m.huge_pages_free, 3);
        assert_eq!(m.huge_page_bytes, 2 << 20);
    }

    #[test]
    fn cpuinfo_reads_the_first_processor() {
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\
model\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f\n\n\
processor\t: 1\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Other\n";
        let id = parse_cpuinfo(text);
        assert_eq!(id.model_name.as_deref(), Some("AMD EPYC"));
        assert_eq!((id.family, id.model), (Some(25), Some(17)));
    }

    #[test]
    fn cpuinfo_without_the_fields_reads_none() {
        // An aarch64 /proc/cpuinfo: no `model name`, `cpu family` or `model`.
        let id = parse_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n");
        assert_eq!(id, CpuIdentity::default());
        assert_eq!(
            parse_cpuinfo("cpu family\t: six\nmodel\t:\n"),
            CpuIdentity::default()
        );
    }

    #[test]
    fn meminfo_tolerates_garbage() {
        assert_eq!(
            parse_meminfo("nonsense\nMemTotal: lots kB\n"),
            MemInfo::default()
        );
    }

    #[test]
    fn rss_parses_current_and_peak() {
        let r = parse_rss("Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n");
        assert_eq!(
            r,
            Rss {
                current_bytes: 1 << 20,
                peak_bytes: 2 << 20
            }
        );
        let live = rss().unwrap();
        assert!(live.peak_bytes >= live.current_bytes && live.current_bytes > 0);
    }

    #[test]
    fn thp_mode_is_the_bracketed_word() {
        assert_eq!(
            parse_thp_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(parse_thp_mode("always madvise never"), None);
    }

    #[test]
    fn o_direct_probe_on_missing_dir_probes_an_ancestor() {
        let dir = std::env::temp_dir().join("kvstack-probe-test-missing/a/b");
        let cap = probe_o_direct(&dir);
        // Whatever the file system answers, the report must say which directory it probed.
        assert!(
            cap.detail.contains("does not exist yet") || !cap.available,
            "{cap:?}"
        );
    }

    #[test]
    fn probes_never_panic() {
        let r = probe_host(Path::new("."));
        assert!(r.logical_cpus >= 1);
        // No GPU in CI: the CUDA probe must report absence, not crash.
        if !r.cuda.driver_library {
            assert!(r.cuda.detail.is_some());
        }
    }
}
