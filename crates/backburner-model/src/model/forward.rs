//! The forward pass of one decoder layer (HF `Qwen3_5DecoderLayer`): RMSNorm1p → mixer (Gated DeltaNet or gated
//! attention) → residual add → RMSNorm1p → SwiGLU MLP → residual add, on activation buffers that a sequence's
//! [`Scratch`] keeps between calls (no allocation per op once the buffers have grown to the ubatch size).
//!
//! Each mixer is its input projection, the per-sequence core of `mixer.rs`, and its output projection; the
//! projections and the MLP ([`Model::layer_rest`]) work on any stack of rows, which the batched decode step
//! (`batch.rs`) shares.

use backburner_kernels::kv::PagedKvCache;
use backburner_kernels::profile::{self, Op};
use backburner_kernels::rowops;

use super::mixer::{AwaitRemote, Checkpoints};
use super::scratch::{sized, RowBufs, Scratch};
use super::{AttnWeights, Ffn, GdnWeights, Layer, Mixer, Model, GDN_CHUNK};
use crate::remote::{RemoteError, RemoteSlot};
use crate::state::{LayerState, LinearState};

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
        self.input_norm(layer, x, &mut s.rows);
        match (&layer.mixer, state) {
            (Mixer::Linear(w), LayerState::Linear(st)) => self.gdn(idx, w, t, pos0, st, s),
            (Mixer::Attention(w), LayerState::Attention(c)) => {
                if let Some(a) = self.attention_begin(idx, w, t, pos0, c, s, remote) {
                    return Some(a);
                }
            }
            _ => panic!("layer kind and state kind differ"),
        }
        self.layer_rest(idx, layer, x, t, &mut s.rows, &mut remote.error);
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
        self.attention_core_finish(idx, t, c, &mut s.mix, remote, w);
        aw.o_proj.forward_into(&s.mix.o, t, &mut s.rows.out);
        self.layer_rest(idx, layer, x, t, &mut s.rows, &mut remote.error);
    }

    /// The layer's input norm: `r.h = rms_norm(x)` on the rows of `x` (`[rows, H]`).
    pub(super) fn input_norm(&self, layer: &Layer, x: &[f32], r: &mut RowBufs) {
        let _p = profile::scope(Op::Norm);
        let eps = self.config.rms_norm_eps as f32;
        rowops::rms_norm(x, &layer.input_norm, eps, sized(&mut r.h, x.len()));
    }

    /// Residual add of the mixer's output (`r.out`), then the feed-forward block (a dense MLP's SwiGLU inside the
    /// gate/up product's region where the weights allow: [`crate::linear::Linear::forward_swiglu`]), on `t` rows of
    /// `x` (`[t, H]`) of layer `idx`. A failure of routed experts held elsewhere latches in `err`.
    pub(super) fn layer_rest(
        &self,
        idx: usize,
        layer: &Layer,
        x: &mut [f32],
        t: usize,
        r: &mut RowBufs,
        err: &mut Option<RemoteError>,
    ) {
        let eps = self.config.rms_norm_eps as f32;
        residual_add(x, &r.out);
        {
            let _p = profile::scope(Op::Norm);
            rowops::rms_norm(x, &layer.post_norm, eps, sized(&mut r.h, x.len()));
        }
        self.ffn(idx, &layer.ffn, t, r, err);
        residual_add(x, &r.out);
    }

    /// The feed-forward block on the `t` normed rows `r.h` (`[t, H]`), output in `r.out`.
    fn ffn(&self, idx: usize, ffn: &Ffn, t: usize, r: &mut RowBufs, err: &mut Option<RemoteError>) {
        match ffn {
            Ffn::Dense { gate_up, down } => {
                gate_up.forward_swiglu(&r.h, t, &mut r.gu, &mut r.act);
                down.forward_into(&r.act, t, &mut r.out);
            }
            Ffn::Moe(w) => self.moe_ffn(idx, w, t, r, err),
        }
    }

    /// Gated DeltaNet mixer (HF `Qwen3_5GatedDeltaNet`) of layer `idx` on `s.rows.h` (tokens at `pos0..pos0 + t`),
    /// output in `s.rows.out`, taking the checkpoints requested inside the call (`capture.rs`).
    fn gdn(
        &self,
        idx: usize,
        w: &GdnWeights,
        t: usize,
        pos0: usize,
        st: &mut LinearState,
        s: &mut Scratch,
    ) {
        w.in_proj.forward_into(&s.rows.h, t, &mut s.rows.proj); // [T, width] = [qkv | z | b | a]
        let rows = s.capture.rows(pos0, t, GDN_CHUNK);
        if rows.is_empty() {
            self.gdn_core(w, &s.rows.proj, t, st, &mut s.mix);
        } else {
            let at = Checkpoints {
                layer: idx,
                pos0,
                rows: &rows,
            };
            self.gdn_core_capturing(w, &s.rows.proj, t, st, &mut s.mix, at, &mut s.capture);
        }
        w.out_proj.forward_into(&s.mix.o, t, &mut s.rows.out);
    }

    /// Gated full attention (HF `Qwen3_5Attention`) on `s.rows.h` at positions `pos0..`, output in `s.rows.out`;
    /// with pages held elsewhere, up to their request (`Some`: finish with [`Model::layer_finish`]).
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
        w.qkv.forward_into(&s.rows.h, t, &mut s.rows.proj); // [T, width] = [per-head (q | gate) | k | v]
        let wait = self.attention_core(idx, w, &s.rows.proj, t, pos0, cache, &mut s.mix, remote);
        if wait.is_none() {
            w.o_proj.forward_into(&s.mix.o, t, &mut s.rows.out);
        }
        wait
    }
}

/// The residual add `x ← x + y`.
fn residual_add(x: &mut [f32], y: &[f32]) {
    let _p = profile::scope(Op::Activation);
    rowops::add_assign(x, y);
}
