//! `config.json` of Qwen3.5-family hybrid checkpoints, validated once at load.
//!
//! Field names mirror Hugging Face `Qwen3_5TextConfig` (transformers 5.23,
//! `models/qwen3_5/configuration_qwen3_5.py`); defaults are HF's.

use backburner_kernels::matmul::Precision;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

mod moe;
mod raw;
pub use moe::{FfnKind, MoeConfig};
use raw::RawTextConfig;

/// Model types this build runs.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "qwen3_next",
];
/// Model types of the same family that a later release will run.
pub const NOT_YET_SUPPORTED_MODEL_TYPES: &[&str] = &[];

/// The kind of token mixer in one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention): fixed-size conv and recurrent state.
    LinearAttention,
    /// Gated full attention: a KV cache with one row per position.
    FullAttention,
}

/// RoPE settings (`rope_parameters` in transformers 5; top-level `rope_theta`/`partial_rotary_factor` in older files).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// Base θ of the inverse frequencies.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Fraction of `head_dim` that rotates (0.25 → 64 of 256 dims).
    #[serde(default = "default_partial_rotary")]
    pub partial_rotary_factor: f64,
    /// `mrope_section`; for text-only input MRoPE equals plain RoPE (ARCH_SPEC.md), so it is only recorded.
    #[serde(default)]
    pub mrope_section: Option<Vec<usize>>,
    /// `rope_type`; only `default` (no scaling) is supported.
    #[serde(default)]
    pub rope_type: Option<String>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_partial_rotary() -> f64 {
    0.25
}

/// Where the text model's tensors live inside the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `Qwen3_5ForCausalLM`: `model.layers.*`, `model.embed_tokens`, `lm_head`.
    CausalLm,
    /// `Qwen3_5ForConditionalGeneration` (hub): `model.language_model.*` plus top-level `lm_head`; `model.visual.*` is
    /// skipped. (The MTP block is `mtp.*` at the top level in both layouts.)
    Hub,
}

impl WeightLayout {
    /// Prefix of the decoder's tensors (`model.` or `model.language_model.`).
    pub fn prefix(self) -> &'static str {
        match self {
            WeightLayout::CausalLm => "model.",
            WeightLayout::Hub => "model.language_model.",
        }
    }
}

/// Order of the Gated DeltaNet value heads in the checkpoint's `in_proj_qkv` (its V rows), `in_proj_z`, `in_proj_a`,
/// `in_proj_b`, `A_log`, `dt_bias`, conv1d (its V channels) and `out_proj` (its columns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VHeadOrder {
    /// Hugging Face order: v heads grouped by the k head they share, `[k0v0, k0v1, …, k0v(r-1), k1v0, …]`; v head
    /// `j` uses k head `j / r` (r = Hv / Hk).
    #[default]
    Grouped,
    /// llama.cpp GGUF order (its converter's `_reorder_v_heads`): tiled, `[k0v0, k1v0, …, k(Hk-1)v0, k0v1, …]`;
    /// v head `j` uses k head `j % Hk`.
    Tiled,
}

/// The validated text-model configuration. All sizes are element counts.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `model_type` as found at the top of config.json.
    pub model_type: String,
    /// Tensor naming layout.
    pub layout: WeightLayout,
    /// V: rows of the embedding and the output head.
    pub vocab_size: usize,
    /// H: width of the residual stream.
    pub hidden_size: usize,
    /// I: MLP inner width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Hq: query heads of full-attention layers.
    pub num_attention_heads: usize,
    /// Hkv: KV heads of full-attention layers (GQA).
    pub num_key_value_heads: usize,
    /// D: head dim of full-attention layers.
    pub head_dim: usize,
    /// Hk: q/k heads of Gated DeltaNet layers.
    pub linear_num_key_heads: usize,
    /// Hv: v heads of Gated DeltaNet layers (a multiple of Hk).
    pub linear_num_value_heads: usize,
    /// Dk.
    pub linear_key_head_dim: usize,
    /// Dv.
    pub linear_value_head_dim: usize,
    /// Kc: depthwise conv kernel length.
    pub linear_conv_kernel_dim: usize,
    /// RMSNorm epsilon (also the gated norm's).
    pub rms_norm_eps: f64,
    /// Output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest context the checkpoint claims (tokens).
    pub max_position_embeddings: usize,
    /// One entry per layer.
    pub layer_types: Vec<LayerKind>,
    /// Layers per hybrid cycle (4): a split point must be a multiple of it.
    pub full_attention_interval: usize,
    /// RoPE settings.
    pub rope: RopeParameters,
    /// `eos_token_id` from config.json, if any (generation_config.json wins).
    pub eos_token_ids: Vec<u32>,
    /// Order of the Gated DeltaNet v heads in the stored weights: [`VHeadOrder::Grouped`] for safetensors
    /// checkpoints, [`VHeadOrder::Tiled`] for GGUF files written by llama.cpp's converter.
    pub linear_v_head_order: VHeadOrder,
    /// How the stored weights hold the Gated DeltaNet input projections, where that differs from the
    /// architecture's own ([`crate::arch::Arch::gdn_of`]; `None`: the architecture's): a GGUF `qwen3next` file of
    /// llama.cpp's converter stores Qwen3-Next's `q|k|v` and `z` split by kind.
    pub gdn_projections: Option<crate::arch::GdnProjections>,
    /// The experts' settings of a mixture-of-experts model (`None`: every layer's feed-forward block is dense).
    pub moe: Option<MoeConfig>,
    /// One entry per layer: its feed-forward block.
    pub ffn_types: Vec<FfnKind>,
    /// MTP (multi-token prediction) blocks the checkpoint declares: `mtp_num_hidden_layers` of config.json (the text
    /// config of the hub layout), `<arch>.nextn_predict_layers` of a GGUF file; 0 for none. A load of the model's
    /// ends loads the block when this is 1 and the file holds its tensors ([`crate::model::Mtp`], `docs/MTP.md`).
    /// A caller that does not want it (its memory) sets 0 before loading, as it sets `precision`.
    pub mtp_num_hidden_layers: usize,
    /// The arithmetic of products against bf16 weights (not from config.json: [`Precision::F32`] when read, set by the
    /// caller before loading the weights). [`Precision::Bf16`] rounds the activations to bf16 as llama.cpp does
    /// (about twice the prefill speed on AVX-512 BF16; logits no longer match the f32 reference bit for bit). Part of
    /// the config's `Debug` form, so a host and a worker of a split that disagree on it have different fingerprints.
    pub precision: Precision,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`, or, when `dir` is a GGUF model (a `.gguf` file or a directory of one
    /// without config.json, [`crate::checkpoint::is_gguf`]), its metadata ([`crate::gguf::config_from_gguf`]).
    ///
    /// Errors: [`ModelError::Io`], [`ModelError::Json`], [`ModelError::UnsupportedModelType`],
    /// [`ModelError::NotYetSupported`], [`ModelError::InvalidConfig`]; those of [`crate::gguf::GgufFile::open`].
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if crate::checkpoint::is_gguf(dir) {
            return crate::gguf::config_from_gguf(&crate::gguf::GgufFile::open(dir)?);
        }
        crate::checkpoint::check_checkpoint_dir(dir)?;
        let path = dir.join("config.json");
        let text = crate::fsutil::read_text(&path, crate::fsutil::MAX_SMALL_FILE)?;
        Self::from_json_str(&text).map_err(|e| match e {
            ModelError::Json { message, .. } => ModelError::Json { path, message },
            other => other,
        })
    }

    /// Parses a config.json document (see [`ModelConfig::from_dir`]).
    pub fn from_json_str(text: &str) -> Result<Self> {
        let json_err = |e: serde_json::Error| ModelError::Json {
            path: "config.json".into(),
            message: e.to_string(),
        };
        let top: serde_json::Value = serde_json::from_str(text).map_err(json_err)?;
        let model_type = top
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ModelError::InvalidConfig("config.json has no \"model_type\"".into()))?
            .to_string();
        if NOT_YET_SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(ModelError::NotYetSupported(model_type));
        }
        let (layout, text_value) = match model_type.as_str() {
            "qwen3_5_text" | "qwen3_5_moe_text" | "qwen3_next" => {
                (WeightLayout::CausalLm, top.clone())
            }
            "qwen3_5" | "qwen3_5_moe" => {
                let tc = top.get("text_config").cloned().ok_or_else(|| {
                    ModelError::InvalidConfig(format!(
                        "model_type {model_type} needs a \"text_config\" object"
                    ))
                })?;
                (WeightLayout::Hub, tc)
            }
            _ => {
                return Err(ModelError::UnsupportedModelType {
                    found: model_type,
                    supported: SUPPORTED_MODEL_TYPES.to_vec(),
                })
            }
        };
        let mut text_value = text_value;
        if layout == WeightLayout::Hub && text_value.get("tie_word_embeddings").is_none() {
            if let (Some(t), Some(obj)) =
                (top.get("tie_word_embeddings"), text_value.as_object_mut())
            {
                obj.insert("tie_word_embeddings".into(), t.clone());
            }
        }
        let next = model_type == "qwen3_next";
        let is_moe = model_type.starts_with("qwen3_5_moe") || next;
        if next {
            moe::fill_defaults(&mut text_value, &moe::qwen3_next_defaults());
        } else if is_moe {
            moe::fill_defaults(&mut text_value, &moe::qwen3_5_moe_defaults());
        }
        let raw: RawTextConfig = serde_json::from_value(text_value.clone()).map_err(json_err)?;
        let text_type = if is_moe {
            "qwen3_5_moe_text"
        } else {
            "qwen3_5_text"
        };
        if let Some(inner) = &raw.model_type {
            if layout == WeightLayout::Hub && inner != text_type {
                if NOT_YET_SUPPORTED_MODEL_TYPES.contains(&inner.as_str()) {
                    return Err(ModelError::NotYetSupported(inner.clone()));
                }
                return Err(ModelError::UnsupportedModelType {
                    found: inner.clone(),
                    supported: SUPPORTED_MODEL_TYPES.to_vec(),
                });
            }
        }
        // eos may sit at the top level of hub configs.
        let eos_value = raw
            .eos_token_id
            .clone()
            .or_else(|| top.get("eos_token_id").cloned());
        let n_layers = raw.num_hidden_layers;
        let mut c = Self::validate(model_type, layout, raw, eos_value)?;
        if is_moe {
            // Qwen3.5 MoE's router always renormalizes its top k (`Qwen3_5MoeTopKRouter`); Qwen3-Next's when
            // `norm_topk_prob`
            let (m, kinds) = moe::parse(&text_value, n_layers, !next)?;
            c.moe = Some(m);
            c.ffn_types = kinds;
        }
        Ok(c)
    }

    fn validate(
        model_type: String,
        layout: WeightLayout,
        raw: RawTextConfig,
        eos: Option<serde_json::Value>,
    ) -> Result<Self> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return bad(format!(
                    "hidden_act {act:?} is not supported (only \"silu\")"
                ));
            }
        }
        if raw.attention_bias {
            return bad("attention_bias = true is not supported by Qwen3.5 checkpoints".into());
        }
        for (name, v) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("num_key_value_heads", raw.num_key_value_heads),
            ("head_dim", raw.head_dim),
            ("linear_num_key_heads", raw.linear_num_key_heads),
            ("linear_num_value_heads", raw.linear_num_value_heads),
            ("linear_key_head_dim", raw.linear_key_head_dim),
            ("linear_value_head_dim", raw.linear_value_head_dim),
            ("linear_conv_kernel_dim", raw.linear_conv_kernel_dim),
            ("full_attention_interval", raw.full_attention_interval),
            ("max_position_embeddings", raw.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        // Bounds far above any real checkpoint keep every derived size (products of these) inside usize.
        for (name, v, max) in [
            ("vocab_size", raw.vocab_size, 1usize << 22),
            ("hidden_size", raw.hidden_size, 1 << 17),
            ("intermediate_size", raw.intermediate_size, 1 << 19),
            ("num_hidden_layers", raw.num_hidden_layers, 1 << 12),
            ("num_attention_heads", raw.num_attention_heads, 1 << 12),
            ("num_key_value_heads", raw.num_key_value_heads, 1 << 12),
            ("head_dim", raw.head_dim, 1 << 12),
            ("linear_num_key_heads", raw.linear_num_key_heads, 1 << 12),
            (
                "linear_num_value_heads",
                raw.linear_num_value_heads,
                1 << 12,
            ),
            ("linear_key_head_dim", raw.linear_key_head_dim, 1 << 12),
            ("linear_value_head_dim", raw.linear_value_head_dim, 1 << 12),
            ("linear_conv_kernel_dim", raw.linear_conv_kernel_dim, 64),
            ("mtp_num_hidden_layers", raw.mtp_num_hidden_layers, 1 << 6),
            (
                "full_attention_interval",
                raw.full_attention_interval,
                1 << 12,
            ),
        ] {
            if v > max {
                return bad(format!("{name} = {v} exceeds the supported maximum {max}"));
            }
        }
        if !(raw.rms_norm_eps.is_finite() && raw.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps must be a finite number > 0, found {}",
                raw.rms_norm_eps
            ));
        }
        if let Some(rs) = &raw.rope_scaling {
            if !rs.is_null() {
                return bad(format!(
                    "rope_scaling {rs} is not supported (only plain RoPE)"
                ));
            }
        }
        if let Some(t) = raw
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_type.as_deref())
        {
            if t != "default" {
                return bad(format!("rope_type {t:?} is not supported (only \"default\"); its scaling would be silently wrong"));
            }
        }
        if !raw
            .num_attention_heads
            .is_multiple_of(raw.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                raw.num_attention_heads, raw.num_key_value_heads
            ));
        }
        if !raw
            .linear_num_value_heads
            .is_multiple_of(raw.linear_num_key_heads)
        {
            return bad(format!(
                "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                raw.linear_num_value_heads, raw.linear_num_key_heads
            ));
        }
        let layer_types = match &raw.layer_types {
            Some(list) => {
                if list.len() != raw.num_hidden_layers {
                    return bad(format!(
                        "layer_types has {} entries but num_hidden_layers is {}",
                        list.len(),
                        raw.num_hidden_layers
                    ));
                }
                let mut kinds = Vec::with_capacity(list.len());
                for (i, s) in list.iter().enumerate() {
                    kinds.push(match s.as_str() {
                        "linear_attention" => LayerKind::LinearAttention,
                        "full_attention" => LayerKind::FullAttention,
                        other => {
                            return bad(format!(
                                "layer_types[{i}] = {other:?}; expected \"linear_attention\" or \"full_attention\""
                            ))
                        }
                    });
                }
                kinds
            }
            None => (0..raw.num_hidden_layers)
                .map(|i| {
                    if (i + 1) % raw.full_attention_interval == 0 {
                        LayerKind::FullAttention
                    } else {
                        LayerKind::LinearAttention
                    }
                })
                .collect(),
        };
        let mut rope = raw.rope_parameters.clone().unwrap_or(RopeParameters {
            rope_theta: default_rope_theta(),
            partial_rotary_factor: default_partial_rotary(),
            mrope_section: None,
            rope_type: None,
        });
        if raw.rope_parameters.is_none() {
            if let Some(t) = raw.rope_theta {
                rope.rope_theta = t;
            }
            if let Some(p) = raw.partial_rotary_factor {
                rope.partial_rotary_factor = p;
            }
        }
        let rot = (raw.head_dim as f64 * rope.partial_rotary_factor) as usize;
        if rot == 0 || !rot.is_multiple_of(2) || rot > raw.head_dim {
            return bad(format!(
                "partial_rotary_factor {} gives {rot} rotary dims of head_dim {}; need an even number in 2..=head_dim",
                rope.partial_rotary_factor, raw.head_dim
            ));
        }
        if rope.rope_theta.is_nan() || rope.rope_theta <= 0.0 {
            return bad(format!("rope_theta must be > 0, found {}", rope.rope_theta));
        }
        let eos_token_ids = parse_id_list(eos.as_ref())
            .map_err(|m| ModelError::InvalidConfig(format!("eos_token_id: {m}")))?;
        Ok(ModelConfig {
            model_type,
            layout,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            linear_num_key_heads: raw.linear_num_key_heads,
            linear_num_value_heads: raw.linear_num_value_heads,
            linear_key_head_dim: raw.linear_key_head_dim,
            linear_value_head_dim: raw.linear_value_head_dim,
            linear_conv_kernel_dim: raw.linear_conv_kernel_dim,
            rms_norm_eps: raw.rms_norm_eps,
            tie_word_embeddings: raw.tie_word_embeddings,
            max_position_embeddings: raw.max_position_embeddings,
            layer_types,
            full_attention_interval: raw.full_attention_interval,
            rope,
            eos_token_ids,
            linear_v_head_order: VHeadOrder::Grouped,
            gdn_projections: None,
            moe: None,
            ffn_types: vec![FfnKind::Dense; raw.num_hidden_layers],
            mtp_num_hidden_layers: raw.mtp_num_hidden_layers,
            precision: Precision::F32,
        })
    }

    /// `conv_dim = 2·Hk·Dk + Hv·Dv`: channels of the Gated DeltaNet conv.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// The Gated DeltaNet's dimensions for a call of `n_tokens` tokens.
    pub fn gdn_dims(&self, n_tokens: usize) -> backburner_kernels::gdn::GdnDims {
        backburner_kernels::gdn::GdnDims {
            n_tokens,
            n_k_heads: self.linear_num_key_heads,
            n_v_heads: self.linear_num_value_heads,
            d_k: self.linear_key_head_dim,
            d_v: self.linear_value_head_dim,
            tiled_v_heads: self.linear_v_head_order == VHeadOrder::Tiled,
        }
    }

    /// R: rotary dims per head (`head_dim · partial_rotary_factor`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.rope.partial_rotary_factor) as usize
    }

    /// Indices of the full-attention layers, ascending.
    pub fn full_attention_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers)
            .filter(|&i| self.layer_types[i] == LayerKind::FullAttention)
            .collect()
    }

    /// KV cache bytes per token over all full-attention layers, for `bytes_per_elem` (2 for f16, 4 for f32).
    pub fn kv_bytes_per_token(&self, bytes_per_elem: usize) -> usize {
        self.full_attention_layers().len()
            * 2
            * self.num_key_value_heads
            * self.head_dim
            * bytes_per_elem
    }
}

/// Reads an id or a list of ids (`eos_token_id` may be either; null or absent is none). Errors with a message for
/// anything that is not a non-negative integer below 2^32.
pub(crate) fn parse_id_list(
    v: Option<&serde_json::Value>,
) -> std::result::Result<Vec<u32>, String> {
    let one = |x: &serde_json::Value| -> std::result::Result<u32, String> {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("{x} is not a token id"))
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(a)) => a.iter().map(one).collect(),
        Some(x) => Ok(vec![one(x)?]),
    }
}
