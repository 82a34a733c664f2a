//! One sequence's state of the layers a [`super::DeviceLayers`] holds: each layer's conv and recurrent state or KV
//! cache on the device, the positions each has processed, and the pass's activation buffers.

use std::sync::Arc;

use backburner_kernels::kv::KvPage;

use super::backend::{Backend, Buf, DeviceKv, DeviceResult};
use crate::state::LinearState;

/// One sequence's state of the layers of a [`super::DeviceLayers`], on its device, and the pass's activation buffers.
pub struct DeviceState {
    pub(super) backend: Arc<dyn Backend>,
    /// The model index of the first layer held.
    pub(super) first: usize,
    pub(super) layers: Vec<DState>,
    /// Positions each layer has processed.
    pub(super) pos: Vec<usize>,
    pub(super) s: Scratch,
}

impl DeviceState {
    /// Positions layer `i` (an index of the model) has processed, if this state holds it.
    pub fn positions(&self, i: usize) -> Option<usize> {
        self.pos.get(i.checked_sub(self.first)?).copied()
    }

    /// The KV cache of attention layer `i` (a model index), if this state holds it.
    fn kv(&self, i: usize) -> Option<&DeviceKv> {
        match self.layers.get(i.checked_sub(self.first)?)? {
            DState::Attn(kv) => Some(kv),
            DState::Gdn { .. } => None,
        }
    }

    /// The Gated DeltaNet layers' states copied to the host, as `(model index, state)` in layer order: what a
    /// [`crate::StateSnapshot`] keeps of them.
    ///
    /// Errors: the backend's copy errors.
    pub fn linear_states(&self) -> DeviceResult<Vec<(usize, LinearState)>> {
        let mut out = Vec::new();
        for (j, l) in self.layers.iter().enumerate() {
            if let DState::Gdn { conv, recurrent } = l {
                let mut s = LinearState {
                    conv: vec![0.0; conv.len()],
                    recurrent: vec![0.0; recurrent.len()],
                };
                self.backend.download(conv, &mut s.conv)?;
                self.backend.download(recurrent, &mut s.recurrent)?;
                out.push((self.first + j, s));
            }
        }
        Ok(out)
    }

    /// Goes back to position `n`: every KV cache truncated there and the Gated DeltaNet layers' states taken from
    /// `linear` (`(model index, state)`, as [`DeviceState::linear_states`] gives; entries of layers not held are
    /// skipped).
    ///
    /// Errors: a layer held here without an entry in `linear` or of another size ([`DeviceError::Unsupported`]),
    /// the backend's copy and truncation errors. After an error the state is unusable (drop it).
    pub fn restore(&mut self, n: usize, linear: &[(usize, LinearState)]) -> DeviceResult<()> {
        let be = self.backend.clone();
        for (j, l) in self.layers.iter_mut().enumerate() {
            let i = self.first + j;
            match l {
                DState::Attn(kv) => be.kv_truncate(kv, n)?,
                DState::Gdn { conv, recurrent } => {
                    let s = linear
                        .iter()
                        .find(|(k, _)| *k == i)
                        .map(|(_, s)| s)
                        .filter(|s| {
                            s.conv.len() == conv.len() && s.recurrent.len() == recurrent.len()
                        })
                        .ok_or_else(|| {
                            super::DeviceError::Unsupported(
                                be.info().id,
                                format!(
                                    "restoring layer {i}: the snapshot holds no state of its size"
                                ),
                            )
                        })?;
                    be.upload_into(&s.conv, conv)?;
                    be.upload_into(&s.recurrent, recurrent)?;
                }
            }
        }
        self.pos.fill(n);
        Ok(())
    }

    /// A copy of this state on the same device: every layer's conv and recurrent state and KV cache copied there
    /// ([`Backend::copy`], [`Backend::kv_clone`]), the positions taken, fresh activation buffers. How a sequence is
    /// forked from another (`ModelState::copy_from`).
    ///
    /// Errors: out of memory; a backend that cannot copy a KV cache.
    pub fn duplicate(&self) -> DeviceResult<DeviceState> {
        let be = self.backend.as_ref();
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                DState::Gdn { conv, recurrent } => {
                    let (mut c, mut r) = (be.zeros(0)?, be.zeros(0)?);
                    be.copy(conv, &mut c)?;
                    be.copy(recurrent, &mut r)?;
                    Ok(DState::Gdn {
                        conv: c,
                        recurrent: r,
                    })
                }
                DState::Attn(kv) => Ok(DState::Attn(be.kv_clone(kv)?)),
            })
            .collect::<DeviceResult<Vec<_>>>()?;
        Ok(DeviceState {
            backend: self.backend.clone(),
            first: self.first,
            layers,
            pos: self.pos.clone(),
            s: Scratch::empty(be)?,
        })
    }

    /// Whether `other` holds the same layers as this state, on the same device (states of one placed range).
    pub fn same_layers(&self, other: &DeviceState) -> bool {
        Arc::ptr_eq(&self.backend, &other.backend)
            && self.first == other.first
            && self.layers.len() == other.layers.len()
    }

    /// Positions of attention layer `i`'s cache held elsewhere (KV offload), if this state holds the layer.
    pub fn kv_offloaded(&self, i: usize) -> Option<usize> {
        self.kv(i).map(|kv| self.backend.kv_offloaded(kv))
    }

    /// Full pages of attention layer `i`'s cache that may move elsewhere, if this state holds the layer.
    pub fn kv_movable_pages(&self, i: usize) -> Option<usize> {
        self.kv(i).map(|kv| self.backend.kv_movable_pages(kv))
    }

    /// Copies of the `n` oldest pages of attention layer `i`'s cache ([`Backend::kv_copy_oldest`]); `None` if this
    /// state does not hold the layer.
    pub fn kv_copy_oldest(&self, i: usize, n: usize) -> Option<DeviceResult<Vec<KvPage>>> {
        self.kv(i).map(|kv| self.backend.kv_copy_oldest(kv, n))
    }

    /// Goes back to position `len` inside attention layer `i`'s pages held elsewhere
    /// ([`Backend::kv_truncate_offloaded`]); `None` if this state does not hold the layer.
    pub fn kv_truncate_offloaded(&mut self, i: usize, len: usize) -> Option<DeviceResult<()>> {
        let j = i.checked_sub(self.first)?;
        let r = match self.layers.get_mut(j)? {
            DState::Attn(kv) => self.backend.kv_truncate_offloaded(kv, len),
            DState::Gdn { .. } => return None,
        };
        if r.is_ok() {
            self.pos[j] = len;
        }
        Some(r)
    }

    /// Moves the `n` oldest pages of attention layer `i`'s cache off the device ([`Backend::kv_take_oldest`]);
    /// `None` if this state does not hold the layer.
    pub fn kv_take_oldest(&mut self, i: usize, n: usize) -> Option<DeviceResult<Vec<KvPage>>> {
        let j = i.checked_sub(self.first)?;
        match self.layers.get_mut(j)? {
            DState::Attn(kv) => Some(self.backend.kv_take_oldest(kv, n)),
            DState::Gdn { .. } => None,
        }
    }
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceState({} layers)", self.layers.len())
    }
}

pub(super) enum DState {
    /// `[conv_dim, kernel − 1]` conv state and `[Hv, Dk, Dv]` recurrent state.
    Gdn {
        conv: Buf,
        recurrent: Buf,
    },
    Attn(DeviceKv),
}

/// Activation buffers, grown to the ubatch once.
pub(super) struct Scratch {
    pub(super) x: Buf,
    pub(super) h: Buf,
    pub(super) proj: Buf,
    pub(super) out: Buf,
    pub(super) gu: Buf,
    pub(super) act: Buf,
    pub(super) a: Buf,
    pub(super) b: Buf,
    pub(super) q: Buf,
    pub(super) k: Buf,
    pub(super) v: Buf,
    pub(super) z: Buf,
    pub(super) g: Buf,
    pub(super) beta: Buf,
    pub(super) o: Buf,
    pub(super) lse: Buf,
}

impl Scratch {
    /// Empty buffers (each grows on first use).
    pub(super) fn empty(be: &dyn Backend) -> DeviceResult<Scratch> {
        let z = || be.zeros(0);
        Ok(Scratch {
            x: z()?,
            h: z()?,
            proj: z()?,
            out: z()?,
            gu: z()?,
            act: z()?,
            a: z()?,
            b: z()?,
            q: z()?,
            k: z()?,
            v: z()?,
            z: z()?,
            g: z()?,
            beta: z()?,
            o: z()?,
            lse: z()?,
        })
    }
}
