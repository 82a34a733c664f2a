//! `bench layer-split`'s report: per configuration the medians over rounds, ratios vs local, the decode time per
//! side; the table and the `--json` object, with the original's figures beside them for reference.

use anyhow::Result;
use serde::Serialize;

use super::{LayerSplitArgs, Round, Setup};
use crate::{bench, ModelArgs};

/// What the original reported for its 27B model (laptop + phone over USB-C): shown beside ours for reference only.
pub(super) const ORIGINAL: &str =
    "original (its own report, 27B, laptop + phone over USB-C): prefill 64 tok/s, \
     decode 3.9 tok/s; per decode token host 87 ms + phone 135 ms + link 28 ms";

/// A configuration's medians.
#[derive(Serialize)]
pub(super) struct ConfigResult {
    /// `local`, `experts`, `layer_split`, `layer_split_shaped`, `chain`, `chain_shaped` or `experts_shaped`.
    config: String,
    /// Over the emulated link (else loopback).
    shaped: bool,
    /// Layers on the host, `[0, L1)`.
    host_layers: [usize; 2],
    /// Each worker's layers, in chain order (experts on a worker: the layers whose routed experts it holds).
    worker_layers: Vec<[usize; 2]>,
    /// Bytes of weights the host holds.
    host_weight_bytes: usize,
    /// Median prompt tokens per second (the prompt from an empty context, worker sessions opened in it).
    prefill_tok_s: f64,
    /// Median decode tokens per second (after the first token).
    decode_tok_s: f64,
    /// This configuration's prefill rate / local's (null with `--no-local`).
    prefill_vs_local: Option<f64>,
    /// This configuration's decode rate / local's (null with `--no-local`).
    decode_vs_local: Option<f64>,
    /// Per decode token, from the round with the median decode time: total, host, workers, link (ms).
    decode_ms_per_token: serde_json::Value,
    /// Bytes over the link per decode token, both ways, all workers (that same round).
    bytes_per_decode_token: f64,
    /// Every round's prefill and decode tok/s.
    samples: serde_json::Value,
}

/// The median (the upper one of an even count).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The round whose decode time is the median (its host/worker/link split is reported).
fn median_round(rounds: &[Round]) -> &Round {
    let mut idx: Vec<usize> = (0..rounds.len()).collect();
    idx.sort_by(|&a, &b| rounds[a].decode_ms.total_cmp(&rounds[b].decode_ms));
    &rounds[idx[idx.len() / 2]]
}

/// Each configuration's medians and its ratios vs local (if run), for an `n_layers`-layer model.
pub(super) fn summarize(setups: &[Setup], n_layers: usize) -> Vec<ConfigResult> {
    let col = |st: &Setup, f: fn(&Round) -> f64| st.rounds.iter().map(f).collect::<Vec<f64>>();
    let local = setups
        .iter()
        .find(|st| st.ranges.is_empty() && st.experts.is_none());
    let (lp, ld) = match local {
        Some(l) => (
            Some(median(&col(l, |r| r.prefill_tok_s))),
            Some(median(&col(l, |r| r.decode_tok_s))),
        ),
        None => (None, None),
    };
    setups
        .iter()
        .map(|st| {
            let (p, d) = (col(st, |r| r.prefill_tok_s), col(st, |r| r.decode_tok_s));
            let m = median_round(&st.rounds);
            ConfigResult {
                config: st.name.clone(),
                shaped: st.shaped,
                host_layers: match st.experts {
                    Some(_) => [0, n_layers],
                    None => [0, st.ranges.first().map_or(n_layers, |r| r.start)],
                },
                worker_layers: st.ranges.iter().map(|r| [r.start, r.end]).collect(),
                host_weight_bytes: st.host_weight_bytes,
                prefill_tok_s: median(&p),
                decode_tok_s: median(&d),
                prefill_vs_local: lp.map(|l| median(&p) / l),
                decode_vs_local: ld.map(|l| median(&d) / l),
                decode_ms_per_token: serde_json::json!({
                    "total": m.decode_ms, "host": m.host_ms, "workers": m.workers_ms, "link": m.link_ms,
                }),
                bytes_per_decode_token: m.bytes_per_decode_token,
                samples: serde_json::json!({"prefill_tok_s": p, "decode_tok_s": d}),
            }
        })
        .collect()
}

/// The human table (stdout).
pub(super) fn print_table(results: &[ConfigResult]) {
    println!(
        "{:<20} {:>6} {:<14} {:>9} {:>13} {:>8} {:>12} {:>8} {:>38} {:>10}",
        "configuration",
        "host",
        "workers",
        "host MB",
        "prefill tok/s",
        "vs local",
        "decode tok/s",
        "vs local",
        "decode ms/token = host + workers + link",
        "link B/tok"
    );
    for r in results {
        let workers = if r.worker_layers.is_empty() {
            "-".to_string()
        } else {
            r.worker_layers
                .iter()
                .map(|[a, b]| format!("{a}..{b}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let ms = &r.decode_ms_per_token;
        let f = |k: &str| ms[k].as_f64().unwrap_or(0.0);
        let ratio = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}x"));
        println!(
            "{:<20} {:>6} {:<14} {:>9.1} {:>13.1} {:>8} {:>12.2} {:>8} {:>38} {:>10.0}",
            r.config,
            format!("0..{}", r.host_layers[1]),
            workers,
            r.host_weight_bytes as f64 / 1e6,
            r.prefill_tok_s,
            ratio(r.prefill_vs_local),
            r.decode_tok_s,
            ratio(r.decode_vs_local),
            format!(
                "{:.2} = {:.2} + {:.2} + {:.2}",
                f("total"),
                f("host"),
                f("workers"),
                f("link")
            ),
            r.bytes_per_decode_token
        );
    }
    println!("{ORIGINAL}");
}

/// The `--json` object.
pub(super) fn report_json(
    a: &LayerSplitArgs,
    margs: &ModelArgs,
    loaded: &crate::Loaded,
    host_threads: usize,
    tokens: Vec<u32>,
    results: Vec<ConfigResult>,
) -> Result<serde_json::Value> {
    let cfg = loaded.model.config();
    let n = cfg.num_hidden_layers;
    Ok(serde_json::json!({
        "bench": "layer-split",
        "model": loaded.dir.display().to_string(),
        "config": {"num_hidden_layers": n, "hidden_size": cfg.hidden_size, "params": bench::param_count(cfg)},
        "host_threads": host_threads,
        "worker_threads": a.worker_threads,
        "ubatch": margs.ubatch,
        "kv_dtype": margs.kv_dtype.as_str(),
        "kv_page_size": margs.kv_page_size,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "rounds": a.rounds,
        "shaped_link": (!a.no_shaped).then(|| a.shaped.json()),
        "machine": bench::machine_description(),
        "tokens": tokens,
        "results": results,
        "original_reference": {
            "note": ORIGINAL,
            "prefill_tok_s": 64.0,
            "decode_tok_s": 3.9,
            "decode_ms_per_token": {"host": 87.0, "workers": 135.0, "link": 28.0},
        },
    }))
}
