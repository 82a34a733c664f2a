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
use backburner_engine::{ComputePool, Session};
use backburner_link::Shaper;
use backburner_model::TextTokenizer;
use clap::Args;
use serde_json::{json, Value};

use crate::bench_session_http::{chat_stream, BenchServer, Reply};
use crate::bench_session_report::{progress, table, Totals, TurnRow};
use crate::{bench, compute_pool, ModelArgs};

/// The shipped transcript (see `assets/agent-session/README.md`).
const TRANSCRIPT: &str = include_str!("../../../assets/agent-session/transcript.json");

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors, tokenizer.json with a chat template) or GGUF file (with its tokenizer and chat template). Default: the bundled model (the real Qwen3.5 tokenizer and template, random weights)")))]
#[command(mut_arg("threads", |a| a.help("Compute threads of the server (default 1 here, as the worker's)")))]
pub struct SessionArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
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

/// The session of the server's one slot, with a worker client (and the shaped link) when `worker` is given.
fn slot_session(
    a: &SessionArgs,
    loaded: &crate::Loaded,
    pool: &ComputePool,
    worker: Option<(&str, Option<Shaper>)>,
) -> Result<Session> {
    let mut s = Session::new(loaded.model.clone(), a.model.session_options(pool))?;
    if let Some((addr, shaper)) = worker {
        s.attach_worker(crate::placement::bench_client(
            loaded,
            addr,
            a.split_layer,
            512,
            pool.threads(),
            shaper,
        )?);
    }
    Ok(s)
}

/// The transcript cut to `--turns`, and the sorted cold turns. Errors: bad flags, an unreadable transcript.
fn plan(a: &SessionArgs) -> Result<(Transcript, Vec<usize>)> {
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
    Ok((tx, cold_turns))
}

/// Runs the benchmark.
pub fn run(a: SessionArgs) -> Result<()> {
    let (tx, cold_turns) = plan(&a)?;
    let b = Bench::new(&a, &tx, cold_turns)?;
    let mut rows = TurnRow::for_turns(&tx.turns);
    let has = |m: Mode| a.modes.contains(&m);
    if has(Mode::Cold) || has(Mode::Warm) {
        b.alone(has(Mode::Cold), has(Mode::Warm), &mut rows)?;
    }
    let worker_stats = if has(Mode::Worker) {
        Some(b.with_worker(&mut rows)?)
    } else {
        None
    };
    rows.retain(TurnRow::measured);
    for r in &mut rows {
        r.compare();
    }
    let totals = Totals::of(&rows, &b.cold_turns);
    println!("{}", table(&rows, &totals));
    if let Some(path) = &a.json {
        let cfg = b.loaded.model.config();
        let report = json!({
            "bench": "session",
            "model": b.loaded.dir.display().to_string(),
            "config": {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "params": bench::param_count(cfg)},
            "server_threads": b.pool.threads(),
            "worker_threads": a.worker_threads,
            "ubatch": a.model.ubatch,
            "answer_tokens": a.answer_tokens,
            "modes": a.modes.iter().map(|m| format!("{m:?}").to_lowercase()).collect::<Vec<_>>(),
            "cold_turns": b.cold_turns,
            "worker_link": if a.shaped { json!({"shaped": a.shaped_link.json()}) } else { json!("loopback") },
            "worker_stats": worker_stats,
            "machine": bench::machine_description(),
            "turns": rows,
            "totals": totals,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

/// What the modes share: the model, the server's threads, the async runtime and the replay.
struct Bench<'a> {
    a: &'a SessionArgs,
    loaded: crate::Loaded,
    pool: ComputePool,
    tokenizer: Arc<TextTokenizer>,
    model_id: String,
    rt: tokio::runtime::Runtime,
    replay: Replay<'a>,
    cold_turns: Vec<usize>,
}

impl<'a> Bench<'a> {
    /// Loads the model (and its tokenizer) and starts the runtime. Errors: no tokenizer, and those of loading.
    fn new(a: &'a SessionArgs, tx: &'a Transcript, cold_turns: Vec<usize>) -> Result<Self> {
        let pool = compute_pool(Some(a.model.threads.unwrap_or(1)))?;
        let mut loaded = crate::load(&a.model, &pool)?;
        let tokenizer = Arc::new(loaded.tokenizer.take().context(
            "bench session needs a tokenizer with a chat template, and this checkpoint has no tokenizer.json",
        )?);
        let model_id = loaded
            .dir
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        let cfg = loaded.model.config();
        eprintln!(
            "bench session: model {} ({} layers, hidden {}), server {} thread(s), worker {} thread(s) ({}), ubatch {}, {} turns, cold turns {:?}, machine: {}",
            loaded.dir.display(),
            cfg.num_hidden_layers,
            cfg.hidden_size,
            pool.threads(),
            a.worker_threads,
            if a.shaped { "shaped link" } else { "loopback" },
            a.model.ubatch,
            tx.turns.len(),
            cold_turns,
            bench::machine_description()
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")?;
        let replay = Replay {
            tx,
            client: reqwest::Client::new(),
            answer_tokens: a.answer_tokens,
        };
        Ok(Bench {
            a,
            loaded,
            pool,
            tokenizer,
            model_id,
            rt,
            replay,
            cold_turns,
        })
    }

    /// Starts a server whose one slot is `session`.
    fn server(&self, session: Session) -> Result<BenchServer> {
        let t = self.tokenizer.clone();
        self.rt
            .block_on(BenchServer::start(vec![session], t, &self.model_id))
    }

    /// The cold turns (`cold`) and every turn warm (`warm`) on one server without a worker.
    fn alone(&self, cold: bool, warm: bool, rows: &mut [TurnRow]) -> Result<()> {
        let srv = self.server(slot_session(self.a, &self.loaded, &self.pool, None)?)?;
        let turns = &self.cold_turns;
        if cold {
            let run = self.replay.cold(&srv, turns, "cold", rows, |r| &mut r.cold);
            self.rt.block_on(run)?;
        }
        if warm {
            self.rt.block_on(self.replay.warm(&srv, rows))?;
        }
        self.rt.block_on(srv.stop())
    }

    /// The cold turns with a worker process taking the tail layers of each prefill; returns the link's
    /// statistics (the warm-up request included). Errors: a worker that took no tokens or failed.
    fn with_worker(&self, rows: &mut [TurnRow]) -> Result<Value> {
        let shaper = self
            .a
            .shaped
            .then(|| self.a.shaped_link.shaper())
            .transpose()?;
        let (_w, addr) = crate::bench_split::spawn_worker(
            &self.loaded.dir,
            self.a.worker_threads,
            self.loaded.model.config().precision,
            &[],
        )?;
        let s = slot_session(self.a, &self.loaded, &self.pool, Some((&addr, shaper)))?;
        let srv = self.server(s)?;
        let turns = &self.cold_turns;
        let run = self
            .replay
            .cold(&srv, turns, "worker", rows, |r| &mut r.worker);
        self.rt.block_on(run)?;
        let st = srv.engine.metrics().link_stats();
        self.rt.block_on(srv.stop())?;
        if st.fallbacks > 0 || st.worker_tokens == 0 {
            bail!(
                "the worker did not take the prefill (tokens through it: {}, fallbacks: {})",
                st.worker_tokens,
                st.fallbacks
            );
        }
        Ok(json!({
            "worker_tokens": st.worker_tokens,
            "bytes_sent": st.bytes_sent,
            "bytes_received": st.bytes_received,
        }))
    }
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
