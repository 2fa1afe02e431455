//! Every CSA2 building block's fast form against its reference form (seeded random inputs
//! and proptest), plus the reference semantics the blocks must keep (sentinels, forced
//! blocks, YaRN range, inverse rotation).

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::rows::RowLayout;
use kvstack_firmware_interface::{EntryFormat, IndexMxfp4Entry};
use kvstack_kernels::csa2::attention::{
    AttentionShape, KeyRow, SparseAttention, sparse_attention_ref,
};
use kvstack_kernels::csa2::candidates::{
    CandidateParams, block_scores, candidate_pool, candidate_pool_ref, mask_to_candidates,
};
use kvstack_kernels::csa2::compress::{CompressorState, pool_group_ref, pool_groups};
use kvstack_kernels::csa2::gemm::{MatMut, MatRef, gemm, gemm_ref, linear, linear_ref};
use kvstack_kernels::csa2::indexer::{IndexQuery, index_score_ref, scale_head_weights};
use kvstack_kernels::csa2::norm::{rms_norm, rms_norm_in_place, rms_norm_ref};
use kvstack_kernels::csa2::output::{OutputShape, grouped_output, grouped_output_ref};
use kvstack_kernels::csa2::quant::{Mxfp4Query, RowCodec, dot_mxfp4_exact_ref};
use kvstack_kernels::csa2::rope::{Rope, Yarn};
use kvstack_kernels::csa2::softmax::{OnlineSoftmax, softmax_with_sink_ref};
use kvstack_kernels::csa2::topk::{canonicalize, topk, topk_ref};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zerocopy::FromBytes;

fn normal(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box-Muller: a normal-ish activation without another dependency.
            let u: f32 = rng.random_range(1e-7..1.0);
            let v: f32 = rng.random_range(0.0..1.0);
            (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos() * scale
        })
        .collect()
}

/// |fast - ref| <= bound · Σ|terms| for a sum of `k` products in any order.
fn sum_bound(k: usize) -> f32 {
    (k as f32 + 8.0) * f32::EPSILON
}

#[test]
fn gemm_matches_the_triple_loop() {
    let mut rng = StdRng::seed_from_u64(1);
    for &(m, k, n) in &[
        (1, 1, 1),
        (1, 128, 64),
        (7, 64, 33),
        (300, 128, 64),
        (3, 600, 17),
        (0, 5, 3),
        (4, 0, 2),
    ] {
        let x = normal(&mut rng, m * k, 1.0);
        let w = normal(&mut rng, n * k, 0.1);
        let mut fast = vec![f32::NAN; m * n];
        let mut slow = vec![0f32; m * n];
        linear(&x, &w, m, k, n, &mut fast).unwrap();
        linear_ref(&x, &w, m, k, n, &mut slow).unwrap();
        for i in 0..m {
            for j in 0..n {
                let mag: f32 = (0..k).map(|l| (x[i * k + l] * w[j * k + l]).abs()).sum();
                let (a, b) = (fast[i * n + j], slow[i * n + j]);
                assert!(
                    (a - b).abs() <= sum_bound(k) * mag + f32::MIN_POSITIVE,
                    "({m},{k},{n}) [{i},{j}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn gemm_one_row_equals_many_rows_bitwise() {
    // Decode (one token) and prefill (many) must produce the same projections.
    let mut rng = StdRng::seed_from_u64(2);
    let (m, k, n) = (37, 640, 96);
    let x = normal(&mut rng, m * k, 1.0);
    let w = normal(&mut rng, n * k, 0.05);
    let mut all = vec![0f32; m * n];
    linear(&x, &w, m, k, n, &mut all).unwrap();
    for i in 0..m {
        let mut one = vec![0f32; n];
        linear(&x[i * k..(i + 1) * k], &w, 1, k, n, &mut one).unwrap();
        assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
    }
}

#[test]
fn gemm_rejects_bad_shapes_and_views() {
    let x = vec![0f32; 6];
    let mut out = vec![0f32; 4];
    assert!(linear(&x, &x, 2, 3, 2, &mut out).is_ok());
    assert!(linear(&x, &x, 2, 4, 2, &mut out).is_err());
    assert!(MatRef::strided(&x, 2, 3, 4, 1).is_err());
    let a = MatRef::new(&x, 2, 3).unwrap();
    let b = MatRef::new(&x, 2, 3).unwrap();
    let err = gemm(a, b, MatMut::new(&mut out, 2, 2).unwrap()).unwrap_err();
    assert!(err.to_string().contains("do not chain"), "{err}");
    assert!(gemm_ref(a, b.t(), MatMut::new(&mut out, 2, 2).unwrap()).is_ok());
}

#[test]
fn rms_norm_fast_matches_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    for d in [16, 32, 64, 100, 512] {
        let x = normal(&mut rng, 5 * d, 3.0);
        let w: Vec<f32> = normal(&mut rng, d, 0.1).iter().map(|v| 1.0 + v).collect();
        let mut a = vec![0f32; x.len()];
        let mut b = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-20, &mut a).unwrap();
        rms_norm_ref(&x, &w, 1e-20, &mut b).unwrap();
        let mut c = x.clone();
        rms_norm_in_place(&mut c, &w, 1e-20).unwrap();
        assert_eq!(a, c);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() <= 4.0 * sum_bound(d) * q.abs(), "{p} vs {q}");
        }
    }
    // An all-zero row stays zero (the eps keeps the scale finite).
    let mut z = vec![0f32; 16];
    rms_norm_in_place(&mut z, &[1.0; 16], 1e-20).unwrap();
    assert!(z.iter().all(|v| *v == 0.0));
    assert!(rms_norm(&[0.0; 15], &[1.0; 16], 1e-20, &mut [0.0; 15]).is_err());
}

fn yarn() -> Yarn {
    Yarn {
        factor: 16.0,
        original_max_position: 65536.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    }
}

#[test]
fn yarn_correction_range_is_that_of_the_spec() {
    // README of shared/vectors/csa2: low 3, high 7 for 16 rotary dims at theta 160000.
    assert_eq!(yarn().correction_range(16, 160000.0), (3, 7));
    // V4.1-Flash: 64 rotary dims.
    let (low, high) = yarn().correction_range(64, 160000.0);
    assert!(low < high && high <= 63);
    let plain = Rope::new(16, 160000.0, None).unwrap();
    let scaled = Rope::new(16, 160000.0, Some(yarn())).unwrap();
    // Dims up to `low` keep their frequency, dims from `high` on are divided by the factor.
    for i in 0..=3 {
        assert_eq!(plain.freqs()[i], scaled.freqs()[i]);
    }
    assert_eq!(scaled.freqs()[7], plain.freqs()[7] / 16.0);
    for i in 4..7 {
        assert!(
            scaled.freqs()[i] < plain.freqs()[i] && scaled.freqs()[i] > plain.freqs()[i] / 16.0
        );
    }
}

#[test]
fn rope_rows_equal_reference_and_inverse_undoes_it() {
    let mut rng = StdRng::seed_from_u64(4);
    let rope = Rope::new(16, 160000.0, Some(yarn())).unwrap();
    let (heads, hd) = (4, 64);
    let positions: Vec<u64> = (0..9).map(|i| i * 37 + 3).collect();
    let x = normal(&mut rng, positions.len() * heads * hd, 1.0);
    let mut fast = x.clone();
    rope.rotate_rows(&mut fast, heads * hd, hd, &positions, false)
        .unwrap();
    let mut slow = x.clone();
    for (row, &p) in slow.chunks_exact_mut(heads * hd).zip(&positions) {
        for h in row.chunks_exact_mut(hd) {
            rope.rotate_ref(&mut h[hd - 16..], p, false).unwrap();
        }
    }
    assert_eq!(
        fast, slow,
        "fast rotation must be bit-identical to the reference"
    );
    // Only the last 16 dims of each head move.
    for (a, b) in fast.chunks_exact(hd).zip(x.chunks_exact(hd)) {
        assert_eq!(a[..hd - 16], b[..hd - 16]);
    }
    rope.rotate_rows(&mut fast, heads * hd, hd, &positions, true)
        .unwrap();
    for (a, b) in fast.iter().zip(&x) {
        assert!((a - b).abs() <= 4e-6 * (1.0 + b.abs()), "{a} vs {b}");
    }
    assert!(Rope::new(15, 1e4, None).is_err());
    assert!(
        rope.rotate_rows(&mut [0.0; 10], 10, 10, &[0], false)
            .is_err()
    );
}

#[test]
fn rope_angles_are_position_times_frequency() {
    let rope = Rope::new(16, 10000.0, None).unwrap();
    let mut a = vec![0f32; 8];
    rope.angles(5, &mut a).unwrap();
    for (x, f) in a.iter().zip(rope.freqs()) {
        assert_eq!(*x, 5.0 * f);
    }
    assert_eq!(rope.freqs()[0], 1.0);
}

#[test]
fn online_softmax_matches_two_pass_softmax() {
    let mut rng = StdRng::seed_from_u64(5);
    for n in [0usize, 1, 5, 40] {
        let mut logits = normal(&mut rng, n, 4.0);
        if n > 3 {
            logits[2] = f32::NEG_INFINITY; // a masked key
        }
        let sink = normal(&mut rng, 1, 2.0)[0];
        let d = 8;
        let values = normal(&mut rng, n * d, 1.0);
        let mut p = vec![0f32; n];
        softmax_with_sink_ref(&logits, sink, &mut p).unwrap();
        let psum: f32 = p.iter().sum();
        assert!((0.0..1.0).contains(&psum), "the sink takes a share: {psum}");
        let mut want = vec![0f32; d];
        for (pi, v) in p.iter().zip(values.chunks_exact(d)) {
            for (w, x) in want.iter_mut().zip(v) {
                *w += pi * x;
            }
        }
        let mut acc = OnlineSoftmax::new(d, sink);
        for (l, v) in logits.iter().zip(values.chunks_exact(d)) {
            acc.push(*l, v);
        }
        let mut got = vec![0f32; d];
        acc.finish(&mut got).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

#[test]
fn compressor_pools_groups_and_keeps_the_pending_token() {
    let mut rng = StdRng::seed_from_u64(6);
    let (ratio, d) = (2, 64);
    let kv = normal(&mut rng, 7 * d, 1.0);
    let gate = normal(&mut rng, 7 * d, 1.0);
    // Reference, group by group.
    let mut want = Vec::new();
    for g in 0..3 {
        let mut o = vec![0f32; d];
        pool_group_ref(
            &kv[g * 2 * d..(g + 1) * 2 * d],
            &gate[g * 2 * d..(g + 1) * 2 * d],
            ratio,
            &mut o,
        )
        .unwrap();
        want.extend(o);
    }
    let mut fast = vec![0f32; 3 * d];
    pool_groups(&kv[..6 * d], &gate[..6 * d], ratio, d, &mut fast).unwrap();
    assert_eq!(
        fast, want,
        "channel-vectorized pooling must be bit-identical"
    );
    // Token by token through the state: the same groups, one pending token at the end.
    let mut st = CompressorState::new(ratio, d).unwrap();
    let mut pooled = Vec::new();
    let mut groups = 0;
    for t in 0..7 {
        groups += st
            .push(
                &kv[t * d..(t + 1) * d],
                Some(&gate[t * d..(t + 1) * d]),
                &mut pooled,
            )
            .unwrap();
    }
    assert_eq!((groups, st.pending_tokens()), (3, 1));
    assert_eq!(pooled, want);
    assert_eq!(&st.pending()[..d], &kv[6 * d..7 * d]);
    // Resuming from the stored pending state completes the group like an uninterrupted run.
    let mut resumed = CompressorState::with_pending(ratio, d, st.pending()).unwrap();
    let extra = normal(&mut rng, 2 * d, 1.0);
    let mut a = Vec::new();
    resumed
        .push(&extra[..d], Some(&extra[d..]), &mut a)
        .unwrap();
    let mut b = Vec::new();
    st.push(&extra[..d], Some(&extra[d..]), &mut b).unwrap();
    assert_eq!(a, b);
    // Pooling is a convex combination per channel.
    for c in 0..d {
        let lo = kv[c].min(kv[d + c]);
        let hi = kv[c].max(kv[d + c]);
        assert!(want[c] >= lo - 1e-6 && want[c] <= hi + 1e-6);
    }
    // Ratio 1 passes rows through; ratio 2 without a gate is an error.
    let mut r1 = CompressorState::new(1, d).unwrap();
    let mut out = Vec::new();
    assert_eq!(r1.push(&kv[..2 * d], None, &mut out).unwrap(), 2);
    assert_eq!(out, kv[..2 * d]);
    assert!(
        CompressorState::new(2, d)
            .unwrap()
            .push(&kv[..d], None, &mut out)
            .is_err()
    );
    assert!(CompressorState::with_pending(2, d, &kv[..4 * d]).is_err());
}

fn mx_rows(rng: &mut StdRng, n: usize, dim: usize, spread: i32) -> (RowCodec, Vec<u8>) {
    let codec = RowCodec::new(EntryFormat::IndexMxfp4, dim).unwrap();
    let mut x = normal(rng, n * dim, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        // Vary block magnitudes, as activations do.
        *v *= 2f32.powi(((i / 32) as i32 * 7) % (2 * spread + 1) - spread);
    }
    let mut rows = vec![0u8; n * codec.bytes()];
    codec.quantize(&x, &mut rows).unwrap();
    (codec, rows)
}

#[test]
fn exact_mxfp4_dot_matches_reference_and_the_simd_kernel() {
    let mut rng = StdRng::seed_from_u64(7);
    for dim in [32, 64, 128, 256] {
        let (codec, q) = mx_rows(&mut rng, 1, dim, 6);
        let (_, keys) = mx_rows(&mut rng, 50, dim, 6);
        let prepared = Mxfp4Query::new(codec.layout(), &q).unwrap();
        for k in keys.chunks_exact(codec.bytes()) {
            let fast = prepared.dot(k).unwrap();
            let slow = dot_mxfp4_exact_ref(codec.layout(), &q, k).unwrap();
            assert_eq!(fast.to_bits(), slow.to_bits(), "dim {dim}");
            if dim == 128 {
                let qe = IndexMxfp4Entry::read_from_bytes(&q[..]).unwrap();
                let ke = IndexMxfp4Entry::read_from_bytes(k).unwrap();
                assert_eq!(
                    fast.to_bits(),
                    kvstack_kernels::dot_mxfp4_mxfp4(&qe, &ke).to_bits()
                );
            }
        }
    }
}

#[test]
fn one_block_f32_dot_is_exact_so_both_index_scores_agree() {
    // With one 32-wide block per row every partial f32 sum is exact: the reference's f32 dot
    // on dequantized values and the exact integer dot give the same bits.
    let mut rng = StdRng::seed_from_u64(8);
    let heads = 4;
    let (codec, q) = mx_rows(&mut rng, heads, 32, 3);
    let (_, keys) = mx_rows(&mut rng, 64, 32, 3);
    let mut w = normal(&mut rng, heads, 1.0);
    scale_head_weights(&mut w, 32, heads);
    let iq = IndexQuery::new(codec.layout(), &q, &w).unwrap();
    for k in keys.chunks_exact(codec.bytes()) {
        let a = iq.score(k).unwrap();
        let b = index_score_ref(codec.layout(), &q, &w, k).unwrap();
        assert_eq!(a.to_bits(), b.to_bits());
    }
}

#[test]
fn head_weight_scale_is_two_f32_multiplies() {
    let mut w = vec![3.0f32];
    scale_head_weights(&mut w, 128, 32);
    assert_eq!(
        w[0],
        3.0f32 * (128f64.powf(-0.5) as f32) * (32f64.powf(-0.5) as f32)
    );
}

fn as_set(row: &[i32]) -> Vec<i32> {
    let mut v: Vec<i32> = row.iter().copied().filter(|&j| j >= 0).collect();
    v.sort_unstable();
    v
}

#[test]
fn topk_sentinels_follow_the_reference() {
    // Fewer finite scores than k: the -1 slots of the reference can sit between valid
    // indices (in-place replacement); the fast form is canonical; the sets agree.
    let mut scores = vec![f32::NEG_INFINITY; 40];
    for j in (0..40).step_by(3) {
        scores[j] = j as f32 * 0.1;
    }
    let mut a = vec![0; 16];
    let mut b = vec![0; 16];
    topk_ref(&scores, 16, &mut a).unwrap();
    topk(&scores, 16, &mut b).unwrap();
    assert_eq!(as_set(&a), as_set(&b));
    assert_eq!(as_set(&b), (0..40).step_by(3).collect::<Vec<_>>());
    assert_eq!(&b[14..], &[-1, -1]);
    let mut c = a.clone();
    canonicalize(&mut c);
    assert_eq!(c, b);
    // W < k: padded with -1; nothing visible: all -1 (never position 0).
    let mut small = vec![0; 16];
    topk(&[1.0, f32::NEG_INFINITY, 3.0], 16, &mut small).unwrap();
    assert_eq!(&small[..3], &[0, 2, -1]);
    topk(&[], 16, &mut small).unwrap();
    assert!(small.iter().all(|&j| j == -1));
    topk_ref(&[f32::NEG_INFINITY; 4], 16, &mut small).unwrap();
    assert!(small.iter().all(|&j| j == -1));
}

proptest! {
    #[test]
    fn topk_fast_selects_the_reference_set(
        scores in prop::collection::vec(prop_oneof![4 => -100f32..100f32, 1 => Just(f32::NEG_INFINITY)], 0..200),
        k in 0usize..40,
    ) {
        let mut a = vec![0; k];
        let mut b = vec![0; k];
        topk_ref(&scores, k, &mut a).unwrap();
        topk(&scores, k, &mut b).unwrap();
        prop_assert_eq!(as_set(&a), as_set(&b));
    }

    #[test]
    fn candidate_pool_fast_equals_reference(
        scores in prop::collection::vec(prop_oneof![4 => -10f32..10f32, 1 => Just(f32::NEG_INFINITY)], 0..120),
        visible_frac in 0.0f64..=1.0,
        block in 1usize..10,
        top_blocks in 0usize..6,
    ) {
        let w = scores.len();
        let visible = ((w as f64) * visible_frac) as usize;
        let mut masked = scores.clone();
        for s in &mut masked[visible..] {
            *s = f32::NEG_INFINITY;
        }
        let params = CandidateParams { block, top_blocks };
        let mut a = Vec::new();
        let mut b = Vec::new();
        let mut bs = Vec::new();
        candidate_pool_ref(&masked, visible, params, &mut a).unwrap();
        candidate_pool(&masked, visible, params, &mut bs, &mut b).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert!(b.iter().all(|&j| (j as usize) < visible));
        // The newest visible position is always a candidate (its block is forced in).
        if visible > 0 && top_blocks > 0 {
            prop_assert!(b.contains(&((visible - 1) as u32)));
        }
    }
}

#[test]
fn candidate_pool_forces_the_newest_block_and_drops_empty_ones() {
    // 33 visible of 40 with blocks of 8 and 4 blocks: the newest block holds only position 32.
    let scores: Vec<f32> = (0..40)
        .map(|j| {
            if j < 33 {
                (j % 7) as f32
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let params = CandidateParams {
        block: 8,
        top_blocks: 4,
    };
    let mut bs = Vec::new();
    block_scores(&scores, 33, params, &mut bs).unwrap();
    assert_eq!(bs.len(), 5);
    assert_eq!(bs[4], f32::INFINITY);
    let mut pool = Vec::new();
    candidate_pool(&scores, 33, params, &mut bs, &mut pool).unwrap();
    assert_eq!(
        pool.len(),
        25,
        "a partial newest block of 1 plus 3 full blocks"
    );
    assert!(pool.contains(&32));
    // Nothing visible: no block, no candidate.
    candidate_pool(&[f32::NEG_INFINITY; 8], 0, params, &mut bs, &mut pool).unwrap();
    assert!(pool.is_empty());
    let mut s = vec![1.0f32; 6];
    mask_to_candidates(&mut s, &[1, 4]);
    assert_eq!(s.iter().filter(|v| v.is_finite()).count(), 2);
}

#[test]
fn sparse_attention_fast_matches_reference() {
    let mut rng = StdRng::seed_from_u64(9);
    for (heads, d) in [(4, 64), (2, 512)] {
        let shape = AttentionShape::new(heads, d).unwrap();
        let (wc, ec) = (shape.window_codec(), shape.compressed_codec());
        let win = normal(&mut rng, 16 * d, 1.0);
        let ent = normal(&mut rng, 6 * d, 1.0);
        let mut wrows = vec![0u8; 16 * wc.bytes()];
        let mut erows = vec![0u8; 6 * ec.bytes()];
        wc.quantize(&win, &mut wrows).unwrap();
        ec.quantize(&ent, &mut erows).unwrap();
        let mut keys: Vec<KeyRow<'_>> =
            wrows.chunks_exact(wc.bytes()).map(KeyRow::Window).collect();
        // Entries, one selected twice (duplicates are kept).
        keys.extend(erows.chunks_exact(ec.bytes()).map(KeyRow::Compressed));
        keys.push(KeyRow::Compressed(&erows[..ec.bytes()]));
        let q = normal(&mut rng, heads * d, 1.0);
        let sinks = normal(&mut rng, heads, 1.0);
        let mut want = vec![0f32; heads * d];
        sparse_attention_ref(&shape, &q, &sinks, &keys, &mut want).unwrap();
        let mut got = vec![0f32; heads * d];
        let mut fast = SparseAttention::new(shape);
        fast.run(&q, &sinks, keys.iter().copied(), &mut got)
            .unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 2e-6 * (1.0 + b.abs()), "{a} vs {b}");
        }
        // No keys at all: everything goes to the sink, the output is zero.
        fast.run(&q, &sinks, std::iter::empty(), &mut got).unwrap();
        assert!(got.iter().all(|v| *v == 0.0));
    }
}

#[test]
fn grouped_output_fast_matches_reference() {
    let mut rng = StdRng::seed_from_u64(10);
    let shape = OutputShape {
        heads: 4,
        head_dim: 64,
        groups: 2,
        rank: 32,
        hidden: 128,
    };
    let n = 9;
    let x = normal(&mut rng, n * 256, 1.0);
    let wo_a = normal(&mut rng, 64 * 128, 0.1);
    let wo_b = normal(&mut rng, 128 * 64, 0.1);
    let mut a = vec![0f32; n * 128];
    let mut b = vec![0f32; n * 128];
    grouped_output(&shape, n, &x, &wo_a, &wo_b, &mut a).unwrap();
    grouped_output_ref(&shape, n, &x, &wo_a, &wo_b, &mut b).unwrap();
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
    // Group g reads only its heads: zeroing group 1's input changes nothing from group 0.
    let mut x1 = x.clone();
    for row in x1.chunks_exact_mut(256) {
        row[128..].fill(0.0);
    }
    let wo_b_g0: Vec<f32> = wo_b
        .chunks_exact(64)
        .flat_map(|r| r[..32].iter().copied().chain([0.0; 32]))
        .collect();
    grouped_output_ref(&shape, n, &x, &wo_a, &wo_b_g0, &mut a).unwrap();
    grouped_output_ref(&shape, n, &x1, &wo_a, &wo_b_g0, &mut b).unwrap();
    assert_eq!(a, b);
    let bad = OutputShape { groups: 3, ..shape };
    assert!(grouped_output(&bad, n, &x, &wo_a, &wo_b, &mut a).is_err());
}

#[test]
fn row_codecs_at_any_width_match_the_reference_rows() {
    let mut rng = StdRng::seed_from_u64(11);
    for (format, dims) in [
        (EntryFormat::WindowFp8, [64, 512]),
        (EntryFormat::GlobalFp4, [64, 512]),
        (EntryFormat::IndexMxfp4, [32, 128]),
    ] {
        for dim in dims {
            let codec = RowCodec::new(format, dim).unwrap();
            let x = normal(&mut rng, 3 * dim, 2.0);
            let mut fast = vec![0u8; 3 * codec.bytes()];
            let mut slow = vec![0u8; 3 * codec.bytes()];
            codec.quantize(&x, &mut fast).unwrap();
            codec.quantize_ref(&x, &mut slow).unwrap();
            assert_eq!(fast, slow, "{format} {dim}");
            let mut a = vec![0f32; 3 * dim];
            let mut b = vec![0f32; 3 * dim];
            codec.dequantize(&fast, &mut a).unwrap();
            codec.dequantize_ref(&fast, &mut b).unwrap();
            assert_eq!(a, b);
            let layout = RowLayout::new(format, dim).unwrap();
            assert_eq!(codec.layout(), layout);
        }
    }
    assert!(RowCodec::new(EntryFormat::IndexMxfp4, 48).is_err());
}
