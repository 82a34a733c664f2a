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
}
