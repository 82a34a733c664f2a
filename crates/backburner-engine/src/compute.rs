//! The threads a role computes on.
//!
//! Each role that runs the model (a host's sessions, a worker daemon, later the server's scheduler) owns a
//! [`ComputePool`] of its own size; every kernel of a forward pass splits its work over the pool it runs in
//! ([`backburner_kernels::parallel`]). Nothing reads a process-wide setting such as `RAYON_NUM_THREADS`, so a host
//! and a worker in one process (as in the tests) each get exactly the threads they were given.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use backburner_kernels::team::{self, Team};

use crate::error::{EngineError, Result};

/// A pool of compute threads (rayon), shared by cloning.
#[derive(Clone)]
pub struct ComputePool {
    pool: Arc<rayon::ThreadPool>,
    /// Whether an [`ComputePool::install_hot`] keeps the pool's threads spinning now (at most one at a time).
    hot: Arc<AtomicBool>,
}

impl ComputePool {
    /// A pool of `threads` compute threads, named `bb-compute-N`.
    ///
    /// Errors: [`EngineError::InvalidSetting`] for 0 threads or when the OS refuses to start the threads.
    pub fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(EngineError::InvalidSetting(
                "compute threads must be ≥ 1".into(),
            ));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("bb-compute-{i}"))
            .build()
            .map_err(|e| {
                EngineError::InvalidSetting(format!("cannot start {threads} compute threads: {e}"))
            })?;
        Ok(ComputePool {
            pool: Arc::new(pool),
            hot: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The process's default pool, one thread per core, created on first use (for sessions whose options name no
    /// pool, e.g. in tests).
    pub fn shared_default() -> Self {
        static DEFAULT: OnceLock<ComputePool> = OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                let n = std::thread::available_parallelism().map_or(1, |n| n.get());
                ComputePool::new(n).expect("the default compute pool starts")
            })
            .clone()
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on the pool (the calling thread waits) and returns its result; kernels inside split their work over
    /// the pool's threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Whether [`ComputePool::install_hot`] keeps this pool's other threads spinning: with 2 or more threads, and no
    /// more than the machine's cores (`std::thread::available_parallelism`). With more, the spinners take the cores
    /// that the threads with work need: decode on a 2-core VM fell from 250 to 8–19 tok/s at 3 threads (Q8_0 bench
    /// file), where a plain install costs a thread wake-up per region instead.
    pub fn spins(&self) -> bool {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (2..=cores).contains(&self.threads())
    }

    /// Like [`ComputePool::install`], with the pool's other threads kept awake while `f` runs, as the members of a
    /// spinning fork/join ([`Team`]): the parallel regions of the kernels that `f` runs on this thread are published
    /// in one atomic word and their tasks claimed by whichever thread is free first, and between regions the members
    /// run any other work queued on the pool (`rayon::yield_now`). For a token loop, whose step has ~40 short
    /// parallel regions: a parked rayon thread picks up its half of a region 35–60 µs late on a 2-vCPU VM (a thread
    /// wake-up each time), a spinning one within 1 µs (docs/BENCHMARKS.md), and the team spares rayon's steal and
    /// latch per region (IQ4_XS decode at 2 threads ×1.01–1.05 over a spinning rayon pool). The cost: those cores
    /// stay busy until `f` returns, as llama.cpp's threads do while it generates. Results and bits are those of
    /// [`ComputePool::install`] (a task's result never depends on the thread that runs it).
    ///
    /// The spinning stops when `f` returns or panics; a spinner that had not started yet exits at once. One hot
    /// section per pool at a time: while one runs, another (nested, or from another thread) is a plain `install`
    /// (a thread waiting inside a parallel region may run another section's spinner, which returns only when that
    /// section ends: a second set would hold up the first).
    ///
    /// A pool with more threads than the machine has cores ([`ComputePool::spins`] false) never spins.
    pub fn install_hot<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if !self.spins() || self.hot.swap(true, Ordering::AcqRel) {
            return self.install(f);
        }
        let hot = self.hot.clone();
        self.pool.install(move || {
            let keep = KeepAwake::start(hot);
            team::enter(&keep.0, f)
        })
    }
}

/// The spinners of [`ComputePool::install_hot`] on every thread of the current pool but this one, serving the
/// section's [`Team`], and the pool's hot flag; dropping it (also when unwinding) lets the spinners go and the flag
/// down.
struct KeepAwake(Arc<Team>, Arc<AtomicBool>);

impl KeepAwake {
    fn start(pool_hot: Arc<AtomicBool>) -> Self {
        let team = Team::new();
        let here = rayon::current_thread_index();
        let members = team.clone();
        rayon::spawn_broadcast(move |ctx| {
            if Some(ctx.index()) == here {
                return;
            }
            #[cfg(test)]
            tests::SPINNERS.fetch_add(1, Ordering::SeqCst);
            members.serve();
            #[cfg(test)]
            tests::SPINNERS.fetch_sub(1, Ordering::SeqCst);
        });
        KeepAwake(team, pool_hot)
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.0.stop();
        self.1.store(false, Ordering::Release);
    }
}

impl PartialEq for ComputePool {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.pool, &other.pool)
    }
}

impl Eq for ComputePool {}

impl std::fmt::Debug for ComputePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ComputePool({} threads)", self.threads())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_runs_its_work_on_exactly_its_threads() {
        let p = ComputePool::new(3).unwrap();
        assert_eq!(p.threads(), 3);
        assert_eq!(p.install(rayon::current_num_threads), 3);
        assert_eq!(p.clone(), p);
        assert_ne!(ComputePool::new(1).unwrap(), p);
        assert!(ComputePool::new(0).is_err());
        assert_eq!(ComputePool::shared_default(), ComputePool::shared_default());
    }

    /// Spinners of `install_hot` running now (only this module's tests use it in this binary).
    pub(super) static SPINNERS: std::sync::atomic::AtomicUsize =
        std::sync::atomic::AtomicUsize::new(0);

    /// Whether every spinner has stopped within 10 s.
    fn spinners_stop() -> bool {
        let t = std::time::Instant::now();
        while SPINNERS.load(Ordering::SeqCst) > 0 {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn install_hot_runs_parallel_work_and_releases_the_threads_even_after_a_panic() {
        for threads in [1, 2, 3] {
            let p = ComputePool::new(threads).unwrap();
            // parallel work inside runs on the pool's threads, each part once
            let (n, seen) = p.install_hot(|| {
                use rayon::prelude::*;
                let seen: std::collections::BTreeSet<usize> = (0..64)
                    .into_par_iter()
                    .map(|_| {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        rayon::current_thread_index().unwrap()
                    })
                    .collect();
                (rayon::current_num_threads(), seen)
            });
            assert_eq!(n, threads);
            assert!(seen.iter().all(|&i| i < threads));
            assert!(spinners_stop(), "{threads} threads: a spinner kept running");
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                p.install_hot(|| panic!("inside"))
            }));
            assert!(r.is_err());
            assert!(
                spinners_stop(),
                "{threads} threads: a spinner outlived a panic"
            );
        }
    }

    #[test]
    fn only_a_pool_within_the_cores_spins() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(!ComputePool::new(1).unwrap().spins());
        assert!(!ComputePool::new(cores + 1).unwrap().spins());
        assert_eq!(ComputePool::new(cores).unwrap().spins(), cores >= 2);
        // a pool past the cores still runs its work on its own threads, as a plain install
        let p = ComputePool::new(cores + 1).unwrap();
        assert_eq!(p.install_hot(rayon::current_num_threads), cores + 1);
    }

    #[test]
    fn hot_sections_from_several_threads_on_one_pool_all_finish() {
        // Sections from several threads at once (one spins, the others run as plain installs): all finish, each with
        // its own result.
        let p = ComputePool::new(2).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for t in 0..3 {
            let (p, tx) = (p.clone(), tx.clone());
            std::thread::spawn(move || {
                let sum = p.install_hot(|| {
                    use rayon::prelude::*;
                    (0..300u64)
                        .map(|i| {
                            (0..4u64)
                                .into_par_iter()
                                .map(|j| {
                                    std::thread::sleep(std::time::Duration::from_micros(50));
                                    j + i
                                })
                                .sum::<u64>()
                        })
                        .sum::<u64>()
                });
                tx.send((t, sum)).unwrap();
            });
        }
        let mut done: Vec<(usize, u64)> = (0..3)
            .map(|_| {
                rx.recv_timeout(std::time::Duration::from_secs(60))
                    .expect("a hot section hung")
            })
            .collect();
        done.sort();
        // Σ_i Σ_j (j + i) = 300·6 + 4·(299·300/2)
        let want = 300 * 6 + 4 * 44_850;
        assert_eq!(done, (0..3).map(|t| (t, want)).collect::<Vec<_>>());
        assert!(spinners_stop());
    }
}
