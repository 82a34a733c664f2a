//! The pipelined layer-split call: the host computes ubatch after ubatch while each worker's sender and receiver
//! threads carry residuals to it and relay its replies to the next worker (or back to the host).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use backburner_link::frame::{bytes_f32, f32_bytes};
use backburner_link::message::RunLayers;
use backburner_link::LinkError;
use backburner_model::{Model, ModelState};

use super::{receive_stage, send_stage, u32_tokens, Hop, Pace};
use crate::chain::{compute_allowance, LayerSplit, StageError};
use crate::compute::ComputePool;

/// What each worker's threads need to know of it.
#[derive(Clone, Copy)]
struct StageInfo {
    pace: Pace,
    layers: usize,
    observed: Option<f64>,
    worker_threads: usize,
}

/// The first failure of a call: lowest worker first, a receiver's error (it carries the worker's `Error` frame)
/// before its sender's.
fn first_error(results: Vec<(usize, Result<(), LinkError>)>) -> Option<StageError> {
    results.into_iter().find_map(|(stage, r)| {
        r.err().map(|error| StageError {
            stage,
            error,
            connecting: false,
        })
    })
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
        let hidden = model.config().hidden_size;
        let l1 = self.host_end();
        let total: usize = chunks.iter().map(|c| c.len()).sum();
        let host_threads = pool.threads();
        let LayerSplit {
            stages,
            stats,
            keep,
            ..
        } = self;
        let infos: Vec<StageInfo> = stages
            .iter()
            .map(|s| StageInfo {
                pace: Pace {
                    timeout: s.link.settings.timeout,
                    min_rate: s.link.settings.min_rate,
                },
                layers: s.range.len(),
                observed: s.us_per_token_layer,
                worker_threads: s.link.worker_threads,
            })
            .collect();
        let n = infos.len();
        // the host's latest compute per token and layer (µs, f64 bits): the workers' allowance before they are known
        let host_us =
            AtomicU64::new(crate::chain::fallback_us_per_token_layer(model.config()).to_bits());
        let compute = |i: usize, t: usize| {
            let h = f64::from_bits(host_us.load(Ordering::Relaxed));
            let s = infos[i];
            compute_allowance(s.observed, h, host_threads, s.worker_threads, t, s.layers)
        };
        let worker_us: Vec<Mutex<(u64, u64)>> = (0..n).map(|_| Mutex::new((0, 0))).collect();
        let failed = AtomicBool::new(false);
        let (out_tx, out_rx) = mpsc::channel::<(RunLayers, Vec<u8>)>();
        let mut host_total = Duration::ZERO;
        let results = std::thread::scope(|sc| {
            let mut hops_tx: Vec<mpsc::Sender<Hop>> = Vec::with_capacity(n);
            let mut hops_rx: Vec<mpsc::Receiver<Hop>> = Vec::with_capacity(n);
            for _ in 0..n {
                let (tx, rx) = mpsc::channel::<Hop>();
                hops_tx.push(tx);
                hops_rx.push(rx);
            }
            let first_tx = hops_tx[0].clone();
            let mut handles = Vec::with_capacity(2 * n);
            let conns = stages
                .iter_mut()
                .map(|s| s.link.conn.as_mut().expect("connected"));
            for (i, (c, rx)) in conns.zip(hops_rx).enumerate() {
                let (w, r) = (&mut c.writer, &mut c.reader);
                let (sent_tx, sent_rx) = mpsc::channel();
                let pace = infos[i].pace;
                let failed = &failed;
                handles.push((
                    i,
                    sc.spawn(move || {
                        let res = send_stage(w, rx, sent_tx, pace);
                        if res.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                        res
                    }),
                ));
                let next_tx = hops_tx.get(i + 1).cloned();
                let out_tx = out_tx.clone();
                let (compute, wus) = (&compute, &worker_us[i]);
                handles.push((
                    i,
                    sc.spawn(move || {
                        let next = |msg: RunLayers, x: Vec<u8>| match &next_tx {
                            Some(tx) => {
                                let c = compute(i + 1, msg.n_tokens as usize);
                                tx.send((msg, x, c)).is_ok()
                            }
                            None => out_tx.send((msg, x)).is_ok(),
                        };
                        let res = receive_stage(r, sent_rx, &next, pace, hidden, wus);
                        if res.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                        res
                    }),
                ));
            }
            drop(hops_tx);
            drop(out_tx);
            let mut done = 0;
            for chunk in chunks {
                if failed.load(Ordering::Relaxed) {
                    break;
                }
                let t = chunk.len();
                let pos = state.n_tokens();
                let th = Instant::now();
                let (x, us) = Self::host_layers(model, state, chunk, pool, l1);
                host_total += th.elapsed();
                host_us.store(us.to_bits(), Ordering::Relaxed);
                let msg = RunLayers {
                    pos: pos as u64,
                    n_tokens: u32_tokens(t),
                    keep: super::super::rewind::keep_in(keep, pos, t),
                };
                let _ = first_tx.send((msg, f32_bytes(&x), compute(0, t)));
                done += t;
                progress(done, total);
            }
            drop(first_tx);
            // receivers first within a stage (they carry the worker's Error frame)
            let mut results: Vec<(usize, bool, Result<(), LinkError>)> = handles
                .into_iter()
                .enumerate()
                .map(|(k, (i, h))| (i, k % 2 == 0, h.join().expect("link thread")))
                .collect();
            results.sort_by_key(|(i, is_sender, _)| (*i, *is_sender));
            results
                .into_iter()
                .map(|(i, _, r)| (i, r))
                .collect::<Vec<_>>()
        });
        stats.host_us += host_total.as_micros() as u64;
        for (s, w) in stages.iter_mut().zip(&worker_us) {
            let (us, toks) = *w.lock().unwrap_or_else(|p| p.into_inner());
            stats.worker_us += us;
            if toks > 0 {
                s.us_per_token_layer = Some(us as f64 / (toks as usize * s.range.len()) as f64);
            }
        }
        if let Some(e) = first_error(results) {
            return Err(e);
        }
        let outs: Vec<(RunLayers, Vec<u8>)> = out_rx.try_iter().collect();
        if outs.len() != chunks.len() {
            return Err(StageError {
                stage: n - 1,
                connecting: false,
                error: LinkError::Malformed(format!(
                    "{} of {} ubatches came back",
                    outs.len(),
                    chunks.len()
                )),
            });
        }
        for (k, (msg, bytes)) in outs.into_iter().enumerate() {
            let x = bytes_f32(&bytes).map_err(|error| StageError {
                stage: n - 1,
                error,
                connecting: false,
            })?;
            out(k, x, msg.n_tokens as usize);
        }
        Ok(())
    }
}
