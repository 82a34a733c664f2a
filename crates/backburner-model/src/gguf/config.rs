//! The model config of a `qwen35`, `qwen35moe` or `qwen3next` GGUF file, from the metadata llama.cpp's converter
//! writes (`conversion/qwen.py`: `Qwen3NextModel.set_gguf_parameters` and `TextModel.set_gguf_parameters`) and its
//! loader reads (`src/models/qwen35.cpp`, `qwen3next.cpp`, `llama_model::load_hparams`).
//!
//! The values are turned into the equivalent `config.json` (`model_type` `qwen3_5_text`, …) and validated by
//! [`ModelConfig::from_json_str`], so both sources go through one set of checks.

use std::path::Path;

use serde_json::{json, Value};

use super::metadata::{MetaArray, MetaValue, Metadata};
use super::GgufFile;
use crate::arch::GdnProjections;
use crate::config::{LayerKind, ModelConfig, VHeadOrder};
use crate::error::{ModelError, Result};

/// `general.architecture` values this build loads.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["qwen35", "qwen35moe", "qwen3next"];
/// Family members a later release will load.
const NOT_YET_SUPPORTED: &[&str] = &[];

/// Reads `<arch>.*` keys, with errors naming the key and the file.
struct Keys<'a> {
    md: &'a Metadata,
    arch: &'a str,
    path: &'a Path,
}

/// An f32 is read as the shortest decimal that round-trips it (the value the converter was given: 1e-6 stays 1e-6
/// rather than 9.99999997e-7); an f64 as is.
fn float_value(v: &MetaValue) -> Option<f64> {
    match *v {
        MetaValue::F32(x) => format!("{x}").parse().ok(),
        MetaValue::F64(x) => Some(x),
        _ => None,
    }
}

impl Keys<'_> {
    fn name(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn err(&self, m: String) -> ModelError {
        ModelError::InvalidConfig(format!("GGUF {}: {m}", self.path.display()))
    }

    fn wrong_type(&self, k: &str, v: &MetaValue, want: &str) -> ModelError {
        self.err(format!(
            "{} has type {} ({v:?}), expected {want}",
            self.name(k),
            v.type_name()
        ))
    }

    fn opt_u64(&self, k: &str) -> Result<Option<u64>> {
        match self.md.get(&self.name(k)) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(k, v, "an unsigned integer")),
        }
    }

    fn req_u64(&self, k: &str) -> Result<u64> {
        self.opt_u64(k)?
            .ok_or_else(|| self.err(format!("{} is missing", self.name(k))))
    }

    fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        match self.md.get(&self.name(k)) {
            None => Ok(None),
            Some(v) => match float_value(v) {
                Some(x) if x.is_finite() => Ok(Some(x)),
                Some(x) => Err(self.err(format!("{} is {x}", self.name(k)))),
                None => Err(self.wrong_type(k, v, "f32 or f64")),
            },
        }
    }

    fn opt_str(&self, k: &str) -> Result<Option<&str>> {
        match self.md.get(&self.name(k)) {
            None => Ok(None),
            Some(MetaValue::Str(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong_type(k, v, "a string")),
        }
    }

    /// A value llama.cpp reads with `get_key_or_arr`: one integer, or one per layer (of all `n_all` blocks, MTP
    /// included). The `n_layers` trunk layers must agree: this engine has one value for all layers.
    fn uniform(&self, k: &str, n_all: u64, n_layers: u64) -> Result<Option<u64>> {
        self.uniform_over(k, n_all, n_layers, false)
    }

    /// As [`Keys::uniform`] for an attention head count, which newer converters write per layer with 0 on the
    /// recurrent (Gated DeltaNet) layers: the zeros are skipped and the attention layers' counts must agree.
    fn heads(&self, k: &str, n_all: u64, n_layers: u64) -> Result<Option<u64>> {
        self.uniform_over(k, n_all, n_layers, true)
    }

    fn uniform_over(
        &self,
        k: &str,
        n_all: u64,
        n_layers: u64,
        skip_zero: bool,
    ) -> Result<Option<u64>> {
        let Some(v) = self.md.get(&self.name(k)) else {
            return Ok(None);
        };
        if let Some(x) = v.as_u64() {
            return Ok(Some(x));
        }
        let vals = match v {
            MetaValue::Array(a) => a.to_i64_vec(),
            _ => None,
        }
        .ok_or_else(|| self.wrong_type(k, v, "an unsigned integer or an array of them"))?;
        if vals.len() as u64 != n_all && vals.len() as u64 != n_layers {
            return Err(self.err(format!(
                "{} has {} entries, expected {}",
                self.name(k),
                vals.len(),
                expected_entries(n_all, n_layers)
            )));
        }
        let trunk: Vec<i64> = vals[..n_layers as usize]
            .iter()
            .copied()
            .filter(|&x| !(skip_zero && x == 0))
            .collect();
        if trunk.is_empty() && skip_zero {
            return Err(self.err(format!("{} is 0 on every layer", self.name(k))));
        }
        match trunk.first() {
            Some(&x) if x >= 0 && trunk.iter().all(|&y| y == x) => Ok(Some(x as u64)),
            _ => Err(self.err(format!(
                "{} = {trunk:?} differs across layers (or is negative); this engine needs one value for all layers",
                self.name(k)
            ))),
        }
    }

    /// `attention.recurrent_layers`: one flag per block (or per trunk layer), bools or integers.
    fn recurrent_layers(&self, n_all: u64, n_layers: u64) -> Result<Option<Vec<bool>>> {
        let k = "attention.recurrent_layers";
        let Some(v) = self.md.get(&self.name(k)) else {
            return Ok(None);
        };
        let flags: Vec<bool> = match v {
            MetaValue::Array(MetaArray::Bool(b)) => b.clone(),
            MetaValue::Array(a) => a
                .to_i64_vec()
                .ok_or_else(|| self.wrong_type(k, v, "an array of bools"))?
                .into_iter()
                .map(|x| x != 0)
                .collect(),
            _ => return Err(self.wrong_type(k, v, "an array of bools")),
        };
        if flags.len() as u64 != n_all && flags.len() as u64 != n_layers {
            return Err(self.err(format!(
                "{} has {} entries, expected {}",
                self.name(k),
                flags.len(),
                expected_entries(n_all, n_layers)
            )));
        }
        Ok(Some(flags[..n_layers as usize].to_vec()))
    }
}

/// Checks `general.architecture` and returns it.
///
/// Errors: [`ModelError::UnsupportedArchitecture`] for any value but one of [`SUPPORTED_ARCHITECTURES`].
pub fn check_architecture(f: &GgufFile) -> Result<&str> {
    let arch = f.architecture().unwrap_or("");
    if SUPPORTED_ARCHITECTURES.contains(&arch) {
        return Ok(arch);
    }
    Err(ModelError::UnsupportedArchitecture {
        found: arch.to_string(),
        supported: SUPPORTED_ARCHITECTURES.to_vec(),
        not_yet: NOT_YET_SUPPORTED.contains(&arch),
    })
}

/// RoPE keys: `(rope_parameters, rope_scaling, rotary dims)`.
fn rope(k: &Keys<'_>, head_dim: u64) -> Result<(Value, Value, u64)> {
    let theta = k.opt_f64("rope.freq_base")?.unwrap_or(10_000.0);
    let rot = k.opt_u64("rope.dimension_count")?.unwrap_or(head_dim);
    let factor = if head_dim == 0 {
        0.0
    } else {
        rot as f64 / head_dim as f64
    };
    let mut params =
        json!({"rope_theta": theta, "partial_rotary_factor": factor, "rope_type": "default"});
    let sections = k.md.get_i32_array(&k.name("rope.dimension_sections"));
    if let Some(mut s) = sections {
        // The converter pads HF's 3 sections ([11, 11, 10]) with a zero to llama.cpp's 4.
        while s.len() > 3 && s.last() == Some(&0) {
            s.pop();
        }
        params["mrope_section"] = json!(s);
    }
    let mut scaling = Value::Null;
    if let Some(t) = k.opt_str("rope.scaling.type")? {
        if t != "none" {
            scaling = json!({ "type": t });
        }
    }
    if let Some(fac) = k.opt_f64("rope.scaling.factor")? {
        if fac != 0.0 && fac != 1.0 {
            scaling = json!({ "factor": fac });
        }
    }
    Ok((params, scaling, rot))
}

/// Vocabulary size and tied-ness from the tensors: rows of `token_embd.weight`; tied when there is no
/// `output.weight`. An optional `<arch>.vocab_size` must agree with the rows: a file that disagrees with itself is
/// refused (as a block past `block_count` is), not run with one of the two numbers.
fn vocab_and_tie(f: &GgufFile, k: &Keys<'_>, hidden: u64) -> Result<(u64, bool)> {
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| k.err("the file has no token_embd.weight tensor".into()))?;
    if embd.dims.len() != 2 || embd.dims[0] != hidden {
        return Err(k.err(format!(
            "token_embd.weight has dims {:?}, expected [{hidden} (embedding_length), vocab]",
            embd.dims
        )));
    }
    let rows = embd.dims[1];
    if let Some(meta) = k.opt_u64("vocab_size")? {
        if meta != rows {
            return Err(k.err(format!(
                "{} is {meta} but token_embd.weight has {rows} rows (one per token id)",
                k.name("vocab_size")
            )));
        }
    }
    Ok((rows, f.tensor("output.weight").is_none()))
}

/// The model config of a `qwen35`, `qwen35moe` or `qwen3next` GGUF file. `model_type` is `qwen3_5_text`
/// (`qwen3_5_moe_text`, `qwen3_next`) and `layout` the causal-LM one (the GGUF tensor names are a separate scheme,
/// which the loader maps). Its `linear_v_head_order` is [`VHeadOrder::Tiled`] (the converter's order) for `qwen35`
/// and `qwen35moe`, and [`VHeadOrder::Grouped`] for `qwen3next` (the converter keeps Hugging Face's order there). A
/// `qwen35moe` or `qwen3next` file adds the experts' keys (see `experts`) and may omit `feed_forward_length`; a
/// `qwen3next` file's specifics are in `qwen3next`.
///
/// Keys (all `<arch>.` prefixed): `block_count` less `nextn_predict_layers` (the MTP blocks, which give
/// `mtp_num_hidden_layers`) → layers;
/// `context_length`; `embedding_length`; `feed_forward_length`; `attention.head_count`; `attention.head_count_kv`
/// (default: head_count); `attention.key_length` = `attention.value_length` → head_dim (default
/// embedding_length / head_count); `attention.layer_norm_rms_epsilon`; `rope.freq_base` (default 10000);
/// `rope.dimension_count` / head_dim → partial_rotary_factor; `rope.dimension_sections` (trailing zeros dropped) →
/// mrope_section; `rope.scaling.*` (refused unless none); `ssm.conv_kernel`; `ssm.state_size` → key head dim;
/// `ssm.group_count` → k heads; `ssm.time_step_rank` → v heads; `ssm.inner_size` / v heads → value head dim;
/// `full_attention_interval` (default 4); `attention.recurrent_layers` (else derived from the interval). Vocab size
/// from `token_embd.weight` (`vocab_size`, when present, must equal its rows), tied embeddings when `output.weight`
/// is absent, eos ids from [`super::eos_token_ids`].
///
/// Errors: [`ModelError::UnsupportedArchitecture`]; [`ModelError::InvalidConfig`] for a missing or mistyped key, or
/// values that fail the checks of [`ModelConfig::from_json_str`]; [`ModelError::Tokenizer`] for bad eos ids.
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let arch = check_architecture(f)?;
    let k = Keys {
        md: f.metadata(),
        arch,
        path: f.paths()[0].as_path(),
    };
    let n_all = k.req_u64("block_count")?;
    if n_all == 0 {
        return Err(k.err("block_count is 0: the model has no layers".to_string()));
    }
    let nextn = k.opt_u64("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= n_all {
        return Err(k.err(format!(
            "nextn_predict_layers ({nextn}) leaves none of the {n_all} blocks for the model"
        )));
    }
    let n_layers = n_all - nextn;
    // llama.cpp refuses a file whose tensors it would not all use; a block past block_count means the count lies
    // (a model read with fewer layers than it has would run and give other tokens).
    if let Some(past) = f.tensor_names().into_iter().find(|t| {
        t.strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(i, _)| i.parse::<u64>().map_or(true, |i| i >= n_all))
    }) {
        return Err(k.err(format!(
            "tensor {past:?} is not in any of the {n_all} blocks of block_count"
        )));
    }
    let hidden = k.req_u64("embedding_length")?;
    let (vocab, tied) = vocab_and_tie(f, &k, hidden)?;
    let next = arch == "qwen3next";
    let moe = arch == "qwen35moe" || next;
    let model_type = match arch {
        "qwen3next" => "qwen3_next",
        "qwen35moe" => "qwen3_5_moe_text",
        _ => "qwen3_5_text",
    };
    let mut cfg = json!({
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "tie_word_embeddings": tied,
        "max_position_embeddings": k.req_u64("context_length")?,
        "full_attention_interval": k.opt_u64("full_attention_interval")?.unwrap_or(4),
        "hidden_act": "silu",
        "eos_token_id": super::eos_token_ids(f)?,
        "mtp_num_hidden_layers": nextn,
    });
    let head_dim = attention(&k, n_all, n_layers, hidden, moe, &mut cfg)?;
    if moe {
        experts(&k, &mut cfg)?;
    }
    if next {
        qwen3next_ffn(&mut cfg);
    }
    let (rope_parameters, rope_scaling, rot) = rope(&k, head_dim)?;
    cfg["rope_parameters"] = rope_parameters;
    cfg["rope_scaling"] = rope_scaling;
    linear_attention(&k, &mut cfg)?;
    if let Some(flags) = k.recurrent_layers(n_all, n_layers)? {
        let kind = |r: bool| {
            if r {
                "linear_attention"
            } else {
                "full_attention"
            }
        };
        cfg["layer_types"] = json!(flags.iter().map(|&r| kind(r)).collect::<Vec<_>>());
    }
    let mut config = ModelConfig::from_json_str(&cfg.to_string()).map_err(|e| match e {
        ModelError::InvalidConfig(m) | ModelError::Json { message: m, .. } => {
            k.err(format!("{m} (as read from the GGUF metadata)"))
        }
        other => other,
    })?;
    if config.rotary_dim() as u64 != rot {
        return Err(k.err(format!(
            "rope.dimension_count {rot} of head_dim {head_dim} is not a usable rotary size"
        )));
    }
    if next {
        config.gdn_projections = Some(qwen3next_projections(f, &config));
    } else {
        config.linear_v_head_order = VHeadOrder::Tiled;
    }
    Ok(config)
}

/// A `qwen3next` file's feed-forward settings into `cfg`, as llama.cpp's `llama_model_qwen3next` computes: every
/// layer MoE (its loader requires the experts in every block; the converter cannot write Hugging Face's
/// `mlp_only_layers`), the top k routing weights always renormalized (its `build_moe_ffn` with `norm_w`; the
/// converter writes no `norm_topk_prob`).
fn qwen3next_ffn(cfg: &mut Value) {
    cfg["norm_topk_prob"] = json!(true);
    cfg["decoder_sparse_step"] = json!(1);
    cfg["mlp_only_layers"] = json!([]);
}

/// How a `qwen3next` file stores the Gated DeltaNet input projections: `ssm_in` fused per k head (older converters)
/// when its first Gated DeltaNet layer has one, else `attn_qkv` and `attn_gate` split by kind (the current
/// converter); `ssm_ba` is fused per k head in both.
fn qwen3next_projections(f: &GgufFile, c: &ModelConfig) -> GdnProjections {
    let first = c
        .layer_types
        .iter()
        .position(|&k| k == LayerKind::LinearAttention);
    match first {
        Some(i) if f.tensor(&format!("blk.{i}.ssm_in.weight")).is_some() => {
            GdnProjections::FusedPerKHead
        }
        _ => GdnProjections::SplitQkvzFusedBa,
    }
}

/// The full-attention and MLP sizes into `cfg` (an MoE file's `feed_forward_length` is optional); returns head_dim.
fn attention(
    k: &Keys<'_>,
    n_all: u64,
    n_layers: u64,
    hidden: u64,
    moe: bool,
    cfg: &mut Value,
) -> Result<u64> {
    let missing = |key: &str| k.err(format!("{} is missing", k.name(key)));
    let n_head = k
        .heads("attention.head_count", n_all, n_layers)?
        .ok_or_else(|| missing("attention.head_count"))?;
    if n_head == 0 {
        return Err(k.err(format!("{} is 0", k.name("attention.head_count"))));
    }
    let n_head_kv = k
        .heads("attention.head_count_kv", n_all, n_layers)?
        .unwrap_or(n_head);
    let key_len = k
        .opt_u64("attention.key_length")?
        .unwrap_or(hidden / n_head);
    let value_len = k.opt_u64("attention.value_length")?.unwrap_or(key_len);
    if key_len != value_len {
        return Err(k.err(format!(
            "attention.key_length ({key_len}) differs from attention.value_length ({value_len})"
        )));
    }
    let ff = k.uniform("feed_forward_length", n_all, n_layers)?;
    let ff = match (ff, moe) {
        (Some(ff), _) => Some(ff),
        (None, true) => None,
        (None, false) => return Err(missing("feed_forward_length")),
    };
    let eps = k
        .opt_f64("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| missing("attention.layer_norm_rms_epsilon"))?;
    cfg["num_attention_heads"] = json!(n_head);
    cfg["num_key_value_heads"] = json!(n_head_kv);
    cfg["head_dim"] = json!(key_len);
    if let Some(ff) = ff {
        cfg["intermediate_size"] = json!(ff);
    }
    cfg["rms_norm_eps"] = json!(eps);
    Ok(key_len)
}

/// The experts' sizes of a `qwen35moe` (or `qwen3next`) file into `cfg` (llama.cpp's `llama_model_qwen35moe::load_arch_hparams`):
/// `expert_count`, `expert_used_count`, `expert_feed_forward_length` (default `feed_forward_length / expert_used_count`)
/// and `expert_shared_feed_forward_length` (default `feed_forward_length`), as llama.cpp defaults them.
fn experts(k: &Keys<'_>, cfg: &mut Value) -> Result<()> {
    let n = k.req_u64("expert_count")?;
    let used = k.req_u64("expert_used_count")?;
    let ff = cfg.get("intermediate_size").and_then(Value::as_u64);
    let need = |key: &str| {
        k.err(format!(
            "{} is missing (and feed_forward_length too)",
            k.name(key)
        ))
    };
    let exp_ff = match k.opt_u64("expert_feed_forward_length")? {
        Some(x) => x,
        None => ff
            .zip((used > 0).then_some(used))
            .map(|(f, u)| f / u)
            .ok_or_else(|| need("expert_feed_forward_length"))?,
    };
    let shared = match k.opt_u64("expert_shared_feed_forward_length")? {
        Some(x) => x,
        None => ff.ok_or_else(|| need("expert_shared_feed_forward_length"))?,
    };
    cfg["num_experts"] = json!(n);
    cfg["num_experts_per_tok"] = json!(used);
    cfg["moe_intermediate_size"] = json!(exp_ff);
    cfg["shared_expert_intermediate_size"] = json!(shared);
    if ff.is_none() {
        // unused by an all-MoE model, but the config needs a size
        cfg["intermediate_size"] = json!(exp_ff);
    }
    Ok(())
}

/// The Gated DeltaNet sizes into `cfg` (llama.cpp's `ssm.*` names, as Mamba's: state_size is the key head dim,
/// group_count the k heads, time_step_rank the v heads, inner_size all v channels).
fn linear_attention(k: &Keys<'_>, cfg: &mut Value) -> Result<()> {
    let v_heads = k.req_u64("ssm.time_step_rank")?;
    let inner = k.req_u64("ssm.inner_size")?;
    if v_heads == 0 || inner % v_heads != 0 {
        return Err(k.err(format!(
            "ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({v_heads})"
        )));
    }
    cfg["linear_num_key_heads"] = json!(k.req_u64("ssm.group_count")?);
    cfg["linear_num_value_heads"] = json!(v_heads);
    cfg["linear_key_head_dim"] = json!(k.req_u64("ssm.state_size")?);
    cfg["linear_value_head_dim"] = json!(inner / v_heads);
    cfg["linear_conv_kernel_dim"] = json!(k.req_u64("ssm.conv_kernel")?);
    Ok(())
}

/// What a per-block array's length may be: one entry per block (`block_count`), or per trunk layer when the file has
/// MTP blocks after them (`nextn_predict_layers`).
fn expected_entries(n_all: u64, n_layers: u64) -> String {
    if n_all == n_layers {
        format!("{n_all} (block_count)")
    } else {
        format!("{n_all} (block_count) or {n_layers} (block_count − nextn_predict_layers)")
    }
}
