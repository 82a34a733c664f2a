//! `--expert-split` / `--expert-ids`: which routed experts the workers hold, loading the host without them, and
//! attaching the workers as their holders.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use backburner_engine::connection::{Connection, SessionShape};
use backburner_engine::experts::{layer_ranges, ExpertHolder, LinkExperts};
use backburner_model::{ModelConfig, RemoteExperts};

use crate::link_args::LinkArgs;
use crate::{Loaded, ModelArgs};

/// The experts each worker holds, in `--worker` order: (layers, expert ids ascending).
pub type Away = [(Range<usize>, Vec<usize>)];

/// Whether expert `e` of layer `l` is held by a worker of `away`.
pub fn is_away(away: &Away, l: usize, e: usize) -> bool {
    away.iter()
        .any(|(r, ids)| r.contains(&l) && ids.binary_search(&e).is_ok())
}

/// Parses an id list such as `0-63,100` (ranges inclusive) for `n` experts. Errors: a malformed item or an id
/// `>= n`.
pub fn parse_ids(s: &str, n: usize) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (item, item),
        };
        let (a, b): (usize, usize) = (
            a.parse()
                .with_context(|| format!("--expert-ids: {item:?} is not an id or a range a-b"))?,
            b.parse()
                .with_context(|| format!("--expert-ids: {item:?} is not an id or a range a-b"))?,
        );
        if a > b || b >= n {
            bail!(
                "--expert-ids: {item:?} is not within 0-{} (this model has {n} experts per layer)",
                n - 1
            );
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        bail!("--expert-ids names no expert");
    }
    Ok(out)
}

/// The experts `--expert-split` puts on each worker (empty without it). Errors: a dense model, a count of split
/// points that differs from the workers', ranges that do not increase, bad ids.
pub fn away(link: &LinkArgs, cfg: &ModelConfig) -> Result<Vec<(Range<usize>, Vec<usize>)>> {
    if link.expert_split.is_empty() {
        return Ok(Vec::new());
    }
    let Some(moe) = cfg.moe.as_ref() else {
        bail!(
            "--expert-split needs a mixture-of-experts model; this one ({}) is dense",
            cfg.model_type
        );
    };
    if link.expert_split.len() != link.worker.len() {
        bail!(
            "--expert-split gives {} first layer(s) for {} --worker(s): one per worker",
            link.expert_split.len(),
            link.worker.len()
        );
    }
    let ranges =
        layer_ranges(&link.expert_split, cfg.num_hidden_layers).map_err(anyhow::Error::msg)?;
    let ids = match &link.expert_ids {
        Some(s) => parse_ids(s, moe.num_experts)?,
        None => (0..moe.num_experts).collect(),
    };
    Ok(ranges.into_iter().map(|r| (r, ids.clone())).collect())
}

/// Attaches the workers of `away` to `loaded`'s model as the holders of its missing experts and connects them, so
/// a refusal (another model, too little memory, a wrong secret) is reported before anything runs. Returns the
/// holders (`None` without `--expert-split`).
pub fn attach(
    link: &LinkArgs,
    loaded: &Loaded,
    away: &Away,
    margs: &ModelArgs,
    host_threads: usize,
) -> Result<Option<Arc<LinkExperts>>> {
    if away.is_empty() {
        return Ok(None);
    }
    let holders = link
        .settings(host_threads)?
        .into_iter()
        .zip(away)
        .map(|(st, (r, ids))| {
            let fp = backburner_engine::split::dir_fingerprint_with(
                loaded.dir.clone(),
                loaded.model.config().precision,
            );
            ExpertHolder::new(Connection::new(st, fp), r.clone(), ids.clone())
        })
        .collect();
    let shape = SessionShape {
        kv: margs.kv_dtype,
        page: margs.kv_page_size,
        ubatch: margs.ubatch,
    };
    let rx = Arc::new(LinkExperts::new(
        loaded.model.config().clone(),
        shape,
        holders,
    ));
    rx.connect_all().map_err(|e| {
        let hint = if e.0.contains("OutOfMemory") {
            " (raise that worker's --max-memory, put fewer layers' experts on it with --expert-split, or fewer \
             experts with --expert-ids; with --worker-memory, `run` plans around what each worker holds)"
        } else {
            ""
        };
        anyhow::anyhow!("cannot use the experts' workers: {e}{hint}")
    })?;
    let dynrx: Arc<dyn RemoteExperts> = rx.clone();
    if !loaded.model.attach_remote_experts(dynrx) {
        bail!("the model already has holders of its experts");
    }
    Ok(Some(rx))
}

/// The `"link"` object of `run --json` with experts on workers: per worker its address, the layers and expert ids it
/// holds, and the bytes each way.
pub fn link_json(rx: &LinkExperts) -> serde_json::Value {
    let workers: Vec<serde_json::Value> = rx
        .stats()
        .into_iter()
        .map(|(addr, layers, ids, st)| {
            serde_json::json!({
                "addr": addr,
                "layers": [layers.start, layers.end],
                "experts": ids.len(),
                "bytes_sent": st.bytes_sent,
                "bytes_received": st.bytes_received,
            })
        })
        .collect();
    serde_json::json!({"mode": "expert_split", "workers": workers})
}

/// `run`'s stats lines with experts on workers: one per worker.
pub fn link_lines(rx: &LinkExperts) -> Vec<String> {
    let h = backburner_engine::memory::human;
    rx.stats()
        .into_iter()
        .map(|(addr, layers, ids, st)| {
            format!(
                "experts on {addr}: {} routed experts of layers {}..{}; link {} sent, {} received",
                ids.len(),
                layers.start,
                layers.end,
                h(st.bytes_sent),
                h(st.bytes_received)
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_ids_parse() {
        assert_eq!(parse_ids("0-3,7, 5", 8).unwrap(), vec![0, 1, 2, 3, 5, 7]);
        assert_eq!(parse_ids("2", 8).unwrap(), vec![2]);
        for bad in ["8", "3-1", "a", "1-", "", ","] {
            assert!(parse_ids(bad, 8).is_err(), "{bad:?}");
        }
        let away = vec![(2..4, vec![1, 5])];
        assert!(is_away(&away, 3, 5) && !is_away(&away, 1, 5) && !is_away(&away, 3, 2));
    }
}
