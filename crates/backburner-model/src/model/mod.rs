//! Weights of a Qwen3.5 hybrid decoder and the forward pass over any layer range.
//!
//! The math follows HF transformers 5.23 `modeling_qwen3_5.py` (see `../shared/ARCH_SPEC.md` for it as equations).
//! Projections that read the same input are fused at load time (q|gate|k|v, qkv|z|b|a, gate|up) so each block runs
//! one matmul per input; the fused layout is internal.

use std::ops::Range;
use std::path::Path;

use backburner_kernels::profile::{self, Op};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::ops::Rope;
use crate::state::ModelState;

mod batch;
mod bytes;
mod capture;
pub(crate) use capture::{conv_window, Capture};
mod experts;
mod forward;
mod interleave;
mod load;
mod mixer;
mod moe;
mod moe_split;
mod mtp;
mod place;
mod scratch;
pub mod verify;
pub use experts::ExpertStore;
use load::load_ends;
pub(crate) use load::read_names;
pub use load::{experts_bytes, load_bytes, load_bytes_without};
pub(crate) use mtp::mtp_loads;
pub use mtp::{Mtp, MtpState};
pub use scratch::Scratch;

/// Chunk length of the chunked delta rule (HF uses 64).
pub const GDN_CHUNK: usize = 64;

/// Gated DeltaNet weights of one layer.
#[derive(Debug)]
pub struct GdnWeights {
    /// Fused `[in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]`: `[conv_dim + Hv·Dv + 2·Hv, H]`.
    pub in_proj: Linear,
    /// `conv1d.weight` as `[conv_dim, kernel]`.
    pub conv_weight: Vec<f32>,
    /// `dt_bias` `[Hv]`.
    pub dt_bias: Vec<f32>,
    /// `−exp(A_log)` `[Hv]`.
    pub neg_a: Vec<f32>,
    /// Gated RMSNorm weight `[Dv]` (plain, not 1+w).
    pub norm: Vec<f32>,
    /// `out_proj` `[H, Hv·Dv]`.
    pub out_proj: Linear,
}

/// Gated full-attention weights of one layer.
#[derive(Debug)]
pub struct AttnWeights {
    /// Fused `[q_proj (per-head q|gate); k_proj; v_proj]`: `[Hq·2D + 2·Hkv·D, H]`.
    pub qkv: Linear,
    /// `q_norm` `[D]` (1+w).
    pub q_norm: Vec<f32>,
    /// `k_norm` `[D]` (1+w).
    pub k_norm: Vec<f32>,
    /// `o_proj` `[H, Hq·D]`.
    pub o_proj: Linear,
}

/// The token mixer of one layer.
#[derive(Debug)]
pub enum Mixer {
    /// Gated DeltaNet.
    Linear(GdnWeights),
    /// Gated full attention.
    Attention(AttnWeights),
}

/// The feed-forward block of one layer.
#[derive(Debug)]
pub enum Ffn {
    /// A SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
    Dense {
        /// Fused `[gate_proj; up_proj]` `[2I, H]`.
        gate_up: Linear,
        /// `down_proj` `[H, I]`.
        down: Linear,
    },
    /// Routed experts and a shared expert (HF `Qwen3_5MoeSparseMoeBlock`).
    Moe(Box<MoeWeights>),
}

/// A mixture-of-experts feed-forward block: `Σ_{e ∈ topk} w_e · expert_e(x) + sigmoid(g·x) · shared(x)`, each expert
/// a SwiGLU MLP, kept per expert so that one expert's rows are read alone.
#[derive(Debug)]
pub struct MoeWeights {
    /// `mlp.gate` `[E, H]`: the router's logits.
    pub router: Linear,
    /// Per expert: fused `[gate_proj; up_proj]` `[2·I_e, H]` and `down_proj` `[H, I_e]`; `None` for an expert held
    /// elsewhere (a worker: [`crate::remote_experts`]).
    pub experts: Vec<Option<(Linear, Linear)>>,
    /// The shared expert's fused `[gate_proj; up_proj]` `[2·I_s, H]`.
    pub shared_gate_up: Linear,
    /// The shared expert's `down_proj` `[H, I_s]`.
    pub shared_down: Linear,
    /// `shared_expert_gate` `[1, H]`.
    pub shared_gate: Linear,
    /// k: experts per token.
    pub top_k: usize,
    /// Renormalize the k routing weights to sum to 1.
    pub norm_topk_prob: bool,
}

impl Ffn {
    /// The projections, in the order a decode step reads them (every expert's, though a step reads only the
    /// routed ones).
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Ffn::Dense { gate_up, down } => vec![gate_up, down],
            Ffn::Moe(m) => {
                let mut v = vec![&m.router, &m.shared_gate_up, &m.shared_down, &m.shared_gate];
                for (gu, d) in m.experts.iter().flatten() {
                    v.extend([gu, d]);
                }
                v
            }
        }
    }
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer {
    /// `input_layernorm` `[H]` (1+w).
    pub input_norm: Vec<f32>,
    /// `post_attention_layernorm` `[H]` (1+w).
    pub post_norm: Vec<f32>,
    /// The mixer.
    pub mixer: Mixer,
    /// The feed-forward block.
    pub ffn: Ffn,
}

/// Which parts of a checkpoint to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Decoder layers to load.
    pub layers: Range<usize>,
    /// Load the embedding, final norm and output head (a host does; a worker holding a tail range does not).
    pub ends: bool,
}

/// A loaded model: the config, the layers of `range` and (for a host) the embedding, final norm and head.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    layers: Vec<Option<Layer>>,
    range: Range<usize>,
    /// `embed_tokens` `[V, H]`, also the head when tied.
    embed: Option<Linear>,
    final_norm: Option<Vec<f32>>,
    /// `lm_head` `[V, H]` when not tied.
    lm_head: Option<Linear>,
    rope: Rope,
    /// Bytes of routed experts' weights the products have read so far (each routed expert once per call).
    expert_reads: std::sync::atomic::AtomicU64,
    /// The holders of the routed experts this node leaves out, once attached.
    remote_experts: crate::remote_experts::Attached,
    /// Some routed experts of the layers held were left out at load.
    experts_elsewhere: bool,
    /// The MTP block (loaded with the ends when the config asks for it and the file has it).
    mtp: Option<Mtp>,
    /// Layer ranges placed on a device ([`Model::place_layers`]), in layer order, disjoint. The host holds none of
    /// their weights (their entries in `layers` are `None`).
    devices: Vec<crate::device::DeviceLayers>,
    /// Bytes the placed layers' weights took on the host ([`Layer::weight_bytes`]), before they left it.
    placed_bytes: usize,
    /// The final norm and output head on a device ([`Model::place_head`]).
    head_device: Option<place::DeviceHead>,
}

impl Model {
    /// Loads the whole model from a checkpoint directory (config.json + safetensors).
    ///
    /// Errors: every [`ModelError`] of [`ModelConfig::from_dir`] and [`Checkpoint::open`], plus
    /// [`ModelError::MissingTensor`] / [`ModelError::ShapeMismatch`] / [`ModelError::UnsupportedDtype`] per tensor.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        let opts = LoadOptions {
            layers: 0..config.num_hidden_layers,
            ends: true,
        };
        Self::from_checkpoint(config, &ckpt, &opts, |_, _| {})
    }

    /// Loads the parts named by `opts` from an opened checkpoint; `progress(done, total)` is called after each layer.
    /// A load of the ends (a host's) first logs the file's tensors that the architecture does not use
    /// ([`crate::checkpoint::log_unused_tensors`]).
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        Self::from_checkpoint_without(config, ckpt, opts, &|_, _| false, progress)
    }

    /// As [`Model::from_checkpoint`], leaving out the routed experts for which `elsewhere(layer, expert)` holds
    /// (they are held by workers: attach them with [`Model::attach_remote_experts`] before running the model).
    pub fn from_checkpoint_without(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        elsewhere: &dyn Fn(usize, usize) -> bool,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        Self::from_checkpoint_placed(config, ckpt, opts, elsewhere, None, progress)
    }

    /// As [`Model::from_checkpoint_without`], placing layers `place.layers` on `place.backend` as they load (as
    /// [`Model::place_layers`] would after the load): each of them is uploaded as soon as it is read and its host
    /// copy dropped, so the host's peak is the layers it keeps, the ends and about one layer, never the whole model.
    /// The model runs as one loaded whole and then placed does, to the bit. A placement of every layer of the model
    /// on a load that holds the ends places the final norm and the output head there too ([`Model::place_head`]),
    /// as llama.cpp's `-ngl` past the last layer does.
    ///
    /// Errors: as [`Model::from_checkpoint_without`]; [`ModelError::Device`] with [`DeviceError::Unsupported`] if
    /// `place.layers` is empty or not inside `opts.layers`, or holds a layer the backend cannot run (a
    /// mixture-of-experts layer), and the backend's memory and driver errors.
    ///
    /// [`DeviceError::Unsupported`]: crate::device::DeviceError::Unsupported
    pub fn from_checkpoint_placed(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        elsewhere: &dyn Fn(usize, usize) -> bool,
        place: Option<&crate::device::LayerPlacement>,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        if opts.layers.end > config.num_hidden_layers || opts.layers.start > opts.layers.end {
            return Err(ModelError::InvalidConfig(format!(
                "layer range {:?} is outside 0..{}",
                opts.layers, config.num_hidden_layers
            )));
        }
        if let Some(p) = place {
            place::check_placement(&config, p, &opts.layers)?;
        }
        if opts.ends {
            crate::checkpoint::log_unused_tensors(ckpt, &config);
        }
        let (embed, final_norm, lm_head) = if opts.ends {
            let (e, n, h) = load_ends(&config, ckpt)?;
            (Some(e), Some(n), h)
        } else {
            (None, None, None)
        };
        let mtp = if opts.ends {
            mtp::load_planned(ckpt, &config)?
        } else {
            None
        };
        let place::LoadedLayers {
            host: layers,
            device,
            placed_bytes,
        } = place::load_layers(
            &config,
            ckpt,
            opts.layers.clone(),
            elsewhere,
            place,
            &mut progress,
        )?;
        let rope = Rope::new(config.rotary_dim(), config.head_dim, config.rope.rope_theta);
        let experts_elsewhere = layers.iter().flatten().any(|l| match &l.ffn {
            Ffn::Moe(m) => m.experts.iter().any(Option::is_none),
            Ffn::Dense { .. } => false,
        });
        let mut model = Model {
            experts_elsewhere,
            config,
            layers,
            range: opts.layers.clone(),
            embed,
            final_norm,
            lm_head,
            rope,
            expert_reads: std::sync::atomic::AtomicU64::new(0),
            remote_experts: Default::default(),
            mtp,
            devices: device.into_iter().collect(),
            placed_bytes,
            head_device: None,
        };
        // every layer on the device: the final norm and the head go there too (as llama.cpp's -ngl past the layers)
        if let Some(p) =
            place.filter(|p| opts.ends && p.layers == (0..model.config.num_hidden_layers))
        {
            model.place_head(p.backend.clone())?;
        }
        Ok(model)
    }

    /// Attaches the holders of the routed experts this model was loaded without
    /// ([`Model::from_checkpoint_without`]); once per model. Returns false if holders were already attached.
    pub fn attach_remote_experts(
        &self,
        r: std::sync::Arc<dyn crate::remote_experts::RemoteExperts>,
    ) -> bool {
        self.remote_experts.set(r)
    }

    /// The attached holders of the experts held elsewhere, if any.
    pub fn remote_experts(
        &self,
    ) -> Option<&std::sync::Arc<dyn crate::remote_experts::RemoteExperts>> {
        self.remote_experts.get()
    }

    /// Whether some routed experts of the layers held are held elsewhere.
    pub fn has_remote_experts(&self) -> bool {
        self.experts_elsewhere
    }

    /// Bytes of routed experts' weights read so far: each call of a mixture-of-experts block adds the bytes of every
    /// expert it routed a token to, once (a prefill ubatch or a batched decode step reads an expert once for all its
    /// tokens). With [`Model::expert_bytes`], what a decode step really reads of the weights.
    pub fn expert_bytes_read(&self) -> u64 {
        self.expert_reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes of every routed expert's weights this node holds (0 for a dense model): the part of
    /// [`Model::weight_bytes`] a decode step reads only for the experts it routes to.
    pub fn expert_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| match &l.ffn {
                Ffn::Moe(m) => m
                    .experts
                    .iter()
                    .flatten()
                    .map(|(g, d)| g.bytes() + d.bytes())
                    .sum(),
                Ffn::Dense { .. } => 0,
            })
            .sum()
    }

    /// The validated config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Layers loaded.
    pub fn layer_range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Layer `i`, if loaded and held on the host: `None` for a layer placed on a device ([`Model::placement`]),
    /// whose weights left the host.
    pub fn layer(&self, i: usize) -> Option<&Layer> {
        self.layers.get(i).and_then(|l| l.as_ref())
    }

    /// Whether this node holds the embedding, final norm and head.
    pub fn holds_ends(&self) -> bool {
        self.embed.is_some() && self.final_norm.is_some()
    }

    /// Checks that every id is `< vocab_size`.
    ///
    /// Errors: [`ModelError::InvalidConfig`] naming the first id out of range.
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            Some(&bad) => Err(ModelError::InvalidConfig(format!(
                "token id {bad} is out of range for vocab_size {}",
                self.config.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Embedding lookup: ids `[n_tokens]` → residual stream `[n_tokens, hidden]` f32.
    ///
    /// Errors: [`ModelError::InvalidConfig`] if the embedding is not loaded or an id is ≥ vocab_size.
    pub fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut x = vec![0.0f32; ids.len() * self.config.hidden_size];
        self.embed_into(ids, &mut x)?;
        Ok(x)
    }

    /// As [`Model::embed`], into `x` (`[n_tokens, hidden]`; panics if it is not).
    pub(crate) fn embed_into(&self, ids: &[u32], x: &mut [f32]) -> Result<()> {
        let emb = self
            .embed
            .as_ref()
            .ok_or_else(|| ModelError::InvalidConfig("embedding not loaded on this node".into()))?;
        self.check_ids(ids)?;
        let _s = profile::scope(Op::Embed);
        let h = self.config.hidden_size;
        assert_eq!(x.len(), ids.len() * h, "embed: x is not [n_tokens, hidden]");
        for (row, &id) in x.chunks_exact_mut(h).zip(ids) {
            emb.row_into(id as usize, row);
        }
        Ok(())
    }

    /// One ubatch through the whole model on a node that holds every layer and the ends: embeds `ids`, runs every
    /// layer, advances the position, and returns the logits of the rows in `logit_rows` (`[rows, vocab]` f32; empty
    /// for `None`).
    ///
    /// Panics (a caller bug) if the model does not hold every layer and the ends, an id is out of range (check with
    /// [`Model::check_ids`] first) or `logit_rows` is outside `0..ids.len()`.
    pub fn forward_tokens(
        &self,
        ids: &[u32],
        state: &mut ModelState,
        logit_rows: Option<Range<usize>>,
    ) -> Vec<f32> {
        let t = ids.len();
        let mut x = self
            .embed(ids)
            .expect("forward_tokens: the embedding is loaded and the ids were checked");
        self.forward_layers(0..self.config.num_hidden_layers, &mut x, t, state);
        self.commit_tokens(state, t);
        match logit_rows {
            Some(r) => {
                let h = self.config.hidden_size;
                let n = r.len();
                self.logits(&x[r.start * h..r.end * h], n)
                    .expect("forward_tokens: the head is loaded")
            }
            None => Vec::new(),
        }
    }

    /// Final norm and output head on residual rows: x `[n_rows, hidden]` → logits `[n_rows, vocab]` f32.
    pub fn logits(&self, x: &[f32], n_rows: usize) -> Result<Vec<f32>> {
        let norm = self.final_norm.as_ref().ok_or_else(|| {
            ModelError::InvalidConfig("output head not loaded on this node".into())
        })?;
        let _s = profile::scope(Op::Head);
        if let Some(d) = &self.head_device {
            return Ok(d.logits(x, n_rows)?);
        }
        let mut h = x.to_vec();
        backburner_kernels::rowops::rms_norm_inplace(&mut h, norm, self.config.rms_norm_eps as f32);
        let head = self
            .lm_head
            .as_ref()
            .or(self.embed.as_ref())
            .expect("ends loaded");
        Ok(head.forward_as(Op::Head, &h, n_rows))
    }

    /// Runs layers `layers` on the residual stream x `[n_tokens, hidden]` (in place) for tokens at positions
    /// `state.n_tokens()..+n_tokens`, updating their state. The caller advances the position with
    /// [`Model::commit_tokens`] once every layer of the node has run (a node may run its layers in several calls).
    ///
    /// Panics if a layer in `layers` is not loaded or its state is not held (caller bug).
    pub fn forward_layers(
        &self,
        layers: Range<usize>,
        x: &mut [f32],
        n_tokens: usize,
        state: &mut ModelState,
    ) {
        let pos0 = state.n_tokens();
        self.forward_layers_at(layers, x, n_tokens, pos0, state)
    }

    /// As [`Model::forward_layers`], for tokens at positions `pos0..pos0 + n_tokens` given explicitly: a host in split
    /// prefill runs its head layers ahead of its tail layers, so the two ranges sit at different positions until the
    /// worker's rows are merged back. Each attention layer's cache must hold exactly `pos0` rows.
    pub fn forward_layers_at(
        &self,
        layers: Range<usize>,
        x: &mut [f32],
        n_tokens: usize,
        pos0: usize,
        state: &mut ModelState,
    ) {
        assert_eq!(
            x.len(),
            n_tokens * self.config.hidden_size,
            "x is not [T, H]"
        );
        let mut i = layers.start;
        while i < layers.end {
            if let Some(end) = self.forward_on_device(i..layers.end, x, n_tokens, pos0, state) {
                i = end;
                continue;
            }
            let layer = self.layers[i].as_ref().expect("layer not loaded");
            let (ls, scratch, remote) = state.layer_and_scratch(i);
            let ls = ls.expect("layer state not held");
            self.forward_layer(i, layer, x, n_tokens, pos0, ls, scratch, remote);
            i += 1;
        }
    }

    /// Advances the state's position by `n_tokens` after [`Model::forward_layers`] ran every held layer.
    pub fn commit_tokens(&self, state: &mut ModelState, n_tokens: usize) {
        state.set_n_tokens(state.n_tokens() + n_tokens);
    }
}
