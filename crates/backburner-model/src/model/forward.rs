//! The forward pass of one decoder layer (HF `Qwen3_5DecoderLayer`): RMSNorm1p → mixer (Gated DeltaNet or gated
//! attention) → residual add → RMSNorm1p → SwiGLU MLP → residual add, on activation buffers that a sequence's
//! [`Scratch`] keeps between calls (no allocation per op once the buffers have grown to the ubatch size).

use backburner_kernels::attention::Partial;
use backburner_kernels::gdn::{self, GdnDims};
use backburner_kernels::kv::PagedKvCache;
use backburner_kernels::profile::{self, Op};
use backburner_kernels::rowops;

use super::{AttnWeights, GdnWeights, Layer, Mixer, Model, GDN_CHUNK};
use crate::ops;
use crate::remote::RemoteSlot;

/// Most bytes of the host's own page partials computed while the pages held elsewhere are attended (KV offload):
/// all of them for decode, a bounded part of a long prefill ubatch's.
const AHEAD_BYTES: usize = 64 << 20;
use crate::state::{LayerState, LinearState, PageStore};

/// Reusable activation buffers of the forward pass (f32), grown to the largest ubatch seen. Held per sequence in its
/// [`ModelState`](crate::ModelState); not part of the state (never snapshotted or transferred).
#[derive(Debug, Default)]
pub struct Scratch {
    /// Normed layer input `[T, H]`.
    h: Vec<f32>,
    /// A fused projection's output `[T, width]`.
    proj: Vec<f32>,
    /// The mixer's or the MLP's output `[T, H]`.
    out: Vec<f32>,
    /// `[gate | up]` `[T, 2I]`.
    gu: Vec<f32>,
    /// `silu(gate) ⊙ up` `[T, I]`.
    act: Vec<f32>,
    /// GDN conv input / attention queries.
    a: Vec<f32>,
    /// GDN conv output / attention gate.
    b: Vec<f32>,
    /// q, k, v, z heads.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    z: Vec<f32>,
    /// GDN β and log-decay g `[T, Hv]`.
    beta: Vec<f32>,
    g: Vec<f32>,
    /// Mixer core output `[T, heads·dim]`.
    o: Vec<f32>,
}

impl Scratch {
    /// Bytes held by the buffers.
    pub fn bytes(&self) -> usize {
        4 * [
            &self.h, &self.proj, &self.out, &self.gu, &self.act, &self.a, &self.b, &self.q,
            &self.k, &self.v, &self.z, &self.beta, &self.g, &self.o,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
    }
}

/// `v` as a slice of `n` elements (grown with zeros if shorter; capacity kept).
fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

/// Copies column block `[c0, c0 + width)` of the `[n_rows, n_cols]` matrix `x` into `out` (`[n_rows, width]`).
fn take_cols_into(x: &[f32], n_cols: usize, c0: usize, width: usize, out: &mut Vec<f32>) {
    let n_rows = x.len() / n_cols;
    let dst = sized(out, n_rows * width);
    for (d, row) in dst
        .chunks_exact_mut(width.max(1))
        .zip(x.chunks_exact(n_cols))
    {
        d.copy_from_slice(&row[c0..c0 + width]);
    }
}

/// An attention op waiting for the partial over the pages held elsewhere (KV offload): the host's own first pages'
/// partials computed meanwhile, and what the op needs to finish.
pub(crate) struct AwaitRemote {
    ahead: Option<Vec<Option<Partial>>>,
    pos0: usize,
    scale: f32,
}

impl Model {
    /// One layer on the residual stream `x` (`[t, H]`, in place) for tokens at `pos0..pos0 + t`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_layer(
        &self,
        idx: usize,
        layer: &Layer,
        x: &mut [f32],
        t: usize,
        pos0: usize,
        state: &mut LayerState,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
    ) {
        if let Some(w) = self.layer_begin(idx, layer, x, t, pos0, state, s, remote) {
            self.layer_finish(idx, layer, x, t, state, s, remote, w);
        }
    }

    /// The first part of a layer: all of it, or, for an attention layer with pages held elsewhere, up to the
    /// request for their partial (the host's own pages' partials computed meanwhile). `Some` means the layer waits
    /// for [`Model::layer_finish`]; the caller may run other work (another ubatch's layer) in between.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_begin(
        &self,
        idx: usize,
        layer: &Layer,
        x: &mut [f32],
        t: usize,
        pos0: usize,
        state: &mut LayerState,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
    ) -> Option<AwaitRemote> {
        let eps = self.config.rms_norm_eps as f32;
        {
            let _p = profile::scope(Op::Norm);
            rowops::rms_norm_1p(x, &layer.input_norm, eps, sized(&mut s.h, x.len()));
        }
        match (&layer.mixer, state) {
            (Mixer::Linear(w), LayerState::Linear(st)) => self.gdn(w, t, st, s),
            (Mixer::Attention(w), LayerState::Attention(c)) => {
                if let Some(a) = self.attention_begin(idx, w, t, pos0, c, s, remote) {
                    return Some(a);
                }
            }
            _ => panic!("layer kind and state kind differ"),
        }
        self.layer_rest(layer, x, t, s);
        None
    }

    /// The rest of a layer begun by [`Model::layer_begin`] that waited for the pages held elsewhere.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_finish(
        &self,
        idx: usize,
        layer: &Layer,
        x: &mut [f32],
        t: usize,
        state: &mut LayerState,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
        w: AwaitRemote,
    ) {
        let (Mixer::Attention(aw), LayerState::Attention(c)) = (&layer.mixer, state) else {
            panic!("only an attention layer waits for pages held elsewhere");
        };
        self.attention_finish(idx, aw, t, c, s, remote, w);
        self.layer_rest(layer, x, t, s);
    }

    /// Residual add of the mixer's output, then the MLP block.
    fn layer_rest(&self, layer: &Layer, x: &mut [f32], t: usize, s: &mut Scratch) {
        let eps = self.config.rms_norm_eps as f32;
        residual_add(x, &s.out);
        {
            let _p = profile::scope(Op::Norm);
            rowops::rms_norm_1p(x, &layer.post_norm, eps, sized(&mut s.h, x.len()));
        }
        layer.gate_up.forward_into(&s.h, t, &mut s.gu);
        {
            let _p = profile::scope(Op::Activation);
            let inter = self.config.intermediate_size;
            rowops::silu_mul_halves(&s.gu, inter, sized(&mut s.act, t * inter));
        }
        layer.down.forward_into(&s.act, t, &mut s.out);
        residual_add(x, &s.out);
    }

    /// Gated DeltaNet mixer (HF `Qwen3_5GatedDeltaNet`) on `s.h`, output in `s.out`.
    fn gdn(&self, w: &GdnWeights, t: usize, st: &mut LinearState, s: &mut Scratch) {
        let c = &self.config;
        let (hk, hv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let conv_dim = c.conv_dim();
        let width = conv_dim + hv * dv + 2 * hv;
        w.in_proj.forward_into(&s.h, t, &mut s.proj); // [T, width] = [qkv | z | b | a]
        {
            let _p = profile::scope(Op::Copy);
            take_cols_into(&s.proj, width, 0, conv_dim, &mut s.a);
            take_cols_into(&s.proj, width, conv_dim, hv * dv, &mut s.z);
        }
        {
            let _p = profile::scope(Op::GdnConv);
            gdn::causal_conv1d_silu(
                &s.a,
                t,
                conv_dim,
                c.linear_conv_kernel_dim,
                &w.conv_weight,
                &mut st.conv,
                sized(&mut s.b, t * conv_dim),
            );
        }
        {
            let _p = profile::scope(Op::Copy);
            take_cols_into(&s.b, conv_dim, 0, hk * dk, &mut s.q);
            take_cols_into(&s.b, conv_dim, hk * dk, hk * dk, &mut s.k);
            take_cols_into(&s.b, conv_dim, 2 * hk * dk, hv * dv, &mut s.v);
        }
        {
            let _p = profile::scope(Op::Norm);
            rowops::l2_norm_scaled(&mut s.q, dk, 1.0 / (dk as f32).sqrt());
            rowops::l2_norm_scaled(&mut s.k, dk, 1.0);
        }
        {
            let _p = profile::scope(Op::Activation);
            let (beta, g) = (sized(&mut s.beta, t * hv), sized(&mut s.g, t * hv));
            for (row, (bt, gt)) in s
                .proj
                .chunks_exact(width)
                .zip(beta.chunks_exact_mut(hv).zip(g.chunks_exact_mut(hv)))
            {
                let ba = &row[conv_dim + hv * dv..];
                for j in 0..hv {
                    bt[j] = ops::sigmoid(ba[j]);
                    gt[j] = w.neg_a[j] * ops::softplus(ba[hv + j] + w.dt_bias[j]);
                }
            }
        }
        let dims = GdnDims {
            n_tokens: t,
            n_k_heads: hk,
            n_v_heads: hv,
            d_k: dk,
            d_v: dv,
        };
        let o = sized(&mut s.o, t * hv * dv);
        if t == 1 {
            let _p = profile::scope(Op::DeltaRecurrent);
            gdn::delta_rule_recurrent(dims, &s.q, &s.k, &s.v, &s.g, &s.beta, &mut st.recurrent, o);
        } else {
            let _p = profile::scope(Op::DeltaChunked);
            gdn::delta_rule_chunked(
                dims,
                GDN_CHUNK,
                &s.q,
                &s.k,
                &s.v,
                &s.g,
                &s.beta,
                &mut st.recurrent,
                o,
            );
        }
        {
            let _p = profile::scope(Op::Norm);
            rowops::gated_rms_norm(&mut s.o, &s.z, &w.norm, c.rms_norm_eps as f32);
        }
        w.out_proj.forward_into(&s.o, t, &mut s.out);
    }

    /// Gated full attention (HF `Qwen3_5Attention`) on `s.h` at positions `pos0..`, output in `s.out`; with pages
    /// held elsewhere, up to their request (`Some`: finish with [`Model::attention_finish`]).
    #[allow(clippy::too_many_arguments)]
    fn attention_begin(
        &self,
        idx: usize,
        w: &AttnWeights,
        t: usize,
        pos0: usize,
        cache: &mut PagedKvCache,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
    ) -> Option<AwaitRemote> {
        let c = &self.config;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let width = hq * 2 * d + 2 * hkv * d;
        let eps = c.rms_norm_eps as f32;
        w.qkv.forward_into(&s.h, t, &mut s.proj); // [T, width] = [per-head (q | gate) | k | v]
        {
            let _p = profile::scope(Op::Copy);
            let q = sized(&mut s.a, t * hq * d);
            let gate = sized(&mut s.b, t * hq * d);
            for ((row, qr), gr) in s
                .proj
                .chunks_exact(width)
                .zip(q.chunks_exact_mut(hq * d))
                .zip(gate.chunks_exact_mut(hq * d))
            {
                for ((head, qh), gh) in row[..hq * 2 * d]
                    .chunks_exact(2 * d)
                    .zip(qr.chunks_exact_mut(d))
                    .zip(gr.chunks_exact_mut(d))
                {
                    qh.copy_from_slice(&head[..d]);
                    gh.copy_from_slice(&head[d..]);
                }
            }
            take_cols_into(&s.proj, width, hq * 2 * d, hkv * d, &mut s.k);
            take_cols_into(&s.proj, width, hq * 2 * d + hkv * d, hkv * d, &mut s.v);
        }
        {
            let _p = profile::scope(Op::Norm);
            rowops::rms_norm_1p_inplace(&mut s.a, &w.q_norm, eps);
            rowops::rms_norm_1p_inplace(&mut s.k, &w.k_norm, eps);
        }
        {
            let _p = profile::scope(Op::Rope);
            self.rope.apply(&mut s.a, t, hq, pos0);
            self.rope.apply(&mut s.k, t, hkv, pos0);
        }
        assert_eq!(
            cache.len(),
            pos0,
            "KV cache length differs from the position"
        );
        {
            let _p = profile::scope(Op::KvAppend);
            cache.append(&s.k, &s.v, t);
        }
        let scale = 1.0 / (d as f32).sqrt();
        if cache.offloaded() > 0 {
            // the oldest pages are elsewhere: their fold first, then ours (docs/KV_OFFLOAD.md), our first pages'
            // partials computed while theirs are
            let _p = profile::scope(Op::Attention);
            let ahead = remote
                .begin(idx, &s.a, t, hq, pos0, scale)
                .then(|| cache.partials_ahead(&s.a, t, hq, pos0, scale, AHEAD_BYTES));
            return Some(AwaitRemote { ahead, pos0, scale });
        }
        let part = {
            let _p = profile::scope(Op::Attention);
            PageStore::attend(cache, &s.a, t, hq, pos0, scale, None)
        };
        self.attention_out(w, t, part, s);
        None
    }

    /// The end of an attention op that waited for the pages held elsewhere: their partial, then the fold over the
    /// pages here. On a failure the output is zeros and the error is latched for the caller, which discards this
    /// step.
    #[allow(clippy::too_many_arguments)]
    fn attention_finish(
        &self,
        idx: usize,
        w: &AttnWeights,
        t: usize,
        cache: &mut PagedKvCache,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
        a: AwaitRemote,
    ) {
        let c = &self.config;
        let (hq, d) = (c.num_attention_heads, c.head_dim);
        let part = {
            let _p = profile::scope(Op::Attention);
            let AwaitRemote { ahead, pos0, scale } = a;
            match ahead.and_then(|a| remote.finish(idx, t, hq, d).map(|p| (p, a))) {
                Some((prefix, a)) => cache.attend_after_ahead(prefix, &a, &s.a, t, hq, pos0, scale),
                None => Partial::empty(t, hq, d),
            }
        };
        self.attention_out(w, t, part, s);
    }

    /// The attention output gate and projection: `s.out = o_proj(o ⊙ σ(gate))`.
    fn attention_out(&self, w: &AttnWeights, t: usize, part: Partial, s: &mut Scratch) {
        s.o = part.o;
        {
            let _p = profile::scope(Op::Activation);
            rowops::sigmoid_mul(&mut s.o, &s.b);
        }
        w.o_proj.forward_into(&s.o, t, &mut s.out);
    }
}

/// The residual add `x ← x + y`.
fn residual_add(x: &mut [f32], y: &[f32]) {
    let _p = profile::scope(Op::Activation);
    rowops::add_assign(x, y);
}
