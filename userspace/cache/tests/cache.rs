//! Paged KV cache: accounting against `kvstack calc`, block tables, fork/COW, the prefix index,
//! errors, and a property test of random append/fork/truncate/drop/prefix sequences against a
//! simple model.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeSet, HashMap, HashSet};

use kvstack_cache::Error;
use kvstack_cache::{AppendData, CacheOptions, KvCache, PoolKind, SequenceId};
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use kvstack_spec::builtin::default_config;
use kvstack_spec::{CacheReport, FormatOverrides};
use proptest::prelude::*;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

const MEM: PinnedOptions = PinnedOptions {
    huge_pages: HugePages::Never,
    locking: Locking::Never,
};

fn cache(opts: CacheOptions) -> KvCache {
    KvCache::for_config(
        &default_config().unwrap(),
        CacheOptions {
            memory: MEM,
            ..opts
        },
    )
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Deterministic contents: every entry is a function of the token prefix it summarises, so two
// sequences with the same prefix must read the same bytes, and any write that leaks from one
// sequence into another shows up as a mismatch.

fn mix(h: u64, x: u64) -> u64 {
    let mut z = h ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `h[t]` summarises `tokens[..t]`.
fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = vec![0x1234_5678];
    for &t in tokens {
        let last = *h.last().unwrap();
        h.push(mix(last, u64::from(t)));
    }
    h
}

fn fill(seed: u64, out: &mut [u8]) {
    let word = seed.to_le_bytes();
    for (i, b) in out.iter_mut().enumerate() {
        *b = word[i % 8] ^ (i as u8);
    }
}

const GLOBAL: u64 = 0;
const INDEX: u64 = 1;
const WINDOW: u64 = 2;

fn expected_bytes(h: u64, layer: usize, kind: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(mix(h, ((layer as u64) << 8) | kind), &mut v);
    v
}

fn expected_pending(h: u64, layer: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (mix(h, (layer as u64) << 20 | i as u64) % 1000) as f32)
        .collect()
}

/// Owned append data for new tokens `new` of a sequence whose tokens were `old`, with window
/// rows for the last `k` new tokens.
struct Chunk {
    tokens: Vec<u32>,
    global: Vec<Vec<GlobalFp4Entry>>,
    index: Vec<Vec<IndexMxfp4Entry>>,
    window: Vec<WindowFp8Entry>,
    pending: Vec<Vec<f32>>,
}

impl Chunk {
    fn new(cache: &KvCache, old: &[u32], new: &[u32], k: usize) -> Chunk {
        let g = cache.geometry();
        let all: Vec<u32> = old.iter().chain(new).copied().collect();
        let h = prefix_hashes(&all);
        let (t, end) = (old.len() as u64, all.len() as u64);
        let mut c = Chunk {
            tokens: new.to_vec(),
            global: Vec::new(),
            index: Vec::new(),
            window: Vec::new(),
            pending: Vec::new(),
        };
        for s in &g.sources {
            let r = u64::from(s.ratio);
            let mut gl = Vec::new();
            let mut ix = Vec::new();
            for j in t / r..end / r {
                let hj = h[((j + 1) * r) as usize];
                gl.push(
                    GlobalFp4Entry::read_from_bytes(&expected_bytes(hj, s.layer, GLOBAL, 288))
                        .unwrap(),
                );
                ix.push(
                    IndexMxfp4Entry::read_from_bytes(&expected_bytes(hj, s.layer, INDEX, 68))
                        .unwrap(),
                );
            }
            c.global.push(gl);
            c.index.push(ix);
            let n = (end % r) as usize * g.pending_token_floats;
            c.pending
                .push(expected_pending(h[end as usize], s.layer, n));
        }
        for l in 0..g.num_layers {
            for p in end - k as u64..end {
                let bytes = expected_bytes(h[p as usize + 1], l, WINDOW, 528);
                c.window
                    .push(WindowFp8Entry::read_from_bytes(&bytes).unwrap());
            }
        }
        c
    }

    fn data(&self) -> AppendData<'_> {
        AppendData {
            tokens: &self.tokens,
            global: self.global.iter().map(Vec::as_slice).collect(),
            index: self.index.iter().map(Vec::as_slice).collect(),
            window: &self.window,
            pending: self.pending.iter().map(Vec::as_slice).collect(),
        }
    }
}

fn append(cache: &mut KvCache, seq: SequenceId, new: &[u32], k: usize) -> Result<(), Error> {
    let old = cache.tokens(seq)?.to_vec();
    let chunk = Chunk::new(cache, &old, new, k);
    cache.append(seq, &chunk.data())
}

/// Window rows of every layer for positions `[first, len)` of a sequence with these tokens.
fn window_rows(cache: &KvCache, tokens: &[u32], first: u64) -> Vec<WindowFp8Entry> {
    let h = prefix_hashes(tokens);
    let mut rows = Vec::new();
    for l in 0..cache.geometry().num_layers {
        for p in first..tokens.len() as u64 {
            let bytes = expected_bytes(h[p as usize + 1], l, WINDOW, 528);
            rows.push(WindowFp8Entry::read_from_bytes(&bytes).unwrap());
        }
    }
    rows
}

/// What the model knows about a sequence.
#[derive(Clone, Debug, Default)]
struct ModelSeq {
    tokens: Vec<u32>,
    /// Positions whose window rows were written and not forgotten.
    window: BTreeSet<u64>,
    pending_valid: bool,
}

impl ModelSeq {
    fn new() -> Self {
        ModelSeq {
            pending_valid: true,
            ..Default::default()
        }
    }

    fn len(&self) -> u64 {
        self.tokens.len() as u64
    }

    fn appended(&mut self, new: &[u32], k: usize, w: u64) {
        let end = self.len() + new.len() as u64;
        let first = end - k as u64;
        if k < new.len() {
            // A window restart forgets every older row.
            self.window.clear();
        }
        self.window.extend(first..end);
        self.window.retain(|&p| p + w >= end);
        self.tokens.extend_from_slice(new);
        self.pending_valid = true;
    }

    fn truncated(&mut self, to: u64) {
        self.tokens.truncate(to as usize);
        self.window.retain(|&p| p < to);
        self.pending_valid = to.is_multiple_of(2);
    }

    /// The contiguous run of known rows ending at the last token, within the window.
    fn window_range(&self, w: u64) -> std::ops::Range<u64> {
        let end = self.len();
        let mut start = end;
        while start > 0 && start + w > end && self.window.contains(&(start - 1)) {
            start -= 1;
        }
        start..end
    }
}

/// Checks everything `seq` exposes against the model.
fn check_seq(cache: &KvCache, seq: SequenceId, m: &ModelSeq) {
    let g = cache.geometry();
    assert_eq!(cache.tokens(seq).unwrap(), &m.tokens[..], "{seq} tokens");
    assert_eq!(cache.len(seq).unwrap(), m.len());
    let h = prefix_hashes(&m.tokens);
    for s in &g.sources {
        let r = u64::from(s.ratio);
        let n = m.len() / r;
        // Read through the source itself and through a layer that reuses it.
        for layer in [s.layer, s.layer + 1] {
            let gv = cache.global_entries(seq, layer).unwrap();
            let iv = cache.index_keys(seq, layer).unwrap();
            assert_eq!((gv.len(), iv.len()), (n, n), "{seq} layer {layer}");
            let scanned: Vec<&GlobalFp4Entry> = gv.iter().collect();
            assert_eq!(scanned.len() as u64, n);
            for j in 0..n {
                let hj = h[((j + 1) * r) as usize];
                let want = expected_bytes(hj, s.layer, GLOBAL, 288);
                assert_eq!(
                    gv.get(j).unwrap().as_bytes(),
                    &want[..],
                    "{seq} layer {layer} entry {j}"
                );
                assert_eq!(scanned[j as usize].as_bytes(), &want[..]);
                let want = expected_bytes(hj, s.layer, INDEX, 68);
                assert_eq!(
                    iv.get(j).unwrap().as_bytes(),
                    &want[..],
                    "{seq} layer {layer} key {j}"
                );
            }
            assert!(gv.get(n).is_none());
        }
        if r > 1 {
            let want = m.pending_valid.then(|| {
                expected_pending(
                    h[m.tokens.len()],
                    s.layer,
                    (m.len() % r) as usize * g.pending_token_floats,
                )
            });
            assert_eq!(
                cache.pending(seq, s.layer).unwrap().map(<[f32]>::to_vec),
                want,
                "{seq} pending"
            );
        }
    }
    let w = g.window_tokens as u64;
    for layer in [0, 2, 20, g.num_layers - 1] {
        let view = cache.window(seq, layer).unwrap();
        assert_eq!(
            view.range(),
            m.window_range(w),
            "{seq} window of layer {layer}"
        );
        for (p, row) in view.iter() {
            let want = expected_bytes(h[p as usize + 1], layer, WINDOW, 528);
            assert_eq!(
                row.as_bytes(),
                &want[..],
                "{seq} window layer {layer} pos {p}"
            );
        }
    }
}

/// Every page's reference count equals the references held by block tables and the prefix
/// index.
fn check_refcounts(cache: &KvCache) {
    let counts = cache.page_refcounts();
    let mut want: Vec<Vec<u32>> = counts.iter().map(|c| vec![0; c.len()]).collect();
    let seqs: Vec<SequenceId> = cache.sequences().collect();
    for s in seqs {
        for (p, table) in cache.block_tables(s).unwrap().iter().enumerate() {
            for &id in *table {
                want[p][id as usize] += 1;
            }
        }
    }
    for row in cache.prefix_pages() {
        for (p, &id) in row.iter().enumerate() {
            want[p][id as usize] += 1;
        }
    }
    assert_eq!(counts, want, "reference counts");
}

fn all_pages_free(cache: &KvCache) -> bool {
    let u = cache.usage();
    u.global.pages_in_use == 0 && u.index.pages_in_use == 0 && u.window.pages_in_use == 0
}

// ---------------------------------------------------------------------------------------------

#[test]
fn the_cache_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<KvCache>();
}

#[test]
fn accounting_equals_the_cache_arithmetic() {
    let cfg = default_config().unwrap();
    let report = CacheReport::compute(&cfg, &FormatOverrides::default()).unwrap();
    let mut c = cache(CacheOptions {
        context_limit: 1 << 16,
        max_sequences: 1,
        ..Default::default()
    });
    let seq = c.create_sequence().unwrap();
    let t_total = 30_002u64;
    let chunk = 1000u64;
    let mut t = 0;
    while t < t_total {
        let n = chunk.min(t_total - t);
        let shape = c.append_shape(seq, n).unwrap();
        let tokens: Vec<u32> = (t..t + n).map(|i| i as u32).collect();
        let global: Vec<Vec<GlobalFp4Entry>> = shape
            .entries
            .iter()
            .map(|&e| vec![GlobalFp4Entry::new_zeroed(); e as usize])
            .collect();
        let index: Vec<Vec<IndexMxfp4Entry>> = shape
            .entries
            .iter()
            .map(|&e| vec![IndexMxfp4Entry::new_zeroed(); e as usize])
            .collect();
        let pending: Vec<Vec<f32>> = shape
            .pending_tokens
            .iter()
            .map(|&p| vec![0.5; (p * shape.pending_token_floats) as usize])
            .collect();
        let k = (t + n).saturating_sub(t.max(t_total - 128));
        let window = vec![WindowFp8Entry::new_zeroed(); (k * shape.layers) as usize];
        let data = AppendData {
            tokens: &tokens,
            global: global.iter().map(Vec::as_slice).collect(),
            index: index.iter().map(Vec::as_slice).collect(),
            window: &window,
            pending: pending.iter().map(Vec::as_slice).collect(),
        };
        c.append(seq, &data).unwrap();
        t += n;
    }
    let u = c.usage();
    // In-use entries: exactly the arithmetic (890 B per token for an even length).
    let entries = u.persistent_entry_bytes();
    assert_eq!(entries, report.bytes_at_context(t_total));
    assert_eq!(
        entries as f64 / t_total as f64,
        report.persistent_bytes_per_token
    );
    assert_eq!(report.persistent_bytes_per_token, 890.0);
    // Allocated: at most the partial last page of each pool plus OS-page rounding more.
    let slack: u64 = u
        .pools
        .iter()
        .filter(|p| p.pool.kind != PoolKind::Window)
        .map(|p| p.page_bytes + 4096)
        .sum();
    assert!(u.persistent_allocated_bytes() >= entries);
    assert!(u.persistent_allocated_bytes() - entries <= slack, "{u:?}");
    // Per-sequence constant.
    assert_eq!(u.window.allocated_bytes, report.window_bytes);
    assert_eq!(u.window.allocated_bytes, 40 * 128 * 528);
    assert_eq!(
        u.window.entry_bytes, report.window_bytes,
        "the window is full"
    );
    assert_eq!(u.pending.allocated_bytes, report.pending_state_bytes);
    let su = c.sequence_usage(seq).unwrap();
    assert_eq!(su.per_sequence_bytes(), report.per_sequence_bytes);
    assert_eq!(su.global_entry_bytes + su.index_entry_bytes, entries);
    // Every full page is also held by the prefix index; the 8 partial tail pages are not.
    assert_eq!(su.shared_pages, su.pages - 8);
    // t_total is even: no pending token in use.
    assert_eq!(u.pending.in_use_bytes, 0);
    // The prefix index holds every complete block.
    assert_eq!(u.prefix_blocks, t_total / 256);
    assert!(u.metadata.total() > 0);
    drop(c);
}

#[test]
fn errors_name_what_and_where() {
    let mut c = cache(CacheOptions {
        context_limit: 100,
        max_sequences: 2,
        page_tokens: 4,
        ..Default::default()
    });
    let s = c.create_sequence().unwrap();
    let ghost = SequenceId(99);
    assert!(matches!(c.len(ghost), Err(Error::UnknownSequence { seq }) if seq == ghost));
    assert!(matches!(
        append(&mut c, ghost, &[1], 1),
        Err(Error::UnknownSequence { .. })
    ));
    assert!(matches!(
        c.drop_sequence(ghost),
        Err(Error::UnknownSequence { .. })
    ));
    append(&mut c, s, &[1; 90], 10).unwrap();
    let err = append(&mut c, s, &[1; 11], 1).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ContextLimit {
                len: 90,
                appended: 11,
                limit: 100,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(c.len(s).unwrap(), 90, "a failed append changes nothing");
    assert!(matches!(
        c.global_entries(s, 0),
        Err(Error::NoCompressedKv { layer: 0 })
    ));
    assert!(matches!(
        c.window(s, 40),
        Err(Error::UnknownLayer {
            layer: 40,
            layers: 40
        })
    ));
    assert!(matches!(
        c.pending(s, 20),
        Err(Error::NoPendingState { layer: 20 })
    ));
    assert!(matches!(
        c.truncate(s, 91),
        Err(Error::TruncateBeyondEnd {
            len: 90,
            to: 91,
            ..
        })
    ));

    // Wrong shapes.
    let chunk = Chunk::new(&c, &c.tokens(s).unwrap(), &[1, 2, 3], 1);
    let mut data = chunk.data();
    data.global[3] = &data.global[3][..2];
    let err = c.append(s, &data).unwrap_err();
    assert!(
        err.to_string()
            .contains("global entries of layer 20: expected 3, got 2"),
        "{err}"
    );
    let mut data = chunk.data();
    data.window = &data.window[1..];
    assert!(matches!(c.append(s, &data), Err(Error::Shape { .. })));
    let mut data = chunk.data();
    data.pending.pop();
    assert!(matches!(c.append(s, &data), Err(Error::Shape { .. })));
    c.append(s, &chunk.data()).unwrap();

    c.create_sequence().unwrap();
    assert!(matches!(
        c.fork(s),
        Err(Error::TooManySequences { limit: 2 })
    ));

    // A page that is not a whole number of entries.
    let err = KvCache::for_config(
        &default_config().unwrap(),
        CacheOptions {
            page_tokens: 63,
            memory: MEM,
            ..Default::default()
        },
    )
    .unwrap_err();
    let Error::PageSize {
        pool,
        page_bytes,
        entry_bytes,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (pool.kind, pool.layer, *page_bytes, *entry_bytes),
        (PoolKind::Global, Some(2), 9072, 288)
    );
    assert!(
        err.to_string().contains("global-entry pool of layer 2"),
        "{err}"
    );
}

#[test]
fn pool_exhaustion_reports_the_numbers_and_evicts_cached_blocks_first() {
    // Room for 16 tokens per pool: 4 pages of 4 tokens.
    let mut c = cache(CacheOptions {
        context_limit: 64,
        page_tokens: 4,
        max_sequences: 4,
        pool_tokens: Some(16),
        ..Default::default()
    });
    let a = c.create_sequence().unwrap();
    append(&mut c, a, &[7; 16], 4).unwrap();
    assert_eq!(c.usage().prefix_blocks, 4);
    // A full pool while `a` lives: nothing evictable (a pins its chain).
    let b = c.create_sequence().unwrap();
    let err = append(&mut c, b, &[8; 2], 2).unwrap_err();
    assert!(
        matches!(
            err,
            Error::PoolExhausted {
                requested: 1,
                in_use: 4,
                capacity: 4,
                free: 0,
                page_bytes: 576,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("global-entry pool of layer 2 exhausted"),
        "{err}"
    );
    assert_eq!(c.len(b).unwrap(), 0);
    check_refcounts(&c);
    // Once `a` is gone its blocks stay cached; a new sequence evicts them, oldest first.
    c.drop_sequence(a).unwrap();
    assert_eq!(c.lookup_prefix(&[7; 16]), 16);
    append(&mut c, b, &[8; 6], 4).unwrap();
    // Two pages per pool were needed: the two deepest blocks (the leaves) went first.
    assert_eq!(c.lookup_prefix(&[7; 16]), 8);
    assert_eq!(
        c.usage().prefix_blocks,
        3,
        "two of a's blocks and b's first block"
    );
    check_refcounts(&c);
}

#[test]
fn fork_shares_pages_and_copies_the_tail_on_divergence() {
    let mut c = cache(CacheOptions {
        context_limit: 512,
        page_tokens: 8,
        max_sequences: 4,
        ..Default::default()
    });
    let a = c.create_sequence().unwrap();
    let mut ma = ModelSeq::new();
    let toks: Vec<u32> = (0..21).collect();
    append(&mut c, a, &toks, 21).unwrap();
    ma.appended(&toks, 21, 128);
    let b = c.fork(a).unwrap();
    let mut mb = ma.clone();
    assert_eq!(c.block_tables(a).unwrap(), c.block_tables(b).unwrap());
    let su = c.sequence_usage(b).unwrap();
    assert_eq!(su.shared_pages, su.pages);
    // Diverge: different tokens after the fork.
    append(&mut c, a, &[100, 101, 102], 3).unwrap();
    ma.appended(&[100, 101, 102], 3, 128);
    append(&mut c, b, &[200, 201], 2).unwrap();
    mb.appended(&[200, 201], 2, 128);
    let (ta, tb) = (c.block_tables(a).unwrap(), c.block_tables(b).unwrap());
    for p in 0..8 {
        // Full pages (two blocks of 8 tokens) still shared, the tail copied.
        assert_eq!(ta[p][..2], tb[p][..2]);
        assert_ne!(ta[p][2], tb[p][2]);
    }
    check_seq(&c, a, &ma);
    check_seq(&c, b, &mb);
    check_refcounts(&c);
    c.drop_sequence(a).unwrap();
    check_seq(&c, b, &mb);
    c.drop_sequence(b).unwrap();
    assert!(
        !all_pages_free(&c),
        "the prefix index still holds the full blocks"
    );
    // Blocks 0 and 1 (shared) and a's block 2 (tokens 16..24).
    assert_eq!(c.clear_prefix_index(), 3);
    assert!(all_pages_free(&c));
    assert!(c.trim().unwrap() > 0);
    assert_eq!(c.usage().global.allocated_bytes, 0);
}

#[test]
fn a_cached_prefix_maps_the_same_pages_and_the_window_is_rebuilt() {
    let mut c = cache(CacheOptions {
        context_limit: 4096,
        page_tokens: 256,
        max_sequences: 4,
        ..Default::default()
    });
    let prompt: Vec<u32> = (0..1000).map(|i| (i * 7 % 331) as u32).collect();
    let a = c.create_sequence().unwrap();
    append(&mut c, a, &prompt[..700], 128).unwrap();
    assert_eq!(c.lookup_prefix(&prompt), 512);
    // Leave at least one token to compute: at most 600 tokens from the cache.
    let hit = c.create_sequence_with_prefix(&prompt, 600).unwrap();
    assert_eq!(hit.tokens, 512);
    let b = hit.seq;
    let (ta, tb) = (c.block_tables(a).unwrap(), c.block_tables(b).unwrap());
    for p in 0..8 {
        assert_eq!(ta[p][..2], tb[p][..]);
    }
    assert!(c.window(b, 5).unwrap().is_empty());
    assert_eq!(c.pending(b, 2).unwrap(), Some(&[][..]));
    // Bounded replay: window rows of the last 128 cached tokens, then the suffix.
    let rows = window_rows(&c, &prompt[..512], 512 - 128);
    c.write_window(b, 384, &rows).unwrap();
    let err = c
        .write_window(b, 300, &window_rows(&c, &prompt[..512], 300))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::WindowRange {
                first: 300,
                len: 512,
                oldest: 384,
                ..
            }
        ),
        "{err}"
    );
    append(&mut c, b, &prompt[512..], 128).unwrap();
    let mut mb = ModelSeq::new();
    mb.appended(&prompt, 128, 128);
    check_seq(&c, b, &mb);
    c.drop_sequence(a).unwrap();
    check_seq(&c, b, &mb);
    check_refcounts(&c);
    // 1000 tokens = 3 blocks now cached.
    assert_eq!(c.usage().prefix_blocks, 3);
    c.drop_sequence(b).unwrap();
    c.clear_prefix_index();
    assert!(all_pages_free(&c));
}

#[test]
fn truncate_releases_pages_and_invalidates_a_split_group() {
    let mut c = cache(CacheOptions {
        context_limit: 512,
        page_tokens: 8,
        max_sequences: 2,
        prefix_index: false,
        ..Default::default()
    });
    let s = c.create_sequence().unwrap();
    let toks: Vec<u32> = (0..40).collect();
    append(&mut c, s, &toks, 40).unwrap();
    let mut m = ModelSeq::new();
    m.appended(&toks, 40, 128);
    c.truncate(s, 17).unwrap();
    m.truncated(17);
    assert_eq!(
        c.pending(s, 2).unwrap(),
        None,
        "token 16 opened a group that is gone"
    );
    check_seq(&c, s, &m);
    let h = prefix_hashes(&m.tokens);
    let pend = expected_pending(h[17], 8, 1024);
    assert!(matches!(
        c.set_pending(s, 8, &pend[..10]),
        Err(Error::Shape { expected: 1024, .. })
    ));
    for layer in [2, 8, 14] {
        c.set_pending(s, layer, &expected_pending(h[17], layer, 1024))
            .unwrap();
    }
    m.pending_valid = true;
    check_seq(&c, s, &m);
    // 17 tokens: 3 pages of ratio-1 pools (8 entries each), 2 of ratio-2 pools (4 entries).
    let tables = c.block_tables(s).unwrap();
    assert_eq!(
        tables.iter().map(|t| t.len()).collect::<Vec<_>>(),
        [2, 2, 2, 2, 2, 2, 3, 3]
    );
    append(&mut c, s, &[5, 6, 7], 1).unwrap();
    m.appended(&[5, 6, 7], 1, 128);
    check_seq(&c, s, &m);
    c.drop_sequence(s).unwrap();
    assert!(all_pages_free(&c));
}

#[test]
fn the_window_ring_wraps() {
    let mut c = cache(CacheOptions {
        context_limit: 1024,
        page_tokens: 16,
        max_sequences: 1,
        ..Default::default()
    });
    let s = c.create_sequence().unwrap();
    let mut m = ModelSeq::new();
    for (n, k) in [(100, 100), (50, 50), (1, 1), (200, 20), (3, 3)] {
        let new: Vec<u32> = (0..n).map(|i| (m.len() + i) as u32 % 97).collect();
        append(&mut c, s, &new, k as usize).unwrap();
        m.appended(&new, k as usize, 128);
        check_seq(&c, s, &m);
    }
    assert_eq!(c.window(s, 0).unwrap().range(), 331..354);
    // Truncation keeps the rows still in the ring: not those overwritten by later positions.
    for _ in 0..2 {
        let new: Vec<u32> = (0..100).collect();
        append(&mut c, s, &new, 100).unwrap();
        m.appended(&new, 100, 128);
    }
    c.truncate(s, 500).unwrap();
    m.truncated(500);
    m.pending_valid = true;
    check_seq(&c, s, &m);
    assert_eq!(c.window(s, 3).unwrap().range(), 426..500);
}

// ---------------------------------------------------------------------------------------------
// Property test.

#[derive(Clone, Debug)]
enum Op {
    Create,
    /// Start from a cached prefix of sequence `from`'s tokens cut at `cut`, plus `suffix`.
    FromPrefix {
        from: usize,
        cut: usize,
        suffix: Vec<u32>,
    },
    Append {
        seq: usize,
        tokens: Vec<u32>,
        window: usize,
    },
    Fork {
        seq: usize,
    },
    Truncate {
        seq: usize,
        to: usize,
    },
    Drop {
        seq: usize,
    },
    Rebuild {
        seq: usize,
        back: usize,
    },
    ClearIndex,
}

fn op() -> impl Strategy<Value = Op> {
    // Tokens from a tiny alphabet so that different sequences often compute equal blocks.
    let toks = |max| prop::collection::vec(0u32..3, 1..max);
    prop_oneof![
        1 => Just(Op::Create),
        2 => (any::<usize>(), any::<usize>(), toks(10)).prop_map(|(from, cut, suffix)| Op::FromPrefix { from, cut, suffix }),
        8 => (any::<usize>(), toks(60), any::<usize>()).prop_map(|(seq, tokens, window)| Op::Append { seq, tokens, window }),
        2 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(seq, to)| Op::Truncate { seq, to }),
        1 => any::<usize>().prop_map(|seq| Op::Drop { seq }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(seq, back)| Op::Rebuild { seq, back }),
        1 => Just(Op::ClearIndex),
    ]
}

const PAGE: usize = 4;
const LIMIT: usize = 300;
const W: u64 = 128;

struct Harness {
    cache: KvCache,
    live: Vec<(SequenceId, ModelSeq)>,
    /// Token prefixes (multiples of PAGE) the prefix index holds.
    cached: HashSet<Vec<u32>>,
}

impl Harness {
    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn published(&mut self, tokens: &[u32]) {
        for k in 1..=tokens.len() / PAGE {
            self.cached.insert(tokens[..k * PAGE].to_vec());
        }
    }

    fn run(&mut self, op: &Op) {
        match op {
            Op::Create => {
                if self.live.len() < 6 {
                    let s = self.cache.create_sequence().unwrap();
                    self.live.push((s, ModelSeq::new()));
                }
            }
            Op::FromPrefix { from, cut, suffix } => {
                let Some(i) = self.pick(*from) else { return };
                if self.live.len() >= 6 {
                    return;
                }
                let src = &self.live[i].1.tokens;
                let mut tokens = src[..cut % (src.len() + 1)].to_vec();
                tokens.extend(suffix);
                tokens.truncate(LIMIT);
                let expected = (1..=tokens.len() / PAGE)
                    .rev()
                    .find(|&k| self.cached.contains(&tokens[..k * PAGE]))
                    .map_or(0, |k| k * PAGE);
                assert_eq!(self.cache.lookup_prefix(&tokens), expected as u64);
                let hit = self
                    .cache
                    .create_sequence_with_prefix(&tokens, u64::MAX)
                    .unwrap();
                assert_eq!(hit.tokens, expected as u64);
                let mut m = ModelSeq::new();
                m.tokens = tokens[..expected].to_vec();
                check_seq(&self.cache, hit.seq, &m);
                let rest = &tokens[expected..];
                if !rest.is_empty() {
                    append(&mut self.cache, hit.seq, rest, rest.len().min(128)).unwrap();
                    m.appended(rest, rest.len().min(128), W);
                }
                self.published(&tokens);
                self.live.push((hit.seq, m));
            }
            Op::Append {
                seq,
                tokens,
                window,
            } => {
                let Some(i) = self.pick(*seq) else { return };
                let (s, m) = &mut self.live[i];
                // Mostly full windows (so sequences outgrow the ring), sometimes a restart.
                let k = if window % 3 == 0 {
                    window % (tokens.len() + 1)
                } else {
                    tokens.len()
                };
                let r = append(&mut self.cache, *s, tokens, k);
                if m.tokens.len() + tokens.len() > LIMIT {
                    assert!(matches!(r, Err(Error::ContextLimit { .. })), "{r:?}");
                    return;
                }
                r.unwrap();
                m.appended(tokens, k, W);
                let all = m.tokens.clone();
                self.published(&all);
            }
            Op::Fork { seq } => {
                let Some(i) = self.pick(*seq) else { return };
                if self.live.len() < 6 {
                    let s = self.cache.fork(self.live[i].0).unwrap();
                    let m = self.live[i].1.clone();
                    self.live.push((s, m));
                }
            }
            Op::Truncate { seq, to } => {
                let Some(i) = self.pick(*seq) else { return };
                let (s, m) = &mut self.live[i];
                let to = (to % (m.tokens.len() + 1)) as u64;
                self.cache.truncate(*s, to).unwrap();
                m.truncated(to);
                if !m.pending_valid {
                    let h = prefix_hashes(&m.tokens);
                    for layer in [2, 8, 14] {
                        let v = expected_pending(h[m.tokens.len()], layer, 1024);
                        self.cache.set_pending(*s, layer, &v).unwrap();
                    }
                    m.pending_valid = true;
                }
            }
            Op::Drop { seq } => {
                let Some(i) = self.pick(*seq) else { return };
                let (s, _) = self.live.swap_remove(i);
                self.cache.drop_sequence(s).unwrap();
            }
            Op::Rebuild { seq, back } => {
                let Some(i) = self.pick(*seq) else { return };
                let (s, m) = &mut self.live[i];
                let back = (*back as u64) % (m.len().min(W) + 1);
                let first = m.len() - back;
                let rows = window_rows(&self.cache, &m.tokens, first);
                self.cache.write_window(*s, first, &rows).unwrap();
                m.window.extend(first..m.len());
            }
            Op::ClearIndex => {
                self.cache.clear_prefix_index();
                // Blocks pinned by live sequences (their chains) stay.
                self.cached.clear();
                let chains: Vec<Vec<u32>> =
                    self.live.iter().map(|(_, m)| m.tokens.clone()).collect();
                for t in chains {
                    self.published(&t);
                }
            }
        }
    }

    fn check(&self) {
        for (s, m) in &self.live {
            check_seq(&self.cache, *s, m);
        }
        check_refcounts(&self.cache);
        assert_eq!(self.cache.usage().prefix_blocks as usize, self.cached.len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_sequence_intact(ops in prop::collection::vec(op(), 1..60)) {
        let cache = cache(CacheOptions {
            context_limit: LIMIT as u64,
            page_tokens: PAGE as u32,
            max_sequences: 6,
            // No pressure: nothing is evicted behind the model's back.
            pool_tokens: Some(1 << 14),
            ..Default::default()
        });
        let mut h = Harness { cache, live: Vec::new(), cached: HashSet::new() };
        for op in &ops {
            h.run(op);
            h.check();
        }
        let ids: Vec<SequenceId> = h.live.drain(..).map(|(s, _)| s).collect();
        for s in ids {
            h.cache.drop_sequence(s).unwrap();
        }
        h.cache.clear_prefix_index();
        prop_assert!(all_pages_free(&h.cache), "{:?}", h.cache.usage());
        prop_assert!(h.cache.page_refcounts().iter().flatten().all(|&r| r == 0));
    }
}

#[test]
fn independent_sequences_with_equal_prompts_share_the_index_chain() {
    let mut c = cache(CacheOptions {
        context_limit: 64,
        page_tokens: 4,
        max_sequences: 3,
        ..Default::default()
    });
    let a = c.create_sequence().unwrap();
    let b = c.create_sequence().unwrap();
    append(&mut c, a, &[1, 2, 3, 4, 5, 6, 7, 8], 8).unwrap();
    append(&mut c, b, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 9).unwrap();
    // b computed the same two blocks itself: the index keeps a's pages, b keeps its own.
    assert_eq!(c.usage().prefix_blocks, 2);
    check_refcounts(&c);
    let mut seen = HashMap::new();
    for s in [a, b] {
        seen.insert(s, c.block_tables(s).unwrap()[0].to_vec());
    }
    assert_ne!(seen[&a], seen[&b]);
}
