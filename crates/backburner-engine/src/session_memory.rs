//! A session's memory report (kept apart from `session.rs`).

use crate::memory::MemoryReport;
use crate::session::Session;

impl Session {
    /// What this session holds, in bytes: the model's weights ([`backburner_model::Model::weight_bytes`]; shared
    /// by every session on the same model), the KV pages held on this host, the Gated DeltaNet states and the
    /// forward pass's activation buffers as grown so far.
    pub fn memory(&self) -> MemoryReport {
        let st = &self.state;
        MemoryReport {
            weights: self.model.weight_bytes() as u64,
            kv_pages: st.kv_bytes() as u64,
            recurrent_state: st.linear_bytes() as u64,
            scratch: st.scratch_bytes() as u64,
        }
    }
}
