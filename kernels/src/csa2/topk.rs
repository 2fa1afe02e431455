//! Top-k selection with the reference's sentinel semantics (spec §4 indexer).
//!
//! The reference takes `scores.topk(min(k, W), sorted=False).indices.sort()` and then sets
//! every selected position whose score is not finite to `-1` **in place**. With fewer than `k`
//! finite scores the `-1`s therefore sit wherever the masked picks sorted, possibly between
//! valid indices; only the **set** of valid indices is meaningful, and `-1` never attends.
//! Rows here are always `k` wide: with `W < k` the missing slots are `-1` too.
//!
//! Ties have no defined order in the reference (torch's introselect looks at values only);
//! both forms here break them towards the lower index, deterministically.

use std::cmp::Ordering;

use super::{Error, check_len};

/// The `-1` slot.
pub const NONE: i32 = -1;

/// Descending score, NaN as `-inf`, ties to the lower index.
fn order(scores: &[f32]) -> impl Fn(&usize, &usize) -> Ordering + '_ {
    let key = |i: usize| {
        let s = scores[i];
        if s.is_nan() { f32::NEG_INFINITY } else { s }
    };
    move |&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b))
}

fn check(scores: &[f32], k: usize, out: &[i32]) -> Result<(), Error> {
    check_len("top-k output row (k slots)", k, out.len())?;
    if scores.len() > i32::MAX as usize {
        return Err(Error::Param {
            what: "top-k scores",
            reason: format!("{} positions do not fit the i32 index type", scores.len()),
        });
    }
    Ok(())
}

/// Reference: sorts every position by score, takes `min(k, W)`, sorts the picks ascending and
/// replaces non-finite picks by `-1` in place; pads with `-1` to `k` slots.
pub fn topk_ref(scores: &[f32], k: usize, out: &mut [i32]) -> Result<(), Error> {
    check(scores, k, out)?;
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(order(scores));
    idx.truncate(k.min(scores.len()));
    idx.sort_unstable();
    out.fill(NONE);
    for (o, &i) in out.iter_mut().zip(&idx) {
        if scores[i].is_finite() {
            *o = i as i32;
        }
    }
    Ok(())
}

/// Fast: selects among the positions with a score above `-inf` only (an `O(W)` partial
/// selection), then writes the canonical layout: valid indices ascending, then `-1`s. The set
/// of valid indices equals [`topk_ref`]'s.
pub fn topk(scores: &[f32], k: usize, out: &mut [i32]) -> Result<(), Error> {
    check(scores, k, out)?;
    let mut idx: Vec<usize> = (0..scores.len())
        .filter(|&i| scores[i] > f32::NEG_INFINITY)
        .collect();
    if idx.len() > k {
        if k == 0 {
            idx.clear();
        } else {
            idx.select_nth_unstable_by(k - 1, order(scores));
            idx.truncate(k);
        }
    }
    idx.retain(|&i| scores[i].is_finite());
    idx.sort_unstable();
    out.fill(NONE);
    for (o, &i) in out.iter_mut().zip(&idx) {
        *o = i as i32;
    }
    Ok(())
}

/// Rewrites a top-k row into the canonical layout (valid indices ascending, then `-1`s), the
/// form `topk_indices_canonical` records.
pub fn canonicalize(row: &mut [i32]) {
    row.sort_unstable_by_key(|&i| if i < 0 { i64::MAX } else { i64::from(i) });
    for v in row.iter_mut() {
        if *v < 0 {
            *v = NONE;
        }
    }
}
