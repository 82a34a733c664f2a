//! A sequence's state of the layers placed on devices (`crate::device`), beside the CPU path's: moving KV pages
//! out of whichever cache holds a layer (KV offload).

use super::{LayerState, ModelState};

impl ModelState {
    /// What a pass of layers placed on devices uses of the state, together: their states, the store of pages held
    /// elsewhere and the checkpoints requested.
    pub(crate) fn device_pass(
        &mut self,
    ) -> (
        &mut Vec<Option<crate::device::DeviceState>>,
        &mut crate::remote::RemoteSlot,
        &mut crate::model::Capture,
    ) {
        (
            &mut self.device,
            &mut self.remote,
            &mut self.scratch.capture,
        )
    }

    /// Copies of `src`'s device states for this state ([`ModelState::copy_from`]), or `None` when this state already
    /// holds device states of other layers or devices, or a copy fails (the device's memory).
    pub(super) fn device_copies(
        &self,
        src: &ModelState,
    ) -> Option<Vec<Option<crate::device::DeviceState>>> {
        let compatible = self.device.is_empty()
            || (self.device.len() == src.device.len()
                && self
                    .device
                    .iter()
                    .zip(&src.device)
                    .all(|(d, s)| match (d, s) {
                        (Some(d), Some(s)) => d.same_layers(s),
                        _ => true,
                    }));
        if !compatible {
            return None;
        }
        src.device
            .iter()
            .map(|d| d.as_ref().map(|d| d.duplicate()).transpose())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tracing::warn!("a fork could not copy the device's state: {e}"))
            .ok()
    }

    /// The device state holding layer `i`, if it is placed on a device and the sequence has run it.
    fn device_of(&self, i: usize) -> Option<&crate::device::DeviceState> {
        self.device
            .iter()
            .flatten()
            .find(|d| d.positions(i).is_some())
    }

    /// Full pages of attention layer `i`'s KV cache that may move elsewhere (KV offload), wherever the layer runs
    /// (on the CPU path or on a device); `None` for a layer without a cache here.
    pub fn movable_pages(&self, i: usize) -> Option<usize> {
        match self.device_of(i) {
            Some(d) => d.kv_movable_pages(i),
            None => match self.layers.get(i)?.as_ref()? {
                LayerState::Attention(c) => Some(c.movable_pages()),
                LayerState::Linear(_) => None,
            },
        }
    }

    /// Moves the `n` oldest pages of attention layer `i`'s KV cache out (to be held elsewhere), wherever the layer
    /// runs, in position order and the wire's page layout.
    ///
    /// Errors: a message if the layer has no cache here, fewer than `n` pages may move, or the device cannot move
    /// pages; nothing changes then.
    pub fn take_oldest_pages(
        &mut self,
        i: usize,
        n: usize,
    ) -> Result<Vec<backburner_kernels::kv::KvPage>, String> {
        if let Some(d) = self
            .device
            .iter_mut()
            .flatten()
            .find(|d| d.positions(i).is_some())
        {
            return match d.kv_take_oldest(i, n) {
                Some(r) => r.map_err(|e| e.to_string()),
                None => Err(format!("layer {i} has no KV cache")),
            };
        }
        match self.layers.get_mut(i).and_then(Option::as_mut) {
            Some(LayerState::Attention(c)) => c.take_oldest(n).map_err(|e| e.to_string()),
            _ => Err(format!("layer {i} has no KV cache here")),
        }
    }

    /// Calls `f` on each of the `n` oldest pages of attention layer `i`'s KV cache, in position order, wherever the
    /// layer runs (a device's are copied to the host first); nothing moves.
    ///
    /// Errors: a message if the layer has no cache here, fewer than `n` pages may move, or the device cannot copy
    /// them.
    pub fn for_oldest_pages(
        &self,
        i: usize,
        n: usize,
        f: &mut dyn FnMut(&backburner_kernels::kv::KvPage),
    ) -> Result<(), String> {
        if let Some(d) = self.device_of(i) {
            let pages = d
                .kv_copy_oldest(i, n)
                .ok_or_else(|| format!("layer {i} has no KV cache"))?
                .map_err(|e| e.to_string())?;
            pages.iter().for_each(f);
            return Ok(());
        }
        match self.layers.get(i).and_then(Option::as_ref) {
            Some(LayerState::Attention(c)) if n <= c.movable_pages() => {
                c.pages()[..n].iter().for_each(f);
                Ok(())
            }
            Some(LayerState::Attention(c)) => Err(format!(
                "layer {i}: {n} pages asked, {} may move",
                c.movable_pages()
            )),
            _ => Err(format!("layer {i} has no KV cache here")),
        }
    }

    /// Goes back to position `len` inside attention layer `i`'s pages held elsewhere (a page boundary at or below
    /// the positions held elsewhere: their holder keeps `[0, len)`), wherever the layer runs; nothing to do for a
    /// layer without a cache here.
    ///
    /// Errors: a message for a position that is not such a boundary or a device that cannot do it.
    pub fn truncate_offloaded_at(&mut self, i: usize, len: usize) -> Result<(), String> {
        if let Some(d) = self
            .device
            .iter_mut()
            .flatten()
            .find(|d| d.positions(i).is_some())
        {
            return match d.kv_truncate_offloaded(i, len) {
                Some(r) => r.map_err(|e| e.to_string()),
                None => Ok(()),
            };
        }
        match self.layers.get_mut(i).and_then(Option::as_mut) {
            Some(LayerState::Attention(c)) => c.truncate_offloaded(len).map_err(|e| e.to_string()),
            _ => Ok(()),
        }
    }
}
