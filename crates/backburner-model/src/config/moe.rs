//! The mixture-of-experts settings of `qwen3_5_moe_text` (HF `Qwen3_5MoeTextConfig`) and `qwen3_next`
//! (`Qwen3NextConfig`), transformers 5.23: which layers route their feed-forward block through experts and how.

use serde::Deserialize;

use crate::error::{ModelError, Result};

/// The feed-forward block of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// A SwiGLU MLP of `intermediate_size`.
    Dense,
    /// A router over `num_experts` SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` of them per token,
    /// plus a shared expert of `shared_expert_intermediate_size` behind a per-token sigmoid gate.
    Moe,
}

/// The experts' settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// E: routed experts per MoE layer.
    pub num_experts: usize,
    /// k: experts each token is routed to.
    pub num_experts_per_tok: usize,
    /// I_e: an expert's inner width.
    pub moe_intermediate_size: usize,
    /// I_s: the shared expert's inner width.
    pub shared_expert_intermediate_size: usize,
    /// Renormalize the k routing weights to sum to 1 (`Qwen3_5MoeTopKRouter` always does; `Qwen3NextTopKRouter`
    /// when `norm_topk_prob`).
    pub norm_topk_prob: bool,
}

/// The fields as config.json spells them; absent ones take the architecture's defaults (`defaults`).
#[derive(Deserialize)]
struct RawMoe {
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    shared_expert_intermediate_size: usize,
    #[serde(default = "yes")]
    norm_topk_prob: bool,
    #[serde(default = "one")]
    decoder_sparse_step: usize,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}

/// Reads the MoE settings of a text config object and the kind of each of `n_layers` layers: a layer is MoE when
/// it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0` (HF `Qwen3NextDecoderLayer`; Qwen3.5 MoE
/// has neither field, so every layer is). `always_norm`: the router renormalizes whatever `norm_topk_prob` says.
///
/// Errors: [`ModelError::Json`] for a field of the wrong type; [`ModelError::InvalidConfig`] for a zero size,
/// `num_experts_per_tok` above `num_experts`, sizes past the supported bounds, or a layer index out of range.
pub(crate) fn parse(
    text: &serde_json::Value,
    n_layers: usize,
    always_norm: bool,
) -> Result<(MoeConfig, Vec<FfnKind>)> {
    let raw: RawMoe = serde_json::from_value(text.clone()).map_err(|e| ModelError::Json {
        path: "config.json".into(),
        message: e.to_string(),
    })?;
    let bad = |m: String| Err(ModelError::InvalidConfig(m));
    for (name, v, max) in [
        ("num_experts", raw.num_experts, 1usize << 14),
        ("num_experts_per_tok", raw.num_experts_per_tok, 1 << 10),
        ("moe_intermediate_size", raw.moe_intermediate_size, 1 << 19),
        ("decoder_sparse_step", raw.decoder_sparse_step, 1 << 12),
    ] {
        if v == 0 || v > max {
            return bad(format!("{name} = {v} must be in 1..={max}"));
        }
    }
    if raw.shared_expert_intermediate_size > 1 << 19 {
        return bad(format!(
            "shared_expert_intermediate_size = {} exceeds the supported maximum {}",
            raw.shared_expert_intermediate_size,
            1 << 19
        ));
    }
    if raw.num_experts_per_tok > raw.num_experts {
        return bad(format!(
            "num_experts_per_tok ({}) exceeds num_experts ({})",
            raw.num_experts_per_tok, raw.num_experts
        ));
    }
    let dense = raw.mlp_only_layers.unwrap_or_default();
    if let Some(&i) = dense.iter().find(|&&i| i >= n_layers) {
        return bad(format!(
            "mlp_only_layers names layer {i}; the model has {n_layers}"
        ));
    }
    let kinds = (0..n_layers)
        .map(|i| {
            if !dense.contains(&i) && (i + 1) % raw.decoder_sparse_step == 0 {
                FfnKind::Moe
            } else {
                FfnKind::Dense
            }
        })
        .collect();
    let moe = MoeConfig {
        num_experts: raw.num_experts,
        num_experts_per_tok: raw.num_experts_per_tok,
        moe_intermediate_size: raw.moe_intermediate_size,
        shared_expert_intermediate_size: raw.shared_expert_intermediate_size,
        norm_topk_prob: always_norm || raw.norm_topk_prob,
    };
    Ok((moe, kinds))
}

/// Fills the keys `obj` lacks from `defaults` (an architecture's config-class defaults).
pub(crate) fn fill_defaults(obj: &mut serde_json::Value, defaults: &serde_json::Value) {
    if let (Some(o), Some(d)) = (obj.as_object_mut(), defaults.as_object()) {
        for (k, v) in d {
            o.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
}

/// `Qwen3NextConfig`'s defaults where they differ from the dense `Qwen3_5TextConfig`'s (the 80B-A3B).
pub(crate) fn qwen3_next_defaults() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512
    })
}

/// `Qwen3_5MoeTextConfig`'s defaults where they differ from the dense `Qwen3_5TextConfig`'s (the 35B-A3B).
pub(crate) fn qwen3_5_moe_defaults() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512
    })
}
