//! Shared pieces of the kvstack fuzz targets: the compact "store image" input of
//! `store_recovery`, the seed store's contents (so the target can tell what a valid writer
//! produced), and the store options every run uses.
//!
//! Fuzz-only code: a failure here is a bug in the harness, so it may unwrap.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvstack_driver::blockio::EnginePreference;
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_firmware_interface::record::{
    ALIGN, RECORD_MAGIC, RecordHeader, SEGMENT_MAGIC, SegmentHeader, crc32c,
};
use kvstack_tiers::{
    BlockSource, ManualClock, ModelFingerprint, Result, StoreLocation, StoreOptions, Tenant,
};

pub mod image;

/// Tokens per block of the seed store: tiny blocks so a unit has several of them.
pub const P: usize = 4;

/// Clock of every run (ms since the epoch): fixed, so runs are reproducible.
pub const NOW_MS: u64 = 1_750_000_000_000;

/// Largest block payload the fuzzed stores accept: one page of payload, so each record is two
/// pages and a 16 KiB segment holds one.
pub const MAX_BLOCK_PAYLOAD: usize = 4096;

/// The seed store's model fingerprint.
pub fn model() -> ModelFingerprint {
    ModelFingerprint([0x5A; 32])
}

/// The seed store's tenants.
pub fn tenants() -> [Tenant; 2] {
    [Tenant::new("fuzz-a"), Tenant::new("fuzz-b")]
}

/// The seed store's units, `(tenant index, tokens)`: two of tenant 0 sharing their first block
/// (the second ends with a 2-token block), one short unit of tenant 1.
pub fn units() -> Vec<(usize, Vec<u32>)> {
    vec![
        (0, vec![1, 2, 3, 4, 5, 6, 7, 8]),
        (0, vec![1, 2, 3, 4, 9, 10, 11, 12, 13, 14]),
        (1, vec![100, 101]),
    ]
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = h ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// KV bytes of the seed store's block covering `tokens[first..first + n]`: a function of the
/// prefix up to the block's end and of the tenant (equal prefixes, equal bytes), 16 to 271
/// bytes long.
pub fn block_kv(tokens: &[u32], first: usize, n: usize, tenant: &Tenant) -> Vec<u8> {
    let mut h = tenant.id();
    for &t in &tokens[..first + n] {
        h = mix(h, u64::from(t));
    }
    let len = 16 + (h % 256) as usize;
    let mut out = Vec::with_capacity(len + 8);
    let mut x = h;
    while out.len() < len {
        x = mix(x, out.len() as u64);
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The seed store's [`BlockSource`].
pub struct SeedSource<'a> {
    /// Every token of the unit.
    pub tokens: &'a [u32],
    /// Its tenant.
    pub tenant: &'a Tenant,
}

impl BlockSource for SeedSource<'_> {
    fn block_payload(&self, _i: usize, first: u64, n: usize, out: &mut Vec<u8>) -> Result<()> {
        out.extend_from_slice(&block_kv(self.tokens, first as usize, n, self.tenant));
        Ok(())
    }
}

/// Where a fuzzed store lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// A directory of segment files.
    Directory,
    /// One preallocated file cut into slots.
    Device,
}

/// The name of the device file of a [`Layout::Device`] store in its directory.
pub const DEVICE_FILE: &str = "device.img";

/// The options of a fuzzed store at `dir`: tiny segments, two I/O buffers in flight,
/// synchronous buffered I/O (the engine is not what is fuzzed, and it works on tmpfs), no huge
/// pages and no locking.
pub fn store_options(
    dir: &Path,
    layout: Layout,
    segment_bytes: u64,
    read_only: bool,
) -> StoreOptions {
    let location = match layout {
        Layout::Directory => StoreLocation::Directory(dir.to_path_buf()),
        Layout::Device => StoreLocation::Device(dir.join(DEVICE_FILE)),
    };
    let mut o = StoreOptions::new(location);
    o.segment_bytes = segment_bytes;
    o.capacity_bytes = 12 * segment_bytes;
    o.max_block_payload = MAX_BLOCK_PAYLOAD;
    o.max_unit_blocks = 64;
    o.queue_depth = 2;
    o.write_queue_bytes = 1 << 20;
    o.engine = EnginePreference::SyncBuffered;
    o.memory = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };
    o.read_only = read_only;
    o
}

/// The clock of every run.
pub fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(NOW_MS))
}

/// A fresh, empty directory for one execution, removed on drop. Under `KVSTACK_FUZZ_TMP`, else
/// `/dev/shm` when it exists (tmpfs: no disk I/O per execution), else the system temp dir.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates it.
    pub fn new(tag: &str) -> ScratchDir {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::var_os("KVSTACK_FUZZ_TMP")
            .map(PathBuf::from)
            .or_else(|| Some(PathBuf::from("/dev/shm")).filter(|p| p.is_dir()))
            .unwrap_or_else(std::env::temp_dir);
        let p = base.join(format!(
            "kvstack-fuzz-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        ScratchDir(p)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Recomputes the header CRC of the record or segment header at the start of `page` (chosen by
/// its magic), so a fuzzer's change to a header field is seen by the checks after the CRC.
/// With `payload`, first recomputes a record's payload CRC over `payload` (the bytes after the
/// header page, cut to the header's `payload_len`).
pub fn fix_crcs(page: &mut [u8], payload: Option<&[u8]>) {
    if page.len() >= RecordHeader::BYTES && page[..8] == RECORD_MAGIC {
        if let Some(rest) = payload {
            let len = u64::from_le_bytes(page[136..144].try_into().unwrap());
            let body = usize::try_from(len)
                .ok()
                .and_then(|n| rest.get(..n))
                .unwrap_or(rest);
            page[160..164].copy_from_slice(&crc32c(body).to_le_bytes());
        }
        let crc = crc32c(&page[..RecordHeader::CRC_OFFSET]);
        page[RecordHeader::CRC_OFFSET..RecordHeader::BYTES].copy_from_slice(&crc.to_le_bytes());
    } else if page.len() >= SegmentHeader::BYTES && page[..8] == SEGMENT_MAGIC {
        let crc = crc32c(&page[..SegmentHeader::CRC_OFFSET]);
        page[SegmentHeader::CRC_OFFSET..SegmentHeader::BYTES].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Pages of [`ALIGN`] bytes.
pub const PAGE: usize = ALIGN;
