//! The threads a role computes on.
//!
//! Each role that runs the model (a host's sessions, a worker daemon, later the server's scheduler) owns a
//! [`ComputePool`] of its own size; every kernel of a forward pass splits its work over the pool it runs in
//! ([`backburner_kernels::parallel`]). Nothing reads a process-wide setting such as `RAYON_NUM_THREADS`, so a host
//! and a worker in one process (as in the tests) each get exactly the threads they were given.

use std::sync::{Arc, OnceLock};

use crate::error::{EngineError, Result};

/// A pool of compute threads (rayon), shared by cloning.
#[derive(Clone)]
pub struct ComputePool {
    pool: Arc<rayon::ThreadPool>,
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
}
