//! The pipelined layer-split call on the pipelined driver ([`crate::pipeline`]): the host computes ubatch after
//! ubatch (embedding and layers `[0, L₁)`) while each worker's link carries residuals to it and relays its replies to
//! the next worker (or back to the host).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use backburner_link::frame::{bytes_f32, f32_bytes};
use backburner_link::message::{LayersDone, RunLayers};
use backburner_link::{FrameReader, LinkError};
use backburner_model::{Model, ModelState};

use super::{check_done, u32_tokens};
use crate::chain::{LayerSplit, Stage, StageError};
use crate::compute::ComputePool;
use crate::pipeline::{self, compute_allowance, Hop, HostStage, Link, LinkStage, Pace};

/// What each worker's threads need to know of it.
#[derive(Clone, Copy)]
struct StageInfo {
    layers: usize,
    observed: Option<f64>,
    worker_threads: usize,
}

/// The layer split's links: each reply carries the ubatch's residual on to the next worker.
struct ChainLinks {
    infos: Vec<StageInfo>,
    /// The host's latest compute per token and layer (µs, f64 bits): the workers' allowance before they are known.
    host_us: AtomicU64,
    host_threads: usize,
    hidden: usize,
}

impl ChainLinks {
    /// The compute worker `i` may take for `t` tokens.
    fn compute(&self, i: usize, t: usize) -> Duration {
        let h = f64::from_bits(self.host_us.load(Ordering::Relaxed));
        let s = self.infos[i];
        compute_allowance(
            s.observed,
            h,
            self.host_threads,
            s.worker_threads,
            t,
            s.layers,
        )
    }

    /// The links of `stages` for `model`, the host computing on `host_threads`.
    fn new(stages: &[Stage], model: &Model, host_threads: usize) -> Self {
        let cfg = model.config();
        ChainLinks {
            infos: stages
                .iter()
                .map(|s| StageInfo {
                    layers: s.range.len(),
                    observed: s.us_per_token_layer,
                    worker_threads: s.link.worker_threads,
                })
                .collect(),
            host_us: AtomicU64::new(crate::chain::fallback_us_per_token_layer(cfg).to_bits()),
            host_threads,
            hidden: cfg.hidden_size,
        }
    }
}

impl Stage {
    /// The worker's connection as a link of the pipelined driver.
    fn link(&mut self) -> Link<'_> {
        let pace = Pace::of(&self.link.settings);
        let c = self.link.conn.as_mut().expect("connected before the call");
        Link {
            writer: &mut c.writer,
            reader: &mut c.reader,
            pace,
        }
    }
}

impl LinkStage for ChainLinks {
    type Tail = ();

    fn reply_bytes(&self, _link: usize, tokens: usize) -> usize {
        tokens.saturating_mul(self.hidden).saturating_mul(4)
    }

    fn check(
        &self,
        _link: usize,
        req: &RunLayers,
        done: &LayersDone,
        back: &[u8],
    ) -> Result<(), LinkError> {
        let pos = usize::try_from(req.pos).map_err(|_| LinkError::Malformed("position".into()))?;
        check_done(done, back, pos, req.n_tokens as usize, self.hidden)
    }

    fn relay_compute(&self, link: usize, tokens: usize) -> Duration {
        self.compute(link, tokens)
    }

    fn receive_tail(
        &self,
        _link: usize,
        _r: &mut FrameReader,
        _pace: Pace,
        _last: Instant,
    ) -> Result<(), LinkError> {
        Ok(())
    }
}

/// The host's part of a layer split: the embedding and layers `[0, L₁)` of each ubatch, sent to the first worker.
struct ChainHost<'a> {
    model: &'a Model,
    state: &'a mut ModelState,
    chunks: &'a [&'a [u32]],
    pool: &'a ComputePool,
    l1: usize,
    /// Positions at which the workers keep checkpoints.
    keep: &'a [usize],
    links: &'a ChainLinks,
    /// The host's compute time in this call.
    total: Duration,
}

impl HostStage for ChainHost<'_> {
    fn step(&mut self, i: usize) -> Result<Option<Hop>, LinkError> {
        let chunk = self.chunks[i];
        let t = chunk.len();
        let pos = self.state.n_tokens();
        let th = Instant::now();
        let (x, us) =
            LayerSplit::host_layers(self.model, self.state, chunk, self.pool, (self.l1, false));
        self.total += th.elapsed();
        self.links.host_us.store(us.to_bits(), Ordering::Relaxed);
        let msg = RunLayers {
            pos: pos as u64,
            n_tokens: u32_tokens(t),
            keep: super::super::rewind::keep_in(self.keep, pos, t),
            verify: false,
        };
        Ok(Some(Hop {
            msg,
            bytes: f32_bytes(&x),
            compute: self.links.compute(0, t),
        }))
    }
}

impl LayerSplit {
    /// Runs ≥ 2 ubatches pipelined (see [`LayerSplit::run`]).
    pub(crate) fn run_pipelined(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        chunks: &[&[u32]],
        pool: &ComputePool,
        progress: &mut dyn FnMut(usize, usize),
        out: &mut dyn FnMut(usize, Vec<f32>, usize),
    ) -> Result<(), StageError> {
        let l1 = self.host_end();
        let LayerSplit {
            stages,
            stats,
            keep,
            ..
        } = self;
        let links = ChainLinks::new(stages, model, pool.threads());
        let mut host = ChainHost {
            model,
            state,
            chunks,
            pool,
            l1,
            keep,
            links: &links,
            total: Duration::ZERO,
        };
        let conns = stages.iter_mut().map(Stage::link).collect();
        let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let fail = |stage: usize, error| StageError {
            stage,
            error,
            connecting: false,
        };
        // (the host's steps never fail)
        let got =
            pipeline::drive(conns, &links, &mut host, &sizes, progress).map_err(|e| fail(0, e))?;
        stats.host_us += host.total.as_micros() as u64;
        for (s, acks) in stages.iter_mut().zip(&got.acks) {
            let us: u64 = acks.iter().map(|a| a.done.compute_us).sum();
            let toks: usize = acks.iter().map(|a| a.tokens).sum();
            stats.worker_us += us;
            if toks > 0 {
                s.us_per_token_layer = Some(us as f64 / (toks * s.range.len()) as f64);
            }
        }
        let n = stages.len();
        got.result.map_err(|f| fail(f.link, f.error))?;
        if got.out.len() != chunks.len() {
            let why = format!("{} of {} ubatches came back", got.out.len(), chunks.len());
            return Err(fail(n - 1, LinkError::Malformed(why)));
        }
        for (k, (msg, bytes)) in got.out.into_iter().enumerate() {
            let x = bytes_f32(&bytes).map_err(|e| fail(n - 1, e))?;
            out(k, x, msg.n_tokens as usize);
        }
        Ok(())
    }
}
