//! `backburner plan`: print a placement.

use std::path::PathBuf;

use anyhow::{Context, Result};
use backburner_engine::memory::human;
use backburner_engine::offload::parse_bytes;
use backburner_engine::plan::{
    self, summary, Calibration, DevicePlan, ModelCosts, Plan, PlanRequest,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::device::DeviceId;
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
    /// A device for the model's first layers (`cuda:0`, as `run --device` takes it): the plan says how many fit its
    /// memory (weights, their KV at the plan's context or their state, and a reserve for the runtime and a ubatch's
    /// activations), the rest staying on the CPU (the host then holds only their weights and the embedding and
    /// head), and the `run` command that places them. Workers then hold KV pages only. `cpu` places none.
    #[arg(long, value_parser = crate::device_args::parse_device)]
    device: Option<DeviceId>,
    /// Memory of --device with a unit (`80G` = 80 GiB, `141GB` = 141·10^9 bytes; a bare number under 1 MiB is
    /// refused as a forgotten unit), so that a plan needs no device; default: its total memory as this build reads
    /// it (the device must be present).
    #[arg(long, value_parser = crate::device_layers::parse_device_memory, requires = "device")]
    device_memory: Option<u64>,
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
        worker_memory: a.worker_memory.clone(),
        ctx: a.ctx,
        ubatch: a.ubatch,
        page_size: a.kv_page_size,
        layer_split: a.layer_split.clone(),
        calibration,
    };
    let p = match device_budget(&a)? {
        Some(d) => plan::plan_with_device(&req, &d)?,
        None => plan::plan(&req)?,
    };
    let command = p.device.as_ref().map(|d| run_command(&a, &p, d));
    if a.json {
        let mut v = serde_json::to_value(&p)?;
        if let Some(c) = command {
            v["device"]["command"] = c.into();
        }
        out_line(&serde_json::to_string_pretty(&v)?);
    } else {
        print_plan(&p);
        if let (Some(d), Some(c)) = (&p.device, command) {
            print_device(d, &c);
        }
    }
    Ok(())
}

/// The device of `--device` (none for `cpu`) with its memory: `--device-memory`, else what this build's registry
/// reads. Errors: a device this build or machine lacks without `--device-memory`.
fn device_budget(a: &PlanArgs) -> Result<Option<plan::DeviceBudget>> {
    let Some(id) = a.device.filter(|d| !d.is_cpu()) else {
        return Ok(None);
    };
    if id.kind == backburner_model::device::BackendKind::Vulkan {
        anyhow::bail!(
            "--device {id}: no build has a Vulkan backend yet (docs/DEVICES.md): plan for cuda:N"
        );
    }
    let memory = match a.device_memory {
        Some(m) => m,
        None => {
            let reg = crate::device_args::registry();
            match reg.info(id) {
                Some(i) => i.memory_bytes,
                None => anyhow::bail!(
                    "--device {id}: {}: give its memory with --device-memory (e.g. 80G) to plan for it",
                    match reg.has(id.kind) {
                        true => "not found on this machine",
                        false => "this build has no such backend (`backburner devices` lists what it has)",
                    }
                ),
            }
        }
    };
    Ok(Some(plan::DeviceBudget {
        id: id.to_string(),
        memory,
    }))
}

/// The `run` command line that carries out a plan with layers on a device: its context, KV dtype, ubatch and page
/// size, the device flags, and with KV offload a `--worker HOST:PORT` per worker holding pages and the
/// `--kv-budget` (workers that compute layers are never part of it: the command line refuses them beside a device).
fn run_command(a: &PlanArgs, p: &Plan, d: &plan::DevicePlacement) -> String {
    let model = a
        .model
        .as_ref()
        .map_or(String::new(), |m| format!(" --model {}", m.display()));
    let mut extra = String::new();
    if a.ubatch != 512 {
        extra.push_str(&format!(" --ubatch {}", a.ubatch));
    }
    if a.kv_page_size != 4096 {
        extra.push_str(&format!(" --kv-page-size {}", a.kv_page_size));
    }
    if !d.layers.is_empty() {
        extra.push_str(&format!(" {}", d.flags));
    }
    if let plan::Mode::KvOffload { host_kv_positions } = p.mode {
        let holding: Vec<usize> = (0..p.workers.len())
            .filter(|&i| p.workers[i].kv_positions > 0)
            .collect();
        for &i in &holding {
            match holding.len() {
                1 => extra.push_str(" --worker HOST:PORT"),
                _ => extra.push_str(&format!(" --worker HOST{}:PORT", i + 1)),
            }
        }
        extra.push_str(&format!(" --kv-budget {host_kv_positions}"));
    }
    format!(
        "backburner run{model} --ctx-size {} --kv-dtype {}{extra}",
        p.ctx, a.kv_dtype
    )
}

/// The device's lines: what its layers take, and the command.
fn print_device(d: &plan::DevicePlacement, command: &str) {
    let cpu = match d.cpu_layers.is_empty() {
        true => String::new(),
        false => format!("; {}..{} on cpu", d.cpu_layers.start, d.cpu_layers.end),
    };
    out_line(&format!(
        "{}: layers {}..{} (weights {}, state {}, KV {}, reserve {}: {} of {}){cpu}",
        d.device,
        d.layers.start,
        d.layers.end,
        human(d.weight_bytes),
        human(d.state_bytes),
        human(d.kv_bytes),
        human(d.reserve_bytes),
        human(d.total_bytes()),
        human(d.memory)
    ));
    out_line(&format!("command: {command}"));
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
