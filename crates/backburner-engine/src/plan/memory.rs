//! The planner's memory model: what each decoder layer, the ends, the per-sequence state and a ubatch's activations
//! cost in bytes, from a checkpoint's stored tensors or from config.json alone.

use std::path::Path;

use backburner_kernels::kv::KvDtype;
use backburner_model::{Checkpoint, KvOptions, LayerKind, ModelConfig};
use serde::Serialize;

use super::PlanError;

/// Where the weight sizes of a [`ModelCosts`] came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightSource {
    /// Summed from the stored tensors of a checkpoint (weights stay in their stored dtype in memory).
    Checkpoint,
    /// Computed from config.json's shapes at `bytes_per_param` bytes per weight (its `dtype`/`torch_dtype`;
    /// bf16 when absent).
    Config {
        /// 2 for bf16/f16, 4 for f32.
        bytes_per_param: u64,
    },
}

/// One stored type among a checkpoint's weights: its name, how many of the tensors the load reads have it and their
/// stored bytes (in the file).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StoredType {
    /// `F32`, `BF16`, `F16`, `Q4_K`, … ([`backburner_model::checkpoint::StoredDtype::name`]).
    pub dtype: String,
    /// Tensors of this type.
    pub tensors: usize,
    /// Their stored bytes.
    pub stored_bytes: u64,
}

/// What the weight sizes were read from: the container and the stored types.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WeightsFormat {
    /// `"safetensors"`, `"gguf"`, or `"config"` (no weights: sizes from config.json's shapes and dtype).
    pub container: String,
    /// The stored types of the tensors the load reads (the text model's layers and ends: not a hub checkpoint's
    /// vision tower or MTP head), most bytes first; empty for `"config"`.
    pub types: Vec<StoredType>,
}

impl WeightsFormat {
    /// For the user: `GGUF: Q4_K (12 tensors), F32 (23 tensors)`, `safetensors: BF16 (...)`, or `config.json shapes at
    /// 2 bytes per weight (no weights read)`.
    pub fn describe(&self, source: &WeightSource) -> String {
        if let WeightSource::Config { bytes_per_param } = source {
            return format!(
                "config.json shapes at {bytes_per_param} bytes per weight (no weights read)"
            );
        }
        let name = match self.container.as_str() {
            "gguf" => "GGUF",
            other => other,
        };
        let types: Vec<String> = self
            .types
            .iter()
            .map(|t| {
                format!(
                    "{} ({} tensor{})",
                    t.dtype,
                    t.tensors,
                    if t.tensors == 1 { "" } else { "s" }
                )
            })
            .collect();
        format!("{name}: {}", types.join(", "))
    }

    /// The stored types of the tensors a full load of `cfg` reads from `ck`.
    ///
    /// Errors: [`backburner_model::ModelError::MissingTensor`] never (only present names are read).
    fn of_checkpoint(cfg: &ModelConfig, ck: &Checkpoint) -> Result<Self, PlanError> {
        let pre = cfg.layout.prefix();
        let ends = [
            format!("{pre}embed_tokens.weight"),
            format!("{pre}norm.weight"),
            "lm_head.weight".to_string(),
        ];
        let read = |name: &str| -> bool {
            if let Some(rest) = name
                .strip_prefix(pre)
                .and_then(|r| r.strip_prefix("layers."))
            {
                return rest
                    .split_once('.')
                    .and_then(|(i, _)| i.parse::<usize>().ok())
                    .is_some_and(|i| i < cfg.num_hidden_layers);
            }
            (name != "lm_head.weight" || !cfg.tie_word_embeddings) && ends.iter().any(|e| e == name)
        };
        let mut types: Vec<StoredType> = Vec::new();
        for name in ck.names().into_iter().filter(|n| read(n)) {
            let dtype = ck.dtype(name)?.name();
            let bytes = ck.stored_bytes(name)? as u64;
            match types.iter_mut().find(|t| t.dtype == dtype) {
                Some(t) => {
                    t.tensors += 1;
                    t.stored_bytes = t.stored_bytes.saturating_add(bytes);
                }
                None => types.push(StoredType {
                    dtype,
                    tensors: 1,
                    stored_bytes: bytes,
                }),
            }
        }
        types.sort_by(|a, b| {
            b.stored_bytes
                .cmp(&a.stored_bytes)
                .then(a.dtype.cmp(&b.dtype))
        });
        Ok(WeightsFormat {
            container: if ck.is_gguf() { "gguf" } else { "safetensors" }.into(),
            types,
        })
    }
}

/// Bytes of the parts a node holds only when it holds the ends (the host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EndsBytes {
    /// `embed_tokens` `[vocab, hidden]`.
    pub embedding: u64,
    /// The final RMSNorm `[hidden]`.
    pub final_norm: u64,
    /// `lm_head` `[vocab, hidden]`; 0 when the head is tied to the embedding.
    pub head: u64,
}

impl EndsBytes {
    /// All three, in bytes.
    pub fn total(&self) -> u64 {
        self.embedding
            .saturating_add(self.final_norm)
            .saturating_add(self.head)
    }
}

/// What one model costs in memory, per part. All sizes are bytes; positions and ubatches are tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelCosts {
    /// The kind of each decoder layer (its length is the layer count).
    pub layer_kinds: Vec<LayerKind>,
    /// Weight bytes of each decoder layer (every tensor under `layers.{i}.`).
    pub layer_weight_bytes: Vec<u64>,
    /// Weight bytes of each decoder layer's routed experts (0 for a dense layer): the part a worker may hold for
    /// it (experts on workers).
    pub layer_expert_bytes: Vec<u64>,
    /// Weight bytes of the embedding, final norm and head.
    pub ends: EndsBytes,
    /// K and V bytes of one position of ONE full-attention layer: `2 × n_kv_heads × head_dim × kv dtype bytes`.
    pub kv_bytes_per_position: u64,
    /// Fixed state bytes of one Gated DeltaNet layer (f32): conv `[conv_dim, kernel−1]` + recurrent
    /// `[n_v_heads, d_k, d_v]`.
    pub linear_state_bytes: u64,
    /// Activation bytes per ubatch token on a node running decoder layers (see [`ModelCosts::scratch_bytes`]).
    pub scratch_bytes_per_token: u64,
    /// Bytes per token of one attention op's link traffic in KV offload: q `[n_heads, head_dim]` out, the partial
    /// `[n_heads, head_dim]` and its LSE `[n_heads]` back, all f32.
    pub offload_bytes_per_token_layer: u64,
    /// Width of the residual stream (elements).
    pub hidden: usize,
    /// Query heads of the attention layers.
    pub n_heads: usize,
    /// Head dim of the attention layers.
    pub head_dim: usize,
    /// Vocabulary size (rows of the head).
    pub vocab: usize,
    /// Layers per hybrid cycle: the seams a split prefers are multiples of it.
    pub interval: usize,
    /// The longest context the checkpoint claims (tokens).
    pub max_position_embeddings: usize,
    /// KV dtype the KV sizes are for.
    pub kv_dtype: KvDtype,
    /// Where the weight sizes came from.
    pub source: WeightSource,
    /// The weights' container and stored types.
    pub format: WeightsFormat,
}

/// Multiplies element counts into bytes, saturating (a saturated size never fits anywhere).
fn mul(xs: &[usize]) -> u64 {
    xs.iter().fold(1u64, |a, &x| a.saturating_mul(x as u64))
}

impl ModelCosts {
    /// Costs from `cfg`'s shapes with `bytes_per_param` bytes per weight (2 = bf16/f16, 4 = f32) and KV in `kv`.
    /// Tensor shapes are those the loader reads (gated attention: `q_proj` is `[2·n_heads·head_dim, hidden]`).
    pub fn from_config(cfg: &ModelConfig, bytes_per_param: u64, kv: KvDtype) -> Self {
        let layer_weight_bytes: Vec<u64> = (0..cfg.num_hidden_layers)
            .map(|i| layer_params(cfg, i).saturating_mul(bytes_per_param))
            .collect();
        let layer_expert_bytes = (0..cfg.num_hidden_layers)
            .map(|i| super::moe::expert_params(cfg, i).saturating_mul(bytes_per_param))
            .collect();
        let emb = mul(&[cfg.vocab_size, cfg.hidden_size]).saturating_mul(bytes_per_param);
        let ends = EndsBytes {
            embedding: emb,
            final_norm: mul(&[cfg.hidden_size]).saturating_mul(bytes_per_param),
            head: if cfg.tie_word_embeddings { 0 } else { emb },
        };
        Self::with_weights(
            cfg,
            (layer_weight_bytes, layer_expert_bytes),
            ends,
            kv,
            WeightSource::Config { bytes_per_param },
            WeightsFormat {
                container: "config".into(),
                types: Vec::new(),
            },
        )
    }

    /// Costs from a checkpoint: each layer's and the ends' bytes are what loading them allocates
    /// ([`backburner_model::load_bytes`], from the tensor headers: projections packed in their dtype with their
    /// panel padding, vectors as f32), so a plan and the check `run` makes before loading agree to the byte; the
    /// embedding and an untied head each as stored.
    ///
    /// Errors: [`PlanError::Model`] for a tensor the load would need that is missing or of an unsupported dtype.
    pub fn from_checkpoint(
        cfg: &ModelConfig,
        ck: &Checkpoint,
        kv: KvDtype,
    ) -> Result<Self, PlanError> {
        let bytes = |layers: std::ops::Range<usize>, ends: bool| {
            backburner_model::load_bytes(ck, cfg, &backburner_model::LoadOptions { layers, ends })
        };
        let per_layer = (0..cfg.num_hidden_layers)
            .map(|i| bytes(i..i + 1, false))
            .collect::<Result<Vec<u64>, _>>()?;
        let all: Vec<usize> = (0..cfg.moe.as_ref().map_or(0, |m| m.num_experts)).collect();
        let experts = (0..cfg.num_hidden_layers)
            .map(|i| backburner_model::experts_bytes(ck, cfg, i..i + 1, &all))
            .collect::<Result<Vec<u64>, _>>()?;
        let all_ends = bytes(0..0, true)?;
        let final_norm = mul(&[cfg.hidden_size, 4]);
        // the embedding alone: the ends of the same model with its head tied (a GGUF file may store the head in
        // another type than the embedding, e.g. Q6_K beside Q4_K)
        let tied = ModelConfig {
            tie_word_embeddings: true,
            ..cfg.clone()
        };
        let embedding = backburner_model::load_bytes(
            ck,
            &tied,
            &backburner_model::LoadOptions {
                layers: 0..0,
                ends: true,
            },
        )?
        .saturating_sub(final_norm);
        let head = all_ends
            .saturating_sub(final_norm)
            .saturating_sub(embedding);
        let ends = EndsBytes {
            embedding,
            final_norm,
            head,
        };
        Ok(Self::with_weights(
            cfg,
            (per_layer, experts),
            ends,
            kv,
            WeightSource::Checkpoint,
            WeightsFormat::of_checkpoint(cfg, ck)?,
        ))
    }

    /// Reads `dir/config.json` (or a GGUF's metadata) and, when the path holds weights (`model.safetensors`, a sharded
    /// index or a GGUF file), sums
    /// the stored tensors ([`ModelCosts::from_checkpoint`]); otherwise computes the weights from the config's shapes
    /// and its `dtype`/`torch_dtype` (`bfloat16` when absent; [`ModelCosts::from_config`]).
    ///
    /// Errors: [`PlanError::Model`] for an unreadable config or checkpoint; [`PlanError::Invalid`] for a dtype other
    /// than bfloat16, float16 or float32.
    pub fn from_dir(dir: &Path, kv: KvDtype) -> Result<(ModelConfig, Self), PlanError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let has_weights = dir.join("model.safetensors").exists()
            || dir.join("model.safetensors.index.json").exists()
            || backburner_model::checkpoint::is_gguf(dir);
        let costs = if has_weights {
            let ck = Checkpoint::open(dir)?;
            Self::from_checkpoint(&cfg, &ck, kv)?
        } else {
            let text = backburner_model::fsutil::read_text(
                &dir.join("config.json"),
                backburner_model::fsutil::MAX_SMALL_FILE,
            )?;
            Self::from_config(&cfg, config_dtype_bytes(&text)?, kv)
        };
        Ok((cfg, costs))
    }

    fn with_weights(
        cfg: &ModelConfig,
        (layer_weight_bytes, layer_expert_bytes): (Vec<u64>, Vec<u64>),
        ends: EndsBytes,
        kv: KvDtype,
        source: WeightSource,
        format: WeightsFormat,
    ) -> Self {
        let (hq, d) = (cfg.num_attention_heads, cfg.head_dim);
        ModelCosts {
            layer_kinds: cfg.layer_types.clone(),
            layer_weight_bytes,
            layer_expert_bytes,
            ends,
            kv_bytes_per_position: kv_bytes_per_layer_position(cfg, kv),
            linear_state_bytes: linear_state_bytes(cfg),
            scratch_bytes_per_token: scratch_bytes_per_token(cfg),
            offload_bytes_per_token_layer: mul(&[4, hq]).saturating_mul(2 * d as u64 + 1),
            hidden: cfg.hidden_size,
            n_heads: hq,
            head_dim: d,
            vocab: cfg.vocab_size,
            interval: cfg.full_attention_interval.max(1),
            max_position_embeddings: cfg.max_position_embeddings,
            kv_dtype: kv,
            source,
            format,
        }
    }

    /// Number of decoder layers.
    pub fn n_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    /// Weight bytes of layers `r` (no ends).
    pub fn weight_bytes(&self, r: std::ops::Range<usize>) -> u64 {
        self.layer_weight_bytes[r]
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Weight bytes of the whole model: every layer plus the ends.
    pub fn total_weight_bytes(&self) -> u64 {
        self.weight_bytes(0..self.n_layers())
            .saturating_add(self.ends.total())
    }

    /// Full-attention layers in `r`.
    pub fn attention_layers(&self, r: std::ops::Range<usize>) -> usize {
        self.layer_kinds[r]
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count()
    }

    /// Fixed recurrent + conv state bytes of the Gated DeltaNet layers in `r`.
    pub fn state_bytes(&self, r: std::ops::Range<usize>) -> u64 {
        let linear = r.len() - self.attention_layers(r);
        self.linear_state_bytes.saturating_mul(linear as u64)
    }

    /// KV bytes of `positions` positions over the full-attention layers in `r`.
    pub fn kv_bytes(&self, r: std::ops::Range<usize>, positions: usize) -> u64 {
        self.kv_bytes_per_position
            .saturating_mul(self.attention_layers(r) as u64)
            .saturating_mul(positions as u64)
    }

    /// Activation (scratch) bytes of a node that runs decoder layers on ubatches of `ubatch` tokens; with `ends`, one
    /// f32 logits row (`vocab × 4`) more. The estimate is
    /// `ubatch × 4 × 2 × (3·hidden + 3·intermediate + 2·proj + core)` where `proj` is the wider fused input
    /// projection (Gated DeltaNet `conv_dim + n_v·d_v + 2·n_v` or attention `2·n_q·d + 2·n_kv·d`) and `core` the
    /// wider mixer output (`n_v·d_v` or `n_q·d`): the forward pass's buffers (normed input, projection, mixer
    /// output, gate|up, activation, q/k/v/z heads), ×2 for the second buffer set of interleaved halves. It is an
    /// estimate with headroom, not a bound on allocator behaviour. A node with no layers and no ends needs none.
    pub fn scratch_bytes(&self, ubatch: usize, layers: bool, ends: bool) -> u64 {
        let mut b = 0u64;
        if layers {
            b = self.scratch_bytes_per_token.saturating_mul(ubatch as u64);
        }
        if ends {
            b = b.saturating_add(mul(&[self.vocab, 4]));
        }
        b
    }

    /// Scratch of a worker that only attends offloaded pages: the room a worker reserves for one attention request,
    /// three partials (`[ubatch, n_heads, head_dim]` + LSE `[ubatch, n_heads]`) and two queries
    /// (`[ubatch, n_heads, head_dim]`), f32: `ubatch × 4 × (5·n_heads·head_dim + 3·n_heads)`.
    pub fn offload_scratch_bytes(&self, ubatch: usize) -> u64 {
        let (hq, d) = (self.n_heads as u64, self.head_dim as u64);
        (4 * (5 * hq * d + 3 * hq)).saturating_mul(ubatch as u64)
    }
}

/// The headroom factor of [`ModelCosts::scratch_bytes`] (two buffer sets).
pub const SCRATCH_FACTOR: u64 = 2;

/// `2 × n_kv_heads × head_dim × kv bytes`: the KV of one position of one full-attention layer, derived from the
/// engine's own [`crate::offload::bytes_per_position`] (which covers every attention layer).
fn kv_bytes_per_layer_position(cfg: &ModelConfig, kv: KvDtype) -> u64 {
    let opts = KvOptions {
        dtype: kv,
        ..KvOptions::default()
    };
    let all = crate::offload::bytes_per_position(cfg, opts) as u64;
    let n = crate::offload::attention_layers(cfg).len() as u64;
    all.checked_div(n)
        .unwrap_or_else(|| mul(&[2, cfg.num_key_value_heads, cfg.head_dim, kv.size_of()]))
}

/// Conv + recurrent state bytes of one Gated DeltaNet layer ([`crate::memory::recurrent_bytes`] of one layer; 0
/// for a model without one).
fn linear_state_bytes(cfg: &ModelConfig) -> u64 {
    cfg.layer_types
        .iter()
        .position(|k| *k == LayerKind::LinearAttention)
        .and_then(|i| crate::memory::recurrent_bytes(cfg, i..i + 1))
        .unwrap_or(0)
}

/// Activation bytes per ubatch token of a node running decoder layers (see [`ModelCosts::scratch_bytes`]); also
/// the per-token part of [`crate::memory::scratch_estimate`], the check `run` makes before allocating.
pub(crate) fn scratch_bytes_per_token(cfg: &ModelConfig) -> u64 {
    scratch_width(cfg).saturating_mul(4 * SCRATCH_FACTOR)
}

/// Elements per ubatch token of the forward pass's activations (see [`ModelCosts::scratch_bytes`]).
fn scratch_width(cfg: &ModelConfig) -> u64 {
    let h = cfg.hidden_size as u64;
    // the feed-forward blocks' width: the dense MLP's where a layer has one; an MoE block's shared expert or routed
    // expert (one expert's rows at a time) and its sum `[T, H]`
    let dense = cfg.ffn_types.contains(&backburner_model::FfnKind::Dense);
    let moe = cfg.moe.as_ref().map_or(0, |m| {
        (m.shared_expert_intermediate_size
            .max(m.moe_intermediate_size) as u64)
            .saturating_add(h)
    });
    let i = match (cfg.moe.is_some(), dense) {
        (true, false) => moe,
        (true, true) => moe.max(cfg.intermediate_size as u64),
        (false, _) => cfg.intermediate_size as u64,
    };
    let (hq, hkv, d) = (
        cfg.num_attention_heads as u64,
        cfg.num_key_value_heads as u64,
        cfg.head_dim as u64,
    );
    let vd = (cfg.linear_num_value_heads * cfg.linear_value_head_dim) as u64;
    let gdn_proj = cfg.conv_dim() as u64 + vd + 2 * cfg.linear_num_value_heads as u64;
    let attn_proj = 2 * hq * d + 2 * hkv * d;
    let proj = gdn_proj.max(attn_proj);
    let core = vd.max(hq * d);
    3 * h + 3 * i + 2 * proj + core
}

/// Parameters of decoder layer `i`: every tensor of the architecture's table for it (norms and small vectors included).
fn layer_params(c: &ModelConfig, i: usize) -> u64 {
    backburner_model::arch::arch_of(c).layer_elements(c, i)
}

/// Bytes per weight named by config.json's `dtype` (transformers ≥ 4.56) or `torch_dtype`, at the top level or in
/// `text_config`; 2 (bf16) when absent. Errors: [`PlanError::Invalid`] for bad JSON or an unsupported dtype.
pub fn config_dtype_bytes(config_json: &str) -> Result<u64, PlanError> {
    let v: serde_json::Value = serde_json::from_str(config_json)
        .map_err(|e| PlanError::Invalid(format!("config.json: {e}")))?;
    let pick = |o: &serde_json::Value| {
        o.get("dtype")
            .or_else(|| o.get("torch_dtype"))
            .and_then(|d| d.as_str())
            .map(str::to_string)
    };
    let name = pick(&v).or_else(|| v.get("text_config").and_then(pick));
    match name.as_deref() {
        None | Some("bfloat16") | Some("float16") => Ok(2),
        Some("float32") => Ok(4),
        Some(other) => Err(PlanError::Invalid(format!(
            "config.json dtype {other:?} is not one this engine loads (bfloat16, float16, float32)"
        ))),
    }
}
