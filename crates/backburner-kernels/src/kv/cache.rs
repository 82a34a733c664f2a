//! The paged KV cache of one full-attention layer.

use super::{KvDtype, KvPage};
use crate::attention::{attend_pages, fold_partials, page_partial, Partial};

/// A change to the cache that would lose or invent rows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Only full pages other than the newest one may leave the cache (the newest may still be written).
    #[error(
        "cannot take {asked} pages: only {movable} full pages before the newest one are held here"
    )]
    NotMovable {
        /// Pages asked for.
        asked: usize,
        /// Full pages that could move.
        movable: usize,
    },
    /// Pages put back must be the ones taken last, full, of this cache's shape and dtype, in order.
    #[error("the pages put back do not end at position {offloaded} in whole pages of this cache's shape")]
    BadRestore {
        /// Positions held elsewhere now.
        offloaded: usize,
    },
    /// The positions asked for are held elsewhere (a worker).
    #[error("positions below {offloaded} are held elsewhere; asked for {from}")]
    Offloaded {
        /// Positions held elsewhere.
        offloaded: usize,
        /// The first position asked for.
        from: usize,
    },
}

/// The paged KV cache of one full-attention layer: a `Vec` of [`KvPage`]s, all of `page_size` capacity;
/// page `i` holds absolute positions `[i * page_size, ...)`, every page is full except possibly the last,
/// and no page is empty.
///
/// Attention over the cache ([`PagedKvCache::attend`]) is the fixed left fold of per-page partials of
/// [`attend_pages`] (DESIGN.md §3.3, §5), so any prefix of the pages may be attended elsewhere and the
/// fold continued here with identical bits.
#[derive(Clone, Debug, PartialEq)]
pub struct PagedKvCache {
    page_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
    len: usize,
    /// Positions `[0, offloaded)` are held elsewhere (whole pages); `pages` starts at `offloaded`.
    offloaded: usize,
    pages: Vec<KvPage>,
}

impl PagedKvCache {
    /// An empty cache of pages of `page_size` positions of `[n_kv_heads, head_dim]` K and V rows in `dtype`.
    ///
    /// Panics if `page_size`, `n_kv_heads` or `head_dim` is zero.
    pub fn new(page_size: usize, n_kv_heads: usize, head_dim: usize, dtype: KvDtype) -> Self {
        assert!(
            page_size > 0,
            "PagedKvCache::new: page_size must be positive"
        );
        assert!(
            n_kv_heads > 0,
            "PagedKvCache::new: n_kv_heads must be positive"
        );
        assert!(head_dim > 0, "PagedKvCache::new: head_dim must be positive");
        PagedKvCache {
            page_size,
            n_kv_heads,
            head_dim,
            dtype,
            len: 0,
            offloaded: 0,
            pages: Vec::new(),
        }
    }

    /// Positions `[0, offloaded)` held elsewhere (a multiple of the page size); the pages here start there.
    pub fn offloaded(&self) -> usize {
        self.offloaded
    }

    /// Full pages held here that may move elsewhere: every full page before the newest (which may still be
    /// written).
    pub fn movable_pages(&self) -> usize {
        self.pages.len().saturating_sub(1)
    }

    /// Moves the `n` oldest pages held here out of the cache (to be held elsewhere) and returns them in position
    /// order; `offloaded` grows by `n · page_size`. Errors: [`KvError::NotMovable`] if fewer than `n` pages may
    /// move ([`PagedKvCache::movable_pages`]); nothing changes then.
    pub fn take_oldest(&mut self, n: usize) -> Result<Vec<KvPage>, KvError> {
        let movable = self.movable_pages();
        if n > movable {
            return Err(KvError::NotMovable { asked: n, movable });
        }
        let taken: Vec<KvPage> = self.pages.drain(..n).collect();
        self.offloaded += n * self.page_size;
        Ok(taken)
    }

    /// Puts back the pages taken last (for example re-ingested after a worker was lost): they must be full, of
    /// this cache's shape and dtype, consecutive, and end exactly at `offloaded`. Errors: [`KvError::BadRestore`];
    /// nothing changes then.
    pub fn restore_oldest(&mut self, pages: Vec<KvPage>) -> Result<(), KvError> {
        let n = pages.len();
        let bad = KvError::BadRestore {
            offloaded: self.offloaded,
        };
        let Some(first) = self.offloaded.checked_sub(n * self.page_size) else {
            return Err(bad);
        };
        let fits = pages.iter().enumerate().all(|(i, p)| {
            p.start() == first + i * self.page_size
                && p.is_full()
                && p.capacity() == self.page_size
                && p.n_kv_heads() == self.n_kv_heads
                && p.head_dim() == self.head_dim
                && p.dtype() == self.dtype
        });
        if !fits {
            return Err(bad);
        }
        self.pages.splice(..0, pages);
        self.offloaded = first;
        Ok(())
    }

    /// Positions stored (the next append goes to position `len`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity of every page, in positions.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Storage dtype of the rows.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// KV heads per row.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The pages held here in position order (from position `offloaded`).
    pub fn pages(&self) -> &[KvPage] {
        &self.pages
    }

    /// Appends rows at positions `[len, len + n_rows)`, opening new pages as needed.
    /// `k`, `v`: `[n_rows, n_kv_heads, head_dim]` f32 (converted to the cache dtype).
    ///
    /// Panics if a slice has the wrong length.
    pub fn append(&mut self, k: &[f32], v: &[f32], n_rows: usize) {
        let row = self.n_kv_heads * self.head_dim;
        assert_eq!(
            k.len(),
            n_rows * row,
            "PagedKvCache::append: `k` must have shape [{n_rows}, {}, {}]",
            self.n_kv_heads,
            self.head_dim
        );
        assert_eq!(
            v.len(),
            n_rows * row,
            "PagedKvCache::append: `v` must have shape [{n_rows}, {}, {}]",
            self.n_kv_heads,
            self.head_dim
        );
        let mut done = 0;
        while done < n_rows {
            if self.pages.last().is_none_or(KvPage::is_full) {
                self.pages.push(KvPage::new(
                    self.len,
                    self.page_size,
                    self.n_kv_heads,
                    self.head_dim,
                    self.dtype,
                ));
            }
            let page = self.pages.last_mut().expect("a page was just ensured");
            let take = (page.capacity() - page.len()).min(n_rows - done);
            let (a, b) = (done * row, (done + take) * row);
            page.append(&k[a..b], &v[a..b], take);
            done += take;
            self.len += take;
        }
    }

    /// Reads positions `[p0, p1)` across pages as f32: `(k, v)`, each `[p1 - p0, n_kv_heads, head_dim]`.
    ///
    /// Panics unless `offloaded <= p0 <= p1 <= len` (see [`PagedKvCache::try_read_rows`]).
    pub fn read_rows(&self, p0: usize, p1: usize) -> (Vec<f32>, Vec<f32>) {
        assert!(
            self.offloaded <= p0 && p0 <= p1 && p1 <= self.len,
            "PagedKvCache::read_rows: positions [{p0}, {p1}) out of range ({}..{} held here)",
            self.offloaded,
            self.len
        );
        let row = self.n_kv_heads * self.head_dim;
        let mut k = vec![0.0f32; (p1 - p0) * row];
        let mut v = vec![0.0f32; (p1 - p0) * row];
        for page in &self.pages {
            let (s, e) = (page.start(), page.start() + page.len());
            let (a, b) = (p0.max(s), p1.min(e));
            if a >= b {
                continue;
            }
            let (o0, o1) = ((a - p0) * row, (b - p0) * row);
            page.read_rows(a - s, b - s, &mut k[o0..o1], &mut v[o0..o1]);
        }
        (k, v)
    }

    /// As [`PagedKvCache::read_rows`]. Errors: [`KvError::Offloaded`] when `p0` is below the positions held here
    /// (the range must be in `offloaded..len`; past `len` still panics, a caller bug).
    pub fn try_read_rows(&self, p0: usize, p1: usize) -> Result<(Vec<f32>, Vec<f32>), KvError> {
        if p0 < self.offloaded {
            return Err(KvError::Offloaded {
                offloaded: self.offloaded,
                from: p0,
            });
        }
        Ok(self.read_rows(p0, p1))
    }

    /// Drops positions `>= len` (and the pages left empty); no effect if `len >= self.len()`. Errors:
    /// [`KvError::Offloaded`] when `len` is below the positions held here (the pages elsewhere must be cut
    /// there); nothing changes then.
    pub fn try_truncate(&mut self, len: usize) -> Result<(), KvError> {
        if len < self.offloaded {
            return Err(KvError::Offloaded {
                offloaded: self.offloaded,
                from: len,
            });
        }
        self.truncate(len);
        Ok(())
    }

    /// Goes back to position `len` inside the positions held elsewhere: a page boundary at or below
    /// [`PagedKvCache::offloaded`], whose holder keeps `[0, len)` and drops the rest. The pages held here are
    /// dropped; `offloaded` and the length become `len`. Errors: [`KvError::BadRestore`] for a position that is not
    /// a page boundary or is past `offloaded`; nothing changes then.
    pub fn truncate_offloaded(&mut self, len: usize) -> Result<(), KvError> {
        if len > self.offloaded || !len.is_multiple_of(self.page_size) {
            return Err(KvError::BadRestore {
                offloaded: self.offloaded,
            });
        }
        self.pages.clear();
        self.offloaded = len;
        self.len = len;
        Ok(())
    }

    /// Forgets every position, those held elsewhere included (their holder must drop them too).
    pub fn clear(&mut self) {
        self.pages.clear();
        self.len = 0;
        self.offloaded = 0;
    }

    /// Drops positions `>= len` (and the pages left empty); no effect if `len >= self.len()`.
    ///
    /// Panics if `len < offloaded` (see [`PagedKvCache::try_truncate`]).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        assert!(
            len >= self.offloaded,
            "PagedKvCache::truncate: positions below {} are held elsewhere",
            self.offloaded
        );
        self.pages.retain(|p| p.start() < len);
        if let Some(last) = self.pages.last_mut() {
            let keep = len - last.start();
            last.truncate(keep);
        }
        self.len = len;
    }

    /// Bytes held here by the stored K and V rows (`2 * (len - offloaded) * n_kv_heads * head_dim *
    /// dtype.size_of()`).
    pub fn bytes(&self) -> usize {
        self.pages.iter().map(KvPage::bytes).sum()
    }

    /// Causal attention of `q` (`[n_tokens, n_heads, head_dim]` f32 at absolute positions
    /// `q_pos0..q_pos0 + n_tokens`) over all pages: per-page partials of
    /// [`attend_page`](crate::attention::attend_page) merged left to right in page order
    /// ([`attend_pages`] with no initial partial). `scale` multiplies the scores (`head_dim^-0.5` for
    /// Qwen3.5).
    ///
    /// Panics on the shape errors of [`attend_pages`].
    pub fn attend(
        &self,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Partial {
        assert_eq!(
            self.offloaded, 0,
            "PagedKvCache::attend: pages are held elsewhere; continue their fold with attend_after"
        );
        if self.pages.is_empty() {
            assert_eq!(
                q.len(),
                n_tokens * n_heads * self.head_dim,
                "PagedKvCache::attend: `q` must have shape [{n_tokens}, {n_heads}, {}]",
                self.head_dim
            );
            return Partial::empty(n_tokens, n_heads, self.head_dim);
        }
        attend_pages(q, n_tokens, n_heads, q_pos0, &self.pages, scale, None)
    }

    /// Continues the fold from `prefix`, the partial of the same queries over the pages held elsewhere (positions
    /// `[0, offloaded)`, folded in page order, e.g. by a worker), over the pages held here: the same bits as
    /// [`PagedKvCache::attend`] over a cache holding every page.
    ///
    /// Panics on the shape errors of [`attend_pages`].
    pub fn attend_after(
        &self,
        prefix: Partial,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Partial {
        self.attend_after_ahead(prefix, &[], q, n_tokens, n_heads, q_pos0, scale)
    }

    /// The partials of the first pages held here, computed ahead (while the fold over the pages held elsewhere is
    /// still under way, e.g. on a worker), as many as fit `max_bytes` of partials (at least one page). Pass them
    /// to [`PagedKvCache::attend_after_ahead`]; `None` for a page no query sees.
    pub fn partials_ahead(
        &self,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
        max_bytes: usize,
    ) -> Vec<Option<Partial>> {
        let per = n_tokens
            .saturating_mul(n_heads)
            .saturating_mul(self.head_dim + 1)
            .saturating_mul(4)
            .max(1);
        let n = (max_bytes / per).max(1).min(self.pages.len());
        self.pages[..n]
            .iter()
            .map(|p| page_partial(q, n_tokens, n_heads, q_pos0, p.view(), scale))
            .collect()
    }

    /// [`PagedKvCache::attend_after`] with the first pages' partials already computed (`ahead`, from
    /// [`PagedKvCache::partials_ahead`] on the same queries): folds `prefix`, then `ahead` in order, then the
    /// remaining pages — the same merges in the same order, so the same bits.
    ///
    /// Panics if `ahead` is longer than the pages held, or on the shape errors of [`attend_pages`].
    #[allow(clippy::too_many_arguments)]
    pub fn attend_after_ahead(
        &self,
        prefix: Partial,
        ahead: &[Option<Partial>],
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Partial {
        assert!(ahead.len() <= self.pages.len(), "more partials than pages");
        let mut acc = prefix;
        fold_partials(&mut acc, ahead.iter().flatten());
        attend_pages(
            q,
            n_tokens,
            n_heads,
            q_pos0,
            &self.pages[ahead.len()..],
            scale,
            Some(acc),
        )
    }
}
