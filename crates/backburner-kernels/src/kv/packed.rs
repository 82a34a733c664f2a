//! A frozen page re-laid head-major ([`PageLayout::HeadMajor`]): each KV head's keys and values interleaved block by
//! block in one contiguous run, so the queries of one GQA group stream their head's part of the page once, front to
//! back, instead of alternating between two tensors and skipping the other heads' blocks; inside each block, K and V
//! are in the kernel's tile order ([`tiles`](super::tiles)), so that stream is read in address order.

use super::page::Rows;
use super::tiles::{push_k_tiles, push_v_tiles};
use super::view::{PageLayout, PageView, RowsRef};
use super::{KvDtype, KV_BLOCK};

/// An owned copy of a page in the head-major layout, `[head, block, {K block, V block}]` (each block in the tile
/// order of [`k_tile_offset`](super::k_tile_offset) and [`v_tile_offset`](super::v_tile_offset), or their pair forms
/// for bf16) in the page's dtype, whole blocks of [`KV_BLOCK`] positions. Built once (off the request path) from a page that will not
/// change again, a full page; the attention kernel reads its [`PackedPage::view`] with the same bits as the original
/// page's view, faster when the page streams from memory (see `benches/old_pages.rs`).
///
/// The view is for attention only: pages travel and are stored block-major ([`KvPage`](super::KvPage)).
#[derive(Clone, Debug)]
pub struct PackedPage {
    start: usize,
    len: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// `[n_kv_heads, blocks, 2, head_dim · KV_BLOCK]`: per head and block, K then V.
    kv: Rows,
}

impl PackedPage {
    /// Copies the whole blocks of `page` (any layout) into the head-major layout. Every stored element is copied,
    /// lanes past `len` in the last block included, so the copy holds exactly the page's bits. Allocates
    /// `2 · ceil(len / 64) · n_kv_heads · head_dim · 64` elements of the page's dtype.
    pub fn pack(page: PageView<'_>) -> Self {
        let kv = match (page.k(), page.v()) {
            (RowsRef::F16(k), RowsRef::F16(v)) => Rows::F16(head_major(&page, k, v, false)),
            (RowsRef::F32(k), RowsRef::F32(v)) => Rows::F32(head_major(&page, k, v, false)),
            (RowsRef::Bf16(k), RowsRef::Bf16(v)) => Rows::Bf16(head_major(&page, k, v, true)),
            _ => unreachable!("a PageView's K and V share one dtype"),
        };
        PackedPage {
            start: page.start(),
            len: page.len(),
            n_kv_heads: page.n_kv_heads(),
            head_dim: page.head_dim(),
            kv,
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
        match self.kv {
            Rows::F16(_) => KvDtype::F16,
            Rows::F32(_) => KvDtype::F32,
            Rows::Bf16(_) => KvDtype::Bf16,
        }
    }

    /// Bytes held by the rows, as [`KvPage::bytes`](super::KvPage::bytes): `2 · len · n_kv_heads · head_dim ·
    /// dtype.size_of()` (the allocation rounds up to a block).
    pub fn bytes(&self) -> usize {
        2 * self.len * self.n_kv_heads * self.head_dim * self.dtype().size_of()
    }

    /// The page as the attention kernel reads it ([`PageLayout::HeadMajor`]; K and V are the same storage).
    pub fn view(&self) -> PageView<'_> {
        let kv = RowsRef::from(&self.kv);
        PageView::with_layout(
            self.start,
            self.len,
            self.n_kv_heads,
            self.head_dim,
            PageLayout::HeadMajor,
            kv,
            kv,
        )
        .expect("a packed page's storage fits its shape")
    }
}

impl<'a> From<&'a PackedPage> for PageView<'a> {
    fn from(p: &'a PackedPage) -> Self {
        p.view()
    }
}

/// The whole blocks of `page` (K storage `k`, V storage `v`) copied head by head, block by block, K then V, each
/// block in tile order ([`tiles`](super::tiles); a head-major page's blocks are in it already).
fn head_major<T: Copy>(page: &PageView<'_>, k: &[T], v: &[T], pairs: bool) -> Vec<T> {
    let dim = page.head_dim();
    let run = dim * KV_BLOCK;
    let blocks = page.len().div_ceil(KV_BLOCK);
    let mut kv = Vec::with_capacity(2 * blocks * page.n_kv_heads() * run);
    let tiled = page.layout() == PageLayout::HeadMajor;
    for h in 0..page.n_kv_heads() {
        for b in 0..blocks {
            let (_, k_at, _, v_at) = page.block(b, h);
            let (kb, vb) = (&k[k_at..k_at + run], &v[v_at..v_at + run]);
            if tiled {
                kv.extend_from_slice(kb);
                kv.extend_from_slice(vb);
            } else {
                push_k_tiles(kb, dim, pairs, &mut kv);
                push_v_tiles(vb, dim, pairs, &mut kv);
            }
        }
    }
    kv
}
