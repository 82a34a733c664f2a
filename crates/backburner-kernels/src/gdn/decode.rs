//! One decode token of a Gated DeltaNet layer's core (causal conv, q/k L2 norms, delta rule, gated norm) as one
//! parallel region split by q/k heads.
//!
//! The same arithmetic as the separate kernels ([`causal_conv1d_silu`](super::causal_conv1d_silu),
//! [`l2_norm_scaled`](crate::rowops::l2_norm_scaled), [`delta_rule_recurrent`](super::delta_rule_recurrent),
//! [`gated_rms_norm`](crate::rowops::gated_rms_norm)) on the same values, so the same bits. Run as one step, each
//! thread convolves and normalises only the channels of its own heads, where the separate kernels ran the conv and
//! the norms on one thread between two parallel regions: at decode those were a few microseconds each per layer,
//! latency-bound on data the weight stream had evicted, while the other thread waited.

use super::recurrent::decode_head;
use super::{causal_conv1d_silu, GdnDims};
use crate::parallel::{for_each_chunk_mut, split_range, threads};
use crate::rowops::{gated_rms_norm, l2_norm_scaled};

/// The per-token inputs of [`delta_rule_decode_step`] (one token, f32).
///
/// * `qkv`: `[conv_dim]` the raw `in_proj_qkv` output (`[q: Hk·Dk | k: Hk·Dk | v: Hv·Dv]`, before the conv);
/// * `z`: `[Hv·Dv]` the output gate's input (`in_proj_z`);
/// * `g`: `[Hv]` log-decay (`<= 0`); `beta`: `[Hv]` write strength;
/// * `conv_weight`: `[conv_dim, kernel]` (HF `conv1d.weight` flattened);
/// * `norm_weight`: `[Dv]` the gated RMSNorm's weight; `eps` its epsilon.
#[derive(Clone, Copy, Debug)]
pub struct DecodeInputs<'a> {
    /// `[conv_dim]` raw `in_proj_qkv` output.
    pub qkv: &'a [f32],
    /// `[Hv·Dv]` gate input.
    pub z: &'a [f32],
    /// `[Hv]` log-decay.
    pub g: &'a [f32],
    /// `[Hv]` write strength.
    pub beta: &'a [f32],
    /// `[conv_dim, kernel]` conv weight.
    pub conv_weight: &'a [f32],
    /// `[Dv]` gated-norm weight.
    pub norm_weight: &'a [f32],
    /// Gated-norm epsilon.
    pub eps: f32,
}

/// One token (`d.n_tokens` must be 1) of a Gated DeltaNet core: for `conv_dim = 2·Hk·Dk + Hv·Dv`,
///
/// ```text
/// x = silu(conv(qkv; conv_state));  q = l2norm(x_q)·Dk^-½;  k = l2norm(x_k);  v = x_v
/// per v head j: S_j ← delta rule (q, k of head k_head(j), v_j, g_j, β_j);  out_j = gated_rms_norm(S_jᵀq, z_j)
/// ```
///
/// * `conv_state`: `[conv_dim, kernel − 1]` f32, advanced by the token;
/// * `state`: `[Hv, Dk, Dv]` f32 recurrent state, advanced;
/// * `out`: `[Hv·Dv]` f32, written.
///
/// Bit-identical to `causal_conv1d_silu` → `l2_norm_scaled` (q with `Dk^-½`, k with 1) → `delta_rule_recurrent` →
/// `gated_rms_norm` on the same inputs, whatever the thread count: the q/k heads are split over the pool's threads,
/// each taking the v heads that read its q/k heads, and every element is computed by the same operations as there.
///
/// Panics if `d.n_tokens != 1`, `kernel == 0` or a slice does not have its shape.
pub fn delta_rule_decode_step(
    d: GdnDims,
    kernel: usize,
    inp: &DecodeInputs<'_>,
    conv_state: &mut [f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let (hk, hv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.d_k, d.d_v);
    d.ratio();
    assert!(
        d.n_tokens == 1 && kernel > 0,
        "delta_rule_decode_step: one token and a positive kernel, got {d:?}, kernel {kernel}"
    );
    let conv_dim = 2 * hk * dk + hv * dv;
    let h = kernel - 1;
    let shapes = [
        (inp.qkv.len(), conv_dim),
        (inp.z.len(), hv * dv),
        (inp.g.len(), hv),
        (inp.beta.len(), hv),
        (inp.conv_weight.len(), conv_dim * kernel),
        (inp.norm_weight.len(), dv),
        (conv_state.len(), conv_dim * h),
        (state.len(), hv * dk * dv),
        (out.len(), hv * dv),
    ];
    assert!(
        shapes.iter().all(|(got, want)| got == want),
        "delta_rule_decode_step: shapes (got, want) {shapes:?} for {d:?}, kernel {kernel}"
    );
    let n_tasks = threads().clamp(1, hk);
    let mut tasks = HeadTask::split(d, h, n_tasks, conv_state, state, out);
    for_each_chunk_mut(&mut tasks, 1, |_, t| {
        for task in t {
            task.run(d, kernel, inp);
        }
    });
}

/// One task's heads: q/k heads (with their q and k conv-state channels) and the v heads that read them (with their
/// v conv-state channels, recurrent states and outputs).
struct HeadTask<'s> {
    k_heads: Vec<KHead<'s>>,
    v_heads: Vec<VHead<'s>>,
}

/// A q/k head `i` and its q and k channels' conv state (`[Dk, kernel − 1]` each).
struct KHead<'s> {
    i: usize,
    q_conv: &'s mut [f32],
    k_conv: &'s mut [f32],
}

/// A v head `j`: its v channels' conv state (`[Dv, kernel − 1]`), recurrent state (`[Dk, Dv]`) and output (`[Dv]`).
struct VHead<'s> {
    j: usize,
    conv: &'s mut [f32],
    state: &'s mut [f32],
    out: &'s mut [f32],
}

impl<'s> HeadTask<'s> {
    /// Splits the states and the output among `n` tasks by contiguous q/k head ranges (`h` = kernel − 1 state
    /// columns per conv channel).
    fn split(
        d: GdnDims,
        h: usize,
        n: usize,
        conv_state: &'s mut [f32],
        state: &'s mut [f32],
        out: &'s mut [f32],
    ) -> Vec<Self> {
        let (hk, dk, dv) = (d.n_k_heads, d.d_k, d.d_v);
        let (q_conv, rest) = conv_state.split_at_mut(hk * dk * h);
        let (k_conv, v_conv) = rest.split_at_mut(hk * dk * h);
        let mut q_conv: Vec<_> = q_conv.chunks_mut(dk * h).map(Some).collect();
        let mut k_conv: Vec<_> = k_conv.chunks_mut(dk * h).map(Some).collect();
        let mut v_conv: Vec<_> = v_conv.chunks_mut(dv * h).map(Some).collect();
        let mut states: Vec<_> = state.chunks_mut(dk * dv).map(Some).collect();
        let mut outs: Vec<_> = out.chunks_mut(dv).map(Some).collect();
        let owned = "each head has one owner";
        (0..n)
            .map(|t| {
                let kr = split_range(hk, n, t);
                let k_heads = kr
                    .clone()
                    .map(|i| KHead {
                        i,
                        q_conv: q_conv[i].take().expect(owned),
                        k_conv: k_conv[i].take().expect(owned),
                    })
                    .collect();
                let v_heads = (0..d.n_v_heads)
                    .filter(|&j| kr.contains(&d.k_head(j)))
                    .map(|j| VHead {
                        j,
                        conv: v_conv[j].take().expect(owned),
                        state: states[j].take().expect(owned),
                        out: outs[j].take().expect(owned),
                    })
                    .collect();
                HeadTask { k_heads, v_heads }
            })
            .collect()
    }

    /// Convolves, normalises and runs the delta rule for this task's heads.
    fn run(&mut self, d: GdnDims, kernel: usize, inp: &DecodeInputs<'_>) {
        let (hk, dk, dv) = (d.n_k_heads, d.d_k, d.d_v);
        let one = |ch0: usize, n: usize, st: &mut [f32], o: &mut [f32]| {
            let (x, w) = (
                &inp.qkv[ch0..ch0 + n],
                &inp.conv_weight[ch0 * kernel..(ch0 + n) * kernel],
            );
            causal_conv1d_silu(x, 1, n, kernel, w, st, o);
        };
        // q and k of this task's q/k heads, in k_heads order: [n_own][q | k][Dk].
        let mut qk = vec![0.0f32; self.k_heads.len() * 2 * dk];
        for (kh, row) in self.k_heads.iter_mut().zip(qk.chunks_exact_mut(2 * dk)) {
            let (q, k) = row.split_at_mut(dk);
            one(kh.i * dk, dk, kh.q_conv, q);
            one((hk + kh.i) * dk, dk, kh.k_conv, k);
            l2_norm_scaled(q, dk, 1.0 / (dk as f32).sqrt());
            l2_norm_scaled(k, dk, 1.0);
        }
        let first_k = self.k_heads.first().map_or(0, |k| k.i);
        let mut v = vec![0.0f32; dv];
        for vi in 0..self.v_heads.len() {
            // The next head's state, prefetched during this one's second pass.
            let next = self
                .v_heads
                .get(vi + 1)
                .map(|n| n.state.as_ptr().cast::<u8>());
            let vh = &mut self.v_heads[vi];
            let j = vh.j;
            one(2 * hk * dk + j * dv, dv, vh.conv, &mut v);
            let (q, k) = qk[(d.k_head(j) - first_k) * 2 * dk..][..2 * dk].split_at(dk);
            decode_head(
                q,
                k,
                &v,
                inp.g[j].exp(),
                inp.beta[j],
                vh.state,
                vh.out,
                next,
            );
            let z = &inp.z[j * dv..(j + 1) * dv];
            gated_rms_norm(vh.out, z, inp.norm_weight, inp.eps);
        }
    }
}
