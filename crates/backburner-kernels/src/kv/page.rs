//! One KV page: a fixed-capacity run of positions of one full-attention layer.

use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::view::{PageLayout, PageView};
use super::{k_offset, k_pair_offset, v_offset, v_pair_offset, KvDtype, KV_BLOCK};

/// Element storage in the page's dtype.
#[derive(Clone, Debug)]
pub(crate) enum Rows {
    F16(Vec<f16>),
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Rows {
    pub(crate) fn new(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F16 => Rows::F16(Vec::new()),
            KvDtype::F32 => Rows::F32(Vec::new()),
            KvDtype::Bf16 => Rows::Bf16(Vec::new()),
        }
    }

    /// Grows or shrinks to `n` elements (new ones zero).
    fn resize(&mut self, n: usize) {
        match self {
            Rows::F16(d) => d.resize(n, f16::ZERO),
            Rows::F32(d) => d.resize(n, 0.0),
            Rows::Bf16(d) => d.resize(n, bf16::ZERO),
        }
    }

    /// Element `i` as f32.
    #[inline]
    fn get(&self, i: usize) -> f32 {
        match self {
            Rows::F16(d) => d[i].to_f32(),
            Rows::F32(d) => d[i],
            Rows::Bf16(d) => d[i].to_f32(),
        }
    }
}

/// Where element `(row, head, d)` of a page lives, for K and for V (see [`KvPage`]).
#[derive(Clone, Copy)]
struct Layout {
    hkv: usize,
    dim: usize,
    /// bf16 pages: [`k_pair_offset`] and [`v_pair_offset`] inside a block.
    pairs: bool,
}

impl Layout {
    /// K: block-major, then head, then the block's [`k_offset`] (or [`k_pair_offset`]) layout.
    #[inline]
    fn k(self, row: usize, h: usize, d: usize) -> usize {
        let (dim, lane) = (self.dim, row % KV_BLOCK);
        let at = if self.pairs {
            k_pair_offset(dim, lane, d)
        } else {
            k_offset(dim, lane, d)
        };
        self.block_base(row, h) + at
    }

    /// V: block-major, then head, then the block's [`v_offset`] (or [`v_pair_offset`]) layout.
    #[inline]
    fn v(self, row: usize, h: usize, d: usize) -> usize {
        let (dim, j) = (self.dim, row % KV_BLOCK);
        let at = if self.pairs {
            v_pair_offset(dim, j, d)
        } else {
            v_offset(dim, j, d)
        };
        self.block_base(row, h) + at
    }

    /// Where head `h`'s part of the block holding `row` starts (the same for K and V).
    #[inline]
    fn block_base(self, row: usize, h: usize) -> usize {
        ((row / KV_BLOCK) * self.hkv + h) * self.dim * KV_BLOCK
    }

    /// Elements of one block of K (or of V) for every head.
    fn block_len(self) -> usize {
        self.hkv * self.dim * KV_BLOCK
    }
}

/// One page of one full-attention layer: positions `[start, start + len)` of capacity `page_size`, K and V
/// rows each `[len, n_kv_heads, head_dim]` (as appended and read) stored in `dtype`.
///
/// K rows are post-k_norm, post-RoPE keys, V rows the values (ARCH_SPEC "Gated full-attention layer"). Storage is
/// laid out for the attention kernel, in blocks of [`KV_BLOCK`] = 64 positions: K as `[block, head, 4, head_dim,
/// 16]` (each block's keys of one head *transposed* in groups of 16, so 16 keys of one dimension are one vector:
/// [`k_offset`](super::k_offset)) and V as `[block, head, ⌈head_dim / 16⌉, 64, 16]` (chunks of 16 dimensions:
/// [`v_offset`](super::v_offset)); bf16 pages keep pairs side by side inside a block
/// ([`k_pair_offset`](super::k_pair_offset), [`v_pair_offset`](super::v_pair_offset)). One head's keys or values of
/// one block are one contiguous run that streams from
/// memory, and each of the kernel's passes over it reads in address order. Storage
/// grows by whole blocks; [`KvPage::bytes`] counts the stored rows (the allocation rounds up to a block).
#[derive(Clone, Debug)]
pub struct KvPage {
    start: usize,
    page_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
    len: usize,
    /// `[blocks, n_kv_heads, head_dim · KV_BLOCK]`, each block as [`k_offset`] places it.
    k: Rows,
    /// `[blocks, n_kv_heads, head_dim · KV_BLOCK]`, each block as [`v_offset`] places it.
    v: Rows,
}

impl PartialEq for KvPage {
    /// Pages are equal when they hold the same positions and rows (allocation size is not compared).
    fn eq(&self, o: &Self) -> bool {
        let meta = (
            self.start,
            self.page_size,
            self.n_kv_heads,
            self.head_dim,
            self.dtype,
            self.len,
        ) == (
            o.start,
            o.page_size,
            o.n_kv_heads,
            o.head_dim,
            o.dtype,
            o.len,
        );
        if !meta {
            return false;
        }
        let n = self.len * self.row_len();
        let (mut k1, mut v1, mut k2, mut v2) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        self.read_rows(0, self.len, &mut k1, &mut v1);
        o.read_rows(0, o.len, &mut k2, &mut v2);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        bits(&k1) == bits(&k2) && bits(&v1) == bits(&v2)
    }
}

impl KvPage {
    /// An empty page for absolute positions starting at `start`, holding at most `page_size` positions of
    /// `[n_kv_heads, head_dim]` K and V rows in `dtype`.
    ///
    /// Panics if `page_size`, `n_kv_heads` or `head_dim` is zero, or `head_dim` is odd with [`KvDtype::Bf16`].
    pub fn new(
        start: usize,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        assert!(page_size > 0, "KvPage::new: page_size must be positive");
        assert!(n_kv_heads > 0, "KvPage::new: n_kv_heads must be positive");
        assert!(head_dim > 0, "KvPage::new: head_dim must be positive");
        assert!(
            !dtype.pairs() || head_dim.is_multiple_of(2),
            "KvPage::new: bf16 pages need an even head_dim (got {head_dim})"
        );
        KvPage {
            start,
            page_size,
            n_kv_heads,
            head_dim,
            dtype,
            len: 0,
            k: Rows::new(dtype),
            v: Rows::new(dtype),
        }
    }

    /// Absolute position of the page's first row.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Rows (positions) stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum rows (`page_size`).
    pub fn capacity(&self) -> usize {
        self.page_size
    }

    /// Whether `len == capacity`.
    pub fn is_full(&self) -> bool {
        self.len == self.page_size
    }

    /// Storage dtype.
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

    /// Values per row of K (or of V): `n_kv_heads * head_dim`.
    fn row_len(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Appends `n_rows` rows at positions `[start + len, start + len + n_rows)`; `k`, `v`:
    /// `[n_rows, n_kv_heads, head_dim]` f32, converted to the page dtype (f16, bf16: round to nearest even).
    ///
    /// Panics if the page would overflow its capacity or a slice has the wrong length.
    pub fn append(&mut self, k: &[f32], v: &[f32], n_rows: usize) {
        let want = n_rows * self.row_len();
        assert_eq!(
            k.len(),
            want,
            "KvPage::append: `k` must have shape [{n_rows}, {}, {}]",
            self.n_kv_heads,
            self.head_dim
        );
        assert_eq!(
            v.len(),
            want,
            "KvPage::append: `v` must have shape [{n_rows}, {}, {}]",
            self.n_kv_heads,
            self.head_dim
        );
        assert!(
            self.len + n_rows <= self.page_size,
            "KvPage::append: {n_rows} rows overflow the page ({} of {} used)",
            self.len,
            self.page_size
        );
        let lay = self.layout();
        let blocks = (self.len + n_rows).div_ceil(KV_BLOCK);
        self.k.resize(blocks * lay.block_len());
        self.v.resize(blocks * lay.block_len());
        let len = self.len;
        match (&mut self.k, &mut self.v) {
            (Rows::F16(kd), Rows::F16(vd)) => {
                let mut kc = vec![f16::ZERO; k.len()];
                kc.convert_from_f32_slice(k);
                let mut vc = vec![f16::ZERO; v.len()];
                vc.convert_from_f32_slice(v);
                scatter(lay, &kc, &vc, kd, vd, n_rows, len);
            }
            (Rows::F32(kd), Rows::F32(vd)) => scatter(lay, k, v, kd, vd, n_rows, len),
            (Rows::Bf16(kd), Rows::Bf16(vd)) => {
                let mut kc = vec![bf16::ZERO; k.len()];
                kc.convert_from_f32_slice(k);
                let mut vc = vec![bf16::ZERO; v.len()];
                vc.convert_from_f32_slice(v);
                scatter(lay, &kc, &vc, kd, vd, n_rows, len);
            }
            _ => unreachable!("K and V share the page dtype"),
        }
        self.len += n_rows;
    }

    fn layout(&self) -> Layout {
        Layout {
            hkv: self.n_kv_heads,
            dim: self.head_dim,
            pairs: self.dtype.pairs(),
        }
    }

    /// Reads page-relative rows `[r0, r1)` as f32 into `k_out`, `v_out`: `[r1 - r0, n_kv_heads, head_dim]`.
    ///
    /// Panics unless `r0 <= r1 <= len` and the output lengths match.
    pub fn read_rows(&self, r0: usize, r1: usize, k_out: &mut [f32], v_out: &mut [f32]) {
        assert!(
            r0 <= r1 && r1 <= self.len,
            "KvPage::read_rows: rows [{r0}, {r1}) out of range (len {})",
            self.len
        );
        let want = (r1 - r0) * self.row_len();
        assert_eq!(k_out.len(), want, "KvPage::read_rows: `k_out` length");
        assert_eq!(v_out.len(), want, "KvPage::read_rows: `v_out` length");
        let (lay, dim) = (self.layout(), self.head_dim);
        let rows = k_out
            .chunks_exact_mut(self.row_len())
            .zip(v_out.chunks_exact_mut(self.row_len()));
        for (i, (kr, vr)) in rows.enumerate() {
            for h in 0..self.n_kv_heads {
                for d in 0..dim {
                    kr[h * dim + d] = self.k.get(lay.k(r0 + i, h, d));
                }
                for (d, o) in vr[h * dim..(h + 1) * dim].iter_mut().enumerate() {
                    *o = self.v.get(lay.v(r0 + i, h, d));
                }
            }
        }
    }

    /// Keeps only the first `len` rows; no effect if `len >= self.len()` (like `Vec::truncate`).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            let n = len.div_ceil(KV_BLOCK) * self.layout().block_len();
            self.k.resize(n);
            self.v.resize(n);
        }
    }

    /// Bytes held by the stored K and V rows: `2 * len * n_kv_heads * head_dim * dtype.size_of()`.
    pub fn bytes(&self) -> usize {
        2 * self.len * self.row_len() * self.dtype.size_of()
    }

    /// The page as the attention kernel reads it.
    pub fn view(&self) -> PageView<'_> {
        PageView {
            start: self.start,
            len: self.len,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            layout: PageLayout::BlockMajor,
            k: (&self.k).into(),
            v: (&self.v).into(),
        }
    }
}

/// Writes `n_rows` rows of `k` and `v` (`[n_rows, hkv, dim]`, already in the storage dtype) as positions
/// `len..len + n_rows` of the block layouts `kd`, `vd`.
fn scatter<T: Copy>(
    lay: Layout,
    k: &[T],
    v: &[T],
    kd: &mut [T],
    vd: &mut [T],
    n_rows: usize,
    len: usize,
) {
    let dim = lay.dim;
    for i in 0..n_rows {
        for h in 0..lay.hkv {
            let src = (i * lay.hkv + h) * dim;
            for d in 0..dim {
                kd[lay.k(len + i, h, d)] = k[src + d];
                vd[lay.v(len + i, h, d)] = v[src + d];
            }
        }
    }
}
