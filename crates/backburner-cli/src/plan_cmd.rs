//! `backburner plan` (print a placement) and `backburner calibrate` (measure the host's speed for it).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use backburner_engine::offload::parse_bytes;
use backburner_engine::plan::{
    self, fmt_gb, summary, Calibration, DevicePlan, DeviceTimes, ModelCosts, Plan, PlanRequest,
};
use backburner_engine::{Logits, Session};
use backburner_kernels::kv::KvDtype;
use clap::Args;

use crate::run_cmd::out_line;

/// `backburner plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// Model directory: config.json, with or without weights (without, sizes come from the config's shapes and dtype).
    #[arg(long)]
    model: PathBuf,
    /// Memory the host may use: bytes with a unit, `24GiB` (2^30) or `24GB` (10^9).
    #[arg(long, value_parser = parse_bytes)]
    host_memory: u64,
    /// Memory of a worker, once per worker in chain order (same units).
    #[arg(long, value_parser = parse_bytes)]
    worker_memory: Vec<u64>,
    /// Context wanted in tokens (default: the largest that fits, up to max_position_embeddings).
    #[arg(long)]
    ctx: Option<usize>,
    /// Calibration file written by `backburner calibrate` (gives expected rates).
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    /// Fixed first split points L1,L2,… (forces layer split; the rest is placed).
    #[arg(long, value_delimiter = ',')]
    layer_split: Option<Vec<usize>>,
    /// Tokens per prefill ubatch (sizes the scratch).
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    /// KV cache dtype: f16 or f32.
    #[arg(long, default_value = "f16")]
    kv_dtype: KvDtype,
    /// Positions per KV page.
    #[arg(long, default_value_t = 4096)]
    kv_page_size: usize,
}

/// Runs `backburner plan`.
pub fn run(a: PlanArgs) -> Result<()> {
    let (config, costs) = ModelCosts::from_dir(&a.model, a.kv_dtype)
        .with_context(|| format!("read the model in {}", a.model.display()))?;
    let calibration = match &a.calibration {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            Some(
                serde_json::from_str::<Calibration>(&text)
                    .with_context(|| format!("{} is not a calibration file", p.display()))?,
            )
        }
        None => None,
    };
    let req = PlanRequest {
        config,
        costs,
        host_memory: a.host_memory,
        worker_memory: a.worker_memory,
        ctx: a.ctx,
        ubatch: a.ubatch,
        page_size: a.kv_page_size,
        layer_split: a.layer_split,
        calibration,
    };
    let p = plan::plan(&req)?;
    if a.json {
        out_line(&serde_json::to_string_pretty(&p)?);
    } else {
        print_plan(&p);
    }
    Ok(())
}

/// GB (10^9) from 1 GB up, MB (10^6) below, so small states do not print as 0.
fn size(b: u64) -> String {
    if b >= 1_000_000_000 {
        fmt_gb(b)
    } else {
        format!("{} MB", b.div_ceil(1_000_000))
    }
}

fn row(d: &DevicePlan) -> String {
    let layers = if d.layers.is_empty() {
        "-".to_string()
    } else {
        format!("{}..{}", d.layers.start, d.layers.end)
    };
    let layers = if d.holds_ends {
        format!("{layers} +ends")
    } else {
        layers
    };
    format!(
        "{:<9} {:<12} {:>9} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9}",
        d.name,
        layers,
        size(d.weight_bytes),
        size(d.state_bytes),
        d.kv_positions,
        size(d.kv_bytes),
        size(d.scratch_bytes),
        size(d.total_bytes()),
        fmt_gb(d.memory)
    )
}

fn print_plan(p: &Plan) {
    out_line(&format!("plan: {}", summary(p)));
    out_line(&format!(
        "{:<9} {:<12} {:>9} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9}",
        "device", "layers", "weights", "state", "KV pos", "KV", "scratch", "total", "memory"
    ));
    out_line(&row(&p.host));
    for w in &p.workers {
        out_line(&row(w));
    }
    out_line(&format!(
        "context: {} tokens, {} fit this placement",
        p.ctx, p.max_ctx
    ));
    out_line(&format!(
        "link: {} bytes per prefill token, {} bytes per decode token",
        p.link.prefill_bytes_per_token, p.link.decode_bytes_per_token
    ));
    match &p.expected {
        Some(r) => out_line(&format!(
            "expected: prefill {:.1} tok/s, decode {:.2} tok/s ({:.2} ms host + {:.2} ms workers + {:.2} ms link per token)",
            r.prefill_tok_s, r.decode_tok_s, r.decode_ms.host, r.decode_ms.workers, r.decode_ms.link
        )),
        None => out_line("expected: no calibration (see `backburner calibrate`)"),
    }
    for n in &p.notes {
        out_line(&format!("note: {n}"));
    }
}

/// `backburner calibrate`.
#[derive(Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    model: crate::ModelArgs,
    /// A worker to measure (not implemented yet: the command refuses rather than guess).
    #[arg(long)]
    worker: Vec<String>,
    /// Where to write the calibration JSON.
    #[arg(long)]
    out: PathBuf,
    /// Decode steps to time.
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
}

/// Runs `backburner calibrate`: times one prefill ubatch (at most `--ubatch`, 512 by default, and at most the
/// context) and `--decode-tokens` decode steps of the real model on the host, takes the ends out (timed apart),
/// and divides by the layer count.
pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    if !a.worker.is_empty() {
        bail!("worker calibration is not implemented yet: run `backburner calibrate` without --worker and fill the \"workers\" and \"link\" fields of the file by hand");
    }
    if a.decode_tokens == 0 {
        bail!("--decode-tokens must be ≥ 1");
    }
    let threads = crate::thread_count(a.model.threads)?;
    let pool = crate::compute_pool(a.model.threads)?;
    let loaded = crate::load(&a.model, &pool)?;
    let model = loaded.model.clone();
    let cfg = model.config().clone();
    let n = cfg.num_hidden_layers as f64;
    let t = a
        .model
        .ubatch
        .min(512)
        .min(cfg.max_position_embeddings.saturating_sub(a.decode_tokens))
        .max(1);
    let ids: Vec<u32> = (0..t as u32)
        .map(|i| (i * 7919) % cfg.vocab_size as u32)
        .collect();
    let (embed_us, head_us) = time_ends(&model, &ids, &pool)?;
    let mut s = Session::new(model.clone(), a.model.session_options(&pool))?;
    let t0 = Instant::now();
    let logits = s.prefill(&ids, Logits::Last, |_, _| {})?;
    let prefill_us = t0.elapsed().as_secs_f64() * 1e6;
    let mut next = backburner_engine::argmax(&logits);
    let t0 = Instant::now();
    for _ in 0..a.decode_tokens {
        next = backburner_engine::argmax(&s.decode(next)?);
    }
    let decode_us = t0.elapsed().as_secs_f64() * 1e6 / a.decode_tokens as f64;
    let ends_prefill = embed_us + head_us / t as f64;
    let ends_decode = embed_us + head_us;
    let cal = Calibration {
        version: 1,
        model: format!(
            "{} ({} layers)",
            loaded.dir.display(),
            cfg.num_hidden_layers
        ),
        host: DeviceTimes {
            threads,
            prefill_us_per_token_layer: ((prefill_us / t as f64 - ends_prefill) / n).max(0.0),
            decode_us_per_layer: ((decode_us - ends_decode) / n).max(0.0),
            ends_prefill_us_per_token: ends_prefill,
            ends_decode_us: ends_decode,
            prefill_tokens: t,
        },
        workers: Vec::new(),
        link: None,
    };
    let text = serde_json::to_string_pretty(&cal)?;
    std::fs::write(&a.out, text + "\n").with_context(|| format!("write {}", a.out.display()))?;
    eprintln!(
        "host: prefill {:.2} µs/token/layer ({t} tokens), decode {:.1} µs/layer; worker and link fields left empty (not measured yet)",
        cal.host.prefill_us_per_token_layer, cal.host.decode_us_per_layer
    );
    Ok(())
}

/// (embedding µs per token, final norm + head µs for one row), each the best of three.
fn time_ends(
    model: &Arc<backburner_model::Model>,
    ids: &[u32],
    pool: &backburner_engine::ComputePool,
) -> Result<(f64, f64)> {
    let mut embed = f64::MAX;
    let mut head = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let x = pool.install(|| model.embed(ids))?;
        embed = embed.min(t0.elapsed().as_secs_f64() * 1e6 / ids.len() as f64);
        let h = model.config().hidden_size;
        let t0 = Instant::now();
        pool.install(|| model.logits(&x[..h], 1))?;
        head = head.min(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok((embed, head))
}
