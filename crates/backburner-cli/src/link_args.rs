//! The flags that place work on workers (`--worker`, repeatable; `--kv-budget`; split and timeout settings) and the
//! link lines of `run`'s stats and `--json`.

use std::path::PathBuf;

use anyhow::{bail, Result};
use backburner_engine::offload::KvBudget;
use backburner_engine::{Session, Timings, WorkerClient, WorkerSettings};
use clap::Args;

use crate::worker_cmd::{self, human_bytes};
use crate::Loaded;

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
    /// Checks `--split-layer` against the model. Errors: a message naming the valid split layers.
    fn check_split(&self, loaded: &Loaded) -> Result<()> {
        let Some(l) = self.split_layer else {
            return Ok(());
        };
        let cfg = loaded.model.config();
        let n = cfg.num_hidden_layers;
        let valid = backburner_engine::valid_split_layers(cfg)
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        // The host runs layers [0, L), the worker [L, n): both ranges must hold layers.
        if l == 0 {
            bail!("--split-layer 0 leaves the host no layers: the host runs layers [0, L) and the worker [L, {n}); valid: {valid}");
        }
        if l >= n {
            bail!("--split-layer {l} is the end of this {n}-layer model and leaves the worker no layers: the host runs layers [0, L) and the worker [L, {n}); valid: {valid}");
        }
        if !l.is_multiple_of(cfg.full_attention_interval) {
            bail!(
                "--split-layer {l} is not on a {}-layer cycle boundary of this {n}-layer model; valid: {valid}",
                cfg.full_attention_interval,
            );
        }
        Ok(())
    }

    /// The layers this host holds: `[0, L1)` with `--layer-split`, else every layer (`None`).
    pub fn host_layers(&self) -> Option<usize> {
        self.layer_split.first().copied()
    }

    /// The settings of each `--worker`, in order (secret, timeout, split settings). Errors: a worker given twice,
    /// an unreadable secret file.
    pub fn settings(&self, host_threads: usize) -> Result<Vec<WorkerSettings>> {
        let secret = worker_cmd::read_secret(self.secret_file.as_ref())?.unwrap_or_default();
        let mut out = Vec::new();
        // the same worker under two names (127.0.0.1:50060 and localhost:50060) counts as given twice
        let resolved: Vec<Vec<std::net::SocketAddr>> = self
            .worker
            .iter()
            .map(|a| {
                std::net::ToSocketAddrs::to_socket_addrs(a.as_str())
                    .map(|it| it.collect())
                    .unwrap_or_default()
            })
            .collect();
        for (i, addr) in self.worker.iter().enumerate() {
            let same = |j: usize| {
                self.worker[j] == *addr || resolved[j].iter().any(|x| resolved[i].contains(x))
            };
            if let Some(j) = (0..i).find(|&j| same(j)) {
                bail!(
                    "--worker {addr} is given twice (as {} before)",
                    self.worker[j]
                );
            }
            let mut st = WorkerSettings::new(addr.clone(), host_threads);
            st.split_layer = self.split_layer;
            st.split_min_tokens = self.split_min_tokens;
            st.secret = secret.clone();
            if st.secret.is_empty() && !worker_cmd::is_loopback(addr) {
                eprintln!(
                    "warning: --worker {addr} is not on this machine and no secret is set: any worker there is trusted and \
                     the link is readable by anyone on the path (set --secret-file or BACKBURNER_SECRET on both sides)"
                );
            }
            st.timeout = std::time::Duration::from_secs(self.worker_timeout.max(1));
            out.push(st);
        }
        Ok(out)
    }

    /// Whether `--worker`s can take this session's KV pages of `page_size` positions (split prefill mirrors them,
    /// KV offload holds them): a worker refuses a size that is not a multiple of 64 (its pages are whole 64-position
    /// blocks). `true` when there is no worker or with `--layer-split` (handled by its chain). Otherwise, with
    /// `--kv-budget` an error (the budget needs the workers); without, a warning and `false`: the prompt runs on
    /// this host alone instead of connecting, being refused and counting a fallback on every request.
    pub fn workers_take_pages(&self, page_size: usize) -> Result<bool> {
        if self.worker.is_empty() || !self.layer_split.is_empty() || page_size.is_multiple_of(64) {
            return Ok(true);
        }
        if self.kv_budget.is_some() {
            bail!(
                "--kv-page-size {page_size} must be a multiple of 64 for workers to hold KV pages (--kv-budget with \
                 --worker)"
            );
        }
        eprintln!(
            "warning: --kv-page-size {page_size} is not a multiple of 64, which workers require: the prompt runs on \
             this host alone (--worker is ignored)"
        );
        Ok(false)
    }

    /// A client per `--worker`, in order, for `loaded`'s model (none with `--layer-split`: see
    /// [`crate::chain_args::layer_split`]). Validates `--split-layer` first.
    pub fn clients(&self, loaded: &Loaded, host_threads: usize) -> Result<Vec<WorkerClient>> {
        if !self.layer_split.is_empty() || !self.expert_split.is_empty() {
            return Ok(Vec::new());
        }
        self.check_split(loaded)?;
        Ok(self
            .settings(host_threads)?
            .into_iter()
            .map(|st| {
                WorkerClient::new(
                    st,
                    backburner_engine::split::dir_fingerprint_with(
                        loaded.dir.clone(),
                        loaded.model.config().precision,
                    ),
                )
            })
            .collect())
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
