//! Layers placed on devices: [`Model::place_layers`] uploads a range of layers to a backend, and the plain forward
//! pass ([`Model::forward_layers_at`]) hands those layers to it, keeping the sequence's state of them on the device
//! ([`crate::device::DeviceState`] in the [`ModelState`]). The rest of the layers stay on the CPU path; the residual
//! stream crosses at the range's ends (one upload, one download per pass), as it crosses the link in a layer split.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::Model;
use crate::device::{
    Backend, Buf, DeviceError, DeviceId, DeviceLayers, DeviceMatrix, DeviceResult,
};
use crate::remote::RemoteError;
use crate::state::ModelState;

impl Model {
    /// Places layers `range` on `backend`: their weights are uploaded now, and every pass of
    /// [`Model::forward_layers`] and [`Model::forward_tokens`] runs them there. The host keeps its copy of the
    /// weights (the CPU path's other entry points still read them).
    ///
    /// Only the single-sequence pass runs placed layers, KV offload included (move pages with
    /// [`ModelState::take_oldest_pages`]): batched decode, verify, MTP drafting and the interleaved pass panic on a
    /// model with placed layers (`Model::check_cpu_only`), and a [`ModelState`]'s snapshots and checkpoints do not
    /// hold the device state.
    ///
    /// Errors: [`DeviceError::Unsupported`] if `range` is empty, not loaded here, overlaps a range already placed, or
    /// holds a layer the backend cannot run (a mixture-of-experts layer); the backend's memory and driver errors.
    pub fn place_layers(
        &mut self,
        range: Range<usize>,
        backend: Arc<dyn Backend>,
    ) -> Result<(), DeviceError> {
        let id = backend.info().id;
        let bad = |why: String| Err(DeviceError::Unsupported(id, why));
        if range.is_empty() || range.start < self.range.start || range.end > self.range.end {
            return bad(format!(
                "layers {range:?}: this node holds {:?}",
                self.range
            ));
        }
        if let Some(p) = self.devices.iter().find(|p| {
            let r = p.range();
            r.start < range.end && range.start < r.end
        }) {
            return bad(format!(
                "layers {range:?} overlap {:?}, placed already",
                p.range()
            ));
        }
        let part = DeviceLayers::new(self, range, backend)?;
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

    /// Bytes of weights placed on devices.
    pub fn device_weight_bytes(&self) -> u64 {
        self.devices.iter().map(DeviceLayers::weight_bytes).sum()
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
