//! Running a decode step's few parallel tasks on rayon's pool with a short wait at the end.
//!
//! A decode step splits work of a fraction of a millisecond over a few threads, many times
//! per step. Rayon's `in_place_scope`, called from a thread outside its pool, blocks that
//! thread on a condition variable until the pool's tasks finish; when the caller's own share
//! finishes first, waking it again costs 10-50 us on the VMs measured (a scope with one empty
//! task: median 10 us, q75 39 us), a sizeable part of a 0.2 ms scan. [`run_tasks`] instead
//! waits a bounded time for the other tasks itself, spinning with periodic yields (so that a
//! task scheduled on the same CPU still runs), and leaves the scope only once they are done.
//!
//! Handing a task to the pool costs a wake-up too: a pool thread that found nothing to do
//! for a while sleeps, and waking it is a system call on the caller's side and tens of
//! microseconds on the woken side. A step of many short phases (a batch decode step: 40
//! layers of 8-10 splits each, 10-100 us apiece) pays it at almost every split. For such a
//! step [`with_team`] keeps some pool threads spinning on a queue for its whole length, and
//! the splits made inside it hand their tasks over through that queue.

use std::any::Any;
use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest the calling thread spins for the pool's tasks before it leaves the wait to rayon
/// (and sleeps): longer than a task of a decode step is expected to outlast the caller's.
const SPIN_LIMIT: Duration = Duration::from_micros(500);

/// Spin-loop hints between two yields of the waiting thread (a few microseconds).
const SPINS_PER_YIELD: u32 = 64;

/// How long a team's thread spins without yielding after its last task: longer than the
/// single-threaded stretches between two splits of a decode step (norms, residual adds).
const TEAM_HOT: Duration = Duration::from_micros(200);

thread_local! {
    /// Whether this thread is running a task of [`run_tasks`].
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
    /// The team [`with_team`] holds for this thread (null when none): its `run_tasks`
    /// calls queue their tasks there.
    static TEAM: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
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

/// How many times cheaper a split is inside [`with_team`] than on the pool (a queue push and
/// a cache line's round trip, about a microsecond, against a wake-up's 10-20): the work a
/// part must have to pay for its hand-over shrinks by this factor there.
const TEAM_SPLIT_DISCOUNT: usize = 8;

/// The least work a part of a split must have to pay for handing it to another thread,
/// given `pool`, that least work when the part goes to rayon's pool: smaller inside
/// [`with_team`] on the team's thread, where the hand-over costs less. Callers compare it
/// with the same unit of work they measured `pool` in.
pub fn min_split_work(pool: usize) -> usize {
    if TEAM.with(Cell::get).is_null() {
        pool
    } else {
        pool / TEAM_SPLIT_DISCOUNT
    }
}

/// A queued task of a [`run_tasks`] call made under [`with_team`]. It borrows that call's
/// tasks and counters; the lifetime is erased because the call does not return (nor unwind)
/// before every task it queued has run.
type Job = Box<dyn FnOnce() + Send + 'static>;

/// Pool threads kept spinning for one caller ([`with_team`]), and the queue they take tasks
/// from.
struct Team {
    /// Tasks waiting for a thread, oldest first.
    queue: Mutex<VecDeque<Job>>,
    /// `queue`'s length, read without the lock by the spinning threads.
    queued: AtomicUsize,
    /// Set when the caller's closure has returned: the team's threads leave once the queue
    /// is empty.
    stop: AtomicBool,
}

impl Team {
    /// The oldest queued task, if any.
    fn pop(&self) -> Option<Job> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let job = queue.pop_front();
        if job.is_some() {
            self.queued.fetch_sub(1, Ordering::Release);
        }
        job
    }

    /// A team thread's loop: runs queued tasks until the caller is done, spinning between
    /// them. Once it has been idle for [`TEAM_HOT`] it yields every few microseconds: first
    /// to work waiting in rayon's pool (another caller's tasks, which would otherwise wait
    /// for this team to end), else to the OS.
    fn serve(&self) {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(job) = self.pop() {
                // A job catches its task's panic itself (`run_tasks`); it never unwinds here.
                marked(job);
                idle_since = Instant::now();
                spins = 0;
                continue;
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins >= SPINS_PER_YIELD {
                spins = 0;
                if idle_since.elapsed() >= TEAM_HOT {
                    match rayon::yield_now() {
                        Some(rayon::Yield::Executed) => idle_since = Instant::now(),
                        _ => std::thread::yield_now(),
                    }
                }
            }
        }
    }
}

/// Runs `f` with `helpers` threads of rayon's pool kept spinning for it: every [`run_tasks`]
/// call `f` makes on this thread queues its tasks for them instead of spawning them on the
/// pool, so a split costs a queue push and a spin (about a microsecond), not a wake-up
/// (10-20 us, [`min_split_work`]). The threads spin (yielding after 200 us without work)
/// until `f` returns, so a team is for a stretch of many short splits (a model step), not
/// for idle time; while idle they run what other callers left waiting on the pool.
///
/// `f` splits its work even when this thread runs a task of [`run_tasks`] itself (a
/// sequence group of a batch step given threads of its own): the caller decides, by
/// `helpers`, whether `f` gets threads. With no helpers, or inside another team on this
/// thread, `f` just runs. A panic in `f` is passed on once the team's threads have left.
///
/// Interleaved on a 2-vCPU VM (2 threads, the built-in model after a 1024-token prompt):
/// decode of one sequence 62-66 tok/s with its splits spawned on the pool, 80-82 on a team
/// (74-75 on one thread); `kvstack bench runtime`'s 1024-token prefill 828-894 tok/s on the
/// pool, 971-1071 on a team.
pub fn with_team<R>(helpers: usize, f: impl FnOnce() -> R) -> R {
    if helpers == 0 || !TEAM.with(Cell::get).is_null() {
        return f();
    }
    let team = Team {
        queue: Mutex::new(VecDeque::new()),
        queued: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    };
    /// Ends the team when `f` returns or unwinds: this thread's splits go back to the
    /// pool (or run alone, in a task), and the team's threads leave once the queue is empty.
    struct Release<'a>(&'a Team, bool);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            TEAM.with(|t| t.set(std::ptr::null()));
            IN_TASK.with(|c| c.set(self.1));
            self.0.stop.store(true, Ordering::Release);
        }
    }
    let team = &team;
    rayon::in_place_scope(|s| {
        for _ in 0..helpers {
            s.spawn(move |_| team.serve());
        }
        TEAM.with(|t| t.set(team));
        let _release = Release(team, IN_TASK.with(|c| c.replace(false)));
        f()
    })
}

/// One call's tasks queued on `team`; returns when all have run, passing on the first panic.
fn run_on_team<T: FnOnce() + Send>(team: &Team, first: T, rest: impl Iterator<Item = T>) {
    let done = AtomicUsize::new(0);
    let panicked: Mutex<Option<Box<dyn Any + Send>>> = Mutex::new(None);
    let (done, panicked) = (&done, &panicked);
    let record = move |r: Result<(), Box<dyn Any + Send>>| {
        if let Err(p) = r {
            panicked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(p);
        }
    };
    // Every task first, so that nothing is queued if taking them panics.
    let rest: Vec<T> = rest.collect();
    let queued = rest.len();
    {
        let mut queue = team.queue.lock().unwrap_or_else(|e| e.into_inner());
        for task in rest {
            let job: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
                record(catch_unwind(AssertUnwindSafe(task)));
                // The last touch of this call's state: after it the caller may return.
                done.fetch_add(1, Ordering::Release);
            });
            // SAFETY: the job borrows `done`, `panicked` and what the tasks borrow, all of
            // which outlive this call, and this call returns or unwinds only after `done`
            // counts every queued job: the wait below cannot be left early (the first
            // task's panic is caught), and a job always runs, by a team thread or, failing
            // that, by this thread draining the queue.
            let job: Job =
                unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + '_>, Job>(job) };
            queue.push_back(job);
        }
        team.queued.fetch_add(queued, Ordering::Release);
    }
    let own = catch_unwind(AssertUnwindSafe(|| marked(first)));
    // Help with what no team thread has taken yet, then wait for the rest.
    while done.load(Ordering::Acquire) < queued {
        match team.pop() {
            Some(job) => marked(job),
            None => std::hint::spin_loop(),
        }
    }
    if let Err(p) = own {
        resume_unwind(p);
    }
    if let Some(p) = panicked.lock().unwrap_or_else(|e| e.into_inner()).take() {
        resume_unwind(p);
    }
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
///
/// Inside [`with_team`] the tasks after the first go to the team's queue instead; the
/// calling thread runs its own, then takes queued ones no team thread has taken, then spins
/// until all are done (a team thread is already running, so there is no sleep to fall back
/// to).
pub fn run_tasks<T: FnOnce() + Send>(tasks: impl IntoIterator<Item = T>) {
    let mut tasks = tasks.into_iter();
    let Some(first) = tasks.next() else {
        return;
    };
    let team = TEAM.with(Cell::get);
    if !team.is_null() && !in_task() {
        // SAFETY: `TEAM` is non-null only inside `with_team` on this thread, whose team
        // outlives that call; this call returns before `with_team` does.
        run_on_team(unsafe { &*team }, first, tasks);
        return;
    }
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
    fn a_team_runs_every_task_once_on_its_threads_and_passes_panics_on() {
        let owner = std::thread::current().id();
        let elsewhere = std::sync::atomic::AtomicBool::new(false);
        with_team(1, || {
            assert!(!in_task());
            assert_eq!(min_split_work(64), 64 / TEAM_SPLIT_DISCOUNT);
            for n in [1usize, 2, 7] {
                let seen = Mutex::new(vec![0u32; n]);
                let marks = Mutex::new(Vec::new());
                run_tasks((0..n).map(|i| {
                    let (seen, marks, elsewhere) = (&seen, &marks, &elsewhere);
                    move || {
                        // The first task waits (at most 5 s) for a team thread to take one
                        // of the others, so the test sees the team work, not the caller's
                        // draining alone.
                        let start = Instant::now();
                        while i == 0
                            && n > 1
                            && !elsewhere.load(Ordering::Acquire)
                            && start.elapsed() < Duration::from_secs(5)
                        {
                            std::hint::spin_loop();
                        }
                        if std::thread::current().id() != owner {
                            elsewhere.store(true, Ordering::Release);
                        }
                        marks.lock().unwrap().push(in_task());
                        seen.lock().unwrap()[i] += 1;
                    }
                }));
                assert_eq!(*seen.lock().unwrap(), vec![1; n], "{n} tasks");
                assert_eq!(*marks.lock().unwrap(), vec![true; n]);
                assert!(!in_task());
            }
            // A panic in a queued task and in the caller's own task reach the caller, after
            // the other tasks have run.
            for bad in [0usize, 2] {
                let ran = AtomicUsize::new(0);
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    run_tasks((0..4).map(|i| {
                        let ran = &ran;
                        move || {
                            ran.fetch_add(1, Ordering::Relaxed);
                            assert!(i != bad, "task {bad} fails");
                        }
                    }))
                }));
                assert!(r.is_err(), "panic of task {bad}");
                assert_eq!(ran.load(Ordering::Relaxed), 4);
            }
            // Inside the team, another team just runs its closure here.
            assert_eq!(with_team(3, || 5), 5);
        });
        assert!(
            elsewhere.load(Ordering::Acquire),
            "no team thread ran a task"
        );
        assert_eq!(min_split_work(64), 64);
        // A task given threads of its own splits on its team, and gets its mark back.
        run_tasks([|| {
            assert!(in_task());
            let count = AtomicUsize::new(0);
            with_team(1, || {
                assert!(!in_task());
                run_tasks((0..3).map(|_| {
                    || {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }));
            });
            assert_eq!(count.load(Ordering::Relaxed), 3);
            assert!(in_task());
        }]);
        // A panic in the team's closure is passed on, and the thread leaves the team.
        assert!(std::panic::catch_unwind(|| with_team(1, || panic!("the step fails"))).is_err());
        assert_eq!(min_split_work(64), 64);
    }

    #[test]
    fn a_team_holding_every_pool_thread_still_runs_other_callers_tasks() {
        let done = AtomicBool::new(false);
        let done = &done;
        std::thread::scope(|s| {
            with_team(rayon::current_num_threads(), || {
                // Another thread's split while every pool thread spins for this team: its
                // pool task runs on a team thread that has been idle, well before the team
                // ends (at most 10 s from now).
                s.spawn(move || {
                    let ran = AtomicUsize::new(0);
                    run_tasks((0..2).map(|_| {
                        let ran = &ran;
                        move || {
                            ran.fetch_add(1, Ordering::Relaxed);
                        }
                    }));
                    assert_eq!(ran.load(Ordering::Relaxed), 2);
                    done.store(true, Ordering::Release);
                });
                let start = Instant::now();
                while !done.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(
                    done.load(Ordering::Acquire),
                    "the other caller's tasks waited"
                );
            });
        });
    }

    #[test]
    fn a_panicking_task_is_passed_on() {
        let r = std::panic::catch_unwind(|| {
            run_tasks((0..3).map(|i| move || assert!(i != 2, "task 2 fails")));
        });
        assert!(r.is_err());
    }
}
