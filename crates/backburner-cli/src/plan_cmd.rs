//! `backburner plan`: print a placement.

use std::path::PathBuf;

use anyhow::{Context, Result};
use backburner_engine::memory::human;
use backburner_engine::offload::parse_bytes;
use backburner_engine::plan::{
    self, summary, Calibration, DevicePlan, ModelCosts, Plan, PlanRequest,
};
use backburner_kernels::kv::KvDtype;
use clap::Args;

use crate::run_cmd::out_line;

/// `backburner plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// Model: a directory with config.json, with or without weights (without, sizes come from the config's shapes and
    /// dtype), or a GGUF file (or a directory holding one). Default: the bundled model.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Memory the host may use: bytes with a unit, `24GiB` (2^30) or `24GB` (10^9). Default: this machine's
    /// physical memory (`MemTotal` of /proc/meminfo).
    #[arg(long, value_parser = parse_bytes)]
    host_memory: Option<u64>,
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
    /// KV cache dtype: f16, f32 or bf16 (bf16 needs a model with an even head_dim).
    #[arg(long, default_value = "f16")]
    kv_dtype: KvDtype,
    /// Positions per KV page.
    #[arg(long, default_value_t = 4096)]
    kv_page_size: usize,
}

/// Runs `backburner plan`.
pub fn run(a: PlanArgs) -> Result<()> {
    let model = match &a.model {
        Some(m) => m.clone(),
        None => crate::default_model::ensure()?,
    };
    let (config, costs) = ModelCosts::from_dir(&model, a.kv_dtype)
        .with_context(|| format!("read the model in {}", model.display()))?;
    let kv = backburner_model::KvOptions {
        page_size: a.kv_page_size,
        dtype: a.kv_dtype,
    };
    kv.check(&config).map_err(|m| anyhow::anyhow!("{m}"))?;
    let calibration = match &a.calibration {
        Some(p) => {
            let text =
                crate::prompt::read_bounded(p, crate::prompt::MAX_SIDE_FILE, "calibration file")?;
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
        host_memory: match a.host_memory {
            Some(m) => m,
            None => this_machine_memory()?,
        },
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
        human(d.weight_bytes),
        human(d.state_bytes),
        d.kv_positions,
        human(d.kv_bytes),
        human(d.scratch_bytes),
        human(d.total_bytes()),
        if d.memory >= backburner_engine::plan::UNKNOWN_MEMORY {
            "?".to_string()
        } else {
            human(d.memory)
        }
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
    out_line(&format!("weights: {}", p.weights.describe()));
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

/// This machine's physical memory (bytes), from `/proc/meminfo`. Errors: where it cannot be read (then
/// `--host-memory` is needed).
fn this_machine_memory() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .and_then(|kib| kib.checked_mul(1024))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "cannot read this machine's memory from /proc/meminfo: give --host-memory"
            )
        })
}
