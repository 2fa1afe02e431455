//! Top-k selection and the hierarchical candidate pool (spec §4).
//!
//! Ranking (as `f32::total_cmp`, like `csa2::topk`): higher score first, `-0` below `+0`;
//! equal scores rank the lower index (or position) first. NaN and `-inf` are never selected.
//! `+inf` takes a slot like any score, but the slot is written as `-1` (the reference replaces
//! every selected non-finite score by `-1`); it only arises from an overflow, or from the
//! candidate pool's forced newest block. The order is total, so the selected set is unique.

use super::AttnError;

/// An order-preserving `u32` image of a score: larger score (in `f32::total_cmp` order, so
/// `-0 < +0`), larger key; unselectable scores (NaN, `-inf`) map to 0, below every selectable
/// one (the smallest, `-f32::MAX`, maps to `0x0080_0000`). Branch-free, so the chunk maxima
/// below vectorize.
#[inline]
fn sort_key(s: f32) -> u32 {
    let b = s.to_bits();
    let k = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    if s > f32::NEG_INFINITY { k } else { 0 }
}

/// The key of `+inf`: a selected item with it is written as `-1`.
const INF_KEY: u32 = 0xFF80_0000;

/// A ranked item: the score key in the high half, `u32::MAX - id` in the low half, so that a
/// larger item is a better one (higher score, then lower id).
#[inline]
fn item(key: u32, id: u32) -> u64 {
    (u64::from(key) << 32) | u64::from(u32::MAX - id)
}

/// The id of an item.
#[inline]
fn item_id(x: u64) -> u32 {
    u32::MAX - (x as u32)
}

/// Keeps the `k` largest items of `buf` (any order); returns the smallest kept.
fn keep_best(buf: &mut Vec<u64>, k: usize) -> u64 {
    if buf.len() > k {
        let cut = buf.len() - k;
        buf.select_nth_unstable(cut);
        buf.drain(..cut);
    }
    buf.iter().copied().min().unwrap_or(0)
}

/// Items per quick check: the scan maps a chunk to keys and compares its maximum with the
/// threshold before looking at single items.
const CHUNK: usize = 16;

/// The `k` best selectable items of `v` (ranked by `key`, ties to the lower `id(index)`),
/// unordered. Scans in index order with a running threshold: once `k` items are held, an item
/// can only enter if it ranks above the worst held one; with ids growing with the index, most
/// chunks are rejected by one comparison of their largest key.
#[inline(always)]
fn best_k_impl<T: Copy>(
    v: &[T],
    k: usize,
    key: impl Fn(T) -> u32,
    id: impl Fn(usize) -> u32,
) -> Vec<u64> {
    let cap = (4 * k).max(1024);
    let mut buf: Vec<u64> = Vec::with_capacity(cap + CHUNK);
    if k == 0 {
        return buf;
    }
    let mut thr = 0u64;
    for (c, chunk) in v.chunks(CHUNK).enumerate() {
        let mut ks = [0u32; CHUNK];
        for (d, &x) in ks.iter_mut().zip(chunk) {
            *d = key(x);
        }
        let m = ks.iter().fold(0u32, |a, &b| a.max(b));
        if m == 0 || m < (thr >> 32) as u32 {
            continue;
        }
        for (i, &kk) in ks.iter().enumerate().take(chunk.len()) {
            let x = item(kk, id(c * CHUNK + i));
            if kk != 0 && x > thr {
                buf.push(x);
            }
        }
        if buf.len() >= cap {
            thr = keep_best(&mut buf, k);
        }
    }
    keep_best(&mut buf, k);
    buf
}

/// [`best_k_impl`] compiled for AVX2 (unsigned 32-bit maxima in 8 lanes; the baseline
/// x86-64 target has no unsigned vector maximum).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn best_k_avx2<T: Copy>(
    v: &[T],
    k: usize,
    key: impl Fn(T) -> u32,
    id: impl Fn(usize) -> u32,
) -> Vec<u64> {
    best_k_impl(v, k, key, id)
}

/// [`best_k_impl`] on the best level this CPU runs (the result does not depend on it).
fn best_k<T: Copy>(
    v: &[T],
    k: usize,
    key: impl Fn(T) -> u32,
    id: impl Fn(usize) -> u32,
) -> Vec<u64> {
    #[cfg(target_arch = "x86_64")]
    if crate::level::Verified::new(crate::SimdLevel::Avx2).is_ok() {
        // SAFETY: the AVX2 level was verified just above, so this CPU has AVX2 and FMA.
        return unsafe { best_k_avx2(v, k, key, id) };
    }
    best_k_impl(v, k, key, id)
}

/// The block keys of [`candidate_blocks`]: per block, the largest [`sort_key`].
#[inline(always)]
fn block_keys_impl(vis: &[f32], block: usize) -> Vec<u32> {
    let mut out = vec![0u32; vis.len().div_ceil(block.max(1))];
    if block == 8 {
        // The real pool geometry: one 8-lane maximum per block.
        let (whole, rest) = vis.as_chunks::<8>();
        for (o, c) in out.iter_mut().zip(whole) {
            *o = c.iter().fold(0u32, |m, &s| m.max(sort_key(s)));
        }
        if let Some(o) = out.get_mut(whole.len()) {
            *o = rest.iter().fold(0u32, |m, &s| m.max(sort_key(s)));
        }
    } else {
        for (o, c) in out.iter_mut().zip(vis.chunks(block.max(1))) {
            *o = c.iter().fold(0u32, |m, &s| m.max(sort_key(s)));
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn block_keys_avx2(vis: &[f32], block: usize) -> Vec<u32> {
    block_keys_impl(vis, block)
}

fn block_keys(vis: &[f32], block: usize) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if crate::level::Verified::new(crate::SimdLevel::Avx2).is_ok() {
        // SAFETY: the AVX2 level was verified just above, so this CPU has AVX2 and FMA.
        return unsafe { block_keys_avx2(vis, block) };
    }
    block_keys_impl(vis, block)
}

/// Top-k of index scores (spec §4): the indices of the `out.len()` best selectable scores,
/// ascending, then `-1` for the slots left when fewer are selectable. See the
/// [module documentation](super) for the ranking and tie rule.
///
/// # Errors
///
/// [`AttnError::PositionOutOfRange`] if `scores` has more than `i32::MAX` entries.
pub fn topk(scores: &[f32], out: &mut [i32]) -> Result<(), AttnError> {
    if i32::try_from(scores.len()).is_err() {
        return Err(AttnError::PositionOutOfRange {
            what: "top-k scores",
            position: scores.len() as i64,
            len: i32::MAX as usize,
        });
    }
    let best = best_k(scores, out.len(), sort_key, |i| i as u32);
    write_sorted(best, out);
    Ok(())
}

/// Top-k over a candidate list (a Reindex layer, spec §4): `scores[i]` belongs to
/// `positions[i]`; returns the best `out.len()` positions ascending, `-1`-padded. Ties go to
/// the lower position, and negative positions are never selected, so the result is what
/// [`topk`] gives on a full score array that is `-inf` outside the candidates.
///
/// # Errors
///
/// [`AttnError::LengthMismatch`] unless `scores.len() == positions.len()`.
pub fn topk_positions(scores: &[f32], positions: &[i32], out: &mut [i32]) -> Result<(), AttnError> {
    if scores.len() != positions.len() {
        return Err(AttnError::LengthMismatch {
            what: "candidate scores (one per position)",
            expected: positions.len(),
            actual: scores.len(),
        });
    }
    let k = out.len();
    let best = if positions.windows(2).all(|w| w[0] < w[1]) {
        // Ascending positions: the index order is the position order. Negative positions
        // (never selected) can only come first.
        let skip = positions.partition_point(|&p| p < 0);
        let (tail, pos) = (
            scores.get(skip..).unwrap_or_default(),
            positions.get(skip..).unwrap_or_default(),
        );
        best_k(tail, k, sort_key, |i| {
            pos.get(i).map_or(u32::MAX, |&p| p as u32)
        })
    } else {
        let mut all: Vec<u64> = scores
            .iter()
            .zip(positions)
            .filter(|&(&s, &p)| sort_key(s) != 0 && p >= 0)
            .map(|(&s, &p)| item(sort_key(s), p as u32))
            .collect();
        keep_best(&mut all, k);
        all
    };
    write_sorted(best, out);
    Ok(())
}

/// Writes the ids of the selected items with a finite score sorted ascending into `out`,
/// `-1` after them.
fn write_sorted(items: Vec<u64>, out: &mut [i32]) {
    let mut v: Vec<i32> = items
        .into_iter()
        .filter(|&x| (x >> 32) as u32 != INF_KEY)
        .map(|x| item_id(x) as i32)
        .collect();
    v.sort_unstable();
    out.fill(-1);
    for (o, i) in out.iter_mut().zip(v) {
        *o = i;
    }
}

/// The hierarchical candidate pool of the candidate-source layer (spec §4), from the index
/// scores of all stored positions (`-inf` past `visible`, as [`super::indexer_scores`] writes
/// them): block score = max of the block's `block` visible scores (NaN ignored); the block
/// holding position `visible - 1` scores `+inf`; the best `max_blocks` blocks with a score
/// above `-inf` are kept (ranked as the [module documentation](super) says, ties to the lower
/// block). Returns their visible positions, ascending (at most `max_blocks * block`).
///
/// # Errors
///
/// [`AttnError::PositionOutOfRange`] if `visible > scores.len()` or positions do not fit i32;
/// [`AttnError::LengthMismatch`] if `block == 0`.
pub fn candidate_blocks(
    scores: &[f32],
    visible: usize,
    max_blocks: usize,
    block: usize,
) -> Result<Vec<i32>, AttnError> {
    if visible > scores.len() || i32::try_from(visible).is_err() {
        return Err(AttnError::PositionOutOfRange {
            what: "visible index scores",
            position: visible as i64,
            len: scores.len(),
        });
    }
    if block == 0 {
        return Err(AttnError::LengthMismatch {
            what: "candidate block size",
            expected: 8,
            actual: 0,
        });
    }
    let vis = scores.get(..visible).unwrap_or_default();
    // Block keys: the largest score key of the block (0 if none is selectable); the newest
    // block is forced to `+inf`.
    let mut bk = block_keys(vis, block);
    if let Some(last) = bk.last_mut() {
        *last = INF_KEY;
    }
    let best = best_k(&bk, max_blocks, |x| x, |i| i as u32);
    let mut blocks: Vec<usize> = best.into_iter().map(|x| item_id(x) as usize).collect();
    blocks.sort_unstable();
    let mut out = Vec::with_capacity(blocks.len() * block);
    for b in blocks {
        let start = b * block;
        out.extend((start..(start + block).min(visible)).map(|p| p as i32));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_nan_and_padding() {
        let s = [1.0, f32::NAN, 3.0, 3.0, f32::NEG_INFINITY, -0.0, 0.0, 2.0];
        let mut out = [0i32; 4];
        topk(&s, &mut out).unwrap();
        assert_eq!(out, [0, 2, 3, 7]);
        let mut out = [0i32; 5];
        topk(&s, &mut out).unwrap();
        // -0 ranks below +0 (total order), so +0 (index 6) takes the last slot.
        assert_eq!(out, [0, 2, 3, 6, 7]);
        // A selected +inf takes a slot but is written as -1.
        let inf = [1.0, f32::INFINITY, 3.0];
        let mut out = [0i32; 2];
        topk(&inf, &mut out).unwrap();
        assert_eq!(out, [2, -1]);
        let mut out = [0i32; 9];
        topk(&s, &mut out).unwrap();
        assert_eq!(out, [0, 2, 3, 5, 6, 7, -1, -1, -1]);
        let mut none = [0i32; 0];
        topk(&s, &mut none).unwrap();
    }

    #[test]
    fn threshold_scan_keeps_the_lower_index_on_ties() {
        // Many equal scores across compactions: the first k indices must win.
        let s = vec![5.0f32; 10_000];
        let mut out = [0i32; 300];
        topk(&s, &mut out).unwrap();
        let want: Vec<i32> = (0..300).collect();
        assert_eq!(out.to_vec(), want);
    }

    #[test]
    fn candidates_force_the_newest_block() {
        let mut s = vec![f32::NEG_INFINITY; 40];
        for (i, v) in s.iter_mut().enumerate().take(27) {
            *v = i as f32 * 0.1;
        }
        s[3] = 100.0;
        // Visible 27: blocks 0..=3, block 3 (positions 24..27) is the newest and forced.
        let c = candidate_blocks(&s, 27, 2, 8).unwrap();
        assert_eq!(c, vec![0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26]);
        let c = candidate_blocks(&s, 0, 2, 8).unwrap();
        assert!(c.is_empty());
    }

    #[test]
    fn positions_match_full_array_topk() {
        let positions = [3, 9, 10, 20, 21];
        let scores = [0.5, 0.7, 0.7, f32::NEG_INFINITY, 0.1];
        let mut out = [0i32; 3];
        topk_positions(&scores, &positions, &mut out).unwrap();
        assert_eq!(out, [3, 9, 10]);
        let unsorted = [21, 10, 9, 20, 3];
        let scores_u = [0.1, 0.7, 0.7, f32::NEG_INFINITY, 0.5];
        topk_positions(&scores_u, &unsorted, &mut out).unwrap();
        assert_eq!(out, [3, 9, 10]);
        let mut out = [0i32; 2];
        topk_positions(&scores_u, &unsorted, &mut out).unwrap();
        assert_eq!(out, [9, 10]);
    }
}
