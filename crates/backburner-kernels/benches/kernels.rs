//! Criterion benches of the hot kernels at real-model shapes (Qwen3.5: 24 query heads over 4 KV heads of
//! dim 256; GDN with 16 k heads, 32 v heads, d_k = d_v = 128).
//!
//! `cargo bench -p backburner-kernels` (or `--no-run` to only build).

use backburner_kernels::attention::attend_page;
use backburner_kernels::gdn::{
    causal_conv1d_silu, delta_rule_chunked, delta_rule_recurrent, GdnDims,
};
use backburner_kernels::kv::{KvDtype, KvPage};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;

fn uniform(r: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

fn bench_attend_page(c: &mut Criterion) {
    let (n_heads, n_kv, dim, page_size) = (24, 4, 256, 4096);
    let mut r = StdRng::seed_from_u64(1);
    let k = uniform(&mut r, page_size * n_kv * dim, -1.0, 1.0);
    let v = uniform(&mut r, page_size * n_kv * dim, -1.0, 1.0);
    let mut group = c.benchmark_group("attend_page");
    group.sample_size(10);
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let mut page = KvPage::new(0, page_size, n_kv, dim, dtype);
        page.append(&k, &v, page_size);
        for n_tokens in [1usize, 64, 512] {
            let q = uniform(&mut r, n_tokens * n_heads * dim, -1.0, 1.0);
            // Queries after the page: every query sees all 4096 keys. Throughput in FLOP (2 per multiply-add of
            // q·k and of p·v): "elem/s" reads as FLOP/s, to set beside the FMA peak (roofline).
            group.throughput(Throughput::Elements(
                (4 * n_heads * dim * n_tokens * page_size) as u64,
            ));
            group.bench_with_input(
                BenchmarkId::new(format!("{dtype}"), n_tokens),
                &n_tokens,
                |b, &n| {
                    b.iter(|| {
                        black_box(attend_page(
                            black_box(&q),
                            n,
                            n_heads,
                            page_size,
                            &page,
                            (dim as f32).powf(-0.5),
                        ))
                    })
                },
            );
        }
    }
    group.finish();
}

struct GdnInputs {
    d: GdnDims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn gdn_inputs(n_tokens: usize) -> GdnInputs {
    let d = GdnDims {
        n_tokens,
        n_k_heads: 16,
        n_v_heads: 32,
        d_k: 128,
        d_v: 128,
        tiled_v_heads: false,
    };
    let mut r = StdRng::seed_from_u64(2);
    let nq = n_tokens * d.n_k_heads * d.d_k;
    let norm = |x: &mut Vec<f32>, s: f32| {
        for row in x.chunks_exact_mut(d.d_k) {
            let n = row.iter().map(|a| a * a).sum::<f32>().sqrt();
            row.iter_mut().for_each(|a| *a *= s / n);
        }
    };
    let mut q = uniform(&mut r, nq, -1.0, 1.0);
    let mut k = uniform(&mut r, nq, -1.0, 1.0);
    norm(&mut q, (d.d_k as f32).powf(-0.5));
    norm(&mut k, 1.0);
    GdnInputs {
        d,
        q,
        k,
        v: uniform(&mut r, n_tokens * d.n_v_heads * d.d_v, -1.0, 1.0),
        g: uniform(&mut r, n_tokens * d.n_v_heads, -1.0, -0.001),
        beta: uniform(&mut r, n_tokens * d.n_v_heads, 0.0, 1.0),
    }
}

fn bench_delta_rule(c: &mut Criterion) {
    let mut group = c.benchmark_group("delta_rule");
    group.sample_size(10);
    let x = gdn_inputs(512);
    let state = vec![0.0f32; x.d.n_v_heads * x.d.d_k * x.d.d_v];
    let mut out = vec![0.0f32; 512 * x.d.n_v_heads * x.d.d_v];
    // FLOP of the chunked form per chunk of c tokens and v head: three c×dk×dv products (W·S, Q·S, Kᵀ·V') and five
    // triangular c×c products over dk or dv (K·Kᵀ, two substitutions, Q·Kᵀ, A·V'), 2 FLOP per multiply-add.
    let (c, dk, dv) = (64u64, x.d.d_k as u64, x.d.d_v as u64);
    let per_chunk = 3 * 2 * c * dk * dv + c * c * (3 * dk + 2 * dv);
    group.throughput(Throughput::Elements(
        per_chunk * (512 / c) * x.d.n_v_heads as u64,
    ));
    group.bench_function("chunked_512", |b| {
        b.iter(|| {
            let mut s = state.clone();
            delta_rule_chunked(x.d, 64, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut s, &mut out);
            black_box(&out);
        })
    });
    group.throughput(Throughput::Elements(512));
    group.bench_function("recurrent_512", |b| {
        b.iter(|| {
            let mut s = state.clone();
            delta_rule_recurrent(x.d, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut s, &mut out);
            black_box(&out);
        })
    });
    let one = gdn_inputs(1);
    let mut out1 = vec![0.0f32; one.d.n_v_heads * one.d.d_v];
    let mut s1 = state.clone();
    group.throughput(Throughput::Elements(1));
    group.bench_function("recurrent_decode_1", |b| {
        b.iter(|| {
            delta_rule_recurrent(
                one.d, &one.q, &one.k, &one.v, &one.g, &one.beta, &mut s1, &mut out1,
            );
            black_box(&out1);
        })
    });
    group.finish();
}

/// Decode over a long context at the bench model's shape (8 query heads over 2 KV heads of dim 128): one query
/// token against 8192 cached positions in two pages, f16.
fn bench_attend_decode(c: &mut Criterion) {
    let (n_heads, n_kv, dim, n_keys) = (8, 2, 128, 8192);
    let mut r = StdRng::seed_from_u64(4);
    let mut cache = backburner_kernels::kv::PagedKvCache::new(4096, n_kv, dim, KvDtype::F16);
    cache.append(
        &uniform(&mut r, n_keys * n_kv * dim, -1.0, 1.0),
        &uniform(&mut r, n_keys * n_kv * dim, -1.0, 1.0),
        n_keys,
    );
    let q = uniform(&mut r, n_heads * dim, -1.0, 1.0);
    let mut group = c.benchmark_group("attend_decode");
    group.sample_size(20);
    group.throughput(Throughput::Bytes((2 * n_keys * n_kv * dim * 2) as u64));
    group.bench_function("bench_model_8192", |b| {
        b.iter(|| {
            black_box(cache.attend(black_box(&q), 1, n_heads, n_keys, (dim as f32).powf(-0.5)))
        })
    });
    // As in real decode, where the weights stream through the caches between two attention calls: evict first.
    let evict = vec![1u8; 96 << 20];
    group.bench_function("bench_model_8192_cold", |b| {
        b.iter_batched(
            || black_box(evict.iter().step_by(64).map(|&x| x as u64).sum::<u64>()),
            |_| black_box(cache.attend(black_box(&q), 1, n_heads, n_keys, (dim as f32).powf(-0.5))),
            criterion::BatchSize::PerIteration,
        )
    });
    // The same two inside a one-thread pool, as the engine runs a decode step (`ComputePool::install` around the
    // whole token): `attend`'s parallel loop then runs on the calling thread, without the hand-off to rayon's
    // global pool that the two above pay on every call (a third of their time at one thread).
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    group.bench_function("bench_model_8192_inpool", |b| {
        pool.install(|| {
            b.iter(|| {
                black_box(cache.attend(black_box(&q), 1, n_heads, n_keys, (dim as f32).powf(-0.5)))
            })
        })
    });
    group.bench_function("bench_model_8192_inpool_cold", |b| {
        pool.install(|| {
            b.iter_batched(
                || black_box(evict.iter().step_by(64).map(|&x| x as u64).sum::<u64>()),
                |_| {
                    black_box(cache.attend(
                        black_box(&q),
                        1,
                        n_heads,
                        n_keys,
                        (dim as f32).powf(-0.5),
                    ))
                },
                criterion::BatchSize::PerIteration,
            )
        })
    });
    group.finish();
}

/// The GDN short convolution for one decode token: conv_dim 8,192 (16·128 q + 16·128 k + 32·128 v), kernel 4;
/// bytes = weights + state read and written + x + out.
fn bench_conv_decode(c: &mut Criterion) {
    let mut r = StdRng::seed_from_u64(9);
    let (conv_dim, kernel) = (8192, 4);
    let x = uniform(&mut r, conv_dim, -1.0, 1.0);
    let w = uniform(&mut r, conv_dim * kernel, -0.5, 0.5);
    let mut state = uniform(&mut r, conv_dim * (kernel - 1), -1.0, 1.0);
    let mut out = vec![0.0f32; conv_dim];
    let mut group = c.benchmark_group("conv_decode");
    group.throughput(Throughput::Bytes(
        (4 * conv_dim * (kernel + 2 * (kernel - 1) + 2)) as u64,
    ));
    group.bench_function("8192x4", |b| {
        b.iter(|| causal_conv1d_silu(black_box(&x), 1, conv_dim, kernel, &w, &mut state, &mut out))
    });
    group.finish();
}

criterion_group!(
    benches,
    bench_attend_page,
    bench_delta_rule,
    bench_attend_decode,
    bench_conv_decode
);
criterion_main!(benches);
