//! The fused decode step of a Gated DeltaNet core against the separate kernels it replaces at decode: the same bits,
//! for both v-head orders, several thread counts, the architecture's conv kernel and another, and the 128-wide and
//! general value heads.

use crate::common;

use backburner_kernels::gdn::{
    causal_conv1d_silu, delta_rule_decode_step, delta_rule_recurrent, DecodeInputs, GdnDims,
};
use backburner_kernels::rowops::{gated_rms_norm, l2_norm_scaled};
use common::*;

/// One layer's decode inputs and states, random.
struct Case {
    d: GdnDims,
    kernel: usize,
    qkv: Vec<f32>,
    z: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    conv_weight: Vec<f32>,
    norm_weight: Vec<f32>,
    conv_state: Vec<f32>,
    state: Vec<f32>,
}

impl Case {
    fn new(d: GdnDims, kernel: usize, seed: u64) -> Self {
        let mut r = rng(seed);
        let conv_dim = 2 * d.n_k_heads * d.d_k + d.n_v_heads * d.d_v;
        let (hv, hvdv) = (d.n_v_heads, d.n_v_heads * d.d_v);
        Case {
            d,
            kernel,
            qkv: uniform(&mut r, conv_dim, -2.0, 2.0),
            z: uniform(&mut r, hvdv, -2.0, 2.0),
            g: uniform(&mut r, hv, -3.0, -0.01),
            beta: uniform(&mut r, hv, 0.05, 0.95),
            conv_weight: uniform(&mut r, conv_dim * kernel, -0.5, 0.5),
            norm_weight: uniform(&mut r, d.d_v, 0.5, 1.5),
            conv_state: uniform(&mut r, conv_dim * (kernel - 1), -1.0, 1.0),
            state: uniform(&mut r, hv * d.d_k * d.d_v, -0.2, 0.2),
        }
    }

    fn inputs(&self) -> DecodeInputs<'_> {
        DecodeInputs {
            qkv: &self.qkv,
            z: &self.z,
            g: &self.g,
            beta: &self.beta,
            conv_weight: &self.conv_weight,
            norm_weight: &self.norm_weight,
            eps: 1e-6,
        }
    }

    /// The separate kernels, as the many-token path runs them: (conv state, state, output) after one token.
    fn separate(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = self.d;
        let (hk, dk, hvdv) = (d.n_k_heads, d.d_k, d.n_v_heads * d.d_v);
        let conv_dim = self.qkv.len();
        let (mut conv_state, mut state) = (self.conv_state.clone(), self.state.clone());
        let mut x = vec![0.0f32; conv_dim];
        let w = &self.conv_weight;
        causal_conv1d_silu(
            &self.qkv,
            1,
            conv_dim,
            self.kernel,
            w,
            &mut conv_state,
            &mut x,
        );
        let (q, rest) = x.split_at_mut(hk * dk);
        let (k, v) = rest.split_at_mut(hk * dk);
        l2_norm_scaled(q, dk, 1.0 / (dk as f32).sqrt());
        l2_norm_scaled(k, dk, 1.0);
        let mut out = vec![0.0f32; hvdv];
        delta_rule_recurrent(d, q, k, v, &self.g, &self.beta, &mut state, &mut out);
        gated_rms_norm(&mut out, &self.z, &self.norm_weight, 1e-6);
        (conv_state, state, out)
    }

    /// The fused step on a pool of `threads` threads.
    fn fused(&self, threads: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (mut conv_state, mut state) = (self.conv_state.clone(), self.state.clone());
        let mut out = vec![f32::NAN; self.d.n_v_heads * self.d.d_v];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        pool.install(|| {
            delta_rule_decode_step(
                self.d,
                self.kernel,
                &self.inputs(),
                &mut conv_state,
                &mut state,
                &mut out,
            )
        });
        (conv_state, state, out)
    }
}

fn dims(hk: usize, hv: usize, dk: usize, dv: usize, tiled: bool) -> GdnDims {
    GdnDims {
        n_tokens: 1,
        n_k_heads: hk,
        n_v_heads: hv,
        d_k: dk,
        d_v: dv,
        tiled_v_heads: tiled,
    }
}

#[test]
fn the_fused_decode_step_gives_the_bits_of_the_separate_kernels() {
    let cases = [
        // the bench model's shape (4 q/k heads, 8 v heads of 128), both v-head orders, kernel 4
        (dims(4, 8, 128, 128, false), 4),
        (dims(4, 8, 128, 128, true), 4),
        // 3 q/k heads over 2 threads (uneven), v heads of 64 (the general step), kernel 3 (the general conv)
        (dims(3, 6, 32, 64, true), 3),
        (dims(3, 9, 16, 24, false), 2),
    ];
    for (i, (d, kernel)) in cases.into_iter().enumerate() {
        let case = Case::new(d, kernel, 40 + i as u64);
        let want = case.separate();
        assert_ne!(
            bits(&want.1),
            bits(&case.state),
            "case {i}: the state moved"
        );
        for threads in [1, 2, 3] {
            let got = case.fused(threads);
            let what = format!("case {i} ({d:?}, kernel {kernel}), {threads} threads");
            assert_eq!(bits(&got.0), bits(&want.0), "{what}: conv state");
            assert_eq!(bits(&got.1), bits(&want.1), "{what}: recurrent state");
            assert_eq!(bits(&got.2), bits(&want.2), "{what}: output");
        }
    }
}

#[test]
#[should_panic(expected = "one token")]
fn the_fused_decode_step_refuses_two_tokens() {
    let mut d = dims(1, 1, 4, 4, false);
    let case = Case::new(d, 4, 1);
    d.n_tokens = 2;
    let (mut cs, mut s, mut o) = (case.conv_state.clone(), case.state.clone(), vec![0.0; 4]);
    delta_rule_decode_step(d, 4, &case.inputs(), &mut cs, &mut s, &mut o);
}
