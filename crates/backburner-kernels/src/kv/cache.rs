//! The paged KV cache of one full-attention layer.

use super::{KvDtype, KvPage};
use crate::attention::{attend_pages, Partial};

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
            pages: Vec::new(),
        }
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

    /// The pages in position order.
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
    /// Panics unless `p0 <= p1 <= len`.
    pub fn read_rows(&self, p0: usize, p1: usize) -> (Vec<f32>, Vec<f32>) {
        assert!(
            p0 <= p1 && p1 <= self.len,
            "PagedKvCache::read_rows: positions [{p0}, {p1}) out of range (len {})",
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

    /// Drops positions `>= len` (and the pages left empty); no effect if `len >= self.len()`.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.pages.retain(|p| p.start() < len);
        if let Some(last) = self.pages.last_mut() {
            let keep = len - last.start();
            last.truncate(keep);
        }
        self.len = len;
    }

    /// Bytes held by the stored K and V rows over all pages
    /// (`2 * len * n_kv_heads * head_dim * dtype.size_of()`).
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
}
