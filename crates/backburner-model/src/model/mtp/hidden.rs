//! The main model's final-normed hidden rows, the MTP block's input: a forward pass that returns them beside the
//! logits, and the norm alone for residual rows of any other path (a verify step).

use std::ops::Range;

use backburner_kernels::profile::{self, Op};
use backburner_kernels::rowops;

use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::state::ModelState;

impl Model {
    /// The final norm on residual rows `x` `[n_rows, H]` f32 (what the last layer leaves): the hidden rows the output
    /// head reads and the MTP block takes (`h_p`, `docs/MTP.md`), `[n_rows, H]` f32.
    ///
    /// Errors: [`ModelError::InvalidConfig`] if the final norm is not loaded on this node or `x` is not
    /// `[n_rows, H]`.
    pub fn final_hidden(&self, x: &[f32], n_rows: usize) -> Result<Vec<f32>> {
        let norm = self.final_norm.as_ref().ok_or_else(|| {
            ModelError::InvalidConfig("output head not loaded on this node".into())
        })?;
        if x.len() != n_rows * self.config.hidden_size {
            return Err(ModelError::InvalidConfig(format!(
                "final_hidden: {} values for {n_rows} rows of width {}",
                x.len(),
                self.config.hidden_size
            )));
        }
        let _s = profile::scope(Op::Head);
        let mut h = x.to_vec();
        rowops::rms_norm_inplace(&mut h, norm, self.config.rms_norm_eps as f32);
        Ok(h)
    }

    /// As [`Model::forward_tokens`] (same panics), also returning the final-normed hidden rows of every token:
    /// `(logits [rows, V], hidden [T, H])`, f32. The logits are bit-identical to `forward_tokens`'s (the head reads
    /// the same normed rows). For the MTP block: after a prefill, `hidden` and the tokens that follow each row are
    /// what [`Model::mtp_ingest`] takes.
    pub fn forward_tokens_hidden(
        &self,
        ids: &[u32],
        state: &mut ModelState,
        logit_rows: Option<Range<usize>>,
    ) -> (Vec<f32>, Vec<f32>) {
        let t = ids.len();
        let mut x = self
            .embed(ids)
            .expect("forward_tokens_hidden: the embedding is loaded and the ids were checked");
        self.forward_layers(0..self.config.num_hidden_layers, &mut x, t, state);
        self.commit_tokens(state, t);
        let hidden = self
            .final_hidden(&x, t)
            .expect("forward_tokens_hidden: the head is loaded");
        let logits = match logit_rows {
            Some(r) => {
                let h = self.config.hidden_size;
                self.head_logits(&hidden[r.start * h..r.end * h], r.len())
            }
            None => Vec::new(),
        };
        (logits, hidden)
    }
}
