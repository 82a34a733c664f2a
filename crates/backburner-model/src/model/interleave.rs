//! Two sub-ubatches run interleaved (KV offload, docs/KV_OFFLOAD.md): while one waits for the partial attention of
//! the pages held elsewhere, the host runs the other's layer. Sub-ubatch B runs one layer behind A, so at each step
//! A is at layer k and B at layer k − 1; whichever of the two is at an attention layer with pages elsewhere sends
//! its request first, the other's layer runs, then the request is finished. Each layer sees A before B, so the
//! result is that of running A and then B as two ubatches, bit for bit.

use std::ops::Range;

use super::Model;
use crate::state::{LayerState, ModelState};

fn waits_for_remote(s: &LayerState) -> bool {
    matches!(s, LayerState::Attention(c) if c.offloaded() > 0)
}

impl Model {
    /// [`Model::forward_tokens`] of `ids` as two sub-ubatches `ids[..split]` and `ids[split..]` run interleaved:
    /// the same state changes and logits as two calls in turn (bit for bit), with the host's compute overlapping
    /// the workers' attention. `logit_rows` index `ids`.
    ///
    /// Panics as [`Model::forward_tokens`], and if `split` is not inside `1..ids.len()`.
    pub fn forward_tokens_interleaved(
        &self,
        ids: &[u32],
        split: usize,
        state: &mut ModelState,
        logit_rows: Option<Range<usize>>,
    ) -> Vec<f32> {
        self.check_cpu_only("the interleaved pass (KV offload)");
        assert!(
            split > 0 && split < ids.len(),
            "split {split} outside 1..{}",
            ids.len()
        );
        let (ta, tb) = (split, ids.len() - split);
        let embed = |x: &[u32]| {
            self.embed(x)
                .expect("the embedding is loaded and the ids were checked")
        };
        let (mut xa, mut xb) = (embed(&ids[..split]), embed(&ids[split..]));
        let pa = state.n_tokens();
        let pb = pa + ta;
        let n = self.config.num_hidden_layers;
        // step 0: A's first layer alone
        self.forward_layers_at(0..1, &mut xa, ta, pa, state);
        for k in 1..n {
            let (la, lb) = (self.layers[k].as_ref(), self.layers[k - 1].as_ref());
            let (la, lb) = (la.expect("layer loaded"), lb.expect("layer loaded"));
            let (sa, sb, scr_a, scr_b, remote) = state.two_layers(k);
            let (a_waits, b_waits) = (waits_for_remote(sa), waits_for_remote(sb));
            if b_waits && !a_waits {
                if let Some(w) = self.layer_begin(k - 1, lb, &mut xb, tb, pb, sb, scr_b, remote) {
                    self.forward_layer(k, la, &mut xa, ta, pa, sa, scr_a, remote);
                    self.layer_finish(k - 1, lb, &mut xb, tb, sb, scr_b, remote, w);
                } else {
                    self.forward_layer(k, la, &mut xa, ta, pa, sa, scr_a, remote);
                }
            } else if a_waits && !b_waits {
                if let Some(w) = self.layer_begin(k, la, &mut xa, ta, pa, sa, scr_a, remote) {
                    self.forward_layer(k - 1, lb, &mut xb, tb, pb, sb, scr_b, remote);
                    self.layer_finish(k, la, &mut xa, ta, sa, scr_a, remote, w);
                } else {
                    self.forward_layer(k - 1, lb, &mut xb, tb, pb, sb, scr_b, remote);
                }
            } else {
                // neither waits, or both would (adjacent attention layers): one after the other
                self.forward_layer(k, la, &mut xa, ta, pa, sa, scr_a, remote);
                self.forward_layer(k - 1, lb, &mut xb, tb, pb, sb, scr_b, remote);
            }
        }
        // the last step: B's last layer alone
        self.forward_layers_at(n - 1..n, &mut xb, tb, pb, state);
        self.commit_tokens(state, ids.len());
        let Some(r) = logit_rows else {
            return Vec::new();
        };
        let h = self.config.hidden_size;
        let mut x = xa;
        x.extend_from_slice(&xb);
        self.logits(&x[r.start * h..r.end * h], r.len())
            .expect("the head is loaded")
    }
}
