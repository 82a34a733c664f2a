//! Gated DeltaNet kernels: the chunked form against the recurrence, the recurrence against the f64
//! reference, and the causal conv against its reference and across calls.

use crate::common;

use backburner_kernels::gdn::{
    causal_conv1d_silu, delta_rule_chunked, delta_rule_recurrent, GdnDims,
};
use backburner_kernels::reference::{causal_conv1d_silu_reference, delta_rule_reference};
use common::*;

/// Chunked vs recurrent, relative to the output (or state) scale. Both run in f32 (unit roundoff 6e-8) but
/// sum in different orders: dot products over d_k, a forward substitution of up to 64 steps whose
/// multipliers |A_ij| = β|k_i·k_j|·Γ_ij are <= 1, and state products over d_k. The errors seen are ~1e-6;
/// 1e-4 leaves ~100x margin while a real bug (a wrong decay exponent, an off-by-one in the mask or in the
/// chunk boundary) moves outputs by 1e-2 or more.
const CHUNK_TOL: f32 = 1e-4;
/// Recurrent (f32) vs the f64 reference: the same operation order per element over a few hundred tokens, so
/// only f32 rounding of d_k-term sums (~d_k · 6e-8) accumulated through a contracting state.
const REF_TOL: f32 = 1e-5;

/// A delta-rule kernel under test: (inputs, state in/out, out).
type Kernel<'a> = &'a dyn Fn(&Inputs, &mut [f32], &mut [f32]);

/// Random inputs of one delta-rule call, shaped like the real model scaled down.
struct Inputs {
    d: GdnDims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl Inputs {
    /// q, k l2-normalized (q also scaled by d_k^-0.5), v in [-1, 1), g in [g_lo, -0.001), beta in (0, 1).
    fn random(d: GdnDims, seed: u64, g_lo: f32) -> Self {
        let mut r = rng(seed);
        let nq = d.n_tokens * d.n_k_heads * d.d_k;
        let mut q = uniform(&mut r, nq, -1.0, 1.0);
        let mut k = uniform(&mut r, nq, -1.0, 1.0);
        l2norm_rows(&mut q, d.d_k, (d.d_k as f32).powf(-0.5));
        l2norm_rows(&mut k, d.d_k, 1.0);
        let v = uniform(&mut r, d.n_tokens * d.n_v_heads * d.d_v, -1.0, 1.0);
        let g = uniform(&mut r, d.n_tokens * d.n_v_heads, g_lo, -0.001);
        let beta = uniform(&mut r, d.n_tokens * d.n_v_heads, 0.01, 0.99);
        Inputs {
            d,
            q,
            k,
            v,
            g,
            beta,
        }
    }

    /// Tokens `[t0, t1)` as their own call.
    fn slice(&self, t0: usize, t1: usize) -> Inputs {
        let d = GdnDims {
            n_tokens: t1 - t0,
            ..self.d
        };
        let qk = self.d.n_k_heads * self.d.d_k;
        let vv = self.d.n_v_heads * self.d.d_v;
        let hv = self.d.n_v_heads;
        Inputs {
            d,
            q: self.q[t0 * qk..t1 * qk].to_vec(),
            k: self.k[t0 * qk..t1 * qk].to_vec(),
            v: self.v[t0 * vv..t1 * vv].to_vec(),
            g: self.g[t0 * hv..t1 * hv].to_vec(),
            beta: self.beta[t0 * hv..t1 * hv].to_vec(),
        }
    }

    fn out_len(&self) -> usize {
        self.d.n_tokens * self.d.n_v_heads * self.d.d_v
    }

    /// Runs `kernel` from `state` and returns (out, new state).
    fn run(&self, kernel: Kernel, state: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut s = state.to_vec();
        let mut out = vec![f32::NAN; self.out_len()];
        kernel(self, &mut s, &mut out);
        (out, s)
    }
}

fn recurrent(x: &Inputs, s: &mut [f32], o: &mut [f32]) {
    delta_rule_recurrent(x.d, &x.q, &x.k, &x.v, &x.g, &x.beta, s, o);
}

fn chunked(chunk: usize) -> impl Fn(&Inputs, &mut [f32], &mut [f32]) {
    move |x, s, o| delta_rule_chunked(x.d, chunk, &x.q, &x.k, &x.v, &x.g, &x.beta, s, o)
}

fn reference(x: &Inputs, s: &mut [f32], o: &mut [f32]) {
    delta_rule_reference(x.d, &x.q, &x.k, &x.v, &x.g, &x.beta, s, o);
}

fn dims(n_tokens: usize, n_k_heads: usize, n_v_heads: usize, d_k: usize, d_v: usize) -> GdnDims {
    GdnDims {
        n_tokens,
        n_k_heads,
        n_v_heads,
        d_k,
        d_v,
        tiled_v_heads: false,
    }
}

/// A nonzero starting state of the magnitude a real state reaches (entries ~0.3).
fn start_state(d: GdnDims, seed: u64) -> Vec<f32> {
    uniform(&mut rng(seed), d.n_v_heads * d.d_k * d.d_v, -0.3, 0.3)
}

#[test]
fn delta_rule_chunked_matches_recurrent() {
    let shapes = [(2, 4, 16, 24), (2, 2, 32, 32)];
    let mut worst = 0.0f32;
    for (si, &(hk, hv, dk, dv)) in shapes.iter().enumerate() {
        for n in [1, 5, 63, 64, 65, 130, 200] {
            for chunk in [64, 16] {
                let d = dims(n, hk, hv, dk, dv);
                let x = Inputs::random(d, 100 + n as u64 + si as u64, -1.0);
                let s0 = start_state(d, 7 + si as u64);
                let (o_r, s_r) = x.run(&recurrent, &s0);
                let (o_c, s_c) = x.run(&chunked(chunk), &s0);
                let what = format!("shape {:?} n {n} chunk {chunk}", (hk, hv, dk, dv));
                worst = worst.max(assert_close_rel(
                    &format!("{what} out"),
                    &o_c,
                    &o_r,
                    CHUNK_TOL,
                ));
                worst = worst.max(assert_close_rel(
                    &format!("{what} state"),
                    &s_c,
                    &s_r,
                    CHUNK_TOL,
                ));
            }
        }
    }
    eprintln!("delta_rule_chunked vs recurrent: worst relative error {worst:e}");
}

/// Moves the v-head axis of `x` (`[outer, n_v_heads, inner]`) from grouped to tiled order: tiled head `i·hk + g` is
/// grouped head `g·r + i` (r = hv / hk), as llama.cpp's converter reorders them.
fn tile_heads(x: &[f32], hk: usize, hv: usize, inner: usize) -> Vec<f32> {
    let r = hv / hk;
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(hv * inner) {
        for t in 0..hv {
            let (i, g) = (t / hk, t % hk);
            out.extend_from_slice(&row[(g * r + i) * inner..][..inner]);
        }
    }
    out
}

#[test]
fn tiled_v_heads_compute_the_grouped_result_permuted() {
    let (hk, hv, dk, dv) = (2, 6, 16, 8);
    for n in [1, 70] {
        let d = dims(n, hk, hv, dk, dv);
        let x = Inputs::random(d, 31 + n as u64, -1.0);
        let s0 = start_state(d, 5);
        let tiled = Inputs {
            d: GdnDims {
                tiled_v_heads: true,
                ..d
            },
            q: x.q.clone(),
            k: x.k.clone(),
            v: tile_heads(&x.v, hk, hv, dv),
            g: tile_heads(&x.g, hk, hv, 1),
            beta: tile_heads(&x.beta, hk, hv, 1),
        };
        let s0_tiled = tile_heads(&s0, hk, hv, dk * dv);
        let kernels: [(&str, Kernel); 3] = [
            ("recurrent", &recurrent),
            ("chunked", &chunked(16)),
            ("reference", &reference),
        ];
        for (what, kernel) in kernels {
            let (o, s) = x.run(kernel, &s0);
            let (o_t, s_t) = tiled.run(kernel, &s0_tiled);
            assert_eq!(o_t, tile_heads(&o, hk, hv, dv), "{what} n {n}: output");
            assert_eq!(s_t, tile_heads(&s, hk, hv, dk * dv), "{what} n {n}: state");
        }
    }
}

#[test]
fn delta_rule_chunked_matches_recurrent_under_strong_decay() {
    // g down to -12 per token: cumulative decays underflow to 0 inside a chunk, which must not produce
    // inf or NaN (every exponent of the chunked form is <= 0).
    let d = dims(150, 2, 4, 16, 24);
    let x = Inputs::random(d, 3, -12.0);
    let s0 = start_state(d, 4);
    let (o_r, s_r) = x.run(&recurrent, &s0);
    let (o_c, s_c) = x.run(&chunked(64), &s0);
    assert!(o_c.iter().chain(&s_c).all(|v| v.is_finite()));
    let e_o = assert_close_rel("out", &o_c, &o_r, CHUNK_TOL);
    let e_s = assert_close_rel("state", &s_c, &s_r, CHUNK_TOL);
    eprintln!("strong decay: chunked vs recurrent out {e_o:e}, state {e_s:e}");
}

#[test]
fn delta_rule_chunked_over_two_calls_matches_one_call() {
    for (hk, hv, dk, dv) in [(2, 4, 16, 24), (2, 2, 32, 32)] {
        let d = dims(150, hk, hv, dk, dv);
        let x = Inputs::random(d, 11, -1.0);
        let s0 = start_state(d, 12);
        let (o_all, s_all) = x.run(&chunked(64), &s0);
        let (o_a, s_a) = x.slice(0, 70).run(&chunked(64), &s0);
        let (o_b, s_b) = x.slice(70, 150).run(&chunked(64), &s_a);
        let o_split: Vec<f32> = o_a.into_iter().chain(o_b).collect();
        assert_close_rel("out", &o_split, &o_all, CHUNK_TOL);
        assert_close_rel("state", &s_b, &s_all, CHUNK_TOL);
    }
}

#[test]
fn delta_rule_chunked_with_zero_tokens_leaves_state_untouched() {
    let d = dims(0, 2, 4, 16, 24);
    let x = Inputs::random(d, 1, -1.0);
    let s0 = start_state(d, 2);
    let (out, s) = x.run(&chunked(64), &s0);
    assert!(out.is_empty());
    assert_eq!(bits(&s), bits(&s0));
}

#[test]
fn delta_rule_recurrent_matches_reference() {
    for (n, hk, hv, dk, dv) in [(1, 2, 4, 16, 24), (37, 2, 4, 16, 24), (200, 2, 2, 32, 32)] {
        let d = dims(n, hk, hv, dk, dv);
        let x = Inputs::random(d, 21 + n as u64, -1.0);
        let s0 = start_state(d, 22);
        let (o_r, s_r) = x.run(&recurrent, &s0);
        let (o_f, s_f) = x.run(&reference, &s0);
        let e_o = assert_close_rel("out", &o_r, &o_f, REF_TOL);
        let e_s = assert_close_rel("state", &s_r, &s_f, REF_TOL);
        eprintln!("recurrent vs f64 reference, n {n}: out {e_o:e}, state {e_s:e}");
    }
}

#[test]
fn delta_rule_recurrent_split_calls_are_bit_identical_to_one_call() {
    let d = dims(40, 2, 4, 16, 24);
    let x = Inputs::random(d, 31, -1.0);
    let s0 = start_state(d, 32);
    let (o_all, s_all) = x.run(&recurrent, &s0);
    let mut s = s0.clone();
    let mut outs = Vec::new();
    for (a, b) in [(0, 1), (1, 17), (17, 18), (18, 40)] {
        let (o, s_next) = x.slice(a, b).run(&recurrent, &s);
        outs.extend(o);
        s = s_next;
    }
    assert_eq!(bits(&outs), bits(&o_all));
    assert_eq!(bits(&s), bits(&s_all));
}

#[test]
fn delta_rule_recurrent_computes_a_scalar_step_by_hand() {
    // d_k = d_v = 1: S = 0.5·0.5 = 0.25; u = 0.25; δ = 0.5·(2 − 0.25) = 0.875; S = 1.125; o = 1.125·q.
    let d = dims(1, 1, 1, 1, 1);
    let mut s = vec![0.5];
    let mut o = vec![0.0];
    let g = [0.5f32.ln()];
    delta_rule_recurrent(d, &[2.0], &[1.0], &[2.0], &g, &[0.5], &mut s, &mut o);
    assert!((s[0] - 1.125).abs() < 1e-6, "state {}", s[0]);
    assert!((o[0] - 2.25).abs() < 1e-6, "out {}", o[0]);
}

#[test]
#[should_panic(expected = "`state` must have shape [4, 16, 24]")]
fn delta_rule_chunked_panics_on_a_wrong_state_length() {
    let d = dims(3, 2, 4, 16, 24);
    let x = Inputs::random(d, 1, -1.0);
    let mut s = vec![0.0; 10];
    let mut o = vec![0.0; x.out_len()];
    delta_rule_chunked(d, 64, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut s, &mut o);
}

#[test]
#[should_panic(expected = "multiple of n_k_heads")]
fn delta_rule_recurrent_panics_when_v_heads_are_not_a_multiple_of_k_heads() {
    let d = dims(1, 2, 3, 4, 4);
    let mut s = vec![0.0; 3 * 16];
    let mut o = vec![0.0; 12];
    delta_rule_recurrent(
        d, &[0.0; 8], &[0.0; 8], &[0.0; 12], &[0.0; 3], &[0.0; 3], &mut s, &mut o,
    );
}

/// Runs the fast conv and returns (out, state).
fn conv(
    x: &[f32],
    n: usize,
    c: usize,
    kernel: usize,
    w: &[f32],
    state: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let mut s = state.to_vec();
    let mut out = vec![f32::NAN; n * c];
    causal_conv1d_silu(x, n, c, kernel, w, &mut s, &mut out);
    (out, s)
}

#[test]
fn causal_conv1d_silu_computes_a_small_case_by_hand() {
    // One channel, weights [1, 2, 3] (3 multiplies the current token), zero state = zero left padding:
    // pre-activations 3, 2+6 = 8, 1+4+9 = 14; the state keeps the last two raw inputs.
    let (out, s) = conv(&[1.0, 2.0, 3.0], 3, 1, 3, &[1.0, 2.0, 3.0], &[0.0, 0.0]);
    let silu = |z: f32| z / (1.0 + (-z).exp());
    for (o, z) in out.iter().zip([3.0, 8.0, 14.0]) {
        assert!((o - silu(z)).abs() < 1e-6, "{o} vs silu({z})");
    }
    assert_eq!(s, vec![2.0, 3.0]);
}

#[test]
fn causal_conv1d_silu_matches_reference() {
    let (c, kernel) = (37, 4);
    let mut r = rng(41);
    let w = uniform(&mut r, c * kernel, -1.0, 1.0);
    for n in [1, 2, 3, 20, 70] {
        let x = uniform(&mut r, n * c, -2.0, 2.0);
        let s0 = uniform(&mut r, c * (kernel - 1), -2.0, 2.0);
        let (o_f, s_f) = conv(&x, n, c, kernel, &w, &s0);
        let mut s_r = s0.clone();
        let mut o_r = vec![0.0; n * c];
        causal_conv1d_silu_reference(&x, n, c, kernel, &w, &mut s_r, &mut o_r);
        // A 4-term f32 sum and an f32 exp: a few ulps of the output scale.
        assert_close_rel("out", &o_f, &o_r, 1e-6);
        assert_eq!(s_f, s_r, "the state is a copy of raw inputs");
    }
}

#[test]
fn causal_conv1d_silu_state_carries_across_calls_exactly() {
    // Kernel 4 (the architecture's) has its own one-token path; 3 and 5 take the general one.
    for kernel in [3, 4, 5] {
        let (c, n) = (19, 30);
        let mut r = rng(51);
        let w = uniform(&mut r, c * kernel, -1.0, 1.0);
        let x = uniform(&mut r, n * c, -2.0, 2.0);
        let s0 = uniform(&mut r, c * (kernel - 1), -2.0, 2.0);
        let (o_all, s_all) = conv(&x, n, c, kernel, &w, &s0);
        // Splits include one-token calls and calls shorter than kernel - 1, whose new state keeps older entries.
        for cuts in [
            vec![0, 1, 2, 30],
            vec![0, 2, 3, 17, 29, 30],
            vec![0, 15, 30],
        ] {
            let mut s = s0.clone();
            let mut outs = Vec::new();
            for win in cuts.windows(2) {
                let (a, b) = (win[0], win[1]);
                let (o, s_next) = conv(&x[a * c..b * c], b - a, c, kernel, &w, &s);
                outs.extend(o);
                s = s_next;
            }
            assert_eq!(bits(&outs), bits(&o_all), "kernel {kernel}, cuts {cuts:?}");
            assert_eq!(bits(&s), bits(&s_all), "kernel {kernel}, cuts {cuts:?}");
        }
    }
}
