//! Static task splitting on the current thread pool.
//!
//! Kernels run on whatever rayon pool the caller installed (the engine owns one per role: host, worker, server;
//! see `backburner_engine::Compute`). They split their work into a fixed number of equal tasks, usually one per
//! pool thread, so that each thread streams a disjoint, contiguous part of the data (for the bandwidth-bound
//! decode path) and the result never depends on how tasks are scheduled. Inside the engine's hot section (a token
//! loop, `ComputePool::install_hot`) the regions run on its spinning [`Team`](crate::team::Team) instead of rayon's
//! fork/join: the same tasks, claimed by whichever thread is free first.
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
    if crate::team::run_on_team(n_tasks, &|i| meter.task(|| f(i))) {
        return meter.finish();
    }
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
    let n_chunks = data.len().div_ceil(chunk);
    let width = n_chunks.min(threads());
    if width <= 1 {
        for (i, c) in data.chunks_mut(chunk).enumerate() {
            f(i, c);
        }
        return;
    }
    let meter = SyncMeter::start(width);
    if n_chunks <= crate::team::MAX_TEAM_TASKS {
        let (base, len) = (SendPtr(data.as_mut_ptr()), data.len());
        let task = |i: usize| {
            let start = i * chunk;
            let n = chunk.min(len - start);
            // SAFETY: chunk `i` is `[i·chunk, i·chunk + n)` of `data` (n ≥ 1: i < n_chunks), disjoint from every
            // other task's; `data` is borrowed mutably for the whole region.
            let c = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), n) };
            meter.task(|| f(i, c))
        };
        if crate::team::run_on_team(n_chunks, &task) {
            return meter.finish();
        }
    }
    data.par_chunks_mut(chunk)
        .with_max_len(1)
        .enumerate()
        .for_each(|(i, c)| meter.task(|| f(i, c)));
    meter.finish();
}

/// A raw pointer that may cross threads (for the disjoint chunks of [`for_each_chunk_mut`]).
struct SendPtr<T>(*mut T);
// SAFETY: used only to hand out disjoint chunks of a slice of `T: Send` borrowed mutably for the region.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
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

/// Sum (wrapping) of `words`, each thread of the current pool summing one contiguous share: a plain streaming read,
/// used to measure the read bandwidth. Reads with the widest vector loads the CPU has (AVX-512, else AVX2: the
/// width the product kernels use; a build for baseline x86-64 alone would read with 16-byte loads, measured 8–12 %
/// slower on an AMD EPYC).
pub fn read_sum(words: &[u64]) -> u64 {
    let share = words.len().div_ceil(threads()).max(1);
    words
        .par_chunks(share)
        .map(sum_words)
        .reduce(|| 0, u64::wrapping_add)
}

/// Sum (wrapping) of the bytes of `slices` read as little-endian `u64` words (a ragged edge as single bytes), each
/// thread of the current pool summing one contiguous share of every slice in one parallel region: a plain read of
/// exactly these bytes, with the placement in memory (pages, caches) of whatever holds them, e.g. a model's weights.
pub fn read_sum_slices(slices: &[&[u8]]) -> u64 {
    let n = threads().max(1);
    (0..n)
        .into_par_iter()
        .map(|t| {
            slices.iter().fold(0u64, |acc, s| {
                let part = &s[split_range(s.len(), n, t)];
                // SAFETY: any bit pattern is a valid u64.
                let (head, mid, tail) = unsafe { part.align_to::<u64>() };
                let edge = head
                    .iter()
                    .chain(tail)
                    .fold(0u64, |a, &b| a.wrapping_add(u64::from(b)));
                acc.wrapping_add(sum_words(mid)).wrapping_add(edge)
            })
        })
        .reduce(|| 0, u64::wrapping_add)
}

/// Wrapping sum of `c` on the widest ISA available.
fn sum_words(c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::allowed(2) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked).
            return unsafe { sum_words_avx512(c) };
        }
        if crate::simd::allowed(1) && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked).
            return unsafe { sum_words_avx2(c) };
        }
    }
    sum_words_body(c)
}

/// Four 512-bit accumulators over 32-word steps (explicit loads: left to itself the compiler vectorizes the scalar
/// body across steps with gathers), then the scalar body for the rest.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_words_avx512(c: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let steps = c.chunks_exact(32);
    let rest = steps.remainder();
    let mut acc = [_mm512_setzero_si512(); 4];
    for w in steps {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: w holds 32 words; lane j's 8 words are w[8j..8j + 8].
            *a = _mm512_add_epi64(*a, unsafe {
                _mm512_loadu_si512(w.as_ptr().add(8 * j).cast())
            });
        }
    }
    let v = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    (_mm512_reduce_add_epi64(v) as u64).wrapping_add(sum_words_body(rest))
}

/// As [`sum_words_avx512`] with four 256-bit accumulators over 16-word steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(c: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let steps = c.chunks_exact(16);
    let rest = steps.remainder();
    let mut acc = [_mm256_setzero_si256(); 4];
    for w in steps {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: w holds 16 words; lane j's 4 words are w[4j..4j + 4].
            *a = _mm256_add_epi64(*a, unsafe {
                _mm256_loadu_si256(w.as_ptr().add(4 * j).cast())
            });
        }
    }
    let v = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    let mut lanes = [0u64; 4];
    // SAFETY: lanes is 32 bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), v) };
    lanes
        .iter()
        .fold(sum_words_body(rest), |s, x| s.wrapping_add(*x))
}

/// Eight independent accumulators over chunks of 8 words (one 512-bit or two 256-bit adds per chunk once vectorized).
#[inline(always)]
fn sum_words_body(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for w in c.chunks_exact(8) {
        for (a, x) in acc.iter_mut().zip(w) {
            *a = a.wrapping_add(*x);
        }
    }
    let tail = c.chunks_exact(8).remainder().iter();
    tail.chain(&acc).fold(0u64, |s, a| s.wrapping_add(*a))
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
    fn read_sum_is_the_same_on_every_isa() {
        use crate::simd::{ISA_CAP, ISA_MAX};
        let words: Vec<u64> = (0..4099u64)
            .map(|i| i.wrapping_mul(0x2545_f491_4f6c_dd1d))
            .collect();
        let want = words.iter().fold(0u64, |s, w| s.wrapping_add(*w));
        for cap in [0u8, 1, 2] {
            ISA_CAP.store(cap, Ordering::SeqCst);
            let got = sum_words(&words);
            ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
            assert_eq!(got, want, "cap {cap}");
        }
    }

    #[test]
    fn read_sum_slices_reads_every_byte_of_ragged_slices_once() {
        // One nonzero byte at each position of slices at odd offsets and lengths, on 1–3 threads: it counts once, as
        // a byte (at an edge) or inside its aligned little-endian word, and nothing else counts.
        let mut bytes = vec![0u8; 600];
        let ranges = [3..200, 200..201, 201..201, 201..597];
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for i in 3..597 {
                bytes[i] = 7;
                let slices: Vec<&[u8]> = ranges.iter().map(|r| &bytes[r.clone()]).collect();
                let got = pool.install(|| read_sum_slices(&slices));
                let shift = 8 * (bytes[i..].as_ptr() as usize % 8);
                assert!(
                    got == 7 || got == 7 << shift,
                    "byte {i}, {threads} threads: {got:#x}"
                );
                bytes[i] = 0;
            }
        }
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
