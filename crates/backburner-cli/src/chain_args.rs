//! `--layer-split`: its stats line and `--json` fields (the engine builds the chain: [`backburner_engine::open`]).

use anyhow::Result;
use backburner_engine::chain::LayerSplit;
use backburner_engine::Session;

use crate::worker_cmd::human_bytes;

/// The worker layer ranges of `--layer-split L1,L2,…` for an `n`-layer model: `[L1, L2)`, …, `[Lk, n)`
/// ([`backburner_engine::open::layer_ranges`]). Errors: a count that differs from the workers', points out of order
/// or past the model.
pub fn ranges(points: &[usize], workers: usize, n: usize) -> Result<Vec<std::ops::Range<usize>>> {
    Ok(backburner_engine::open::layer_ranges(points, workers, n)?)
}

fn per_token_ms(us: u64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        us as f64 / n as f64 / 1000.0
    }
}

/// Where each layer range ran: `host 0..4, 127.0.0.1:50060 4..8`.
fn placement(c: &LayerSplit) -> String {
    let mut p = format!("host 0..{}", c.host_end());
    for st in c.stages() {
        let r = st.range();
        p += &format!(", {} {}..{}", st.addr(), r.start, r.end);
    }
    p
}

/// The `"link"` object of `run --json` for a layer split.
pub fn link_json(s: &Session) -> Option<serde_json::Value> {
    let c = s.layer_split()?;
    let ls = s.link_stats();
    let st = c.stats();
    let d = st.decode_calls;
    let link_us = st
        .decode_wall_us
        .saturating_sub(st.decode_host_us + st.decode_worker_us);
    let stages: Vec<serde_json::Value> = c
        .stages()
        .iter()
        .map(|w| serde_json::json!({"addr": w.addr(), "layers": [w.range().start, w.range().end]}))
        .collect();
    Some(serde_json::json!({
        "workers": c.stages().len(),
        "mode": "layer_split",
        "host_layers": [0, c.host_end()],
        "layer_split": stages,
        "worker_layers": ls.worker_layers,
        "worker_tokens": ls.worker_tokens,
        "bytes_sent": ls.bytes_sent,
        "bytes_received": ls.bytes_received,
        "failures": st.failures,
        "rebuilds": st.rebuilds,
        "retries": st.retries,
        "verify_calls": st.verify_calls,
        "decode_ms_per_token": {
            "host": per_token_ms(st.decode_host_us, d),
            "workers": per_token_ms(st.decode_worker_us, d),
            "link": per_token_ms(link_us, d),
        },
    }))
}

/// The link lines of `run`'s stats for a layer split: which layers ran where, bytes, and per decode token the
/// host's compute, the workers' and the rest (link and relay).
pub fn link_lines(s: &Session) -> Vec<String> {
    let Some(c) = s.layer_split() else {
        return Vec::new();
    };
    let ls = s.link_stats();
    let st = c.stats();
    let mut out = vec![format!(
        "layer split: {} | {} layer{} on workers | sent {} | received {}",
        placement(c),
        ls.worker_layers,
        if ls.worker_layers == 1 { "" } else { "s" },
        human_bytes(ls.bytes_sent),
        human_bytes(ls.bytes_received),
    )];
    if st.decode_calls > 0 {
        let d = st.decode_calls;
        let link_us = st
            .decode_wall_us
            .saturating_sub(st.decode_host_us + st.decode_worker_us);
        out.push(format!(
            "decode per token: host {:.2} ms + workers {:.2} ms + link {:.2} ms",
            per_token_ms(st.decode_host_us, d),
            per_token_ms(st.decode_worker_us, d),
            per_token_ms(link_us, d),
        ));
    }
    if st.failures > 0 || st.rebuilds > 0 {
        out.push(format!(
            "workers lost {} | state rebuilt {} | requests retried {}",
            st.failures, st.rebuilds, st.retries
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::ranges;

    #[test]
    fn split_points_become_contiguous_ranges() {
        assert_eq!(ranges(&[4], 1, 8).unwrap(), vec![4..8]);
        assert_eq!(ranges(&[0, 5], 2, 8).unwrap(), vec![0..5, 5..8]);
        for (p, w) in [
            (vec![4], 2),
            (vec![4, 4], 2),
            (vec![6, 4], 2),
            (vec![8], 1),
            (vec![9], 1),
        ] {
            assert!(ranges(&p, w, 8).is_err(), "{p:?} {w}");
        }
    }
}
