//! Layers placed on devices: [`Model::place_layers`] uploads a range of layers to a backend, and the plain forward
//! pass ([`Model::forward_layers_at`]) hands those layers to it, keeping the sequence's state of them on the device
//! ([`crate::device::DeviceState`] in the [`ModelState`]). The rest of the layers stay on the CPU path; the residual
//! stream crosses at the range's ends (one upload, one download per pass), as it crosses the link in a layer split.
//! The host holds no copy of the placed layers' weights: [`Model::place_layers`] drops it once they are uploaded, and
//! a load with a placement ([`Model::from_checkpoint_placed`]) uploads each layer as it reads it.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::load::load_layer;
use super::{Layer, Model};
use crate::checkpoint::Checkpoint;
use crate::config::{FfnKind, ModelConfig};
use crate::device::{
    Backend, Buf, DeviceError, DeviceId, DeviceLayers, DeviceMatrix, DeviceResult, LayerPlacement,
};
use crate::error::ModelError;
use crate::remote::RemoteError;
use crate::state::ModelState;

impl Model {
    /// Places layers `range` on `backend`: their weights are uploaded now, the host's copy of them is dropped (the
    /// host then holds none of their weights, norms included: [`Model::layer`] is `None` for them and
    /// [`Model::host_weight_bytes`] no longer counts them), and every pass of [`Model::forward_layers`] and
    /// [`Model::forward_tokens`] runs them there. To place layers without ever holding the whole model on the host,
    /// load with [`Model::from_checkpoint_placed`].
    ///
    /// The single-sequence pass (KV offload included: move pages with [`ModelState::take_oldest_pages`]), batched
    /// decode and a [`ModelState`]'s snapshots and checkpoints run placed layers; verify, MTP drafting and the
    /// interleaved pass panic on a model with placed layers (`Model::check_cpu_only`: callers refuse first).
    ///
    /// Errors: [`DeviceError::Unsupported`] if `range` is empty, not loaded here, overlaps a range already placed, or
    /// holds a layer the backend cannot run (a mixture-of-experts layer); the backend's memory and driver errors.
    /// Nothing changes on an error.
    pub fn place_layers(
        &mut self,
        range: Range<usize>,
        backend: Arc<dyn Backend>,
    ) -> Result<(), DeviceError> {
        let placed: Vec<Range<usize>> = self.devices.iter().map(DeviceLayers::range).collect();
        check_range(&range, &self.range, &placed, backend.as_ref())?;
        let part = DeviceLayers::new(self, range.clone(), backend)?;
        for l in &mut self.layers[range] {
            self.placed_bytes += l.take().map_or(0, |l| l.weight_bytes());
        }
        self.devices.push(part);
        self.devices.sort_by_key(|p| p.range().start);
        Ok(())
    }

    /// Places the final norm and the output head on `backend` (the tied embedding or `lm_head`, as held): every
    /// [`Model::logits`] then runs there and copies only the logits back. The MTP block's head stays on the CPU.
    ///
    /// Errors: [`DeviceError::Unsupported`] if this node does not hold the ends or the head's format is one the
    /// backend lacks; the backend's memory and driver errors.
    pub fn place_head(&mut self, backend: Arc<dyn Backend>) -> Result<(), DeviceError> {
        let id = backend.info().id;
        let (Some(norm), Some(head)) = (
            self.final_norm.as_ref(),
            self.lm_head.as_ref().or(self.embed.as_ref()),
        ) else {
            return Err(DeviceError::Unsupported(
                id,
                "a head this node does not hold".into(),
            ));
        };
        let norm = backend.upload(norm)?;
        let head = backend.upload_matrix(head)?;
        self.head_device = Some(DeviceHead {
            eps: self.config.rms_norm_eps as f32,
            norm,
            head,
            scratch: Mutex::new(None),
            backend,
        });
        Ok(())
    }

    /// The device of the output head, if it is placed on one.
    pub fn head_placement(&self) -> Option<DeviceId> {
        self.head_device.as_ref().map(|d| d.backend.info().id)
    }

    /// Where each placed range of layers runs, in layer order (layers not listed run on the CPU path).
    pub fn placement(&self) -> Vec<(Range<usize>, DeviceId)> {
        self.devices
            .iter()
            .map(|p| (p.range(), p.backend().info().id))
            .collect()
    }

    /// Bytes of weights placed on devices: the placed layers' and the output head's (its matrix; the host keeps its
    /// own copy of the head, which the embedding or MTP may share).
    pub fn device_weight_bytes(&self) -> u64 {
        let head = self.head_device.as_ref().map_or(0, |h| h.head.bytes);
        self.devices
            .iter()
            .map(DeviceLayers::weight_bytes)
            .sum::<u64>()
            + head
    }

    /// Panics (a caller bug) if layers are placed on a device: `what` runs on the CPU path only.
    pub(crate) fn check_cpu_only(&self, what: &str) {
        assert!(
            self.devices.is_empty(),
            "{what} runs on the CPU path only; layers {:?} are placed on devices",
            self.placement()
        );
    }

    /// The end of the placed range holding layer `i`, if it is placed on a device.
    pub(super) fn placed_end(&self, i: usize) -> Option<usize> {
        self.devices
            .iter()
            .map(DeviceLayers::range)
            .find(|r| r.contains(&i))
            .map(|r| r.end)
    }

    /// If layer `layers.start` is placed on a device, runs the placed layers from there (up to `layers.end` or the
    /// placed range's end) on `x` and returns where the pass goes on; `None` if it is not placed. A device failure
    /// latches in the state as a remote failure does (the step's output is meaningless: the caller discards it).
    pub(super) fn forward_on_device(
        &self,
        layers: Range<usize>,
        x: &mut [f32],
        n_tokens: usize,
        pos0: usize,
        state: &mut ModelState,
    ) -> Option<usize> {
        let (p, part) = self
            .devices
            .iter()
            .enumerate()
            .find(|(_, p)| p.range().contains(&layers.start))?;
        let end = layers.end.min(part.range().end);
        if state.device.len() <= p {
            state.device.resize_with(p + 1, || None);
        }
        let stale = state.device[p]
            .as_ref()
            .is_none_or(|s| pos0 == 0 && s.positions(layers.start) != Some(0));
        if stale {
            match part.new_state(state.kv_options()) {
                Ok(s) => state.device[p] = Some(s),
                Err(e) => {
                    state.latch_remote_error(RemoteError(e.to_string()));
                    return Some(end);
                }
            }
        }
        let (devs, remote, capture) = state.device_pass();
        let st = devs[p].as_mut().expect("made above");
        let r = part.forward_host_with(layers.start..end, x, n_tokens, pos0, st, remote, capture);
        if let Err(e) = r {
            state.latch_remote_error(RemoteError(e.to_string()));
        }
        Some(end)
    }
}

/// The final norm and the output head on a device.
pub(super) struct DeviceHead {
    backend: Arc<dyn Backend>,
    eps: f32,
    norm: Buf,
    head: DeviceMatrix,
    /// The rows, their norm and the logits, kept between calls.
    scratch: Mutex<Option<[Buf; 3]>>,
}

impl std::fmt::Debug for DeviceHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceHead({:?} on {})",
            self.head,
            self.backend.info().id
        )
    }
}

impl DeviceHead {
    /// Final norm and head on residual rows `x` (`[n_rows, hidden]`) → logits `[n_rows, vocab]` f32 on the host.
    pub(super) fn logits(&self, x: &[f32], n_rows: usize) -> DeviceResult<Vec<f32>> {
        let be = self.backend.as_ref();
        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let [xd, h, y] = match guard.take() {
            Some(s) => s,
            None => [be.zeros(0)?, be.zeros(0)?, be.zeros(0)?],
        };
        let (mut xd, mut h, mut y) = (xd, h, y);
        let r = (|| {
            be.upload_into(x, &mut xd)?;
            be.rms_norm(&xd, &self.norm, self.eps, &mut h)?;
            be.matmul(&h, n_rows, &self.head, &mut y)?;
            let mut out = vec![0.0f32; y.len()];
            be.download(&y, &mut out)?;
            Ok(out)
        })();
        *guard = Some([xd, h, y]);
        r
    }
}

/// Checks that layers `range` can be placed on `backend`: not empty, inside `held` (the layers the node loads) and
/// clear of the ranges `placed` already. Errors: [`DeviceError::Unsupported`] naming what is wrong.
pub(super) fn check_range(
    range: &Range<usize>,
    held: &Range<usize>,
    placed: &[Range<usize>],
    backend: &dyn Backend,
) -> Result<(), DeviceError> {
    let bad = |why: String| Err(DeviceError::Unsupported(backend.info().id, why));
    if range.is_empty() || range.start < held.start || range.end > held.end {
        return bad(format!("layers {range:?}: this node holds {held:?}"));
    }
    match placed
        .iter()
        .find(|r| r.start < range.end && range.start < r.end)
    {
        Some(r) => bad(format!("layers {range:?} overlap {r:?}, placed already")),
        None => Ok(()),
    }
}

/// The layers a load read ([`load_layers`]).
pub(super) struct LoadedLayers {
    /// Every layer of the model, `Some` where held on the host.
    pub(super) host: Vec<Option<Layer>>,
    /// The layers placed on a device as they were read.
    pub(super) device: Option<DeviceLayers>,
    /// Bytes the placed layers took on the host before they left it ([`Layer::weight_bytes`]).
    pub(super) placed_bytes: usize,
}

/// Checks, before a load reads anything, that `p` can be placed as the load of `held` reads it: [`check_range`],
/// and no mixture-of-experts layer in it (they run on the CPU). Errors: [`DeviceError::Unsupported`].
pub(super) fn check_placement(
    c: &ModelConfig,
    p: &LayerPlacement,
    held: &Range<usize>,
) -> Result<(), DeviceError> {
    check_range(&p.layers, held, &[], p.backend.as_ref())?;
    match p.layers.clone().find(|&i| c.ffn_types[i] == FfnKind::Moe) {
        Some(i) => Err(DeviceError::Unsupported(
            p.backend.info().id,
            format!("layer {i}: mixture-of-experts layers (they run on the CPU)"),
        )),
        None => Ok(()),
    }
}

/// The layers of a load (`layers`, without the routed experts `elsewhere` names), each read in turn: those of
/// `place.layers` (checked with [`check_range`]) uploaded to `place.backend` and dropped, the others kept.
/// `progress(done, total)` hears each layer.
///
/// Errors: the layer's load ([`ModelError`]); the upload's as [`ModelError::Device`].
pub(super) fn load_layers(
    c: &ModelConfig,
    ckpt: &Checkpoint,
    layers: Range<usize>,
    elsewhere: &dyn Fn(usize, usize) -> bool,
    place: Option<&LayerPlacement>,
    progress: &mut impl FnMut(usize, usize),
) -> Result<LoadedLayers, ModelError> {
    let total = layers.len();
    let mut host: Vec<Option<Layer>> = (0..c.num_hidden_layers).map(|_| None).collect();
    let mut device = place.map(|p| DeviceLayers::empty(c, p.layers.start, p.backend.clone()));
    let mut placed_bytes = 0;
    for (n, i) in layers.enumerate() {
        let layer = load_layer(c, ckpt, i, elsewhere)?;
        match device
            .as_mut()
            .filter(|_| place.is_some_and(|p| p.layers.contains(&i)))
        {
            Some(d) => {
                d.push(&layer)?;
                placed_bytes += layer.weight_bytes();
            }
            None => host[i] = Some(layer),
        }
        progress(n + 1, total);
    }
    Ok(LoadedLayers {
        host,
        device,
        placed_bytes,
    })
}
