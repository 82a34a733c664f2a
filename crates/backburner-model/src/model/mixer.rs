//! The per-sequence core of each token mixer: everything between its input projection and its output projection
//! that reads or writes one sequence's state (GDN causal conv, delta rule and gated norm; attention q/k norms,
//! RoPE at the sequence's position, KV append, attention over its pages and the output gate). The single-sequence
//! pass ([`Model::forward_layer`]) and the batched decode step ([`Model::forward_decode_batch`]) both run the
//! projections on their stacked rows and call these on each sequence's rows.

use backburner_kernels::attention::Partial;
use backburner_kernels::gdn::{self, GdnDims};
use backburner_kernels::kv::PagedKvCache;
use backburner_kernels::profile::{self, Op};
use backburner_kernels::rowops;

use super::capture::{conv_window, Capture};
use super::scratch::{sized, take_cols_into, MixerBufs};
use super::{AttnWeights, GdnWeights, Model, GDN_CHUNK};
use crate::ops;
use crate::remote::RemoteSlot;
use crate::state::{LinearState, PageStore};

/// Most bytes of the host's own page partials computed while the pages held elsewhere are attended (KV offload):
/// all of them for decode, a bounded part of a long prefill ubatch's.
const AHEAD_BYTES: usize = 64 << 20;

/// Where the checkpoints of one Gated DeltaNet call go: its layer, its first position and the rows to take.
pub(super) struct Checkpoints<'a> {
    pub(super) layer: usize,
    pub(super) pos0: usize,
    pub(super) rows: &'a [usize],
}

/// An attention op waiting for the partial over the pages held elsewhere (KV offload): the host's own first pages'
/// partials computed meanwhile, and what the op needs to finish.
pub(crate) struct AwaitRemote {
    ahead: Option<Vec<Option<Partial>>>,
    pos0: usize,
    scale: f32,
}

impl Model {
    /// Gated DeltaNet core (HF `Qwen3_5GatedDeltaNet` between `in_proj` and `out_proj`) of one sequence's `t` tokens:
    /// `proj` is their fused input projection `[t, conv_dim + Hv·Dv + 2·Hv]` (`[qkv | z | b | a]`, f32); the causal
    /// conv and the delta rule advance `st`; the gated-normed output `[t, Hv·Dv]` is left in `m.o`. One token runs as one
    /// parallel step ([`Model::gdn_decode`]), more through the chunked delta rule.
    pub(super) fn gdn_core(
        &self,
        w: &GdnWeights,
        proj: &[f32],
        t: usize,
        st: &mut LinearState,
        m: &mut MixerBufs,
    ) {
        let (hv, dv) = (
            self.config.linear_num_value_heads,
            self.config.linear_value_head_dim,
        );
        let dims = self.gdn_dims(t);
        if t == 1 {
            return self.gdn_decode(w, proj, dims, st, m);
        }
        self.gdn_conv_qkv(w, proj, t, st, m);
        self.gdn_gates(w, proj, t, m);
        let o = sized(&mut m.o, t * hv * dv);
        {
            let st = &mut st.recurrent;
            let _p = profile::scope(Op::DeltaChunked);
            gdn::delta_rule_chunked(dims, GDN_CHUNK, &m.q, &m.k, &m.v, &m.g, &m.beta, st, o);
        }
        let _p = profile::scope(Op::Norm);
        rowops::gated_rms_norm(&mut m.o, &m.z, &w.norm, self.config.rms_norm_eps as f32);
    }

    /// The Gated DeltaNet's dimensions for a call of `t` tokens.
    pub(super) fn gdn_dims(&self, t: usize) -> GdnDims {
        self.config.gdn_dims(t)
    }

    /// [`Model::gdn_core`] taking exact checkpoints at `at.rows` (each a multiple of [`GDN_CHUNK`] or `t`, increasing,
    /// from [`super::capture::Capture::rows`]) into `cap`: the delta rule runs as consecutive calls split at those rows
    /// (the same chunks, so the same bits as one call) with the state copied between them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_core_capturing(
        &self,
        w: &GdnWeights,
        proj: &[f32],
        t: usize,
        st: &mut LinearState,
        m: &mut MixerBufs,
        at: Checkpoints<'_>,
        cap: &mut Capture,
    ) {
        if t == 1 {
            // one token: the decode step, whose only checkpoint is its end
            self.gdn_core(w, proj, t, st, m);
            cap.keep(at.pos0 + 1, at.layer, st.clone());
            return;
        }
        let c = &self.config;
        let (hv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
        let (conv_dim, kc) = (c.conv_dim(), c.linear_conv_kernel_dim - 1);
        assert!(
            at.rows.windows(2).all(|w| w[0] < w[1]) && at.rows.iter().all(|&r| r > 0 && r <= t),
            "checkpoint rows must increase inside 1..={t}"
        );
        let before = st.conv.clone();
        self.gdn_conv_qkv(w, proj, t, st, m);
        self.gdn_gates(w, proj, t, m);
        let dims = self.gdn_dims(t);
        sized(&mut m.o, t * hv * dv);
        let mut a = 0;
        for &b in at.rows {
            delta_rule_rows(dims, m, a..b, &mut st.recurrent);
            let conv = if b == t {
                st.conv.clone()
            } else {
                conv_window(&before, &m.a, conv_dim, kc, b)
            };
            let recurrent = st.recurrent.clone();
            cap.keep(at.pos0 + b, at.layer, LinearState { conv, recurrent });
            a = b;
        }
        if a < t {
            delta_rule_rows(dims, m, a..t, &mut st.recurrent);
        }
        let _p = profile::scope(Op::Norm);
        rowops::gated_rms_norm(&mut m.o, &m.z, &w.norm, c.rms_norm_eps as f32);
    }

    /// [`Model::gdn_core`] for one token: the gates here, then conv, norms and recurrence as one parallel step
    /// ([`gdn::delta_rule_decode_step`], the same bits as the separate kernels of the many-token path).
    fn gdn_decode(
        &self,
        w: &GdnWeights,
        proj: &[f32],
        dims: GdnDims,
        st: &mut LinearState,
        m: &mut MixerBufs,
    ) {
        self.gdn_gates(w, proj, 1, m);
        let c = &self.config;
        let conv_dim = c.conv_dim();
        let hvdv = dims.n_v_heads * dims.d_v;
        let inp = gdn::DecodeInputs {
            qkv: &proj[..conv_dim],
            z: &proj[conv_dim..conv_dim + hvdv],
            g: &m.g,
            beta: &m.beta,
            conv_weight: &w.conv_weight,
            norm_weight: &w.norm,
            eps: c.rms_norm_eps as f32,
        };
        let o = sized(&mut m.o, hvdv);
        let _p = profile::scope(Op::DeltaRecurrent);
        let kernel = c.linear_conv_kernel_dim;
        gdn::delta_rule_decode_step(dims, kernel, &inp, &mut st.conv, &mut st.recurrent, o);
    }

    /// The GDN causal conv (advancing `st.conv`) and its output split into L2-normed q, k (`m.q`, `m.k`) and v
    /// (`m.v`); z to `m.z`.
    fn gdn_conv_qkv(
        &self,
        w: &GdnWeights,
        proj: &[f32],
        t: usize,
        st: &mut LinearState,
        m: &mut MixerBufs,
    ) {
        self.gdn_conv_qkv_as(w, proj, t, st, m, false)
    }

    /// [`Model::gdn_conv_qkv`], the conv run one row at a time when `by_row` (its one-token path: the same bits,
    /// without the many-token path's transposed copies and parallel region; for the few rows of a verify).
    pub(super) fn gdn_conv_qkv_as(
        &self,
        w: &GdnWeights,
        proj: &[f32],
        t: usize,
        st: &mut LinearState,
        m: &mut MixerBufs,
        by_row: bool,
    ) {
        let c = &self.config;
        let (hk, hv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let conv_dim = c.conv_dim();
        let width = conv_dim + hv * dv + 2 * hv;
        assert_eq!(proj.len(), t * width, "gdn: proj is not [t, width]");
        {
            let _p = profile::scope(Op::Copy);
            take_cols_into(proj, width, 0, conv_dim, &mut m.a);
            take_cols_into(proj, width, conv_dim, hv * dv, &mut m.z);
        }
        {
            let _p = profile::scope(Op::GdnConv);
            let out = sized(&mut m.b, t * conv_dim);
            let (kernel, cw) = (c.linear_conv_kernel_dim, &w.conv_weight);
            if by_row {
                for (x, o) in
                    m.a.chunks_exact(conv_dim)
                        .zip(out.chunks_exact_mut(conv_dim))
                {
                    gdn::causal_conv1d_silu(x, 1, conv_dim, kernel, cw, &mut st.conv, o);
                }
            } else {
                gdn::causal_conv1d_silu(&m.a, t, conv_dim, kernel, cw, &mut st.conv, out);
            }
        }
        {
            let _p = profile::scope(Op::Copy);
            take_cols_into(&m.b, conv_dim, 0, hk * dk, &mut m.q);
            take_cols_into(&m.b, conv_dim, hk * dk, hk * dk, &mut m.k);
            take_cols_into(&m.b, conv_dim, 2 * hk * dk, hv * dv, &mut m.v);
        }
        let _p = profile::scope(Op::Norm);
        rowops::l2_norm_scaled(&mut m.q, dk, 1.0 / (dk as f32).sqrt());
        rowops::l2_norm_scaled(&mut m.k, dk, 1.0);
    }

    /// GDN β = σ(b) and log-decay g = −exp(A)·softplus(a + dt_bias) (`[t, Hv]` each, in `m.beta`, `m.g`).
    pub(super) fn gdn_gates(&self, w: &GdnWeights, proj: &[f32], t: usize, m: &mut MixerBufs) {
        let _p = profile::scope(Op::Activation);
        let c = &self.config;
        let (hv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
        let conv_dim = c.conv_dim();
        let width = conv_dim + hv * dv + 2 * hv;
        let (beta, g) = (sized(&mut m.beta, t * hv), sized(&mut m.g, t * hv));
        for (row, (bt, gt)) in proj
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

    /// Gated attention core (HF `Qwen3_5Attention` between `q/k/v_proj` and `o_proj`) of one sequence's `t` tokens
    /// at positions `pos0..`: `proj` is their fused projection `[t, Hq·2D + 2·Hkv·D]` (`[per-head (q | gate) | k |
    /// v]`, f32). Appends K and V to `cache` (which must hold exactly `pos0` rows; panics otherwise) and leaves the
    /// gated output `[t, Hq·D]` in `m.o`. With pages held elsewhere it stops at their request (`Some`: finish with
    /// [`Model::attention_core_finish`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_core(
        &self,
        idx: usize,
        w: &AttnWeights,
        proj: &[f32],
        t: usize,
        pos0: usize,
        cache: &mut PagedKvCache,
        m: &mut MixerBufs,
        remote: &mut RemoteSlot,
    ) -> Option<AwaitRemote> {
        self.attention_qkv(w, proj, t, pos0, m);
        assert_eq!(
            cache.len(),
            pos0,
            "KV cache length differs from the position"
        );
        {
            let _p = profile::scope(Op::KvAppend);
            cache.append(&m.k, &m.v, t);
        }
        let (hq, d) = (self.config.num_attention_heads, self.config.head_dim);
        let scale = 1.0 / (d as f32).sqrt();
        if cache.offloaded() > 0 {
            // the oldest pages are elsewhere: their fold first, then ours (docs/KV_OFFLOAD.md), our first pages'
            // partials computed while theirs are
            let _p = profile::scope(Op::Attention);
            let ahead = remote
                .begin(idx, &m.a, t, hq, pos0, scale)
                .then(|| cache.partials_ahead(&m.a, t, hq, pos0, scale, AHEAD_BYTES));
            return Some(AwaitRemote { ahead, pos0, scale });
        }
        let part = {
            let _p = profile::scope(Op::Attention);
            PageStore::attend(cache, &m.a, t, hq, pos0, scale, None)
        };
        attention_gate(part, m);
        None
    }

    /// Splits the fused projection into queries (`m.a`), gate (`m.b`), keys (`m.k`) and values (`m.v`), then the
    /// q/k norms and RoPE at positions `pos0..`.
    fn attention_qkv(
        &self,
        w: &AttnWeights,
        proj: &[f32],
        t: usize,
        pos0: usize,
        m: &mut MixerBufs,
    ) {
        let c = &self.config;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let width = hq * 2 * d + 2 * hkv * d;
        assert_eq!(proj.len(), t * width, "attention: proj is not [t, width]");
        {
            let _p = profile::scope(Op::Copy);
            let q = sized(&mut m.a, t * hq * d);
            let gate = sized(&mut m.b, t * hq * d);
            for ((row, qr), gr) in proj
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
            take_cols_into(proj, width, hq * 2 * d, hkv * d, &mut m.k);
            take_cols_into(proj, width, hq * 2 * d + hkv * d, hkv * d, &mut m.v);
        }
        {
            let _p = profile::scope(Op::Norm);
            let eps = c.rms_norm_eps as f32;
            rowops::rms_norm_inplace(&mut m.a, &w.q_norm, eps);
            rowops::rms_norm_inplace(&mut m.k, &w.k_norm, eps);
        }
        let _p = profile::scope(Op::Rope);
        self.rope.apply(&mut m.a, t, hq, pos0);
        self.rope.apply(&mut m.k, t, hkv, pos0);
    }

    /// The end of an attention core that waited for the pages held elsewhere: their partial, then the fold over
    /// the pages here, gated into `m.o`. On a failure the output is zeros and the error is latched for the caller,
    /// which discards this step.
    pub(super) fn attention_core_finish(
        &self,
        idx: usize,
        t: usize,
        cache: &mut PagedKvCache,
        m: &mut MixerBufs,
        remote: &mut RemoteSlot,
        a: AwaitRemote,
    ) {
        let (hq, d) = (self.config.num_attention_heads, self.config.head_dim);
        let part = {
            let _p = profile::scope(Op::Attention);
            let AwaitRemote { ahead, pos0, scale } = a;
            match ahead.and_then(|a| remote.finish(idx, t, hq, d).map(|p| (p, a))) {
                Some((prefix, a)) => cache.attend_after_ahead(prefix, &a, &m.a, t, hq, pos0, scale),
                None => Partial::empty(t, hq, d),
            }
        };
        attention_gate(part, m);
    }
}

/// The attention output gate: `m.o = o ⊙ σ(gate)` (the gate in `m.b`).
fn attention_gate(part: Partial, m: &mut MixerBufs) {
    m.o = part.o;
    let _p = profile::scope(Op::Activation);
    rowops::sigmoid_mul(&mut m.o, &m.b);
}

/// The chunked delta rule on rows `r` of a call whose inputs sit in `m` (`q`, `k` `[t, Hk·Dk]`, `v` `[t, Hv·Dv]`,
/// `g`, `beta` `[t, Hv]`), advancing `state` and writing rows `r` of `m.o` (`[t, Hv·Dv]`). `d.n_tokens` is the call's
/// `t`; `r.start` must be a chunk boundary of the call for the result to equal the whole call's.
fn delta_rule_rows(d: GdnDims, m: &mut MixerBufs, r: std::ops::Range<usize>, state: &mut [f32]) {
    let (qk, vv, g) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v, d.n_v_heads);
    let dims = GdnDims {
        n_tokens: r.len(),
        ..d
    };
    let (a, b) = (r.start, r.end);
    let _p = profile::scope(Op::DeltaChunked);
    gdn::delta_rule_chunked(
        dims,
        GDN_CHUNK,
        &m.q[a * qk..b * qk],
        &m.k[a * qk..b * qk],
        &m.v[a * vv..b * vv],
        &m.g[a * g..b * g],
        &m.beta[a * g..b * g],
        state,
        &mut m.o[a * vv..b * vv],
    );
}
