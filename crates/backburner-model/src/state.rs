//! Per-sequence model state, kept outside the layers: a conv + recurrent state per Gated DeltaNet layer and a paged
//! KV cache per full-attention layer, addressable by layer index and position range.

use std::ops::Range;

use backburner_kernels::attention::{attend_pages, Partial};
use backburner_kernels::kv::{KvDtype, PagedKvCache};

use crate::config::{LayerKind, ModelConfig};
use crate::model::Scratch;

mod device;
mod rollback;

pub use rollback::{Back, BackError, StateSnapshot};

/// Where the KV pages of one full-attention layer live, as the attention op sees them.
///
/// The op folds per-page partials (normalized output + log-sum-exp) left to right in page order
/// ([`attend_pages`]). A store holding the *oldest* pages elsewhere (a worker, in KV offload) implements this by
/// returning its fold over those pages, and the host continues the same fold over its own pages by passing that
/// partial as `init`: the result is bit-identical to one store holding every page.
pub trait PageStore {
    /// Positions stored.
    fn n_positions(&self) -> usize;
    /// Attention partial of q `[n_tokens, n_heads, head_dim]` f32 at positions `q_pos0..` over the stored pages,
    /// continuing the fold from `init`; returns `[n_tokens, n_heads, head_dim]` output and `[n_tokens, n_heads]` LSE.
    fn attend(
        &self,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
        init: Option<Partial>,
    ) -> Partial;
}

impl PageStore for PagedKvCache {
    fn n_positions(&self) -> usize {
        self.len()
    }

    fn attend(
        &self,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
        init: Option<Partial>,
    ) -> Partial {
        if self.pages().is_empty() && init.is_none() {
            return PagedKvCache::attend(self, q, n_tokens, n_heads, q_pos0, scale);
        }
        attend_pages(q, n_tokens, n_heads, q_pos0, self.pages(), scale, init)
    }
}

/// State of one Gated DeltaNet layer for one sequence (fixed size, not splittable by position).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearState {
    /// `[conv_dim, kernel-1]` f32: the last kernel−1 raw `in_proj_qkv` outputs per channel, oldest first.
    pub conv: Vec<f32>,
    /// `[n_v_heads, d_k, d_v]` f32: the delta-rule state S.
    pub recurrent: Vec<f32>,
}

impl LinearState {
    /// Zero state (sequence start) for `cfg`.
    pub fn zeros(cfg: &ModelConfig) -> Self {
        LinearState {
            conv: vec![0.0; cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1)],
            recurrent: vec![
                0.0;
                cfg.linear_num_value_heads
                    * cfg.linear_key_head_dim
                    * cfg.linear_value_head_dim
            ],
        }
    }

    /// Bytes held (f32).
    pub fn bytes(&self) -> usize {
        4 * (self.conv.len() + self.recurrent.len())
    }
}

/// The state of one layer.
#[derive(Debug)]
pub enum LayerState {
    /// Gated DeltaNet layer.
    Linear(LinearState),
    /// Full-attention layer: K (after k_norm and RoPE) and V rows, paged.
    Attention(PagedKvCache),
}

/// KV cache settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvOptions {
    /// Positions per page (default 4096).
    pub page_size: usize,
    /// Storage dtype (default f16).
    pub dtype: KvDtype,
}

impl KvOptions {
    /// Whether pages of these options can hold the attention rows of `cfg`: [`KvDtype::Bf16`] pages keep pairs of
    /// dimensions side by side and need an even `head_dim`. Check before [`ModelState::new`], which builds caches
    /// whose first append would panic otherwise.
    ///
    /// Errors: a message for the user naming the dtype and the model's `head_dim`.
    pub fn check(&self, cfg: &ModelConfig) -> Result<(), String> {
        if self.dtype.pairs() && !cfg.head_dim.is_multiple_of(2) {
            return Err(format!(
                "KV dtype {} needs an even head_dim (its pages keep pairs of dimensions side by side); this model's \
                 head_dim is {}: use --kv-dtype f16 or f32",
                self.dtype, cfg.head_dim
            ));
        }
        Ok(())
    }
}

impl Default for KvOptions {
    fn default() -> Self {
        KvOptions {
            page_size: 4096,
            dtype: KvDtype::F16,
        }
    }
}

/// State of every layer in `layers` (a host holds all of them; a worker later holds its tail range), plus the
/// number of positions processed.
#[derive(Debug)]
pub struct ModelState {
    layers: Vec<Option<LayerState>>,
    range: Range<usize>,
    n_tokens: usize,
    kv: KvOptions,
    /// Activation buffers of the forward pass and what an open verify keeps (not state: never snapshotted or sent).
    scratch: Scratch,
    /// The second sub-ubatch's buffers when two run interleaved (KV offload).
    scratch_b: Scratch,
    /// Where pages held elsewhere are attended (KV offload), and the step's first failure.
    remote: crate::remote::RemoteSlot,
    /// The state of the layers placed on devices, one per placed range of the model, made at the sequence's first
    /// pass ([`crate::Model::place_layers`]).
    pub(crate) device: Vec<Option<crate::device::DeviceState>>,
}

impl ModelState {
    /// Empty state for layers `range` of `cfg`. `kv` must pass [`KvOptions::check`] for `cfg` (a bf16 cache of an
    /// odd `head_dim` panics on its first append).
    pub fn new(cfg: &ModelConfig, range: Range<usize>, kv: KvOptions) -> Self {
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                if !range.contains(&i) {
                    return None;
                }
                Some(match cfg.layer_types[i] {
                    LayerKind::LinearAttention => LayerState::Linear(LinearState::zeros(cfg)),
                    LayerKind::FullAttention => LayerState::Attention(PagedKvCache::new(
                        kv.page_size,
                        cfg.num_key_value_heads,
                        cfg.head_dim,
                        kv.dtype,
                    )),
                })
            })
            .collect();
        ModelState {
            layers,
            range,
            n_tokens: 0,
            kv,
            scratch: Scratch::default(),
            scratch_b: Scratch::default(),
            remote: Default::default(),
            device: Vec::new(),
        }
    }

    /// Layers whose state this holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// KV settings.
    pub fn kv_options(&self) -> KvOptions {
        self.kv
    }

    /// Attaches the store of this sequence's pages held elsewhere (KV offload); attention ops of layers with
    /// offloaded pages go through it. Returns the previous one.
    pub fn set_remote(
        &mut self,
        r: Box<dyn crate::RemotePages>,
    ) -> Option<Box<dyn crate::RemotePages>> {
        self.remote.pages.replace(r)
    }

    /// Detaches the remote store.
    pub fn take_remote(&mut self) -> Option<Box<dyn crate::RemotePages>> {
        self.remote.pages.take()
    }

    /// The first failure of remote pages or of routed experts held elsewhere since the last call, if any: the
    /// forward steps since then produced meaningless output and must be discarded (restore a snapshot; the state's
    /// KV rows past it are dropped by truncation).
    pub fn take_remote_error(&mut self) -> Option<crate::RemoteError> {
        self.remote.error.take()
    }

    /// Latches `e` as the state's remote failure unless one is latched already.
    pub(crate) fn latch_remote_error(&mut self, e: crate::RemoteError) {
        self.remote.error.get_or_insert(e);
    }

    /// The remote failure latched, if any, without clearing it.
    pub fn remote_error(&self) -> Option<&crate::RemoteError> {
        self.remote.error.as_ref()
    }

    /// Positions held elsewhere (KV offload): the largest `offloaded()` of the held attention caches (they move
    /// together).
    pub fn offloaded(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| match l {
                LayerState::Attention(c) => c.offloaded(),
                LayerState::Linear(_) => 0,
            })
            .chain(
                self.device
                    .iter()
                    .flatten()
                    .flat_map(|d| self.range.clone().filter_map(|i| d.kv_offloaded(i))),
            )
            .max()
            .unwrap_or(0)
    }

    /// The KV cache of full-attention layer `i`, if held (to move its oldest pages elsewhere).
    pub fn kv_cache_mut(&mut self, i: usize) -> Option<&mut PagedKvCache> {
        match self.layers.get_mut(i)?.as_mut()? {
            LayerState::Attention(c) => Some(c),
            LayerState::Linear(_) => None,
        }
    }

    /// Positions processed so far (tokens in the sequence).
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub(crate) fn set_n_tokens(&mut self, n: usize) {
        self.n_tokens = n;
    }

    /// The state of layer `i`, if held.
    pub fn layer(&self, i: usize) -> Option<&LayerState> {
        self.layers.get(i).and_then(|l| l.as_ref())
    }

    /// Mutable state of layer `i` (if held) and the forward pass's activation buffers.
    pub(crate) fn layer_and_scratch(
        &mut self,
        i: usize,
    ) -> (
        Option<&mut LayerState>,
        &mut Scratch,
        &mut crate::remote::RemoteSlot,
    ) {
        self.scratch.close_verify();
        (
            self.layers.get_mut(i).and_then(|l| l.as_mut()),
            &mut self.scratch,
            &mut self.remote,
        )
    }

    /// The forward pass's activation buffers (and what an open verify keeps).
    pub(crate) fn scratch(&self) -> &Scratch {
        &self.scratch
    }

    /// The forward pass's activation buffers.
    pub(crate) fn scratch_mut(&mut self) -> &mut Scratch {
        &mut self.scratch
    }

    /// Both sets of activation buffers (the second serves interleaved sub-ubatches).
    pub(crate) fn scratches_mut(&mut self) -> [&mut Scratch; 2] {
        [&mut self.scratch, &mut self.scratch_b]
    }

    /// Layers `a` and `b = a - 1` (both held, a caller bug otherwise), both sets of activation buffers and the
    /// remote slot, for two sub-ubatches run interleaved.
    pub(crate) fn two_layers(
        &mut self,
        a: usize,
    ) -> (
        &mut LayerState,
        &mut LayerState,
        &mut Scratch,
        &mut Scratch,
        &mut crate::remote::RemoteSlot,
    ) {
        self.scratch.close_verify();
        let (lo, hi) = self.layers.split_at_mut(a);
        (
            hi[0].as_mut().expect("layer state held"),
            lo[a - 1].as_mut().expect("layer state held"),
            &mut self.scratch,
            &mut self.scratch_b,
            &mut self.remote,
        )
    }

    /// Bytes held by the forward pass's reusable activation buffers (grown to the largest ubatch run).
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.bytes() + self.scratch_b.bytes()
    }

    /// Mutable state of layer `i`, if held. Closes an open verify ([`ModelState::verify_span`]), as every change
    /// of the state outside a verify does.
    pub fn layer_mut(&mut self, i: usize) -> Option<&mut LayerState> {
        self.scratch.close_verify();
        self.layers.get_mut(i).and_then(|l| l.as_mut())
    }

    /// Every layer's state (`None` where not held), the forward pass's buffers (with what a verify keeps) and the
    /// remote slot: for the verify path, which keeps the verify open.
    pub(crate) fn verify_parts(
        &mut self,
    ) -> (
        &mut [Option<LayerState>],
        &mut Scratch,
        &mut crate::remote::RemoteSlot,
    ) {
        (&mut self.layers, &mut self.scratch, &mut self.remote)
    }

    /// KV rows `[p0, p1)` of full-attention layer `i` as f32 (`[p1-p0, n_kv_heads, head_dim]` each for K and V), or
    /// `None` if `i` is not a held attention layer.
    pub fn read_kv_rows(&self, i: usize, p0: usize, p1: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        match self.layer(i)? {
            LayerState::Attention(c) => Some(c.read_rows(p0, p1)),
            LayerState::Linear(_) => None,
        }
    }

    /// Appends K and V rows (`[n_rows, n_kv_heads, head_dim]` f32 each) to full-attention layer `i` at positions
    /// `[len, len + n_rows)`: how a node adopts rows computed elsewhere (a worker's tail-layer KV in split prefill).
    /// The caller then sets the position with [`ModelState::set_position`]. Returns false if `i` is not a held
    /// attention layer.
    pub fn append_kv_rows(&mut self, i: usize, k: &[f32], v: &[f32], n_rows: usize) -> bool {
        match self.layer_mut(i) {
            Some(LayerState::Attention(c)) => {
                c.append(k, v, n_rows);
                true
            }
            _ => false,
        }
    }

    /// The state of Gated DeltaNet layer `i`, if held.
    pub fn linear(&self, i: usize) -> Option<&LinearState> {
        match self.layer(i)? {
            LayerState::Linear(s) => Some(s),
            LayerState::Attention(_) => None,
        }
    }

    /// Replaces the state of Gated DeltaNet layer `i` (e.g. with a worker's after split prefill). Returns false if `i`
    /// is not a held linear layer or the sizes differ.
    pub fn set_linear(&mut self, i: usize, s: LinearState) -> bool {
        match self.layer_mut(i) {
            Some(LayerState::Linear(dst))
                if dst.conv.len() == s.conv.len() && dst.recurrent.len() == s.recurrent.len() =>
            {
                *dst = s;
                true
            }
            _ => false,
        }
    }

    /// Sets the position (tokens processed) after rows and states were adopted from elsewhere. Panics if a held
    /// attention layer's cache length differs from `n` (a caller bug that would corrupt attention).
    pub fn set_position(&mut self, n: usize) {
        self.scratch.close_verify();
        for (i, l) in self.layers.iter().enumerate() {
            if let Some(LayerState::Attention(c)) = l {
                assert_eq!(
                    c.len(),
                    n,
                    "set_position({n}): layer {i} holds {} KV rows",
                    c.len()
                );
            }
        }
        self.n_tokens = n;
    }

    /// Makes this state an exact copy of `src` (another sequence's state on the same layers and KV settings): its KV
    /// pages and linear states are copied, its position taken; the activation buffers and the remote store stay.
    /// The state of layers placed on a device is copied on that device ([`crate::device::DeviceState::duplicate`]).
    /// How a prompt prefilled once is forked into other sequences (`n` > 1). Returns false, changing nothing, when
    /// the layers, KV settings or device placement differ, either state has pages held elsewhere (KV offload) or a
    /// remote failure, or the device cannot make the copy (its memory).
    pub fn copy_from(&mut self, src: &ModelState) -> bool {
        let movable = |s: &ModelState| s.offloaded() == 0 && s.remote.error.is_none();
        let same_kinds = self.layers.len() == src.layers.len()
            && self.layers.iter().zip(&src.layers).all(|(d, s)| {
                matches!(
                    (d, s),
                    (None, None)
                        | (
                            Some(LayerState::Attention(_)),
                            Some(LayerState::Attention(_))
                        )
                        | (Some(LayerState::Linear(_)), Some(LayerState::Linear(_)))
                )
            });
        if !same_kinds
            || self.range != src.range
            || self.kv != src.kv
            || !movable(self)
            || !movable(src)
        {
            return false;
        }
        // the device's copies first: a failure there leaves this state as it was
        let Some(device) = self.device_copies(src) else {
            return false;
        };
        self.device = device;
        self.scratch.close_verify();
        for (d, s) in self.layers.iter_mut().zip(&src.layers) {
            match (d, s) {
                (Some(LayerState::Attention(d)), Some(LayerState::Attention(s))) => d.clone_from(s),
                (Some(LayerState::Linear(d)), Some(LayerState::Linear(s))) => d.clone_from(s),
                _ => {}
            }
        }
        self.n_tokens = src.n_tokens;
        true
    }

    /// Forgets everything (sequence start), pages held elsewhere included (their holder must drop them too),
    /// keeping allocations where cheap.
    pub fn clear(&mut self) {
        self.scratch.close_verify();
        self.remote.error = None;
        self.device.clear();
        for l in self.layers.iter_mut().flatten() {
            match l {
                LayerState::Attention(c) => c.clear(),
                LayerState::Linear(s) => {
                    s.conv.fill(0.0);
                    s.recurrent.fill(0.0);
                }
            }
        }
        self.n_tokens = 0;
    }

    /// Bytes of the KV pages held here (pages moved elsewhere not counted).
    pub fn kv_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| match l {
                LayerState::Attention(c) => c.bytes(),
                LayerState::Linear(_) => 0,
            })
            .sum()
    }

    /// Bytes of the Gated DeltaNet layers' conv and recurrent states.
    pub fn linear_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| match l {
                LayerState::Attention(_) => 0,
                LayerState::Linear(s) => s.bytes(),
            })
            .sum()
    }

    /// Bytes held: KV pages plus linear states ([`ModelState::kv_bytes`] + [`ModelState::linear_bytes`]).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| match l {
                LayerState::Attention(c) => c.bytes(),
                LayerState::Linear(s) => s.bytes(),
            })
            .sum()
    }
}
