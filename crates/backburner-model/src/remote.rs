//! Attention over KV pages held elsewhere (KV offload, docs/KV_OFFLOAD.md): the seam between the forward pass and
//! whatever holds a layer's oldest pages (a worker over the link, or an in-process store in tests).
//!
//! For a full-attention layer whose cache has pages elsewhere (`PagedKvCache::offloaded() > 0`), the forward pass
//! calls [`RemotePages::begin`] with the layer's queries, then [`RemotePages::finish`] for the partial over those
//! pages (folded in page order from empty: the first steps of the local fold), and continues the fold over the pages
//! it holds (`PagedKvCache::attend_after`): the same bits as a local cache holding every page. A failure is latched in
//! the state ([`crate::ModelState::take_remote_error`]); the step's output is then meaningless and the caller must
//! discard it and restore the state (it never reaches a sampler).

use backburner_kernels::attention::Partial;

/// Pages of some layers' oldest positions held elsewhere.
pub trait RemotePages: Send {
    /// Starts the partial attention of `q` (`[n_tokens, n_heads, head_dim]` f32 at positions `q_pos0..`, scores
    /// scaled by `scale`) over `layer`'s pages held elsewhere; the host computes its own pages meanwhile.
    ///
    /// Errors: [`RemoteError`] when the pages are unreachable (a dead or stalled worker, a refused request).
    fn begin(
        &mut self,
        layer: usize,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Result<(), RemoteError>;

    /// The partial started by the last [`RemotePages::begin`] for `layer`: `o` `[n_tokens, n_heads, head_dim]` and
    /// `lse` `[n_tokens, n_heads]`, folded over the pages in position order from empty.
    ///
    /// Errors: [`RemoteError`].
    fn finish(&mut self, layer: usize) -> Result<Partial, RemoteError>;
}

/// What is held elsewhere (KV pages, routed experts) could not be used: the message says what and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RemoteError(pub String);

/// The forward pass's handle on the remote pages of a sequence and the first failure of the current step.
#[derive(Default)]
pub(crate) struct RemoteSlot {
    pub pages: Option<Box<dyn RemotePages>>,
    pub error: Option<RemoteError>,
}

impl std::fmt::Debug for RemoteSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSlot")
            .field("attached", &self.pages.is_some())
            .field("error", &self.error)
            .finish()
    }
}

impl RemoteSlot {
    /// Starts the partial over `layer`'s pages held elsewhere; false after latching the failure (or when no store
    /// is attached although pages are elsewhere). The caller computes its own pages meanwhile, then calls
    /// [`RemoteSlot::finish`].
    pub fn begin(
        &mut self,
        layer: usize,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> bool {
        if self.error.is_some() {
            return false;
        }
        let Some(r) = self.pages.as_mut() else {
            self.error = Some(RemoteError(format!(
                "KV pages: layer {layer} has pages elsewhere but no remote store is attached"
            )));
            return false;
        };
        match r.begin(layer, q, n_tokens, n_heads, q_pos0, scale) {
            Ok(()) => true,
            Err(e) => {
                self.error = Some(e);
                false
            }
        }
    }

    /// The partial started by [`RemoteSlot::begin`] (`[n_tokens, n_heads, head_dim]`), or `None` after latching
    /// the failure (including a partial of another shape).
    pub fn finish(
        &mut self,
        layer: usize,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Option<Partial> {
        let r = self.pages.as_mut()?;
        match r.finish(layer) {
            Ok(p)
                if p.n_tokens == n_tokens
                    && p.n_heads == n_heads
                    && p.head_dim == head_dim
                    && p.o.len() == n_tokens * n_heads * head_dim
                    && p.lse.len() == n_tokens * n_heads =>
            {
                Some(p)
            }
            Ok(p) => {
                self.error = Some(RemoteError(format!(
                    "KV pages: layer {layer}: a [{}, {}, {}] partial for [{n_tokens}, {n_heads}, {head_dim}] queries",
                    p.n_tokens, p.n_heads, p.head_dim
                )));
                None
            }
            Err(e) => {
                self.error = Some(e);
                None
            }
        }
    }
}
