//! Causal attention as mergeable partials (DESIGN.md §3.3, §5).
//!
//! A [`Partial`] is the softmax attention of some queries over a subset of the keys: the normalized output
//! and the log-sum-exp (LSE) of the scaled scores. Partials over disjoint key sets merge exactly in real
//! arithmetic by the online-softmax rule ("Online normalizer calculation for softmax", Milakov &
//! Gimelshein 2018; FlashAttention, Dao et al. 2022):
//!
//! ```text
//! m = max(λ1, λ2);  w_i = exp(λ_i − m);  O = (w1·O1 + w2·O2)/(w1 + w2);  λ = m + ln(w1 + w2)
//! ```
//!
//! In floats the result depends on the merge order, so [`attend_pages`] fixes it: a left fold over pages in
//! position order. A remote worker may fold the first pages and the host continue the fold with the rest
//! and get the same bits.

mod merge;
mod online;
mod page_kernel;
mod pair_kernel;

pub use merge::merge_into;
pub use page_kernel::attend_page;

use crate::kv::{KvPage, PageView};

/// Attention partial over some keys: normalized output and log-sum-exp of the scaled scores.
///
/// * `o`: `[n_tokens, n_heads, head_dim]` f32, `Σ_j softmax_j · v_j` over the keys seen (0 where none);
/// * `lse`: `[n_tokens, n_heads]` f32, natural-log `ln Σ_j exp(scale · q·k_j)` over the keys seen
///   (`f32::NEG_INFINITY` where no key was visible).
#[derive(Clone, Debug, PartialEq)]
pub struct Partial {
    /// Query tokens.
    pub n_tokens: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// `[n_tokens, n_heads, head_dim]` normalized outputs.
    pub o: Vec<f32>,
    /// `[n_tokens, n_heads]` log-sum-exp of the scaled scores.
    pub lse: Vec<f32>,
}

impl Partial {
    /// The partial over no keys: every `lse` is `-inf` and every `o` is 0 (the identity of
    /// [`merge_into`]).
    pub fn empty(n_tokens: usize, n_heads: usize, head_dim: usize) -> Self {
        Partial {
            n_tokens,
            n_heads,
            head_dim,
            o: vec![0.0; n_tokens * n_heads * head_dim],
            lse: vec![f32::NEG_INFINITY; n_tokens * n_heads],
        }
    }

    /// Whether the shape fields agree with the vector lengths.
    fn is_consistent(&self) -> bool {
        self.o.len() == self.n_tokens * self.n_heads * self.head_dim
            && self.lse.len() == self.n_tokens * self.n_heads
    }
}

/// Left fold of [`attend_page`] over `pages` in order, starting from `init` (or [`Partial::empty`]):
/// `acc = init; for p in pages { merge_into(&mut acc, &attend_page(q, .., p, scale)) }`.
///
/// * `q`: `[n_tokens, n_heads, head_dim]` f32 at absolute positions `q_pos0..q_pos0 + n_tokens`;
/// * `pages`: KV pages in position order, all with the same `n_kv_heads` and `head_dim`;
/// * `scale`: score multiplier (`head_dim^-0.5` for Qwen3.5);
/// * `init`: the fold so far (e.g. a worker's partial over the earlier pages).
///
/// Returns `[n_tokens, n_heads, head_dim]` / `[n_tokens, n_heads]` partial. Pages that lie entirely in the
/// future of every query are skipped (their partial would be empty, and merging it is an exact no-op), so
/// skipping does not change any bit. This fixed order is the contract of DESIGN.md §5.
///
/// Panics if `init` or a page does not match the shapes, or `n_heads` is not a multiple of `n_kv_heads`.
pub fn attend_pages(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    pages: &[KvPage],
    scale: f32,
    init: Option<Partial>,
) -> Partial {
    let head_dim = pages.first().map(KvPage::head_dim);
    fold_pages(
        q,
        n_tokens,
        n_heads,
        q_pos0,
        pages.iter().map(KvPage::view),
        scale,
        head_dim,
        init,
    )
}

/// The fold of [`attend_pages`] over page views from anywhere (local pages, pages received from a host, packed
/// copies): the same operations in the same order, so the same bits. `head_dim` is needed only when there is
/// neither an `init` nor a page to take it from (it defaults to `q.len() / (n_tokens · n_heads)`).
///
/// Panics as [`attend_pages`].
#[allow(clippy::too_many_arguments)]
pub fn fold_pages<'p>(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    pages: impl IntoIterator<Item = PageView<'p>>,
    scale: f32,
    head_dim: Option<usize>,
    init: Option<Partial>,
) -> Partial {
    let head_dim = match (&init, head_dim) {
        (Some(p), _) => p.head_dim,
        (None, Some(d)) => d,
        (None, None) if n_tokens * n_heads > 0 => q.len() / (n_tokens * n_heads),
        (None, None) => 0,
    };
    assert_eq!(
        q.len(),
        n_tokens * n_heads * head_dim,
        "attend_pages: `q` must have shape [{n_tokens}, {n_heads}, {head_dim}]"
    );
    let mut acc = init.unwrap_or_else(|| Partial::empty(n_tokens, n_heads, head_dim));
    assert!(
        acc.is_consistent()
            && acc.n_tokens == n_tokens
            && acc.n_heads == n_heads
            && acc.head_dim == head_dim,
        "attend_pages: `init` must be a [{n_tokens}, {n_heads}, {head_dim}] partial"
    );
    for page in pages {
        assert_eq!(
            page.head_dim(),
            head_dim,
            "attend_pages: page head_dim differs from the query's"
        );
        if let Some(part) = page_partial(q, n_tokens, n_heads, q_pos0, page, scale) {
            merge_into(&mut acc, &part);
        }
    }
    acc
}

/// One page's partial for the fold, or `None` when the page adds nothing (no query sees any of its rows), in which
/// case the fold skips it. Pages' partials may be computed in any order or place (for example while a worker
/// computes the fold over its pages) and then folded with [`fold_partials`] in page order.
pub fn page_partial(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    page: PageView<'_>,
    scale: f32,
) -> Option<Partial> {
    let last_pos = (q_pos0 + n_tokens).saturating_sub(1);
    if n_tokens == 0 || page.is_empty() || page.start() > last_pos {
        return None;
    }
    Some(attend_page(q, n_tokens, n_heads, q_pos0, page, scale))
}

/// Merges page partials into `acc` in the order given (page order): with the partials of [`page_partial`] this is
/// exactly the fold of [`fold_pages`], bit for bit.
///
/// Panics if a partial's shape differs from `acc`'s.
pub fn fold_partials<'a>(acc: &mut Partial, parts: impl IntoIterator<Item = &'a Partial>) {
    for p in parts {
        merge_into(acc, p);
    }
}
