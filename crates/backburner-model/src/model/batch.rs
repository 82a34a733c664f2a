//! Batched decode across sequences: one new token for each of N sequences (each with its own state and position)
//! as one pass of `[N, hidden]` rows. Decode on a CPU is bound by reading the weights, so every projection, the MLP
//! and the head run once on the stacked rows; only the mixers' per-sequence cores (`mixer.rs`) run per sequence,
//! on its own state and buffers. The matmul computes each output element with the same FMA chain for any number of
//! rows, and every other op is row-wise, so each sequence's logits and state equal those of
//! [`Model::forward_tokens`] on its token alone, bit for bit. Layers placed on a device (`place.rs`) run each
//! sequence's row alone: the same bits, without the batch's shared weight reads there (yet).

use backburner_kernels::profile::{self, Op};

use super::scratch::{sized, RowBufs};
use super::{Mixer, Model};
use crate::state::{LayerState, ModelState};

impl Model {
    /// One decode step for each of `N = ids.len()` sequences at once: `ids[i]` is the next token of the sequence
    /// of `states[i]`, at that state's own position. Runs every layer on the stacked `[N, hidden]` rows, advances
    /// each state by one position and returns the logits `[N, vocab]` f32 (row `i` for `states[i]`), bit-identical
    /// to `forward_tokens(&[ids[i]], states[i], Some(0..1))` on each sequence alone. Runs on the current rayon pool
    /// (the caller installs it). The first state's row buffers serve the batch; nothing allocates per step in the
    /// model once they (and each state's own buffers) have grown.
    ///
    /// Panics (a caller bug) if the batch is empty, `ids` and `states` differ in length, the model does not hold
    /// every layer and the ends, a state does not hold every layer of the model, a state has KV pages held
    /// elsewhere (`offloaded() > 0`: the batch is only for sequences whose pages are all local), or an id is out of
    /// range (check with [`Model::check_ids`] first).
    pub fn forward_decode_batch(&self, ids: &[u32], states: &mut [&mut ModelState]) -> Vec<f32> {
        self.check_batch(ids, states);
        let n = ids.len();
        let h = self.config.hidden_size;
        let mut rows = std::mem::take(&mut states[0].scratch_mut().rows);
        let mut x = std::mem::take(&mut rows.x);
        self.embed_into(ids, sized(&mut x, n * h))
            .expect("forward_decode_batch: the embedding is loaded and the ids were checked");
        let mut err = None;
        let mut idx = 0;
        while idx < self.layers.len() {
            if let Some(end) = self.placed_end(idx) {
                // layers on a device: each sequence's row through them alone (the same bits as its own pass)
                for (row, st) in x.chunks_exact_mut(h).zip(states.iter_mut()) {
                    let pos0 = st.n_tokens();
                    self.forward_on_device(idx..end, row, 1, pos0, st);
                }
                idx = end;
                continue;
            }
            let layer = self.layers[idx].as_ref().expect("layer not loaded");
            self.input_norm(layer, &x, &mut rows);
            self.batch_mixer(idx, &layer.mixer, states, &mut rows);
            self.layer_rest(idx, layer, &mut x, n, &mut rows, &mut err);
            idx += 1;
        }
        // a failure of experts held elsewhere spoils every row of the batch
        if let Some(e) = err {
            for st in states.iter_mut() {
                st.latch_remote_error(e.clone());
            }
        }
        for st in states.iter_mut() {
            self.commit_tokens(st, 1);
        }
        let logits = self
            .logits(&x, n)
            .expect("forward_decode_batch: the head is loaded");
        rows.x = x;
        states[0].scratch_mut().rows = rows;
        logits
    }

    /// The caller-bug checks of [`Model::forward_decode_batch`].
    fn check_batch(&self, ids: &[u32], states: &[&mut ModelState]) {
        assert!(!ids.is_empty(), "forward_decode_batch: empty batch");
        assert_eq!(
            ids.len(),
            states.len(),
            "forward_decode_batch: {} ids for {} states",
            ids.len(),
            states.len()
        );
        let all = 0..self.config.num_hidden_layers;
        assert!(
            self.range == all && self.holds_ends(),
            "forward_decode_batch: the model does not hold every layer and the ends"
        );
        for (i, st) in states.iter().enumerate() {
            assert_eq!(
                st.range(),
                all,
                "forward_decode_batch: state {i} does not hold the whole model's layers"
            );
            assert_eq!(
                st.offloaded(),
                0,
                "forward_decode_batch: state {i} has KV pages held elsewhere"
            );
        }
        if let Err(e) = self.check_ids(ids) {
            panic!("forward_decode_batch: {e}");
        }
    }

    /// A mixer on the batch: its input projection on the stacked normed rows `r.h` (`[N, H]`), each sequence's core
    /// on its row of the projection (its state, position and buffers), then the output projection on the stacked
    /// core outputs, into `r.out` (`[N, H]`).
    fn batch_mixer(
        &self,
        idx: usize,
        mixer: &Mixer,
        states: &mut [&mut ModelState],
        r: &mut RowBufs,
    ) {
        let n = states.len();
        let (proj_w, out_w) = match mixer {
            Mixer::Linear(w) => (&w.in_proj, &w.out_proj),
            Mixer::Attention(w) => (&w.qkv, &w.o_proj),
        };
        proj_w.forward_into(&r.h, n, &mut r.proj);
        let (pw, ow) = (proj_w.out_features(), out_w.in_features());
        let o = sized(&mut r.o, n * ow);
        for ((st, p), orow) in states
            .iter_mut()
            .zip(r.proj.chunks_exact(pw))
            .zip(o.chunks_exact_mut(ow))
        {
            let pos0 = st.n_tokens();
            let (ls, s, remote) = st.layer_and_scratch(idx);
            match (mixer, ls.expect("layer state held")) {
                (Mixer::Linear(w), LayerState::Linear(ls)) => {
                    self.gdn_core(w, p, 1, ls, &mut s.mix)
                }
                (Mixer::Attention(w), LayerState::Attention(c)) => {
                    let wait = self.attention_core(idx, w, p, 1, pos0, c, &mut s.mix, remote);
                    assert!(wait.is_none(), "batched decode with pages held elsewhere");
                }
                _ => panic!("layer kind and state kind differ"),
            }
            let _p = profile::scope(Op::Copy);
            orow.copy_from_slice(&s.mix.o);
        }
        out_w.forward_into(&r.o, n, &mut r.out);
    }
}
