//! Measured speeds for the planner (`backburner calibrate`): per-layer prefill and decode times of a few layers on
//! the host or on a worker, and the link's round trip and bandwidth. Only a few layers are loaded on either side,
//! so a host that cannot hold the model can still be calibrated.

use std::ops::Range;
use std::time::{Duration, Instant};

use backburner_model::{KvOptions, Model, ModelState};
use serde::Serialize;

use super::{LayerSplit, Stage};
use crate::compute::ComputePool;
use crate::connection::{Connection, SessionShape};
use crate::error::{EngineError, Result};

/// Per-layer times of one device, averaged over the layers measured (µs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerTimes {
    /// Prefill µs per token per layer (one ubatch of `prefill_tokens`).
    pub prefill_us_per_token_layer: f64,
    /// Decode µs per token per layer.
    pub decode_us_per_layer: f64,
    /// Tokens of the measured prefill ubatch.
    pub prefill_tokens: usize,
}

/// A worker's per-layer times and its link.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerTimes {
    /// The worker's compute threads (from its `Welcome`).
    pub threads: usize,
    /// Its layers' times, from its own compute reports.
    pub layers: LayerTimes,
    /// Median round trip of a 16-byte `Ping` (µs).
    pub round_trip_us: f64,
    /// Bytes per second of a 4 MiB `Ping` and its `Pong` (both directions counted).
    pub bytes_per_s: f64,
}

fn ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919) % vocab.max(1)) as u32).collect()
}

/// Times layers `layers` of `model` (which must hold them) on the host: one prefill ubatch of `tokens` tokens,
/// then `decode` single-token steps, on `pool`. Errors: [`EngineError::InvalidSetting`] for no tokens, layers
/// the model does not hold, or KV options the model does not fit ([`KvOptions::check`]).
pub fn time_host_layers(
    model: &Model,
    layers: Range<usize>,
    tokens: usize,
    decode: usize,
    kv: KvOptions,
    pool: &ComputePool,
) -> Result<LayerTimes> {
    if tokens == 0
        || decode == 0
        || layers.is_empty()
        || !model.layer_range().contains(&layers.start)
        || layers.end > model.layer_range().end
    {
        return Err(EngineError::InvalidSetting(format!(
            "cannot time layers {layers:?} of a model holding {:?} with {tokens} tokens and {decode} steps",
            model.layer_range()
        )));
    }
    let cfg = model.config();
    kv.check(cfg).map_err(EngineError::InvalidSetting)?;
    let h = cfg.hidden_size;
    let mut state = ModelState::new(cfg, layers.clone(), kv);
    let k = layers.len() as f64;
    let mut x: Vec<f32> = (0..tokens * h)
        .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
        .collect();
    let t0 = Instant::now();
    pool.install(|| model.forward_layers(layers.clone(), &mut x, tokens, &mut state));
    let prefill = t0.elapsed().as_secs_f64() * 1e6 / (tokens as f64 * k);
    model.commit_tokens(&mut state, tokens);
    let t0 = Instant::now();
    for _ in 0..decode {
        let mut r = x[..h].to_vec();
        pool.install(|| model.forward_layers(layers.clone(), &mut r, 1, &mut state));
        model.commit_tokens(&mut state, 1);
    }
    let step = t0.elapsed().as_secs_f64() * 1e6 / (decode as f64 * k);
    Ok(LayerTimes {
        prefill_us_per_token_layer: prefill,
        decode_us_per_layer: step,
        prefill_tokens: tokens,
    })
}

/// Times layers `layers` (or the range the worker is pinned to with `--layers`) on the worker behind `link` as a
/// layer-split session (the worker loads only them): one
/// prefill ubatch of `tokens` tokens and `decode` single-token steps, from the worker's own compute reports; then
/// the link's round trip (median of 9 small pings) and bandwidth (a 4 MiB ping). `model` must hold the embedding
/// (its layers are not used).
///
/// Errors: [`EngineError::WorkerLost`] if the worker fails or refuses; [`EngineError::InvalidSetting`] for no
/// tokens or KV options the model does not fit ([`KvOptions::check`]).
pub fn time_worker(
    model: &Model,
    link: Connection,
    layers: Range<usize>,
    tokens: usize,
    decode: usize,
    kv: KvOptions,
    pool: &ComputePool,
) -> Result<WorkerTimes> {
    if tokens == 0 || decode == 0 || layers.is_empty() {
        return Err(EngineError::InvalidSetting("nothing to time".into()));
    }
    let cfg = model.config();
    kv.check(cfg).map_err(EngineError::InvalidSetting)?;
    // a chain that ends before the model does: only the workers' times are of use
    let mut stage = Stage::new(link, layers.clone());
    // a worker pinned to other layers (`--layers`) is timed on those
    stage.adopt_pinned = true;
    // the host runs no layer: only the embedding feeds the worker
    let mut chain = LayerSplit {
        stages: vec![stage],
        stats: Default::default(),
        host_end: 0,
        keep: Vec::new(),
    };
    let lost = |chain: &LayerSplit, e: super::StageError| {
        let (addr, layers) = (
            chain.stages[0].addr().to_string(),
            format!("{}..{}", layers.start, layers.end),
        );
        let reason = e.error.to_string();
        match e.connecting {
            true => EngineError::WorkerUnavailable {
                addr,
                layers,
                reason,
            },
            false => EngineError::WorkerLost {
                addr,
                layers,
                reason,
                kept: 0,
            },
        }
    };
    let shape = SessionShape {
        kv: kv.dtype,
        page: kv.page_size,
        ubatch: tokens,
    };
    chain.connect(cfg, shape).map_err(|e| lost(&chain, e))?;
    let layers = chain.stages[0].range();
    let mut state = ModelState::new(cfg, 0..0, kv);
    let p = ids(tokens, cfg.vocab_size);
    let k = layers.len() as f64;
    let none = &mut |_: usize, _: Vec<f32>, _: usize| {};
    chain
        .run(model, &mut state, &[&p], pool, &mut |_, _| {}, none)
        .map_err(|e| lost(&chain, e))?;
    let prefill = chain.stats.worker_us as f64 / (tokens as f64 * k);
    let before = chain.stats.worker_us;
    for i in 0..decode {
        let id = [p[i % p.len()]];
        chain
            .run(model, &mut state, &[&id], pool, &mut |_, _| {}, none)
            .map_err(|e| lost(&chain, e))?;
    }
    let step = (chain.stats.worker_us - before) as f64 / (decode as f64 * k);
    let link = &mut chain.stages[0].link;
    let mut rtts: Vec<Duration> = Vec::with_capacity(9);
    for _ in 0..9 {
        rtts.push(
            link.ping(&[0u8; 16])
                .map_err(|e| lost_link(&layers, link, e))?,
        );
    }
    rtts.sort();
    let rtt = rtts[4];
    let big = vec![0x5au8; 4 << 20];
    let t = link.ping(&big).map_err(|e| lost_link(&layers, link, e))?;
    let secs = t.saturating_sub(rtt).as_secs_f64().max(1e-6);
    Ok(WorkerTimes {
        threads: link.worker_threads,
        layers: LayerTimes {
            prefill_us_per_token_layer: prefill,
            decode_us_per_layer: step,
            prefill_tokens: tokens,
        },
        round_trip_us: rtt.as_secs_f64() * 1e6,
        bytes_per_s: 2.0 * big.len() as f64 / secs,
    })
}

fn lost_link(
    layers: &Range<usize>,
    link: &Connection,
    e: backburner_link::LinkError,
) -> EngineError {
    EngineError::WorkerLost {
        addr: link.settings().addr.clone(),
        layers: format!("{}..{}", layers.start, layers.end),
        reason: e.to_string(),
        kept: 0,
    }
}
