//! `backburner bench split-prefill`: prompt ingestion on the host alone vs split with a worker process, measured
//! side by side in one run, plus the same over an emulated 10 Gbit/s link with 48 µs one-way delay, and a ping
//! round-trip histogram.
//!
//! The worker is started by the bench as a child process (`backburner worker`, same binary, loopback, its own
//! thread count), so the two sides really are two processes computing at once.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backburner_engine::{Logits, Session, WorkerClient};
use backburner_link::Shaper;
use clap::Args;
use serde::Serialize;

use crate::{bench, compute_pool, ModelArgs};

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors) or GGUF file. Default: the bundled bench model (random weights, generated once)")))]
pub struct SplitArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Prompt lengths (tokens, comma-separated) to ingest, each from an empty context.
    #[arg(long, value_delimiter = ',', default_value = "2048,8192,16384")]
    depths: Vec<usize>,
    /// Threads of the worker process (the host uses --threads, default 1 here).
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    /// First worker layer (default: balanced by threads).
    #[arg(long)]
    split_layer: Option<usize>,
    #[command(flatten)]
    shaped: bench::ShapedLinkArgs,
    /// Skip the shaped-link run and the shaped ping.
    #[arg(long)]
    no_shaped: bool,
    /// Pings for the round-trip histogram.
    #[arg(long, default_value_t = 2000)]
    pings: usize,
}

/// A worker child process, killed when dropped.
pub(crate) struct ChildWorker(Child);
impl Drop for ChildWorker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `backburner worker` (this binary) on a loopback port with `threads` threads and `extra` flags; returns it
/// and its address once it listens.
pub(crate) fn spawn_worker(
    model: &std::path::Path,
    threads: usize,
    precision: backburner_model::Precision,
    extra: &[&str],
) -> Result<(ChildWorker, String)> {
    let exe = std::env::current_exe().context("locate the backburner binary")?;
    let mut child = Command::new(exe)
        .args([
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            &threads.to_string(),
        ])
        .arg("--model")
        .arg(model)
        .args(["--precision", precision.name()])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("start the worker process")?;
    let mut r = BufReader::new(child.stderr.take().expect("piped"));
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            bail!("the worker process exited before listening");
        }
        if let Some(rest) = line.split("listening on ").nth(1) {
            let addr = rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            std::thread::spawn(move || {
                let mut s = String::new();
                while r.read_line(&mut s).map(|n| n > 0).unwrap_or(false) {
                    s.clear();
                }
            });
            return Ok((ChildWorker(child), addr));
        }
    }
}

#[derive(Serialize)]
struct DepthResult {
    tokens: usize,
    local_tok_s: f64,
    split_tok_s: f64,
    speedup: f64,
    shaped_tok_s: Option<f64>,
    shaped_speedup: Option<f64>,
    worker_tokens: u64,
    link_bytes_per_token: f64,
    /// Worker idle time between ubatches as a share of its busy time.
    bubble_fraction: f64,
    worker_idle_ms: f64,
    worker_compute_ms: f64,
}

#[derive(Serialize)]
struct Rtt {
    n: usize,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
}

fn rtt(mut samples: Vec<Duration>) -> Rtt {
    samples.sort();
    let q = |f: f64| {
        samples[((samples.len() as f64 * f) as usize).min(samples.len() - 1)].as_secs_f64() * 1e6
    };
    Rtt {
        n: samples.len(),
        p50_us: q(0.5),
        p90_us: q(0.9),
        p99_us: q(0.99),
    }
}

/// Runs the benchmark.
pub fn run(a: SplitArgs) -> Result<()> {
    let pool = compute_pool(Some(a.model.threads.unwrap_or(1)))?;
    let host_threads = pool.threads();
    let (margs, loaded) = bench::load_or_bench_model(&a.model, &pool)?;
    let cfg = loaded.model.config().clone();
    if backburner_engine::split::balanced_split(&cfg, 1, 1).is_none() {
        bail!(
            "this {}-layer model has no split point on its {}-layer cycle: split prefill needs two cycles or more \
             (the worker would take no part)",
            cfg.num_hidden_layers,
            cfg.full_attention_interval
        );
    }
    let precision = loaded.model.config().precision;
    let (_w, addr) = spawn_worker(&loaded.dir, a.worker_threads, precision, &[])?;
    let make_client = |shaper: Option<Shaper>| -> Result<WorkerClient> {
        crate::placement::bench_client(&loaded, &addr, a.split_layer, 1, host_threads, shaper)
    };
    let shaper = a.shaped.shaper()?;
    let max = *a.depths.iter().max().context("--depths needs a value")?;
    if a.depths.contains(&0) || a.pings == 0 {
        bail!("--depths and --pings must be ≥ 1");
    }
    let prompt = bench::pseudo_random_prompt(max, cfg.vocab_size, 0x2545_f491_4f6c_dd1d);
    eprintln!(
        "bench split-prefill: model {} ({} layers, hidden {}), host {host_threads} thread(s), worker {} thread(s) at {addr}, ubatch {}, machine: {}",
        loaded.dir.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        a.worker_threads,
        margs.ubatch,
        bench::machine_description()
    );
    let mut results = Vec::new();
    let mut split_layer = 0;
    for &n in &a.depths {
        let p = &prompt[..n];
        let t = Instant::now();
        let mut s = Session::new(loaded.model.clone(), margs.session_options(&pool))?;
        let want = s.prefill(p, Logits::Last, |_, _| {})?;
        let local = t.elapsed().as_secs_f64();
        drop(s);

        let mut s = Session::new(loaded.model.clone(), margs.session_options(&pool))?;
        s.attach_worker(make_client(None)?);
        let t = Instant::now();
        let got = s.prefill(p, Logits::Last, |_, _| {})?;
        let split = t.elapsed().as_secs_f64();
        let st = s.link_stats();
        split_layer = s.workers().first().map_or(0, |w| w.split_layer());
        if st.fallbacks > 0 {
            bail!(
                "the worker failed during the benchmark (fallbacks: {})",
                st.fallbacks
            );
        }
        if st.worker_tokens == 0 {
            bail!(
                "the worker took no part in the {n}-token prefill (a prompt of one ubatch or less, {} tokens here, \
                 runs on the host): give longer --depths",
                margs.ubatch
            );
        }
        if got
            .iter()
            .zip(&want)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            bail!("split logits differ from local at {n} tokens");
        }
        drop(s);

        let shaped = if a.no_shaped {
            None
        } else {
            let mut s = Session::new(loaded.model.clone(), margs.session_options(&pool))?;
            s.attach_worker(make_client(Some(shaper))?);
            let t = Instant::now();
            s.prefill(p, Logits::Last, |_, _| {})?;
            let el = t.elapsed().as_secs_f64();
            if s.link_stats().fallbacks > 0 {
                bail!("the worker failed during the shaped run");
            }
            Some(el)
        };
        let r = DepthResult {
            tokens: n,
            local_tok_s: n as f64 / local,
            split_tok_s: n as f64 / split,
            speedup: local / split,
            shaped_tok_s: shaped.map(|s| n as f64 / s),
            shaped_speedup: shaped.map(|s| local / s),
            worker_tokens: st.worker_tokens,
            link_bytes_per_token: (st.bytes_sent + st.bytes_received) as f64 / n as f64,
            bubble_fraction: st.worker_idle_us as f64 / st.worker_compute_us.max(1) as f64,
            worker_idle_ms: st.worker_idle_us as f64 / 1e3,
            worker_compute_ms: st.worker_compute_us as f64 / 1e3,
        };
        eprintln!(
            "{n:>6} tokens: local {:>7.1} tok/s | split {:>7.1} tok/s ({:.2}x) | shaped {} | {:.0} link B/token | bubble {:.1}%",
            r.local_tok_s,
            r.split_tok_s,
            r.speedup,
            r.shaped_speedup.map(|s| format!("{:.1} tok/s ({s:.2}x)", r.shaped_tok_s.unwrap_or(0.0))).unwrap_or_else(|| "-".into()),
            r.link_bytes_per_token,
            100.0 * r.bubble_fraction
        );
        results.push(r);
    }
    // ping round trips, 16-byte request/reply
    let mut pings = Vec::new();
    let links = if a.no_shaped {
        vec![None]
    } else {
        vec![None, Some(shaper)]
    };
    for sh in links {
        let mut c = make_client(sh)?;
        let kv = margs.kv_dtype;
        c.ping(&cfg, kv, margs.kv_page_size, margs.ubatch, &[0u8; 16])?; // connect + warm up
        let mut v = Vec::with_capacity(a.pings);
        for _ in 0..a.pings {
            v.push(c.ping(&cfg, kv, margs.kv_page_size, margs.ubatch, &[0u8; 16])?);
        }
        let r = rtt(v);
        eprintln!(
            "ping 16 B {}: p50 {:.1} µs, p90 {:.1} µs, p99 {:.1} µs ({} samples)",
            if sh.is_some() { "shaped" } else { "loopback" },
            r.p50_us,
            r.p90_us,
            r.p99_us,
            r.n
        );
        pings.push(r);
        drop(c);
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = serde_json::json!({
        "bench": "split-prefill",
        "model": loaded.dir.display().to_string(),
        "config": {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "params": bench::param_count(&cfg)},
        "split_layer": split_layer,
        "host_threads": host_threads,
        "worker_threads": a.worker_threads,
        "ubatch": margs.ubatch,
        "shaped_link": (!a.no_shaped).then(|| a.shaped.json()),
        "machine": bench::machine_description(),
        "results": results,
        "ping_loopback": pings.first(),
        "ping_shaped": pings.get(1),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
