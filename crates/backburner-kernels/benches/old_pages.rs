//! The KV-offload worker's operator alone: attention of decode-shaped queries over many old (full, frozen) f16
//! pages, folded in page order ([`fold_pages`]). Block-major pages (as a [`KvPage`] grows) and the same pages
//! packed head-major ([`PackedPage`]) are timed alternately, round by round, beside a read bandwidth measured in
//! the same rounds (a SIMD sum over a buffer of the same size, on the same threads); the table gives medians.
//!
//! * "DRAM": 256 MiB of K+V (far beyond L2 and L3), each page read once per fold, as on a worker with a long
//!   context; the bandwidth is that of a 256 MiB buffer.
//! * "cache": one page attended 64 times (in L2 for 256 positions, L3 for 4096); the bandwidth is that of a buffer
//!   of the page's size.
//!
//! Measured on the 2-core AMD EPYC (Zen 4) dev VM, single-core read bandwidth 17-21 GB/s (drifting, shared VM),
//! decode (1 token), 1 thread, DRAM: packed pages run 1.3-1.8x faster than block-major ones for the bench shape and
//! 1.1-1.3x for the 24/4/256 shape; in cache and for 4-token batches (FMA-bound) the two layouts are within noise.
//! Packed pages, medians of 5 runs of 15 rounds, before (6dfef0e) and after the 6-row tile for groups of 6 rows
//! (d2624f7; the 8/2/128 kernel is unchanged, its two columns show the run-to-run noise):
//!
//! ```text
//! shape     page  set    before µs/page  GB/s  %bw   after µs/page  GB/s  %bw
//! 8/2/128    256  DRAM            19.8   13.2  64%            21.2   12.4  64%
//! 8/2/128   4096  DRAM           276     15.2  77%           301     13.9  73%
//! 24/4/256   256  DRAM           127      8.3  45%           113      9.3  50%
//! 24/4/256  4096  DRAM          1969      8.5  45%          1755      9.6  52%
//! 8/2/128    256  cache           13.3   19.8   -             13.5   19.5   -
//! 24/4/256   256  cache           85.3   12.3   -             69.6   15.1   -
//! ```
//!
//! In cache the 8/2/128 kernel takes about as long per page (13.3 µs for 256 positions) as DRAM needs to deliver
//! the page at 20 GB/s (13.1 µs): it is compute-bound and memory-bound at once, so its DRAM time is near the sum
//! rather than the maximum of the two. Interleaving the softmax reductions of a group's rows saved ~4 % in cache and
//! did not show in DRAM beyond the noise; prefetching the whole next block into L2 made packed pages 20-40 % slower;
//! two passes of 2 rows x 8 value vectors (each value row read whole) made packed pages ~8 % slower.
//!
//! `cargo bench -p backburner-kernels --bench old_pages` (prints a table; `-- --quick` for fewer rounds; rows can
//! be selected through the environment, see [`Filter`]).

use std::hint::black_box;
use std::time::Instant;

use backburner_kernels::attention::fold_pages;
use backburner_kernels::kv::{KvDtype, KvPage, PackedPage, PageView};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// An attention shape: query heads, KV heads, head dimension.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    n_heads: usize,
    n_kv: usize,
    dim: usize,
}

const SHAPES: [Shape; 2] = [
    // backburner-cli's bench model (crates/backburner-cli/src/bench.rs).
    Shape {
        name: "bench 8/2/128",
        n_heads: 8,
        n_kv: 2,
        dim: 128,
    },
    // A Qwen3.5 full-attention layer at real width (as benches/kernels.rs).
    Shape {
        name: "qwen3.5 24/4/256",
        n_heads: 24,
        n_kv: 4,
        dim: 256,
    },
];
const PAGE_SIZES: [usize; 2] = [256, 4096];
const TOKENS: [usize; 2] = [1, 4];
const THREADS: [usize; 2] = [1, 2];
/// K+V bytes of the memory-bound working set.
const DRAM_BYTES: usize = 256 << 20;
/// Folds over the one page of the in-cache case.
const CACHE_REPEAT: usize = 64;

/// Median seconds of the block-major fold, the packed fold and the bandwidth sum.
struct Medians {
    unpacked: f64,
    packed: f64,
    bw_s: f64,
}

/// Which rows to run, from the environment (unset: all): `BB_SHAPE` (a prefix of the shape's name), `BB_PAGE`,
/// `BB_TOK`, `BB_THR`, `BB_SET` (`DRAM` or `cache`); `BB_MIB` sets the DRAM working set in MiB, `BB_KV` the pages'
/// dtype (`f16`, the default, or `bf16`: the pair kernel).
struct Filter;

impl Filter {
    fn skip(key: &str, value: &str) -> bool {
        std::env::var(key).is_ok_and(|want| !value.starts_with(&want))
    }

    fn dtype() -> KvDtype {
        std::env::var("BB_KV").map_or(KvDtype::F16, |d| d.parse().expect("BB_KV: f16 or bf16"))
    }

    fn dram_bytes() -> usize {
        std::env::var("BB_MIB").map_or(DRAM_BYTES, |m| {
            m.parse::<usize>().expect("BB_MIB: MiB") << 20
        })
    }
}

fn main() {
    let rounds = if std::env::args().any(|a| a == "--quick") {
        5
    } else {
        15
    };
    let big = vec![1.0f32; Filter::dram_bytes() / 4];
    println!(
        "old-page attention, {} KV, queries after every page; medians of {rounds} alternating rounds; \
         GB/s = K+V bytes / time; %bw = of the sum bandwidth on as many threads in the same rounds; \
         speedup = unpacked / packed time",
        Filter::dtype()
    );
    let head = [
        "shape", "page", "tok", "thr", "set", "bw GB/s", "µs/page", "GB/s", "%bw",
    ];
    println!(
        "{:<17} {:>5} {:>3} {:>3} {:>5} | {:>7} | {:>9} {:>6} {:>4} | {:>9} {:>6} {:>4} | speedup",
        head[0],
        head[1],
        head[2],
        head[3],
        head[4],
        head[5],
        head[6],
        head[7],
        head[8],
        "packed µs",
        "GB/s",
        "%bw",
    );
    for shape in SHAPES {
        for page_size in PAGE_SIZES {
            let skip = Filter::skip("BB_SHAPE", shape.name)
                || Filter::skip("BB_PAGE", &page_size.to_string());
            if !skip {
                bench_pages(shape, page_size, &big, rounds);
            }
        }
    }
}

/// Every row of one shape and page size: pages built once (block-major and packed), then each thread count,
/// token count and working set.
fn bench_pages(shape: Shape, page_size: usize, big: &[f32], rounds: usize) {
    let page_bytes = 2 * page_size * shape.n_kv * shape.dim * 2;
    let pages = build_pages(shape, page_size, Filter::dram_bytes() / page_bytes);
    let packed: Vec<PackedPage> = pages.iter().map(|p| PackedPage::pack(p.view())).collect();
    let u: Vec<PageView<'_>> = pages.iter().map(KvPage::view).collect();
    let p: Vec<PageView<'_>> = packed.iter().map(PackedPage::view).collect();
    let cache = (vec![u[0]; CACHE_REPEAT], vec![p[0]; CACHE_REPEAT]);
    let small = vec![1.0f32; page_bytes / 4];
    for threads in THREADS {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        for n_tokens in TOKENS {
            let sets = [
                ("DRAM", (&u, &p), big),
                ("cache", (&cache.0, &cache.1), &small[..]),
            ];
            for (set, (vu, vp), buf) in sets {
                let skip = Filter::skip("BB_THR", &threads.to_string())
                    || Filter::skip("BB_TOK", &n_tokens.to_string())
                    || Filter::skip("BB_SET", set);
                if skip {
                    continue;
                }
                // The sum reads as many bytes as the fold: the buffer once (DRAM) or 64 times (cache).
                let bytes = page_bytes * vu.len();
                let reps = bytes / (4 * buf.len());
                let m = pool.install(|| measure(shape, n_tokens, (vu, vp), (buf, reps), rounds));
                print_row(shape, page_size, (n_tokens, threads, set), bytes, &m);
            }
        }
    }
}

/// `n_pages` full pages (f16, or `BB_KV`) of `page_size` positions, consecutive from position 0 (random rows from a small pool,
/// each page its own storage).
fn build_pages(shape: Shape, page_size: usize, n_pages: usize) -> Vec<KvPage> {
    let mut r = StdRng::seed_from_u64(7);
    let n = page_size * shape.n_kv * shape.dim;
    let pool: Vec<(Vec<f32>, Vec<f32>)> = (0..4)
        .map(|_| {
            let mut u = || (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
            (u(), u())
        })
        .collect();
    (0..n_pages)
        .map(|i| {
            let mut p = KvPage::new(
                i * page_size,
                page_size,
                shape.n_kv,
                shape.dim,
                Filter::dtype(),
            );
            let (k, v) = &pool[i % pool.len()];
            p.append(k, v, page_size);
            p
        })
        .collect()
}

/// Alternating rounds (the order flips every round) of: the fold over `unpacked`, the fold over `packed`, `reps`
/// sums over `buf` split over the current pool's threads. Asserts that both folds give the same bits.
fn measure(
    shape: Shape,
    n_tokens: usize,
    (unpacked, packed): (&[PageView<'_>], &[PageView<'_>]),
    (buf, reps): (&[f32], usize),
    rounds: usize,
) -> Medians {
    let mut r = StdRng::seed_from_u64(11);
    let q: Vec<f32> = (0..n_tokens * shape.n_heads * shape.dim)
        .map(|_| r.random_range(-1.0f32..1.0))
        .collect();
    let pos0 = unpacked
        .iter()
        .map(|p| p.start() + p.len())
        .max()
        .unwrap_or(0);
    let scale = (shape.dim as f32).powf(-0.5);
    let fold = |views: &[PageView<'_>]| {
        let t = Instant::now();
        let out = fold_pages(
            &q,
            n_tokens,
            shape.n_heads,
            pos0,
            views.iter().copied(),
            scale,
            Some(shape.dim),
            None,
        );
        (t.elapsed().as_secs_f64(), black_box(out))
    };
    assert_eq!(
        fold(unpacked).1,
        fold(packed).1,
        "packed pages must give the same bits"
    );
    let (mut tu, mut tp, mut tb) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        tb.push((0..reps).map(|_| read_seconds(buf)).sum());
        if i % 2 == 0 {
            tu.push(fold(unpacked).0);
            tp.push(fold(packed).0);
        } else {
            tp.push(fold(packed).0);
            tu.push(fold(unpacked).0);
        }
    }
    Medians {
        unpacked: median(tu),
        packed: median(tp),
        bw_s: median(tb),
    }
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

/// One table row: `bytes` of K+V read per fold.
fn print_row(
    shape: Shape,
    page: usize,
    (tok, thr, set): (usize, usize, &str),
    bytes: usize,
    m: &Medians,
) {
    let n_pages = bytes / (2 * page * shape.n_kv * shape.dim * 2);
    let (bw, gu, gp) = (
        bytes as f64 / m.bw_s / 1e9,
        bytes as f64 / m.unpacked / 1e9,
        bytes as f64 / m.packed / 1e9,
    );
    println!(
        "{:<17} {:>5} {:>3} {:>3} {:>5} | {:>7.1} | {:>9.2} {:>6.1} {:>3.0}% | {:>9.2} {:>6.1} {:>3.0}% | {:>6.3}",
        shape.name,
        page,
        tok,
        thr,
        set,
        bw,
        m.unpacked / n_pages as f64 * 1e6,
        gu,
        100.0 * gu / bw,
        m.packed / n_pages as f64 * 1e6,
        gp,
        100.0 * gp / bw,
        m.unpacked / m.packed,
    );
}

/// Seconds to read `buf` once, split in equal parts over the current rayon pool's threads.
fn read_seconds(buf: &[f32]) -> f64 {
    use rayon::prelude::*;
    let parts = rayon::current_num_threads();
    let chunk = buf.len().div_ceil(parts);
    let t = Instant::now();
    let s: f32 = buf.par_chunks(chunk).map(sum).sum();
    let dt = t.elapsed().as_secs_f64();
    black_box(s);
    dt
}

/// `Σ x` in 64 independent lanes (vectorized; AVX-512 where the CPU has it).
fn sum(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { sum_avx512(x) };
    }
    sum_lanes(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    sum_lanes(x)
}

#[inline(always)]
fn sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 64];
    let mut c = x.chunks_exact(64);
    for v in &mut c {
        for l in 0..64 {
            acc[l] += v[l];
        }
    }
    acc.iter().sum::<f32>() + c.remainder().iter().sum::<f32>()
}
