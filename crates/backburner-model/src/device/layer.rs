//! A range of decoder layers held on one backend, and their pass over a sequence's residual stream: the same math as
//! the CPU path (`model/forward.rs`, `model/mixer.rs`), written once against [`Backend`]'s ops so that any device
//! runs it. On [`super::CpuBackend`] it gives the CPU path's bits.

use std::ops::Range;
use std::sync::Arc;

use super::backend::{Backend, Buf, DeviceKv, DeviceMatrix, DeviceResult};
use super::id::DeviceError;
use super::state::{DState, DeviceState, Scratch};
use crate::config::ModelConfig;
use crate::model::Capture;
use crate::model::{Ffn, Layer, Mixer, Model};
use crate::ops::Rope;
use crate::remote::RemoteSlot;
use crate::state::KvOptions;

/// One layer's weights on a device.
pub(super) struct DLayer {
    input_norm: Buf,
    post_norm: Buf,
    mixer: DMixer,
    gate_up: DeviceMatrix,
    down: DeviceMatrix,
}

pub(super) enum DMixer {
    Gdn {
        in_proj: DeviceMatrix,
        conv_weight: Buf,
        dt_bias: Buf,
        neg_a: Buf,
        norm: Buf,
        out_proj: DeviceMatrix,
    },
    Attn {
        qkv: DeviceMatrix,
        q_norm: Buf,
        k_norm: Buf,
        o_proj: DeviceMatrix,
    },
}

/// Layers to place on a device as a load reads them ([`Model::from_checkpoint_placed`]).
#[derive(Clone)]
pub struct LayerPlacement {
    /// The layers (model indices; inside the layers the load holds).
    pub layers: Range<usize>,
    /// The device that holds and runs them.
    pub backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for LayerPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layers {:?} on {}", self.layers, self.backend.info().id)
    }
}

/// Layers `range` of a model held on one backend: their weights uploaded once, run on a [`DeviceState`].
pub struct DeviceLayers {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) range: Range<usize>,
    pub(super) layers: Vec<DLayer>,
    pub(super) cfg: ModelConfig,
    pub(super) rope: Rope,
}

impl std::fmt::Debug for DeviceLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceLayers({:?} on {})",
            self.range,
            self.backend.info().id
        )
    }
}

impl DeviceLayers {
    /// Uploads the weights of layers `range` of `model` (which must hold them on the host) to `backend`.
    ///
    /// Errors: [`DeviceError::Unsupported`] for a layer the host does not hold, a mixture-of-experts layer (they run
    /// on the CPU) or a weight format the backend lacks; the backend's out-of-memory and driver errors.
    pub fn new(
        model: &Model,
        range: Range<usize>,
        backend: Arc<dyn Backend>,
    ) -> Result<Self, DeviceError> {
        let id = backend.info().id;
        let mut d = Self::empty(model.config(), range.start, backend);
        for i in range {
            let l = model.layer(i).ok_or_else(|| {
                DeviceError::Unsupported(id, format!("layer {i}: not held on the host"))
            })?;
            d.push(l)?;
        }
        Ok(d)
    }

    /// No layers yet on `backend`, of a model with `config`, the first to be pushed being its layer `first`: a load
    /// that places layers as it reads them builds them with [`DeviceLayers::push`].
    pub fn empty(config: &ModelConfig, first: usize, backend: Arc<dyn Backend>) -> Self {
        let cfg = config.clone();
        let rope = Rope::new(cfg.rotary_dim(), cfg.head_dim, cfg.rope.rope_theta);
        DeviceLayers {
            backend,
            range: first..first,
            layers: Vec::new(),
            cfg,
            rope,
        }
    }

    /// Uploads `layer`'s weights as the next layer held (model index [`DeviceLayers::range`]`.end`, which the range
    /// then includes); the caller may drop its copy after.
    ///
    /// Errors: [`DeviceError::Unsupported`] for a mixture-of-experts layer or a weight format the backend lacks; the
    /// backend's out-of-memory and driver errors. Nothing is added on an error.
    pub fn push(&mut self, layer: &Layer) -> Result<(), DeviceError> {
        let i = self.range.end;
        self.layers
            .push(upload_layer(self.backend.as_ref(), layer, i)?);
        self.range.end += 1;
        Ok(())
    }

    /// The layers held.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        let m = |w: &DeviceMatrix| w.bytes;
        let f = |b: &Buf| 4 * b.len() as u64;
        self.layers
            .iter()
            .map(|l| {
                let mix = match &l.mixer {
                    DMixer::Gdn {
                        in_proj,
                        conv_weight,
                        dt_bias,
                        neg_a,
                        norm,
                        out_proj,
                    } => {
                        m(in_proj) + m(out_proj) + f(conv_weight) + f(dt_bias) + f(neg_a) + f(norm)
                    }
                    DMixer::Attn {
                        qkv,
                        q_norm,
                        k_norm,
                        o_proj,
                    } => m(qkv) + m(o_proj) + f(q_norm) + f(k_norm),
                };
                mix + m(&l.gate_up) + m(&l.down) + f(&l.input_norm) + f(&l.post_norm)
            })
            .sum()
    }

    /// A sequence's empty state of these layers (position 0), its KV pages as `kv` says.
    ///
    /// Errors: the backend's out-of-memory and driver errors.
    pub fn new_state(&self, kv: KvOptions) -> DeviceResult<DeviceState> {
        let be = self.backend.as_ref();
        let c = &self.cfg;
        let layers = self
            .layers
            .iter()
            .map(|l| match l.mixer {
                DMixer::Gdn { .. } => {
                    let conv = c.conv_dim() * (c.linear_conv_kernel_dim - 1);
                    let rec =
                        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
                    Ok(DState::Gdn {
                        conv: be.zeros(conv)?,
                        recurrent: be.zeros(rec)?,
                    })
                }
                DMixer::Attn { .. } => Ok(DState::Attn(be.kv_new(
                    kv.page_size,
                    c.num_key_value_heads,
                    c.head_dim,
                    kv.dtype,
                )?)),
            })
            .collect::<DeviceResult<Vec<_>>>()?;
        let s = Scratch::empty(be)?;
        let pos = vec![0; layers.len()];
        Ok(DeviceState {
            backend: self.backend.clone(),
            first: self.range.start,
            layers,
            pos,
            s,
        })
    }

    /// Runs layers `layers` (model indices inside [`DeviceLayers::range`]) on the host residual stream `x`
    /// (`[n_tokens, hidden]` f32, in place) for tokens at positions `pos0..`: one upload, the layers on the device,
    /// one download. Each of those layers must have processed exactly `pos0` positions (panics otherwise: caller
    /// bug).
    ///
    /// Errors: the backend's; after one, the state is unusable (drop it).
    pub fn forward_host(
        &self,
        layers: Range<usize>,
        x: &mut [f32],
        n_tokens: usize,
        pos0: usize,
        st: &mut DeviceState,
    ) -> DeviceResult<()> {
        let (mut remote, mut capture) = (RemoteSlot::default(), Capture::default());
        self.forward_host_with(layers, x, n_tokens, pos0, st, &mut remote, &mut capture)
    }

    /// [`DeviceLayers::forward_host`] with the sequence's store of KV pages held elsewhere (KV offload): an
    /// attention layer whose device cache moved pages off ([`DeviceState::kv_take_oldest`]) asks `remote` for their
    /// partial and continues the fold over its own pages ([`Backend::attend_after`]). A failure of the store is
    /// latched in `remote` (the step's output is then meaningless). The Gated DeltaNet layers take the checkpoints
    /// `capture` requests, as the CPU path does (`model/capture.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_host_with(
        &self,
        layers: Range<usize>,
        x: &mut [f32],
        n_tokens: usize,
        pos0: usize,
        st: &mut DeviceState,
        remote: &mut RemoteSlot,
        capture: &mut Capture,
    ) -> DeviceResult<()> {
        assert!(
            layers.start >= self.range.start && layers.end <= self.range.end,
            "layers {layers:?} are not all in {:?}",
            self.range
        );
        assert_eq!(x.len(), n_tokens * self.cfg.hidden_size, "x is not [T, H]");
        let be = self.backend.as_ref();
        let (a, b) = (
            layers.start - self.range.start,
            layers.end - self.range.start,
        );
        for (i, &p) in st.pos[a..b].iter().enumerate() {
            assert_eq!(
                p,
                pos0,
                "layer {} holds {p} positions, the pass is at {pos0}",
                a + i
            );
        }
        let mut xd = std::mem::replace(&mut st.s.x, be.zeros(0)?);
        let r = (|| {
            be.upload_into(x, &mut xd)?;
            for (j, (l, ls)) in self.layers[a..b]
                .iter()
                .zip(st.layers[a..b].iter_mut())
                .enumerate()
            {
                let at = Pass {
                    idx: layers.start + j,
                    t: n_tokens,
                    pos0,
                };
                self.layer(l, &mut xd, at, ls, &mut st.s, remote, capture)?;
            }
            be.download(&xd, x)
        })();
        st.s.x = xd;
        r?;
        for p in &mut st.pos[a..b] {
            *p = pos0 + n_tokens;
        }
        Ok(())
    }

    /// One layer on the device residual stream `x` (`[t, H]`).
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: &DLayer,
        x: &mut Buf,
        at: Pass,
        ls: &mut DState,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
        capture: &mut Capture,
    ) -> DeviceResult<()> {
        let t = at.t;
        let be = self.backend.as_ref();
        let eps = self.cfg.rms_norm_eps as f32;
        be.rms_norm(x, &l.input_norm, eps, &mut s.h)?;
        match (&l.mixer, ls) {
            (DMixer::Gdn { .. }, DState::Gdn { conv, recurrent }) => {
                self.gdn(&l.mixer, at, conv, recurrent, s, capture)?
            }
            (DMixer::Attn { .. }, DState::Attn(kv)) => {
                self.attention(&l.mixer, at, kv, s, remote)?
            }
            _ => panic!("layer kind and state kind differ"),
        }
        be.add_assign(x, &s.out)?;
        be.rms_norm(x, &l.post_norm, eps, &mut s.h)?;
        be.matmul_swiglu(&s.h, t, &l.gate_up, &mut s.gu, &mut s.act)?;
        be.matmul(&s.act, t, &l.down, &mut s.out)?;
        be.add_assign(x, &s.out)
    }

    /// Gated attention on `s.h` at positions `pos0..`, output in `s.out` (`model/mixer.rs`'s `attention_core` with
    /// its projections, all pages on this device).
    fn attention(
        &self,
        m: &DMixer,
        at: Pass,
        kv: &mut DeviceKv,
        s: &mut Scratch,
        remote: &mut RemoteSlot,
    ) -> DeviceResult<()> {
        let (t, pos0) = (at.t, at.pos0);
        let DMixer::Attn {
            qkv,
            q_norm,
            k_norm,
            o_proj,
        } = m
        else {
            unreachable!("attention on a Gated DeltaNet layer")
        };
        let be = self.backend.as_ref();
        let c = &self.cfg;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let width = hq * 2 * d + 2 * hkv * d;
        let eps = c.rms_norm_eps as f32;
        be.matmul(&s.h, t, qkv, &mut s.proj)?;
        // [t, Hq·2D] per-head (q | gate) = [t·Hq, 2D]: q the first D of each, the gate the rest
        be.take_cols(&s.proj, width, 0, hq * 2 * d, &mut s.o)?;
        be.take_cols(&s.o, 2 * d, 0, d, &mut s.a)?;
        be.take_cols(&s.o, 2 * d, d, d, &mut s.b)?;
        be.take_cols(&s.proj, width, hq * 2 * d, hkv * d, &mut s.k)?;
        be.take_cols(&s.proj, width, hq * 2 * d + hkv * d, hkv * d, &mut s.v)?;
        be.rms_norm_inplace(&mut s.a, q_norm, eps)?;
        be.rms_norm_inplace(&mut s.k, k_norm, eps)?;
        be.rope(&self.rope, &mut s.a, t, hq, pos0)?;
        be.rope(&self.rope, &mut s.k, t, hkv, pos0)?;
        assert_eq!(kv.len, pos0, "KV cache length differs from the position");
        be.kv_append(kv, &s.k, &s.v, t)?;
        let scale = 1.0 / (d as f32).sqrt();
        if be.kv_offloaded(kv) == 0 {
            be.attend(kv, &s.a, t, hq, pos0, scale, &mut s.o, &mut s.lse)?;
        } else {
            // the oldest pages are elsewhere: their partial first, then the fold over ours (docs/KV_OFFLOAD.md)
            let mut q = vec![0.0f32; s.a.len()];
            be.download(&s.a, &mut q)?;
            let prefix = remote
                .begin(at.idx, &q, t, hq, pos0, scale)
                .then(|| remote.finish(at.idx, t, hq, d))
                .flatten();
            match prefix {
                Some(p) => {
                    be.attend_after(kv, p, &s.a, t, hq, pos0, scale, &mut s.o, &mut s.lse)?
                }
                // the failure is latched in `remote`: the step's output is discarded
                None => s.o = be.zeros(t * hq * d)?,
            }
        }
        be.sigmoid_mul(&mut s.o, &s.b)?;
        be.matmul(&s.o, t, o_proj, &mut s.out)
    }
}

/// Where a layer's pass is: its model index, its tokens and their first position.
#[derive(Clone, Copy)]
pub(super) struct Pass {
    pub(super) idx: usize,
    pub(super) t: usize,
    pub(super) pos0: usize,
}

/// Uploads one layer's weights.
fn upload_layer(be: &dyn Backend, l: &Layer, i: usize) -> Result<DLayer, DeviceError> {
    let (gate_up, down) = match &l.ffn {
        Ffn::Dense { gate_up, down } => (be.upload_matrix(gate_up)?, be.upload_matrix(down)?),
        Ffn::Moe(_) => {
            return Err(DeviceError::Unsupported(
                be.info().id,
                format!("layer {i}: mixture-of-experts layers (they run on the CPU)"),
            ))
        }
    };
    let mixer = match &l.mixer {
        Mixer::Linear(w) => DMixer::Gdn {
            in_proj: be.upload_matrix(&w.in_proj)?,
            conv_weight: be.upload(&w.conv_weight)?,
            dt_bias: be.upload(&w.dt_bias)?,
            neg_a: be.upload(&w.neg_a)?,
            norm: be.upload(&w.norm)?,
            out_proj: be.upload_matrix(&w.out_proj)?,
        },
        Mixer::Attention(w) => DMixer::Attn {
            qkv: be.upload_matrix(&w.qkv)?,
            q_norm: be.upload(&w.q_norm)?,
            k_norm: be.upload(&w.k_norm)?,
            o_proj: be.upload_matrix(&w.o_proj)?,
        },
    };
    Ok(DLayer {
        input_norm: be.upload(&l.input_norm)?,
        post_norm: be.upload(&l.post_norm)?,
        mixer,
        gate_up,
        down,
    })
}
