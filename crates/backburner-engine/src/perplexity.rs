//! Perplexity of a token sequence under the model.

use std::sync::Arc;

use backburner_model::Model;
use serde::Serialize;

use crate::error::{EngineError, Result};
use crate::session::{Logits, Session, SessionOptions};

/// Perplexity result.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Perplexity {
    /// `exp(nll)`.
    pub ppl: f64,
    /// Mean negative log-likelihood per predicted token (nats).
    pub nll: f64,
    /// Tokens in the text.
    pub n_tokens: usize,
    /// Tokens predicted (each window's tokens after its first).
    pub n_scored: usize,
    /// Window length used (tokens).
    pub ctx: usize,
}

/// −log softmax(row)[target], computed in f64 from f32 logits.
fn nll_of(row: &[f32], target: u32) -> f64 {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    lse - row[target as usize] as f64
}

/// Scores `ids` in non-overlapping windows of `ctx` tokens, each from a fresh state: within a window, token `i`
/// (i ≥ 1) is predicted from tokens `0..i` of that window; a last window shorter than 2 tokens is skipped. The log
/// softmax is computed in f64 from the f32 logits.
///
/// Errors: [`EngineError::InvalidSetting`] for ctx < 2 or fewer than 2 tokens; those of [`Session::prefill`].
pub fn perplexity(
    model: Arc<Model>,
    ids: &[u32],
    ctx: usize,
    opts: SessionOptions,
    progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    perplexity_windows(model, ids, ctx, false, opts, progress)
}

/// As [`perplexity`]; with `second_half`, in llama.cpp's convention (`llama-perplexity`): only whole windows, and in
/// each only the tokens of its second half are scored (token `i` for `i > ctx / 2`), each predicted from at least
/// half a window of context. Its figures are then comparable with llama-perplexity's `-c ctx` on the same tokens.
///
/// Errors: as [`perplexity`]; [`EngineError::InvalidSetting`] when `second_half` leaves no whole window.
pub fn perplexity_windows(
    model: Arc<Model>,
    ids: &[u32],
    ctx: usize,
    second_half: bool,
    opts: SessionOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    if ctx < 2 {
        return Err(EngineError::InvalidSetting("--ctx must be ≥ 2".into()));
    }
    if ids.len() < 2 {
        return Err(EngineError::InvalidSetting(
            "perplexity needs a text of at least 2 tokens".into(),
        ));
    }
    let vocab = model.config().vocab_size;
    let mut session = Session::new(model, opts)?;
    let mut nll_sum = 0.0f64;
    let mut n_scored = 0usize;
    let mut done = 0;
    // Each window is prefilled ubatch by ubatch and scored as it goes, so memory holds one ubatch of logits
    // ([ubatch, vocab] f32), never the window's.
    let ubatch = session.options().ubatch;
    if second_half && ids.len() < ctx {
        return Err(EngineError::InvalidSetting(format!(
            "the text is {} tokens, shorter than one window of {ctx}",
            ids.len()
        )));
    }
    // token i of a window is scored when i >= first
    let first = if second_half { ctx / 2 + 1 } else { 1 };
    for window in ids.chunks(ctx) {
        if window.len() < 2 || (second_half && window.len() < ctx) {
            continue;
        }
        session.clear();
        let mut prev_last: Option<Vec<f32>> = None;
        for (ci, chunk) in window.chunks(ubatch).enumerate() {
            let logits = session.prefill(chunk, Logits::All, |_, _| {})?;
            if logits.iter().any(|v| !v.is_finite()) {
                return Err(EngineError::NonFinite);
            }
            let at = ci * ubatch; // window index of chunk[0]
                                  // the row before this chunk's first token predicts it
            if let Some(row) = prev_last.take() {
                if at >= first {
                    nll_sum += nll_of(&row, chunk[0]);
                    n_scored += 1;
                }
            }
            for i in 1..chunk.len() {
                if at + i >= first {
                    nll_sum += nll_of(&logits[(i - 1) * vocab..i * vocab], chunk[i]);
                    n_scored += 1;
                }
            }
            prev_last = Some(logits[(chunk.len() - 1) * vocab..].to_vec());
        }
        done += window.len();
        progress(done, ids.len());
    }
    let nll = nll_sum / n_scored as f64;
    Ok(Perplexity {
        ppl: nll.exp(),
        nll,
        n_tokens: ids.len(),
        n_scored,
        ctx,
    })
}
