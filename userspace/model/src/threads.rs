//! Splitting independent work over threads (attention rows, batch members, MoE experts).
//!
//! The chunks run on rayon's global pool (one worker per CPU, started once), the first on the
//! calling thread, through `kvstack_kernels::par::run_tasks` (which waits for the others
//! without sleeping for a short while): an OS thread started per chunk would cost about as much
//! as a decode step's chunk of work.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::Error;

/// Work (about one multiply-add a unit) below which one more thread does not pay for the
/// hand-over to the pool (10-20 us of work on one core).
pub(crate) const MIN_WORK_PER_THREAD: usize = 1 << 17;

/// Into how many parts `rows` rows with `work` units of work in all are split on `threads`
/// threads: as many as the work pays for, one inside a task that already shares the pool.
pub(crate) fn parts(rows: usize, threads: usize, work: usize) -> usize {
    if kvstack_kernels::par::in_task() {
        return 1;
    }
    threads
        .min(rows)
        .min(work / kvstack_kernels::par::min_split_work(MIN_WORK_PER_THREAD))
        .max(1)
}

/// The first error of a split's parts; a part that panicked is an error too.
fn joined<R>(results: Vec<Option<Result<R, Error>>>, what: &str) -> Result<Vec<R>, Error> {
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(Error::ModelInput(format!(
                    "a {what} worker thread panicked"
                )))
            })
        })
        .collect()
}

/// Runs `f(rows, part)` over `parts` consecutive row ranges of `out` (`width` values a row),
/// each on its own thread; `f` sees the rows it covers and their slice of `out`.
pub(crate) fn rows_mut<F>(
    out: &mut [f32],
    width: usize,
    parts: usize,
    what: &str,
    f: F,
) -> Result<(), Error>
where
    F: Fn(Range<usize>, &mut [f32]) -> Result<(), Error> + Sync,
{
    let n = out.len() / width.max(1);
    if parts <= 1 || n <= 1 {
        return f(0..n, out);
    }
    let per = n.div_ceil(parts);
    let f = &f;
    let results = on_threads(out, per * width, |c, part| {
        f(c * per..c * per + part.len() / width, part)
    });
    joined(results, what).map(|_| ())
}

/// `f(rows)` for `parts` consecutive ranges of `0..n`, each on its own thread, concatenated
/// in row order.
pub(crate) fn rows_collect<R, F>(n: usize, parts: usize, what: &str, f: F) -> Result<Vec<R>, Error>
where
    R: Send,
    F: Fn(Range<usize>) -> Result<Vec<R>, Error> + Sync,
{
    if parts <= 1 || n <= 1 {
        return f(0..n);
    }
    let per = n.div_ceil(parts);
    let mut starts: Vec<usize> = (0..n).step_by(per).collect();
    let f = &f;
    let results = on_threads(&mut starts, 1, |_, s| match s.first() {
        Some(&s) => f(s..(s + per).min(n)),
        None => Ok(Vec::new()),
    });
    Ok(joined(results, what)?.into_iter().flatten().collect())
}

/// Runs `f(chunk_index, chunk)` for every `chunk_len`-long chunk of `data` (the last may be
/// shorter), the first on the calling thread and the others on the worker pool, and returns
/// the results in chunk order; a chunk that panicked gives `None`, for the caller to turn into
/// its own error.
pub(crate) fn on_threads<T, R, F>(data: &mut [T], chunk_len: usize, f: F) -> Vec<Option<R>>
where
    T: Send,
    R: Send,
    F: Fn(usize, &mut [T]) -> R + Sync,
{
    let f = &f;
    // A panicking chunk only loses its own result; the data it held is the caller's to
    // discard (it turns the `None` into an error).
    let run = move |c: usize, part: &mut [T]| catch_unwind(AssertUnwindSafe(|| f(c, part))).ok();
    let chunks: Vec<&mut [T]> = data.chunks_mut(chunk_len.max(1)).collect();
    // Inside a task that already shares the pool (a group of a sequence-parallel step), the
    // chunks run here, in order: splitting again only adds waits.
    if kvstack_kernels::par::in_task() {
        return chunks
            .into_iter()
            .enumerate()
            .map(|(c, part)| run(c, part))
            .collect();
    }
    let mut results: Vec<Option<R>> = (0..chunks.len()).map(|_| None).collect();
    kvstack_kernels::par::run_tasks(
        results
            .iter_mut()
            .zip(chunks)
            .enumerate()
            .map(|(c, (slot, part))| move || *slot = run(c, part)),
    );
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_splits_cover_every_row_once_in_order() {
        for parts in [1, 2, 3, 7] {
            let mut out = vec![0f32; 10 * 3];
            rows_mut(&mut out, 3, parts, "test", |rows, part| {
                assert_eq!(part.len(), rows.len() * 3);
                for (i, row) in rows.zip(part.chunks_exact_mut(3)) {
                    row.fill(i as f32);
                }
                Ok(())
            })
            .unwrap();
            let want: Vec<f32> = (0..10).flat_map(|i| [i as f32; 3]).collect();
            assert_eq!(out, want, "{parts} parts");
            let got = rows_collect(10, parts, "test", |rows| Ok(rows.collect())).unwrap();
            assert_eq!(got, (0..10).collect::<Vec<usize>>(), "{parts} parts");
        }
        let e = rows_collect(10, 2, "router", |rows| {
            assert!(rows.start == 0, "the second part fails");
            Ok(vec![0u8])
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("router worker thread panicked"),
            "{e}"
        );
    }

    #[test]
    fn chunks_keep_their_order_and_panics_become_none() {
        let mut v: Vec<u32> = (0..10).collect();
        let r = on_threads(&mut v, 4, |c, part| {
            part.iter_mut().for_each(|x| *x += 100);
            assert!(c != 1, "chunk 1 fails");
            c * 10 + part.len()
        });
        assert_eq!(r, vec![Some(4), None, Some(22)]);
        assert_eq!(v, (100..110).collect::<Vec<u32>>());
    }
}
