//! `backburner bench decode-offload`: decode time per token at a long context with the whole KV cache on the host
//! vs half of it on one worker process (pages packed, as by default, or kept as received) vs on two, over loopback
//! and over an emulated link, as ratios measured in one run (alternating configurations, medians); and the ingestion of a prompt 4× the host's KV budget with a
//! worker vs an unbounded local run.
//!
//! Depth: the cache is filled with **synthetic rows** (uniform random K and V, the same seed in every
//! configuration) rather than a real prefill, which would take most of an hour at 64k positions here; decode time
//! depends on the number of rows, not their values. Every configuration must give the local logits bit for bit
//! (checked), which also checks the offloaded fold at depth.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backburner_engine::offload::KvBudget;
use backburner_engine::{argmax, Logits, Session, SessionOptions, WorkerClient, WorkerSettings};
use backburner_link::Shaper;
use clap::Args;
use serde::Serialize;

use crate::bench_split::spawn_worker;
use crate::{bench, compute_pool, Loaded, ModelArgs};

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors) or GGUF file. Default: the bundled bench model (random weights, generated once)")))]
#[command(mut_arg("threads", |a| a.help("Host compute threads (default 1 here)")))]
pub struct OffloadArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Context depth (positions) to decode at.
    #[arg(long, default_value_t = 65536)]
    depth: usize,
    /// Tokens decoded per measurement.
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
    /// Measurements per configuration (alternating; the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Threads of each worker process (the host uses --threads, default 1 here).
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    #[command(flatten)]
    shaped: bench::ShapedLinkArgs,
    /// Prompt length (tokens) for the ingestion run, 4× the host's budget in it (0 = skip it).
    #[arg(long, default_value_t = 8192)]
    ingest_tokens: usize,
    /// KV page size (positions) of the ingestion run.
    #[arg(long, default_value_t = 512)]
    ingest_page_size: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Config {
    Local,
    OneWorker,
    OneWorkerUnpacked,
    TwoWorkers,
    OneWorkerShaped,
}

#[derive(Serialize)]
struct ConfigResult {
    config: Config,
    decode_ms_per_token: f64,
    /// Local median / this median.
    speedup_vs_local: f64,
    samples_ms_per_token: Vec<f64>,
    positions_on_host: usize,
    /// Positions held by each worker, in order.
    positions_on_workers: Vec<usize>,
    bytes_per_decode_token: u64,
}

struct Setup {
    session: Session,
    snap: backburner_model::StateSnapshot,
    first: u32,
    samples: Vec<f64>,
    bytes_per_token: u64,
}

fn client(addr: &str, loaded: &Loaded, shaper: Option<Shaper>, frame: usize) -> WorkerClient {
    let mut st = WorkerSettings::new(addr, 1);
    st.timeout = Duration::from_secs(600);
    st.shaper = shaper;
    st.frame_budget = frame;
    WorkerClient::new(
        st,
        backburner_engine::split::dir_fingerprint_with(
            loaded.dir.clone(),
            loaded.model.config().precision,
        ),
    )
}

/// Decodes `n` greedy tokens from the snapshot and rewinds; returns ms per token and the logits of the first step.
fn measure(s: &mut Setup, n: usize) -> Result<(f64, Vec<f32>)> {
    let mut tok = s.first;
    let mut first = Vec::new();
    let t = Instant::now();
    // the token loop on a compute thread, as `generate` runs it
    s.session.in_pool(|session| -> Result<()> {
        for i in 0..n {
            let l = session.decode(tok)?;
            tok = argmax(&l);
            if i == 0 {
                first = l;
            }
        }
        Ok(())
    })?;
    let ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
    s.session.rewind(&s.snap);
    Ok((ms, first))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The worker processes of the bench and what each configuration uses.
struct Workers {
    _procs: Vec<crate::bench_split::ChildWorker>,
    /// Packed pages (default), for one worker and the shaped link.
    one: String,
    /// The first of two, sized to a quarter of the depth.
    first_of_two: String,
    /// The second of two.
    second_of_two: String,
    /// `--no-pack-pages`.
    unpacked: String,
}

/// Starts the four worker processes; the first of two holds a quarter of the depth, the second the rest of the
/// offloaded half: its budget fits those pages, the headroom a worker keeps for answering attention, its session
/// state (under 2 MiB here) and one put in flight (its frame), but not one more page.
fn start_workers(
    a: &OffloadArgs,
    loaded: &Loaded,
    margs: &ModelArgs,
    page_put: usize,
) -> Result<Workers> {
    let cfg = loaded.model.config();
    let quarter = (a.depth / 4 / margs.kv_page_size * page_put) as u64;
    let headroom = backburner_engine::worker::attend_headroom(cfg, margs.ubatch);
    let wt = a.worker_threads;
    // its --max-memory also holds the weights of the tail layers the host will ask for (split balanced as in
    // `clients`: one host thread)
    let l = backburner_engine::balanced_split(cfg, 1, wt).unwrap_or(cfg.num_hidden_layers);
    let ck = backburner_model::Checkpoint::open(&loaded.dir)?;
    let tail = backburner_model::LoadOptions {
        layers: l..cfg.num_hidden_layers,
        ends: false,
    };
    let weights = backburner_model::load_bytes(&ck, cfg, &tail)?;
    let w1_mem = format!(
        "{}",
        quarter + headroom + page_put as u64 + (3 << 20) + weights
    );
    let mut procs = Vec::new();
    let mut start = |extra: &[&str]| -> Result<String> {
        let (p, addr) = spawn_worker(&loaded.dir, wt, cfg.precision, extra)?;
        procs.push(p);
        Ok(addr)
    };
    let one = start(&[])?;
    let first_of_two = start(&["--max-memory", &w1_mem])?;
    let second_of_two = start(&[])?;
    let unpacked = start(&["--no-pack-pages"])?;
    Ok(Workers {
        _procs: procs,
        one,
        first_of_two,
        second_of_two,
        unpacked,
    })
}

const CONFIGS: [Config; 5] = [
    Config::Local,
    Config::OneWorker,
    Config::OneWorkerUnpacked,
    Config::TwoWorkers,
    Config::OneWorkerShaped,
];

/// A session of configuration `c` filled to the depth with synthetic rows, its pages moved out by two decode steps.
fn setup(
    c: Config,
    a: &OffloadArgs,
    loaded: &Loaded,
    opts: &SessionOptions,
    w: &Workers,
    page_put: usize,
) -> Result<Setup> {
    let mut o = opts.clone();
    if c != Config::Local {
        // half the depth on workers: the host keeps half plus one page of headroom, so no page moves while timing
        o.kv_budget = Some(KvBudget::Positions(a.depth / 2 + opts.kv.page_size));
    }
    let mut s = Session::new(loaded.model.clone(), o)?;
    let shaper = a.shaped.shaper()?;
    let attach: &[(&str, Option<Shaper>)] = match c {
        Config::Local => &[],
        Config::OneWorker => &[(&w.one, None)],
        Config::OneWorkerUnpacked => &[(&w.unpacked, None)],
        Config::TwoWorkers => &[(&w.first_of_two, None), (&w.second_of_two, None)],
        Config::OneWorkerShaped => &[(&w.one, Some(shaper))],
    };
    for (addr, sh) in attach {
        s.attach_worker(client(addr, loaded, *sh, page_put));
    }
    s.fill_synthetic(a.depth, 0x5eed)?;
    // two steps move the pages out and warm up; the measurements start from here
    let l = s.decode(1)?;
    let l = s.decode(argmax(&l))?;
    let first = argmax(&l);
    let snap = s.snapshot();
    Ok(Setup {
        session: s,
        snap,
        first,
        samples: Vec::new(),
        bytes_per_token: 0,
    })
}

/// `reps` rounds over the configurations in turn; every configuration's logits must be the local ones.
fn measure_rounds(setups: &mut [Setup], a: &OffloadArgs) -> Result<()> {
    let mut want: Option<Vec<u32>> = None;
    for rep in 0..a.reps {
        for (c, st) in CONFIGS.iter().zip(setups.iter_mut()) {
            let before = st.session.link_stats();
            let (ms, first) = measure(st, a.decode_tokens)?;
            let after = st.session.link_stats();
            if after.offload_failures + after.fallbacks > 0 {
                bail!("a worker failed during the benchmark ({c:?})");
            }
            let bits: Vec<u32> = first.iter().map(|x| x.to_bits()).collect();
            match &want {
                None => want = Some(bits),
                Some(w) if *w != bits => bail!("{c:?}: logits differ from local"),
                _ => {}
            }
            st.bytes_per_token =
                (after.offload_decode_bytes - before.offload_decode_bytes) / a.decode_tokens as u64;
            st.samples.push(ms);
            eprintln!("rep {rep} {c:?}: {ms:.2} ms/token");
        }
    }
    Ok(())
}

/// The medians and placements of each configuration, printed as they are made.
fn summarize(setups: &[Setup]) -> Vec<ConfigResult> {
    let local = median(&setups[0].samples);
    let mut results = Vec::new();
    for (c, st) in CONFIGS.iter().zip(setups) {
        let m = median(&st.samples);
        let runs = st.session.placement().runs().to_vec();
        let on_workers = (0..st.session.workers().len())
            .map(|w| {
                runs.iter()
                    .filter(|r| r.worker == w)
                    .map(|r| r.end - r.start)
                    .sum()
            })
            .collect::<Vec<usize>>();
        let r = ConfigResult {
            config: *c,
            decode_ms_per_token: m,
            speedup_vs_local: local / m,
            samples_ms_per_token: st.samples.clone(),
            positions_on_host: st.session.state().n_tokens() - st.session.state().offloaded(),
            positions_on_workers: on_workers,
            bytes_per_decode_token: st.bytes_per_token,
        };
        eprintln!(
            "{:>18}: {:>7.2} ms/token ({:.2}x local) | host {} positions, workers {:?} | {} B/token on the link",
            format!("{c:?}"),
            r.decode_ms_per_token,
            r.speedup_vs_local,
            r.positions_on_host,
            r.positions_on_workers,
            r.bytes_per_decode_token
        );
        results.push(r);
    }
    results
}

/// Runs the benchmark.
pub fn run(a: OffloadArgs) -> Result<()> {
    let pool = compute_pool(Some(a.model.threads.unwrap_or(1)))?;
    let (margs, loaded) = bench::load_or_bench_model(&a.model, &pool)?;
    let cfg = loaded.model.config().clone();
    let ps = margs.kv_page_size;
    if a.depth < 4 * ps {
        bail!(
            "--depth {} is below 4 KV pages of --kv-page-size {ps} ({} positions): raise --depth or lower --kv-page-size",
            a.depth,
            4 * ps
        );
    }
    if a.decode_tokens == 0 || a.reps == 0 {
        bail!("--decode-tokens and --reps must be at least 1");
    }
    if a.ingest_tokens > 0 && a.ingest_tokens / 4 < margs.ubatch + 2 * a.ingest_page_size {
        bail!("--ingest-tokens / 4 (the host's budget in the ingestion run) must hold a ubatch and two pages of --ingest-page-size (or --ingest-tokens 0 skips it)");
    }
    let opts = margs.session_options(&pool);
    let per_pos = backburner_engine::offload::bytes_per_position(&cfg, opts.kv);
    let page_put = per_pos * ps;
    let workers = start_workers(&a, &loaded, &margs, page_put)?;
    eprintln!(
        "bench decode-offload: model {} ({} layers, {} attention), depth {} (synthetic rows), page {ps}, {} KiB KV per position, host {} thread(s), workers {} thread(s) each, machine: {}",
        loaded.dir.display(),
        cfg.num_hidden_layers,
        backburner_engine::offload::attention_layers(&cfg).len(),
        a.depth,
        per_pos / 1024,
        pool.threads(),
        a.worker_threads,
        bench::machine_description()
    );
    let mut setups = CONFIGS
        .iter()
        .map(|c| setup(*c, &a, &loaded, &opts, &workers, page_put))
        .collect::<Result<Vec<_>>>()?;
    // the workers pack their new pages in the background: let them finish before measuring
    std::thread::sleep(Duration::from_secs(2));
    measure_rounds(&mut setups, &a)?;
    let results = summarize(&setups);
    drop(setups);
    let ingest = if a.ingest_tokens > 0 {
        Some(ingest(&a, &loaded, &margs, &pool, &workers.one)?)
    } else {
        None
    };
    let report = serde_json::json!({
        "bench": "decode-offload",
        "model": loaded.dir.display().to_string(),
        "depth": a.depth,
        "depth_rows": "synthetic (uniform random K and V)",
        "kv_page_size": ps,
        "kv_dtype": margs.kv_dtype.as_str(),
        "host_kv_budget_positions": a.depth / 2 + ps,
        "host_threads": pool.threads(),
        "worker_threads": a.worker_threads,
        "decode_tokens": a.decode_tokens,
        "reps": a.reps,
        "shaped_link": a.shaped.json(),
        "machine": bench::machine_description(),
        "decode": results,
        "ingest": ingest,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Ingestion of a prompt 4× the host's budget with a worker (interleaved and not) vs unbounded local, alternating,
/// medians of 2.
fn ingest(
    a: &OffloadArgs,
    loaded: &Loaded,
    margs: &ModelArgs,
    pool: &backburner_engine::ComputePool,
    addr: &str,
) -> Result<serde_json::Value> {
    let n = a.ingest_tokens;
    let prompt = bench::pseudo_random_prompt(n, loaded.model.config().vocab_size, 0x1234_5678);
    let mut m = margs.clone();
    m.kv_page_size = a.ingest_page_size;
    let opts = m.session_options(pool);
    let budget = n / 4;
    if budget < margs.ubatch + 2 * a.ingest_page_size {
        bail!("--ingest-tokens / 4 must hold a ubatch and two pages");
    }
    let mut times: [Vec<f64>; 3] = Default::default();
    let names = ["local", "offload, interleaved", "offload, not interleaved"];
    let mut want = None;
    for _ in 0..2 {
        for (i, name) in names.iter().enumerate() {
            let mut o = opts.clone();
            let mut s = if i > 0 {
                o.kv_budget = Some(KvBudget::Positions(budget));
                o.interleave = i == 1;
                let mut s = Session::new(loaded.model.clone(), o)?;
                s.attach_worker(client(addr, loaded, None, 256 << 20));
                s
            } else {
                Session::new(loaded.model.clone(), o)?
            };
            let t = Instant::now();
            let l = s
                .prefill(&prompt, Logits::Last, |_, _| {})
                .context("ingest")?;
            let el = t.elapsed().as_secs_f64();
            let bits: Vec<u32> = l.iter().map(|x| x.to_bits()).collect();
            match &want {
                None => want = Some(bits),
                Some(w) if *w != bits => bail!("ingest logits with the worker differ from local"),
                _ => {}
            }
            eprintln!("ingest {n} tokens {name}: {:.1} tok/s", n as f64 / el);
            times[i].push(el);
        }
    }
    let [l, o, p] = times.map(|t| median(&t));
    Ok(serde_json::json!({
        "prompt_tokens": n,
        "host_kv_budget_positions": budget,
        "kv_page_size": a.ingest_page_size,
        "local_tok_s": n as f64 / l,
        "offload_interleaved_tok_s": n as f64 / o,
        "offload_not_interleaved_tok_s": n as f64 / p,
        "interleaved_vs_local": l / o,
        "interleaved_vs_not": p / o,
    }))
}
