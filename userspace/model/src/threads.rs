//! Splitting independent work over threads (attention rows, batch members, MoE experts).
//!
//! The chunks run on rayon's global pool (one worker per CPU, started once), the first on the
//! calling thread, through `kvstack_kernels::par::run_tasks` (which waits for the others
//! without sleeping for a short while): an OS thread started per chunk would cost about as much
//! as a decode step's chunk of work.

use std::panic::{AssertUnwindSafe, catch_unwind};

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
