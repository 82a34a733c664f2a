//! A device's memory as a budget (`plan --device cuda:0 --device-memory 80G`): how many of the host's first layers
//! fit on the device, the rest staying on the CPU, as llama.cpp's `-ngl` places them and `run --device D
//! --device-layers N` carries out.
//!
//! A layer on the device takes its weights ([`ModelCosts::layer_weight_bytes`], the planner's per-layer accounting),
//! its KV at the plan's context (a full-attention layer) or its recurrent and conv state (a Gated DeltaNet layer);
//! the device keeps back [`DEVICE_RUNTIME_RESERVE`] for its runtime plus one ubatch's activations
//! ([`ModelCosts::scratch_bytes`]). The device takes the longest prefix of the host's layers that fits. Layers on a
//! device run on a host alone for now, so a plan with workers is refused; a mixture-of-experts layer does not run on
//! a device yet, so the prefix ends before the first one.

use std::ops::Range;

use backburner_model::{FfnKind, LayerKind};
use serde::Serialize;

use super::{range_pair, ModelCosts, Plan, PlanError, PlanRequest};

/// Bytes a device keeps back for its runtime beside the layers and the activations: the driver's context, the
/// loaded kernels and the math libraries' workspaces (about 0.5 GiB for a CUDA context on an H100; 1 GiB is the
/// margin). A stated constant, not a measurement of any one driver.
pub const DEVICE_RUNTIME_RESERVE: u64 = 1 << 30;

/// What the planner is told of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceBudget {
    /// Its id as `--device` spells it (`cuda:0`).
    pub id: String,
    /// Bytes of memory it offers (given, or its total memory as its driver reports it).
    pub memory: u64,
}

/// The layers a plan puts on a device and what they take there. Sizes are bytes; positions are tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DevicePlacement {
    /// The device (`cuda:0`).
    pub device: String,
    /// Bytes of memory it offers.
    pub memory: u64,
    /// Bytes kept back: [`DEVICE_RUNTIME_RESERVE`] plus one ubatch's activations.
    pub reserve_bytes: u64,
    /// The layers on the device: the first of the host's (empty when none fit).
    #[serde(serialize_with = "range_pair")]
    pub layers: Range<usize>,
    /// Weight bytes of those layers (the host keeps its own copy: the plan's host figures stand).
    pub weight_bytes: u64,
    /// Recurrent + conv state bytes of its Gated DeltaNet layers.
    pub state_bytes: u64,
    /// KV positions its attention layers hold (the plan's context).
    pub kv_positions: usize,
    /// Bytes of those KV rows.
    pub kv_bytes: u64,
    /// The host's layers that stay on the CPU.
    #[serde(serialize_with = "range_pair")]
    pub cpu_layers: Range<usize>,
    /// The flags of `run` (and `perplexity`) that carry it out: `--device cuda:0 --device-layers N`.
    pub flags: String,
}

impl DevicePlacement {
    /// Everything the device holds: reserve + weights + state + KV (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.reserve_bytes
            .saturating_add(self.weight_bytes)
            .saturating_add(self.state_bytes)
            .saturating_add(self.kv_bytes)
    }
}

/// Bytes a device keeps back for ubatches of `ubatch` tokens: [`DEVICE_RUNTIME_RESERVE`] + the activations of one
/// ubatch through decoder layers ([`ModelCosts::scratch_bytes`] without the ends).
pub fn device_reserve(costs: &ModelCosts, ubatch: usize) -> u64 {
    DEVICE_RUNTIME_RESERVE.saturating_add(costs.scratch_bytes(ubatch, true, false))
}

/// Bytes layer `l` takes on a device at `positions` KV positions: its weights, plus its KV rows (full attention)
/// or its recurrent and conv state (Gated DeltaNet).
pub fn layer_device_bytes(costs: &ModelCosts, l: usize, positions: usize) -> u64 {
    let held = match costs.layer_kinds[l] {
        LayerKind::FullAttention => costs.kv_bytes(l..l + 1, positions),
        _ => costs.state_bytes(l..l + 1),
    };
    costs.layer_weight_bytes[l].saturating_add(held)
}

/// The longest prefix of `plan`'s host layers that fits `dev` at the plan's context (see the module docs), with
/// the notes that say what limited it.
///
/// Errors: [`PlanError::Invalid`] when the plan has workers (layers on a device run on a host alone for now).
pub fn place_on_device(
    req: &PlanRequest,
    plan: &Plan,
    dev: &DeviceBudget,
) -> Result<(DevicePlacement, Vec<String>), PlanError> {
    if !plan.workers.is_empty() {
        return Err(PlanError::Invalid(format!(
            "--device {}: layers on a device run on a host alone for now, not with workers (docs/DEVICES.md)",
            dev.id
        )));
    }
    let costs = &req.costs;
    let held = plan.host.layers.clone();
    let positions = plan.ctx;
    let reserve = device_reserve(costs, req.ubatch);
    let mut notes = Vec::new();
    let mut used = reserve;
    let mut end = held.start;
    for l in held.clone() {
        if req.config.ffn_types.get(l) == Some(&FfnKind::Moe) {
            notes.push(format!(
                "layer {l} is a mixture-of-experts layer, which does not run on a device yet: layers {l}.. stay on \
                 the CPU"
            ));
            break;
        }
        let next = used.saturating_add(layer_device_bytes(costs, l, positions));
        if next > dev.memory {
            break;
        }
        used = next;
        end = l + 1;
    }
    if reserve > dev.memory {
        notes.push(format!(
            "{} offers {} bytes, less than the {reserve} it keeps back for its runtime and a ubatch's activations: \
             no layer fits",
            dev.id, dev.memory
        ));
    }
    let layers = held.start..end;
    if layers.is_empty() {
        notes.push(format!(
            "no layer fits on {}: every layer runs on the CPU (no --device flags)",
            dev.id
        ));
    }
    let placement = DevicePlacement {
        device: dev.id.clone(),
        memory: dev.memory,
        reserve_bytes: reserve,
        weight_bytes: costs.weight_bytes(layers.clone()),
        state_bytes: costs.state_bytes(layers.clone()),
        kv_positions: positions,
        kv_bytes: costs.kv_bytes(layers.clone(), positions),
        cpu_layers: end..held.end,
        flags: format!("--device {} --device-layers {}", dev.id, layers.len()),
        layers,
    };
    Ok((placement, notes))
}

/// [`super::plan`], then the device's share of the host's layers ([`place_on_device`]) in [`Plan::device`], with its
/// notes.
///
/// Errors: those of [`super::plan`] and [`place_on_device`].
pub fn plan_with_device(req: &PlanRequest, dev: &DeviceBudget) -> Result<Plan, PlanError> {
    let mut p = super::plan(req)?;
    let (d, notes) = place_on_device(req, &p, dev)?;
    p.notes.extend(notes);
    if !d.layers.is_empty() {
        p.notes.push(format!(
            "layers {}..{} on {} hold the KV of {} positions (attention layers): run with --ctx-size {} or less; \
             the host keeps its own copy of their weights",
            d.layers.start, d.layers.end, d.device, d.kv_positions, d.kv_positions
        ));
    }
    p.device = Some(d);
    Ok(p)
}
