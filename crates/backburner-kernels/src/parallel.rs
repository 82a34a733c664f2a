//! Static task splitting on the current thread pool.
//!
//! Kernels run on whatever rayon pool the caller installed (the engine owns one per role: host, worker, server;
//! see `backburner_engine::Compute`). They split their work into a fixed number of equal tasks, usually one per
//! pool thread, so that each thread streams a disjoint, contiguous part of the data (for the bandwidth-bound
//! decode path) and the result never depends on how tasks are scheduled.
//!
//! With profiling on, [`for_each_task`] charges the time the region waits for its slowest task to
//! [`Op::Sync`](crate::profile::Op::Sync).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rayon::prelude::*;

use crate::profile;

/// Threads of the current pool (rayon's `current_num_threads`).
#[inline]
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// Runs `f(i)` for every task `i` in `0..n_tasks` on the current pool and returns when all are done. With one task
/// (or a pool of one thread) everything runs on the calling thread, in order.
pub fn for_each_task(n_tasks: usize, f: impl Fn(usize) + Sync) {
    if n_tasks == 0 {
        return;
    }
    let width = n_tasks.min(threads());
    if width <= 1 {
        (0..n_tasks).for_each(f);
        return;
    }
    let meter = SyncMeter::start(width);
    (0..n_tasks)
        .into_par_iter()
        .with_max_len(1)
        .for_each(|i| meter.task(|| f(i)));
    meter.finish();
}

/// Splits `data` into consecutive chunks of `chunk` elements (the last may be shorter) and runs `f(index, chunk)` for
/// each on the current pool, like [`for_each_task`] (sync time is profiled the same way).
///
/// Panics if `chunk == 0`.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk > 0, "for_each_chunk_mut: chunk must be positive");
    let width = data.len().div_ceil(chunk).min(threads());
    if width <= 1 {
        for (i, c) in data.chunks_mut(chunk).enumerate() {
            f(i, c);
        }
        return;
    }
    let meter = SyncMeter::start(width);
    data.par_chunks_mut(chunk)
        .with_max_len(1)
        .enumerate()
        .for_each(|(i, c)| meter.task(|| f(i, c)));
    meter.finish();
}

/// With profiling on, the busy time of a parallel region's tasks, to charge what the region waited beyond their mean
/// to [`Op::Sync`](profile::Op::Sync). Costs nothing (no clock reads) with profiling off.
struct SyncMeter {
    on: bool,
    width: usize,
    t0: Option<Instant>,
    busy: AtomicU64,
}

impl SyncMeter {
    fn start(width: usize) -> Self {
        let on = profile::enabled();
        SyncMeter {
            on,
            width,
            t0: on.then(Instant::now),
            busy: AtomicU64::new(0),
        }
    }

    #[inline]
    fn task<R>(&self, f: impl FnOnce() -> R) -> R {
        if !self.on {
            return f();
        }
        let s = Instant::now();
        let r = f();
        let ns = u64::try_from(s.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.busy.fetch_add(ns, Ordering::Relaxed);
        r
    }

    fn finish(self) {
        if let Some(t0) = self.t0 {
            let wall = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let mean_busy = self.busy.load(Ordering::Relaxed) / self.width as u64;
            profile::charge_sync(wall.saturating_sub(mean_busy));
        }
    }
}

/// The read-bandwidth pass's work: the wrapping sum of `words`, split into one contiguous share per thread of the
/// current pool (as the decode kernels stream their share of the weights), each summed into eight independent
/// accumulators so that the loop vectorizes and only memory bounds it. `bench local` times it over 1 GiB, the
/// quantized-product bench over the bytes it streams.
pub fn read_sum(words: &[u64]) -> u64 {
    let share = words.len().div_ceil(threads()).max(1);
    words
        .par_chunks(share)
        .map(|c| {
            let mut acc = [0u64; 8];
            for w in c.chunks_exact(8) {
                for (a, x) in acc.iter_mut().zip(w) {
                    *a = a.wrapping_add(*x);
                }
            }
            let tail = c.chunks_exact(8).remainder().iter();
            tail.chain(&acc).fold(0u64, |s, a| s.wrapping_add(*a))
        })
        .reduce(|| 0, u64::wrapping_add)
}

/// Rows per task to split `n_rows` rows of `row_len` elements over the pool: one task per thread when the work is
/// at least `min_elems` elements, else all rows in one task (run on the calling thread).
pub fn rows_per_task(n_rows: usize, row_len: usize, min_elems: usize) -> usize {
    if n_rows * row_len < min_elems {
        return n_rows.max(1);
    }
    n_rows.div_ceil(threads()).max(1)
}

/// The `i`-th of `parts` near-equal contiguous parts of `0..n` (the first `n % parts` parts get one more).
///
/// Panics if `i >= parts`.
pub fn split_range(n: usize, parts: usize, i: usize) -> Range<usize> {
    assert!(i < parts, "split_range: part {i} of {parts}");
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_range_covers_everything_once_in_order() {
        for n in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_range(n, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == n / parts || r.len() == n / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn read_sum_is_the_wrapping_sum_on_any_pool() {
        let words: Vec<u64> = (0..1003u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let want = words.iter().fold(0u64, |s, w| s.wrapping_add(*w));
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            assert_eq!(pool.install(|| read_sum(&words)), want, "{threads} threads");
        }
        assert_eq!(read_sum(&[]), 0);
    }

    #[test]
    fn for_each_task_runs_every_task_once_on_any_pool() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let hits: Vec<AtomicU64> = (0..11).map(|_| AtomicU64::new(0)).collect();
            pool.install(|| {
                for_each_task(11, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }
}
