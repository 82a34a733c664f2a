//! `--expert-split` / `--expert-ids`: the stats lines and `--json` fields of experts on workers (the engine decides
//! which experts the workers hold, loads the host without them and connects the workers:
//! [`backburner_engine::open`]).

use backburner_engine::experts::LinkExperts;

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
