//! Going back to a checkpoint below the positions held by workers (KV offload): at a page boundary the workers keep
//! the pages before it and drop the rest, the host drops its own pages, and the linear states come from the
//! checkpoint, so the prompt cache resumes in place instead of re-ingesting the whole history.

use backburner_model::StateSnapshot;

use super::attention_layers;
use crate::session::Session;

impl Session {
    /// Restores `snap` (at position `n`, below the positions held by workers) in place when `n` is a page boundary:
    /// every worker holding pages at or past `n` drops them, the host's caches go back to `n`. True when done; false
    /// when `n` is not a page boundary or a worker failed (the caller then drops the state for a rebuild).
    pub(crate) fn rewind_into_offload(&mut self, snap: &StateSnapshot) -> bool {
        let n = snap.n_tokens();
        let ps = self.opts.kv.page_size;
        if !n.is_multiple_of(ps) || n > self.state.offloaded() {
            return false;
        }
        let holders: Vec<usize> = self
            .placement
            .runs()
            .iter()
            .filter(|r| r.end > n)
            .map(|r| r.worker)
            .collect();
        {
            let mut ws = self.lock_workers();
            for i in holders {
                let Some(w) = ws.get_mut(i) else {
                    return false;
                };
                if let Err(e) = w.pages_drop(n as u64) {
                    // found between requests (an eviction, a dropped link): the rebuild that follows may reconnect
                    // at once, as a request's retry does
                    w.fail_offload(&e);
                    w.link.retry_now();
                    return false;
                }
            }
        }
        self.placement.truncate(n);
        for l in attention_layers(self.model.config()) {
            if self.state.truncate_offloaded_at(l, n).is_err() {
                return false;
            }
        }
        self.state.go_back(snap.n_tokens(), &[snap]).is_ok()
    }
}
