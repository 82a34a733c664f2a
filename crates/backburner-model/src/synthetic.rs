//! Random checkpoints of the real architecture, generated deterministically: the bundled default model, the
//! benchmark model and test models of any depth are written by this one function.
//!
//! The generator is a fixed SplitMix64 with Box–Muller normals, so the bytes never change with a dependency's
//! version. Weights are stored as bf16.

use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// SplitMix64 (also the random GGUF generator's, [`crate::gguf::random`]).
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub(crate) fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub(crate) fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Writes `config.json` (the given JSON) and `model.safetensors` (random bf16 weights from `seed`) into `dir`: every
/// tensor of the architecture's table ([`crate::arch`]) in table order, each drawn from its entry's distribution
/// (projections N(0, 0.02); RMSNorm1p weights N(0, 0.1), multiplier 1+w; the gated norm 1 + N(0, 0.1); conv weights
/// N(0, 0.3); `A_log` and `dt_bias` N(0, 0.5)). Untied configs get an `lm_head`.
///
/// Errors: [`ModelError::InvalidConfig`] for a config that does not validate, [`ModelError::Io`] on write failure.
pub fn write_random_checkpoint(
    dir: &Path,
    config_json: &serde_json::Value,
    seed: u64,
) -> Result<()> {
    let text = serde_json::to_string_pretty(config_json).expect("JSON value serializes");
    let c = ModelConfig::from_json_str(&text)?;
    if c.layout != crate::config::WeightLayout::CausalLm {
        return Err(ModelError::InvalidConfig(
            "synthetic checkpoints use the text layout (qwen3_5_text, qwen3_5_moe_text)".into(),
        ));
    }
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, &text).map_err(|e| ModelError::io(&cfg_path, e))?;
    let arch = crate::arch::arch_of(&c);
    let mut rng = SplitMix(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let specs = arch
        .end_tensors(&c)
        .into_iter()
        .chain((0..c.num_hidden_layers).flat_map(|i| arch.layer_tensors(&c, i)));
    for t in specs {
        let n: usize = t.shape.iter().product();
        let mut bytes = Vec::with_capacity(n * 2);
        for _ in 0..n {
            let x = t.init.mean + t.init.std * rng.normal();
            bytes.extend_from_slice(&bf16::from_f64(x).to_le_bytes());
        }
        tensors.push((t.name, t.shape, bytes));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::BF16, s.clone(), b)
                .map(|t| (n.clone(), t))
                .map_err(|e| ModelError::InvalidConfig(format!("tensor {n}: {e}")))
        })
        .collect::<Result<_>>()?;
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).map_err(|e| {
        ModelError::CorruptSafetensors {
            path: path.clone(),
            message: format!("write failed: {e}"),
        }
    })?;
    Ok(())
}

/// A small Qwen3.5-architecture config for tests: `n_layers` layers (3 Gated DeltaNet : 1 attention), hidden 64,
/// GQA 4:2, head_dim 32, Hk 2 / Hv 4, Dk 16 / Dv 24, vocab 512.
pub fn tiny_config(n_layers: usize) -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_5_text",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": n_layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false, "max_position_embeddings": 65536,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    })
}

/// A small Qwen3.5 mixture-of-experts config (`qwen3_5_moe_text`) for tests: [`tiny_config`]'s shapes with every
/// layer's feed-forward block 8 experts of 32 (2 per token) and a shared expert of 48.
pub fn tiny_moe_config(n_layers: usize) -> serde_json::Value {
    let mut c = tiny_config(n_layers);
    let o = c.as_object_mut().expect("an object");
    o.insert("model_type".into(), "qwen3_5_moe_text".into());
    o.remove("intermediate_size");
    for (k, v) in [
        ("num_experts", 8),
        ("num_experts_per_tok", 2),
        ("moe_intermediate_size", 32),
        ("shared_expert_intermediate_size", 48),
    ] {
        o.insert(k.into(), v.into());
    }
    c
}

/// A small Qwen3-Next config (`qwen3_next`) for tests: [`tiny_moe_config`]'s shapes with the fused Gated DeltaNet
/// projections, layer 1 dense (`mlp_only_layers`) and the top k not renormalized.
pub fn tiny_next_config(n_layers: usize) -> serde_json::Value {
    let mut c = tiny_moe_config(n_layers);
    let o = c.as_object_mut().expect("an object");
    o.insert("model_type".into(), "qwen3_next".into());
    o.insert("intermediate_size".into(), 96.into());
    o.insert("mlp_only_layers".into(), serde_json::json!([1]));
    o.insert("norm_topk_prob".into(), false.into());
    c
}
