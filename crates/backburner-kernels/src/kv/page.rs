//! One KV page: a fixed-capacity run of positions of one full-attention layer.

use half::{f16, slice::HalfFloatSliceExt};

use super::KvDtype;

/// Row storage in the page's dtype, `[len, n_kv_heads, head_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Rows {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Rows {
    fn new(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F16 => Rows::F16(Vec::new()),
            KvDtype::F32 => Rows::F32(Vec::new()),
        }
    }

    fn push(&mut self, src: &[f32]) {
        match self {
            Rows::F16(d) => {
                let n = d.len();
                d.resize(n + src.len(), f16::ZERO);
                d[n..].convert_from_f32_slice(src);
            }
            Rows::F32(d) => d.extend_from_slice(src),
        }
    }

    /// Elements `[a, a + dst.len())` as f32.
    #[inline]
    pub(crate) fn read(&self, a: usize, dst: &mut [f32]) {
        match self {
            Rows::F16(d) => d[a..a + dst.len()].convert_to_f32_slice(dst),
            Rows::F32(d) => dst.copy_from_slice(&d[a..a + dst.len()]),
        }
    }

    fn truncate(&mut self, n: usize) {
        match self {
            Rows::F16(d) => d.truncate(n),
            Rows::F32(d) => d.truncate(n),
        }
    }
}

/// One page of one full-attention layer: positions `[start, start + len)` of capacity `page_size`, K and V
/// rows each `[len, n_kv_heads, head_dim]` stored in `dtype`.
///
/// K rows are post-k_norm, post-RoPE keys, V rows the values (ARCH_SPEC "Gated full-attention layer").
/// Storage grows with `len`; [`KvPage::bytes`] counts the stored rows, not the capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct KvPage {
    start: usize,
    page_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
    len: usize,
    k: Rows,
    v: Rows,
}

impl KvPage {
    /// An empty page for absolute positions starting at `start`, holding at most `page_size` positions of
    /// `[n_kv_heads, head_dim]` K and V rows in `dtype`.
    ///
    /// Panics if `page_size`, `n_kv_heads` or `head_dim` is zero.
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
    /// `[n_rows, n_kv_heads, head_dim]` f32, converted to the page dtype (f16: round to nearest even).
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
        self.k.push(k);
        self.v.push(v);
        self.len += n_rows;
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
        self.k.read(r0 * self.row_len(), k_out);
        self.v.read(r0 * self.row_len(), v_out);
    }

    /// Keeps only the first `len` rows; no effect if `len >= self.len()` (like `Vec::truncate`).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            let n = len * self.row_len();
            self.k.truncate(n);
            self.v.truncate(n);
        }
    }

    /// Bytes held by the stored K and V rows: `2 * len * n_kv_heads * head_dim * dtype.size_of()`.
    pub fn bytes(&self) -> usize {
        2 * self.len * self.row_len() * self.dtype.size_of()
    }

    /// K storage (crate-internal, for the attention kernel).
    pub(crate) fn k_rows(&self) -> &Rows {
        &self.k
    }

    /// V storage (crate-internal, for the attention kernel).
    pub(crate) fn v_rows(&self) -> &Rows {
        &self.v
    }
}
