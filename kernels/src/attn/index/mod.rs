//! The indexer scan: `I(s) = sum_h w[h] * relu(q[h] . k[s])` over MXFP4 keys (spec §4, §5.3).

use kvstack_firmware_interface::element::E2M1_TIMES_TWO_I8;
use kvstack_firmware_interface::{EntryFormat, IndexMxfp4Entry};
use zerocopy::FromZeros;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod tiles;

#[cfg(all(test, target_arch = "x86_64"))]
pub(super) use avx2::tile_accepted;
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) use avx512::{tile16_accepted, tile16_fused_accepted};

use super::{AttnError, INDEX_DIM, INDEX_HEADS, Paged, thread_count, verified};
use crate::SimdLevel;
use crate::level::Verified;
#[cfg(target_arch = "x86_64")]
use crate::level::Vnni;

/// An indexer query for one token: 32 heads of 128 values in MXFP4 (spec §5.3) and the 32 f32
/// head weights, prepared once for the integer kernels.
///
/// # Exactness of the fast path
///
/// Per 32-element block `b` the integer sum `I_b = sum(2 q_i * 2 k_i)` is exact (`|I_b| <=
/// 4608 < 2^13`), and the block's term is `t_b = I_b * 2^(eq_b + ek_b - 256)`. The AVX2 kernel
/// forms `t_0 + t_1` and `t_2 + t_3` in f32 and rounds their sum once, which equals the f64
/// combine of [`crate::dot_mxfp4_mxfp4`] whenever every term is a normal f32 and the pair sums
/// are exact. Sufficient, and checked per tile of eight keys: every query scale byte in
/// `1..=254`; for every key, `eq + ek` in `130..=368` for all block pairs; and the spread of the
/// key's four exponents plus the spread of the head's four exponents at most 10 (then every
/// sum of terms spans at most 24 significant bits). Real activations have spreads of a few
/// units; a tile that fails the check is scored by the exact f64 path instead, so the result is
/// bit-identical either way.
#[derive(Clone)]
pub struct IndexQuery {
    pub(crate) heads: [IndexMxfp4Entry; INDEX_HEADS],
    pub(crate) weights: [f32; INDEX_HEADS],
    pub(crate) prep: Box<Prepared>,
}

impl std::fmt::Debug for IndexQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexQuery")
            .field("weights", &self.weights)
            .field("fast_path", &self.prep.fast.is_some())
            .finish_non_exhaustive()
    }
}

/// The query in the layout of the integer kernel (lanes are heads: vector `r` holds heads
/// `8r..8r+8`).
#[derive(Clone)]
pub(crate) struct Prepared {
    /// `qv[b][g][r]`: lane `i` holds the four `2 * e2m1` values (i8) of head `8r + i` for
    /// group `g` of block `b`, elements [`group_element`]`(b, g, 0..4)`.
    pub(crate) qv: [[[[u8; 32]; 4]; 8]; 4],
    /// `offsq[b][r]`: `-12 * sum(2 q_i) * 2^(eq - 127)` over block `b` of each head (exact).
    /// Keys are decoded as `2 k + 12` (unsigned bytes for `vpmaddubsw`), so `12 * sum(2 q_i)`
    /// is removed from each block sum, in the same fused multiply-add that applies the scale.
    pub(crate) offsq: [[[f32; 8]; 4]; 4],
    /// `sq[b][r]`: `2^(eq - 127)` of block `b` of each head.
    pub(crate) sq: [[[f32; 8]; 4]; 4],
    /// The head weights, eight per vector.
    pub(crate) w: [[f32; 8]; 4],
    /// Key scale bytes the fast path accepts for this query; `None` if the query itself has a
    /// scale byte outside `1..=241` or a head spans more than 10 exponents.
    pub(crate) fast: Option<FastLimits>,
    /// The query for the VNNI kernel, whose lanes are keys ([`avx512`]):
    /// `kq[h][b][g]` is the four `2 * e2m1` bytes (i8) of head `h` for group `g` of block `b`,
    /// elements [`key_lane_element`]`(b, g, 0..4)`, broadcast against sixteen keys at once.
    pub(crate) kq: [[[u32; 8]; 4]; INDEX_HEADS],
    /// `koff[h][b]`: `-12 * sum(2 q_i)` over block `b` of head `h`, the integer accumulator's
    /// start (it removes the `+ 12` of the decoded keys).
    pub(crate) koff: [[i32; 4]; INDEX_HEADS],
    /// `ksq[h][b]`: `2^(eq - 127)` of block `b` of head `h`.
    pub(crate) ksq: [[f32; 4]; INDEX_HEADS],
    /// The head weights, one per head.
    pub(crate) kw: [f32; INDEX_HEADS],
    /// The query for the fused VNNI kernel (one integer sum per head over all four blocks,
    /// [`avx512`]): `fq[h][8b + g]` is `kq[h][b][g]` with every byte shifted left by
    /// `eq_b - min_b(eq_b)` of head `h` (at most [`FUSED_SPAN`], so `|byte| <= 96`).
    pub(crate) fq: [[u32; 32]; INDEX_HEADS],
    /// `foff[h]`: `-FUSED_KEY_OFFSET * sum` of head `h`'s shifted bytes, the accumulator's
    /// start (it removes the offset of the decoded keys).
    pub(crate) foff: [i32; INDEX_HEADS],
    /// `fw[h]`: `w[h] * 2^(min_b(eq_b) - 127)` (exact).
    pub(crate) fw: [f32; INDEX_HEADS],
    /// Smallest key scale bytes the fused kernel accepts for this query; `None` if it cannot
    /// serve the query at all (see [`FusedLimits`]).
    pub(crate) fused: Option<FusedLimits>,
}

/// Largest spread of the four scale exponents of one query head, or of one key, that the
/// fused VNNI kernel folds into its 8-bit operands: `2 * e2m1` is at most 12 in magnitude, so
/// shifted by 3 it still fits a signed byte (96), and a key's `(2k << 3) + 96` an unsigned one.
pub(crate) const FUSED_SPAN: i32 = 3;

/// What the fused kernel adds to every shifted key value (`2k << t`, `|.| <= 96`) to make it
/// an unsigned byte for `vpdpbusd`.
pub(crate) const FUSED_KEY_OFFSET: i32 = 96;

/// Bounds on the smallest scale byte `ekmin` of each key of a tile for the fused kernel,
/// beyond the fast path's ([`FastLimits`]).
///
/// # Why the fused result is bit-identical
///
/// Under the fast path's conditions a head's dot `d` is exact in f32 and equals `I * u` with
/// `I` the integer the fused kernel sums (`sum_b I_b * 2^(s_b + t_b)`, `|I| < 2^21`, exactly
/// converted) and `u = 2^(eqmin + ekmin - 256)`. The reference rounds `T = w * relu(d)` and
/// sums the `T` in head order; the kernel rounds `U = relu(I) * fw` (`fw = w * 2^(eqmin -
/// 127)`, exact) and sums the `U` in the same order, then multiplies by `2^(ekmin - 129)`.
/// Scaling by a power of two commutes with every rounding as long as no rounded value is
/// subnormal or infinite in either domain (a sum that cancels into the subnormal range is
/// exact in both). The bounds keep every nonzero `T` and `U` within `[2^-126, 2^120)`:
/// `U` through a per-query check of `fw`, `T` through `ekmin` in `lo..=hi`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedLimits {
    /// Smallest allowed `ekmin`.
    pub(crate) lo: i32,
    /// Largest allowed `ekmin`.
    pub(crate) hi: i32,
}

/// Element (0..128) of byte `j` of group `g` (0..8) of block `b` in the VNNI kernel's decode
/// order: the kernel transposes sixteen keys so that vector `dw` (0..16) holds packed bytes
/// `4dw..4dw+4` of every key, then splits low nibbles (even elements `8dw + 2j`) from high
/// nibbles (odd elements). Block `b` is `dw = 4b..4b+4`; group `g` is `dw = 4b + g / 2`, low
/// nibbles for even `g`.
pub(crate) const fn key_lane_element(b: usize, g: usize, j: usize) -> usize {
    8 * (4 * b + g / 2) + 2 * j + g % 2
}

/// Bounds on the key scale bytes of a tile for the f32 fast path (see [`IndexQuery`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FastLimits {
    /// Smallest allowed key scale byte.
    pub(crate) kmin: i32,
    /// Largest allowed key scale byte.
    pub(crate) kmax: i32,
    /// Largest allowed spread (max - min) of one key's four scale bytes.
    pub(crate) kspan: i32,
}

/// Element (0..128) of byte `j` of group `g` (0..8) of block `b` in the AVX2 kernel's decode
/// order.
///
/// The kernel splits a key's packed bytes `32c..32c+32` (`c = b / 2`) into their low nibbles
/// (even elements) and high nibbles (odd elements); 4-byte group `dw` of either covers packed
/// bytes `32c + 4dw .. +4`, i.e. elements `64c + 8dw + 2j (+1)`. Block `b` is made of
/// `dw = 4(b % 2) .. +4`, low nibbles first (`g < 4`), then high.
pub(crate) const fn group_element(b: usize, g: usize, j: usize) -> usize {
    let c = b / 2;
    let dw = 4 * (b % 2) + g % 4;
    let nib = g / 4;
    64 * c + 8 * dw + 2 * j + nib
}

/// `2 * e2m1` of element `i` of an MXFP4 row.
fn x2(e: &IndexMxfp4Entry, i: usize) -> i8 {
    let byte = e.values[i / 2];
    let code = if i.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    };
    E2M1_TIMES_TWO_I8[usize::from(code)]
}

impl Prepared {
    fn new(heads: &[IndexMxfp4Entry; INDEX_HEADS], weights: &[f32; INDEX_HEADS]) -> Prepared {
        let mut p = Prepared {
            qv: [[[[0; 32]; 4]; 8]; 4],
            offsq: [[[0.0; 8]; 4]; 4],
            sq: [[[0.0; 8]; 4]; 4],
            w: std::array::from_fn(|r| std::array::from_fn(|i| weights[8 * r + i])),
            fast: None,
            kq: [[[0; 8]; 4]; INDEX_HEADS],
            koff: [[0; 4]; INDEX_HEADS],
            ksq: [[0.0; 4]; INDEX_HEADS],
            kw: *weights,
            fq: [[0; 32]; INDEX_HEADS],
            foff: [0; INDEX_HEADS],
            fw: [0.0; INDEX_HEADS],
            fused: None,
        };
        let (mut qmin, mut qmax, mut qspan) = (255i32, 0i32, 0i32);
        for (h, q) in heads.iter().enumerate() {
            let (r, i) = (h / 8, h % 8);
            for b in 0..4 {
                let mut sum = 0i32;
                for g in 0..8 {
                    for j in 0..4 {
                        let v = x2(q, group_element(b, g, j));
                        p.qv[b][g][r][4 * i + j] = v as u8;
                        sum += i32::from(v);
                    }
                }
                let sq = kvstack_firmware_interface::element::ue8m0_to_f32(q.scales[b]);
                p.sq[b][r][i] = sq;
                p.ksq[h][b] = sq;
                p.koff[h][b] = -12 * sum;
                for g in 0..8 {
                    let v: [u8; 4] =
                        std::array::from_fn(|j| x2(q, key_lane_element(b, g, j)) as u8);
                    p.kq[h][b][g] = u32::from_le_bytes(v);
                }
                // |12 * sum| <= 4608 < 2^13: exact in f32, and so is its product with the
                // power of two (normal on the fast path; the slow path does not read it).
                p.offsq[b][r][i] = -(12 * sum) as f32 * sq;
            }
            let e = q.scales.map(i32::from);
            let (lo, hi) = (
                e.iter().copied().min().unwrap_or(0),
                e.iter().copied().max().unwrap_or(0),
            );
            qmin = qmin.min(lo);
            qmax = qmax.max(hi);
            qspan = qspan.max(hi - lo);
        }
        if qmin >= 1 && qmax <= 241 && qspan <= 10 {
            p.fast = Some(FastLimits {
                kmin: (130 - qmin).max(3),
                kmax: (368 - qmax).min(254),
                kspan: 10 - qspan,
            });
            p.fused = p.prepare_fused(heads, weights);
        }
        p
    }

    /// Fills the fused kernel's query (`fq`, `foff`, `fw`) and returns its limits, or `None`
    /// when a head spans more than [`FUSED_SPAN`] exponents or a weight is outside the range
    /// the exactness argument of [`FusedLimits`] covers.
    fn prepare_fused(
        &mut self,
        heads: &[IndexMxfp4Entry; INDEX_HEADS],
        weights: &[f32; INDEX_HEADS],
    ) -> Option<FusedLimits> {
        let (mut lo, mut hi) = (i32::MIN, i32::MAX);
        for (h, (q, &w)) in heads.iter().zip(weights).enumerate() {
            let e = q.scales.map(i32::from);
            let emin = e.iter().copied().min()?;
            if e.iter().any(|&x| x - emin > FUSED_SPAN) || !(w == 0.0 || w.is_normal()) {
                return None;
            }
            let mut sum = 0i32;
            for (b, &eb) in e.iter().enumerate() {
                let shift = eb - emin;
                for g in 0..8 {
                    let v: [u8; 4] = std::array::from_fn(|j| {
                        let x = i32::from(x2(q, key_lane_element(b, g, j))) << shift;
                        sum += x;
                        x as i8 as u8
                    });
                    self.fq[h][8 * b + g] = u32::from_le_bytes(v);
                }
            }
            self.foff[h] = -FUSED_KEY_OFFSET * sum;
            if w == 0.0 {
                self.fw[h] = w;
                continue;
            }
            // `a`: the exponent of |w| (w is normal), so 2^a <= |w| < 2^(a + 1).
            let a = ((w.to_bits() >> 23) & 0xFF) as i32 - 127;
            // U = relu(I) * fw with 1 <= |I| < 2^21: 2^(a + emin - 127) <= |U| < 2^(a + emin
            // - 105), inside [2^-126, 2^120].
            if a + emin < 1 || a + emin > 225 {
                return None;
            }
            self.fw[h] = w * f32::from_bits(((emin) as u32) << 23);
            // T = U * 2^(ekmin - 129): the same bounds for T.
            lo = lo.max(130 - a - emin);
            hi = hi.min(354 - a - emin);
        }
        (lo <= hi).then_some(FusedLimits { lo, hi })
    }
}

impl IndexQuery {
    /// A query from its 32 MXFP4 heads and f32 head weights (`weights_proj(h) * 128^-0.5 *
    /// 32^-0.5`, spec §4).
    pub fn new(heads: &[IndexMxfp4Entry; INDEX_HEADS], weights: &[f32; INDEX_HEADS]) -> Self {
        IndexQuery {
            heads: *heads,
            weights: *weights,
            prep: Box::new(Prepared::new(heads, weights)),
        }
    }

    /// Quantizes 32 x 128 f32 query values (head-major, post-RoPE) to MXFP4 and prepares them.
    ///
    /// # Errors
    ///
    /// [`AttnError::LengthMismatch`] unless `q.len() == 32 * 128`; [`AttnError::NonFinite`]
    /// for a NaN or infinite value.
    pub fn from_f32(q: &[f32], weights: &[f32; INDEX_HEADS]) -> Result<Self, AttnError> {
        if q.len() != INDEX_HEADS * INDEX_DIM {
            return Err(AttnError::LengthMismatch {
                what: "indexer query f32 values (32 heads x 128)",
                expected: INDEX_HEADS * INDEX_DIM,
                actual: q.len(),
            });
        }
        let mut heads = [IndexMxfp4Entry::new_zeroed(); INDEX_HEADS];
        let bytes = zerocopy::IntoBytes::as_mut_bytes(&mut heads[..]);
        crate::quantize(EntryFormat::IndexMxfp4, q, bytes)?;
        Ok(IndexQuery::new(&heads, weights))
    }

    /// The MXFP4 query heads.
    pub fn heads(&self) -> &[IndexMxfp4Entry; INDEX_HEADS] {
        &self.heads
    }

    /// The head weights.
    pub fn weights(&self) -> &[f32; INDEX_HEADS] {
        &self.weights
    }

    /// Whether the integer fast path can serve this query (see the type's documentation).
    pub fn has_fast_path(&self) -> bool {
        self.prep.fast.is_some()
    }
}

/// The weighted head sum of the index score: `T_h = w[h] * relu(d[h])` rounded to f32, summed
/// in head order in f32 starting from the first head's term (`s = T_0; s = s + T_h`), the order
/// of the public reference's recorded scores.
pub(crate) fn head_sum(d: &[f32; INDEX_HEADS], w: &[f32; INDEX_HEADS]) -> f32 {
    let mut s = w[0] * d[0].max(0.0);
    for (&wh, &dh) in w.iter().zip(d).skip(1) {
        s += wh * dh.max(0.0);
    }
    s
}

/// Scores one key exactly as the reference does: the exact dots, then [`head_sum`]. This is
/// the portable path and the fallback of the fast one.
pub(crate) fn score_exact(q: &IndexQuery, k: &IndexMxfp4Entry) -> f32 {
    let mut d = [0f32; INDEX_HEADS];
    for (head, dh) in q.heads.iter().zip(d.iter_mut()) {
        crate::portable::dot_mxfp4_mxfp4(head, std::slice::from_ref(k), std::slice::from_mut(dh));
    }
    head_sum(&d, &q.weights)
}

/// Scores `(destination, key)` items into `out[destination]` with the exact (portable) path.
fn score_items<'a>(
    q: &IndexQuery,
    items: impl Iterator<Item = (usize, &'a IndexMxfp4Entry)>,
    out: &mut [f32],
) {
    for (d, k) in items {
        if let Some(o) = out.get_mut(d) {
            *o = score_exact(q, k);
        }
    }
}

/// Below this many keys per thread, extra threads cost more than they save.
const MIN_KEYS_PER_THREAD: usize = 2048;

/// Pieces per thread a scan is cut into, so that a thread that runs slower takes fewer.
const PIECES_PER_THREAD: usize = 8;

/// Keys per piece of a scan of `n` keys on `t` threads: about [`PIECES_PER_THREAD`] pieces
/// per thread, at least [`MIN_KEYS_PER_THREAD`] keys each, and whole tiles of 16 so that only
/// the last piece has a partial tile.
fn share_chunk(n: usize, t: usize) -> usize {
    if t <= 1 {
        return n.max(1);
    }
    n.div_ceil(t * PIECES_PER_THREAD)
        .max(MIN_KEYS_PER_THREAD)
        .next_multiple_of(16)
}

/// Runs `work` on every item on `t` threads (this one and `t - 1` workers of rayon's pool),
/// each taking the next item as it finishes one. Pieces handed out this way, rather than one
/// equal share per thread, let a thread that runs slower (a vCPU whose host core is busy, a
/// smaller core) take fewer pieces instead of holding up the call: on the 2-vCPU VMs measured,
/// one vCPU often ran 1.4x slower than the other for a while.
fn share<I: Send>(t: usize, items: impl Iterator<Item = I> + Send, work: impl Fn(I) + Sync) {
    let queue = std::sync::Mutex::new(items);
    let take = || queue.lock().unwrap_or_else(|e| e.into_inner()).next();
    let worker = || {
        while let Some(item) = take() {
            work(item);
        }
    };
    let worker = &worker;
    crate::par::run_tasks((0..t).map(|_| move || worker()));
}

/// Index scores of every stored key: `out[s] = I(s)` for `s < visible`, `-inf` for the
/// invisible rest (`visible` is the count of visible entries, `(t + 1) / ratio` for query
/// position `t`, spec §4). `threads` contiguous ranges are scored in parallel (1 = the calling
/// thread only); the result does not depend on `threads`.
///
/// # Errors
///
/// [`AttnError::LengthMismatch`] unless `out.len() == keys.len()`;
/// [`AttnError::PositionOutOfRange`] if `visible > keys.len()`.
pub fn indexer_scores(
    query: &IndexQuery,
    keys: Paged<'_, IndexMxfp4Entry>,
    visible: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<(), AttnError> {
    scan(Verified::detected(), query, keys, visible, threads, out)
}

/// [`indexer_scores`] on a given level.
///
/// # Errors
///
/// As [`indexer_scores`], plus [`AttnError::UnsupportedLevel`] for a level this CPU cannot run.
pub fn indexer_scores_with(
    level: SimdLevel,
    query: &IndexQuery,
    keys: Paged<'_, IndexMxfp4Entry>,
    visible: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<(), AttnError> {
    scan(verified(Some(level))?, query, keys, visible, threads, out)
}

pub(crate) fn scan(
    level: Verified,
    query: &IndexQuery,
    keys: Paged<'_, IndexMxfp4Entry>,
    visible: usize,
    threads: usize,
    out: &mut [f32],
) -> Result<(), AttnError> {
    if out.len() != keys.len() {
        return Err(AttnError::LengthMismatch {
            what: "index scores (one per stored key)",
            expected: keys.len(),
            actual: out.len(),
        });
    }
    if visible > keys.len() {
        return Err(AttnError::PositionOutOfRange {
            what: "visible index keys",
            position: visible as i64,
            len: keys.len(),
        });
    }
    let (scored, rest) = out.split_at_mut(visible);
    rest.fill(f32::NEG_INFINITY);
    crate::work::add_index(
        visible as u64,
        INDEX_HEADS as u64,
        INDEX_DIM as u64,
        IndexMxfp4Entry::BYTES as u64,
    );
    let t = thread_count(threads).min(visible.div_ceil(MIN_KEYS_PER_THREAD).max(1));
    let chunk = share_chunk(visible, t);
    #[cfg(target_arch = "x86_64")]
    let vnni = Vnni::detect(level);
    let run = |start: usize, o: &mut [f32]| {
        let runs = keys
            .runs(start..start + o.len())
            .map(move |(p, r)| (p - start, r));
        match level.level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `level` is `Verified` as AVX2 or AVX-512 (which includes AVX2 and FMA),
            // so this CPU has AVX2 and FMA.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe {
                avx2::score_runs(query, runs, vnni, o)
            },
            _ => {
                let items =
                    runs.flat_map(|(d, r)| r.iter().enumerate().map(move |(i, k)| (d + i, k)));
                score_items(query, items, o);
            }
        }
    };
    share(t, scored.chunks_mut(chunk).enumerate(), |(i, o)| {
        run(i * chunk, o);
    });
    Ok(())
}

/// Index scores of the keys at `positions` (a Reindex layer's candidate pool, spec §4):
/// `out[i] = I(positions[i])` when `0 <= positions[i] < visible`, `-inf` otherwise (so `-1`
/// slots score `-inf`). Parallel over `threads` slices of the list; the result does not depend
/// on `threads`.
///
/// # Errors
///
/// [`AttnError::LengthMismatch`] unless `out.len() == positions.len()`;
/// [`AttnError::PositionOutOfRange`] if `visible > keys.len()`.
pub fn indexer_scores_at(
    query: &IndexQuery,
    keys: Paged<'_, IndexMxfp4Entry>,
    visible: usize,
    positions: &[i32],
    threads: usize,
    out: &mut [f32],
) -> Result<(), AttnError> {
    gather(
        Verified::detected(),
        query,
        keys,
        visible,
        positions,
        threads,
        out,
    )
}

/// [`indexer_scores_at`] on a given level.
///
/// # Errors
///
/// As [`indexer_scores_at`], plus [`AttnError::UnsupportedLevel`].
pub fn indexer_scores_at_with(
    level: SimdLevel,
    query: &IndexQuery,
    keys: Paged<'_, IndexMxfp4Entry>,
    visible: usize,
    positions: &[i32],
    threads: usize,
    out: &mut [f32],
) -> Result<(), AttnError> {
    gather(
        verified(Some(level))?,
        query,
        keys,
        visible,
        positions,
        threads,
        out,
    )
}

pub(crate) fn gather(
    level: Verified,
    query: &IndexQuery,
    keys: Paged<'_, IndexMxfp4Entry>,
    visible: usize,
    positions: &[i32],
    threads: usize,
    out: &mut [f32],
) -> Result<(), AttnError> {
    if out.len() != positions.len() {
        return Err(AttnError::LengthMismatch {
            what: "index scores (one per candidate position)",
            expected: positions.len(),
            actual: out.len(),
        });
    }
    if visible > keys.len() {
        return Err(AttnError::PositionOutOfRange {
            what: "visible index keys",
            position: visible as i64,
            len: keys.len(),
        });
    }
    let scored = positions
        .iter()
        .filter(|&&p| usize::try_from(p).is_ok_and(|p| p < visible))
        .count();
    crate::work::add_index(
        scored as u64,
        INDEX_HEADS as u64,
        INDEX_DIM as u64,
        IndexMxfp4Entry::BYTES as u64,
    );
    let t = thread_count(threads).min(positions.len().div_ceil(MIN_KEYS_PER_THREAD).max(1));
    let chunk = share_chunk(positions.len(), t);
    #[cfg(target_arch = "x86_64")]
    let vnni = Vnni::detect(level);
    let run = |pos: &[i32], o: &mut [f32]| {
        o.fill(f32::NEG_INFINITY);
        match level.level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `level` is `Verified` as AVX2 or AVX-512 (which includes AVX2 and FMA),
            // so this CPU has AVX2 and FMA.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe {
                avx2::score_positions(query, keys, visible, pos, vnni, o)
            },
            _ => {
                let items = pos.iter().enumerate().filter_map(|(i, &p)| {
                    let p = usize::try_from(p).ok().filter(|&p| p < visible)?;
                    keys.get(p).map(|k| (i, k))
                });
                score_items(query, items, o);
            }
        }
    };
    share(
        t,
        positions.chunks(chunk).zip(out.chunks_mut(chunk)),
        |(p, o)| {
            run(p, o);
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that `element(b, g, j)` maps the 8 groups x 4 bytes of each block `b` onto
    /// that block's 32 elements, each once.
    fn assert_block_permutation(element: fn(usize, usize, usize) -> usize) {
        for b in 0..4 {
            let mut seen = [false; 32];
            for g in 0..8 {
                for j in 0..4 {
                    let e = element(b, g, j);
                    assert_eq!(e / 32, b, "element {e} outside block {b}");
                    assert!(!seen[e % 32]);
                    seen[e % 32] = true;
                }
            }
        }
    }

    #[test]
    fn group_orders_are_permutations_of_each_block() {
        assert_block_permutation(group_element);
        assert_block_permutation(key_lane_element);
    }
}
