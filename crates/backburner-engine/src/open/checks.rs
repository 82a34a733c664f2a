//! The checks of a placement against the model that need no weights: split layers, layer split points, expert
//! splits and ids, the workers' addresses and page sizes.

use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;

use backburner_model::ModelConfig;

use super::{OpenError, OpenObserver, Workers};
use crate::split::WorkerSettings;

/// The experts each worker holds, in worker order: (layers, expert ids ascending).
pub type Away = Vec<(Range<usize>, Vec<usize>)>;

/// Checks a split-prefill layer against `cfg`: the host runs layers `[0, L)`, the worker `[L, n)`, so both must hold
/// layers and L must fall on a layer cycle boundary. `None` (balanced by threads) passes. Errors:
/// [`OpenError::SplitLayerZero`], [`OpenError::SplitLayerAtEnd`], [`OpenError::SplitLayerOffCycle`], each listing the
/// valid layers.
pub fn check_split_layer(cfg: &ModelConfig, layer: Option<usize>) -> Result<(), OpenError> {
    let Some(l) = layer else {
        return Ok(());
    };
    let n = cfg.num_hidden_layers;
    let valid = || {
        crate::valid_split_layers(cfg)
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if l == 0 {
        return Err(OpenError::SplitLayerZero { n, valid: valid() });
    }
    if l >= n {
        return Err(OpenError::SplitLayerAtEnd {
            layer: l,
            n,
            valid: valid(),
        });
    }
    if !l.is_multiple_of(cfg.full_attention_interval) {
        return Err(OpenError::SplitLayerOffCycle {
            layer: l,
            cycle: cfg.full_attention_interval,
            n,
            valid: valid(),
        });
    }
    Ok(())
}

/// The worker layer ranges of layer-split points `L1,L2,…` for an `n`-layer model: `[L1, L2)`, …, `[Lk, n)`.
/// Errors: [`OpenError::LayerSplitCount`] for a count that differs from `workers`, [`OpenError::LayerSplitEmpty`] for
/// points out of order or at or past the model's end.
pub fn layer_ranges(
    points: &[usize],
    workers: usize,
    n: usize,
) -> Result<Vec<Range<usize>>, OpenError> {
    if points.len() != workers {
        return Err(OpenError::LayerSplitCount {
            points: points.len(),
            workers,
        });
    }
    let mut out = Vec::with_capacity(points.len());
    for (i, &a) in points.iter().enumerate() {
        let b = points.get(i + 1).copied().unwrap_or(n);
        if a >= b {
            return Err(OpenError::LayerSplitEmpty {
                points: points
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                worker: i + 1,
                n,
            });
        }
        out.push(a..b);
    }
    Ok(out)
}

/// Whether every address `addr` resolves to is a loopback address (`false` when it does not resolve).
fn is_loopback(addr: &str) -> bool {
    addr.to_socket_addrs()
        .map(|mut a| a.all(|s| s.ip().is_loopback()))
        .unwrap_or(false)
}

/// The settings of each worker, in order, for a host of `host_threads` compute threads and split-prefill layer
/// `split_layer`. A worker off this machine without a secret is reported to `obs` (anyone on the path can read
/// the link). Errors: [`OpenError::WorkerTwice`] for a worker given twice, under the same name or two that resolve
/// to a common address.
pub fn worker_settings(
    w: &Workers,
    split_layer: Option<usize>,
    host_threads: usize,
    obs: &mut dyn OpenObserver,
) -> Result<Vec<WorkerSettings>, OpenError> {
    let resolved: Vec<Vec<SocketAddr>> = w
        .addrs
        .iter()
        .map(|a| {
            a.to_socket_addrs()
                .map(|it| it.collect())
                .unwrap_or_default()
        })
        .collect();
    let mut out = Vec::with_capacity(w.addrs.len());
    for (i, addr) in w.addrs.iter().enumerate() {
        let same =
            |j: usize| w.addrs[j] == *addr || resolved[j].iter().any(|x| resolved[i].contains(x));
        if let Some(j) = (0..i).find(|&j| same(j)) {
            return Err(OpenError::WorkerTwice {
                addr: addr.clone(),
                before: w.addrs[j].clone(),
            });
        }
        let mut st = WorkerSettings::new(addr.clone(), host_threads);
        st.split_layer = split_layer;
        st.split_min_tokens = w.split_min_tokens;
        st.secret = w.secret.clone();
        if st.secret.is_empty() && !is_loopback(addr) {
            obs.warning(&format!(
                "--worker {addr} is not on this machine and no secret is set: any worker there is trusted and the \
                 link is readable by anyone on the path (set --secret-file or BACKBURNER_SECRET on both sides)"
            ));
        }
        st.timeout = w.timeout.max(std::time::Duration::from_secs(1));
        out.push(st);
    }
    Ok(out)
}

/// Parses an expert id list such as `0-63,100` (ranges inclusive; items separated by commas) for a model of `n`
/// experts per layer, into ascending ids without repeats. Errors: [`OpenError::ExpertIdParse`] for an item that is
/// not an id or a range, [`OpenError::ExpertIdRange`] for a reversed range or an id `>= n`,
/// [`OpenError::NoExpertIds`] for a list without an id.
pub fn parse_expert_ids(s: &str, n: usize) -> Result<Vec<usize>, OpenError> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (item, item),
        };
        let num = |v: &str| {
            v.parse::<usize>().map_err(|e| OpenError::ExpertIdParse {
                item: item.to_string(),
                source: e,
            })
        };
        let (a, b) = (num(a)?, num(b)?);
        if a > b || b >= n {
            return Err(OpenError::ExpertIdRange {
                item: item.to_string(),
                n,
            });
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        return Err(OpenError::NoExpertIds);
    }
    Ok(out)
}

/// The experts an expert split puts on each worker (empty without one): worker i holds the routed experts `ids`
/// (default: all) of layers `[Li, Li+1)`. Errors: [`OpenError::NotMoe`] for a dense model,
/// [`OpenError::ExpertSplitCount`], [`OpenError::ExpertSplit`] for ranges that do not increase, and the errors of
/// [`parse_expert_ids`].
pub fn experts_away(
    starts: &[usize],
    ids: Option<&str>,
    workers: usize,
    cfg: &ModelConfig,
) -> Result<Away, OpenError> {
    if starts.is_empty() {
        return Ok(Vec::new());
    }
    let Some(moe) = cfg.moe.as_ref() else {
        return Err(OpenError::NotMoe {
            model_type: cfg.model_type.clone(),
        });
    };
    if starts.len() != workers {
        return Err(OpenError::ExpertSplitCount {
            given: starts.len(),
            workers,
        });
    }
    let ranges = crate::experts::layer_ranges(starts, cfg.num_hidden_layers)
        .map_err(OpenError::ExpertSplit)?;
    let ids = match ids {
        Some(s) => parse_expert_ids(s, moe.num_experts)?,
        None => (0..moe.num_experts).collect(),
    };
    Ok(ranges.into_iter().map(|r| (r, ids.clone())).collect())
}

/// Whether expert `e` of layer `l` is held by a worker of `away`.
pub fn is_away(away: &[(Range<usize>, Vec<usize>)], l: usize, e: usize) -> bool {
    away.iter()
        .any(|(r, ids)| r.contains(&l) && ids.binary_search(&e).is_ok())
}
