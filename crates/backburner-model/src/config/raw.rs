//! `config.json` as transformers spells it (the text settings of `Qwen3_5TextConfig`, transformers 5.23), with its
//! defaults; validated into [`super::ModelConfig`].

use serde::Deserialize;

use super::RopeParameters;

#[derive(Deserialize)]
pub(super) struct RawTextConfig {
    #[serde(default)]
    pub(super) model_type: Option<String>,
    #[serde(default = "d_vocab")]
    pub(super) vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub(super) hidden_size: usize,
    #[serde(default = "d_inter")]
    pub(super) intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub(super) num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub(super) num_attention_heads: usize,
    #[serde(default = "d_kv_heads")]
    pub(super) num_key_value_heads: usize,
    #[serde(default = "d_head_dim")]
    pub(super) head_dim: usize,
    #[serde(default = "d_lin_k_heads")]
    pub(super) linear_num_key_heads: usize,
    #[serde(default = "d_lin_v_heads")]
    pub(super) linear_num_value_heads: usize,
    #[serde(default = "d_lin_dim")]
    pub(super) linear_key_head_dim: usize,
    #[serde(default = "d_lin_dim")]
    pub(super) linear_value_head_dim: usize,
    #[serde(default = "d_conv")]
    pub(super) linear_conv_kernel_dim: usize,
    #[serde(default = "d_eps")]
    pub(super) rms_norm_eps: f64,
    #[serde(default)]
    pub(super) tie_word_embeddings: bool,
    #[serde(default)]
    pub(super) attention_bias: bool,
    #[serde(default = "d_max_pos")]
    pub(super) max_position_embeddings: usize,
    #[serde(default)]
    pub(super) layer_types: Option<Vec<String>>,
    #[serde(default = "d_interval")]
    pub(super) full_attention_interval: usize,
    #[serde(default)]
    pub(super) rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub(super) rope_theta: Option<f64>,
    #[serde(default)]
    pub(super) rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub(super) partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub(super) hidden_act: Option<String>,
    #[serde(default)]
    pub(super) eos_token_id: Option<serde_json::Value>,
    /// MTP blocks (`mtp_num_hidden_layers`; some configs spell it `num_nextn_predict_layers`).
    #[serde(default, alias = "num_nextn_predict_layers")]
    pub(super) mtp_num_hidden_layers: usize,
}

fn d_vocab() -> usize {
    248_320
}
fn d_hidden() -> usize {
    4096
}
fn d_inter() -> usize {
    12_288
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> usize {
    16
}
fn d_kv_heads() -> usize {
    4
}
fn d_head_dim() -> usize {
    256
}
fn d_lin_k_heads() -> usize {
    16
}
fn d_lin_v_heads() -> usize {
    32
}
fn d_lin_dim() -> usize {
    128
}
fn d_conv() -> usize {
    4
}
fn d_eps() -> f64 {
    1e-6
}
fn d_max_pos() -> usize {
    32_768
}
fn d_interval() -> usize {
    4
}
