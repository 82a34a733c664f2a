//! A spinning fork/join for the short parallel regions of a token step.
//!
//! A decode step runs ~40 parallel regions of 10–300 µs each. Through rayon each region is a `join` tree: the
//! calling thread queues the other half, a spinning thread steals it, and the caller, once done with its half,
//! waits on a latch, where rayon's idle loop sends it to sleep after some rounds of looking for work — so a region
//! whose halves end apart may pay a futex wake-up besides the steal. A [`Team`]
//! is the fork/join of llama.cpp's thread pool instead: the caller publishes the region in one atomic word, the
//! members (threads spinning in [`Team::serve`], started by the engine's hot section) claim task indices from it
//! with a compare-and-swap, and the caller runs tasks too and then spins until every claimed task is done. Nobody
//! sleeps, nothing allocates, and a member that has not arrived yet only means the others run its tasks; a thread
//! waiting yields its core every ~10 µs (`sched_yield`), so that another process on the cores costs a time
//! slice now and then, not every region (Q8_0 at 2 threads beside a busy loop: 66–74 → 77–102 tok/s).
//!
//! Tasks are claimed in index order by whichever thread asks first, so a region's result must not depend on which
//! thread runs a task — the contract of [`for_each_task`](crate::parallel::for_each_task) already.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Most tasks a team region takes (the field width of [`Team`]'s state word); a larger region runs on rayon.
pub const MAX_TEAM_TASKS: usize = (1 << 16) - 1;

/// Polls of the state word per look at rayon's queues in [`Team::serve`].
const POLLS_PER_STEAL: u32 = 16;

/// Polls (each a `pause`) of an idle member, or of a caller waiting for its region's last task, per
/// `sched_yield`: when another process holds one of the cores, a spinning thread would otherwise keep the core from the
/// thread that has the work (a member that claimed a task and lost its core, or the caller between regions), for a
/// whole time slice. Without contention a yield returns at once (~0.3 µs), every ~10 µs of waiting.
const POLLS_PER_YIELD: u32 = 256;

/// The job of a region: a reference to the caller's task function (its lifetime erased while the region runs).
type Job<'a> = &'a (dyn Fn(usize) + Sync + 'a);

/// A set of threads that run the parallel regions of the thread that [`enter`]ed it. Shared (`Arc`) between the
/// caller and the members ([`Team::serve`]).
pub struct Team {
    /// `generation << 32 | n_tasks << 16 | next_task`: the region now published and the first task not claimed yet.
    state: AtomicU64,
    /// Tasks of the current region that have finished (or panicked).
    done: AtomicUsize,
    /// The current region's `Job`, as a pointer to the caller's `&dyn Fn` (valid while `done < n_tasks`).
    job: AtomicPtr<()>,
    /// The first panic of the current region's tasks, re-raised on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Members keep serving while this is set.
    live: AtomicBool,
}

thread_local! {
    /// The team of this thread's regions (set by [`enter`]) and whether a region of it is running on this thread
    /// now (a nested region then runs on rayon).
    static CURRENT: Cell<(Option<*const Team>, bool)> = const { Cell::new((None, false)) };
}

impl Default for Team {
    fn default() -> Self {
        Team {
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            panic: Mutex::new(None),
            live: AtomicBool::new(true),
        }
    }
}

fn unpack(s: u64) -> (u64, usize, usize) {
    (
        s >> 32,
        ((s >> 16) & 0xffff) as usize,
        (s & 0xffff) as usize,
    )
}

impl Team {
    /// A live team with no region published.
    pub fn new() -> Arc<Team> {
        Arc::new(Team::default())
    }

    /// Runs on a member thread until [`Team::stop`]: claims and runs the tasks of each region the caller publishes,
    /// and between regions runs whatever rayon work the pool has queued (`rayon::yield_now`; a kernel may still use
    /// rayon directly), otherwise spins (`spin_loop`), yielding the core every `POLLS_PER_YIELD` polls.
    pub fn serve(&self) {
        let mut idle = 0u32;
        while self.live.load(Ordering::Acquire) {
            if self.claim_and_run() {
                idle = 0;
                continue;
            }
            idle = idle.wrapping_add(1);
            // A region is taken within a `pause` of being published; rayon's queues (a probe of every deque and
            // the injector, ~0.3 µs) are looked at once every POLLS_PER_STEAL polls.
            if idle.is_multiple_of(POLLS_PER_YIELD) {
                std::thread::yield_now();
            } else if !idle.is_multiple_of(POLLS_PER_STEAL)
                || rayon::yield_now() != Some(rayon::Yield::Executed)
            {
                std::hint::spin_loop();
            }
        }
    }

    /// Lets every [`Team::serve`] return (after the task it may be running).
    pub fn stop(&self) {
        self.live.store(false, Ordering::Release);
    }

    /// Claims one task of the published region and runs it; false when none is left to claim.
    fn claim_and_run(&self) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (_, n, next) = unpack(s);
            if next >= n {
                return false;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break self.run_task(next),
                Err(now) => s = now,
            }
        }
        true
    }

    /// Runs task `i` of the current region (claimed by this thread), records a panic, and counts it done.
    fn run_task(&self, i: usize) {
        // SAFETY: task `i` is claimed and not done, so the caller is still inside `run`, which published `job` (a
        // pointer to its live `&dyn Fn`) before the state word this claim succeeded on (acquire), and keeps it alive
        // until `done` reaches `n_tasks`.
        let job: Job<'_> = unsafe { *(self.job.load(Ordering::Acquire) as *const Job<'_>) };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| job(i))) {
            let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(p);
        }
        self.done.fetch_add(1, Ordering::Release);
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks` on this thread and the members, and returns when all are done;
    /// re-raises the first panic of a task. Only the thread that [`enter`]ed the team publishes regions.
    ///
    /// Panics if `n_tasks > MAX_TEAM_TASKS`.
    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(n_tasks <= MAX_TEAM_TASKS, "Team::run: {n_tasks} tasks");
        let job: Job<'_> = f;
        let (generation, _, _) = unpack(self.state.load(Ordering::Relaxed));
        self.done.store(0, Ordering::Relaxed);
        self.job
            .store(&job as *const Job<'_> as *mut (), Ordering::Relaxed);
        let next_gen = (generation + 1) & 0xffff_ffff;
        self.state
            .store(next_gen << 32 | (n_tasks as u64) << 16, Ordering::Release);
        while self.claim_and_run() {}
        let mut polls = 0u32;
        while self.done.load(Ordering::Acquire) < n_tasks {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(POLLS_PER_YIELD) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let p = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = p {
            resume_unwind(p);
        }
    }
}

/// Runs `f` with `team` as this thread's team: the regions of [`for_each_task`](crate::parallel::for_each_task) and
/// [`for_each_chunk_mut`](crate::parallel::for_each_chunk_mut) on this thread run on it until `f` returns or panics.
pub fn enter<R>(team: &Arc<Team>, f: impl FnOnce() -> R) -> R {
    struct Restore((Option<*const Team>, bool));
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace((Some(Arc::as_ptr(team)), false))));
    f()
}

/// Runs `f(i)` for every `i` in `0..n_tasks` on this thread's team, if it has one and is not inside one of its
/// regions already; returns false (running nothing) otherwise.
pub(crate) fn run_on_team(n_tasks: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
    let (team, busy) = CURRENT.with(Cell::get);
    let Some(team) = team.filter(|_| !busy && n_tasks <= MAX_TEAM_TASKS) else {
        return false;
    };
    struct Idle;
    impl Drop for Idle {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set((c.get().0, false)));
        }
    }
    CURRENT.with(|c| c.set((Some(team), true)));
    let _idle = Idle;
    // SAFETY: `enter` keeps the `Arc` alive while `CURRENT` points to it on this thread.
    unsafe { &*team }.run(n_tasks, f);
    true
}
