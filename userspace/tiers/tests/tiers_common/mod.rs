//! Helpers shared by the tiers tests: temporary stores, deterministic unit contents.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvstack_driver::blockio::EnginePreference;
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_tiers::Result;
use kvstack_tiers::{
    BlockSource, Clock, DeleteTicket, ModelFingerprint, ReadOutcome, SsdStore, StoreLocation,
    StoreOptions, Tenant, UnitTicket, UnitWrite,
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

/// Small segments so tests fill, evict and compact quickly.
pub fn small_opts(dir: &Path) -> StoreOptions {
    let mut o = StoreOptions::new(StoreLocation::Directory(dir.to_path_buf()));
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

pub fn open(opts: StoreOptions, clock: Arc<dyn Clock>) -> SsdStore {
    SsdStore::open(opts, clock).unwrap()
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
