//! Helpers shared by the tiers tests: temporary stores, deterministic unit contents.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvstack_driver::blockio::{
    BufferPool, EngineKind, EnginePreference, IoOp, IoTarget, NvmeOpener, OpKind,
};
use kvstack_driver::nvme::fake::FakeOpener;
use kvstack_driver::nvme::vfio::VfioOpener;
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_tiers::Result;
use kvstack_tiers::{
    BlockSource, Clock, DeleteTicket, ModelFingerprint, NamespaceLocation, ReadOutcome, SsdStore,
    StoreLocation, StoreOptions, Tenant, UnitTicket, UnitWrite,
};

pub const MEM: PinnedOptions = PinnedOptions {
    huge_pages: HugePages::Never,
    locking: Locking::Never,
};

/// Tokens per block in these tests.
pub const P: usize = 16;

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let p = std::env::temp_dir().join(format!(
            "kvstack-test-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Environment variable choosing the media of the tests' stores (see [`media`]).
pub const MEDIA_VAR: &str = "KVSTACK_TIERS_IO";

/// Bytes of the fake namespace's image file (sparse: only written blocks take room); a store
/// uses at most its `capacity_bytes` of it.
pub const FAKE_NAMESPACE_BYTES: u64 = 1 << 30;

/// Bytes of a real namespace each test directory gets (every store of these tests fits).
pub const VFIO_REGION_BYTES: u64 = 128 << 20;

/// What the tests' stores live on, from `KVSTACK_TIERS_IO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Media {
    /// Unset or `dir`: segment files in the test's directory.
    Directory,
    /// `nvme-fake`: namespace 1 of the in-process fake NVMe controller (driven through the
    /// userspace NVMe engine), over the image file `nvme.img` in the test's directory, behind
    /// a volatile write cache that only Flush empties.
    FakeNvme,
    /// `vfio:<pci-address>`: namespace 1 of a real controller bound to `vfio-pci` (the QEMU
    /// rig, whose image is new and zeroed at each boot). Each test directory gets its own
    /// region of [`VFIO_REGION_BYTES`], never used before in this boot (the next one is
    /// counted in a file in the temporary directory, so processes share the count); one
    /// controller, so such tests run one at a time (`--test-threads=1`).
    Vfio(String),
}

/// The media `KVSTACK_TIERS_IO` names.
pub fn media() -> Media {
    match std::env::var(MEDIA_VAR).as_deref() {
        Err(_) | Ok("" | "dir") => Media::Directory,
        Ok("nvme-fake") => Media::FakeNvme,
        Ok(v) => match v.strip_prefix("vfio:") {
            Some(a) => Media::Vfio(a.to_owned()),
            None => panic!("{MEDIA_VAR}={v}: expected dir, nvme-fake or vfio:<pci-address>"),
        },
    }
}

/// Whether the stores of this run are on a namespace (segment slots, no segment files).
pub fn on_namespace() -> bool {
    media() != Media::Directory
}

/// The opener of the namespace of `dir`'s stores (namespace media only).
pub fn namespace_opener(dir: &Path) -> Arc<dyn NvmeOpener> {
    match media() {
        Media::Directory => panic!("no namespace: {MEDIA_VAR} is unset"),
        Media::FakeNvme => Arc::new(FakeOpener::new(&dir.join("nvme.img"), FAKE_NAMESPACE_BYTES)),
        Media::Vfio(address) => Arc::new(VfioOpener::new(&address).unwrap()),
    }
}

/// Byte offset of `dir`'s region of a real namespace: recorded in `dir/nvme-region` when
/// first asked for, from a count shared by every process of this boot.
pub fn vfio_region(dir: &Path) -> u64 {
    let marker = dir.join("nvme-region");
    if let Ok(text) = std::fs::read_to_string(&marker) {
        return text.trim().parse().unwrap();
    }
    let counter = std::env::temp_dir().join("kvstack-test-nvme-regions");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&counter)
        .unwrap();
    f.lock().unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut &f, &mut text).unwrap();
    let next: u64 = text.trim().parse().unwrap_or(0);
    f.set_len(0).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, (next + 1).to_string().as_bytes(), 0).unwrap();
    let offset = next * VFIO_REGION_BYTES;
    std::fs::write(&marker, offset.to_string()).unwrap();
    f.unlock().unwrap();
    offset
}

/// Byte offset of `dir`'s stores in their namespace (0 for the fake: one image per
/// directory).
pub fn namespace_offset(dir: &Path) -> u64 {
    match media() {
        Media::Vfio(_) => vfio_region(dir),
        _ => 0,
    }
}

/// The location of the stores of test directory `dir` on the configured media.
pub fn location(dir: &Path) -> StoreLocation {
    match media() {
        Media::Directory => StoreLocation::Directory(dir.to_path_buf()),
        _ => StoreLocation::Namespace(
            NamespaceLocation::new(namespace_opener(dir))
                .at_offset(namespace_offset(dir))
                .unwrap(),
        ),
    }
}

/// Moves `data` from or to bytes `[start, start + data.len())` of `dir`'s namespace (whole
/// pages) through an engine of a freshly brought-up controller (no store may be open on it),
/// one command's transfer at a time; writes are flushed.
fn raw_io(dir: &Path, kind: OpKind, start: u64, data: &mut [u8]) {
    let ns = namespace_opener(dir).open().unwrap();
    let chunk = ns.max_bytes().min(data.len()).max(4096);
    let mut engine = ns.engine(1, chunk).unwrap();
    let pool = BufferPool::new(1, chunk, MEM).unwrap();
    let target = IoTarget::Namespace(ns.target());
    for (i, part) in data.chunks_mut(chunk).enumerate() {
        let mut buf = pool.try_get().unwrap();
        if kind == OpKind::Write {
            buf.as_mut_slice()[..part.len()].copy_from_slice(part);
        }
        engine
            .submit(IoOp {
                kind,
                target: target.clone(),
                offset: start + (i * chunk) as u64,
                len: part.len(),
                buf,
                tag: 0,
            })
            .map_err(|e| e.error)
            .unwrap();
        let mut out = Vec::new();
        engine.wait(1, &mut out).unwrap();
        let c = out.pop().unwrap();
        c.result.as_ref().unwrap();
        if kind == OpKind::Read {
            part.copy_from_slice(&c.op.buf.as_slice()[..part.len()]);
        }
    }
    if kind == OpKind::Write {
        engine.flush(&target).unwrap();
    }
}

/// Reads `len` bytes at byte `offset` of `dir`'s part of its namespace (whole 4 KiB pages
/// are read).
pub fn raw_read(dir: &Path, offset: u64, len: usize) -> Vec<u8> {
    let offset = offset + namespace_offset(dir);
    let start = offset / 4096 * 4096;
    let end = (offset + len as u64).div_ceil(4096) * 4096;
    let mut data = vec![0u8; (end - start) as usize];
    raw_io(dir, OpKind::Read, start, &mut data);
    let s = (offset - start) as usize;
    data[s..s + len].to_vec()
}

/// Writes `bytes` at byte `offset` of `dir`'s part of its namespace (read-modify-write of
/// whole pages), then flushes.
pub fn raw_write(dir: &Path, offset: u64, bytes: &[u8]) {
    let offset = offset + namespace_offset(dir);
    let start = offset / 4096 * 4096;
    let end = (offset + bytes.len() as u64).div_ceil(4096) * 4096;
    let mut data = vec![0u8; (end - start) as usize];
    if start != offset || end != offset + bytes.len() as u64 {
        raw_io(dir, OpKind::Read, start, &mut data);
    }
    let s = (offset - start) as usize;
    data[s..s + bytes.len()].copy_from_slice(bytes);
    raw_io(dir, OpKind::Write, start, &mut data);
}

/// Small segments so tests fill, evict and compact quickly.
pub fn small_opts(dir: &Path) -> StoreOptions {
    let mut o = StoreOptions::new(location(dir));
    o.segment_bytes = 256 << 10;
    o.capacity_bytes = 8 * (256 << 10);
    o.max_block_payload = 8192;
    o.max_unit_blocks = 64;
    o.queue_depth = 8;
    o.memory = MEM;
    o.engine = EnginePreference::Auto;
    o
}

pub fn model() -> ModelFingerprint {
    ModelFingerprint([7; 32])
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = h ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The payload of the block covering `tokens[first..first + n]`: a function of the whole
/// prefix up to the block's end (so equal prefixes give equal bytes) and of the tenant.
pub fn block_bytes(tokens: &[u32], first: usize, n: usize, salt: u64) -> Vec<u8> {
    let mut h = salt;
    for &t in &tokens[..first + n] {
        h = mix(h, u64::from(t));
    }
    let len = 1000 + (h % 3000) as usize;
    let mut out = Vec::with_capacity(len);
    let mut x = h;
    while out.len() < len {
        x = mix(x, out.len() as u64);
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub struct Synthetic<'a> {
    pub tokens: &'a [u32],
    pub salt: u64,
}

impl BlockSource for Synthetic<'_> {
    fn block_payload(&self, _i: usize, first: u64, n: usize, out: &mut Vec<u8>) -> Result<()> {
        out.extend_from_slice(&block_bytes(self.tokens, first as usize, n, self.salt));
        Ok(())
    }
}

pub fn put(store: &SsdStore, tenant: &Tenant, tokens: &[u32]) -> Result<UnitTicket> {
    let salt = tenant.id();
    store.put_unit(&UnitWrite {
        model: &model(),
        tenant,
        tokens,
        page_tokens: P,
        align: 2,
        source: &Synthetic { tokens, salt },
    })
}

/// Reads the longest stored prefix of `tokens` and checks every byte; returns the tokens
/// matched and delivered.
pub fn read_and_check(store: &SsdStore, tenant: &Tenant, tokens: &[u32]) -> (u64, ReadOutcome) {
    let hit = store.lookup(&model(), tenant, tokens, P);
    let mut delivered = 0u64;
    let mut first = 0usize;
    let outcome = store
        .read_blocks(&hit.keys, |i, h, kv| {
            assert_eq!(h.tokens, hit.block_tokens[i]);
            let n = h.tokens as usize;
            let want = block_bytes(tokens, first, n, tenant.id());
            assert!(kv == want.as_slice(), "block {i} differs");
            first += n;
            delivered += n as u64;
            Ok(())
        })
        .unwrap();
    if outcome == ReadOutcome::Complete {
        assert_eq!(delivered, hit.tokens);
    }
    (delivered, outcome)
}

/// Token ids of unit `u` of a family: units of one family share their first `shared` tokens.
pub fn unit_tokens(family: u32, u: u32, shared: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| {
            if i < shared {
                family * 100_000 + i as u32
            } else {
                family * 100_000 + 50_000 + u * 1000 + i as u32
            }
        })
        .collect()
}

/// Opens a store; on a namespace, checks that it runs on the userspace NVMe engine.
pub fn open(opts: StoreOptions, clock: Arc<dyn Clock>) -> SsdStore {
    let namespace = matches!(opts.location, StoreLocation::Namespace(_));
    let store = SsdStore::open(opts, clock).unwrap();
    if namespace {
        assert_eq!(
            store.engine().kind,
            EngineKind::Nvme,
            "{:?}",
            store.engine()
        );
    }
    store
}

/// Tokens of unit `u` of round `round` in the mixed workloads of the crash and full-store
/// tests: three families (`family_base + u % 3`) share two whole blocks, then a tail unique to
/// (round, u) of varying length (`tail_base + round * round_stride + u * 64 + i`); every tenth
/// unit is `long_blocks` blocks and 6 tokens, long enough to be queued in parts.
pub fn mixed_unit_tokens(
    family_base: u32,
    tail_base: u32,
    round_stride: u32,
    long_blocks: usize,
    round: u32,
    u: u32,
) -> Vec<u32> {
    let family = u % 3;
    let len = if u % 10 == 9 {
        long_blocks * P + 6
    } else {
        2 * P + 2 + 2 * ((round * 7 + u * 5) % (3 * P as u32)) as usize
    };
    let mut t = unit_tokens(family_base + family, 0, 2 * P, 2 * P);
    t.extend((0..len - 2 * P).map(|i| tail_base + round * round_stride + u * 64 + i as u32));
    t
}

/// Queues the delete of the unit `tokens` of `tenant`.
pub fn del(store: &SsdStore, tenant: &Tenant, tokens: &[u32]) -> Result<DeleteTicket> {
    store.delete_unit(&model(), tenant, tokens, P)
}

/// The unit key (key of the last block) of `tokens`.
pub fn unit_key(tenant: &Tenant, tokens: &[u32]) -> kvstack_firmware_interface::record::Key {
    *kvstack_tiers::key::chain_keys(tokens, P, &model(), tenant)
        .last()
        .unwrap()
}

/// Whether `tokens` is a unit of `store` (by key).
pub fn is_unit(store: &SsdStore, tenant: &Tenant, tokens: &[u32]) -> bool {
    let k = unit_key(tenant, tokens);
    store.units().iter().any(|(u, _, _)| *u == k)
}
