//! `backburner bench layer-split`: the whole model on the host vs a layer split with one worker process vs a chain
//! of two, each over loopback and over the emulated link, measured in one run: round by round every configuration
//! prefills the same prompt from an empty context and decodes the same greedy tokens; medians are reported with
//! ratios vs local.
//!
//! Each configuration keeps its own host model, loaded once (local: every layer; a layer split: the embedding,
//! layers `[0, L1)`, the final norm and the head; configurations with the same `L1` share one) and its own session,
//! cleared before each round. The workers are child processes (`backburner worker --layers A..B`, this binary,
//! loopback), started once, so host and workers really are separate processes (host 1 thread and worker 1 thread by
//! default, to fit two cores). Every configuration must give the local tokens and the local prompt logits bit for
//! bit in every round (checked; the bench fails otherwise).
//!
//! On a mixture-of-experts model, `--experts L` adds experts on a worker (docs/EXPERTS.md): the host holds every
//! layer but the routed experts of `[L, n)`, which one more worker process holds.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backburner_engine::chain::{ChainStats, LayerSplit};
use backburner_engine::connection::{Connection, SessionShape};
use backburner_engine::experts::{ExpertHolder, LinkExperts};
use backburner_engine::{argmax, ComputePool, Logits, Session, WorkerSettings};
use backburner_link::Shaper;
use backburner_model::{Model, RemoteExperts};
use clap::Args;

mod report;

use report::{print_table, report_json, summarize};

use crate::bench_split::{spawn_worker, ChildWorker};
use crate::{bench, chain_args, compute_pool, ModelArgs};

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors) or GGUF file. Default: the bundled bench model (random weights, generated once)")))]
#[command(mut_arg("threads", |a| a.help("Host compute threads (default 1 here)")))]
pub struct LayerSplitArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Prompt length (tokens) prefilled from an empty context in every round (a pseudo-random prompt).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Greedy tokens decoded after the prompt in every round.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Rounds over the configurations in turn (medians are reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// First worker layer of the one-worker configuration: the host holds [0, L), the worker [L, n).
    #[arg(long, default_value_t = 4, value_name = "L")]
    layer_split: usize,
    /// First layer of each worker of the chain configuration (two or more, increasing).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4,6",
        value_name = "L1,L2[,...]"
    )]
    chain: Vec<usize>,
    /// Threads of each worker process (the host uses --threads, default 1 here).
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    #[command(flatten)]
    shaped: bench::ShapedLinkArgs,
    /// Skip the shaped-link configurations.
    #[arg(long)]
    no_shaped: bool,
    /// Skip the chain configurations (a model of fewer than three layers has no chain).
    #[arg(long)]
    no_chain: bool,
    /// Mixture-of-experts models: also run experts on a worker, the routed experts of layers [L, n) on one more
    /// worker process and every layer on the host (over loopback, and over the emulated link unless --no-shaped).
    #[arg(long, value_name = "L")]
    experts: Option<usize>,
    /// Skip the whole-model-on-host configuration: the host loads only its own layers (and the ends), so
    /// `--max-memory` may be smaller than the model (zero to one). The configurations are then checked bit for bit
    /// against the first one instead of against local.
    #[arg(long)]
    no_local: bool,
    /// `--max-memory` of each worker process (default: none but the OS's limits).
    #[arg(long, value_name = "BYTES")]
    worker_max_memory: Option<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One round's measurements of one configuration.
#[derive(Clone, Debug, Default)]
struct Round {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    /// Wall time per decode step, ms.
    decode_ms: f64,
    /// Host compute per decode step (embedding, its layers, final norm, head), ms; the whole step when local.
    host_ms: f64,
    /// The workers' own reported compute per decode step, summed over workers, ms.
    workers_ms: f64,
    /// Link and relay per decode step: the chain's wall time less host and worker compute, ms.
    link_ms: f64,
    /// Bytes over the link per decode step, both ways, all workers.
    bytes_per_decode_token: f64,
}

/// A configuration: its name, where its layers live, its session and its rounds so far.
struct Setup {
    name: String,
    shaped: bool,
    /// Worker layer ranges in chain order (none: local).
    ranges: Vec<Range<usize>>,
    host_weight_bytes: usize,
    session: Session,
    rounds: Vec<Round>,
    /// Experts on a worker: the host holds every layer; `ranges` names the layers whose experts are away.
    experts: Option<Arc<LinkExperts>>,
}

/// The worker processes, one per distinct layer range, with their addresses.
struct Workers {
    _procs: Vec<ChildWorker>,
    by_range: Vec<(Range<usize>, String)>,
}

impl Workers {
    /// The address of the worker holding `r`.
    fn addr(&self, r: &Range<usize>) -> &str {
        &self
            .by_range
            .iter()
            .find(|(x, _)| x == r)
            .expect("a worker per range")
            .1
    }
}

/// Starts one `backburner worker --layers A..B` per distinct range of `sets`.
fn start_workers(
    dir: &std::path::Path,
    threads: usize,
    precision: backburner_model::Precision,
    max_memory: Option<&str>,
    sets: &[&[Range<usize>]],
) -> Result<Workers> {
    let mut w = Workers {
        _procs: Vec::new(),
        by_range: Vec::new(),
    };
    for r in sets.iter().flat_map(|s| s.iter()) {
        if w.by_range.iter().any(|(x, _)| x == r) {
            continue;
        }
        let layers = format!("{}..{}", r.start, r.end);
        let mut extra = vec!["--layers", &layers];
        if let Some(m) = max_memory {
            extra.extend(["--max-memory", m]);
        }
        let (p, addr) = spawn_worker(dir, threads, precision, &extra)
            .with_context(|| format!("start the worker for layers {layers}"))?;
        w._procs.push(p);
        w.by_range.push((r.clone(), addr));
    }
    Ok(w)
}

/// Everything the configurations are built from.
struct Ctx<'a> {
    margs: &'a ModelArgs,
    pool: &'a ComputePool,
    dir: &'a std::path::Path,
    workers: &'a Workers,
    shaper: Shaper,
    /// The model's decoder layers.
    n_layers: usize,
    /// Host models by the layers they hold (`[0, held)`), each loaded once.
    hosts: Vec<(usize, Arc<Model>)>,
}

impl Ctx<'_> {
    /// The host model holding `[0, held)` and the ends, loaded on first use.
    fn host(&mut self, held: usize) -> Result<Arc<Model>> {
        if let Some((_, m)) = self.hosts.iter().find(|(h, _)| *h == held) {
            return Ok(m.clone());
        }
        let m = crate::load_host(self.margs, self.pool, Some(held))?.model;
        self.hosts.push((held, m.clone()));
        Ok(m)
    }

    /// A configuration whose workers hold `ranges` (none: local), over the shaped link or loopback.
    fn setup(&mut self, name: &str, ranges: &[Range<usize>], shaped: bool) -> Result<Setup> {
        let n = self.n_layers;
        let held = ranges.first().map_or(n, |r| r.start);
        let model = self.host(held)?;
        let opts = self.margs.session_options(self.pool);
        let session = if ranges.is_empty() {
            Session::new(model.clone(), opts)?
        } else {
            let parts = ranges
                .iter()
                .map(|r| {
                    let mut st = WorkerSettings::new(self.workers.addr(r), self.pool.threads());
                    st.timeout = Duration::from_secs(600);
                    st.shaper = shaped.then_some(self.shaper);
                    let fp = backburner_engine::split::dir_fingerprint_with(
                        self.dir.to_path_buf(),
                        self.margs.precision,
                    );
                    (Connection::new(st, fp), r.clone())
                })
                .collect();
            let chain = LayerSplit::from_parts(model.config(), parts)?;
            Session::with_layer_split(model.clone(), opts, chain)?
        };
        Ok(Setup {
            name: name.to_string(),
            shaped,
            ranges: ranges.to_vec(),
            host_weight_bytes: model.weight_bytes(),
            session,
            rounds: Vec::new(),
            experts: None,
        })
    }

    /// Experts on the worker at `addr`: a host model without the routed experts of `[l, n)`, attached to it.
    fn setup_experts(&mut self, name: &str, addr: &str, l: usize, shaped: bool) -> Result<Setup> {
        let cfg = self.hosts[0].1.config().clone();
        if self.hosts[0].0 != self.n_layers {
            bail!(
                "experts on a worker compare against the whole model on the host: drop --no-local"
            );
        }
        let n = cfg.num_hidden_layers;
        let ids: Vec<usize> = (0..cfg.moe.as_ref().map_or(0, |m| m.num_experts)).collect();
        let away = vec![(l..n, ids.clone())];
        let model = crate::load_host_without(self.margs, self.pool, None, &away)?.model;
        let mut st = WorkerSettings::new(addr, self.pool.threads());
        st.timeout = Duration::from_secs(600);
        st.shaper = shaped.then_some(self.shaper);
        let fp = backburner_engine::split::dir_fingerprint_with(
            self.dir.to_path_buf(),
            self.margs.precision,
        );
        let holder = ExpertHolder::new(Connection::new(st, fp), l..n, ids);
        let shape = SessionShape {
            kv: self.margs.kv_dtype,
            page: self.margs.kv_page_size,
            ubatch: self.margs.ubatch,
        };
        let rx = Arc::new(LinkExperts::new(cfg, shape, vec![holder]));
        let dynrx: Arc<dyn RemoteExperts> = rx.clone();
        model.attach_remote_experts(dynrx);
        rx.connect_all()
            .map_err(|e| anyhow::anyhow!("the experts' worker: {e}"))?;
        let session = Session::new(model.clone(), self.margs.session_options(self.pool))?;
        Ok(Setup {
            name: name.to_string(),
            shaped,
            ranges: std::iter::once(l..n).collect(),
            host_weight_bytes: model.weight_bytes(),
            session,
            rounds: Vec::new(),
            experts: Some(rx),
        })
    }
}

/// The greedy tokens and the prompt's last logits (as bits) of one round, to compare configurations.
#[derive(PartialEq)]
struct Output {
    tokens: Vec<u32>,
    logits: Vec<u32>,
}

/// The layer split's time counters (zeros for a local session).
fn chain_stats(s: &Session) -> ChainStats {
    s.layer_split()
        .map(|c| c.stats().clone())
        .unwrap_or_default()
}

/// Bytes over the link so far, both ways, all workers (the session's, or the experts' workers').
fn link_bytes(st: &Setup) -> u64 {
    if let Some(rx) = &st.experts {
        return rx
            .stats()
            .iter()
            .map(|(.., l)| l.bytes_sent + l.bytes_received)
            .sum();
    }
    let l = st.session.link_stats();
    l.bytes_sent + l.bytes_received
}

/// One round of `st`: clear, prefill `prompt`, decode `n` greedy tokens; the decode split from the chain's counters.
fn measure(st: &mut Setup, prompt: &[u32], n: usize) -> Result<(Round, Output)> {
    st.session.clear();
    let t = Instant::now();
    let logits = st.session.prefill(prompt, Logits::Last, |_, _| {})?;
    let prefill_s = t.elapsed().as_secs_f64();
    let (c0, b0) = (chain_stats(&st.session), link_bytes(st));
    let s = &mut st.session;
    let mut tokens = vec![argmax(&logits)];
    let t = Instant::now();
    // the token loop on a compute thread, as `generate` runs it
    s.in_pool(|s| -> Result<()> {
        for _ in 0..n {
            let l = s.decode(*tokens.last().expect("non-empty"))?;
            tokens.push(argmax(&l));
        }
        Ok(())
    })?;
    let decode_s = t.elapsed().as_secs_f64();
    let (c1, b1) = (chain_stats(&st.session), link_bytes(st));
    if c1.failures > 0 {
        bail!("{}: a worker was lost during the benchmark", st.name);
    }
    let per = |us: u64| us as f64 / n as f64 / 1e3;
    let decode_ms = decode_s * 1e3 / n as f64;
    let (host, workers, wall) = (
        c1.decode_host_us - c0.decode_host_us,
        c1.decode_worker_us - c0.decode_worker_us,
        c1.decode_wall_us - c0.decode_wall_us,
    );
    let r = Round {
        prefill_tok_s: prompt.len() as f64 / prefill_s,
        decode_tok_s: n as f64 / decode_s,
        decode_ms,
        host_ms: if st.ranges.is_empty() || st.experts.is_some() {
            decode_ms
        } else {
            per(host)
        },
        workers_ms: per(workers),
        link_ms: per(wall.saturating_sub(host + workers)),
        bytes_per_decode_token: (b1 - b0) as f64 / n as f64,
    };
    let logits = logits.iter().map(|x| x.to_bits()).collect();
    Ok((r, Output { tokens, logits }))
}

/// `rounds` rounds over the configurations in turn (local first, unless `--no-local`); every configuration must
/// give the first one's greedy tokens and prompt logits, bit for bit, in every round. Returns those tokens.
fn measure_rounds(setups: &mut [Setup], a: &LayerSplitArgs, prompt: &[u32]) -> Result<Vec<u32>> {
    let mut want: Option<Output> = None;
    for round in 0..a.rounds {
        for st in setups.iter_mut() {
            let (r, out) = measure(st, prompt, a.decode_tokens)
                .with_context(|| format!("round {} of {}", round + 1, st.name))?;
            match &want {
                None => want = Some(out),
                Some(w) if w.tokens != out.tokens => bail!(
                    "{}: greedy tokens differ from local's in round {}: {:?} vs {:?}",
                    st.name,
                    round + 1,
                    out.tokens,
                    w.tokens
                ),
                Some(w) if w.logits != out.logits => bail!(
                    "{}: the prompt's logits differ from local bit for bit in round {}",
                    st.name,
                    round + 1
                ),
                _ => {}
            }
            eprintln!(
                "round {}/{} {:<20} prefill {:>8.1} tok/s | decode {:>7.2} tok/s ({:.2} ms/token: host {:.2} + workers {:.2} + link {:.2})",
                round + 1,
                a.rounds,
                st.name,
                r.prefill_tok_s,
                r.decode_tok_s,
                r.decode_ms,
                r.host_ms,
                r.workers_ms,
                r.link_ms
            );
            st.rounds.push(r);
        }
    }
    Ok(want.map(|w| w.tokens).unwrap_or_default())
}

/// Worker layer ranges in chain order.
type Ranges = Vec<Range<usize>>;

/// The layer ranges of the one-worker and chain configurations, checked against an `n`-layer model.
fn worker_ranges(a: &LayerSplitArgs, n: usize) -> Result<(Ranges, Ranges)> {
    if a.prompt_tokens == 0 || a.decode_tokens == 0 || a.rounds == 0 || a.worker_threads == 0 {
        bail!("--prompt-tokens, --decode-tokens, --rounds and --worker-threads must be ≥ 1");
    }
    let one = chain_args::ranges(&[a.layer_split], 1, n).context("--layer-split")?;
    if a.no_chain {
        if one[0].start == 0 {
            bail!("a split point of 0 leaves the host no layers: the first must be at least 1");
        }
        return Ok((one, Vec::new()));
    }
    if a.chain.len() < 2 {
        bail!("--chain takes two or more split points (one per worker), e.g. 4,6");
    }
    let chain = chain_args::ranges(&a.chain, a.chain.len(), n).context("--chain")?;
    if one[0].start == 0 || chain[0].start == 0 {
        bail!("a split point of 0 leaves the host no layers: the first must be at least 1");
    }
    Ok((one, chain))
}

/// The first host model: every layer, or with `--no-local` only `[0, --layer-split)` and the ends (so that a
/// `--max-memory` below the model's size holds). Returns the resolved model options, it and the model's layers.
fn load_first_host(
    a: &LayerSplitArgs,
    pool: &ComputePool,
) -> Result<(ModelArgs, crate::Loaded, usize)> {
    if !a.no_local {
        let (margs, loaded) = bench::load_or_bench_model(&a.model, pool)?;
        let n = loaded.model.config().num_hidden_layers;
        return Ok((margs, loaded, n));
    }
    let mut margs = a.model.clone();
    if margs.model.is_none() {
        margs.model = Some(bench::bench_model_dir()?);
    }
    let dir = margs.model.clone().expect("set above");
    let n = crate::load_tokenizer(&dir)?.0.num_hidden_layers;
    if a.layer_split == 0 || a.layer_split >= n {
        bail!("--layer-split must be inside the model's {n} layers");
    }
    let loaded = crate::load_host(&margs, pool, Some(a.layer_split))?;
    Ok((margs, loaded, n))
}

/// The decoder layers `loaded` holds on the host (`[0, held)`).
fn held_of(loaded: &crate::Loaded) -> usize {
    loaded.model.layer_range().end
}

/// Runs the benchmark.
pub fn run(a: LayerSplitArgs) -> Result<()> {
    let pool = compute_pool(Some(a.model.threads.unwrap_or(1)))?;
    let (margs, loaded, n) = load_first_host(&a, &pool)?;
    let cfg = loaded.model.config().clone();
    let (one, chain) = worker_ranges(&a, n)?;
    let precision = cfg.precision;
    let workers = start_workers(
        &loaded.dir,
        a.worker_threads,
        precision,
        a.worker_max_memory.as_deref(),
        &[&one, &chain],
    )?;
    let experts_worker = match a.experts {
        Some(l) if cfg.moe.is_none() || l >= n => {
            bail!("--experts L needs a mixture-of-experts model and L inside its {n} layers")
        }
        Some(_) => Some(
            spawn_worker(&loaded.dir, a.worker_threads, precision, &[])
                .context("start the experts' worker")?,
        ),
        None => None,
    };
    let shaper = a.shaped.shaper()?;
    let mut ctx = Ctx {
        margs: &margs,
        pool: &pool,
        dir: &loaded.dir,
        workers: &workers,
        shaper,
        n_layers: n,
        hosts: vec![(held_of(&loaded), loaded.model.clone())],
    };
    let mut plan: Vec<(&str, &[Range<usize>], bool)> = vec![("layer_split", &one, false)];
    if !a.no_local {
        plan.insert(0, ("local", &[], false));
    }
    if !a.no_shaped {
        plan.push(("layer_split_shaped", &one, true));
    }
    if !a.no_chain {
        plan.push(("chain", &chain, false));
        if !a.no_shaped {
            plan.push(("chain_shaped", &chain, true));
        }
    }
    let mut setups = plan
        .iter()
        .map(|(name, r, sh)| ctx.setup(name, r, *sh))
        .collect::<Result<Vec<_>>>()?;
    if let (Some(l), Some((_, addr))) = (a.experts, &experts_worker) {
        setups.insert(1, ctx.setup_experts("experts", addr, l, false)?);
        if !a.no_shaped {
            setups.push(ctx.setup_experts("experts_shaped", addr, l, true)?);
        }
    }
    let prompt =
        bench::pseudo_random_prompt(a.prompt_tokens, cfg.vocab_size, 0x6c61_7965_7273_706c);
    eprintln!(
        "bench layer-split: model {} ({n} layers, hidden {}), prompt {} tokens, decode {} tokens, {} rounds, host {} thread(s), workers {} thread(s) each, ubatch {}, machine: {}",
        loaded.dir.display(),
        cfg.hidden_size,
        a.prompt_tokens,
        a.decode_tokens,
        a.rounds,
        pool.threads(),
        a.worker_threads,
        margs.ubatch,
        bench::machine_description()
    );
    // warm-up: the workers load their layers and the host's fingerprint cache fills on the first handshake
    for st in &mut setups {
        let s = &mut st.session;
        s.prefill(&prompt[..prompt.len().min(8)], Logits::Last, |_, _| {})
            .with_context(|| format!("warm-up of {}", st.name))?;
        s.decode(0)?;
    }
    let tokens = measure_rounds(&mut setups, &a, &prompt)?;
    let results = summarize(&setups, n);
    if !a.json {
        print_table(&results);
        return Ok(());
    }
    let report = report_json(&a, &margs, &loaded, pool.threads(), tokens, results)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
