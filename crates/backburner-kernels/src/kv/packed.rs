//! A frozen page re-laid head-major ([`PageLayout::HeadMajor`]): each KV head's keys, and its values, one
//! contiguous run over the page, so the queries of one GQA group stream their head's K and V without jumps.

use super::page::{PageLayout, PageView, Rows, RowsRef};
use super::{KvDtype, KV_BLOCK};

/// An owned copy of a page in the head-major layout: K `[head, block, head_dim, 64]`, V `[head, block, 64,
/// head_dim]`, whole blocks of [`KV_BLOCK`] positions, in the page's dtype. Built once from a page that will not
/// change again (a full page); the attention kernel reads its [`PackedPage::view`] with the same bits as the
/// original page's view.
#[derive(Clone, Debug)]
pub struct PackedPage {
    start: usize,
    len: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k: Rows,
    v: Rows,
}

impl PackedPage {
    /// Copies the whole blocks of `page` (any layout) into the head-major layout. Every stored element is copied,
    /// lanes past `len` in the last block included, so the copy holds exactly the page's bits.
    pub fn pack(page: PageView<'_>) -> Self {
        let (k, v) = match (page.k(), page.v()) {
            (RowsRef::F16(k), RowsRef::F16(v)) => {
                let (k, v) = head_major(&page, k, v);
                (Rows::F16(k), Rows::F16(v))
            }
            (RowsRef::F32(k), RowsRef::F32(v)) => {
                let (k, v) = head_major(&page, k, v);
                (Rows::F32(k), Rows::F32(v))
            }
            _ => unreachable!("a PageView's K and V share one dtype"),
        };
        PackedPage {
            start: page.start(),
            len: page.len(),
            n_kv_heads: page.n_kv_heads(),
            head_dim: page.head_dim(),
            k,
            v,
        }
    }

    /// Absolute position of the first row.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Rows (positions) held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// KV heads per row.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Storage dtype.
    pub fn dtype(&self) -> KvDtype {
        match self.k {
            Rows::F16(_) => KvDtype::F16,
            Rows::F32(_) => KvDtype::F32,
        }
    }

    /// Bytes held by the rows, as [`KvPage::bytes`](super::KvPage::bytes): `2 * len * n_kv_heads * head_dim *
    /// dtype.size_of()` (the allocation rounds up to a block).
    pub fn bytes(&self) -> usize {
        2 * self.len * self.n_kv_heads * self.head_dim * self.dtype().size_of()
    }

    /// The page as the attention kernel reads it ([`PageLayout::HeadMajor`]).
    pub fn view(&self) -> PageView<'_> {
        PageView::with_layout(
            self.start,
            self.len,
            self.n_kv_heads,
            self.head_dim,
            PageLayout::HeadMajor,
            (&self.k).into(),
            (&self.v).into(),
        )
        .expect("a packed page's storage fits its shape")
    }
}

impl<'a> From<&'a PackedPage> for PageView<'a> {
    fn from(p: &'a PackedPage) -> Self {
        p.view()
    }
}

/// The whole blocks of `page` (storage `k`, `v`) copied head by head, block by block: K `[head, block, head_dim,
/// 64]`, V `[head, block, 64, head_dim]`.
fn head_major<T: Copy>(page: &PageView<'_>, k: &[T], v: &[T]) -> (Vec<T>, Vec<T>) {
    let run = page.head_dim() * KV_BLOCK;
    let blocks = page.len().div_ceil(KV_BLOCK);
    let n = blocks * page.n_kv_heads() * run;
    let (mut ko, mut vo) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for h in 0..page.n_kv_heads() {
        for b in 0..blocks {
            let (_, k_at, _, v_at) = page.block(b, h);
            ko.extend_from_slice(&k[k_at..k_at + run]);
            vo.extend_from_slice(&v[v_at..v_at + run]);
        }
    }
    (ko, vo)
}
