//! `backburner bench session`: the time to the first answer of each turn of a coding-agent session
//! (`assets/agent-session/transcript.json`), replayed over HTTP against a `serve` instance the bench starts in
//! this process, in three modes:
//!
//! - **cold**: alone, each measured turn from an empty slot (`"cache_prompt": false`): the whole request prefilled;
//! - **worker**: the same with a worker process (`backburner worker`, this binary, on loopback or through the
//!   emulated link) taking the tail layers of the prefill (split prefill);
//! - **warm**: alone, turn after turn with the prompt cache (`"cache_prompt": true`; turn 0 from an empty slot), so
//!   each turn prefills only what it adds to the previous one.
//!
//! Request `k` is the system prompt and the messages of turns `0..=k`, with the transcript's tools, streamed
//! (`"stream": true`), greedy, `--answer-tokens` long. The time to the first answer is measured by the client, from
//! sending the request to the first streamed reasoning, content or tool-call delta.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use backburner_engine::{Session, WorkerClient, WorkerSettings};
use backburner_link::Shaper;
use clap::Args;
use serde::Serialize;
use serde_json::{json, Value};

use crate::bench_session_http::{chat_stream, BenchServer, Reply};
use crate::{bench, compute_pool, LinkArgs, ModelArgs};

/// The shipped transcript (see `assets/agent-session/README.md`).
const TRANSCRIPT: &str = include_str!("../../../assets/agent-session/transcript.json");

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors, tokenizer.json with a chat template). Default: the bundled model (the real Qwen3.5 tokenizer and template, random weights)")))]
#[command(mut_arg("threads", |a| a.help("Compute threads of the server (default 1 here, as the worker's)")))]
pub struct SessionArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Transcript to replay (default: the shipped assets/agent-session/transcript.json, built in).
    #[arg(long, value_name = "FILE")]
    transcript: Option<PathBuf>,
    /// Replay only the first N turns (default: all).
    #[arg(long, value_name = "N")]
    turns: Option<usize>,
    /// Turns (0-based, comma-separated) measured cold, alone and with the worker (default: every turn). A cold
    /// turn prefills its whole request: about 27k tokens at the last turn of the shipped transcript.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    cold_turns: Option<Vec<usize>>,
    /// Modes to run, comma-separated: cold (alone, empty slot), worker (empty slot, split prefill with a worker
    /// process), warm (alone, prompt cache, every turn).
    #[arg(long, value_delimiter = ',', default_value = "cold,worker,warm")]
    modes: Vec<Mode>,
    /// Tokens generated per answer (greedy).
    #[arg(long, default_value_t = 8)]
    answer_tokens: usize,
    /// Threads of the worker process.
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    /// First worker layer (default: balanced by threads).
    #[arg(long)]
    split_layer: Option<usize>,
    /// Send the worker's traffic through the emulated link (--shaped-delay-us, --shaped-gbit) instead of plain
    /// loopback.
    #[arg(long)]
    shaped: bool,
    #[command(flatten)]
    shaped_link: bench::ShapedLinkArgs,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// A way of serving the turns.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Alone, each measured turn from an empty slot.
    Cold,
    /// From an empty slot, with a worker process for split prefill.
    Worker,
    /// Alone, with the prompt cache, turn after turn.
    Warm,
}

/// The parts of the transcript a replay needs.
struct Transcript {
    system: String,
    tools: Value,
    turns: Vec<Vec<Value>>,
}

impl Transcript {
    /// Reads `path` (default: the built-in transcript). Errors: unreadable, not JSON, or not the documented shape.
    fn load(path: Option<&std::path::Path>) -> Result<Transcript> {
        let text = match path {
            Some(p) => backburner_model::fsutil::read_text(p, 64 << 20)
                .with_context(|| format!("reading --transcript {}", p.display()))?,
            None => TRANSCRIPT.to_string(),
        };
        let v: Value = serde_json::from_str(&text).context("the transcript is not JSON")?;
        let system = v["system"]
            .as_str()
            .context("the transcript has no `system` string")?;
        let turns = v["turns"]
            .as_array()
            .context("the transcript has no `turns` array")?
            .iter()
            .map(|t| t["messages"].as_array().cloned())
            .collect::<Option<Vec<_>>>()
            .context("every turn needs a `messages` array")?;
        if turns.is_empty() {
            bail!("the transcript has no turns");
        }
        Ok(Transcript {
            system: system.to_string(),
            tools: v["tools"].clone(),
            turns,
        })
    }

    /// The chat request of turn `k`: the system prompt and turns `0..=k`, streamed, greedy.
    fn request(&self, model: &str, k: usize, max_tokens: usize, cache_prompt: bool) -> Value {
        let mut messages = vec![json!({"role": "system", "content": self.system})];
        for t in &self.turns[..=k] {
            messages.extend(t.iter().cloned());
        }
        let mut body = json!({
            "model": model,
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": 0,
            "cache_prompt": cache_prompt,
        });
        if !self.tools.is_null() {
            body["tools"] = self.tools.clone();
        }
        body
    }
}

/// One turn's measurements.
#[derive(Serialize)]
struct TurnRow {
    turn: usize,
    /// Messages the turn adds.
    messages: usize,
    prompt_tokens: usize,
    cold: Option<Reply>,
    worker: Option<Reply>,
    warm: Option<Reply>,
    /// Whether the warm answer's text equals the cold one's (greedy; null unless both ran).
    warm_matches_cold: Option<bool>,
    /// Whether the worker answer's text equals the cold one's (null unless both ran).
    worker_matches_cold: Option<bool>,
}

/// The session of the server's one slot, with a worker client (and the shaped link) when `worker` is given.
fn slot_session(
    a: &SessionArgs,
    loaded: &crate::Loaded,
    pool: &backburner_engine::ComputePool,
    worker: Option<(&str, Option<Shaper>)>,
) -> Result<Session> {
    let mut s = Session::new(loaded.model.clone(), a.model.session_options(pool))?;
    if let Some((addr, shaper)) = worker {
        let link = LinkArgs {
            worker: vec![addr.to_string()],
            kv_budget: None,
            no_interleave: false,
            split_layer: a.split_layer,
            layer_split: Vec::new(),
            worker_memory: Vec::new(),
            split_min_tokens: 512,
            secret_file: None,
            worker_timeout: 600,
        };
        let c = link.clients(loaded, pool.threads())?.remove(0);
        let mut st: WorkerSettings = c.settings().clone();
        st.shaper = shaper;
        s.attach_worker(WorkerClient::new(
            st,
            backburner_engine::split::dir_fingerprint(loaded.dir.clone()),
        ));
    }
    Ok(s)
}

/// Runs the benchmark.
pub fn run(a: SessionArgs) -> Result<()> {
    if a.answer_tokens == 0 || a.worker_threads == 0 {
        bail!("--answer-tokens and --worker-threads must be ≥ 1");
    }
    let mut tx = Transcript::load(a.transcript.as_deref())?;
    if let Some(t) = a.turns {
        if t == 0 {
            bail!("--turns must be ≥ 1");
        }
        tx.turns.truncate(t);
    }
    let n = tx.turns.len();
    let mut cold_turns = a.cold_turns.clone().unwrap_or_else(|| (0..n).collect());
    cold_turns.sort_unstable();
    cold_turns.dedup();
    if let Some(&k) = cold_turns.iter().find(|&&k| k >= n) {
        bail!("--cold-turns {k}: the transcript has turns 0..{}", n - 1);
    }
    let shaper = a.shaped.then(|| a.shaped_link.shaper()).transpose()?;
    let pool = compute_pool(Some(a.model.threads.unwrap_or(1)))?;
    let mut loaded = crate::load(&a.model, &pool)?;
    let tokenizer = Arc::new(loaded.tokenizer.take().context(
        "bench session needs a tokenizer with a chat template, and this checkpoint has no tokenizer.json",
    )?);
    let model_id = loaded
        .dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let cfg = loaded.model.config().clone();
    eprintln!(
        "bench session: model {} ({} layers, hidden {}), server {} thread(s), worker {} thread(s) ({}), ubatch {}, {} turns, cold turns {:?}, machine: {}",
        loaded.dir.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        pool.threads(),
        a.worker_threads,
        if a.shaped { "shaped link" } else { "loopback" },
        a.model.ubatch,
        n,
        cold_turns,
        bench::machine_description()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let replay = Replay {
        tx: &tx,
        client: reqwest::Client::new(),
        answer_tokens: a.answer_tokens,
    };
    let mut rows: Vec<TurnRow> = (0..n)
        .map(|k| TurnRow {
            turn: k,
            messages: tx.turns[k].len(),
            prompt_tokens: 0,
            cold: None,
            worker: None,
            warm: None,
            warm_matches_cold: None,
            worker_matches_cold: None,
        })
        .collect();
    let has = |m: Mode| a.modes.contains(&m);
    if has(Mode::Cold) || has(Mode::Warm) {
        let s = slot_session(&a, &loaded, &pool, None)?;
        let srv = rt.block_on(BenchServer::start(vec![s], tokenizer.clone(), &model_id))?;
        if has(Mode::Cold) {
            rt.block_on(replay.cold(&srv, &cold_turns, "cold", &mut rows, |r| &mut r.cold))?;
        }
        if has(Mode::Warm) {
            rt.block_on(replay.warm(&srv, &mut rows))?;
        }
        rt.block_on(srv.stop())?;
    }
    let mut worker_link = None;
    if has(Mode::Worker) {
        let (_w, addr) = crate::bench_split::spawn_worker(&loaded.dir, a.worker_threads, &[])?;
        let s = slot_session(&a, &loaded, &pool, Some((&addr, shaper)))?;
        let srv = rt.block_on(BenchServer::start(vec![s], tokenizer.clone(), &model_id))?;
        let run = replay.cold(&srv, &cold_turns, "worker", &mut rows, |r| &mut r.worker);
        rt.block_on(run)?;
        let st = srv.engine.metrics().link_stats();
        rt.block_on(srv.stop())?;
        if st.fallbacks > 0 || st.worker_tokens == 0 {
            bail!(
                "the worker did not take the prefill (tokens through it: {}, fallbacks: {})",
                st.worker_tokens,
                st.fallbacks
            );
        }
        worker_link = Some(json!({
            "worker_tokens": st.worker_tokens,
            "bytes_sent": st.bytes_sent,
            "bytes_received": st.bytes_received,
        }));
    }
    rows.retain(|r| r.cold.is_some() || r.worker.is_some() || r.warm.is_some());
    for r in &mut rows {
        let same = |x: &Option<Reply>| match (&r.cold, x) {
            (Some(c), Some(o)) => Some(c.text == o.text),
            _ => None,
        };
        r.warm_matches_cold = same(&r.warm);
        r.worker_matches_cold = same(&r.worker);
    }
    let totals = Totals::of(&rows, &cold_turns);
    println!("{}", table(&rows, &totals));
    if let Some(path) = &a.json {
        let report = json!({
            "bench": "session",
            "model": loaded.dir.display().to_string(),
            "config": {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "params": bench::param_count(&cfg)},
            "server_threads": pool.threads(),
            "worker_threads": a.worker_threads,
            "ubatch": a.model.ubatch,
            "answer_tokens": a.answer_tokens,
            "modes": a.modes.iter().map(|m| format!("{m:?}").to_lowercase()).collect::<Vec<_>>(),
            "cold_turns": cold_turns,
            "worker_link": if a.shaped { json!({"shaped": a.shaped_link.json()}) } else { json!("loopback") },
            "worker_stats": worker_link,
            "machine": bench::machine_description(),
            "turns": rows,
            "totals": totals,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

/// What every request of a replay shares.
struct Replay<'a> {
    tx: &'a Transcript,
    client: reqwest::Client,
    answer_tokens: usize,
}

impl Replay<'_> {
    /// Sends turn `k`'s request with `max_tokens` and `cache_prompt`.
    async fn ask(
        &self,
        srv: &BenchServer,
        k: usize,
        max_tokens: usize,
        cache: bool,
    ) -> Result<Reply> {
        let body = self.tx.request(&srv.model_id, k, max_tokens, cache);
        chat_stream(&self.client, &srv.url, &body)
            .await
            .with_context(|| format!("turn {k}"))
    }

    /// One untimed request (turn 0, one token, empty slot), so the first measured turn does not pay for first
    /// touches of the weights or the worker's connection.
    async fn warm_up(&self, srv: &BenchServer) -> Result<()> {
        self.ask(srv, 0, 1, false).await.map(|_| ())
    }

    /// Measures `turns` from an empty slot each, into `slot(row)`. Errors: a failed request, a cache hit.
    async fn cold(
        &self,
        srv: &BenchServer,
        turns: &[usize],
        name: &str,
        rows: &mut [TurnRow],
        slot: fn(&mut TurnRow) -> &mut Option<Reply>,
    ) -> Result<()> {
        self.warm_up(srv).await?;
        for &k in turns {
            let r = self.ask(srv, k, self.answer_tokens, false).await?;
            if r.cached_tokens != 0 {
                bail!(
                    "turn {k} reused {} cached tokens in a cold run",
                    r.cached_tokens
                );
            }
            progress(name, k, &r);
            rows[k].prompt_tokens = r.prompt_tokens;
            *slot(&mut rows[k]) = Some(r);
        }
        Ok(())
    }

    /// Measures every turn in order with the prompt cache (turn 0 from an empty slot).
    async fn warm(&self, srv: &BenchServer, rows: &mut [TurnRow]) -> Result<()> {
        self.warm_up(srv).await?;
        for (k, row) in rows.iter_mut().enumerate() {
            let r = self.ask(srv, k, self.answer_tokens, k > 0).await?;
            progress("warm", k, &r);
            row.prompt_tokens = r.prompt_tokens;
            row.warm = Some(r);
        }
        Ok(())
    }
}

/// A progress line on stderr.
fn progress(mode: &str, k: usize, r: &Reply) {
    eprintln!(
        "{mode:>6} turn {k:>2}: {:>6} prompt tokens ({:>6} cached): first answer {:>8.3} s, done {:>8.3} s",
        r.prompt_tokens, r.cached_tokens, r.first_answer_s, r.total_s
    );
}

/// Sums over the turns.
#[derive(Serialize)]
struct Totals {
    /// Turns measured cold.
    cold_turns: usize,
    /// Seconds to the first answer summed over the cold turns: alone, with the worker, and warm on the same turns.
    cold_s: Option<f64>,
    worker_s: Option<f64>,
    warm_same_turns_s: Option<f64>,
    /// Warm, over every turn: the whole session's waiting.
    warm_all_turns_s: Option<f64>,
    /// Prompt tokens reused from the cache over the warm turns, and prompt tokens in all.
    warm_cached_tokens: usize,
    warm_prompt_tokens: usize,
    /// cold_s / worker_s.
    worker_speedup: Option<f64>,
    /// cold_s / warm_same_turns_s.
    warm_speedup: Option<f64>,
}

impl Totals {
    fn of(rows: &[TurnRow], cold_turns: &[usize]) -> Totals {
        // Σ over the cold turns of one mode's first-answer time; None unless that mode measured every one of them.
        let sum = |mode: fn(&TurnRow) -> &Option<Reply>| -> Option<f64> {
            if cold_turns.is_empty() {
                return None;
            }
            cold_turns
                .iter()
                .map(|&k| {
                    let row = rows.iter().find(|r| r.turn == k)?;
                    mode(row).as_ref().map(|x| x.first_answer_s)
                })
                .sum()
        };
        let cold = sum(|r| &r.cold);
        let worker = sum(|r| &r.worker);
        let warm_same = sum(|r| &r.warm);
        let warm: Vec<&Reply> = rows.iter().filter_map(|r| r.warm.as_ref()).collect();
        let ratio = |x: Option<f64>, y: Option<f64>| Some(x? / y?);
        Totals {
            cold_turns: cold_turns.len(),
            cold_s: cold,
            worker_s: worker,
            warm_same_turns_s: warm_same,
            warm_all_turns_s: (!warm.is_empty())
                .then(|| warm.iter().map(|r| r.first_answer_s).sum()),
            warm_cached_tokens: warm.iter().map(|r| r.cached_tokens).sum(),
            warm_prompt_tokens: warm.iter().map(|r| r.prompt_tokens).sum(),
            worker_speedup: ratio(cold, worker),
            warm_speedup: ratio(cold, warm_same),
        }
    }
}

/// The per-turn table and the totals, as text.
fn table(rows: &[TurnRow], t: &Totals) -> String {
    let s = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
    let first = |r: &Option<Reply>| s(r.as_ref().map(|x| x.first_answer_s));
    let mut out = format!(
        "{:>4} {:>4} {:>8} | {:>12} {:>14} | {:>10} {:>8}\n",
        "turn", "msgs", "prompt", "cold alone s", "cold worker s", "warm s", "cached"
    );
    for r in rows {
        out += &format!(
            "{:>4} {:>4} {:>8} | {:>12} {:>14} | {:>10} {:>8}\n",
            r.turn,
            r.messages,
            r.prompt_tokens,
            first(&r.cold),
            first(&r.worker),
            first(&r.warm),
            r.warm
                .as_ref()
                .map_or("-".into(), |w| w.cached_tokens.to_string()),
        );
    }
    let x = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}x"));
    out += &format!(
        "total over the {} cold turn(s): cold alone {} s, cold with worker {} s ({}), warm {} s ({})\n",
        t.cold_turns,
        s(t.cold_s),
        s(t.worker_s),
        x(t.worker_speedup),
        s(t.warm_same_turns_s),
        x(t.warm_speedup),
    );
    out += &format!(
        "warm, whole session: {} s to first answers, {} of {} prompt tokens from the cache",
        s(t.warm_all_turns_s),
        t.warm_cached_tokens,
        t.warm_prompt_tokens
    );
    out
}
