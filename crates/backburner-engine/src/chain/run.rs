//! One layer-split call: connecting the workers, then each ubatch through the host's layers and every worker's in
//! turn (pipelined across ubatches when there are several), with a deadline on every message.

use std::time::Instant;

use backburner_link::frame::{bytes_f32, f32_bytes, Kind};
use backburner_link::message::{LayersDone, RunLayers};
use backburner_link::LinkError;
use backburner_model::{Model, ModelConfig, ModelState};

use super::{LayerSplit, StageError};
use crate::compute::ComputePool;
use crate::connection::{why, SessionShape};
use crate::pipeline::compute_allowance;

fn u32_tokens(t: usize) -> u32 {
    u32::try_from(t).expect("the ubatch was checked to fit u32 when connecting")
}

/// Checks a worker's `LayersDone` for the ubatch at `pos` of `t` tokens and the size of its residual `x`.
fn check_done(
    d: &LayersDone,
    x: &[u8],
    pos: usize,
    t: usize,
    hidden: usize,
) -> Result<(), LinkError> {
    let want = (pos + t) as u64;
    if d.pos_after != want {
        return Err(LinkError::Malformed(format!(
            "worker acknowledged position {}, expected {want}",
            d.pos_after
        )));
    }
    let bytes = t.checked_mul(hidden).and_then(|v| v.checked_mul(4));
    if bytes != Some(x.len()) {
        return Err(LinkError::Malformed(format!(
            "worker returned a residual of {} bytes for {t} tokens of hidden {hidden}",
            x.len()
        )));
    }
    Ok(())
}

impl LayerSplit {
    /// Connects every worker that has no connection (a fresh session: its state starts at position 0).
    pub(crate) fn connect(
        &mut self,
        cfg: &ModelConfig,
        shape: SessionShape,
    ) -> Result<(), StageError> {
        for (i, s) in self.stages.iter_mut().enumerate() {
            if s.link.is_connected() {
                continue;
            }
            let range = s.range.clone();
            let fail = |error| StageError {
                stage: i,
                error,
                connecting: true,
            };
            let adopt = s.adopt_pinned;
            if !adopt {
                s.link.fingerprint(range.clone()).map_err(fail)?;
            }
            let mut chosen = range.clone();
            s.link
                .connect_with(cfg, shape, true, |ch| {
                    if shape.ubatch as u64 > u64::from(ch.limits.max_ubatch) {
                        return Err(LinkError::Refused(format!(
                            "the host's ubatch {} is above the worker's limit of {} tokens",
                            shape.ubatch, ch.limits.max_ubatch
                        )));
                    }
                    if let Some((a, b)) = ch.layers {
                        if adopt {
                            chosen = a as usize..b as usize;
                            return Ok(chosen.clone());
                        }
                        if (a as usize, b as usize) != (range.start, range.end) {
                            return Err(LinkError::Refused(format!(
                                "the worker serves layers {a}..{b} (--layers), this layer split needs {}..{}",
                                range.start, range.end
                            )));
                        }
                    }
                    Ok(range.clone())
                })
                .map_err(fail)?;
            s.range = chosen;
            s.pos = Some(0);
        }
        Ok(())
    }

    /// Runs the host's layers `[0, L₁)` of `chunk` (one ubatch at the state's position), returning the residual
    /// `[t, hidden]` and the host's compute time per token and layer (µs; a pessimistic estimate when L₁ = 0).
    fn host_layers(
        model: &Model,
        state: &mut ModelState,
        chunk: &[u32],
        pool: &ComputePool,
        (l1, verify): (usize, bool),
    ) -> (Vec<f32>, f64) {
        let t = chunk.len();
        let t0 = Instant::now();
        let x = pool.install(|| {
            let mut x = model
                .embed(chunk)
                .expect("the session checked the ids and holds the embedding");
            if verify {
                model
                    .forward_layers_verify(0..l1, &mut x, t, state)
                    .expect("the host holds its layers and the ids were checked");
            } else {
                model.forward_layers(0..l1, &mut x, t, state);
            }
            model.commit_tokens(state, t);
            x
        });
        let us = t0.elapsed().as_secs_f64() * 1e6;
        // with no layer of its own the host's time says nothing of a layer's: a pessimistic estimate instead
        let per = match l1 {
            0 => super::fallback_us_per_token_layer(model.config()),
            _ => us / (t * l1) as f64,
        };
        (x, per)
    }

    /// Runs `chunks` (consecutive ubatches from the state's position) through the host's layers and every worker,
    /// calling `out(index, residual, t)` with each ubatch's final residual `[t, hidden]` in order (on this
    /// thread). `progress(done, total)` counts tokens through the host's layers.
    ///
    /// Errors: the first worker's failure (transport, deadline, its typed `Error`, a reply that does not match).
    /// The host's and the workers' states are then partly advanced; the caller discards them.
    pub(crate) fn run(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        chunks: &[&[u32]],
        pool: &ComputePool,
        progress: &mut dyn FnMut(usize, usize),
        out: &mut dyn FnMut(usize, Vec<f32>, usize),
    ) -> Result<(), StageError> {
        let t0 = Instant::now();
        let host0 = self.stats.host_us;
        let worker0 = self.stats.worker_us;
        let tokens: usize = chunks.iter().map(|c| c.len()).sum();
        // the head (in `out`) is host compute too
        let mut head_us = 0u64;
        let mut timed = |k: usize, x: Vec<f32>, t: usize| {
            let th = Instant::now();
            out(k, x, t);
            head_us += th.elapsed().as_micros() as u64;
        };
        let r = if chunks.len() == 1 {
            self.run_one(model, state, chunks[0], pool, false)
                .map(|x| timed(0, x, chunks[0].len()))
        } else {
            self.run_pipelined(model, state, chunks, pool, progress, &mut timed)
        };
        self.stats.host_us += head_us;
        if r.is_ok() {
            self.call_done(t0, (host0, worker0), tokens, state.n_tokens());
            progress(tokens, tokens);
        }
        r
    }

    /// A verify step of speculative decoding: `ids` (`[T]`, T ≤ the ubatch) through the host's layers and every
    /// worker's as one ubatch whose rows have the bits of one-token steps, each side keeping what rolling back to any
    /// prefix needs ([`LayerSplit::kept_verified`] says how many positions the host kept). Returns the final
    /// residual `[T, hidden]`. Errors and state after them: as [`LayerSplit::run`].
    pub(crate) fn verify(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        ids: &[u32],
        pool: &ComputePool,
    ) -> Result<Vec<f32>, StageError> {
        let t0 = Instant::now();
        let (host0, worker0) = (self.stats.host_us, self.stats.worker_us);
        let x = self.run_one(model, state, ids, pool, true)?;
        self.stats.verify_calls += 1;
        self.call_done(t0, (host0, worker0), ids.len(), state.n_tokens());
        Ok(x)
    }

    /// The host kept the first positions of the verify step it ran, up to `pos`: the workers roll back there on
    /// their next request (it rides on it).
    pub(crate) fn kept_verified(&mut self, pos: usize) {
        for s in &mut self.stages {
            if s.pos.is_some() {
                s.pos = Some(pos);
            }
        }
    }

    /// Counts a call that succeeded (`tokens` tokens, started at `t0`, host and worker time counters then at
    /// `before`) and records every worker at the host's position `pos`.
    fn call_done(&mut self, t0: Instant, before: (u64, u64), tokens: usize, pos: usize) {
        let wall = t0.elapsed().as_micros() as u64;
        let st = &mut self.stats;
        st.calls += 1;
        st.tokens += tokens as u64;
        st.wall_us += wall;
        if tokens == 1 {
            st.decode_calls += 1;
            st.decode_wall_us += wall;
            st.decode_host_us += st.host_us - before.0;
            st.decode_worker_us += st.worker_us - before.1;
        }
        for s in &mut self.stages {
            s.pos = Some(pos);
            s.link.succeeded();
        }
    }

    /// One ubatch, worker after worker, on this thread (decode steps, short prompts, and verify steps when `verify`).
    fn run_one(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        chunk: &[u32],
        pool: &ComputePool,
        verify: bool,
    ) -> Result<Vec<f32>, StageError> {
        let t = chunk.len();
        let hidden = model.config().hidden_size;
        let pos = state.n_tokens();
        let l1 = self.host_end();
        let th = Instant::now();
        let (mut x, host_us) = Self::host_layers(model, state, chunk, pool, (l1, verify));
        self.stats.host_us += th.elapsed().as_micros() as u64;
        let host_threads = pool.threads();
        let keep = if verify {
            Vec::new()
        } else {
            self.keep_in(pos, t)
        };
        for (i, s) in self.stages.iter_mut().enumerate() {
            let fail = |error| StageError {
                stage: i,
                error,
                connecting: false,
            };
            let compute = compute_allowance(
                s.us_per_token_layer,
                host_us,
                host_threads,
                s.link.worker_threads,
                t,
                s.range.len(),
            );
            let bytes = f32_bytes(&x);
            let d = s.link.allowance(2 * bytes.len(), compute);
            let c = s.link.conn.as_mut().expect("connected before the call");
            c.set_deadline(Some(d));
            let msg = RunLayers {
                pos: pos as u64,
                n_tokens: u32_tokens(t),
                keep: keep.clone(),
                verify,
            };
            if let Err(e) = c.writer.send(Kind::RunLayers, &msg, &bytes) {
                return Err(fail(why(c, e)));
            }
            let (done, back): (LayersDone, _) = c
                .reader
                .expect(Kind::LayersDone, "LayersDone")
                .map_err(fail)?;
            check_done(&done, &back, pos, t, hidden).map_err(fail)?;
            x = bytes_f32(&back).map_err(fail)?;
            self.stats.worker_us += done.compute_us;
            s.us_per_token_layer = Some(done.compute_us as f64 / (t * s.range.len()) as f64);
        }
        Ok(x)
    }
}

mod pipeline;
