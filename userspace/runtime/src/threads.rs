//! Splitting independent work over scoped threads (attention rows, batch members).

/// Runs `f(chunk_index, chunk)` for every `chunk_len`-long chunk of `data` (the last may be
/// shorter), each on a scoped thread of its own, and returns the results in chunk order; a
/// chunk whose thread panicked gives `None`, for the caller to turn into its own error.
pub(crate) fn on_threads<T, R, F>(data: &mut [T], chunk_len: usize, f: F) -> Vec<Option<R>>
where
    T: Send,
    R: Send,
    F: Fn(usize, &mut [T]) -> R + Sync,
{
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = data
            .chunks_mut(chunk_len.max(1))
            .enumerate()
            .map(|(c, part)| s.spawn(move || f(c, part)))
            .collect();
        handles.into_iter().map(|h| h.join().ok()).collect()
    })
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
