//! Speculative decoding's verify step and its rollback (docs/ENGINE_CORE.md, option B), on the layers a node holds.
//!
//! A verify runs `T = k + 1` tokens (the last accepted token and `k` drafts) at positions `pos0..pos0 + T` as one
//! ubatch and gives every row's logits, bit for bit those of `T` one-token decode steps
//! ([`Model::forward_tokens`] with `Some(0..1)`). Every op of a layer computes a row with the same arithmetic
//! whatever the number of rows (projections, norms, the MoE block, attention over the pages: their docs and
//! `tests/verify.rs`), except the Gated DeltaNet's delta rule, whose many-token path is the chunked form: a verify
//! runs the recurrence instead ([`gdn::delta_rule_recurrent_from`]), and the causal conv and the norms through the
//! kernels whose bits the fused decode step shares.
//!
//! For a rollback the verify keeps, per Gated DeltaNet layer, the state it started from (the recurrence reads it
//! from one buffer and writes the new state to the other: no copy), the conv state it started from, the raw conv
//! inputs and the delta rule's inputs (k, v, g, β) of its rows, in buffers that are reused from one verify to the
//! next (they grow to the largest `T` seen). [`ModelState::rollback_verify`] to `m` accepted positions truncates the
//! attention layers' KV rows, replays the `m` positions from the kept state ([`gdn::delta_rule_replay`]) and takes
//! the conv window after them from the kept inputs: the state is then the one `m` decode steps leave, bit for bit.
//!
//! A verify stays open until the rollback, the next verify, or any other change of the state (a forward call, a
//! restore, a copy: they close it, and a rollback then fails with [`VerifyError::NoVerify`]). It takes no prompt-cache
//! checkpoint (`capture.rs`).

use std::ops::Range;

use backburner_kernels::gdn::{self, GdnDims};
use backburner_kernels::kv::PagedKvCache;
use backburner_kernels::profile::{self, Op};
use backburner_kernels::rowops;

use super::capture::conv_window_into;
use super::scratch::{sized, Scratch};
use super::{AttnWeights, GdnWeights, Layer, Mixer, Model};
use crate::error::ModelError;
use crate::remote::RemoteSlot;
use crate::state::{LayerState, LinearState, ModelState};

/// Why a verify or a rollback was refused. Nothing changed in the state when one is returned.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// A verify of no token.
    #[error("a verify needs at least one token")]
    Empty,
    /// An id out of range, or the embedding or head not loaded on this node ([`Model::forward_verify`]).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// [`Model::forward_verify`] on a node or a state that does not hold every layer.
    #[error("a whole-model verify needs every layer and the ends on this node and in the state")]
    NotWholeModel,
    /// A layer of the range is not loaded on this node, or its state is not held.
    #[error("layer {0} is not loaded on this node or its state is not held")]
    LayerMissing(usize),
    /// The residual rows do not have the shape `[n_tokens, hidden]`.
    #[error("the residual stream has {got} values, expected {want} ([n_tokens, hidden])")]
    Shape {
        /// Values given.
        got: usize,
        /// `n_tokens · hidden`.
        want: usize,
    },
    /// No verify is open: none ran, or the state changed since (a forward call, a restore, a rollback).
    #[error("no open verify to roll back (none ran, or the state changed since)")]
    NoVerify,
    /// The state's position is not the verify's end (its tokens were not committed).
    #[error("the state is at position {at}, the open verify covers {span:?}")]
    Position {
        /// The state's position.
        at: usize,
        /// The verify's positions.
        span: Range<usize>,
    },
    /// `accepted` is outside `1..=T`.
    #[error("{accepted} accepted positions for a verify of {t} (1..={t})")]
    Accepted {
        /// Accepted positions asked for.
        accepted: usize,
        /// The verify's token count.
        t: usize,
    },
    /// A layer whose state this sequence holds did not run in the verify (a node must verify all its layers).
    #[error("layer {0} is held here but did not run in the verify")]
    NotVerified(usize),
    /// The KV rows to drop are held elsewhere (KV offload).
    #[error("cannot roll back to position {to}: positions below {offloaded} are held elsewhere")]
    Offloaded {
        /// The position the rollback returns to.
        to: usize,
        /// Positions held elsewhere.
        offloaded: usize,
    },
}

/// What a verify keeps of one Gated DeltaNet layer for a rollback (f32; buffers reused from verify to verify).
#[derive(Debug, Default)]
pub(crate) struct LinearKeep {
    /// `[Hv, Dk, Dv]`: the recurrent state before the verify (the other half of the double buffer; stale once the
    /// verify is closed).
    state: Vec<f32>,
    /// `[conv_dim, kernel − 1]`: the conv state before the verify.
    conv: Vec<f32>,
    /// `[T, conv_dim]`: the raw `in_proj_qkv` rows (the conv's inputs).
    raw: Vec<f32>,
    /// `[T, Hk·Dk]` normalised keys, `[T, Hv·Dv]` values, `[T, Hv]` log-decays and write strengths.
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl LinearKeep {
    fn bytes(&self) -> usize {
        let v = [
            &self.state,
            &self.conv,
            &self.raw,
            &self.k,
            &self.v,
            &self.g,
            &self.beta,
        ];
        4 * v.iter().map(|b| b.capacity()).sum::<usize>()
    }
}

/// The open verify of a sequence and what its layers keep (held in the sequence's [`Scratch`]).
#[derive(Debug, Default)]
pub(crate) struct VerifyKeep {
    /// First position and token count of the open verify; `None` when none is open.
    span: Option<(usize, usize)>,
    /// The Gated DeltaNet dims (`n_tokens` unused), conv kernel and `conv_dim` of the model that ran it.
    dims: Option<(GdnDims, usize, usize)>,
    /// Per layer index: ran in the open verify.
    ran: Vec<bool>,
    /// Per layer index: what a Gated DeltaNet layer keeps (empty for the others).
    linear: Vec<LinearKeep>,
}

impl VerifyKeep {
    /// Forgets the open verify (the buffers stay).
    pub(crate) fn close(&mut self) {
        self.span = None;
    }

    /// Opens a verify at `pos0..pos0 + t`, or continues it (a node running its layers in several calls).
    fn open(&mut self, pos0: usize, t: usize, n_layers: usize, dims: (GdnDims, usize, usize)) {
        if self.span != Some((pos0, t)) {
            self.span = Some((pos0, t));
            self.ran.clear();
        }
        self.ran.resize(n_layers, false);
        if self.linear.len() < n_layers {
            self.linear.resize_with(n_layers, LinearKeep::default);
        }
        self.dims = Some(dims);
    }
}

impl Model {
    /// The verify step of speculative decoding on a node holding every layer and the ends: embeds `ids` (`T =
    /// ids.len()` tokens at positions `state.n_tokens()..+T`), runs every layer as [`Model::forward_layers_verify`],
    /// advances the position by `T`, and returns the logits of every row, `[T, vocab]` f32: row `i` has the bits of
    /// the logits of the `(i + 1)`-th of `T` one-token [`Model::forward_tokens`] calls on the same tokens. Roll the
    /// rejected positions back with [`ModelState::rollback_verify`]. Runs on the current rayon pool.
    ///
    /// Errors ([`VerifyError`], the state unchanged): `Empty` for no id, `Model` for an id out of range,
    /// `NotWholeModel` if the model or the state lacks a layer or the ends.
    pub fn forward_verify(
        &self,
        ids: &[u32],
        state: &mut ModelState,
    ) -> Result<Vec<f32>, VerifyError> {
        self.check_cpu_only("verify");
        let all = 0..self.config.num_hidden_layers;
        if self.range != all || !self.holds_ends() || state.range() != all {
            return Err(VerifyError::NotWholeModel);
        }
        if ids.is_empty() {
            return Err(VerifyError::Empty);
        }
        self.check_ids(ids)?;
        let t = ids.len();
        let mut x = self.embed(ids)?;
        self.forward_layers_verify(all, &mut x, t, state)?;
        self.commit_tokens(state, t);
        Ok(self.logits(&x, t)?)
    }

    /// An upper estimate of what a verify of `t` tokens over `layers` keeps for its rollback, in bytes (a node
    /// reserves it before the verify; [`ModelState::verify_bytes`] says what is held after): per Gated DeltaNet layer
    /// a second recurrent state `[Hv, Dk, Dv]`, the conv state `[conv_dim, kernel − 1]` and the verify's inputs
    /// `[t, conv_dim + Hk·Dk + Hv·Dv + 2·Hv]`, all f32. 0 for `t ≤ 1` (a one-token verify keeps nothing).
    pub fn verify_keep_bytes(&self, layers: Range<usize>, t: usize) -> usize {
        if t <= 1 {
            return 0;
        }
        let c = &self.config;
        let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let conv = c.conv_dim();
        let per_row = conv + hk * dk + hv * dv + 2 * hv;
        let per_layer =
            hv * dk * dv + conv * c.linear_conv_kernel_dim.saturating_sub(1) + t * per_row;
        let linear = layers
            .filter(|&i| c.layer_types.get(i) == Some(&crate::config::LayerKind::LinearAttention))
            .count();
        4 * linear * per_layer
    }

    /// Runs layers `layers` of a verify on the residual stream `x` (`[n_tokens, hidden]` f32, in place) for tokens
    /// at positions `state.n_tokens()..+n_tokens`, keeping what a rollback needs: [`Model::forward_layers`] with the
    /// rows of one-token decode steps (see the module doc). A node may run its layers in several calls at the same
    /// position (they join one verify); it then advances the position with [`Model::commit_tokens`] and may roll
    /// back with [`ModelState::rollback_verify`] once every layer it holds has run.
    ///
    /// Errors ([`VerifyError`], nothing run): `Empty` for `n_tokens = 0`, `Shape` if `x` is not `[n_tokens,
    /// hidden]`, `LayerMissing` for a layer of the range not loaded or not held.
    pub fn forward_layers_verify(
        &self,
        layers: Range<usize>,
        x: &mut [f32],
        n_tokens: usize,
        state: &mut ModelState,
    ) -> Result<(), VerifyError> {
        self.check_cpu_only("verify");
        let t = n_tokens;
        if t == 0 {
            return Err(VerifyError::Empty);
        }
        let want = t * self.config.hidden_size;
        if x.len() != want {
            return Err(VerifyError::Shape { got: x.len(), want });
        }
        let pos0 = state.n_tokens();
        if let Some(i) = layers
            .clone()
            .find(|&i| self.layer(i).is_none() || state.layer(i).is_none())
        {
            return Err(VerifyError::LayerMissing(i));
        }
        let c = &self.config;
        let dims = (self.gdn_dims(0), c.linear_conv_kernel_dim, c.conv_dim());
        let (states, s, remote) = state.verify_parts();
        s.verify.open(pos0, t, c.num_hidden_layers, dims);
        for i in layers {
            let layer = self.layers[i].as_ref().expect("checked: loaded");
            let ls = states[i].as_mut().expect("checked: held");
            self.verify_layer(i, layer, x, t, pos0, ls, s, remote);
            s.verify.ran[i] = true;
        }
        Ok(())
    }

    /// One layer of a verify (as [`Model::forward_layer`], with the mixers of [`Model::gdn_verify`] and
    /// [`Model::attention_verify`]).
    #[allow(clippy::too_many_arguments)]
    fn verify_layer(
        &self,
        idx: usize,
        layer: &Layer,
        x: &mut [f32],
        t: usize,
        pos0: usize,
        ls: &mut LayerState,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
    ) {
        self.input_norm(layer, x, &mut s.rows);
        match (&layer.mixer, ls) {
            (Mixer::Linear(w), LayerState::Linear(st)) => self.gdn_verify(idx, w, t, st, s),
            (Mixer::Attention(w), LayerState::Attention(c)) => {
                self.attention_verify(idx, w, t, pos0, c, s, remote)
            }
            _ => panic!("layer kind and state kind differ"),
        }
        self.layer_rest(idx, layer, x, t, &mut s.rows, &mut remote.error);
    }

    /// The Gated DeltaNet mixer of a verify on `s.rows.h` (`[t, H]`), output in `s.rows.out`. One token is the
    /// decode step itself (nothing to keep: its only rollback is to itself). More run the conv row by row and the
    /// norms of the many-token path (the decode step's bits) and the recurrence out of place from the state, which
    /// stays in the layer's keep with the conv state, the raw rows and the delta rule's inputs (buffers swapped,
    /// not copied).
    fn gdn_verify(
        &self,
        idx: usize,
        w: &GdnWeights,
        t: usize,
        st: &mut LinearState,
        s: &mut Scratch,
    ) {
        w.in_proj.forward_into(&s.rows.h, t, &mut s.rows.proj); // [T, width] = [qkv | z | b | a]
        let m = &mut s.mix;
        if t == 1 {
            self.gdn_core(w, &s.rows.proj, 1, st, m);
        } else {
            let keep = &mut s.verify.linear[idx];
            keep.conv.clone_from(&st.conv);
            self.gdn_conv_qkv_as(w, &s.rows.proj, t, st, m, true);
            self.gdn_gates(w, &s.rows.proj, t, m);
            std::mem::swap(&mut st.recurrent, &mut keep.state);
            st.recurrent.resize(keep.state.len(), 0.0);
            let c = &self.config;
            let o = sized(
                &mut m.o,
                t * c.linear_num_value_heads * c.linear_value_head_dim,
            );
            {
                let _p = profile::scope(Op::DeltaRecurrent);
                gdn::delta_rule_recurrent_from(
                    self.gdn_dims(t),
                    &m.q,
                    &m.k,
                    &m.v,
                    &m.g,
                    &m.beta,
                    &keep.state,
                    &mut st.recurrent,
                    o,
                );
            }
            {
                let _p = profile::scope(Op::Norm);
                rowops::gated_rms_norm(&mut m.o, &m.z, &w.norm, c.rms_norm_eps as f32);
            }
            std::mem::swap(&mut m.a, &mut keep.raw);
            std::mem::swap(&mut m.k, &mut keep.k);
            std::mem::swap(&mut m.v, &mut keep.v);
            std::mem::swap(&mut m.g, &mut keep.g);
            std::mem::swap(&mut m.beta, &mut keep.beta);
        }
        w.out_proj.forward_into(&s.mix.o, t, &mut s.rows.out);
    }

    /// The attention mixer of a verify on `s.rows.h`, output in `s.rows.out`: the ubatch's attention (every row
    /// attends as a one-token step would: `attend_page`'s rows do not depend on the other rows of the call, and a
    /// page a row cannot see merges as an exact no-op), waiting here for the pages held elsewhere, if any.
    #[allow(clippy::too_many_arguments)]
    fn attention_verify(
        &self,
        idx: usize,
        w: &AttnWeights,
        t: usize,
        pos0: usize,
        cache: &mut PagedKvCache,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
    ) {
        w.qkv.forward_into(&s.rows.h, t, &mut s.rows.proj);
        let m = &mut s.mix;
        if let Some(a) = self.attention_core(idx, w, &s.rows.proj, t, pos0, cache, m, remote) {
            self.attention_core_finish(idx, t, cache, m, remote, a);
        }
        w.o_proj.forward_into(&s.mix.o, t, &mut s.rows.out);
    }
}

impl ModelState {
    /// The positions of the open verify (`pos0..pos0 + T`), if one is open ([`Model::forward_layers_verify`]).
    pub fn verify_span(&self) -> Option<Range<usize>> {
        let (pos0, t) = self.scratch().verify.span?;
        Some(pos0..pos0 + t)
    }

    /// Bytes held for rollbacks: per Gated DeltaNet layer a second recurrent state and the inputs of the largest
    /// verify run so far (0 before the first verify of more than one token).
    pub fn verify_bytes(&self) -> usize {
        self.scratch()
            .verify
            .linear
            .iter()
            .map(LinearKeep::bytes)
            .sum()
    }

    /// Rolls the open verify of `T` tokens at `pos0..pos0 + T` back to its first `accepted` positions (`1 ≤ accepted ≤
    /// T`): attention layers' KV rows are truncated to `pos0 + accepted` (pages too), Gated DeltaNet layers replay
    /// the accepted positions from the state the verify started from, and the position becomes `pos0 + accepted`.
    /// The state is then, bit for bit, the one `accepted` one-token decode steps from `pos0` leave. `accepted = T`
    /// keeps everything (no work). Either way the verify is closed. Runs on the current rayon pool.
    ///
    /// Errors ([`VerifyError`], the state unchanged): `NoVerify` if no verify is open, `Position` if the state is
    /// not at the verify's end (its tokens not committed), `Accepted` outside `1..=T`, `NotVerified` for a layer
    /// held here that did not run in it, `Offloaded` if rows to drop are held elsewhere.
    pub fn rollback_verify(&mut self, accepted: usize) -> Result<(), VerifyError> {
        let keep = &self.scratch().verify;
        let (pos0, t) = keep.span.ok_or(VerifyError::NoVerify)?;
        if self.n_tokens() != pos0 + t {
            return Err(VerifyError::Position {
                at: self.n_tokens(),
                span: pos0..pos0 + t,
            });
        }
        if accepted == 0 || accepted > t {
            return Err(VerifyError::Accepted { accepted, t });
        }
        let to = pos0 + accepted;
        for i in self.range() {
            if !keep.ran.get(i).copied().unwrap_or(false) {
                return Err(VerifyError::NotVerified(i));
            }
            if let Some(LayerState::Attention(c)) = self.layer(i) {
                if c.offloaded() > to {
                    let offloaded = c.offloaded();
                    return Err(VerifyError::Offloaded { to, offloaded });
                }
            }
        }
        let (layers, s, _) = self.verify_parts();
        let keep = &mut s.verify;
        keep.close();
        if accepted < t {
            let (dims, kernel, conv_dim) = keep.dims.expect("an open verify has its dims");
            for (l, kept) in layers.iter_mut().zip(&keep.linear) {
                match l {
                    Some(LayerState::Attention(c)) => c.truncate(to),
                    Some(LayerState::Linear(st)) => {
                        replay(dims, kernel, conv_dim, accepted, kept, st)
                    }
                    None => {}
                }
            }
            self.set_n_tokens(to);
        }
        Ok(())
    }
}

/// A Gated DeltaNet layer's state after the first `m` positions of the verify that `kept` holds: the recurrence
/// replayed from the kept state, the conv window of the kept conv state and raw rows.
fn replay(
    dims: GdnDims,
    kernel: usize,
    conv_dim: usize,
    m: usize,
    kept: &LinearKeep,
    st: &mut LinearState,
) {
    let d = GdnDims {
        n_tokens: m,
        ..dims
    };
    let (qk, vv, hv) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v, d.n_v_heads);
    {
        let _p = profile::scope(Op::DeltaRecurrent);
        gdn::delta_rule_replay(
            d,
            &kept.k[..m * qk],
            &kept.v[..m * vv],
            &kept.g[..m * hv],
            &kept.beta[..m * hv],
            &kept.state,
            &mut st.recurrent,
        );
    }
    let _p = profile::scope(Op::Copy);
    conv_window_into(&kept.conv, &kept.raw, conv_dim, kernel - 1, m, &mut st.conv);
}
