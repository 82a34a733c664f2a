//! A device's memory as a budget: how many of a model's first layers fit a device (`plan --device cuda:0
//! --device-memory 80G`, and `run --device-layers auto`), the rest staying on the CPU, as llama.cpp's `-ngl` places
//! them and `run --device D --device-layers N` carries out.
//!
//! A layer on the device takes its weights ([`ModelCosts::layer_weight_bytes`], the planner's per-layer accounting),
//! its KV at the context (a full-attention layer) or its recurrent and conv state (a Gated DeltaNet layer), once per
//! sequence held; the device keeps back [`DEVICE_RUNTIME_RESERVE`] for its runtime plus one ubatch's activations
//! ([`ModelCosts::scratch_bytes`]). The device takes the longest prefix of the layers that fits ([`fit_layers`]); a
//! mixture-of-experts layer does not run on a device yet, so the prefix ends before the first one. The host holds
//! the weights of the other layers and the ends only (the placed layers' weights are not kept on the host); how the
//! plan shares memory and context between the two is in `device_plan.rs`.

use std::ops::Range;

use backburner_model::{FfnKind, LayerKind, ModelConfig};
use serde::Serialize;

use super::{range_pair, ModelCosts};

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

/// What a device is asked to hold: a model's layers for `sequences` sequences of `positions` KV positions.
#[derive(Clone, Copy, Debug)]
pub struct DeviceLoad<'a> {
    /// The model's config (which layers are mixture-of-experts).
    pub config: &'a ModelConfig,
    /// The model's costs ([`ModelCosts::from_dir`]).
    pub costs: &'a ModelCosts,
    /// Bytes the device offers (free memory, or the budget given).
    pub memory: u64,
    /// KV positions (tokens) each sequence holds in every full-attention layer: the context.
    pub positions: usize,
    /// Sequences held at once, each with its own KV and state (`serve`'s slots; 1 for `run` and plans).
    pub sequences: usize,
    /// Tokens per prefill ubatch (sizes the activations in the reserve).
    pub ubatch: usize,
}

/// Why a device's prefix of layers ends where it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FitStop {
    /// Every layer asked for fits.
    AllFit,
    /// Layer `layer` needs `need` bytes and `left` bytes are left after the reserve and the layers before it (0 when
    /// the reserve alone is more than the memory).
    Memory {
        /// The first layer that does not fit.
        layer: usize,
        /// Bytes it would take (weights, KV or state).
        need: u64,
        /// Bytes left for it.
        left: u64,
    },
    /// Layer `layer` is a mixture-of-experts layer, which does not run on a device yet.
    Moe {
        /// The first such layer.
        layer: usize,
    },
    /// Every layer fits but the output head (final norm and head matrix) that goes with them does not: the last
    /// layer stays on the CPU, and the head with it.
    Head {
        /// Bytes the head would take.
        need: u64,
        /// Bytes left for it after every layer.
        left: u64,
    },
}

/// The longest prefix of layers that fits a device ([`fit_layers`]) and what it takes there. Sizes are bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFit {
    /// The layers on the device (empty when none fit).
    pub layers: Range<usize>,
    /// Bytes kept back: [`device_reserve`].
    pub reserve_bytes: u64,
    /// Weight bytes of those layers.
    pub weight_bytes: u64,
    /// Recurrent + conv state bytes of their Gated DeltaNet layers, all sequences.
    pub state_bytes: u64,
    /// KV bytes of their attention layers, all sequences.
    pub kv_bytes: u64,
    /// Bytes of the final norm and output head, on the device when every layer of the model is (0 otherwise).
    pub head_bytes: u64,
    /// Why the prefix ends there.
    pub stop: FitStop,
}

impl DeviceFit {
    /// Everything the device holds: reserve + weights + head + state + KV (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.reserve_bytes
            .saturating_add(self.weight_bytes)
            .saturating_add(self.head_bytes)
            .saturating_add(self.state_bytes)
            .saturating_add(self.kv_bytes)
    }
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
    /// The layers on the device: the first of the model's (empty when none fit).
    #[serde(serialize_with = "range_pair")]
    pub layers: Range<usize>,
    /// Weight bytes of those layers (held on the device only: the host holds the other layers' and the ends').
    pub weight_bytes: u64,
    /// Bytes of the final norm and output head, on the device when every layer is (the host keeps its copy too).
    pub head_bytes: u64,
    /// Recurrent + conv state bytes of its Gated DeltaNet layers.
    pub state_bytes: u64,
    /// KV positions its attention layers hold: the plan's context (KV offload: the newest positions kept).
    pub kv_positions: usize,
    /// Bytes of those KV rows.
    pub kv_bytes: u64,
    /// The layers that run on the CPU (the host holds them).
    #[serde(serialize_with = "range_pair")]
    pub cpu_layers: Range<usize>,
    /// The flags of `run` (and `perplexity`) that carry it out: `--device cuda:0 --device-layers N`.
    pub flags: String,
}

impl DevicePlacement {
    /// Everything the device holds: reserve + weights + head + state + KV (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.reserve_bytes
            .saturating_add(self.weight_bytes)
            .saturating_add(self.head_bytes)
            .saturating_add(self.state_bytes)
            .saturating_add(self.kv_bytes)
    }

    /// The placement of `fit` on `dev` for a model of `n_layers` layers, its KV at `kv_positions`.
    pub fn of(dev: &DeviceBudget, fit: &DeviceFit, kv_positions: usize, n_layers: usize) -> Self {
        DevicePlacement {
            device: dev.id.clone(),
            memory: dev.memory,
            reserve_bytes: fit.reserve_bytes,
            layers: fit.layers.clone(),
            weight_bytes: fit.weight_bytes,
            head_bytes: fit.head_bytes,
            state_bytes: fit.state_bytes,
            kv_positions,
            kv_bytes: fit.kv_bytes,
            cpu_layers: fit.layers.end..n_layers,
            flags: format!("--device {} --device-layers {}", dev.id, fit.layers.len()),
        }
    }
}

/// Bytes a device keeps back for ubatches of `ubatch` tokens: [`DEVICE_RUNTIME_RESERVE`] + the activations of one
/// ubatch through decoder layers ([`ModelCosts::scratch_bytes`] without the ends).
pub fn device_reserve(costs: &ModelCosts, ubatch: usize) -> u64 {
    DEVICE_RUNTIME_RESERVE.saturating_add(costs.scratch_bytes(ubatch, true, false))
}

/// Bytes layer `l` takes on a device for one sequence of `positions` KV positions: its weights, plus its KV rows
/// (full attention) or its recurrent and conv state (Gated DeltaNet).
pub fn layer_device_bytes(costs: &ModelCosts, l: usize, positions: usize) -> u64 {
    costs.layer_weight_bytes[l].saturating_add(per_sequence(costs, l, positions))
}

/// Bytes of layer `l`'s KV rows at `positions` (full attention) or its state (Gated DeltaNet), one sequence.
fn per_sequence(costs: &ModelCosts, l: usize, positions: usize) -> u64 {
    match costs.layer_kinds[l] {
        LayerKind::FullAttention => costs.kv_bytes(l..l + 1, positions),
        _ => costs.state_bytes(l..l + 1),
    }
}

/// The longest prefix of `held` that fits the device of `load`: after the reserve ([`device_reserve`]), each layer
/// in order takes its weights plus, per sequence, its KV at `load.positions` or its state, until one does not fit
/// or is a mixture-of-experts layer ([`FitStop`]). Monotone: more positions, sequences or ubatch never give more
/// layers; more memory never fewer.
pub fn fit_layers(load: &DeviceLoad, held: Range<usize>) -> DeviceFit {
    let costs = load.costs;
    let seqs = load.sequences as u64;
    let reserve = device_reserve(costs, load.ubatch);
    let mut used = reserve;
    let mut end = held.start;
    let mut stop = FitStop::AllFit;
    for l in held.clone() {
        if load.config.ffn_types.get(l) == Some(&FfnKind::Moe) {
            stop = FitStop::Moe { layer: l };
            break;
        }
        let need = costs.layer_weight_bytes[l]
            .saturating_add(per_sequence(costs, l, load.positions).saturating_mul(seqs));
        let left = load.memory.saturating_sub(used);
        if need > left {
            stop = FitStop::Memory {
                layer: l,
                need,
                left,
            };
            break;
        }
        used += need;
        end = l + 1;
    }
    // every layer of the model on the device: the final norm and the head go too (`Model::from_checkpoint_placed`)
    let mut head_bytes = 0;
    if stop == FitStop::AllFit && held == (0..costs.layer_kinds.len()) && end > held.start {
        let head = head_device_bytes(costs);
        let left = load.memory.saturating_sub(used);
        if head > left {
            stop = FitStop::Head { need: head, left };
            end -= 1;
        } else {
            head_bytes = head;
        }
    }
    let layers = held.start..end;
    DeviceFit {
        reserve_bytes: reserve,
        weight_bytes: costs.weight_bytes(layers.clone()),
        state_bytes: costs.state_bytes(layers.clone()).saturating_mul(seqs),
        kv_bytes: costs
            .kv_bytes(layers.clone(), load.positions)
            .saturating_mul(seqs),
        head_bytes,
        layers,
        stop,
    }
}

/// Bytes the final norm and the output head take on a device: `lm_head`, or the embedding it is tied to.
pub fn head_device_bytes(costs: &ModelCosts) -> u64 {
    let e = &costs.ends;
    let head = if e.head > 0 { e.head } else { e.embedding };
    e.final_norm.saturating_add(head)
}

/// The notes that say what limited `fit` on device `id` of `memory` bytes (nothing when every layer fits).
pub(super) fn fit_notes(fit: &DeviceFit, id: &str, memory: u64) -> Vec<String> {
    let mut notes = Vec::new();
    match fit.stop {
        FitStop::Moe { layer } => notes.push(format!(
            "layer {layer} is a mixture-of-experts layer, which does not run on a device yet: layers {layer}.. stay \
             on the CPU"
        )),
        FitStop::Head { need, left } => notes.push(format!(
            "every layer fits on {id} but not the output head that goes with them ({need} bytes, {left} left): the \
             last layer and the head stay on the CPU"
        )),
        FitStop::Memory { .. } if fit.reserve_bytes > memory => notes.push(format!(
            "{id} offers {memory} bytes, less than the {} it keeps back for its runtime and a ubatch's activations: \
             no layer fits",
            fit.reserve_bytes
        )),
        _ => {}
    }
    if fit.layers.is_empty() {
        notes.push(format!(
            "no layer fits on {id}: every layer runs on the CPU (no --device flags)"
        ));
    }
    notes
}
