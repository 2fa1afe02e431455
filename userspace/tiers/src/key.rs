//! Content keys of persisted blocks and units (spec §8: "a chained hash of its token blocks,
//! the model fingerprint and the tenant").
//!
//! - A [`ModelFingerprint`] is BLAKE3 of the model config, the page size and the storage
//!   formats: two stores, or two runs, only share blocks when every byte of a block would mean
//!   the same thing.
//! - A [`Tenant`] is BLAKE3 of the tenant's name. Every key is derived from it, so tenants
//!   never share (or see) each other's blocks; a cryptographic hash makes it infeasible to
//!   forge a key of another tenant.
//! - The key of block `i` hashes the key of block `i - 1` (for the first block, the root key
//!   of model and tenant), the block's token ids, the model and the tenant. Equal keys
//!   therefore mean equal token prefixes, and a unit that shares a prefix with another shares
//!   its blocks.

use kvstack_firmware_interface::record::{FORMAT_VERSION, KEY_BYTES, Key, MODEL_BYTES};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;

use kvstack_spec::config::ModelConfig;

/// Identifies the model (config, page size, formats) whose KV a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelFingerprint(pub [u8; 32]);

impl ModelFingerprint {
    /// Fingerprint of `cfg` stored in pages of `page_tokens` tokens. Every field of the config
    /// counts (its JSON serialisation), plus the entry sizes and the record format version.
    pub fn new(cfg: &ModelConfig, page_tokens: usize) -> ModelFingerprint {
        let mut h = blake3::Hasher::new_derive_key("kvstack model fingerprint v1");
        // Serialising a plain data struct cannot fail; an empty string would still give a
        // fingerprint that differs from every real config's.
        let json = serde_json::to_string(cfg).unwrap_or_default();
        h.update(json.as_bytes());
        for v in [
            page_tokens as u64,
            GlobalFp4Entry::BYTES as u64,
            IndexMxfp4Entry::BYTES as u64,
            WindowFp8Entry::BYTES as u64,
            u64::from(FORMAT_VERSION),
        ] {
            h.update(&v.to_le_bytes());
        }
        ModelFingerprint(*h.finalize().as_bytes())
    }

    /// This fingerprint narrowed to one set of weights: `weights` identifies them (a hash of
    /// the checkpoint, or the built-in model's name and seed). Two checkpoints of one config
    /// hold different KV for the same tokens, so their units must never match.
    pub fn with_weights(&self, weights: &[u8]) -> ModelFingerprint {
        if weights.is_empty() {
            return *self;
        }
        let mut h = blake3::Hasher::new_derive_key("kvstack model fingerprint weights v1");
        h.update(&self.0);
        h.update(weights);
        ModelFingerprint(*h.finalize().as_bytes())
    }

    /// The 16 bytes kept in each record header.
    pub fn short(&self) -> [u8; MODEL_BYTES] {
        let mut out = [0u8; MODEL_BYTES];
        out.copy_from_slice(&self.0[..MODEL_BYTES]);
        out
    }
}

/// A tenant: units of one tenant are invisible to every other.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Tenant {
    name: String,
    #[serde(skip)]
    hash: [u8; 32],
}

impl Tenant {
    /// The tenant called `name`.
    pub fn new(name: &str) -> Tenant {
        let mut h = blake3::Hasher::new_derive_key("kvstack tenant v1");
        h.update(name.as_bytes());
        Tenant {
            name: name.to_owned(),
            hash: *h.finalize().as_bytes(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The 8-byte id kept in each record header (informational: keys use the full hash).
    pub fn id(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.hash[..8]);
        u64::from_le_bytes(b)
    }
}

/// The key a first block chains from.
pub fn root_key(model: &ModelFingerprint, tenant: &Tenant) -> Key {
    let mut h = blake3::Hasher::new_derive_key("kvstack root v1");
    h.update(&model.0);
    h.update(&tenant.hash);
    *h.finalize().as_bytes()
}

/// The key of a block of `tokens` whose parent has key `parent`.
pub fn block_key(parent: &Key, tokens: &[u32], model: &ModelFingerprint, tenant: &Tenant) -> Key {
    let mut h = blake3::Hasher::new_derive_key("kvstack block v1");
    h.update(parent);
    h.update(&model.0);
    h.update(&tenant.hash);
    h.update(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    *h.finalize().as_bytes()
}

/// Keys of the blocks of a unit of `tokens`: one per `page_tokens` tokens, the last one
/// possibly partial.
pub fn chain_keys(
    tokens: &[u32],
    page_tokens: usize,
    model: &ModelFingerprint,
    tenant: &Tenant,
) -> Vec<Key> {
    let mut parent = root_key(model, tenant);
    tokens
        .chunks(page_tokens.max(1))
        .map(|block| {
            parent = block_key(&parent, block, model, tenant);
            parent
        })
        .collect()
}

/// Lower-case hex of the first `n` bytes of a key (for reports).
pub fn key_hex(key: &Key, n: usize) -> String {
    key.iter()
        .take(n.min(KEY_BYTES))
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_separate_tenants_and_models() {
        let cfg = kvstack_spec::builtin::default_config().unwrap();
        let m = ModelFingerprint::new(&cfg, 256);
        let m2 = ModelFingerprint::new(&cfg, 128);
        assert_ne!(m.with_weights(b"seed 1"), m.with_weights(b"seed 2"));
        assert_ne!(m.with_weights(b"seed 1"), m);
        assert_eq!(m.with_weights(b""), m);
        assert_ne!(m, m2);
        let a = Tenant::new("a");
        let b = Tenant::new("b");
        let t: Vec<u32> = (0..600).collect();
        let ka = chain_keys(&t, 256, &m, &a);
        assert_eq!(ka.len(), 3);
        // Shared prefix, shared keys.
        assert_eq!(chain_keys(&t[..512], 256, &m, &a), ka[..2]);
        // Other tenant or model: no key in common.
        let kb = chain_keys(&t, 256, &m, &b);
        let km = chain_keys(&t, 256, &m2, &a);
        for k in &ka {
            assert!(!kb.contains(k) && !km.contains(k));
        }
        // A partial block differs from the full one with the same first tokens.
        assert_ne!(chain_keys(&t[..300], 256, &m, &a)[1], ka[1]);
    }
}
