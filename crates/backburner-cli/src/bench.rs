//! `backburner bench local`: prefill and decode throughput of the local engine at growing context depth.
//!
//! One run per thread count: prefill a random prompt of the deepest depth in ubatches, and at each requested depth
//! record the prefill rate so far and then decode `--decode-tokens` tokens (greedy) from that depth before rewinding
//! and continuing the prefill. Decode therefore measures real attention over `depth` cached positions.

use std::time::Instant;

use anyhow::{bail, Result};
use backburner_engine::{argmax, Logits, Session};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{default_model, load, set_threads, ModelArgs};

/// Benchmark options.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    kind: BenchKind,
}

#[derive(Subcommand)]
enum BenchKind {
    /// Single-node prefill and decode at several context depths and thread counts.
    Local(LocalArgs),
    /// Prompt ingestion local vs split with a worker process (1 thread each), plus a shaped link and ping RTTs.
    SplitPrefill(crate::bench_split::SplitArgs),
}

#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors). Default: the bundled bench model (random weights, generated once)")))]
struct LocalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Context depths (tokens, comma-separated) at which to report prefill and decode.
    #[arg(long, value_delimiter = ',', default_value = "2048,8192,16384")]
    depths: Vec<usize>,
    /// Thread counts to run, comma-separated (one full run each).
    #[arg(long = "thread-counts", value_delimiter = ',', default_value = "1,2")]
    thread_counts: Vec<usize>,
    /// Tokens decoded at each depth.
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
    /// Print JSON only.
    #[arg(long)]
    json: bool,
}

/// The benchmark configuration: Qwen3.5 text architecture (3 Gated DeltaNet + 1 gated attention layers per cycle,
/// GQA, partial RoPE, d_k = d_v) at a width this machine runs in minutes. Random weights, generated once.
pub fn bench_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 32768,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "dtype": "bfloat16"
    })
}

#[derive(Serialize)]
struct DepthResult {
    depth: usize,
    /// Prompt tokens per second from 0 to this depth.
    prefill_tok_s: f64,
    /// Seconds to prefill from 0 to this depth.
    prefill_s: f64,
    /// Decode tokens per second at this depth.
    decode_tok_s: f64,
    /// Milliseconds per decoded token at this depth.
    decode_ms_per_token: f64,
}

#[derive(Serialize)]
struct ThreadResult {
    threads: usize,
    depths: Vec<DepthResult>,
}

fn run_local(a: LocalArgs) -> Result<()> {
    if a.depths.is_empty() || a.thread_counts.is_empty() {
        bail!("--depths and --thread-counts need at least one value");
    }
    if a.depths.contains(&0) || a.thread_counts.contains(&0) || a.decode_tokens == 0 {
        bail!("--depths, --thread-counts and --decode-tokens must be ≥ 1");
    }
    let mut depths = a.depths.clone();
    depths.sort_unstable();
    depths.dedup();
    let max_depth = *depths.last().expect("non-empty");
    let mut margs = a.model.clone();
    if margs.model.is_none() {
        margs.model = Some(default_model::ensure_at(
            &default_model::cache_dir().join("bench-model-v1"),
            &bench_config(),
        )?);
    }
    // One global pool sized for the largest count; each run sets RAYON_NUM_THREADS (candle's gemm) and runs inside a
    // pool of its own size.
    set_threads(Some(*a.thread_counts.iter().max().expect("non-empty")))?;
    let loaded = load(&margs)?;
    let cfg = loaded.model.config().clone();
    let prompt = pseudo_random_prompt(max_depth, cfg.vocab_size, 0x1234_5678_9abc_def0);
    let machine = machine_description();
    if !a.json {
        eprintln!(
            "bench local: model {} ({} layers, hidden {}, {} params), ubatch {}, kv {} page {}, machine: {machine}",
            loaded.dir.display(),
            cfg.num_hidden_layers,
            cfg.hidden_size,
            param_count(&cfg),
            margs.ubatch,
            margs.kv_dtype,
            margs.kv_page_size
        );
    }
    let mut results = Vec::new();
    for &threads in &a.thread_counts {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        let r = pool.install(|| -> Result<ThreadResult> {
            let mut s = Session::new(loaded.model.clone(), margs.session_options())?;
            let mut out = Vec::new();
            let t0 = Instant::now();
            let mut done = 0;
            for &depth in &depths {
                // prefill up to `depth` in ubatches
                while done < depth {
                    let end = (done + margs.ubatch).min(depth);
                    s.prefill(&prompt[done..end], Logits::Last, |_, _| {})?;
                    done = end;
                }
                let prefill_s = t0.elapsed().as_secs_f64();
                // decode from this depth, then rewind
                let snap = s.snapshot();
                // any id will do as the first decode input; then follow the greedy choice
                let mut tok = prompt[depth - 1];
                let td = Instant::now();
                for _ in 0..a.decode_tokens {
                    let l = s.decode(tok)?;
                    tok = argmax(&l);
                }
                let dec_s = td.elapsed().as_secs_f64();
                s.rewind(&snap);
                let r = DepthResult {
                    depth,
                    prefill_tok_s: depth as f64 / prefill_s,
                    prefill_s,
                    decode_tok_s: a.decode_tokens as f64 / dec_s,
                    decode_ms_per_token: dec_s * 1e3 / a.decode_tokens as f64,
                };
                if !a.json {
                    eprintln!(
                        "threads {threads} depth {depth:>6}: prefill {:>8.1} tok/s ({:.1} s)  decode {:>7.2} tok/s ({:.1} ms/token)",
                        r.prefill_tok_s, r.prefill_s, r.decode_tok_s, r.decode_ms_per_token
                    );
                }
                out.push(r);
            }
            Ok(ThreadResult { threads, depths: out })
        })?;
        results.push(r);
    }
    let report = serde_json::json!({
        "bench": "local",
        "model": loaded.dir.display().to_string(),
        "config": {
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "params": param_count(&cfg),
        },
        "ubatch": margs.ubatch,
        "kv_dtype": margs.kv_dtype.to_string(),
        "kv_page_size": margs.kv_page_size,
        "decode_tokens": a.decode_tokens,
        "machine": machine,
        "results": results,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// A fixed pseudo-random prompt of `n` ids in `0..vocab` (xorshift64 from `seed`), so every run ingests the same
/// tokens.
pub fn pseudo_random_prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.max(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// Parameters of the text model (embedding counted once when tied).
pub fn param_count(c: &backburner_model::ModelConfig) -> usize {
    let h = c.hidden_size;
    let mut n = c.vocab_size * h * if c.tie_word_embeddings { 1 } else { 2 } + h;
    for k in &c.layer_types {
        n += 2 * h + 3 * h * c.intermediate_size;
        n += match k {
            backburner_model::LayerKind::LinearAttention => {
                let hv = c.linear_num_value_heads;
                let dv = c.linear_value_head_dim;
                (c.conv_dim() + hv * dv + 2 * hv) * h
                    + c.conv_dim() * c.linear_conv_kernel_dim
                    + 2 * hv
                    + dv
                    + h * hv * dv
            }
            backburner_model::LayerKind::FullAttention => {
                let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                (hq * 2 * d + 2 * hkv * d) * h + 2 * d + h * hq * d
            }
        };
    }
    n
}

pub fn machine_description() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!("{cpu}, {cores} cores")
}

/// Runs a benchmark.
pub fn run(a: BenchArgs) -> Result<()> {
    match a.kind {
        BenchKind::Local(l) => run_local(l),
        BenchKind::SplitPrefill(a) => crate::bench_split::run(a),
    }
}
