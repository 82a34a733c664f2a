//! [`PageView`]: a page as the attention kernel reads it, borrowed from any storage, in a [`PageLayout`].

use half::{bf16, f16};

use super::page::{KvPage, Rows};
use super::KV_BLOCK;

/// Stored elements of a page in its dtype, borrowed (in the [`PageLayout`] of the [`PageView`] that holds them).
#[derive(Clone, Copy, Debug)]
pub enum RowsRef<'a> {
    /// f16 storage.
    F16(&'a [f16]),
    /// f32 storage.
    F32(&'a [f32]),
    /// bf16 storage (pairs side by side: [`k_pair_offset`](super::k_pair_offset),
    /// [`v_pair_offset`](super::v_pair_offset)).
    Bf16(&'a [bf16]),
}

impl RowsRef<'_> {
    fn len(&self) -> usize {
        match self {
            RowsRef::F16(d) => d.len(),
            RowsRef::F32(d) => d.len(),
            RowsRef::Bf16(d) => d.len(),
        }
    }
}

impl<'a> From<&'a Rows> for RowsRef<'a> {
    fn from(r: &'a Rows) -> Self {
        match r {
            Rows::F16(d) => RowsRef::F16(d),
            Rows::F32(d) => RowsRef::F32(d),
            Rows::Bf16(d) => RowsRef::Bf16(d),
        }
    }
}

/// How the blocks of a page are ordered in its storage, and the elements inside a block of [`KV_BLOCK`] positions
/// of one KV head; the attention kernel reads every layout with the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageLayout {
    /// Block-major, as a [`KvPage`] grows: K `[block, head, {K block}]` in the K storage and V `[block, head,
    /// {V block}]` in the V storage. The layout of pages on the wire. Inside a block, K is `[4, head_dim, 16]`
    /// (lane groups of 16 keys, transposed: [`k_offset`](super::k_offset)) and V `[⌈head_dim / 16⌉, 64, 16]`
    /// (chunks of 16 dimensions: [`v_offset`](super::v_offset)); bf16 pages pair them
    /// ([`k_pair_offset`](super::k_pair_offset), [`v_pair_offset`](super::v_pair_offset)).
    BlockMajor,
    /// Head-major with K and V interleaved, as a [`PackedPage`](super::PackedPage) holds a frozen page: `[head,
    /// block, {K block, V block}]`, so one KV head's keys and values are one contiguous run over
    /// the page (the queries of one GQA group stream it once, front to back). The K and V storages are one buffer
    /// (or two copies of it) of `2 · ceil(len / 64) · n_kv_heads · head_dim · 64` elements: K is read from the
    /// first, V from the second, each at its own offsets. Inside a block, K and V are in the kernel's tile order
    /// ([`k_tile_offset`](super::k_tile_offset), [`v_tile_offset`](super::v_tile_offset) and their pair forms), so
    /// that the stream is read in address order.
    HeadMajor,
}

/// A page as the attention kernel reads it, borrowed from wherever it lives (a local [`KvPage`], a page received
/// from a host, a packed copy): absolute positions `[start, start + len)`, `n_kv_heads` × `head_dim` K and V rows
/// in the blocks of a [`PageLayout`] (block-major for [`PageView::new`] and [`KvPage`]), whole blocks of
/// [`KV_BLOCK`] positions stored.
#[derive(Clone, Copy, Debug)]
pub struct PageView<'a> {
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) n_kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) layout: PageLayout,
    pub(super) k: RowsRef<'a>,
    pub(super) v: RowsRef<'a>,
}

/// A [`PageView`] whose storage does not fit its shape.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("page view of {len} positions × {n_kv_heads} heads × {head_dim} dims needs {need} elements of K and of V in one dtype (an even head_dim for bf16), got {k} and {v}")]
pub struct PageViewError {
    /// Positions.
    pub len: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Elements needed in each of K and V (whole blocks; twice as many for [`PageLayout::HeadMajor`]), or
    /// `usize::MAX` on overflow.
    pub need: usize,
    /// K elements given.
    pub k: usize,
    /// V elements given.
    pub v: usize,
}

impl<'a> PageView<'a> {
    /// A view of block-layout storage ([`PageLayout::BlockMajor`]). Errors: [`PageViewError`] if `k` or `v` holds
    /// fewer than `ceil(len / 64) · n_kv_heads · head_dim · 64` elements, their dtypes differ, a dimension is
    /// zero, or bf16 storage has an odd `head_dim`.
    pub fn new(
        start: usize,
        len: usize,
        n_kv_heads: usize,
        head_dim: usize,
        k: RowsRef<'a>,
        v: RowsRef<'a>,
    ) -> Result<Self, PageViewError> {
        Self::with_layout(
            start,
            len,
            n_kv_heads,
            head_dim,
            PageLayout::BlockMajor,
            k,
            v,
        )
    }

    /// A view of storage in `layout`. Errors: [`PageViewError`] as [`PageView::new`], where
    /// [`PageLayout::HeadMajor`] needs twice as many elements in `k` and in `v` (each holds K and V).
    pub fn with_layout(
        start: usize,
        len: usize,
        n_kv_heads: usize,
        head_dim: usize,
        layout: PageLayout,
        k: RowsRef<'a>,
        v: RowsRef<'a>,
    ) -> Result<Self, PageViewError> {
        let need = len
            .div_ceil(KV_BLOCK)
            .checked_mul(n_kv_heads)
            .and_then(|x| x.checked_mul(head_dim))
            .and_then(|x| x.checked_mul(KV_BLOCK))
            .and_then(|x| match layout {
                PageLayout::BlockMajor => Some(x),
                PageLayout::HeadMajor => x.checked_mul(2),
            })
            .unwrap_or(usize::MAX);
        let same = matches!(
            (k, v),
            (RowsRef::F16(_), RowsRef::F16(_))
                | (RowsRef::F32(_), RowsRef::F32(_))
                | (RowsRef::Bf16(_), RowsRef::Bf16(_))
        );
        let odd_pairs = matches!(k, RowsRef::Bf16(_)) && !head_dim.is_multiple_of(2);
        if !same
            || odd_pairs
            || n_kv_heads == 0
            || head_dim == 0
            || k.len() < need
            || v.len() < need
        {
            return Err(PageViewError {
                len,
                n_kv_heads,
                head_dim,
                need,
                k: k.len(),
                v: v.len(),
            });
        }
        Ok(PageView {
            start,
            len,
            n_kv_heads,
            head_dim,
            layout,
            k,
            v,
        })
    }

    /// Absolute position of the first row.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Rows (positions) in the page.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the page holds no row.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The order of the blocks in [`PageView::k`] and [`PageView::v`].
    pub fn layout(&self) -> PageLayout {
        self.layout
    }

    /// K storage (whole blocks, in [`PageView::layout`]).
    pub fn k(&self) -> RowsRef<'a> {
        self.k
    }

    /// V storage (whole blocks, in [`PageView::layout`]).
    pub fn v(&self) -> RowsRef<'a> {
        self.v
    }

    /// Block `b` of KV head `h` (for the attention kernel): the storage and the offsets of its K and its V runs
    /// (`head_dim · 64` elements each, in the block order of the page's [`PageLayout`]); positions at or past `len`
    /// hold no key.
    pub(crate) fn block(&self, b: usize, h: usize) -> (RowsRef<'a>, usize, RowsRef<'a>, usize) {
        let run = self.head_dim * KV_BLOCK;
        let (k_at, v_at) = match self.layout {
            PageLayout::BlockMajor => {
                let at = (b * self.n_kv_heads + h) * run;
                (at, at)
            }
            PageLayout::HeadMajor => {
                let at = (h * self.len.div_ceil(KV_BLOCK) + b) * 2 * run;
                (at, at + run)
            }
        };
        (self.k, k_at, self.v, v_at)
    }

    /// Where a decode reading block `b` of KV head `h` prefetches (offsets into the K and V storages, as
    /// [`PageView::block`]'s): the block it reads next. A head-major page is read in address order (a head's blocks,
    /// then the next head's, as the attention tasks run), so that is the next K and V runs, past the head's or the
    /// page's end too (a prefetch address, never dereferenced). A block-major page interleaves the heads: this head's
    /// next block while `more` blocks of the segment follow, else block `b` itself (a hint for lines already on
    /// their way, so the loads need no branch).
    pub(crate) fn read_next(&self, b: usize, h: usize, more: bool) -> (usize, usize) {
        let (_, k_at, _, v_at) = self.block(b, h);
        let run = self.head_dim * KV_BLOCK;
        match self.layout {
            PageLayout::HeadMajor => (k_at + 2 * run, v_at + 2 * run),
            PageLayout::BlockMajor if more => {
                let (_, k2, _, v2) = self.block(b + 1, h);
                (k2, v2)
            }
            PageLayout::BlockMajor => (k_at, v_at),
        }
    }
}

impl<'a> From<&'a KvPage> for PageView<'a> {
    fn from(p: &'a KvPage) -> Self {
        p.view()
    }
}
