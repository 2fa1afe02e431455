//! Process-wide counters of the work the kernels did: what `kvstack bench runtime` holds a
//! step's time against (multiply-adds at the FMA or 8-bit peak, bytes at the read stream).
//!
//! Every counted entry point adds its work once per call (relaxed atomics), never per element,
//! so counting costs nothing measurable. The counts are the work a call must do at least:
//!
//! - linear products ([`crate::linear::PackedLinear`]): `m · n · k` multiply-adds and each
//!   weight panel's bytes once per product (what it must read at least: a product of more
//!   than 4 rows reads them again per group of rows, mostly from cache);
//! - sparse attention ([`crate::csa2::attention::SparseAttention::run`],
//!   [`crate::attn::sparse_attention_decode`]): per query and key, `heads · head_dim`
//!   multiply-adds for the logits and as many for `P · V` (spec §4 core attention), and the key
//!   row's stored bytes when the call reads it quantized (a row decoded earlier, as prefill
//!   shares them, counts its bytes where it was decoded: [`add_attention_bytes`]);
//! - the indexer scan ([`crate::attn::indexer_scores`], [`crate::attn::indexer_scores_at`] and
//!   callers of [`add_index`]): per query and scored key, `heads · dim` 8-bit multiply-adds and
//!   the key's stored bytes.
//!
//! Norms, rotations, hyper-connections, the router and softmax exponentials are not counted:
//! they are a few percent of a step's arithmetic, so limits computed from these counts are
//! slightly optimistic (the ratios to them slightly pessimistic).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Linear multiply-adds, weight bytes, attention multiply-adds, attention key bytes, index
/// multiply-adds, index key bytes.
static COUNTERS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

/// A snapshot of the counters (or, from [`Work::since`], the work between two snapshots).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Work {
    /// f32 multiply-adds of linear products.
    pub linear_macs: u64,
    /// Weight bytes linear products read (each product's weights once).
    pub weight_bytes: u64,
    /// f32 multiply-adds of the sparse attention (logits and `P · V`).
    pub attention_macs: u64,
    /// Stored bytes of the cache rows (window FP8, compressed FP4) the attention read.
    pub attention_bytes: u64,
    /// 8-bit multiply-adds of the indexer scans.
    pub index_macs: u64,
    /// Stored bytes of the index keys the scans read.
    pub index_bytes: u64,
}

impl Work {
    /// The counts since the process started.
    pub fn now() -> Work {
        let c = |i: usize| COUNTERS[i].load(Relaxed);
        Work {
            linear_macs: c(0),
            weight_bytes: c(1),
            attention_macs: c(2),
            attention_bytes: c(3),
            index_macs: c(4),
            index_bytes: c(5),
        }
    }

    /// The work done between `earlier` and `self` (both from [`Work::now`]).
    pub fn since(&self, earlier: &Work) -> Work {
        Work {
            linear_macs: self.linear_macs.wrapping_sub(earlier.linear_macs),
            weight_bytes: self.weight_bytes.wrapping_sub(earlier.weight_bytes),
            attention_macs: self.attention_macs.wrapping_sub(earlier.attention_macs),
            attention_bytes: self.attention_bytes.wrapping_sub(earlier.attention_bytes),
            index_macs: self.index_macs.wrapping_sub(earlier.index_macs),
            index_bytes: self.index_bytes.wrapping_sub(earlier.index_bytes),
        }
    }

    /// f32 FLOPs (2 per multiply-add): linears and attention.
    pub fn f32_flops(&self) -> f64 {
        2.0 * (self.linear_macs + self.attention_macs) as f64
    }

    /// Bytes read from memory at least: weights and cache rows (attention and index keys).
    pub fn bytes(&self) -> f64 {
        (self.weight_bytes + self.attention_bytes + self.index_bytes) as f64
    }
}

pub(crate) fn add_linear(macs: u64, bytes: u64) {
    COUNTERS[0].fetch_add(macs, Relaxed);
    COUNTERS[1].fetch_add(bytes, Relaxed);
}

pub(crate) fn add_attention(macs: u64, bytes: u64) {
    COUNTERS[2].fetch_add(macs, Relaxed);
    COUNTERS[3].fetch_add(bytes, Relaxed);
}

/// Counts `bytes` of cache rows read for the attention outside its kernels (rows decoded
/// once and shared by a step's queries).
pub fn add_attention_bytes(bytes: u64) {
    COUNTERS[3].fetch_add(bytes, Relaxed);
}

/// Counts an indexer scan done outside [`crate::attn`]'s entry points: `keys` keys scored by
/// `heads` heads of `dim`, reading `key_bytes` bytes per key.
pub fn add_index(keys: u64, heads: u64, dim: u64, key_bytes: u64) {
    COUNTERS[4].fetch_add(keys * heads * dim, Relaxed);
    COUNTERS[5].fetch_add(keys * key_bytes, Relaxed);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn snapshots_subtract_to_the_work_between_them() {
        let a = Work::now();
        add_linear(10, 20);
        add_attention(30, 40);
        add_index(2, 3, 4, 5);
        let w = Work::now().since(&a);
        // Other tests of this binary may count at the same time: at least ours.
        assert!(w.linear_macs >= 10 && w.weight_bytes >= 20);
        assert!(w.attention_macs >= 30 && w.attention_bytes >= 40);
        assert!(w.index_macs >= 24 && w.index_bytes >= 10);
        assert!(w.f32_flops() >= 80.0 && w.bytes() >= 70.0);
    }
}
