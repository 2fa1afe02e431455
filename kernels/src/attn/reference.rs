//! Plain scalar references of the attention kernels: simple loops over the scalar reference
//! codecs of `kvstack_firmware_interface`, written for clarity, not speed. The fast kernels
//! are tested against these; other crates may use them as the ground truth as well.

use kvstack_firmware_interface::IndexMxfp4Entry;
use kvstack_firmware_interface::element::E2M1_TIMES_TWO_I8;
use kvstack_firmware_interface::entry::{dequantize_global_fp4, dequantize_window_fp8};

use super::sparse::{KvRow, SparseAttnInput, gather_rows};
use super::{AttnError, HEAD_DIM, INDEX_HEADS};

/// `2 * e2m1` of element `i` of an MXFP4 row.
fn x2(e: &IndexMxfp4Entry, i: usize) -> i32 {
    let b = e.values[i / 2];
    let code = if i.is_multiple_of(2) {
        b & 0x0F
    } else {
        b >> 4
    };
    i32::from(E2M1_TIMES_TWO_I8[usize::from(code)])
}

/// The exact dot of two MXFP4 rows rounded once to f32 (the definition
/// [`crate::dot_mxfp4_mxfp4`] implements): per block `t_b = I_b * 2^(eq_b + ek_b - 256)` with
/// the exact integer `I_b = sum(2q * 2k)`, combined as `(t0 + t1) + (t2 + t3)` in f64. A scale
/// byte of 255 gives NaN.
pub fn mxfp4_dot_ref(q: &IndexMxfp4Entry, k: &IndexMxfp4Entry) -> f32 {
    let mut t = [0f64; 4];
    for (b, tb) in t.iter_mut().enumerate() {
        let i: i32 = (32 * b..32 * b + 32).map(|i| x2(q, i) * x2(k, i)).sum();
        let (eq, ek) = (q.scales[b], k.scales[b]);
        *tb = if eq == 255 || ek == 255 {
            f64::NAN
        } else {
            f64::from(i) * 2f64.powi(i32::from(eq) + i32::from(ek) - 256)
        };
    }
    ((t[0] + t[1]) + (t[2] + t[3])) as f32
}

/// One index score: `T_h = w[h] * max(q[h] . k, 0)` in f32 ([`mxfp4_dot_ref`] for the dots),
/// summed in head order in f32 starting from the first head's term.
pub fn index_score_ref(
    heads: &[IndexMxfp4Entry; INDEX_HEADS],
    weights: &[f32; INDEX_HEADS],
    k: &IndexMxfp4Entry,
) -> f32 {
    let mut total = 0f32;
    for (h, (q, &w)) in heads.iter().zip(weights).enumerate() {
        let term = w * mxfp4_dot_ref(q, k).max(0.0);
        total = if h == 0 { term } else { total + term };
    }
    total
}

/// Index scores of `keys`: [`index_score_ref`] below `visible`, `-inf` from there on.
pub fn indexer_scores_ref(
    heads: &[IndexMxfp4Entry; INDEX_HEADS],
    weights: &[f32; INDEX_HEADS],
    keys: &[IndexMxfp4Entry],
    visible: usize,
) -> Vec<f32> {
    keys.iter()
        .enumerate()
        .map(|(s, k)| {
            if s < visible {
                index_score_ref(heads, weights, k)
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

/// Top-k by sorting, as the reference does: every score above `-inf` (NaN excluded) ranked by
/// `f32::total_cmp` descending then index ascending, the first `k` taken, non-finite picks
/// (`+inf`) replaced by `-1`; valid indices ascending, `-1`-padded to `k`.
pub fn topk_ref(scores: &[f32], k: usize) -> Vec<i32> {
    let mut items: Vec<(f32, usize)> = scores
        .iter()
        .enumerate()
        .filter(|(_, s)| **s > f32::NEG_INFINITY)
        .map(|(i, &s)| (s, i))
        .collect();
    items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut idx: Vec<i32> = items
        .iter()
        .take(k)
        .filter(|(s, _)| s.is_finite())
        .map(|&(_, i)| i as i32)
        .collect();
    idx.sort_unstable();
    idx.resize(k, -1);
    idx
}

/// The candidate pool by the definition of spec §4: block maxima over visible positions (NaN
/// ignored), the newest visible block forced to `+inf`, the blocks sorted as [`topk_ref`]
/// sorts scores, the first `max_blocks` with a score above `-inf` kept, their visible
/// positions ascending.
pub fn candidate_blocks_ref(
    scores: &[f32],
    visible: usize,
    max_blocks: usize,
    block: usize,
) -> Vec<i32> {
    let nblocks = visible.div_ceil(block);
    let mut bs = vec![f32::NEG_INFINITY; nblocks];
    for (p, &s) in scores.iter().enumerate().take(visible) {
        if s.total_cmp(&bs[p / block]).is_gt() && !s.is_nan() {
            bs[p / block] = s;
        }
    }
    if let Some(last) = bs.last_mut() {
        *last = f32::INFINITY;
    }
    let mut order: Vec<usize> = (0..nblocks)
        .filter(|&b| bs[b] > f32::NEG_INFINITY)
        .collect();
    order.sort_by(|&a, &b| bs[b].total_cmp(&bs[a]).then(a.cmp(&b)));
    order.truncate(max_blocks);
    order.sort_unstable();
    let mut out = Vec::new();
    for b in order {
        let start = b * block;
        out.extend((start..(start + block).min(visible)).map(|p| p as i32));
    }
    out
}

/// Dequantizes an attended row with the scalar reference codecs.
fn row_f64(row: &KvRow<'_>) -> [f64; HEAD_DIM] {
    let mut v = [0f32; HEAD_DIM];
    match row {
        KvRow::Fp8(e) => dequantize_window_fp8(e, &mut v),
        KvRow::Fp4(e) => dequantize_global_fp4(e, &mut v),
    }
    v.map(f64::from)
}

/// Sparse attention in f64: for each head, logits `q . k * 512^-0.5` over the window rows and
/// the selected global rows (negative slots skipped), softmax with the sink column (value 0)
/// in the denominator, `out = sum_j p_j v_j`. Zero output when nothing is attended and there is
/// no sink.
///
/// # Errors
///
/// As [`super::sparse_attention_decode`].
pub fn sparse_attention_ref(
    input: &SparseAttnInput<'_>,
) -> Result<Vec<[f64; HEAD_DIM]>, AttnError> {
    let rows: Vec<[f64; HEAD_DIM]> = gather_rows(input)?.iter().map(row_f64).collect();
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let mut out = Vec::with_capacity(input.q.len());
    for (h, q) in input.q.iter().enumerate() {
        let logits: Vec<f64> = rows
            .iter()
            .map(|v| {
                q.iter()
                    .zip(v)
                    .map(|(&a, &b)| f64::from(a) * b)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let sink = input.sinks.and_then(|s| s.get(h)).map(|&s| f64::from(s));
        let m = logits
            .iter()
            .copied()
            .chain(sink)
            .fold(f64::NEG_INFINITY, f64::max);
        let mut o = [0f64; HEAD_DIM];
        if m > f64::NEG_INFINITY {
            let den: f64 = logits.iter().map(|&x| (x - m).exp()).sum::<f64>()
                + sink.map_or(0.0, |s| (s - m).exp());
            for (x, v) in logits.iter().zip(&rows) {
                let p = (x - m).exp() / den;
                for (od, vd) in o.iter_mut().zip(v) {
                    *od += p * vd;
                }
            }
        }
        out.push(o);
    }
    Ok(out)
}
