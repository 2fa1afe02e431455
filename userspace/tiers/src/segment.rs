//! Where segments live: a directory of segment files, fixed-size slots of one preallocated
//! file or raw block device, or fixed-size LBA ranges of an NVMe namespace driven by the
//! userspace driver.
//!
//! - Directory: segment `id` is the file `seg-<id as 16 hex digits>.kvs`, preallocated to the
//!   segment size when created and removed when freed. At most `capacity / segment_bytes`
//!   files exist at once.
//! - Device (or one preallocated file): slot `k` is the byte range
//!   `[k * segment_bytes, (k + 1) * segment_bytes)`. A slot is in use when its first page holds
//!   a valid segment header of this store; freeing a slot zeroes that page. Records carry
//!   their segment id, so bytes a slot held in an earlier life are never mistaken for new ones
//!   (a new store on slots starts its ids far from any earlier store's: see
//!   `store::open::first_slot_segment`).
//! - Namespace: the same slots as a device, as byte ranges of the namespace (from LBA 0, at
//!   most `capacity_bytes` of it); the bytes of each slot are the records of the other
//!   layouts, unchanged. Every I/O goes through the namespace's block engines (one controller
//!   for all of them), and durability is the engine's flush (NVMe Flush) instead of
//!   `fdatasync`.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvstack_driver::blockio::{
    BlockEngine, BufferPool, IoOp, IoTarget, NvmeNamespace, NvmeOpener, OpKind, OpenMode,
    file_size, open_file, preallocate,
};
use kvstack_driver::lock::{Holder, LocationLock, LockMode, LockOutcome, try_lock};
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions, PinnedRegion};
use kvstack_firmware_interface::record::{ALIGN, SEGMENT_HEADER_PAGE};
use serde::Serialize;

use crate::{Error, Result};

/// Where a store keeps its segments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum StoreLocation {
    /// A directory of segment files (created if missing).
    Directory(PathBuf),
    /// An existing preallocated file or raw block device, cut into segment slots.
    Device(PathBuf),
    /// An NVMe namespace driven by the userspace driver (`vfio:<pci-address>`), cut into
    /// segment slots.
    Namespace(NamespaceLocation),
}

/// A namespace location: how to bring its controller up (done when the store opens; the
/// controller is shut down when the store and its engines are gone). Compared and serialized
/// by name (`vfio:0000:00:04.0`).
#[derive(Clone)]
pub struct NamespaceLocation {
    opener: Arc<dyn NvmeOpener>,
    name: PathBuf,
    offset: u64,
}

impl NamespaceLocation {
    /// The location `opener` brings up: the namespace from its first byte.
    pub fn new(opener: Arc<dyn NvmeOpener>) -> NamespaceLocation {
        let name = PathBuf::from(opener.name());
        NamespaceLocation {
            opener,
            name,
            offset: 0,
        }
    }

    /// The same namespace from byte `offset` on (a multiple of 4 KiB): several stores, or
    /// tests, on disjoint parts of one namespace. The name says `+<offset>`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for an offset that is not whole pages.
    pub fn at_offset(mut self, offset: u64) -> Result<NamespaceLocation> {
        if !offset.is_multiple_of(ALIGN as u64) {
            return Err(Error::InvalidOption {
                field: "namespace offset",
                reason: format!("{offset} is not a multiple of {ALIGN}"),
            });
        }
        self.offset = offset;
        self.name = PathBuf::from(format!("{}+{offset}", self.opener.name()));
        Ok(self)
    }

    /// Where the store starts in the namespace, in bytes.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// `vfio:0000:00:04.0`, `fake:<image>`.
    pub fn name(&self) -> String {
        self.name.display().to_string()
    }

    /// Brings the controller up.
    ///
    /// # Errors
    /// [`Error::Nvme`] with the driver's error.
    pub fn open(&self) -> Result<Arc<dyn NvmeNamespace>> {
        self.opener.open().map_err(|source| Error::Nvme {
            location: self.name(),
            source,
        })
    }
}

impl std::fmt::Debug for NamespaceLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NamespaceLocation")
            .field(&self.name)
            .finish()
    }
}

impl PartialEq for NamespaceLocation {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for NamespaceLocation {}

impl Serialize for NamespaceLocation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl StoreLocation {
    /// The path (a namespace's name, as a path, for messages and reports).
    pub fn path(&self) -> &Path {
        match self {
            StoreLocation::Directory(p) | StoreLocation::Device(p) => p,
            StoreLocation::Namespace(n) => &n.name,
        }
    }

    /// The directory whose file system holds the data (for the `O_DIRECT` probe; the current
    /// directory for a namespace, which has none).
    pub fn probe_dir(&self) -> PathBuf {
        match self {
            StoreLocation::Directory(p) => p.clone(),
            StoreLocation::Namespace(_) => PathBuf::from("."),
            StoreLocation::Device(p) => p
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
        }
    }
}

/// An NVMe namespace as the store uses it: engines are made from it, and a small engine of its
/// own writes segment header pages and sends the Flush commands that make batches durable.
pub(crate) struct NsMedia {
    pub ns: Arc<dyn NvmeNamespace>,
    /// Depth 1, one page: header pages, slot clears, flushes (from the writer and the syncer).
    util: Mutex<Option<(Box<dyn BlockEngine>, BufferPool)>>,
}

impl std::fmt::Debug for NsMedia {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NsMedia").field(&self.ns.describe()).finish()
    }
}

impl NsMedia {
    pub fn new(ns: Arc<dyn NvmeNamespace>) -> NsMedia {
        NsMedia {
            ns,
            util: Mutex::new(None),
        }
    }

    /// Runs `f` on the utility engine (built on first use).
    fn with_util<T>(
        &self,
        f: impl FnOnce(&mut dyn BlockEngine, &BufferPool) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        let mut util = self.util.lock().unwrap_or_else(|e| e.into_inner());
        if util.is_none() {
            let pool = BufferPool::new(
                1,
                SEGMENT_HEADER_PAGE,
                PinnedOptions {
                    huge_pages: HugePages::Never,
                    locking: Locking::Never,
                },
            )
            .map_err(std::io::Error::other)?;
            // Mapped for the controller: header pages move zero copy (docs/nvme.md).
            self.ns.map_pool(&pool).map_err(std::io::Error::other)?;
            let engine = self
                .ns
                .engine(1, SEGMENT_HEADER_PAGE)
                .map_err(std::io::Error::other)?;
            *util = Some((engine, pool));
        }
        let Some((engine, pool)) = util.as_mut() else {
            return Err(std::io::Error::other("no utility engine"));
        };
        f(engine.as_mut(), pool)
    }

    /// Writes one page (`data` at most a page; the rest of the page is zeros) at `offset`.
    fn write_page(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        let target = IoTarget::Namespace(self.ns.target());
        self.with_util(|engine, pool| {
            let mut buf = pool
                .try_get()
                .ok_or_else(|| std::io::Error::other("utility buffer in use"))?;
            let page = buf.as_mut_slice();
            page.fill(0);
            let n = data.len().min(page.len());
            page[..n].copy_from_slice(&data[..n]);
            engine
                .submit(IoOp {
                    kind: OpKind::Write,
                    target,
                    offset,
                    len: SEGMENT_HEADER_PAGE,
                    buf,
                    tag: 0,
                })
                .map_err(|e| e.error)?;
            let mut out = Vec::with_capacity(1);
            engine.wait(1, &mut out)?;
            match out.pop() {
                Some(c) => c.result.map(|_| ()),
                None => Err(std::io::Error::other("the write vanished")),
            }
        })
    }

    /// NVMe Flush through the engine: every completed write of the namespace becomes durable.
    fn flush(&self) -> std::io::Result<()> {
        let target = IoTarget::Namespace(self.ns.target());
        self.with_util(|engine, _| engine.flush(&target))
    }
}

/// The bytes under a segment: a file (a segment file, a device, a preallocated file) or a
/// namespace. Cloning shares it.
#[derive(Clone, Debug)]
pub(crate) enum Media {
    /// A kernel file.
    File(Arc<File>),
    /// A namespace of the userspace NVMe driver.
    Namespace(Arc<NsMedia>),
}

impl Media {
    /// What block-I/O operations on these bytes name.
    pub fn target(&self) -> IoTarget {
        match self {
            Media::File(f) => IoTarget::File(Arc::clone(f)),
            Media::Namespace(n) => IoTarget::Namespace(n.ns.target()),
        }
    }

    /// Makes completed writes durable: `fdatasync`, or the NVMe Flush command.
    pub fn sync(&self) -> std::io::Result<()> {
        match self {
            Media::File(f) => f.sync_data(),
            Media::Namespace(n) => n.flush(),
        }
    }

    /// Writes one header page synchronously at `offset` (`page` is at most one page).
    pub fn write_page(&self, page: &[u8], offset: u64) -> std::io::Result<()> {
        match self {
            Media::File(f) => f.write_all_at(page, offset),
            Media::Namespace(n) => n.write_page(page, offset),
        }
    }

    /// One value per distinct file or namespace (device slots share one: synced once).
    pub fn identity(&self) -> usize {
        match self {
            Media::File(f) => Arc::as_ptr(f) as usize,
            Media::Namespace(n) => Arc::as_ptr(n) as usize,
        }
    }
}

/// One segment's bytes: a file (or device) range. Holding an `Arc<SegmentFile>` is a **lease**:
/// the store frees (deletes or reuses) a segment only once no lease but its own remains, so a
/// reader never sees its bytes change under it.
#[derive(Debug)]
pub(crate) struct SegmentFile {
    /// Segment id (unique for the life of the store).
    pub id: u64,
    /// Slot (device) or the id again (directory).
    pub slot: u64,
    /// The segment file, or the device (or the namespace's name).
    pub path: PathBuf,
    pub media: Media,
    /// Byte offset of the segment in `file`.
    pub base: u64,
    /// Bytes of the segment.
    pub bytes: u64,
}

/// An existing segment slot found when opening.
#[derive(Debug)]
pub(crate) struct ExistingSlot {
    pub slot: u64,
    /// Directory mode: the id parsed from the file name.
    pub named_id: Option<u64>,
    pub path: PathBuf,
    pub media: Media,
    pub base: u64,
    pub bytes: u64,
}

/// The set of segment slots.
#[derive(Debug)]
pub(crate) struct Space {
    pub location: StoreLocation,
    pub segment_bytes: u64,
    /// Most segments at once.
    pub slots: u64,
    pub direct: bool,
    pub read_only: bool,
    /// The device file or namespace (slot layouts).
    device: Option<Media>,
    /// Byte offset of slot 0 (a namespace location's offset; 0 otherwise).
    base: u64,
    used: BTreeSet<u64>,
    /// The lock that makes this process the location's writer (or one of its readers); held
    /// as long as the space is.
    _lock: Option<LocationLock>,
    /// Read-only access while another process writes: the writers that hold the location
    /// (their segments may change under the scan).
    pub live_writers: Option<Vec<Holder>>,
}

fn segment_name(id: u64) -> String {
    format!("seg-{id:016x}.kvs")
}

fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("seg-")?.strip_suffix(".kvs")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

impl Space {
    /// Opens the location. `capacity` bounds a directory store and the part of a namespace
    /// used (ignored for a device, whose size is the capacity). A namespace's controller is
    /// brought up here, once the location's lock is held.
    pub fn open(
        location: &StoreLocation,
        segment_bytes: u64,
        capacity: u64,
        direct: bool,
        read_only: bool,
    ) -> Result<Space> {
        if segment_bytes < 4 * ALIGN as u64 || !segment_bytes.is_multiple_of(ALIGN as u64) {
            return Err(Error::InvalidOption {
                field: "segment_bytes",
                reason: format!("{segment_bytes} is not a multiple of 4096 of at least 16384"),
            });
        }
        let (slots, device) = match location {
            StoreLocation::Directory(dir) => {
                if !read_only {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| Error::io("cannot create store directory", dir, e))?;
                } else if !dir.is_dir() {
                    return Err(Error::Location {
                        path: dir.clone(),
                        reason: "no such store directory".into(),
                    });
                }
                (capacity / segment_bytes, None)
            }
            StoreLocation::Device(_) | StoreLocation::Namespace(_) => (0, None),
        };
        // The location is locked before anything in it is read or changed: a writer must be
        // alone (two writers would reuse each other's segment names and lose acknowledged
        // units); a reader shares the lock with other readers, or reads a live store.
        let (lock, live_writers) = lock_location(location, read_only)?;
        let (slots, device) = match location {
            StoreLocation::Directory(_) => (slots, device),
            StoreLocation::Namespace(n) => {
                let media = Arc::new(NsMedia::new(n.open()?));
                log::info!("store on {} from byte {}", media.ns.describe(), n.offset);
                let bytes = media
                    .ns
                    .target()
                    .capacity()
                    .saturating_sub(n.offset)
                    .min(capacity);
                (bytes / segment_bytes, Some(Media::Namespace(media)))
            }
            StoreLocation::Device(path) => {
                let f = open_file(
                    path,
                    OpenMode {
                        write: !read_only,
                        create: false,
                        direct,
                    },
                )
                .map_err(|e| Error::io("cannot open store device", path, e))?;
                let size =
                    file_size(&f).map_err(|e| Error::io("cannot size store device", path, e))?;
                (size / segment_bytes, Some(Media::File(Arc::new(f))))
            }
        };
        if slots < 3 {
            return Err(Error::InvalidOption {
                field: "capacity_bytes",
                reason: format!(
                    "room for {slots} segments of {segment_bytes} bytes; at least 3 are needed \
                     (one is kept in reserve for compaction)"
                ),
            });
        }
        Ok(Space {
            location: location.clone(),
            segment_bytes,
            slots,
            direct,
            read_only,
            device,
            base: match location {
                StoreLocation::Namespace(n) => n.offset,
                _ => 0,
            },
            used: BTreeSet::new(),
            _lock: lock,
            live_writers,
        })
    }

    /// The namespace of a namespace location (brought up by [`Space::open`]).
    pub fn namespace(&self) -> Option<Arc<NsMedia>> {
        match &self.device {
            Some(Media::Namespace(n)) => Some(Arc::clone(n)),
            _ => None,
        }
    }

    /// The writers of a live read ([`Space::live_writers`]), described.
    pub fn live_description(&self) -> Option<String> {
        self.live_writers.as_deref().map(describe_holders)
    }

    /// Every slot that may hold a segment: directory files named like segments, or every
    /// device slot.
    pub fn existing(&self) -> Result<Vec<ExistingSlot>> {
        match (&self.location, &self.device) {
            (StoreLocation::Directory(dir), _) => {
                let mut out = Vec::new();
                let entries = std::fs::read_dir(dir)
                    .map_err(|e| Error::io("cannot list store directory", dir, e))?;
                for entry in entries {
                    let entry =
                        entry.map_err(|e| Error::io("cannot list store directory", dir, e))?;
                    let name = entry.file_name();
                    let Some(id) = name.to_str().and_then(parse_segment_name) else {
                        continue;
                    };
                    let path = entry.path();
                    let f = match open_file(
                        &path,
                        OpenMode {
                            write: !self.read_only,
                            create: false,
                            direct: self.direct,
                        },
                    ) {
                        Ok(f) => f,
                        // A live store's writer deletes segments it reclaimed: one listed a
                        // moment ago may be gone, which is not damage.
                        Err(e)
                            if self.live_writers.is_some()
                                && e.kind() == std::io::ErrorKind::NotFound =>
                        {
                            continue;
                        }
                        Err(e) => return Err(Error::io("cannot open segment", &path, e)),
                    };
                    let bytes =
                        file_size(&f).map_err(|e| Error::io("cannot size segment", &path, e))?;
                    out.push(ExistingSlot {
                        slot: id,
                        named_id: Some(id),
                        path,
                        media: Media::File(Arc::new(f)),
                        base: 0,
                        bytes,
                    });
                }
                out.sort_by_key(|s| s.slot);
                Ok(out)
            }
            (StoreLocation::Device(_) | StoreLocation::Namespace(_), Some(m)) => Ok((0..self
                .slots)
                .map(|k| ExistingSlot {
                    slot: k,
                    named_id: None,
                    path: self.location.path().to_path_buf(),
                    media: m.clone(),
                    base: self.slot_base(k),
                    bytes: self.segment_bytes,
                })
                .collect()),
            (StoreLocation::Device(_) | StoreLocation::Namespace(_), None) => {
                Err(Error::Location {
                    path: self.location.path().to_path_buf(),
                    reason: "device not open".into(),
                })
            }
        }
    }

    /// Byte offset of slot `slot` in the device or namespace (slot layouts).
    pub fn slot_base(&self, slot: u64) -> u64 {
        self.base + slot * self.segment_bytes
    }

    /// Marks a recovered slot as used.
    pub fn mark_used(&mut self, slot: u64) {
        self.used.insert(slot);
    }

    /// Slots in use.
    pub fn used(&self) -> u64 {
        self.used.len() as u64
    }

    /// Free slots.
    pub fn free(&self) -> u64 {
        self.slots.saturating_sub(self.used())
    }

    /// Creates the storage of segment `id` (its header is written by the caller).
    pub fn create(&mut self, id: u64) -> Result<SegmentFile> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        if self.free() == 0 {
            return Err(Error::StoreFull {
                needed: self.segment_bytes,
            });
        }
        match (&self.location, &self.device) {
            (StoreLocation::Directory(dir), _) => {
                let path = dir.join(segment_name(id));
                let f = open_file(
                    &path,
                    OpenMode {
                        write: true,
                        create: true,
                        direct: self.direct,
                    },
                )
                .map_err(|e| Error::io("cannot create segment", &path, e))?;
                preallocate(&f, self.segment_bytes)
                    .map_err(|e| Error::io("cannot preallocate segment", &path, e))?;
                // The new name must survive a crash along with the data written into it: the
                // directory is synced with the batch that first writes into it, so creation
                // itself does not wait for a journal commit.
                self.used.insert(id);
                Ok(SegmentFile {
                    id,
                    slot: id,
                    path,
                    media: Media::File(Arc::new(f)),
                    base: 0,
                    bytes: self.segment_bytes,
                })
            }
            (StoreLocation::Device(_) | StoreLocation::Namespace(_), Some(m)) => {
                let Some(slot) = (0..self.slots).find(|s| !self.used.contains(s)) else {
                    return Err(Error::StoreFull {
                        needed: self.segment_bytes,
                    });
                };
                self.used.insert(slot);
                Ok(SegmentFile {
                    id,
                    slot,
                    path: self.location.path().to_path_buf(),
                    media: m.clone(),
                    base: self.slot_base(slot),
                    bytes: self.segment_bytes,
                })
            }
            (StoreLocation::Device(_) | StoreLocation::Namespace(_), None) => {
                Err(Error::Location {
                    path: self.location.path().to_path_buf(),
                    reason: "device not open".into(),
                })
            }
        }
    }

    /// Frees a segment nobody else holds a lease on: removes its file, or zeroes its slot's
    /// header page. Not synced: a freed segment that reappears after a crash holds only
    /// complete, checksummed records that were reclaimable anyway.
    pub fn release(&mut self, seg: &SegmentFile) -> Result<()> {
        self.used.remove(&seg.slot);
        match &self.location {
            StoreLocation::Directory(_) => std::fs::remove_file(&seg.path)
                .map_err(|e| Error::io("cannot remove segment", &seg.path, e)),
            StoreLocation::Device(_) | StoreLocation::Namespace(_) => {
                let mut page = PinnedRegion::new(
                    SEGMENT_HEADER_PAGE,
                    PinnedOptions {
                        huge_pages: HugePages::Never,
                        locking: Locking::Never,
                    },
                )
                .map_err(Error::Memory)?;
                page.as_mut_slice().fill(0);
                seg.media
                    .write_page(&page.as_slice()[..SEGMENT_HEADER_PAGE], seg.base)
                    .map_err(|e| Error::io("cannot clear segment slot of", &seg.path, e))
            }
        }
    }

    /// Removes a directory file that holds no valid segment (a segment created just before a
    /// crash, before its header was durable).
    pub fn remove_invalid(&mut self, slot: &ExistingSlot) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        if let StoreLocation::Directory(_) = self.location {
            std::fs::remove_file(&slot.path)
                .map_err(|e| Error::io("cannot remove invalid segment", &slot.path, e))?;
        }
        Ok(())
    }
}

/// Takes the location's lock: exclusive for a writer (refused with [`Error::InUse`] while
/// any other process holds it), shared for a reader (while another process writes, the reader
/// goes on without a lock and gets the writers back, to say that it reads a live store).
pub(crate) fn lock_location(
    location: &StoreLocation,
    read_only: bool,
) -> Result<(Option<LocationLock>, Option<Vec<Holder>>)> {
    let lock_path;
    let path = match location {
        StoreLocation::Namespace(n) => match n.opener.lock_path() {
            Some(p) => {
                lock_path = p;
                lock_path.as_path()
            }
            // The device is exclusive by itself (a VFIO group).
            None => return Ok((None, None)),
        },
        _ => location.path(),
    };
    let mode = if read_only {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    };
    match try_lock(path, mode).map_err(Error::Lock)? {
        LockOutcome::Locked(l) => Ok((Some(l), None)),
        LockOutcome::Busy(holders) if read_only => {
            log::warn!(
                "{} is being written by {}: reading it live (units written meanwhile may be \
                 missing or show as torn tails)",
                path.display(),
                describe_holders(&holders)
            );
            Ok((None, Some(holders)))
        }
        LockOutcome::Busy(holders) => Err(Error::InUse {
            what: match location {
                StoreLocation::Directory(_) => "data directory",
                StoreLocation::Device(_) => "store device",
                StoreLocation::Namespace(_) => "NVMe namespace",
            },
            path: path.to_path_buf(),
            holders: describe_holders(&holders),
        }),
    }
}

/// "pid P (command, for N s)", joined; "another process" when the holders are unknown.
pub(crate) fn describe_holders(holders: &[Holder]) -> String {
    if holders.is_empty() {
        return "another process".into();
    }
    holders
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_engine_values_choose_the_engine_or_the_namespace() {
        use crate::store::StoreOptions;
        use kvstack_driver::blockio::EnginePreference;
        let dir = StoreLocation::Directory(PathBuf::from("/d"));
        for (v, want) in [
            ("auto", EnginePreference::Auto),
            ("io_uring", EnginePreference::Uring),
            ("sync", EnginePreference::SyncBuffered),
            ("sync-direct", EnginePreference::SyncDirect),
        ] {
            let mut o = StoreOptions::new(dir.clone());
            o.set_io_engine(v).unwrap();
            assert_eq!((o.engine, &o.location), (want, &dir), "{v}");
        }
        let mut o = StoreOptions::new(dir.clone());
        o.set_io_engine("vfio:0000:00:04.0").unwrap();
        let StoreLocation::Namespace(n) = &o.location else {
            panic!("{:?}", o.location);
        };
        assert_eq!(n.name(), "vfio:0000:00:04.0");
        assert_eq!(o.location.path(), Path::new("vfio:0000:00:04.0"));
        for bad in [
            "spdk",
            "vfio:",
            "vfio:00:04.0",
            "vfio:../x",
            "VFIO:0000:00:04.0",
        ] {
            let mut o = StoreOptions::new(dir.clone());
            let e = o.set_io_engine(bad).unwrap_err().to_string();
            assert!(e.contains("io_engine"), "{bad}: {e}");
            assert_eq!(o.location, dir, "{bad} changed the location");
        }
        let n = n.clone();
        assert!(n.clone().at_offset(100).is_err());
        let at = n.at_offset(128 << 20).unwrap();
        assert_eq!(at.offset(), 128 << 20);
        assert_eq!(at.name(), "vfio:0000:00:04.0+134217728");
    }

    #[test]
    fn segment_names_roundtrip() {
        assert_eq!(parse_segment_name(&segment_name(0xabc)), Some(0xabc));
        assert_eq!(parse_segment_name("seg-12.kvs"), None);
        assert_eq!(parse_segment_name("other"), None);
    }
}
