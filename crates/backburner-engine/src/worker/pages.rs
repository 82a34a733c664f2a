//! The worker's store of a session's offloaded KV pages (KV offload, docs/KV_OFFLOAD.md): per full-attention layer a
//! contiguous run of the oldest whole pages, kept as received (block layout, the host's KV dtype, so placement never
//! changes a number), bounded by the worker's memory budget, and attended in place through `PageView`s.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use backburner_kernels::attention::{fold_pages, page_partial, Partial};
use backburner_kernels::kv::{KvDtype, PageView, RowsRef, KV_BLOCK};
use backburner_link::ErrorCode;

use super::budget::{MemoryBudget, Reservation};
use super::core::Fault;
use super::packer::{current, Packer, PageData, Slot};

/// The shape every page of a session has (agreed in the handshake).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageShape {
    /// Positions per page.
    pub page_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Storage dtype.
    pub dtype: KvDtype,
}

impl PageShape {
    /// Elements of K (and of V) of one page in the block layout: whole blocks of 64 positions, or `None` on
    /// overflow.
    pub fn elems(&self) -> Option<usize> {
        self.page_size
            .div_ceil(KV_BLOCK)
            .checked_mul(self.n_kv_heads)?
            .checked_mul(self.head_dim)?
            .checked_mul(KV_BLOCK)
    }

    /// Bytes of one page on the wire and in the store (K then V), or `None` on overflow.
    pub fn page_bytes(&self) -> Option<usize> {
        self.elems()?
            .checked_mul(2)?
            .checked_mul(self.dtype.size_of())
    }
}

/// One full page: as received, later packed.
#[derive(Debug)]
struct StoredPage {
    start: usize,
    data: Slot,
}

fn malformed(m: impl Into<String>) -> Fault {
    Fault {
        code: ErrorCode::Malformed,
        message: m.into(),
    }
}

fn bad_state(m: impl Into<String>) -> Fault {
    Fault {
        code: ErrorCode::BadState,
        message: m.into(),
    }
}

/// A layer's run: whole pages in position order from `start`.
#[derive(Debug, Default)]
struct Run {
    start: usize,
    pages: Vec<StoredPage>,
}

/// A session's offloaded pages: per full-attention layer one contiguous run of whole pages (the oldest run for the
/// first worker, a later run for the next ones).
#[derive(Debug)]
pub struct SessionPages {
    shape: PageShape,
    layers: BTreeMap<usize, Run>,
    held: Reservation,
    packer: Option<Packer>,
    /// Bytes reserved beside the pages while any is held, so that an `Attend` can always be answered.
    headroom: u64,
}

impl SessionPages {
    /// An empty store of pages of `shape`, holding its bytes against `budget`. Errors: a [`Fault`] (`Malformed`)
    /// when a page of that shape does not fit in memory arithmetic, or is bf16 with an odd `head_dim` (bf16 pages
    /// keep pairs of dimensions side by side).
    pub fn new(shape: PageShape, budget: &Arc<MemoryBudget>) -> Result<Self, Fault> {
        shape
            .page_bytes()
            .filter(|b| *b > 0)
            .ok_or_else(|| malformed(format!("pages of {shape:?} overflow a size")))?;
        if shape.dtype.pairs() && !shape.head_dim.is_multiple_of(2) {
            return Err(malformed(format!(
                "{} pages need an even head_dim, not {}",
                shape.dtype, shape.head_dim
            )));
        }
        Ok(SessionPages {
            shape,
            layers: BTreeMap::new(),
            held: budget
                .reserve(0, "offloaded KV pages")
                .map_err(Fault::from)?,
            packer: None,
            headroom: 0,
        })
    }

    /// Keeps `bytes` reserved beside the pages while the store holds any (the buffers of answering one `Attend`),
    /// so that a worker full of pages can still attend over them: a put that would leave less is refused.
    pub fn with_headroom(mut self, bytes: u64) -> Self {
        self.headroom = bytes;
        self
    }

    /// Bytes a put reserves beside its pages: the headroom while the store holds no page yet, else 0.
    pub fn put_headroom(&self) -> u64 {
        if self.pages() == 0 {
            self.headroom
        } else {
            0
        }
    }

    /// The standing reservation for answering an `Attend` (0 while no page is held).
    pub fn headroom(&self) -> u64 {
        if self.pages() > 0 {
            self.headroom
        } else {
            0
        }
    }

    /// Packs every page stored from now on in a background thread (see [`super::packer`]); attention reads the
    /// packed copy once it is there, with the same bits.
    pub fn pack_in_background(mut self) -> Self {
        self.packer = Packer::start(self.shape);
        self
    }

    /// Pages held in the packed layout now.
    pub fn packed_pages(&self) -> usize {
        self.layers
            .values()
            .flat_map(|r| &r.pages)
            .filter(|p| current(&p.data).is_packed())
            .count()
    }

    /// The page shape.
    pub fn shape(&self) -> PageShape {
        self.shape
    }

    /// Positions `[start, end)` of `layer` held here (`(0, 0)` when none).
    pub fn span(&self, layer: usize) -> (usize, usize) {
        self.layers.get(&layer).map_or((0, 0), |r| {
            (r.start, r.start + r.pages.len() * self.shape.page_size)
        })
    }

    /// One past the last position of `layer` held here (0 when none).
    pub fn positions(&self, layer: usize) -> usize {
        self.span(layer).1
    }

    /// Pages held over all layers.
    pub fn pages(&self) -> usize {
        self.layers.values().map(|r| r.pages.len()).sum()
    }

    /// Pages of `layer` held here.
    pub fn layer_pages(&self, layer: usize) -> usize {
        self.layers.get(&layer).map_or(0, |r| r.pages.len())
    }

    /// Bytes held (reserved against the budget): the pages and, while any is held, the headroom.
    pub fn bytes(&self) -> u64 {
        self.held.bytes()
    }

    /// Appends `n_pages` whole pages to `layer`'s run, starting at position `first_pos`: `bytes` holds each page's K
    /// then V storage in the block layout and the session's dtype, little-endian (see [`SessionPages::put_layers`]).
    ///
    /// Errors: as [`SessionPages::put_layers`].
    pub fn put(
        &mut self,
        layer: usize,
        first_pos: u64,
        n_pages: usize,
        bytes: &[u8],
    ) -> Result<(), Fault> {
        self.put_layers(&[layer], first_pos, n_pages, bytes)
    }

    /// Appends `n_pages` whole pages to the run of each of `layers` (in that order in `bytes`), starting at position
    /// `first_pos`: the end of each layer's run, or any page boundary for a layer holding none. The bytes are
    /// reserved before anything is allocated, and either every layer takes its pages or none does.
    ///
    /// Errors ([`Fault`]): `BadState` when `first_pos` is not the end of a run (or off a page boundary);
    /// `Malformed` when the byte count is not `layers.len() · n_pages` pages or `n_pages` is 0; `OutOfMemory` over
    /// the budget. Nothing changes on error.
    pub fn put_layers(
        &mut self,
        layers: &[usize],
        first_pos: u64,
        n_pages: usize,
        bytes: &[u8],
    ) -> Result<(), Fault> {
        let ps = self.shape.page_size;
        let first = usize::try_from(first_pos).map_err(|_| malformed("first_pos"))?;
        for &layer in layers {
            let (start, end) = self.span(layer);
            let fits = if start == end {
                first.is_multiple_of(ps)
            } else {
                first == end
            };
            if !fits {
                return Err(bad_state(format!(
                    "pages for layer {layer} must start at {end} (the end of its run), not {first_pos}"
                )));
            }
        }
        let per = self.shape.page_bytes().expect("checked in new");
        let want = per
            .checked_mul(n_pages)
            .and_then(|b| b.checked_mul(layers.len()));
        let last = n_pages.checked_mul(ps).and_then(|b| b.checked_add(first));
        if want != Some(bytes.len()) || n_pages == 0 || last.is_none() {
            return Err(malformed(format!(
                "{} bytes are not {n_pages} pages of {per} bytes for each of {} layers",
                bytes.len(),
                layers.len()
            )));
        }
        let grow = u64::try_from(bytes.len()).map_err(|_| malformed("size"))?;
        let headroom = self.put_headroom();
        self.held.resize(
            self.held
                .bytes()
                .saturating_add(grow)
                .saturating_add(headroom),
        )?;
        for (&layer, chunk) in layers.iter().zip(bytes.chunks_exact(per * n_pages)) {
            let run = self.layers.entry(layer).or_default();
            if run.pages.is_empty() {
                run.start = first;
            }
            for (i, page) in chunk.chunks_exact(per).enumerate() {
                let (k, v) = page.split_at(per / 2);
                let data: Slot = Arc::new(Mutex::new(Arc::new(PageData::decode(
                    self.shape.dtype,
                    k,
                    v,
                ))));
                let start = first + i * ps;
                if let Some(p) = &self.packer {
                    p.submit(&data, start);
                }
                run.pages.push(StoredPage { start, data });
            }
        }
        Ok(())
    }

    /// Drops every page at or past position `positions` (a page boundary) in every layer; the bytes go back to the
    /// budget. Errors: `BadState` when `positions` is not a multiple of the page size.
    pub fn truncate(&mut self, positions: u64) -> Result<(), Fault> {
        let ps = self.shape.page_size as u64;
        if !positions.is_multiple_of(ps) {
            return Err(bad_state(format!(
                "truncation to {positions} is not on a {ps}-position page boundary"
            )));
        }
        let per = self.shape.page_bytes().expect("checked in new") as u64;
        let mut freed = 0u64;
        for run in self.layers.values_mut() {
            let before = run.pages.len();
            run.pages.retain(|p| (p.start as u64) < positions);
            freed += (before - run.pages.len()) as u64 * per;
        }
        let had = self.headroom();
        self.layers.retain(|_, r| !r.pages.is_empty());
        let released = freed + (had - self.headroom());
        let _ = self.held.resize(self.held.bytes() - released);
        Ok(())
    }

    fn check_q(&self, q: &[f32], n_tokens: usize, n_heads: usize) -> Result<(), Fault> {
        let s = &self.shape;
        let want = n_tokens
            .checked_mul(n_heads)
            .and_then(|x| x.checked_mul(s.head_dim));
        if want != Some(q.len()) || n_heads == 0 || !n_heads.is_multiple_of(s.n_kv_heads) {
            return Err(malformed(format!(
                "q of {} values is not [{n_tokens}, {n_heads}, {}] with heads a multiple of {}",
                q.len(),
                s.head_dim,
                s.n_kv_heads
            )));
        }
        Ok(())
    }

    /// Each page of `layer`'s run as it is now (block-major or packed), with its start.
    fn snapshot(&self, layer: usize) -> Vec<(usize, Arc<PageData>)> {
        let run = self.layers.get(&layer).map_or(&[][..], |r| &r.pages[..]);
        run.iter().map(|p| (p.start, current(&p.data))).collect()
    }

    /// The attention partial of `q` (`[n_tokens, n_heads, head_dim]` f32 at positions `q_pos0..`) over `layer`'s
    /// pages, folded in page order from empty: the first steps of the host's own fold, bit for bit.
    ///
    /// Errors: `Malformed` when `q`'s length is not `n_tokens · n_heads · head_dim` or `n_heads` is not a positive
    /// multiple of the KV heads.
    pub fn attend(
        &self,
        layer: usize,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Result<Partial, Fault> {
        self.check_q(q, n_tokens, n_heads)?;
        let pages = self.snapshot(layer);
        Ok(fold_pages(
            q,
            n_tokens,
            n_heads,
            q_pos0,
            pages.iter().map(|(start, d)| d.view(*start, &self.shape)),
            scale,
            Some(self.shape.head_dim),
            None,
        ))
    }

    /// One attention partial of `q` per page of `layer`'s run that some query sees, in page order (for a run that is
    /// not the oldest: the host folds them after the older runs' partials, skipping none). Errors: as [`SessionPages::attend`].
    pub fn attend_each(
        &self,
        layer: usize,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Result<Vec<Partial>, Fault> {
        self.check_q(q, n_tokens, n_heads)?;
        Ok(self
            .snapshot(layer)
            .iter()
            .filter_map(|(start, d)| {
                page_partial(
                    q,
                    n_tokens,
                    n_heads,
                    q_pos0,
                    d.view(*start, &self.shape),
                    scale,
                )
            })
            .collect())
    }
}

/// A page's storage as bytes for [`SessionPages::put`] (K then V, little-endian), from a view of a full page.
pub fn page_bytes(v: PageView<'_>, shape: &PageShape) -> Vec<u8> {
    let n = shape.elems().unwrap_or(0);
    let mut out = Vec::with_capacity(shape.page_bytes().unwrap_or(0));
    for r in [v.k(), v.v()] {
        match r {
            RowsRef::F16(d) => d[..n]
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            RowsRef::F32(d) => d[..n]
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            RowsRef::Bf16(d) => d[..n]
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        }
    }
    out
}
