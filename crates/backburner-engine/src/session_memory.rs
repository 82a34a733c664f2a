//! A session's memory report (kept apart from `session.rs`).

use crate::memory::MemoryReport;
use crate::session::Session;

impl Session {
    /// What this session holds, in bytes: the model's weights in host memory
    /// ([`backburner_model::Model::host_weight_bytes`]; shared by every session on the same model) and on devices,
    /// the KV pages held on this host, the Gated DeltaNet states and the forward pass's activation buffers as grown
    /// so far.
    pub fn memory(&self) -> MemoryReport {
        let st = &self.state;
        MemoryReport {
            weights: self.model.host_weight_bytes() as u64,
            device_weights: self.model.device_weight_bytes(),
            kv_pages: st.kv_bytes() as u64,
            recurrent_state: st.linear_bytes() as u64,
            scratch: st.scratch_bytes() as u64,
        }
    }
}
