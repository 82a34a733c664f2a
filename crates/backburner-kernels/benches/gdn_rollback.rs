//! What rolling a Gated DeltaNet layer back after a speculative verify costs (issue 37, item 4): per layer, for a
//! verify of `T = k + 1` positions (the last accepted token and `k` drafts), at three shapes:
//!
//! * `b27`: the 27B's linear layers (16 q/k heads, 48 v heads, d_k = d_v = 128: a 3 MiB state);
//! * `bench`: the bench model of docs/BENCHMARKS.md (4 q/k heads, 8 v heads of 128: 512 KiB);
//! * `tiny`: the bundled default model (2 q/k heads, 4 v heads of 64: 64 KiB).
//!
//! Cases (`T` in {2, 3, 4, 5, 9}):
//!
//! * `decode_fused/T`: `T` calls of [`delta_rule_decode_step`] (today's decode path: conv, norms, delta rule,
//!   gated norm, one position at a time);
//! * `decode_rec1/T`: `T` calls of [`delta_rule_recurrent`] on one position each (the delta rule alone);
//! * `verify/T`: one [`delta_rule_recurrent`] call on `T` positions (a verify that cannot roll back);
//! * `verify_a/T`: option A, per-position states: `T` one-position calls, the state copied into a slot after each;
//! * `verify_b/T`: option B, inputs kept and replayed: the pre-verify state copied, then one `T`-position call;
//! * `replay_b/T`: option B's rollback in the worst case, `m = T − 1` accepted positions replayed from the copy;
//! * `verify_oop/T`: option B without the copy: one [`delta_rule_recurrent_from`] call on `T` positions, reading
//!   the state from one buffer and writing it to another (the pre-verify state is kept as it is);
//! * `replay_oop/T`: its rollback in the worst case: [`delta_rule_replay`] of `m = T − 1` positions from the kept
//!   state into the live buffer (no output);
//! * `verify_core/T`: the whole core of the model's verify step on `T` positions, against `decode_fused/T`: the
//!   conv state kept (copied), the causal conv of the `T` raw rows (row by row), q/k/v split and normalised,
//!   [`delta_rule_recurrent_from`] from the kept state, the gated norm (`Model::forward_verify`'s linear layer
//!   between its projections);
//! * `chunked/T`: one [`delta_rule_chunked`] call (chunk 64) on `T` positions;
//! * `copy`: one state copy (`copy_from_slice`), and `copy_par` split over the pool's threads.
//!
//! Every iteration takes the next of a ring of states (and of slots) holding at least 64 MiB, twice this machine's
//! L3: as in the model, where the weights stream through the caches between two layers, the state comes from memory.
//!
//! `cargo bench -p backburner-kernels --bench gdn_rollback` (a few minutes; append a filter such as `b27` to narrow).

use std::hint::black_box;
use std::time::Duration;

use backburner_kernels::gdn::{
    causal_conv1d_silu, delta_rule_chunked, delta_rule_decode_step, delta_rule_recurrent,
    delta_rule_recurrent_from, delta_rule_replay, DecodeInputs, GdnDims,
};
use backburner_kernels::rowops::{gated_rms_norm, l2_norm_scaled};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// Bytes a ring of states must span to miss the 32 MiB L3 on every iteration.
const RING_BYTES: usize = 64 << 20;
/// Conv kernel (the architecture's).
const KERNEL: usize = 4;
/// Verify lengths `T = k + 1` for k in {1, 2, 3, 4, 8}.
const TS: [usize; 5] = [2, 3, 4, 5, 9];

fn uniform(r: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// One layer's inputs for `t_max` positions, ready for the delta rule (q, k normalised) and for the fused step (raw).
struct Inputs {
    d: GdnDims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    qkv: Vec<f32>,
    z: Vec<f32>,
    conv_weight: Vec<f32>,
    norm_weight: Vec<f32>,
}

impl Inputs {
    fn new(hk: usize, hv: usize, dk: usize, dv: usize, t_max: usize) -> Self {
        let d = GdnDims {
            n_tokens: t_max,
            n_k_heads: hk,
            n_v_heads: hv,
            d_k: dk,
            d_v: dv,
            tiled_v_heads: false,
        };
        let mut r = StdRng::seed_from_u64(37);
        let norm = |x: &mut Vec<f32>, s: f32| {
            for row in x.chunks_exact_mut(dk) {
                let n = row.iter().map(|a| a * a).sum::<f32>().sqrt();
                row.iter_mut().for_each(|a| *a *= s / n);
            }
        };
        let mut q = uniform(&mut r, t_max * hk * dk, -1.0, 1.0);
        let mut k = uniform(&mut r, t_max * hk * dk, -1.0, 1.0);
        norm(&mut q, (dk as f32).powf(-0.5));
        norm(&mut k, 1.0);
        let conv_dim = 2 * hk * dk + hv * dv;
        Inputs {
            d,
            q,
            k,
            v: uniform(&mut r, t_max * hv * dv, -1.0, 1.0),
            g: uniform(&mut r, t_max * hv, -1.0, -0.001),
            beta: uniform(&mut r, t_max * hv, 0.0, 1.0),
            qkv: uniform(&mut r, t_max * conv_dim, -1.0, 1.0),
            z: uniform(&mut r, t_max * hv * dv, -1.0, 1.0),
            conv_weight: uniform(&mut r, conv_dim * KERNEL, -0.5, 0.5),
            norm_weight: uniform(&mut r, dv, 0.5, 1.5),
        }
    }

    fn state_len(&self) -> usize {
        self.d.n_v_heads * self.d.d_k * self.d.d_v
    }

    fn conv_dim(&self) -> usize {
        2 * self.d.n_k_heads * self.d.d_k + self.d.n_v_heads * self.d.d_v
    }

    /// The delta rule on positions `[t0, t0 + n)`, advancing `s`, writing `out` (`[n, Hv·Dv]`).
    fn recurrent(&self, t0: usize, n: usize, s: &mut [f32], out: &mut [f32]) {
        let d = GdnDims {
            n_tokens: n,
            ..self.d
        };
        let (qk, vv, hv) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v, d.n_v_heads);
        let (a, b) = (t0, t0 + n);
        delta_rule_recurrent(
            d,
            &self.q[a * qk..b * qk],
            &self.k[a * qk..b * qk],
            &self.v[a * vv..b * vv],
            &self.g[a * hv..b * hv],
            &self.beta[a * hv..b * hv],
            s,
            &mut out[..n * vv],
        );
    }

    /// [`Inputs::recurrent`] on positions `[0, n)` out of place, from `src` into `dst`.
    fn recurrent_from(&self, n: usize, src: &[f32], dst: &mut [f32], out: &mut [f32]) {
        let d = GdnDims {
            n_tokens: n,
            ..self.d
        };
        let (qk, vv, hv) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v, d.n_v_heads);
        delta_rule_recurrent_from(
            d,
            &self.q[..n * qk],
            &self.k[..n * qk],
            &self.v[..n * vv],
            &self.g[..n * hv],
            &self.beta[..n * hv],
            src,
            dst,
            &mut out[..n * vv],
        );
    }

    /// The state-only replay of positions `[0, n)` from `src` into `dst`.
    fn replay(&self, n: usize, src: &[f32], dst: &mut [f32]) {
        let d = GdnDims {
            n_tokens: n,
            ..self.d
        };
        let (qk, vv, hv) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v, d.n_v_heads);
        delta_rule_replay(
            d,
            &self.k[..n * qk],
            &self.v[..n * vv],
            &self.g[..n * hv],
            &self.beta[..n * hv],
            src,
            dst,
        );
    }

    /// The model's verify core on positions `[0, n)` (see `verify_core` in the module doc): `conv` advanced (its
    /// old value kept in `b.conv`), the recurrence from `kept` into `live`, the gated-normed output in `b.out`.
    fn verify_core(
        &self,
        n: usize,
        conv: &mut [f32],
        kept: &[f32],
        live: &mut [f32],
        b: &mut Bufs,
    ) {
        let d = GdnDims {
            n_tokens: n,
            ..self.d
        };
        let (cd, qk, vv) = (self.conv_dim(), d.n_k_heads * d.d_k, d.n_v_heads * d.d_v);
        let hv = d.n_v_heads;
        b.conv.copy_from_slice(conv);
        let x = &mut b.x[..n * cd];
        // row by row, as the model's verify (the one-token path: no transposed copies or parallel region)
        for (raw, row) in self.qkv[..n * cd]
            .chunks_exact(cd)
            .zip(x.chunks_exact_mut(cd))
        {
            causal_conv1d_silu(raw, 1, cd, KERNEL, &self.conv_weight, conv, row);
        }
        for (t, row) in x.chunks_exact(cd).enumerate() {
            b.q[t * qk..(t + 1) * qk].copy_from_slice(&row[..qk]);
            b.k[t * qk..(t + 1) * qk].copy_from_slice(&row[qk..2 * qk]);
            b.v[t * vv..(t + 1) * vv].copy_from_slice(&row[2 * qk..]);
        }
        let (q, k) = (&mut b.q[..n * qk], &mut b.k[..n * qk]);
        l2_norm_scaled(q, d.d_k, 1.0 / (d.d_k as f32).sqrt());
        l2_norm_scaled(k, d.d_k, 1.0);
        let out = &mut b.out[..n * vv];
        delta_rule_recurrent_from(
            d,
            q,
            k,
            &b.v[..n * vv],
            &self.g[..n * hv],
            &self.beta[..n * hv],
            kept,
            live,
            out,
        );
        gated_rms_norm(out, &self.z[..n * vv], &self.norm_weight, 1e-6);
    }

    fn chunked(&self, n: usize, s: &mut [f32], out: &mut [f32]) {
        let d = GdnDims {
            n_tokens: n,
            ..self.d
        };
        let (qk, vv, hv) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v, d.n_v_heads);
        delta_rule_chunked(
            d,
            64,
            &self.q[..n * qk],
            &self.k[..n * qk],
            &self.v[..n * vv],
            &self.g[..n * hv],
            &self.beta[..n * hv],
            s,
            &mut out[..n * vv],
        );
    }

    /// One fused decode step of position `t`.
    fn decode(&self, t: usize, conv: &mut [f32], s: &mut [f32], out: &mut [f32]) {
        let d = GdnDims {
            n_tokens: 1,
            ..self.d
        };
        let (cd, vv, hv) = (self.conv_dim(), d.n_v_heads * d.d_v, d.n_v_heads);
        let inp = DecodeInputs {
            qkv: &self.qkv[t * cd..(t + 1) * cd],
            z: &self.z[t * vv..(t + 1) * vv],
            g: &self.g[t * hv..(t + 1) * hv],
            beta: &self.beta[t * hv..(t + 1) * hv],
            conv_weight: &self.conv_weight,
            norm_weight: &self.norm_weight,
            eps: 1e-6,
        };
        delta_rule_decode_step(d, KERNEL, &inp, conv, s, &mut out[..vv]);
    }
}

/// Work buffers of [`Inputs::verify_core`], for `t_max` positions.
struct Bufs {
    conv: Vec<f32>,
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
}

impl Bufs {
    fn new(x: &Inputs, t_max: usize) -> Self {
        let (qk, vv) = (x.d.n_k_heads * x.d.d_k, x.d.n_v_heads * x.d.d_v);
        Bufs {
            conv: vec![0.0; x.conv_dim() * (KERNEL - 1)],
            x: vec![0.0; t_max * x.conv_dim()],
            q: vec![0.0; t_max * qk],
            k: vec![0.0; t_max * qk],
            v: vec![0.0; t_max * vv],
            out: vec![0.0; t_max * vv],
        }
    }
}

/// A ring of `n` buffers of `len` f32 (small random values), handed out in turn.
struct Ring {
    bufs: Vec<Vec<f32>>,
    next: usize,
}

impl Ring {
    fn new(len: usize, min_bytes: usize, seed: u64) -> Self {
        let n = min_bytes.div_ceil(4 * len).max(2);
        let mut r = StdRng::seed_from_u64(seed);
        let bufs = (0..n).map(|_| uniform(&mut r, len, -0.2, 0.2)).collect();
        Ring { bufs, next: 0 }
    }

    fn take(&mut self) -> &mut Vec<f32> {
        let i = self.next;
        self.next = (i + 1) % self.bufs.len();
        &mut self.bufs[i]
    }

    /// Two buffers at once (the ring holds at least two).
    fn take2(&mut self) -> (&mut Vec<f32>, &mut Vec<f32>) {
        let i = self.next;
        let j = (i + 1) % self.bufs.len();
        self.next = (i + 2) % self.bufs.len();
        let (lo, hi) = self.bufs.split_at_mut(i.max(j));
        if i < j {
            (&mut lo[i], &mut hi[0])
        } else {
            (&mut hi[0], &mut lo[j])
        }
    }
}

fn bench_shape(c: &mut Criterion, name: &str, x: &Inputs) {
    let mut group = c.benchmark_group(format!("gdn_rollback_{name}"));
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(300));
    group.measurement_time(Duration::from_millis(800));
    let slen = x.state_len();
    let t_max = *TS.iter().max().unwrap();
    let mut out = vec![0.0f32; t_max * x.d.n_v_heads * x.d.d_v];
    let mut states = Ring::new(slen, RING_BYTES, 1);
    let mut convs = Ring::new(x.conv_dim() * (KERNEL - 1), 0, 2);
    let mut bufs = Bufs::new(x, t_max);

    group.bench_function("copy", |b| {
        b.iter(|| {
            let (src, dst) = states.take2();
            dst.copy_from_slice(src);
            black_box(&dst);
        })
    });
    group.bench_function("copy_par", |b| {
        b.iter(|| {
            let (src, dst) = states.take2();
            let chunk = slen.div_ceil(rayon::current_num_threads()).max(1);
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s));
            black_box(&dst);
        })
    });

    for t in TS {
        // Slots of option A: `t` states per verify, in a ring of their own.
        let mut slots = Ring::new(t * slen, RING_BYTES, 3);
        group.bench_with_input(BenchmarkId::new("decode_fused", t), &t, |b, &t| {
            b.iter(|| {
                let s = states.take();
                let conv = convs.take();
                for p in 0..t {
                    x.decode(p, conv, s, &mut out);
                }
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("decode_rec1", t), &t, |b, &t| {
            b.iter(|| {
                let s = states.take();
                for p in 0..t {
                    x.recurrent(p, 1, s, &mut out);
                }
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("verify", t), &t, |b, &t| {
            b.iter(|| {
                x.recurrent(0, t, states.take(), &mut out);
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("verify_a", t), &t, |b, _| {
            b.iter(|| {
                let s = states.take();
                let slot = slots.take();
                for (p, keep) in slot.chunks_exact_mut(slen).enumerate() {
                    x.recurrent(p, 1, s, &mut out);
                    keep.copy_from_slice(s);
                }
                black_box(&slot);
            })
        });
        group.bench_with_input(BenchmarkId::new("verify_b", t), &t, |b, &t| {
            b.iter(|| {
                let (s, saved) = states.take2();
                saved.copy_from_slice(s);
                x.recurrent(0, t, s, &mut out);
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("replay_b", t), &t, |b, &t| {
            b.iter(|| {
                x.recurrent(0, t - 1, states.take(), &mut out);
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("verify_oop", t), &t, |b, &t| {
            b.iter(|| {
                let (kept, live) = states.take2();
                x.recurrent_from(t, kept, live, &mut out);
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("replay_oop", t), &t, |b, &t| {
            b.iter(|| {
                let (kept, live) = states.take2();
                x.replay(t - 1, kept, live);
                black_box(&live);
            })
        });
        group.bench_with_input(BenchmarkId::new("verify_core", t), &t, |b, &t| {
            b.iter(|| {
                let (kept, live) = states.take2();
                x.verify_core(t, convs.take(), kept, live, &mut bufs);
                black_box(&bufs.out);
            })
        });
        group.bench_with_input(BenchmarkId::new("chunked", t), &t, |b, &t| {
            b.iter(|| {
                x.chunked(t, states.take(), &mut out);
                black_box(&out);
            })
        });
    }
    group.finish();
}

fn bench_rollback(c: &mut Criterion) {
    let t_max = *TS.iter().max().unwrap();
    bench_shape(c, "b27", &Inputs::new(16, 48, 128, 128, t_max));
    bench_shape(c, "bench", &Inputs::new(4, 8, 128, 128, t_max));
    bench_shape(c, "tiny", &Inputs::new(2, 4, 64, 64, t_max));
}

criterion_group!(benches, bench_rollback);
criterion_main!(benches);
