//! `bench spec`'s session: local (every layer here), or over a layer split (`--layer-split L`: the host holds
//! `[0, L)` and the ends, one worker process `[L, n)`, over the emulated link unless `--loopback`).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::{ComputePool, Session, WorkerSettings};
use serde_json::json;

use super::SpecArgs;
use crate::bench_split::{spawn_worker, ChildWorker};
use crate::{Loaded, ModelArgs};

/// The session the bench runs on, the worker process it uses (kept alive with it) and the placement for the JSON
/// report. Errors: `--layer-split L` outside `1..n`, a worker that does not start, a host model that does not load.
pub(super) fn session(
    a: &SpecArgs,
    margs: &ModelArgs,
    loaded: &Loaded,
    pool: &ComputePool,
) -> Result<(Session, Option<ChildWorker>, serde_json::Value)> {
    let opts = margs.session_options(pool);
    let Some(l) = a.layer_split else {
        let s = Session::new(loaded.model.clone(), opts)?;
        return Ok((s, None, json!("local")));
    };
    let n = loaded.model.config().num_hidden_layers;
    if l == 0 || l >= n {
        bail!("--layer-split {l}: the host and the worker each need layers (1 ≤ L < {n})");
    }
    let precision = loaded.model.config().precision;
    let layers = format!("{l}..{n}");
    let (child, addr) = spawn_worker(
        &loaded.dir,
        a.worker_threads,
        precision,
        &["--layers", &layers],
    )
    .with_context(|| format!("start the worker for layers {layers}"))?;
    let host = crate::load_host(margs, pool, Some(l))?.model;
    let mut st = WorkerSettings::new(addr, pool.threads());
    st.timeout = Duration::from_secs(600);
    let link = match a.loopback {
        true => json!("loopback"),
        false => {
            st.shaper = Some(a.shaped.shaper()?);
            a.shaped.json()
        }
    };
    let fp = backburner_engine::split::dir_fingerprint_with(loaded.dir.clone(), precision);
    let parts = vec![(Connection::new(st, fp), l..n)];
    let chain = LayerSplit::from_parts(host.config(), parts)?;
    let s = Session::with_layer_split(host, opts, chain)?;
    eprintln!(
        "bench spec: layer split, host layers 0..{l}, worker {layers} ({} thread(s)), link {link}",
        a.worker_threads
    );
    let placement = json!({"layer_split": l, "worker_layers": layers, "worker_threads": a.worker_threads, "link": link});
    Ok((s, Some(child), placement))
}
