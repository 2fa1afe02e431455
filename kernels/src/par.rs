//! Running a decode step's few parallel tasks on rayon's pool with a short wait at the end.
//!
//! A decode step splits work of a fraction of a millisecond over a few threads, many times
//! per step. Rayon's `in_place_scope`, called from a thread outside its pool, blocks that
//! thread on a condition variable until the pool's tasks finish; when the caller's own share
//! finishes first, waking it again costs 10-50 us on the VMs measured (a scope with one empty
//! task: median 10 us, q75 39 us), a sizeable part of a 0.2 ms scan. [`run_tasks`] instead
//! waits a bounded time for the other tasks itself, spinning with periodic yields (so that a
//! task scheduled on the same CPU still runs), and leaves the scope only once they are done.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest the calling thread spins for the pool's tasks before it leaves the wait to rayon
/// (and sleeps): longer than a task of a decode step is expected to outlast the caller's.
const SPIN_LIMIT: Duration = Duration::from_micros(500);

/// Spin-loop hints between two yields of the waiting thread (a few microseconds).
const SPINS_PER_YIELD: u32 = 64;

thread_local! {
    /// Whether this thread is running a task of [`run_tasks`].
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is running one of [`run_tasks`]' tasks: work split inside a
/// task that already shares the pool with its siblings (an attention of one of several
/// sequences) gains nothing from splitting again and runs on its own thread.
pub fn in_task() -> bool {
    IN_TASK.with(Cell::get)
}

/// Runs `task` marked as a task of [`run_tasks`] (restoring the mark afterwards, also when
/// it panics).
fn marked(task: impl FnOnce()) {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_TASK.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(IN_TASK.with(|c| c.replace(true)));
    task();
}

/// Runs every task at once: the first on the calling thread, the others on rayon's global
/// pool (one worker per CPU, started once), and returns when all have finished. A panic in a
/// task is passed on, as by `rayon::in_place_scope`.
///
/// After its own task the calling thread waits for the others by spinning, yielding every 64
/// spin-loop hints, for at most 500 us, then as rayon does. On a 2-vCPU VM
/// this took the median of a 2-thread scan of 16,384 index keys from 0.190-0.226 to
/// 0.174-0.200 ms (600 interleaved repetitions). The price is the caller's CPU time while it
/// waits: at most 500 us a call, yielding to other threads on its CPU, which matters only
/// when many callers share the pool at once.
pub fn run_tasks<T: FnOnce() + Send>(tasks: impl IntoIterator<Item = T>) {
    let mut tasks = tasks.into_iter();
    let Some(first) = tasks.next() else {
        return;
    };
    let done = AtomicUsize::new(0);
    let done = &done;
    rayon::in_place_scope(|s| {
        let mut spawned = 0;
        for task in tasks {
            spawned += 1;
            s.spawn(move |_| {
                marked(task);
                done.fetch_add(1, Ordering::Release);
            });
        }
        marked(first);
        if spawned > 0 {
            await_count(done, spawned);
        }
    });
}

/// Spins (yielding now and then) until `count` reaches `target` or [`SPIN_LIMIT`] passes.
fn await_count(count: &AtomicUsize, target: usize) {
    let start = Instant::now();
    loop {
        for _ in 0..SPINS_PER_YIELD {
            if count.load(Ordering::Acquire) >= target {
                return;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= SPIN_LIMIT {
            return;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn every_task_runs_once_and_the_call_returns_after_all() {
        for n in [0usize, 1, 2, 5] {
            let seen = Mutex::new(vec![0u32; n]);
            run_tasks((0..n).map(|i| {
                let seen = &seen;
                move || {
                    // Tasks outlasting the spin limit too: the wait falls back to rayon's.
                    if i == 1 {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    seen.lock().unwrap()[i] += 1;
                }
            }));
            assert_eq!(*seen.lock().unwrap(), vec![1; n], "{n} tasks");
        }
    }

    #[test]
    fn tasks_know_they_are_tasks_and_the_caller_gets_its_mark_back() {
        assert!(!in_task());
        let seen = Mutex::new(Vec::new());
        run_tasks((0..3).map(|_| || seen.lock().unwrap().push(in_task())));
        assert_eq!(*seen.lock().unwrap(), vec![true; 3]);
        assert!(!in_task());
        let _ = std::panic::catch_unwind(|| {
            run_tasks([|| assert!(std::hint::black_box(false), "a task fails")])
        });
        assert!(!in_task());
    }

    #[test]
    fn a_panicking_task_is_passed_on() {
        let r = std::panic::catch_unwind(|| {
            run_tasks((0..3).map(|i| move || assert!(i != 2, "task 2 fails")));
        });
        assert!(r.is_err());
    }
}
