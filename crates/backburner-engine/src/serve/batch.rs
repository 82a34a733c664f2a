//! Batched decode: the next token of several sessions in one forward pass, every projection run once on the stacked
//! rows (on CPU decode is bound by reading the weights, so N sequences cost little more than one).

use std::sync::Arc;

use backburner_kernels::profile::{self, Phase};
use backburner_model::{Model, ModelState};

use crate::error::Result;
use crate::session::Session;

/// Decodes `ids[i]` in `sessions[i]` for every i and returns each one's logits `[vocab]` f32 (or its error), bit for
/// bit what [`Session::decode`] returns for it alone.
///
/// Sessions whose whole state is on this host and that share one model run as one batch
/// ([`backburner_model::Model::forward_decode_batch`]); a session with KV pages on workers, a layer split or a pending
/// rebuild decodes alone through [`Session::decode`]. A session whose check fails (full context, id outside the
/// vocabulary) gets its error and the others go on.
///
/// Panics if the slices' lengths differ.
pub fn decode_batch(sessions: &mut [&mut Session], ids: &[u32]) -> Vec<Result<Vec<f32>>> {
    assert_eq!(
        sessions.len(),
        ids.len(),
        "decode_batch: one id per session"
    );
    let mut out: Vec<Option<Result<Vec<f32>>>> = (0..ids.len()).map(|_| None).collect();
    let mut batch: Vec<usize> = Vec::new();
    let mut model: Option<Arc<Model>> = None;
    for (i, (s, &id)) in sessions.iter_mut().zip(ids).enumerate() {
        let checked = s
            .check_fits(1)
            .and_then(|_| Ok(s.model().check_ids(&[id])?));
        if let Err(e) = checked {
            out[i] = Some(Err(e));
        } else if s.batchable() && model.as_ref().is_none_or(|m| Arc::ptr_eq(m, s.model())) {
            model.get_or_insert_with(|| s.model().clone());
            batch.push(i);
        } else {
            out[i] = Some(s.decode(id));
        }
    }
    if batch.len() == 1 {
        out[batch[0]] = Some(sessions[batch[0]].decode(ids[batch[0]]));
    } else if let Some(model) = model {
        let logits = forward_batch(&model, sessions, ids, &batch);
        for (&i, l) in batch.iter().zip(logits) {
            out[i] = Some(match l {
                Some(l) => Ok(l),
                // routed experts on a worker failed in the batch: this session's step is redone alone (its state
                // re-ingested, the worker retried once), or fails with its typed error
                None => sessions[i].decode(ids[i]),
            });
        }
    }
    out.into_iter()
        .map(|r| r.expect("every session decoded"))
        .collect()
}

/// The batched forward of the sessions at `batch` (increasing indices, checked, batchable, on `model`): one token
/// each, appended to their histories. `None` for a session whose step failed (routed experts held elsewhere were
/// unavailable): its state is dropped for a rebuild and its history is as before.
fn forward_batch(
    model: &Model,
    sessions: &mut [&mut Session],
    ids: &[u32],
    batch: &[usize],
) -> Vec<Option<Vec<f32>>> {
    profile::set_phase(Phase::Decode);
    let pool = sessions[batch[0]].opts.pool.clone();
    let bids: Vec<u32> = batch.iter().map(|&i| ids[i]).collect();
    let mut states: Vec<&mut ModelState> = sessions
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| batch.binary_search(i).is_ok())
        .map(|(_, s)| &mut s.state)
        .collect();
    let logits = pool.install(|| model.forward_decode_batch(&bids, &mut states));
    let vocab = model.config().vocab_size;
    let mut out = Vec::with_capacity(batch.len());
    for ((&i, &id), l) in batch.iter().zip(&bids).zip(logits.chunks_exact(vocab)) {
        let s = &mut sessions[i];
        if s.state.take_remote_error().is_some() {
            s.drop_state_for_rebuild();
            out.push(None);
            continue;
        }
        let grid = s.grid();
        s.history.push_call(&[id], grid);
        out.push(Some(l.to_vec()));
    }
    out
}
