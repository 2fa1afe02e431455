//! Fused dequantize-dot products of queries with stored entries (attention over fp4-global
//! entries, the indexer over mxfp4-index keys), dispatched to a SIMD level.
//!
//! # Accuracy of the f32 dots
//!
//! [`dot_fp4`] and [`dot_mxfp4`] never materialize the dequantized row. Each element's value
//! `v_i = e2m1_i * s_tile` is exact in f32 (at most 6 significant bits), so the only roundings
//! are those of the products and sums. Each level sums in a fixed order, so a result is
//! deterministic for a level, and the `_many` forms equal the single forms bit for bit:
//!
//! - portable: 16 lane accumulators of `q_i * v_i` over the row, then a fixed balanced tree;
//! - AVX2: per tile (16 elements for fp4, 32 for mxfp4) 8-lane FMA partial sums of
//!   `q_i * e2m1_i`, each multiplied by its tile scale into one of four (fp4) or two (mxfp4)
//!   8-lane accumulators, which are added and reduced by a fixed 8-lane tree.
//! - AVX-512: per 32 elements, 16-lane partial sums `q_even * e2m1_even + q_odd * e2m1_odd`
//!   (lanes 0..8 one fp4 tile and 8..16 the next; one mxfp4 block), multiplied by the matching
//!   scales into one of four (fp4) or two (mxfp4) 16-lane accumulators, which are added and
//!   reduced 16 entries at a time by a fixed transposing tree (a lone entry is reduced as a
//!   batch padded with zeros, so it gets the same bits).
//!
//! Levels may therefore differ in the last bits. For every level, barring overflow and
//! underflow (and for `n` the dimension),
//!
//! `|dot - sum(q_i * v_i)| <= (n + 8) * 2^-24 * sum(|q_i * v_i|)`,
//!
//! the classic bound for any summation order with the scale products added in; the actual
//! error is far smaller because the summation trees are shallow. The tests check this bound
//! against an f64 reference. NaN or infinite queries, and NaN scales (E4M3 0x7F/0xFF, UE8M0
//! 255), propagate to the result.

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry};

use crate::level::Verified;
use crate::{Error, SimdLevel, portable};

fn check_out(entries: usize, out: &[f32]) -> Result<(), Error> {
    if out.len() == entries {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what: "dot output f32 values (one per entry)",
            expected: entries,
            actual: out.len(),
        })
    }
}

fn fp4_many(level: Verified, q: &[f32; 512], entries: &[GlobalFp4Entry], out: &mut [f32]) {
    match level.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
        SimdLevel::Avx2 => unsafe { crate::x86::avx2::dot_fp4(q, entries, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
        SimdLevel::Avx512 => unsafe { crate::x86::avx512::dot_fp4(q, entries, out) },
        // Portable, and levels without kernels on this target (never `Verified`).
        _ => portable::dot_fp4(q, entries, out),
    }
}

fn mxfp4_many(level: Verified, q: &[f32; 128], keys: &[IndexMxfp4Entry], out: &mut [f32]) {
    match level.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
        SimdLevel::Avx2 => unsafe { crate::x86::avx2::dot_mxfp4(q, keys, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
        SimdLevel::Avx512 => unsafe { crate::x86::avx512::dot_mxfp4(q, keys, out) },
        _ => portable::dot_mxfp4(q, keys, out),
    }
}

fn mx_mx_many(level: Verified, q: &IndexMxfp4Entry, keys: &[IndexMxfp4Entry], out: &mut [f32]) {
    match level.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
        SimdLevel::Avx2 => unsafe { crate::x86::avx2::dot_mxfp4_mxfp4(q, keys, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and FMA.
        SimdLevel::Avx512 => unsafe { crate::x86::avx512::dot_mxfp4_mxfp4(q, keys, out) },
        _ => portable::dot_mxfp4_mxfp4(q, keys, out),
    }
}

/// Dot product of an f32 query with a dequantized fp4-global entry (spec §5.2), without
/// materializing the entry. See the [module documentation](self) for the error bound.
pub fn dot_fp4(q: &[f32; 512], e: &GlobalFp4Entry) -> f32 {
    let mut out = [0f32];
    fp4_many(Verified::detected(), q, std::slice::from_ref(e), &mut out);
    out[0]
}

/// [`dot_fp4`] of one query with many entries: `out[i] = dot_fp4(q, &entries[i])`, bit for
/// bit. Prepares the query once (a permutation matching the SIMD decode order), so prefer it
/// to calling [`dot_fp4`] in a loop.
///
/// # Errors
///
/// [`Error::LengthMismatch`] if `out.len() != entries.len()`.
pub fn dot_fp4_many(
    q: &[f32; 512],
    entries: &[GlobalFp4Entry],
    out: &mut [f32],
) -> Result<(), Error> {
    check_out(entries.len(), out)?;
    fp4_many(Verified::detected(), q, entries, out);
    Ok(())
}

/// [`dot_fp4`] on a given level.
///
/// # Errors
///
/// [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
pub fn dot_fp4_with(level: SimdLevel, q: &[f32; 512], e: &GlobalFp4Entry) -> Result<f32, Error> {
    let mut out = [0f32];
    fp4_many(Verified::new(level)?, q, std::slice::from_ref(e), &mut out);
    Ok(out[0])
}

/// [`dot_fp4_many`] on a given level.
///
/// # Errors
///
/// As [`dot_fp4_many`], plus [`Error::UnsupportedLevel`].
pub fn dot_fp4_many_with(
    level: SimdLevel,
    q: &[f32; 512],
    entries: &[GlobalFp4Entry],
    out: &mut [f32],
) -> Result<(), Error> {
    let level = Verified::new(level)?;
    check_out(entries.len(), out)?;
    fp4_many(level, q, entries, out);
    Ok(())
}

/// Dot product of an f32 query with a dequantized mxfp4-index key (spec §5.3). See the
/// [module documentation](self) for the error bound.
pub fn dot_mxfp4(q: &[f32; 128], k: &IndexMxfp4Entry) -> f32 {
    let mut out = [0f32];
    mxfp4_many(Verified::detected(), q, std::slice::from_ref(k), &mut out);
    out[0]
}

/// [`dot_mxfp4`] of one query with many keys, bit for bit equal to calling it per key.
///
/// # Errors
///
/// [`Error::LengthMismatch`] if `out.len() != keys.len()`.
pub fn dot_mxfp4_many(
    q: &[f32; 128],
    keys: &[IndexMxfp4Entry],
    out: &mut [f32],
) -> Result<(), Error> {
    check_out(keys.len(), out)?;
    mxfp4_many(Verified::detected(), q, keys, out);
    Ok(())
}

/// [`dot_mxfp4`] on a given level.
///
/// # Errors
///
/// [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
pub fn dot_mxfp4_with(level: SimdLevel, q: &[f32; 128], k: &IndexMxfp4Entry) -> Result<f32, Error> {
    let mut out = [0f32];
    mxfp4_many(Verified::new(level)?, q, std::slice::from_ref(k), &mut out);
    Ok(out[0])
}

/// [`dot_mxfp4_many`] on a given level.
///
/// # Errors
///
/// As [`dot_mxfp4_many`], plus [`Error::UnsupportedLevel`].
pub fn dot_mxfp4_many_with(
    level: SimdLevel,
    q: &[f32; 128],
    keys: &[IndexMxfp4Entry],
    out: &mut [f32],
) -> Result<(), Error> {
    let level = Verified::new(level)?;
    check_out(keys.len(), out)?;
    mxfp4_many(level, q, keys, out);
    Ok(())
}

/// Dot product of two mxfp4-index entries (an indexer query in MXFP4 with a key), computed
/// exactly in integer arithmetic.
///
/// Per 32-element block `b`, `I_b = sum(2 q_i * 2 k_i)` is an exact integer (`2 * e2m1` is an
/// integer in `-12..=12`, see `element::E2M1_TIMES_TWO_I8`), and the block's value is
/// `I_b * 2^(eq_b + ek_b - 254) / 4`, exact in f64. The result is
/// `f32((t_0 + t_1) + (t_2 + t_3))` with the `t_b` added in f64, identical on every level.
/// Those f64 additions are exact, so the result is the **correctly rounded** f32 of the exact
/// dot product, whenever the exponent sums `eq_b + ek_b` of the blocks with `I_b != 0` span at
/// most 38 (the case for any realistic pair of activation vectors). With a wider span the f64
/// additions may round, by at most about 2^-52 of the largest block term, before the final
/// rounding to f32. A scale byte of 255 (the MX NaN) gives NaN; byte 0 is 2^-127 as in
/// `element::ue8m0_to_f32`.
pub fn dot_mxfp4_mxfp4(q: &IndexMxfp4Entry, k: &IndexMxfp4Entry) -> f32 {
    let mut out = [0f32];
    mx_mx_many(Verified::detected(), q, std::slice::from_ref(k), &mut out);
    out[0]
}

/// [`dot_mxfp4_mxfp4`] of one query with many keys, prepared once.
///
/// # Errors
///
/// [`Error::LengthMismatch`] if `out.len() != keys.len()`.
pub fn dot_mxfp4_mxfp4_many(
    q: &IndexMxfp4Entry,
    keys: &[IndexMxfp4Entry],
    out: &mut [f32],
) -> Result<(), Error> {
    check_out(keys.len(), out)?;
    mx_mx_many(Verified::detected(), q, keys, out);
    Ok(())
}

/// [`dot_mxfp4_mxfp4`] on a given level.
///
/// # Errors
///
/// [`Error::UnsupportedLevel`] if this CPU cannot run `level`.
pub fn dot_mxfp4_mxfp4_with(
    level: SimdLevel,
    q: &IndexMxfp4Entry,
    k: &IndexMxfp4Entry,
) -> Result<f32, Error> {
    let mut out = [0f32];
    mx_mx_many(Verified::new(level)?, q, std::slice::from_ref(k), &mut out);
    Ok(out[0])
}

/// [`dot_mxfp4_mxfp4_many`] on a given level.
///
/// # Errors
///
/// As [`dot_mxfp4_mxfp4_many`], plus [`Error::UnsupportedLevel`].
pub fn dot_mxfp4_mxfp4_many_with(
    level: SimdLevel,
    q: &IndexMxfp4Entry,
    keys: &[IndexMxfp4Entry],
    out: &mut [f32],
) -> Result<(), Error> {
    let level = Verified::new(level)?;
    check_out(keys.len(), out)?;
    mx_mx_many(level, q, keys, out);
    Ok(())
}
