//! RMSNorm (spec §4: `q_norm`, `kv_norm`, the compressor's `norm`, the indexer's `k_norm`).
//!
//! `y = w ⊙ (x · (mean(x²) + eps)^-1/2)` per row, in f32, as the reference computes it (its
//! RMSNorm upcasts to f32, takes the mean of squares, multiplies by `rsqrt`, then by the
//! weight). The released eps is 1e-20, so the eps only matters for an all-zero row.

use super::{Error, check_len};

fn check(x: &[f32], weight: &[f32], out: &[f32]) -> Result<usize, Error> {
    let d = weight.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(Error::Param {
            what: "rms_norm input",
            reason: format!("{} values are not whole rows of the weight's {d}", x.len()),
        });
    }
    check_len("rms_norm output", x.len(), out.len())?;
    Ok(d)
}

/// Reference RMSNorm of every `weight.len()`-wide row of `x`: squares summed in order.
pub fn rms_norm_ref(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), Error> {
    let d = check(x, weight, out)?;
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mut ss = 0f32;
        for &v in row {
            ss += v * v;
        }
        let r = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = w * (v * r);
        }
    }
    Ok(())
}

/// Fast RMSNorm: eight independent partial sums of squares (vectorizable), then the same
/// scaling as [`rms_norm_ref`]. Differs from it only by the order of the sum of squares
/// (relative difference of the scale below `d · 2^-24`). May run in place (`x` copied into
/// `out` first via [`rms_norm_in_place`]).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), Error> {
    let d = check(x, weight, out)?;
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let r = inv_rms(row, eps);
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = w * (v * r);
        }
    }
    Ok(())
}

/// [`rms_norm`] over `x` in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) -> Result<(), Error> {
    let d = weight.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(Error::Param {
            what: "rms_norm input",
            reason: format!("{} values are not whole rows of the weight's {d}", x.len()),
        });
    }
    for row in x.chunks_exact_mut(d) {
        let r = inv_rms(row, eps);
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = w * (*v * r);
        }
    }
    Ok(())
}

#[inline]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mut acc = [0f32; 8];
    let (chunks, rest) = row.as_chunks::<8>();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(rest) {
        *a += v * v;
    }
    let ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}
