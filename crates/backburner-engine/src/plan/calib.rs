//! Calibration (measured speeds, a JSON file written by `backburner calibrate`) and what a plan is expected to do
//! with them: link bytes per token and tokens per second.

use serde::{Deserialize, Serialize};

use super::{Mode, Plan, PlanRequest};

/// Measured speeds of the devices and the link. Times are microseconds; `threads` is what the device ran with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Format version (1).
    pub version: u32,
    /// What was measured (model directory and shape), for the reader.
    #[serde(default)]
    pub model: String,
    /// Decoder layers of the model measured (0 = not recorded); a plan for another shape refuses the file.
    #[serde(default)]
    pub layers: usize,
    /// Hidden size of the model measured (0 = not recorded).
    #[serde(default)]
    pub hidden: usize,
    /// The host.
    pub host: DeviceTimes,
    /// One entry per worker in chain order (`backburner calibrate --worker`); a plan that uses a worker without an
    /// entry has no expected rates.
    #[serde(default)]
    pub workers: Vec<DeviceTimes>,
    /// The link to the workers (the slowest measured; `None` without workers).
    #[serde(default)]
    pub link: Option<LinkTimes>,
}

/// One device's speed, per decoder layer (the mean over the model's linear and attention layers, at a short
/// context) and for the ends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceTimes {
    /// Compute threads used.
    pub threads: usize,
    /// Prefill µs per token per layer (one ubatch of `prefill_tokens`).
    pub prefill_us_per_token_layer: f64,
    /// Decode µs per token per layer.
    pub decode_us_per_layer: f64,
    /// Embedding + final norm + head, µs per prompt token in prefill (the head runs on the last row only).
    #[serde(default)]
    pub ends_prefill_us_per_token: f64,
    /// Embedding + final norm + head, µs per decoded token.
    #[serde(default)]
    pub ends_decode_us: f64,
    /// Tokens of the prefill ubatch measured.
    #[serde(default)]
    pub prefill_tokens: usize,
}

/// The link's speed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkTimes {
    /// Round trip of a small request/reply, µs.
    pub round_trip_us: f64,
    /// Sustained bytes per second.
    pub bytes_per_s: f64,
}

/// Expected speed of a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    /// Prompt tokens per second in a long prefill (steady state).
    pub prefill_tok_s: f64,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
    /// Where a decode token's time goes.
    pub decode_ms: DecodeBreakdown,
}

/// Milliseconds per decoded token by where they are spent.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodeBreakdown {
    /// The host's layers and ends.
    pub host: f64,
    /// The workers' layers, summed (they run one after another).
    pub workers: f64,
    /// Round trips and transfers.
    pub link: f64,
}

const F32: u64 = 4;

/// Workers that hold something under `p` (layers or KV).
fn active(p: &Plan) -> usize {
    p.workers
        .iter()
        .filter(|w| !w.layers.is_empty() || w.kv_positions > 0)
        .count()
}

/// Link bytes per token of `p`: split prefill sends the residual (`hidden × 4`) one way and gets the tail layers'
/// KV rows back once per prompt token, nothing in decode; KV offload sends q and gets a partial back per attention
/// layer and worker holding pages (prefill also counts, at most, every position's KV moving once); layer split sends
/// the residual to and back from each worker in the chain, in prefill and decode alike.
pub(super) fn link_cost(req: &PlanRequest, p: &Plan) -> super::LinkCost {
    let c = &req.costs;
    let n = c.n_layers();
    let residual = (c.hidden as u64).saturating_mul(F32);
    let k = active(p) as u64;
    let (prefill, decode) = match p.mode {
        Mode::Local => (0, 0),
        Mode::SplitPrefill { split_layer } => {
            (residual.saturating_add(c.kv_bytes(split_layer..n, 1)), 0)
        }
        Mode::KvOffload { .. } => {
            let per = c
                .offload_bytes_per_token_layer
                .saturating_mul(c.attention_layers(0..n) as u64)
                .saturating_mul(k);
            (per.saturating_add(c.kv_bytes(0..n, 1)), per)
        }
        Mode::LayerSplit => {
            let b = residual.saturating_mul(2).saturating_mul(k);
            (b, b)
        }
        Mode::ExpertSplit => {
            // per MoE layer on a worker: the row out with its k routes, one vector back
            let k_routes = req.config.moe.as_ref().map_or(0, |m| m.num_experts_per_tok) as u64;
            let per = residual.saturating_mul(2).saturating_add(16 + 8 * k_routes);
            let layers: u64 = p
                .workers
                .iter()
                .filter(|w| w.weight_bytes > 0)
                .map(|w| {
                    (w.layers.clone())
                        .filter(|&i| c.layer_expert_bytes[i] > 0)
                        .count() as u64
                })
                .sum();
            let b = per.saturating_mul(layers);
            (b, b)
        }
    };
    super::LinkCost {
        prefill_bytes_per_token: prefill,
        decode_bytes_per_token: decode,
    }
}

/// Expected rates of `p` with `cal`, or `None` when a device `p` uses (or the link) has no numbers. Decode is the
/// sum of the stages (they run one after another) plus one round trip and the transfer per hop; pipelined prefill's
/// throughput is set by its slowest stage (the host's link counts as a stage). KV offload adds one round trip and
/// the q/partial transfer per attention layer to the local times (the host's own partial overlaps; not counted).
pub(super) fn expected(req: &PlanRequest, p: &Plan, cal: &Calibration) -> Option<Rates> {
    let h = &cal.host;
    let n = req.costs.n_layers() as f64;
    let host_layers = p.host.layers.len() as f64;
    let local_pf = n * h.prefill_us_per_token_layer + h.ends_prefill_us_per_token;
    let host_dec = host_layers * h.decode_us_per_layer + h.ends_decode_us;
    let ub = req.ubatch as f64;
    let (pf_us, dec) = match p.mode {
        Mode::Local => (local_pf, [host_dec, 0.0, 0.0]),
        Mode::SplitPrefill { split_layer } => {
            let (w, l) = (cal.workers.first()?, cal.link.as_ref()?);
            let tail = (n - split_layer as f64) * w.prefill_us_per_token_layer;
            let head =
                split_layer as f64 * h.prefill_us_per_token_layer + h.ends_prefill_us_per_token;
            let link = us(p.link.prefill_bytes_per_token, l) + l.round_trip_us / ub;
            (head.max(tail).max(link), [host_dec, 0.0, 0.0])
        }
        Mode::KvOffload { .. } => {
            let l = cal.link.as_ref()?;
            let attn = req.costs.attention_layers(0..req.costs.n_layers()) as f64;
            let dec_link = attn * l.round_trip_us + us(p.link.decode_bytes_per_token, l);
            let pf_link = attn * l.round_trip_us / ub + us(p.link.decode_bytes_per_token, l);
            (local_pf + pf_link, [host_dec, 0.0, dec_link])
        }
        Mode::LayerSplit => layer_split(p, h, cal, ub)?,
        Mode::ExpertSplit => {
            // the host's compute as local (the workers' experts overlap with it), plus a round trip per MoE layer
            // whose experts are away and the rows' transfer
            let l = cal.link.as_ref()?;
            let trips = p
                .workers
                .iter()
                .filter(|w| w.weight_bytes > 0)
                .map(|w| {
                    w.layers
                        .clone()
                        .filter(|&i| req.costs.layer_expert_bytes[i] > 0)
                        .count()
                })
                .sum::<usize>() as f64;
            let dec_link = trips * l.round_trip_us + us(p.link.decode_bytes_per_token, l);
            let pf_link = trips * l.round_trip_us / ub + us(p.link.prefill_bytes_per_token, l);
            (local_pf + pf_link, [host_dec, 0.0, dec_link])
        }
    };
    let dec_us: f64 = dec.iter().sum();
    (pf_us > 0.0 && dec_us > 0.0).then(|| Rates {
        prefill_tok_s: 1e6 / pf_us,
        decode_tok_s: 1e6 / dec_us,
        decode_ms: DecodeBreakdown {
            host: dec[0] / 1e3,
            workers: dec[1] / 1e3,
            link: dec[2] / 1e3,
        },
    })
}

/// Microseconds to move `bytes` over `l`.
fn us(bytes: u64, l: &LinkTimes) -> f64 {
    if l.bytes_per_s > 0.0 {
        bytes as f64 / l.bytes_per_s * 1e6
    } else {
        f64::INFINITY
    }
}

/// (prefill µs per token, [host, workers, link] decode µs) of a layer split.
fn layer_split(p: &Plan, h: &DeviceTimes, cal: &Calibration, ub: f64) -> Option<(f64, [f64; 3])> {
    let l = cal.link.as_ref()?;
    let host_pf =
        p.host.layers.len() as f64 * h.prefill_us_per_token_layer + h.ends_prefill_us_per_token;
    let host_dec = p.host.layers.len() as f64 * h.decode_us_per_layer + h.ends_decode_us;
    let (mut slowest, mut work_dec, mut hops) = (host_pf, 0.0, 0.0);
    for (i, w) in p
        .workers
        .iter()
        .enumerate()
        .filter(|(_, w)| !w.layers.is_empty())
    {
        let t = cal.workers.get(i)?;
        let layers = w.layers.len() as f64;
        slowest = slowest.max(layers * t.prefill_us_per_token_layer);
        work_dec += layers * t.decode_us_per_layer;
        hops += 1.0;
    }
    let bytes = p.link.decode_bytes_per_token;
    let link_pf = us(bytes, l) + hops * l.round_trip_us / ub;
    let link_dec = us(bytes, l) + hops * l.round_trip_us;
    Some((slowest.max(link_pf), [host_dec, work_dec, link_dec]))
}
