//! Sparse attention of one decode token over window (FP8) and selected global (FP4) entries
//! (spec §4, core attention).

use kvstack_firmware_interface::{GlobalFp4Entry, WindowFp8Entry};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;
mod tile;

use super::{AttnError, HEAD_DIM, Paged, thread_count, verified};
use crate::SimdLevel;
use crate::level::Verified;

/// The inputs of [`sparse_attention_decode`] for one token at one layer.
#[derive(Clone, Copy, Debug)]
pub struct SparseAttnInput<'a> {
    /// Query heads, post-RoPE, never quantized (64 in the real model; any count >= 1).
    pub q: &'a [[f32; HEAD_DIM]],
    /// One sink logit per head, or `None` for no sink.
    pub sinks: Option<&'a [f32]>,
    /// The window entries, as runs in any order (a ring buffer gives one or two runs).
    pub window: &'a [&'a [WindowFp8Entry]],
    /// The global (compressed) entries the selection refers to.
    pub global: Paged<'a, GlobalFp4Entry>,
    /// Selected global positions (the top-k); negative slots (`-1`) are skipped. Duplicates
    /// are attended twice, as given.
    pub selected: &'a [i32],
}

/// One attended entry.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KvRow<'a> {
    /// A window entry.
    Fp8(&'a WindowFp8Entry),
    /// A global entry.
    Fp4(&'a GlobalFp4Entry),
}

impl KvRow<'_> {
    /// Address and length of the entry's bytes (for prefetching).
    pub(crate) fn bytes(&self) -> (*const u8, usize) {
        match self {
            KvRow::Fp8(e) => ((*e as *const WindowFp8Entry).cast(), WindowFp8Entry::BYTES),
            KvRow::Fp4(e) => ((*e as *const GlobalFp4Entry).cast(), GlobalFp4Entry::BYTES),
        }
    }
}

/// A thread's softmax state over its share of the entries, for `hp` (padded) heads: running
/// maximum of the scaled logits `m`, denominator `l` (relative to `m`) and unnormalized output
/// `o` (`hp x 512`, relative to `m`).
pub(crate) struct Partial {
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    pub(crate) o: Vec<tile::V8>,
}

impl Partial {
    pub(crate) fn new(hp: usize) -> Self {
        Partial {
            m: vec![f32::NEG_INFINITY; hp],
            l: vec![0.0; hp],
            o: tile::zeroed(hp * HEAD_DIM),
        }
    }
}

/// `512^-0.5 = 2^-4.5`, the logit scale (spec §4), correctly rounded to f32 (`1/sqrt(2)`
/// rounded, then an exact division by 16).
pub(crate) const LOGIT_SCALE: f32 = std::f32::consts::FRAC_1_SQRT_2 / 16.0;

/// Single-head sparse attention for one decode token: for every head `h`,
/// `out[h] = sum_j p_j v_j` with `p = softmax([q_h . k_j * 512^-0.5 for j] ++ [sink_h])`
/// restricted to the entries (the sink column has value zero), `V = K`, over the window
/// entries and the selected global entries. With no entries and no sink the output is zero.
///
/// `threads` (>= 1) tasks share the work: first the heads, in groups of 32 (each group's
/// output is computed exactly as a single thread computes it, so with at most one thread per
/// group the result does not depend on the thread count); threads beyond that split each
/// group's entries and merge their partial softmax states, which changes the result only
/// through f32 rounding (see the module tests for the error bound against an f64 reference).
///
/// # Errors
///
/// [`AttnError::LengthMismatch`] if `out` or the sinks do not have one row or value per head;
/// [`AttnError::PositionOutOfRange`] for a selected position past the global entries;
/// [`AttnError::Internal`] if a kernel finds one of its own invariants broken (a bug).
pub fn sparse_attention_decode(
    input: &SparseAttnInput<'_>,
    threads: usize,
    out: &mut [[f32; HEAD_DIM]],
) -> Result<(), AttnError> {
    decode(Verified::detected(), input, threads, out)
}

/// [`sparse_attention_decode`] on a given level.
///
/// # Errors
///
/// As [`sparse_attention_decode`], plus [`AttnError::UnsupportedLevel`].
pub fn sparse_attention_decode_with(
    level: SimdLevel,
    input: &SparseAttnInput<'_>,
    threads: usize,
    out: &mut [[f32; HEAD_DIM]],
) -> Result<(), AttnError> {
    decode(verified(Some(level))?, input, threads, out)
}

/// Resolves the attended rows: the window runs in order, then the selected global entries.
pub(crate) fn gather_rows<'a>(input: &SparseAttnInput<'a>) -> Result<Vec<KvRow<'a>>, AttnError> {
    let nw: usize = input.window.iter().map(|r| r.len()).sum();
    let mut rows = Vec::with_capacity(nw + input.selected.len());
    for run in input.window {
        rows.extend(run.iter().map(KvRow::Fp8));
    }
    for &p in input.selected {
        let Ok(pos) = usize::try_from(p) else {
            continue;
        };
        let e = input.global.get(pos).ok_or(AttnError::PositionOutOfRange {
            what: "selected global entries",
            position: i64::from(p),
            len: input.global.len(),
        })?;
        rows.push(KvRow::Fp4(e));
    }
    Ok(rows)
}

pub(crate) fn decode(
    level: Verified,
    input: &SparseAttnInput<'_>,
    threads: usize,
    out: &mut [[f32; HEAD_DIM]],
) -> Result<(), AttnError> {
    let heads = input.q.len();
    if out.len() != heads {
        return Err(AttnError::LengthMismatch {
            what: "attention output rows (one per query head)",
            expected: heads,
            actual: out.len(),
        });
    }
    if let Some(s) = input.sinks
        && s.len() != heads
    {
        return Err(AttnError::LengthMismatch {
            what: "sink logits (one per query head)",
            expected: heads,
            actual: s.len(),
        });
    }
    let rows = gather_rows(input)?;
    let stored: usize = rows
        .iter()
        .map(|r| match r {
            KvRow::Fp8(_) => std::mem::size_of::<WindowFp8Entry>(),
            KvRow::Fp4(_) => std::mem::size_of::<GlobalFp4Entry>(),
        })
        .sum();
    crate::work::add_attention((2 * rows.len() * heads * HEAD_DIM) as u64, stored as u64);
    let plan = Split::new(heads, rows.len(), thread_count(threads));
    // Head groups run as tasks of `run_tasks` (the first on this thread, the others on the
    // worker pool, see `thread_count`); a task's panic (a bug) is passed on.
    let mut outs: Vec<(usize, &mut [[f32; HEAD_DIM]])> = Vec::with_capacity(plan.groups);
    let mut rest = out;
    let mut h0 = 0;
    while !rest.is_empty() {
        let (g, r) = rest.split_at_mut(plan.group_heads.min(rest.len()));
        let n = g.len();
        outs.push((h0, g));
        h0 += n;
        rest = r;
    }
    let rows = &rows[..];
    let mut done: Vec<Result<(), AttnError>> = outs.iter().map(|_| Ok(())).collect();
    crate::par::run_tasks(
        outs.into_iter().zip(done.iter_mut()).map(|((h0, o), d)| {
            move || *d = attend_group(level, input, h0, rows, plan.row_chunks, o)
        }),
    );
    done.into_iter().collect()
}

/// How one decode call is cut into tasks: heads into groups (each task transposes its own
/// queries and owns its output rows, so nothing is merged across groups), then, when there
/// are more threads than groups, each group's rows into chunks whose partial softmax states
/// are merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Split {
    /// Heads per group (the last group may have fewer).
    pub(crate) group_heads: usize,
    /// Number of head groups.
    pub(crate) groups: usize,
    /// Row chunks per group.
    pub(crate) row_chunks: usize,
}

impl Split {
    /// Groups of [`GROUP_HEADS`] heads (the widest logit kernel), at most one per thread,
    /// then the threads left over split each group's rows, keeping at least
    /// [`MIN_ROWS_PER_THREAD`] rows per chunk.
    pub(crate) fn new(heads: usize, rows: usize, threads: usize) -> Self {
        let threads = threads.max(1);
        let groups = heads.div_ceil(GROUP_HEADS).clamp(1, threads);
        // Heads per group, a multiple of 16 (the kernels' head vector) unless one group.
        let group_heads = if groups == 1 {
            heads.max(1)
        } else {
            heads.div_ceil(groups).next_multiple_of(16)
        };
        let groups = heads.div_ceil(group_heads).max(1);
        let row_chunks = (threads / groups)
            .min(rows.div_ceil(MIN_ROWS_PER_THREAD))
            .max(1);
        Split {
            group_heads,
            groups,
            row_chunks,
        }
    }
}

/// Heads per task when the threads allow: the 32 heads of the widest logit kernel.
const GROUP_HEADS: usize = 32;

/// Fewer rows than this per thread run on fewer threads.
const MIN_ROWS_PER_THREAD: usize = 96;

/// One head group (heads `h0..h0 + out.len()`): its rows in `chunks` pieces (the first on
/// this thread), partial states merged with the group's sinks into `out`.
fn attend_group(
    level: Verified,
    input: &SparseAttnInput<'_>,
    h0: usize,
    rows: &[KvRow<'_>],
    chunks: usize,
    out: &mut [[f32; HEAD_DIM]],
) -> Result<(), AttnError> {
    let heads = h0..h0 + out.len();
    let q = input.q.get(heads.clone()).unwrap_or_default();
    let sinks = input.sinks.and_then(|s| s.get(heads));
    let prep = Prep::new(level, q);
    let chunk = rows.len().div_ceil(chunks.max(1)).max(1);
    let pieces: Vec<&[KvRow<'_>]> = rows.chunks(chunk).collect();
    let mut slots: Vec<Option<Result<Partial, AttnError>>> =
        (0..pieces.len()).map(|_| None).collect();
    let prep = &prep;
    crate::par::run_tasks(
        slots
            .iter_mut()
            .zip(&pieces)
            .map(|(slot, c)| move || *slot = Some(attend(level, prep, c))),
    );
    let mut parts = slots
        .into_iter()
        .flatten()
        .collect::<Result<Vec<Partial>, _>>()?;
    if parts.is_empty() {
        parts.push(Partial::new(prep.hp));
    }
    merge(&parts, sinks, out);
    Ok(())
}

/// Queries prepared for a level: the AVX2 kernels read them transposed (`qt[d][h]`, heads
/// padded to a multiple of 16 with zeros), the portable path as given.
pub(crate) struct Prep<'a> {
    pub(crate) q: &'a [[f32; HEAD_DIM]],
    pub(crate) hp: usize,
    pub(crate) qt: Vec<tile::V8>,
}

impl<'a> Prep<'a> {
    fn new(level: Verified, q: &'a [[f32; HEAD_DIM]]) -> Self {
        let hp = q.len().next_multiple_of(16);
        let qt = match level.level() {
            SimdLevel::Avx2 | SimdLevel::Avx512 => tile::transpose_q(q, hp),
            _ => Vec::new(),
        };
        Prep { q, hp, qt }
    }
}

/// One thread's share: its rows into a fresh partial state.
///
/// # Errors
///
/// [`AttnError::Internal`] if a SIMD kernel found its buffers too short for the heads (the
/// state and `prep` are made for the same `hp` here, so never unless the code is wrong).
fn attend(level: Verified, prep: &Prep<'_>, rows: &[KvRow<'_>]) -> Result<Partial, AttnError> {
    let mut st = Partial::new(prep.hp);
    let ran = match level.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX2, so this CPU has AVX2 and FMA.
        SimdLevel::Avx2 => unsafe { avx2::attend(prep, rows, &mut st) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level` is `Verified` as AVX-512, so this CPU has AVX-512 F/BW/VL, AVX2 and
        // FMA.
        SimdLevel::Avx512 => unsafe { avx512::attend(prep, rows, &mut st) },
        _ => {
            portable::attend(prep.q, rows, &mut st);
            true
        }
    };
    debug_assert!(ran, "sparse attention kernel bounds");
    if ran {
        Ok(st)
    } else {
        Err(AttnError::Internal {
            what: "a sparse attention kernel found its tile buffers too short for the heads",
        })
    }
}

/// Combines the partial states and the sinks: with `M = max(m_t, sink)`,
/// `out = sum_t e^(m_t - M) o_t / (sum_t e^(m_t - M) l_t + e^(sink - M))`.
fn merge(parts: &[Partial], sinks: Option<&[f32]>, out: &mut [[f32; HEAD_DIM]]) {
    // Every state is made for the group's padded heads (`Partial::new(prep.hp)`).
    debug_assert!(
        parts
            .iter()
            .all(|p| p.m.len() >= out.len() && p.l.len() >= out.len())
    );
    for (h, row) in out.iter_mut().enumerate() {
        let sink = sinks.and_then(|s| s.get(h)).copied();
        let mut m = sink.unwrap_or(f32::NEG_INFINITY);
        for p in parts {
            m = m.max(p.m.get(h).copied().unwrap_or(f32::NEG_INFINITY));
        }
        row.fill(0.0);
        if m == f32::NEG_INFINITY {
            // No entries and no sink: nothing to attend.
            continue;
        }
        let mut den = sink.map_or(0.0, |s| (s - m).exp());
        for p in parts {
            let (Some(&mt), Some(&lt)) = (p.m.get(h), p.l.get(h)) else {
                continue;
            };
            if mt == f32::NEG_INFINITY {
                continue;
            }
            let a = (mt - m).exp();
            den += a * lt;
            let o = tile::flat(&p.o)
                .get(h * HEAD_DIM..(h + 1) * HEAD_DIM)
                .unwrap_or_default();
            for (r, &v) in row.iter_mut().zip(o) {
                *r += a * v;
            }
        }
        let inv = 1.0 / den;
        for r in row.iter_mut() {
            *r *= inv;
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use zerocopy::FromZeros;

    /// A state made for fewer heads than the queries is refused by the SIMD kernels and
    /// reported, not half-computed in silence (debug builds stop at the kernel's assertion).
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "bounds"))]
    fn simd_kernels_report_a_state_too_small_for_the_heads() {
        let q = vec![[0.25f32; HEAD_DIM]; 32];
        let e = WindowFp8Entry::new_zeroed();
        let rows = vec![KvRow::Fp8(&e); 7];
        for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
            let Ok(v) = Verified::new(level) else {
                continue;
            };
            let prep = Prep::new(v, &q);
            let run = |st: &mut Partial| match level {
                // SAFETY: `level` was verified on this CPU just above.
                SimdLevel::Avx2 => unsafe { avx2::attend(&prep, &rows, st) },
                // SAFETY: as above.
                _ => unsafe { avx512::attend(&prep, &rows, st) },
            };
            assert!(run(&mut Partial::new(prep.hp)), "{level}");
            assert!(!run(&mut Partial::new(prep.hp - 16)), "{level}");
            assert!(attend(v, &prep, &rows).is_ok(), "{level}");
        }
    }
}
