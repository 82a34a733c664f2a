//! `backburner bench local`: prefill and decode throughput of the local engine at growing context depth.
//!
//! One run per thread count: prefill a random prompt of the deepest depth in ubatches, and at each requested depth
//! record the prefill rate so far and then decode `--decode-tokens` tokens (greedy) from that depth before rewinding
//! and continuing the prefill. Decode therefore measures real attention over `depth` cached positions.

use std::time::Instant;

use anyhow::{bail, Result};
use backburner_engine::{ComputePool, Logits, Session};
use backburner_kernels::profile;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::bench_report::{self, PhaseWork};
use crate::bench_share::{self, PairedShare, WeightPass};
use crate::{compute_pool, default_model, load, ModelArgs};
use backburner_engine::memory;
use backburner_model::ModelConfig;

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
    /// Decode ms/token at a long context with half the KV cache on one or two worker processes vs local, and
    /// ingestion of a prompt 4x the host's KV budget.
    DecodeOffload(crate::bench_offload::OffloadArgs),
    /// Prefill and decode with the whole model on the host vs a layer split with one worker process vs a chain of
    /// two (loopback and a shaped link), alternating rounds, medians, with the decode time split per side.
    LayerSplit(crate::bench_layer_split::LayerSplitArgs),
    /// Time to the first answer of each turn of a coding-agent session replayed over HTTP against an in-process
    /// server: cold alone, cold with a worker (split prefill), and warm (prompt cache).
    Session(crate::bench_session::SessionArgs),
    /// Aggregate decode tok/s of 1, 2, 4, 8 sequences decoded as one batch, vs one at a time.
    Slots(crate::bench_slots::SlotsArgs),
    /// Speculative decoding: a verify step of T = 1..9 positions vs T decode steps and the cost of a rollback, the
    /// draft length controller's cost model from them, and decode tok/s vs draft acceptance (scripted drafts of the
    /// known greedy continuation), alternating with plain runs, medians; tokens checked equal to plain decoding.
    Spec(crate::bench_spec::SpecArgs),
    /// Write a random-weight GGUF file of any shape (the full 27B too) and per-tensor type mix, streamed to disk
    /// with bounded memory, for the other benches' `--model`.
    GenGguf(crate::bench_gen_gguf::GenGgufArgs),
    /// The original write-up's table (zero to one, long prefill local vs split, decode with KV pages on a worker,
    /// an agent session's first answer) on given files, beside llama.cpp on the same files (--llama-cpp),
    /// alternating rounds; writes every run's JSON, a Markdown table and one SVG plot per row to --out.
    SeedTable(crate::bench_seed::SeedArgs),
}

#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors) or GGUF file. Default: the bundled bench model (random weights, generated once)")))]
#[command(mut_arg("threads", |a| a.help("One thread count to run (the same as --thread-counts N)").conflicts_with("thread_counts")))]
struct LocalArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Context depths (tokens, comma-separated) at which to report prefill and decode.
    #[arg(long, value_delimiter = ',', default_value = "2048,8192,16384")]
    depths: Vec<usize>,
    /// Thread counts to run, comma-separated (one full run each).
    #[arg(long = "thread-counts", value_delimiter = ',', default_value = "1,2")]
    thread_counts: Vec<usize>,
    /// Tokens decoded at each depth.
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
    /// Also print where the time goes: wall time per operator class (matmuls, GDN conv / chunked delta rule /
    /// recurrence, attention, norms, RoPE, head, sampling, copies, thread synchronisation) for prefill and decode.
    #[arg(long)]
    profile: bool,
    /// Skip measuring the machine's read bandwidth (a few seconds per thread count) and the decode's share of it in
    /// alternation with reads of the weights (7 rounds of 8 more decode tokens per depth).
    #[arg(long)]
    no_bandwidth: bool,
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
    /// Weight bytes a decode step reads: every weight, except one row of an untied embedding table
    /// ([`backburner_model::Model::decode_weight_bytes`]) and of a mixture-of-experts model's routed experts only
    /// those the step routed to (their bytes counted while decoding, averaged per token).
    decode_weight_bytes_per_token: u64,
    /// Weight bytes read per second in decode (`decode_weight_bytes_per_token` per token), GB/s.
    decode_weight_gb_s: f64,
    /// All the bytes a decode step must read per second: the weights, the KV cache at this depth and the Gated
    /// DeltaNet states (conv + recurrent, f32), GB/s.
    decode_read_gb_s: f64,
    /// The decode's share of the read bandwidth measured in alternation with reads of the weights (null with
    /// --no-bandwidth); see `bench_share`.
    paired: Option<PairedShare>,
}

#[derive(Serialize)]
struct ThreadResult {
    threads: usize,
    /// Measured read bandwidth of main memory with these threads, GB/s (null with --no-bandwidth).
    read_bandwidth_gb_s: Option<f64>,
    depths: Vec<DepthResult>,
    /// Time per operator class and phase (with --profile).
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<serde_json::Value>,
}

fn run_local(mut a: LocalArgs) -> Result<()> {
    if let Some(t) = a.model.threads {
        a.thread_counts = vec![t];
    }
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
    // the device first (a build or machine without it fails before the load), the layers placed after it
    let backend = margs.device.open()?;
    let load_pool = compute_pool(Some(*a.thread_counts.iter().max().expect("non-empty")))?;
    let ctx = Some(max_depth + a.decode_tokens);
    let loaded = crate::load_host_placed(&margs, &load_pool, None, &[], backend.as_ref(), ctx)?;
    drop(load_pool);
    let placement = crate::device_args::placement_of(&loaded.model, backend.as_ref());
    if let (Some(line), false) = (&placement, a.json) {
        eprintln!("{line}");
    }
    let peak_rss_after_load = bench_report::peak_rss();
    let weight_bytes = loaded.model.weight_bytes();
    let file_bytes = checkpoint_file_bytes(&loaded.dir);
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
        let device = match loaded.model.device_weight_bytes() {
            0 => String::new(),
            d => format!(" on the host, {:.1} MB on devices", d as f64 / 1e6),
        };
        eprintln!(
            "weights held {:.1} MB{device} (checkpoint files {:.1} MB); peak resident memory after load {}",
            loaded.model.host_weight_bytes() as f64 / 1e6,
            file_bytes as f64 / 1e6,
            peak_rss_after_load.map_or("unknown".into(), |b| format!("{:.1} MB", b as f64 / 1e6)),
        );
    }
    let mut results = Vec::new();
    for &threads in &a.thread_counts {
        let pool = ComputePool::new(threads)?;
        // the host's read bandwidth says nothing of layers on a device
        let bw = (!a.no_bandwidth && placement.is_none())
            .then(|| bench_report::read_bandwidth(&pool) / 1e9);
        if let (Some(bw), false) = (bw, a.json) {
            eprintln!("threads {threads}: read bandwidth {bw:.1} GB/s");
        }
        profile::set_enabled(a.profile);
        let _ = profile::take();
        let run = run_threads(
            &a,
            &loaded.model,
            &margs,
            &pool,
            &depths,
            &prompt,
            loaded.model.decode_weight_bytes(),
            bw,
        )?;
        profile::set_enabled(false);
        let prof = a.profile.then(profile::take);
        if let (Some(p), false) = (&prof, a.json) {
            eprintln!(
                "profile, threads {threads} (prefill {} tokens, decode {} tokens):\n{}",
                run.prefill.tokens,
                run.decode.tokens,
                bench_report::profile_table(p, run.prefill, run.decode)
            );
        }
        results.push(ThreadResult {
            threads,
            read_bandwidth_gb_s: bw,
            depths: run.depths,
            profile: prof.as_ref().map(bench_report::profile_json),
        });
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
        "weight_bytes": weight_bytes,
        "host_weight_bytes": loaded.model.host_weight_bytes(),
        "device_weight_bytes": loaded.model.device_weight_bytes(),
        "placement": placement,
        "checkpoint_bytes": file_bytes,
        "peak_rss_after_load_bytes": peak_rss_after_load,
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

/// One thread count's measurements.
struct ThreadRun {
    depths: Vec<DepthResult>,
    prefill: PhaseWork,
    decode: PhaseWork,
}

/// Prefills `prompt` up to each depth in ubatches and decodes `a.decode_tokens` greedy tokens there (then rewinds).
#[allow(clippy::too_many_arguments)]
fn run_threads(
    a: &LocalArgs,
    model: &std::sync::Arc<backburner_model::Model>,
    margs: &ModelArgs,
    pool: &ComputePool,
    depths: &[usize],
    prompt: &[u32],
    // what a decode step reads of the weights (an untied embedding: one row), MoE experts whole
    weight_bytes: usize,
    bw: Option<f64>,
) -> Result<ThreadRun> {
    let threads = pool.threads();
    let mut s = Session::new(model.clone(), margs.session_options(pool))?;
    let reads = bw.is_some().then(|| WeightPass::new(model));
    let mut out = Vec::new();
    let (mut prefill, mut decode) = (PhaseWork::default(), PhaseWork::default());
    let mut done = 0;
    for &depth in depths {
        let t0 = Instant::now();
        while done < depth {
            let end = (done + margs.ubatch).min(depth);
            s.prefill(&prompt[done..end], Logits::Last, |_, _| {})?;
            done = end;
        }
        prefill.seconds += t0.elapsed().as_secs_f64();
        prefill.tokens = depth;
        let prefill_s = prefill.seconds;
        // Decode from this depth, then rewind. Any id will do as the first input; then follow the greedy choice.
        let snap = s.snapshot();
        let experts0 = model.expert_bytes_read();
        let dec_s = bench_share::decode_greedy(&mut s, prompt[depth - 1], a.decode_tokens)?;
        let routed = (model.expert_bytes_read() - experts0) / a.decode_tokens.max(1) as u64;
        decode.seconds += dec_s;
        decode.tokens += a.decode_tokens;
        s.rewind(&snap);
        let decode_tok_s = a.decode_tokens as f64 / dec_s;
        // a dense model reads every weight per token; an MoE model its routed experts only
        let weight_bytes = (weight_bytes - model.expert_bytes()) as u64 + routed;
        let read_bytes = decode_read_bytes(model.config(), margs, depth, weight_bytes);
        let paired = match &reads {
            Some(reads) => Some(bench_share::decode_share(
                &mut s,
                pool,
                reads,
                prompt[depth - 1],
                &snap,
                (read_bytes, weight_bytes),
            )?),
            None => None,
        };
        let r = DepthResult {
            depth,
            prefill_tok_s: depth as f64 / prefill_s,
            prefill_s,
            decode_tok_s,
            decode_ms_per_token: dec_s * 1e3 / a.decode_tokens as f64,
            decode_weight_bytes_per_token: weight_bytes,
            decode_weight_gb_s: weight_bytes as f64 * decode_tok_s / 1e9,
            decode_read_gb_s: read_bytes as f64 * decode_tok_s / 1e9,
            paired,
        };
        if !a.json {
            let pct = |x: f64| bw.map_or(String::new(), |bw| format!(" = {:.0}%", 100.0 * x / bw));
            eprintln!(
                "threads {threads} depth {depth:>6}: prefill {:>8.1} tok/s ({:.1} s)  decode {:>7.2} tok/s ({:.1} ms/token; weights {:.1} GB/s{}, with KV and state {:.1} GB/s{})",
                r.prefill_tok_s,
                r.prefill_s,
                r.decode_tok_s,
                r.decode_ms_per_token,
                r.decode_weight_gb_s,
                pct(r.decode_weight_gb_s),
                r.decode_read_gb_s,
                pct(r.decode_read_gb_s),
            );
            if let Some(p) = &r.paired {
                eprintln!("  {}", p.summary());
            }
        }
        out.push(r);
    }
    Ok(ThreadRun {
        depths: out,
        prefill,
        decode,
    })
}

/// Bytes one decode step at `depth` reads: `weight_bytes`, the KV cache of `depth` positions and the Gated DeltaNet
/// states (saturating: a figure for a report).
fn decode_read_bytes(cfg: &ModelConfig, margs: &ModelArgs, depth: usize, weight_bytes: u64) -> u64 {
    let layers = 0..cfg.num_hidden_layers;
    let kv = backburner_model::KvOptions {
        page_size: margs.kv_page_size,
        dtype: margs.kv_dtype,
    };
    let kv_bytes = memory::kv_bytes(cfg, layers.clone(), kv, depth).unwrap_or(u64::MAX);
    let state = memory::recurrent_bytes(cfg, layers).unwrap_or(u64::MAX);
    weight_bytes.saturating_add(kv_bytes).saturating_add(state)
}

/// Total size of the files holding the checkpoint's tensors at `path` (safetensors shards or GGUF parts; not other
/// `*.safetensors` files beside them), 0 when they cannot be listed.
fn checkpoint_file_bytes(path: &std::path::Path) -> u64 {
    backburner_model::Checkpoint::open(path)
        .and_then(|c| c.files())
        .map(|f| f.iter().map(|(_, len)| len).sum())
        .unwrap_or(0)
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

/// The model of `args` loaded on `pool`, or the bench model (generated once) when `--model` is not given; returns
/// the arguments with the model's directory filled in.
pub fn load_or_bench_model(
    args: &ModelArgs,
    pool: &ComputePool,
) -> Result<(ModelArgs, crate::Loaded)> {
    let mut margs = args.clone();
    if margs.model.is_none() {
        margs.model = Some(bench_model_dir()?);
    }
    let loaded = load(&margs, pool)?;
    Ok((margs, loaded))
}

/// The bundled bench model's directory, generated on first use (random weights of [`bench_config`]).
pub fn bench_model_dir() -> Result<std::path::PathBuf> {
    default_model::ensure_at(
        &default_model::cache_dir().join("bench-model-v1"),
        &bench_config(),
    )
}

/// Runs a benchmark (each on the CPU path but `bench local`, which places `--device-layers` on `--device`; the
/// others refuse a device other than cpu).
pub fn run(a: BenchArgs) -> Result<()> {
    use BenchKind as K;
    let model = match &a.kind {
        K::Local(a) => Some(&a.model),
        K::SplitPrefill(a) => Some(&a.model),
        K::DecodeOffload(a) => Some(&a.model),
        K::LayerSplit(a) => Some(&a.model),
        K::Session(a) => Some(&a.model),
        K::Slots(a) => Some(&a.model),
        K::Spec(a) => Some(&a.model),
        K::GenGguf(_) | K::SeedTable(_) => None,
    };
    if let (Some(m), false) = (model, matches!(a.kind, K::Local(_))) {
        m.device.refuse(
            "the benchmarks other than `bench local` (their workers, slots and speculative steps run the CPU path)",
        )?;
    }
    match a.kind {
        BenchKind::Local(l) => run_local(l),
        BenchKind::SplitPrefill(a) => crate::bench_split::run(a),
        BenchKind::DecodeOffload(a) => crate::bench_offload::run(a),
        BenchKind::LayerSplit(a) => crate::bench_layer_split::run(a),
        BenchKind::Session(a) => crate::bench_session::run(a),
        BenchKind::Slots(a) => crate::bench_slots::run(a),
        BenchKind::Spec(a) => crate::bench_spec::run(a),
        BenchKind::GenGguf(a) => crate::bench_gen_gguf::run(a),
        BenchKind::SeedTable(a) => crate::bench_seed::run(a),
    }
}

/// The emulated link of the benches' shaped configurations (a one-way delay and a line rate on every frame the
/// host sends; see ../shared/LINK_EMULATION.md), shared by `bench split-prefill`, `decode-offload` and
/// `layer-split`.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct ShapedLinkArgs {
    /// Emulated link: one-way delay in µs.
    #[arg(long, default_value_t = 48)]
    pub shaped_delay_us: u64,
    /// Emulated link: rate in Gbit/s.
    #[arg(long, default_value_t = 10.0)]
    pub shaped_gbit: f64,
}

impl ShapedLinkArgs {
    /// The shaper. Errors: a rate that is not a finite number in (0, 10 000] Gbit/s.
    pub fn shaper(&self) -> Result<backburner_link::Shaper> {
        if !(self.shaped_gbit.is_finite() && self.shaped_gbit > 0.0 && self.shaped_gbit <= 1e4) {
            anyhow::bail!(
                "--shaped-gbit {} must be a rate in (0, 10000] Gbit/s",
                self.shaped_gbit
            );
        }
        Ok(backburner_link::Shaper {
            delay: std::time::Duration::from_micros(self.shaped_delay_us),
            // at most 10^13 bit/s: exact in u64
            rate_bps: (self.shaped_gbit * 1e9).round() as u64,
        })
    }

    /// `{"one_way_delay_us", "gbit_s"}` for the benches' JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"one_way_delay_us": self.shaped_delay_us, "gbit_s": self.shaped_gbit})
    }
}
