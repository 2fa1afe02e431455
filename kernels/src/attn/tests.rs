//! Fast kernels against the scalar references of [`super::reference`].

use kvstack_firmware_interface::{EntryFormat, GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zerocopy::{FromZeros, IntoBytes};

use super::reference::*;
use super::*;
use crate::available_levels;

/// Roughly normal values (sum of four uniforms), times `scale`.
fn normal(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (0..4).map(|_| r.random::<f32>() - 0.5).sum::<f32>() * scale)
        .collect()
}

fn quantize_rows<E: zerocopy::FromBytes + IntoBytes + Clone>(
    format: EntryFormat,
    x: &[f32],
) -> Vec<E> {
    let n = x.len() / format.dim();
    let mut v = vec![E::new_zeroed(); n];
    crate::quantize(format, x, v.as_mut_bytes()).unwrap();
    v
}

fn index_query(r: &mut StdRng) -> IndexQuery {
    let q = normal(r, INDEX_HEADS * INDEX_DIM, 2.0);
    let w: [f32; 32] = std::array::from_fn(|_| r.random::<f32>() - 0.3);
    IndexQuery::from_f32(&q, &w).unwrap()
}

fn keys(r: &mut StdRng, n: usize) -> Vec<IndexMxfp4Entry> {
    // Per-key magnitudes vary by a factor 4, like RMS-normed keys with RoPE.
    let mut x = Vec::with_capacity(n * INDEX_DIM);
    for _ in 0..n {
        let s = 0.5 + 1.5 * r.random::<f32>();
        x.extend(normal(r, INDEX_DIM, s));
    }
    quantize_rows(EntryFormat::IndexMxfp4, &x)
}

#[test]
fn indexer_scan_is_bit_identical_to_the_reference() {
    let mut r = StdRng::seed_from_u64(7);
    let q = index_query(&mut r);
    assert!(q.has_fast_path());
    let n = 3001;
    let ks = keys(&mut r, n);
    let visible = 2990;
    let want = indexer_scores_ref(q.heads(), q.weights(), &ks, visible);
    // Pages of 64 (the last partial), and one contiguous run.
    let pages: Vec<&[IndexMxfp4Entry]> = ks.chunks(64).collect();
    let paged = Paged::pages(&pages, 64).unwrap();
    for level in available_levels() {
        for threads in [1, 2, 3] {
            for keys in [paged, Paged::contiguous(&ks)] {
                let mut got = vec![0f32; n];
                indexer_scores_with(level, &q, keys, visible, threads, &mut got).unwrap();
                for (s, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{level} t{threads} s{s}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// Asserts that every integer kernel this CPU can run takes every whole tile of `ks` (none
/// falls back to the exact path), so that the bit-identity checks exercise the kernels; the
/// fused VNNI kernel must take them too when `fused` (and decline them otherwise).
#[cfg(target_arch = "x86_64")]
fn assert_kernels_take(q: &IndexQuery, ks: &[IndexMxfp4Entry], what: &str, fused: bool) {
    let scales = |t: &[IndexMxfp4Entry]| t.iter().map(|k| k.scales).collect::<Vec<_>>();
    if crate::SimdLevel::Avx2.is_available() {
        for t in ks.as_chunks::<8>().0 {
            // SAFETY: AVX2 and FMA were detected above.
            let ok = unsafe { super::index::tile_accepted(q, &t.each_ref()) };
            assert!(
                ok,
                "{what}: the AVX2 kernel declined scales {:?}",
                scales(t)
            );
        }
    }
    let avx512 = crate::level::Verified::new(crate::SimdLevel::Avx512);
    if let Some(v) = avx512.ok().and_then(crate::level::Vnni::detect) {
        for t in ks.as_chunks::<16>().0 {
            // SAFETY: the `Vnni` token means AVX-512 F/BW/VL and VNNI.
            let ok = unsafe { super::index::tile16_accepted(q, &t.each_ref()) };
            assert!(
                ok,
                "{what}: the VNNI kernel declined scales {:?}",
                scales(t)
            );
            // SAFETY: as above.
            let took = unsafe { super::index::tile16_fused_accepted(v, q, &t.each_ref()) };
            assert!(
                took.is_none_or(|t| t == fused),
                "{what}: the fused VNNI kernel {} scales {:?}",
                if fused { "declined" } else { "took" },
                scales(t)
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn realistic_keys_take_the_integer_kernels() {
    let mut r = StdRng::seed_from_u64(15);
    for i in 0..4 {
        let q = index_query(&mut r);
        let ks = keys(&mut r, 800);
        assert_kernels_take(&q, &ks, &format!("query {i}"), true);
    }
}

/// An MXFP4 row of the largest products: every element +6, or -6 in the bytes `i` where
/// `neg(i)` (bytes `0x77` and `0xFF`: E2M1 code 7 or 15 in both nibbles).
fn six_row(neg: impl Fn(usize) -> bool, scales: [u8; 4]) -> IndexMxfp4Entry {
    let mut e = IndexMxfp4Entry::new_zeroed();
    for (i, v) in e.values.iter_mut().enumerate() {
        *v = if neg(i) { 0xFF } else { 0x77 };
    }
    e.scales = scales;
    e
}

/// Asserts that every level scores `ks` with the reference's bits.
fn assert_reference_bits(q: &IndexQuery, ks: &[IndexMxfp4Entry], what: &str) {
    let want = indexer_scores_ref(q.heads(), q.weights(), ks, ks.len());
    for level in available_levels() {
        let mut got = vec![0f32; ks.len()];
        indexer_scores_with(level, q, Paged::contiguous(ks), ks.len(), 1, &mut got).unwrap();
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{level} {what} s{s}: {g} vs {w}");
        }
    }
}

#[test]
fn indexer_fast_path_is_exact_at_its_limits() {
    // The largest products (every element +-6, so |I_b| = 4608) with exponent spreads at the
    // fast path's bound (query 4 + key 6 = 10) and scale bytes near both ends of its window:
    // the integer kernels must still give the reference's bits, and take these tiles.
    let mut r = StdRng::seed_from_u64(17);
    for (qbase, kbase) in [(120u8, 120u8), (3, 127), (237, 3), (60, 200)] {
        let heads: [IndexMxfp4Entry; INDEX_HEADS] = std::array::from_fn(|h| {
            let scales = [qbase, qbase + 4, qbase + (h % 5) as u8, qbase + 1];
            six_row(|i| (h + i / 16) % 5 == 0, scales)
        });
        let w: [f32; INDEX_HEADS] = std::array::from_fn(|_| r.random::<f32>() + 0.1);
        let q = IndexQuery::new(&heads, &w);
        assert!(q.has_fast_path(), "query scales from {qbase}");
        let ks: Vec<IndexMxfp4Entry> = (0..64)
            .map(|k| {
                let s = |d: usize| kbase + ((k + d) % 7) as u8;
                six_row(|i| (k + i) % 7 == 0, [s(0), s(1), s(2), s(3)])
            })
            .collect();
        assert_reference_bits(&q, &ks, &format!("q{qbase} k{kbase}"));
        #[cfg(target_arch = "x86_64")]
        assert_kernels_take(&q, &ks, &format!("q{qbase} k{kbase}"), false);
    }
}

/// Whether the bounds of [`index::FusedLimits`] hold for weights `w`, the heads' smallest
/// scale bytes `eqmin` and a key's smallest scale byte `ekmin` (`None`: any key), checked in
/// f64 from the definitions: for every head with `w != 0`, the smallest and largest possible
/// `|U| = |w| 2^(eqmin - 127) |I|` and `|T| = |U| 2^(ekmin - 129)` (`1 <= |I| < 2^21`, `|w|`
/// rounded out to powers of two) lie in `[2^-126, 2^120]`.
fn fused_bounds_hold(
    w: &[f32; INDEX_HEADS],
    eqmin: &[i32; INDEX_HEADS],
    ekmin: Option<i32>,
) -> bool {
    let inside = |lo: f64, hi: f64| lo >= 2f64.powi(-126) && hi <= 2f64.powi(120);
    w.iter()
        .zip(eqmin)
        .filter(|(w, _)| **w != 0.0)
        .all(|(&w, &eq)| {
            let a = f64::from(w).abs().log2().floor() as i32;
            let u = |e: i32| 2f64.powi(a + eq - 127 + e);
            let k = ekmin.map_or(0, |k| k - 129);
            inside(u(0), u(22)) && inside(u(k), u(22 + k))
        })
}

/// The fused VNNI kernel at the edges of its limits: query heads and keys spanning exactly
/// [`index::FUSED_SPAN`] exponents (and one more), the largest products, weights that put the
/// smallest or largest possible terms on the bounds of [`index::FusedLimits`], and keys whose
/// smallest scale byte sits on each bound and one step outside (the bounds found here from
/// the definitions, [`fused_bounds_hold`]). Every level gives the reference's bits, and the
/// fused kernel takes exactly the tiles inside its limits.
#[test]
fn fused_indexer_kernel_is_exact_at_its_limits() {
    let mut r = StdRng::seed_from_u64(23);
    let cases = [
        (100u8, 3u8, -20i32),
        (100, 3, 60),
        (10, 3, 0),
        (200, 3, -30),
        (40, 3, -90),
        (10, 3, -9),
        (10, 3, -10),
        (200, 3, 25),
        (200, 3, 26),
        (100, 4, 0),
    ];
    for (qbase, qspan, wexp) in cases {
        let heads: [IndexMxfp4Entry; INDEX_HEADS] = std::array::from_fn(|h| {
            let mut sc = [qbase, qbase + qspan, qbase + 1, qbase + 2];
            sc.rotate_left(h % 4);
            six_row(|i| (h + i / 16) % 5 == 0, sc)
        });
        let w: [f32; INDEX_HEADS] = std::array::from_fn(|h| match h % 7 {
            3 => 0.0,
            5 => -(1.0 + r.random::<f32>()) * 2f32.powi(wexp),
            _ => (1.0 + r.random::<f32>()) * 2f32.powi(wexp),
        });
        let eqmin = [i32::from(qbase); INDEX_HEADS];
        let q = IndexQuery::new(&heads, &w);
        let what = format!("q{qbase}+{qspan} w2^{wexp}");
        let Some(fast) = q.prep.fast else {
            panic!("{what}: no fast path");
        };
        // Smallest key scale bytes the bounds allow (and the fast path, for span-3 keys).
        let ok = |k: i32| {
            k >= fast.kmin
                && k + index::FUSED_SPAN <= fast.kmax
                && fused_bounds_hold(&w, &eqmin, Some(k))
        };
        let allowed: Vec<i32> = (1..=254).filter(|&k| ok(k)).collect();
        let query_ok = i32::from(qspan) <= index::FUSED_SPAN
            && fused_bounds_hold(&w, &eqmin, None)
            && !allowed.is_empty();
        assert_eq!(q.prep.fused.is_some(), query_ok, "{what}: fused path");
        let (lo, hi) = match (allowed.first(), allowed.last()) {
            (Some(&lo), Some(&hi)) => (lo, hi),
            _ => (120, 120),
        };
        let mut ks = Vec::new();
        let mut expect = Vec::new();
        for ekmin in [lo - 1, lo, lo + 1, hi - 1, hi, hi + 1] {
            for span in [index::FUSED_SPAN, index::FUSED_SPAN + 1] {
                if ekmin < 1 || ekmin + span > 254 {
                    continue;
                }
                expect.push(query_ok && ok(ekmin) && span <= index::FUSED_SPAN);
                for k in 0..16 {
                    let mut sc = [ekmin, ekmin + span, ekmin + 1, ekmin + 2].map(|x| x as u8);
                    sc.rotate_left(k % 4);
                    ks.push(six_row(|i| (k + i) % 7 == 0, sc));
                }
            }
        }
        assert_reference_bits(&q, &ks, &what);
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = crate::level::Verified::new(crate::SimdLevel::Avx512);
            if let Some(v) = avx512.ok().and_then(crate::level::Vnni::detect) {
                for (t, &e) in ks.as_chunks::<16>().0.iter().zip(&expect) {
                    // SAFETY: the `Vnni` token means AVX-512 F/BW/VL and VNNI.
                    let took = unsafe { super::index::tile16_fused_accepted(v, &q, &t.each_ref()) };
                    assert!(
                        took.is_none_or(|t| t == e),
                        "{what}: fused kernel on scales {:?}: took {took:?}, expected {e}",
                        t[0].scales
                    );
                }
            }
        }
    }
}

#[test]
fn indexer_exotic_scales_take_the_exact_path() {
    let mut r = StdRng::seed_from_u64(8);
    let q = index_query(&mut r);
    let mut ks = keys(&mut r, 200);
    // An all-zero block (tiny scale), a huge block, a NaN scale, and a wide exponent spread.
    for v in &mut ks[3].values[..16] {
        *v = 0;
    }
    ks[3].scales[0] = 1;
    ks[17].scales[2] = 250;
    ks[40].scales[1] = 255;
    ks[77].scales[0] = ks[77].scales[3] - 12;
    let want = indexer_scores_ref(q.heads(), q.weights(), &ks, ks.len());
    for level in available_levels() {
        let mut got = vec![0f32; ks.len()];
        indexer_scores_with(level, &q, Paged::contiguous(&ks), ks.len(), 1, &mut got).unwrap();
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{level} s{s}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn indexer_candidates_match_the_scan() {
    let mut r = StdRng::seed_from_u64(9);
    let q = index_query(&mut r);
    let ks = keys(&mut r, 1000);
    // The fused VNNI kernel takes these keys, so on AVX-512 the gathered scan's tiles go to
    // it with their prefetch lists (the path a Reindex pool takes).
    #[cfg(target_arch = "x86_64")]
    assert_kernels_take(&q, &ks, "candidate keys", true);
    let visible = 990;
    let full = indexer_scores_ref(q.heads(), q.weights(), &ks, visible);
    let mut spread: Vec<i32> = (0..1200).step_by(3).collect();
    spread.push(-1);
    // Pool-like blocks of 8: across a page boundary (96 for pages of 100, 124 for pages of
    // 64), twice the same block, one across the visible end, one ending on it and one a
    // position past it, one broken by a -1, one past the end, one descending, and a block
    // right after another so that their runs join; then a
    // long run across page boundaries and the gathered scan's batches of 64 positions, and one
    // up to the visible end that starts off the 8-alignment.
    let mut blocks: Vec<i32> = Vec::new();
    for start in [96, 0, 96, 984, 500, 1000, 200, 208, 3000, 124, 982, 983] {
        blocks.extend(start..start + 8);
    }
    blocks[4 * 8 + 3] = -1;
    blocks.extend((40..48).rev());
    blocks.extend(150..290);
    blocks.extend(974..1000);
    // Pages of 100 find a position's page by division, pages of 64 by a shift; one run has
    // no pages.
    let pages100: Vec<&[IndexMxfp4Entry]> = ks.chunks(100).collect();
    let pages64: Vec<&[IndexMxfp4Entry]> = ks.chunks(64).collect();
    let layouts = [
        Paged::pages(&pages100, 100).unwrap(),
        Paged::pages(&pages64, 64).unwrap(),
        Paged::contiguous(&ks),
    ];
    let (spread, blocks) = (&spread, &blocks);
    for (level, positions, paged) in available_levels().into_iter().flat_map(|l| {
        layouts
            .iter()
            .flat_map(move |&p| [(l, spread, p), (l, blocks, p)])
    }) {
        for threads in [1, 2] {
            let mut got = vec![0f32; positions.len()];
            let res =
                indexer_scores_at_with(level, &q, paged, visible, positions, threads, &mut got);
            res.unwrap();
            for (&p, g) in positions.iter().zip(&got) {
                let w = usize::try_from(p)
                    .ok()
                    .and_then(|p| full.get(p))
                    .copied()
                    .unwrap_or(f32::NEG_INFINITY);
                assert_eq!(g.to_bits(), w.to_bits(), "{level} position {p}");
            }
        }
    }
}

#[test]
fn indexer_argument_errors() {
    let mut r = StdRng::seed_from_u64(10);
    let q = index_query(&mut r);
    let ks = keys(&mut r, 10);
    let mut out = vec![0f32; 9];
    assert!(matches!(
        indexer_scores(&q, Paged::contiguous(&ks), 10, 1, &mut out),
        Err(AttnError::LengthMismatch { .. })
    ));
    let mut out = vec![0f32; 10];
    assert!(matches!(
        indexer_scores(&q, Paged::contiguous(&ks), 11, 1, &mut out),
        Err(AttnError::PositionOutOfRange { .. })
    ));
    let pages: Vec<&[IndexMxfp4Entry]> = vec![&ks[..3], &ks[3..]];
    assert!(matches!(
        Paged::pages(&pages, 3),
        Err(AttnError::PageLayout { page: 1, .. })
    ));
}

#[test]
fn topk_and_candidates_match_the_references() {
    let mut r = StdRng::seed_from_u64(11);
    for (n, k, visible) in [
        (5000, 512, 5000),
        (20000, 512, 19_993),
        (300, 512, 250),
        (1, 4, 1),
    ] {
        let mut s: Vec<f32> = (0..n).map(|_| r.random::<f32>() * 100.0 - 50.0).collect();
        for v in s.iter_mut().skip(visible) {
            *v = f32::NEG_INFINITY;
        }
        // Some unselectable scores and exact ties.
        if n > 100 {
            s[7] = f32::NAN;
            s[50] = s[60];
        }
        let mut out = vec![0i32; k];
        topk(&s, &mut out).unwrap();
        assert_eq!(out, topk_ref(&s, k), "n {n}");
        for blocks in [1, 64, 2048] {
            let c = candidate_blocks(&s, visible, blocks, 8).unwrap();
            assert_eq!(
                c,
                candidate_blocks_ref(&s, visible, blocks, 8),
                "n {n} blocks {blocks}"
            );
        }
        let positions: Vec<i32> = (0..s.len() as i32).collect();
        let mut out2 = vec![0i32; k];
        topk_positions(&s, &positions, &mut out2).unwrap();
        assert_eq!(out2, out);
    }
}

/// A window of FP8 entries and a global cache of FP4 entries, with random selections.
struct AttnData {
    q: Vec<[f32; HEAD_DIM]>,
    sinks: Vec<f32>,
    window: Vec<WindowFp8Entry>,
    global: Vec<GlobalFp4Entry>,
}

fn attn_data(r: &mut StdRng, heads: usize, nw: usize, ng: usize) -> AttnData {
    let qf = normal(r, heads * HEAD_DIM, 2.0);
    let q = qf
        .chunks_exact(HEAD_DIM)
        .map(|c| <[f32; HEAD_DIM]>::try_from(c).unwrap())
        .collect();
    let sinks = (0..heads).map(|_| r.random::<f32>() * 4.0 - 2.0).collect();
    let window = quantize_rows(EntryFormat::WindowFp8, &normal(r, nw * HEAD_DIM, 1.5));
    let global = quantize_rows(EntryFormat::GlobalFp4, &normal(r, ng * HEAD_DIM, 1.5));
    AttnData {
        q,
        sinks,
        window,
        global,
    }
}

/// Largest `|got - want|` over all outputs, relative to the largest `|want|` of the head.
fn max_rel_err(got: &[[f32; HEAD_DIM]], want: &[[f64; HEAD_DIM]]) -> f64 {
    let mut worst = 0f64;
    for (g, w) in got.iter().zip(want) {
        let scale = w.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
        for (a, b) in g.iter().zip(w) {
            worst = worst.max((f64::from(*a) - b).abs() / scale);
        }
    }
    worst
}

/// Tolerance of the f32 kernels against the f64 reference, relative to the largest output
/// magnitude of a head. Sources: f32 logits over 512 products (relative ~1e-6 of the logit's
/// absolute terms), the exp polynomial (~1e-7) and f32 sums over up to a few thousand rows.
/// Observed errors are around 1e-6; the bound leaves a margin of about 20.
const ATTN_TOL: f64 = 2e-5;

#[test]
fn sparse_attention_matches_the_f64_reference() {
    let mut r = StdRng::seed_from_u64(12);
    let d = attn_data(&mut r, 64, 128, 4000);
    let mut sel: Vec<i32> = (0..512).map(|_| r.random_range(0..4000)).collect();
    sel[5] = -1;
    sel[300] = -1;
    let pages: Vec<&[GlobalFp4Entry]> = d.global.chunks(256).collect();
    // The window as a wrapped ring: two runs.
    let runs = [&d.window[100..], &d.window[..100]];
    let input = SparseAttnInput {
        q: &d.q,
        sinks: Some(&d.sinks),
        window: &runs,
        global: Paged::pages(&pages, 256).unwrap(),
        selected: &sel,
    };
    let want = sparse_attention_ref(&input).unwrap();
    for level in available_levels() {
        for threads in [1, 2, 3] {
            let mut got = vec![[0f32; HEAD_DIM]; 64];
            sparse_attention_decode_with(level, &input, threads, &mut got).unwrap();
            let err = max_rel_err(&got, &want);
            eprintln!("ERR {level} t{threads}: {err:e}");
            assert!(err < ATTN_TOL, "{level} t{threads}: {err:e}");
        }
    }
}

#[test]
fn sparse_attention_head_groups_give_the_single_thread_bits() {
    // Threads up to one per 32-head group split heads, not entries: every head is computed
    // exactly as on one thread, whatever the thread count.
    let mut r = StdRng::seed_from_u64(31);
    for heads in [64, 48, 96] {
        let d = attn_data(&mut r, heads, 128, 700);
        let sel: Vec<i32> = (0..512).map(|_| r.random_range(0..700)).collect();
        let runs = [&d.window[..]];
        let input = SparseAttnInput {
            q: &d.q,
            sinks: Some(&d.sinks),
            window: &runs,
            global: Paged::contiguous(&d.global),
            selected: &sel,
        };
        for level in available_levels() {
            let run = |t| {
                let mut o = vec![[0f32; HEAD_DIM]; heads];
                sparse_attention_decode_with(level, &input, t, &mut o).unwrap();
                o
            };
            let one = run(1);
            for t in 2..=heads.div_ceil(32) {
                let got = run(t);
                for (h, (a, b)) in one.iter().zip(&got).enumerate() {
                    for (c, (x, y)) in a.iter().zip(b).enumerate() {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "{level} heads {heads} t{t}: head {h} channel {c}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn sparse_attention_split_plans() {
    use super::sparse::Split;
    let plan = |h, r, t| {
        let s = Split::new(h, r, t);
        (s.group_heads, s.groups, s.row_chunks)
    };
    // Heads first, in groups of 32; threads left over split the entries.
    assert_eq!(plan(64, 640, 1), (64, 1, 1));
    assert_eq!(plan(64, 640, 2), (32, 2, 1));
    assert_eq!(plan(64, 640, 3), (32, 2, 1));
    assert_eq!(plan(64, 640, 4), (32, 2, 2));
    assert_eq!(plan(64, 640, 16), (32, 2, 7));
    // Few entries: no more chunks than 96-entry pieces.
    assert_eq!(plan(64, 100, 8), (32, 2, 2));
    assert_eq!(plan(64, 0, 8), (32, 2, 1));
    // Odd head counts: groups are whole 16-head vectors; small counts stay in one group.
    assert_eq!(plan(48, 640, 2), (32, 2, 1));
    assert_eq!(plan(17, 640, 4), (17, 1, 4));
    assert_eq!(plan(5, 640, 2), (5, 1, 2));
    assert_eq!(plan(0, 640, 2), (1, 1, 2));
}

#[test]
fn sparse_attention_edge_cases() {
    let mut r = StdRng::seed_from_u64(13);
    // Head count not a multiple of 16, tiny and odd row counts, no sinks, large logits.
    for (heads, nw, nsel, sinks, qscale) in [
        (5, 3, 0, false, 1.0),
        (17, 0, 7, true, 1.0),
        (64, 1, 1, true, 1.0),
        (64, 128, 512, false, 20.0),
        (3, 0, 0, true, 1.0),
        (3, 0, 0, false, 1.0),
    ] {
        let mut d = attn_data(&mut r, heads, nw.max(1), 600);
        for q in &mut d.q {
            for x in q.iter_mut() {
                *x *= qscale;
            }
        }
        let sel: Vec<i32> = (0..nsel).map(|_| r.random_range(0..600)).collect();
        let runs = [&d.window[..nw]];
        let input = SparseAttnInput {
            q: &d.q,
            sinks: sinks.then_some(&d.sinks[..]),
            window: &runs,
            global: Paged::contiguous(&d.global),
            selected: &sel,
        };
        let want = sparse_attention_ref(&input).unwrap();
        for level in available_levels() {
            for threads in [1, 2] {
                let mut got = vec![[1f32; HEAD_DIM]; heads];
                sparse_attention_decode_with(level, &input, threads, &mut got).unwrap();
                let err = max_rel_err(&got, &want);
                assert!(err < ATTN_TOL, "{level} h{heads} w{nw} s{nsel}: {err:e}");
                if nw + nsel == 0 {
                    assert!(got.iter().all(|row| row.iter().all(|&x| x == 0.0)));
                }
            }
        }
        // The AVX-512 kernel computes every lane as the AVX2 one does: same bits.
        if crate::SimdLevel::Avx512.is_available() {
            let run = |level| {
                let mut o = vec![[0f32; HEAD_DIM]; heads];
                sparse_attention_decode_with(level, &input, 1, &mut o).unwrap();
                o
            };
            let (a, b) = (run(crate::SimdLevel::Avx2), run(crate::SimdLevel::Avx512));
            for (h, (x, y)) in a.iter().zip(&b).enumerate() {
                for (d, (x, y)) in x.iter().zip(y).enumerate() {
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "h{heads} w{nw} s{nsel}: head {h} channel {d}: avx2 {x} avx512 {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn sparse_attention_argument_errors() {
    let mut r = StdRng::seed_from_u64(14);
    let d = attn_data(&mut r, 4, 2, 10);
    let runs = [&d.window[..]];
    let sel = [3, 10];
    let input = SparseAttnInput {
        q: &d.q,
        sinks: None,
        window: &runs,
        global: Paged::contiguous(&d.global),
        selected: &sel,
    };
    let mut out = vec![[0f32; HEAD_DIM]; 4];
    assert!(matches!(
        sparse_attention_decode(&input, 1, &mut out),
        Err(AttnError::PositionOutOfRange { position: 10, .. })
    ));
    let input = SparseAttnInput {
        selected: &[],
        sinks: Some(&d.sinks[..3]),
        ..input
    };
    assert!(matches!(
        sparse_attention_decode(&input, 1, &mut out),
        Err(AttnError::LengthMismatch { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Agreement with the CSA2 chain of `crate::csa2` (the runtime's building blocks).

#[test]
fn index_scores_equal_the_csa2_chain() {
    use kvstack_firmware_interface::rows::RowLayout;
    let mut r = StdRng::seed_from_u64(21);
    let q = index_query(&mut r);
    let ks = keys(&mut r, 600);
    let layout = RowLayout::new(EntryFormat::IndexMxfp4, INDEX_DIM).unwrap();
    let chain =
        crate::csa2::indexer::IndexQuery::new(layout, q.heads().as_bytes(), q.weights()).unwrap();
    let mut got = vec![0f32; ks.len()];
    indexer_scores(&q, Paged::contiguous(&ks), ks.len(), 2, &mut got).unwrap();
    for (s, (k, g)) in ks.iter().zip(&got).enumerate() {
        let want = chain.score(k.as_bytes()).unwrap();
        assert_eq!(g.to_bits(), want.to_bits(), "key {s}: {g} vs {want}");
    }
}

#[test]
fn selection_equals_the_csa2_chain() {
    use crate::csa2::candidates::{CandidateParams, candidate_pool};
    let mut r = StdRng::seed_from_u64(22);
    for (n, visible) in [(40_000usize, 39_990usize), (3000, 3000), (100, 37)] {
        let mut s: Vec<f32> = (0..n).map(|_| r.random::<f32>() * 10.0 - 5.0).collect();
        for v in s.iter_mut().skip(visible) {
            *v = f32::NEG_INFINITY;
        }
        // Ties, signed zeros, NaN and an overflowed score.
        if n > 1000 {
            s[10] = s[20];
            s[30] = 0.0;
            s[31] = -0.0;
            s[40] = f32::NAN;
            s[50] = f32::INFINITY;
        }
        for k in [1, 512, 5000] {
            let mut mine = vec![0i32; k];
            topk(&s, &mut mine).unwrap();
            let mut theirs = vec![0i32; k];
            crate::csa2::topk::topk(&s, k, &mut theirs).unwrap();
            assert_eq!(mine, theirs, "n {n} k {k}");
        }
        for top_blocks in [4, 2048] {
            let params = CandidateParams {
                block: 8,
                top_blocks,
            };
            let (mut bs, mut theirs) = (Vec::new(), Vec::new());
            candidate_pool(&s, visible, params, &mut bs, &mut theirs).unwrap();
            let mine = candidate_blocks(&s, visible, top_blocks, 8).unwrap();
            let theirs: Vec<i32> = theirs.iter().map(|&p| p as i32).collect();
            assert_eq!(mine, theirs, "n {n} blocks {top_blocks}");
        }
    }
}

#[test]
fn sparse_attention_agrees_with_the_csa2_chain() {
    use crate::csa2::attention::{AttentionShape, KeyRow, sparse_attention_ref as chain_ref};
    let mut r = StdRng::seed_from_u64(23);
    let d = attn_data(&mut r, 64, 128, 1000);
    let sel: Vec<i32> = (0..512).map(|_| r.random_range(0..1000)).collect();
    let runs = [&d.window[..]];
    let input = SparseAttnInput {
        q: &d.q,
        sinks: Some(&d.sinks),
        window: &runs,
        global: Paged::contiguous(&d.global),
        selected: &sel,
    };
    let mut got = vec![[0f32; HEAD_DIM]; 64];
    sparse_attention_decode(&input, 2, &mut got).unwrap();
    let shape = AttentionShape::new(64, HEAD_DIM).unwrap();
    assert_eq!(shape.scale, super::sparse::LOGIT_SCALE);
    let mut keys_rows: Vec<KeyRow<'_>> = d
        .window
        .iter()
        .map(|e| KeyRow::Window(e.as_bytes()))
        .collect();
    keys_rows.extend(
        sel.iter()
            .map(|&p| KeyRow::Compressed(d.global[p as usize].as_bytes())),
    );
    let q: Vec<f32> = d.q.iter().flatten().copied().collect();
    let mut theirs = vec![0f32; 64 * HEAD_DIM];
    chain_ref(&shape, &q, &d.sinks, &keys_rows, &mut theirs).unwrap();
    let want: Vec<[f64; HEAD_DIM]> = theirs
        .chunks_exact(HEAD_DIM)
        .map(|c| std::array::from_fn(|i| f64::from(c[i])))
        .collect();
    let err = max_rel_err(&got, &want);
    assert!(err < ATTN_TOL, "{err:e}");
}
