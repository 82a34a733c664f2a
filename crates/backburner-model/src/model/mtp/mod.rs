//! The MTP (multi-token prediction) block of Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints, as vLLM and llama.cpp define
//! it (`docs/MTP.md`): a draft source for speculative decoding that reads the main model's final-normed hidden state
//! at a position and the token after it, and predicts the token after that.
//!
//! One step on a pair `(h_p, x_{p+1})` at position `p`:
//! `g = rms_norm1p(layer(fc · [rms_norm1p(embed(x_{p+1}), enorm) | rms_norm1p(h_p, hnorm)]), norm)`, logits =
//! `head(g)`, with `layer` a full-attention decoder layer over the block's own KV cache ([`MtpState`]), `embed` and
//! `head` the main model's.

use std::ops::Range;

use backburner_kernels::kv::PagedKvCache;
use backburner_kernels::profile::{self, Op};
use backburner_kernels::rowops;

use super::{Layer, Model, Scratch};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::state::{KvOptions, LayerState};

mod hidden;
mod load;

pub(crate) use load::{mtp_bytes, mtp_loads};

/// The MTP block a load of `config`'s ends reads from `ck`, loaded; `None` when there is none to load
/// ([`ModelConfig::mtp_num_hidden_layers`] is 0, or the file lacks it).
///
/// Errors: [`ModelError::ShapeMismatch`] / [`ModelError::UnsupportedDtype`] per tensor of a block the file holds.
pub(super) fn load_planned(
    ck: &crate::checkpoint::Checkpoint,
    config: &ModelConfig,
) -> Result<Option<Mtp>> {
    load::planned(ck, config)
        .map(|s| load::load(ck, config, &s))
        .transpose()
}

/// The weights of an MTP block.
#[derive(Debug)]
pub struct Mtp {
    /// `pre_fc_norm_embedding` `[H]` (1+w): norms the next token's embedding.
    pub enorm: Vec<f32>,
    /// `pre_fc_norm_hidden` `[H]` (1+w): norms the main model's hidden state.
    pub hnorm: Vec<f32>,
    /// `fc` `[H, 2H]`: the fusion of `[normed embedding | normed hidden]` (embedding first).
    pub fc: Linear,
    /// `layers.0`: a full-attention decoder layer of the main model's shapes (dense or MoE as layer 0 is).
    pub layer: Layer,
    /// `norm` `[H]` (1+w): the block's final norm, before the shared head.
    pub norm: Vec<f32>,
}

impl Mtp {
    /// Bytes held: the projections as packed and the f32 vectors.
    pub fn bytes(&self) -> usize {
        let f = |v: &Vec<f32>| 4 * v.len();
        let l = &self.layer;
        let mixer = match &l.mixer {
            super::Mixer::Attention(w) => {
                w.qkv.bytes() + w.o_proj.bytes() + f(&w.q_norm) + f(&w.k_norm)
            }
            super::Mixer::Linear(_) => unreachable!("the MTP layer is a full-attention layer"),
        };
        mixer
            + l.ffn.linears().iter().map(|m| m.bytes()).sum::<usize>()
            + f(&l.input_norm)
            + f(&l.post_norm)
            + self.fc.bytes()
            + f(&self.enorm)
            + f(&self.hnorm)
            + f(&self.norm)
    }

    /// The weight matrices (packed storage): `fc`, the attention's, the feed-forward block's.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut v = vec![&self.fc];
        if let super::Mixer::Attention(w) = &self.layer.mixer {
            v.extend([&w.qkv, &w.o_proj]);
        }
        v.extend(self.layer.ffn.linears());
        v
    }
}

/// One sequence's MTP state: the block's KV cache (one row per pair ingested, row `p` for the pair at position `p`)
/// and the frontier, the block's output `g` `[H]` of the last pair ingested, from which drafting starts.
#[derive(Debug)]
pub struct MtpState {
    cache: LayerState,
    scratch: Scratch,
    remote: crate::remote::RemoteSlot,
    /// `g` of the last pair ingested `[H]`; empty before the first ingest or after a truncation.
    frontier: Vec<f32>,
}

impl MtpState {
    /// An empty state for a model of `config`, its KV cache of `kv`'s page size and dtype (`kv` must pass
    /// [`KvOptions::check`] for `config`).
    pub fn new(config: &ModelConfig, kv: KvOptions) -> Self {
        let cache = PagedKvCache::new(
            kv.page_size,
            config.num_key_value_heads,
            config.head_dim,
            kv.dtype,
        );
        MtpState {
            cache: LayerState::Attention(cache),
            scratch: Scratch::default(),
            remote: Default::default(),
            frontier: Vec::new(),
        }
    }

    fn cache(&self) -> &PagedKvCache {
        match &self.cache {
            LayerState::Attention(c) => c,
            LayerState::Linear(_) => unreachable!("an MTP state holds a KV cache"),
        }
    }

    /// Pairs ingested: the position the next pair takes.
    pub fn n_positions(&self) -> usize {
        self.cache().len()
    }

    /// Whether drafting can start: a pair has been ingested since the state was made or truncated.
    pub fn has_frontier(&self) -> bool {
        !self.frontier.is_empty()
    }

    /// Drops the pairs at positions `>= n` (no effect for `n >= n_positions()`); when it drops any, the frontier
    /// goes too, so that the next [`Model::mtp_ingest`] must come before drafting.
    pub fn truncate(&mut self, n: usize) {
        if n < self.n_positions() {
            if let LayerState::Attention(c) = &mut self.cache {
                c.truncate(n);
            }
            self.frontier.clear();
        }
    }

    /// Bytes held by the KV rows and the frontier (not the activation buffers).
    pub fn bytes(&self) -> usize {
        self.cache().bytes() + 4 * self.frontier.len()
    }
}

/// The first index of the largest value (greedy pick; ties go to the lower id, as the engine's greedy sampler).
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Model {
    /// The MTP block, if this model loaded one (a load of the ends of a checkpoint that has it:
    /// [`ModelConfig::mtp_num_hidden_layers`]).
    pub fn mtp(&self) -> Option<&Mtp> {
        self.mtp.as_ref()
    }

    fn need_mtp(&self) -> Result<&Mtp> {
        self.mtp.as_ref().ok_or_else(|| {
            ModelError::InvalidConfig(
                "this model holds no MTP block (the checkpoint has none, or it was not loaded)"
                    .into(),
            )
        })
    }

    /// Runs the MTP block on `T = next.len()` pairs `(hidden[i], next[i])` at positions `st.n_positions()..+T`,
    /// appending their KV rows: `hidden` `[T, H]` f32 are the main model's final-normed hidden rows
    /// ([`Model::forward_tokens_hidden`], [`Model::final_hidden`]) or the block's own output of the previous draft
    /// step; `next` `[T]` the tokens that follow each. Returns the block's output rows `g` `[T, H]` (after its final
    /// norm; what the next draft step takes as its hidden input) and the logits `[rows, V]` of `logit_rows` (empty
    /// for `None`). Does not move the frontier.
    ///
    /// Errors: [`ModelError::InvalidConfig`] if the model holds no MTP block, `T` is 0, `hidden` is not `[T, H]`,
    /// an id is out of range or `logit_rows` is outside `0..T`.
    pub fn mtp_forward(
        &self,
        st: &mut MtpState,
        hidden: &[f32],
        next: &[u32],
        logit_rows: Option<Range<usize>>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_cpu_only("MTP drafting");
        let mtp = self.need_mtp()?;
        let (t, h) = (next.len(), self.config.hidden_size);
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        if t == 0 || hidden.len() != t * h {
            return bad(format!(
                "mtp_forward: {} hidden values for {t} tokens of width {h}",
                hidden.len()
            ));
        }
        if let Some(r) = &logit_rows {
            if r.start > r.end || r.end > t {
                return bad(format!("mtp_forward: logit rows {r:?} outside 0..{t}"));
            }
        }
        let e = self.embed(next)?;
        let g = self.mtp_rows(mtp, st, &e, hidden, t);
        let logits = match logit_rows {
            Some(r) => self.head_logits(&g[r.start * h..r.end * h], r.len()),
            None => Vec::new(),
        };
        Ok((g, logits))
    }

    /// The block on `t` pairs of embedded tokens `e` and hidden rows `hidden` (`[t, H]` each): fusion, layer at
    /// positions `st.n_positions()..`, final norm.
    fn mtp_rows(
        &self,
        mtp: &Mtp,
        st: &mut MtpState,
        e: &[f32],
        hidden: &[f32],
        t: usize,
    ) -> Vec<f32> {
        let h = self.config.hidden_size;
        let eps = self.config.rms_norm_eps as f32;
        let mut cat = vec![0.0f32; t * 2 * h];
        {
            let _p = profile::scope(Op::Norm);
            for ((row, er), hr) in cat
                .chunks_exact_mut(2 * h)
                .zip(e.chunks_exact(h))
                .zip(hidden.chunks_exact(h))
            {
                let (a, b) = row.split_at_mut(h);
                rowops::rms_norm(er, &mtp.enorm, eps, a);
                rowops::rms_norm(hr, &mtp.hnorm, eps, b);
            }
        }
        let mut x = mtp.fc.forward(&cat, t);
        let pos0 = st.n_positions();
        // the block's index as GGUF numbers it (past the trunk); it holds no experts elsewhere and no remote pages
        let idx = self.config.num_hidden_layers;
        self.forward_layer(
            idx,
            &mtp.layer,
            &mut x,
            t,
            pos0,
            &mut st.cache,
            &mut st.scratch,
            &mut st.remote,
        );
        let _p = profile::scope(Op::Norm);
        rowops::rms_norm_inplace(&mut x, &mtp.norm, eps);
        x
    }

    /// The output head (the untied `lm_head`, else the embedding) on rows `x` `[n, H]` → `[n, V]`, without a norm.
    fn head_logits(&self, x: &[f32], n: usize) -> Vec<f32> {
        let head = self
            .lm_head
            .as_ref()
            .or(self.embed.as_ref())
            .expect("the ends are loaded");
        head.forward_as(Op::Head, x, n)
    }

    /// Ingests `T` pairs (see [`Model::mtp_forward`]) and moves the frontier to the last one. After a prefill of
    /// `x_0..x_{n-1}` that sampled `x_n`: the `n` hidden rows and tokens `x_1..=x_n`. After a verify of
    /// `[x_n, d_1..d_k]` with `a` drafts accepted and the bonus token `b`: the verify's hidden rows `0..=a` and
    /// tokens `d_1..d_a, b`. The state must hold exactly the pairs before the first row's position (a caller
    /// invariant: `st.n_positions()` equals the main state's position of `hidden`'s first row).
    ///
    /// Errors: as [`Model::mtp_forward`].
    pub fn mtp_ingest(&self, st: &mut MtpState, hidden: &[f32], next: &[u32]) -> Result<()> {
        let (g, _) = self.mtp_forward(st, hidden, next, None)?;
        let h = self.config.hidden_size;
        st.frontier = g[g.len() - h..].to_vec();
        Ok(())
    }

    /// Drafts up to `k` tokens greedily from the frontier ([`argmax`] of each step's logits). See
    /// [`Model::mtp_draft_with`].
    ///
    /// Errors: as [`Model::mtp_draft_with`].
    pub fn mtp_draft(&self, st: &mut MtpState, k: usize) -> Result<Vec<u32>> {
        self.mtp_draft_with(st, k, |l| Some(argmax(l)))
    }

    /// Drafts up to `k` tokens from the frontier: step 1 hands the frontier's logits `[V]` to `pick`, which returns
    /// the draft token (or `None` to stop); each next step runs the block on (its previous output, the previous
    /// draft) at the next position. The steps' KV rows are dropped before returning, so the state (pairs and
    /// frontier) is as it was: drafting again gives the same tokens. Costs the head once and the block `k − 1` times.
    ///
    /// Errors: [`ModelError::InvalidConfig`] if the model holds no MTP block, nothing was ingested since the state was
    /// made or truncated, or `pick` returns an id out of range.
    pub fn mtp_draft_with(
        &self,
        st: &mut MtpState,
        k: usize,
        mut pick: impl FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>> {
        let mtp = self.need_mtp()?;
        if st.frontier.is_empty() {
            return Err(ModelError::InvalidConfig(
                "mtp_draft: nothing ingested since the MTP state was made or truncated".into(),
            ));
        }
        let base = st.n_positions();
        let drafts = self.draft_steps(mtp, st, k, &mut pick);
        st.truncate_keeping_frontier(base);
        drafts
    }

    /// The steps of [`Model::mtp_draft_with`], leaving their KV rows in `st`.
    fn draft_steps(
        &self,
        mtp: &Mtp,
        st: &mut MtpState,
        k: usize,
        pick: &mut impl FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Vec<u32>> {
        let mut g = st.frontier.clone();
        let mut drafts: Vec<u32> = Vec::with_capacity(k);
        while drafts.len() < k {
            if let Some(&prev) = drafts.last() {
                let e = self.embed(&[prev])?;
                g = self.mtp_rows(mtp, st, &e, &g, 1);
            }
            let Some(d) = pick(&self.head_logits(&g, 1)) else {
                break;
            };
            self.check_ids(&[d])?;
            drafts.push(d);
        }
        Ok(drafts)
    }
}

impl MtpState {
    /// Drops the KV rows at positions `>= n` and keeps the frontier (drafting's own rows).
    fn truncate_keeping_frontier(&mut self, n: usize) {
        if let LayerState::Attention(c) = &mut self.cache {
            c.truncate(n);
        }
    }
}
