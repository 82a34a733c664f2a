//! The flags that place work on workers (`--worker`, repeatable; `--kv-budget`; split and timeout settings) and the
//! link lines of `run`'s stats and `--json`.

use std::path::PathBuf;

use anyhow::Result;
use backburner_engine::offload::KvBudget;
use backburner_engine::open::{PlacementFlags, Workers};
use backburner_engine::{Session, Timings};
use clap::Args;

use crate::worker_cmd::{self, human_bytes};

fn parse_budget(s: &str) -> std::result::Result<KvBudget, String> {
    KvBudget::parse(s)
}

/// Options for using workers.
#[derive(Args, Clone)]
pub struct LinkArgs {
    /// Worker address (e.g. 127.0.0.1:50060; an IPv6 address in brackets). Repeatable: the first runs split
    /// prefill; with --kv-budget every worker may hold KV pages, the first ones the oldest.
    #[arg(long, value_name = "HOST:PORT", value_parser = worker_cmd::parse_worker_addr)]
    pub worker: Vec<String>,
    /// Most KV cache kept on this host: positions (e.g. 8192) or bytes with a unit (e.g. 512MiB). Past it the
    /// oldest whole pages of every full-attention layer move to the workers, with the same output. Default:
    /// unlimited.
    #[arg(long, value_name = "N|BYTES", value_parser = parse_budget)]
    pub kv_budget: Option<KvBudget>,
    /// With pages on workers, run each prefill ubatch as one piece instead of two interleaved halves (the host
    /// computing one half while the workers attend for the other); same output either way.
    #[arg(long)]
    pub no_interleave: bool,
    /// First layer the worker runs (a multiple of the model's 4-layer cycle); default balances the two sides' threads.
    #[arg(long, requires = "worker")]
    pub split_layer: Option<usize>,
    /// Layer split: the first layer each --worker holds, in --worker order (e.g. `--layer-split 4`, or
    /// `--layer-split 16,40` with two workers). This host loads and runs only the embedding, layers [0, L1), the
    /// final norm and the head; worker i holds the only copy of [Li, Li+1), the last one up to the model's end.
    /// Any layer boundary works; multiples of the layer cycle balance best. A lost worker fails the request (the
    /// session re-ingests its tokens on the next one).
    #[arg(long, value_delimiter = ',', value_name = "L1[,L2...]", requires = "worker",
          conflicts_with_all = ["split_layer", "kv_budget"])]
    pub layer_split: Vec<usize>,
    /// Experts on workers (mixture-of-experts models): the first layer whose routed experts each --worker holds, in
    /// --worker order (e.g. `--expert-split 20`, or `--expert-split 10,30` with two workers). This host loads every
    /// layer but leaves those experts out; per MoE layer and step it sends each worker the rows routed to its
    /// experts and adds the answers in the local order (the same output as a local run). A lost worker is
    /// reconnected once within the request; one that stays gone fails the request.
    #[arg(long, value_delimiter = ',', value_name = "L1[,L2...]", requires = "worker",
          conflicts_with_all = ["split_layer", "kv_budget", "layer_split"])]
    pub expert_split: Vec<usize>,
    /// With --expert-split: only these expert ids go to the workers (e.g. `0-63,100`), the others stay on this
    /// host. Default: every expert of those layers.
    #[arg(long, value_name = "IDS", requires = "expert_split")]
    pub expert_ids: Option<String>,
    /// Memory of each --worker for the planner (same units as --max-memory; repeatable, in --worker order). With a
    /// host memory limit (--max-memory or the operating system's) and no --layer-split, --kv-budget or
    /// --split-layer, `run` places the model by the same planner as `backburner plan`; a worker without this is
    /// assumed to hold what it is given (it refuses layers whose weights exceed its own --max-memory).
    #[arg(long, value_name = "BYTES", value_parser = backburner_engine::offload::parse_bytes, requires = "worker")]
    pub worker_memory: Vec<u64>,
    /// Smallest prompt (tokens) that goes through the worker.
    #[arg(long, default_value_t = 512, requires = "worker")]
    pub split_min_tokens: usize,
    /// File holding the shared secret (or set BACKBURNER_SECRET).
    #[arg(long, requires = "worker")]
    pub secret_file: Option<PathBuf>,
    /// Seconds to wait for a worker per request before falling back to local compute (split prefill, KV offload);
    /// in a layer split, where the host does not hold the worker's layers, the request fails instead.
    #[arg(long, default_value_t = 60, requires = "worker")]
    pub worker_timeout: u64,
}

impl LinkArgs {
    /// Whether the workers are asked to compute layers (split prefill at a given layer, a layer split, routed
    /// experts), not only to hold KV pages.
    pub fn splits_layers(&self) -> bool {
        self.split_layer.is_some() || !self.layer_split.is_empty() || !self.expert_split.is_empty()
    }

    /// The workers of these flags for the engine: addresses, `--worker-memory`, the secret (`--secret-file` or
    /// `BACKBURNER_SECRET`), `--worker-timeout`, `--split-min-tokens`. Errors: an unreadable secret file.
    pub fn workers(&self) -> Result<Workers> {
        Ok(Workers {
            addrs: self.worker.clone(),
            memory: self.worker_memory.clone(),
            secret: worker_cmd::read_secret(self.secret_file.as_ref())?.unwrap_or_default(),
            timeout: std::time::Duration::from_secs(self.worker_timeout),
            split_min_tokens: self.split_min_tokens,
        })
    }

    /// The placement these flags fix (none: the engine's planner decides where it can).
    pub fn placement(&self) -> PlacementFlags {
        PlacementFlags {
            split_layer: self.split_layer,
            layer_split: self.layer_split.clone(),
            expert_split: self.expert_split.clone(),
            expert_ids: self.expert_ids.clone(),
        }
    }
}

/// Decode time per token (ms; 0 without a decode rate).
fn decode_ms_per_token(tm: &Timings) -> f64 {
    if tm.decode_tok_s > 0.0 {
        1000.0 / tm.decode_tok_s
    } else {
        0.0
    }
}

/// The `"link"` object of `run --json`, if the session has workers.
pub fn link_json(s: &Session, tm: &Timings) -> Option<serde_json::Value> {
    if s.layer_split().is_some() {
        return crate::chain_args::link_json(s);
    }
    let n_workers = s.workers().len();
    if n_workers == 0 {
        return None;
    }
    let ls = s.link_stats();
    let runs = s.placement().runs().to_vec();
    let per_worker: Vec<usize> = (0..n_workers)
        .map(|w| {
            runs.iter()
                .filter(|r| r.worker == w)
                .map(|r| r.end - r.start)
                .sum()
        })
        .collect();
    let ms = decode_ms_per_token(tm);
    Some(serde_json::json!({
        "workers": n_workers,
        "worker_tokens": ls.worker_tokens,
        "bytes_sent": ls.bytes_sent,
        "bytes_received": ls.bytes_received,
        "fallbacks": ls.fallbacks,
        "pages_on_workers": ls.pages_on_workers,
        "positions_on_workers": ls.positions_on_workers,
        "positions_per_worker": per_worker,
        "pages_moved": ls.pages_moved,
        "bytes_per_decode_token": ls.bytes_per_decode_token(),
        "decode_ms_per_token": (ms > 0.0).then_some(ms),
        "offload_failures": ls.offload_failures,
    }))
}

/// The link lines of `run`'s stats (none without workers).
pub fn link_lines(s: &Session, tm: &Timings) -> Vec<String> {
    if s.layer_split().is_some() {
        return crate::chain_args::link_lines(s);
    }
    let n_workers = s.workers().len();
    if n_workers == 0 {
        return Vec::new();
    }
    let ls = s.link_stats();
    let mut out = vec![format!(
        "link: {} tokens through the worker | sent {} | received {} | fallbacks {}",
        ls.worker_tokens,
        human_bytes(ls.bytes_sent),
        human_bytes(ls.bytes_received),
        ls.fallbacks
    )];
    if ls.pages_moved > 0 || ls.offload_failures > 0 {
        let runs = s.placement().runs().to_vec();
        let holding = (0..n_workers)
            .filter(|w| runs.iter().any(|r| r.worker == *w))
            .count();
        let mut line = format!(
            "kv offload: {} positions ({} pages) on {holding} worker{}",
            ls.positions_on_workers,
            ls.pages_on_workers,
            if holding == 1 { "" } else { "s" },
        );
        if ls.offload_decode_tokens > 0 {
            line += &format!(
                " | {}/decode token",
                human_bytes(ls.bytes_per_decode_token())
            );
        }
        if tm.decode_tok_s > 0.0 {
            line += &format!(" | decode {:.1} ms/token", decode_ms_per_token(tm));
        }
        if ls.offload_failures > 0 {
            line += &format!(
                " | workers lost (state re-ingested) {}",
                ls.offload_failures
            );
        }
        out.push(line);
    }
    out
}
