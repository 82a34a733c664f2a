//! The compute backend seam: a [`Backend`] owns buffers on its device and runs the dozen operations a decoder layer
//! is made of. The model's layer pass over any backend is `device/layer.rs`; the CPU backend is `device/cpu.rs`,
//! other backends live in their own crates (`backburner-cuda`).
//!
//! All activations are f32 in row-major order; every shape below is in elements. A buffer's length is set by the op
//! that writes it (growing it on the device when needed), so a caller keeps its buffers between calls and allocates
//! nothing once they have reached the ubatch's size.

use std::any::Any;

use backburner_kernels::attention::Partial;
use backburner_kernels::gdn::GdnDims;
use backburner_kernels::kv::{KvDtype, KvPage};

use super::id::{DeviceError, DeviceInfo};
use crate::linear::Linear;
use crate::ops::Rope;

/// The result of a device operation.
pub type DeviceResult<T> = std::result::Result<T, DeviceError>;

/// An f32 buffer on a device: `len` elements, held as the backend likes (a `Vec<f32>` on the CPU, a device
/// allocation elsewhere). Made and written only by the backend that owns it; handing a buffer to another backend is a
/// caller bug that panics.
pub struct Buf {
    len: usize,
    inner: Box<dyn Any + Send + Sync>,
}

impl Buf {
    /// Wraps a backend's storage of `len` f32 elements.
    pub fn new(len: usize, inner: Box<dyn Any + Send + Sync>) -> Self {
        Buf { len, inner }
    }

    /// Elements (f32).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the length (the backend does, after growing its storage).
    pub fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// The backend's storage. Panics if it is not a `T` (a buffer of another backend: caller bug).
    pub fn get<T: 'static>(&self) -> &T {
        self.inner
            .downcast_ref()
            .expect("a buffer of another backend")
    }

    /// The backend's storage, mutable. Panics if it is not a `T`.
    pub fn get_mut<T: 'static>(&mut self) -> &mut T {
        self.inner
            .downcast_mut()
            .expect("a buffer of another backend")
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf[{}]", self.len)
    }
}

/// A weight matrix `W: [n, k]` (a [`Linear`]: `y = x·Wᵀ`) held on a device in the layout its backend multiplies
/// with, and an attention layer's paged KV cache on a device. Both opaque, like [`Buf`].
pub struct DeviceMatrix {
    /// Output features (rows of W).
    pub n: usize,
    /// Input features (columns of W).
    pub k: usize,
    /// Bytes it takes on the device.
    pub bytes: u64,
    /// The backend's storage.
    pub inner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMatrix[{}, {}] ({} B)", self.n, self.k, self.bytes)
    }
}

/// A paged KV cache of one attention layer on a device: K rows (after k_norm and RoPE) and V rows of every position
/// so far, `[positions, n_kv_heads, head_dim]` each, in the backend's page layout.
pub struct DeviceKv {
    /// Positions held.
    pub len: usize,
    /// The backend's storage.
    pub inner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceKv[{} positions]", self.len)
    }
}

/// A compute backend: one device's buffers and the operations of a decoder layer on them.
///
/// Exactness: the CPU backend computes every op with the kernels of the CPU path and gives its bits; another backend
/// agrees with the f64 reference within a tolerance (stated in `docs/DEVICES.md`), not bit for bit. Each op panics on
/// a shape mismatch (a caller bug) and returns [`DeviceError`] for what the device can fail at (memory, the driver).
pub trait Backend: Send + Sync {
    /// What the device is.
    fn info(&self) -> DeviceInfo;

    /// A new buffer holding `host` (`[len]` f32).
    fn upload(&self, host: &[f32]) -> DeviceResult<Buf>;
    /// Copies `host` (`[len]` f32) into `dst`, set to `len`, reusing its memory where it holds enough (the
    /// residual stream crosses into the device each pass: no allocation per pass). Default: a new buffer.
    fn upload_into(&self, host: &[f32], dst: &mut Buf) -> DeviceResult<()> {
        *dst = self.upload(host)?;
        Ok(())
    }
    /// Copies `b` into `out` (`out.len() == b.len()`).
    fn download(&self, b: &Buf, out: &mut [f32]) -> DeviceResult<()>;
    /// A new buffer of `len` zeros.
    fn zeros(&self, len: usize) -> DeviceResult<Buf>;
    /// Copies `src` into `dst` (set to `src`'s length).
    fn copy(&self, src: &Buf, dst: &mut Buf) -> DeviceResult<()>;
    /// The weights of `w` on the device, in the backend's layout for its format.
    ///
    /// Errors: [`DeviceError::Unsupported`] for a format the backend cannot multiply with; out of memory.
    fn upload_matrix(&self, w: &Linear) -> DeviceResult<DeviceMatrix>;

    /// `y = x·Wᵀ`: x `[n_rows, k]`, y `[n_rows, n]`.
    fn matmul(&self, x: &Buf, n_rows: usize, w: &DeviceMatrix, y: &mut Buf) -> DeviceResult<()>;
    /// The SwiGLU MLP's input from a fused `[gate; up]` matrix (`n = 2·inter`): `gu = x·Wᵀ` `[n_rows, 2·inter]` and
    /// `act = silu(gate)·up` `[n_rows, inter]`.
    fn matmul_swiglu(
        &self,
        x: &Buf,
        n_rows: usize,
        w: &DeviceMatrix,
        gu: &mut Buf,
        act: &mut Buf,
    ) -> DeviceResult<()>;

    /// `out = x·rsqrt(mean(x²) + eps)·g` per row of `g.len()` elements (HF `Qwen3_5RMSNorm`, the gain `g = 1 + w`
    /// as the model holds it); `out` gets `x`'s length.
    fn rms_norm(&self, x: &Buf, g: &Buf, eps: f32, out: &mut Buf) -> DeviceResult<()>;
    /// [`Backend::rms_norm`] in place.
    fn rms_norm_inplace(&self, x: &mut Buf, g: &Buf, eps: f32) -> DeviceResult<()>;
    /// The Gated DeltaNet's output norm: `o = w·(o·rsqrt(mean(o²) + eps))·silu(z)` per row of `w.len()` (plain
    /// weight).
    fn gated_rms_norm(&self, o: &mut Buf, z: &Buf, w: &Buf, eps: f32) -> DeviceResult<()>;
    /// `x = x·rsqrt(Σx² + 1e-6)·scale` per row of `dim` (HF `l2norm`).
    fn l2_norm_scaled(&self, x: &mut Buf, dim: usize, scale: f32) -> DeviceResult<()>;
    /// `o = o · σ(gate)` element-wise (the attention output gate).
    fn sigmoid_mul(&self, o: &mut Buf, gate: &Buf) -> DeviceResult<()>;
    /// `x = x + y` element-wise (the residual add).
    fn add_assign(&self, x: &mut Buf, y: &Buf) -> DeviceResult<()>;
    /// Columns `col0..col0 + n_cols` of `src` (`[rows, width]`) into `dst` (`[rows, n_cols]`).
    fn take_cols(
        &self,
        src: &Buf,
        width: usize,
        col0: usize,
        n_cols: usize,
        dst: &mut Buf,
    ) -> DeviceResult<()>;
    /// Rows `rows` of `src` (`[.., width]`) written over rows `dst_row0..` of `dst` (`[.., width]`, holding them;
    /// its length unchanged). The default copies through the host (for checkpoints, not a hot path); a backend
    /// overrides it with a device copy.
    fn copy_rows(
        &self,
        src: &Buf,
        width: usize,
        rows: std::ops::Range<usize>,
        dst: &mut Buf,
        dst_row0: usize,
    ) -> DeviceResult<()> {
        let n = rows.len() * width;
        let (s0, d0) = (rows.start * width, dst_row0 * width);
        assert!(
            s0 + n <= src.len() && d0 + n <= dst.len(),
            "copy_rows: rows outside the buffers"
        );
        let mut a = vec![0.0f32; src.len()];
        self.download(src, &mut a)?;
        let mut b = vec![0.0f32; dst.len()];
        self.download(dst, &mut b)?;
        b[d0..d0 + n].copy_from_slice(&a[s0..s0 + n]);
        *dst = self.upload(&b)?;
        Ok(())
    }
    /// Partial NeoX RoPE in place on x `[n_tokens, n_heads, head_dim]`, token t at position `pos0 + t`.
    fn rope(
        &self,
        rope: &Rope,
        x: &mut Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
    ) -> DeviceResult<()>;

    /// The Gated DeltaNet's gates from the `[b | a]` columns `col0..col0 + 2·Hv` of `proj` (`[t, width]`):
    /// `beta = σ(b)`, `g = neg_a · softplus(a + dt_bias)` (`[t, Hv]` each; `neg_a`, `dt_bias` `[Hv]`).
    #[allow(clippy::too_many_arguments)]
    fn gdn_gates(
        &self,
        proj: &Buf,
        width: usize,
        col0: usize,
        neg_a: &Buf,
        dt_bias: &Buf,
        beta: &mut Buf,
        g: &mut Buf,
    ) -> DeviceResult<()>;
    /// The causal depthwise conv with SiLU over x `[n_tokens, conv_dim]` (weight `[conv_dim, kernel]`), advancing
    /// `state` (`[conv_dim, kernel − 1]`); `out` `[n_tokens, conv_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv(
        &self,
        x: &Buf,
        n_tokens: usize,
        conv_dim: usize,
        kernel: usize,
        weight: &Buf,
        state: &mut Buf,
        out: &mut Buf,
    ) -> DeviceResult<()>;
    /// The chunked delta rule over `d.n_tokens` tokens (chunks of `chunk`): q, k `[t, Hk·Dk]` (normed), v
    /// `[t, Hv·Dv]`, g, beta `[t, Hv]`; advances `state` `[Hv, Dk, Dv]`; `o` `[t, Hv·Dv]`.
    #[allow(clippy::too_many_arguments)]
    fn delta_rule_chunked(
        &self,
        d: GdnDims,
        chunk: usize,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        g: &Buf,
        beta: &Buf,
        state: &mut Buf,
        o: &mut Buf,
    ) -> DeviceResult<()>;
    /// One token of the Gated DeltaNet core from its raw `qkv` `[conv_dim]` and `z` `[Hv·Dv]` (the columns of
    /// `proj` `[1, width]` at 0 and `conv_dim`): conv, q/k norms, the recurrent step and the gated norm in one, the
    /// same result as the separate ops. Advances `conv_state` and `state`; `o` `[Hv·Dv]`.
    fn delta_rule_decode(&self, step: DecodeStep<'_>, o: &mut Buf) -> DeviceResult<()>;

    /// An empty paged KV cache for `n_kv_heads` heads of `head_dim`, pages of `page_size` positions in `dtype`.
    fn kv_new(
        &self,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> DeviceResult<DeviceKv>;
    /// Appends k, v `[n_rows, n_kv_heads, head_dim]` at the cache's end.
    fn kv_append(&self, kv: &mut DeviceKv, k: &Buf, v: &Buf, n_rows: usize) -> DeviceResult<()>;
    /// Causal attention of q `[n_tokens, n_heads, head_dim]` (token t at position `pos0 + t`, GQA over the cache's
    /// heads) over every position of `kv` up to its own: the normalized partial `o` `[n_tokens, n_heads, head_dim]`
    /// and `lse` `[n_tokens, n_heads]` (natural log of the sum of `exp(scale·q·k)`), as
    /// [`backburner_kernels::attention::Partial`] (so partials over pages elsewhere merge with it exactly).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        kv: &DeviceKv,
        q: &Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
        scale: f32,
        o: &mut Buf,
        lse: &mut Buf,
    ) -> DeviceResult<()>;

    /// Drops the positions `>= len` of `kv` (no effect if it holds fewer): going back to a checkpoint.
    ///
    /// Errors: [`DeviceError::Unsupported`] when `len` is below the positions held elsewhere, or for a backend
    /// that cannot truncate (the default).
    fn kv_truncate(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        let _ = (kv, len);
        Err(DeviceError::Unsupported(
            self.info().id,
            "truncating a KV cache".into(),
        ))
    }
    /// A new cache holding a copy of `kv`'s positions (and its count of positions held elsewhere), on the same device
    /// with the same shape and dtype: a sequence forked from another (`ModelState::copy_from`).
    ///
    /// Errors: out of memory; [`DeviceError::Unsupported`] for a backend that cannot copy a cache (the default).
    fn kv_clone(&self, kv: &DeviceKv) -> DeviceResult<DeviceKv> {
        let _ = kv;
        Err(DeviceError::Unsupported(
            self.info().id,
            "copying a KV cache".into(),
        ))
    }
    /// Positions `[0, n)` of `kv` held elsewhere (KV offload: their pages moved by [`Backend::kv_take_oldest`]).
    /// Default: none (a backend without offload).
    fn kv_offloaded(&self, _kv: &DeviceKv) -> usize {
        0
    }
    /// Full pages of `kv` that may move elsewhere (every full page before the newest). Default: none.
    fn kv_movable_pages(&self, _kv: &DeviceKv) -> usize {
        0
    }
    /// Moves the `n` oldest pages of `kv` to the host, in position order, in the wire's page layout
    /// ([`KvPage`]: what a worker holds); [`Backend::kv_offloaded`] grows by `n` pages. Attention over the layer then
    /// needs the partial over those pages: [`Backend::attend_after`].
    ///
    /// Errors: [`DeviceError::Unsupported`] if fewer than `n` pages may move or the backend has no offload (the
    /// default).
    fn kv_take_oldest(&self, kv: &mut DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        let _ = (kv, n);
        Err(DeviceError::Unsupported(
            self.info().id,
            "moving KV pages off the device".into(),
        ))
    }
    /// Copies of the `n` oldest pages of `kv` (nothing moves): what a worker is sent before the pages leave with
    /// [`Backend::kv_take_oldest`] once it has stored them.
    ///
    /// Errors: as [`Backend::kv_take_oldest`].
    fn kv_copy_oldest(&self, kv: &DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        let _ = (kv, n);
        Err(DeviceError::Unsupported(
            self.info().id,
            "copying KV pages off the device".into(),
        ))
    }
    /// Goes back to position `len` inside the positions held elsewhere (a page boundary at or below
    /// [`Backend::kv_offloaded`]): the pages held here are dropped, the holder keeps `[0, len)`.
    ///
    /// Errors: [`DeviceError::Unsupported`] for another position, or a backend without offload (the default).
    fn kv_truncate_offloaded(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        let _ = (kv, len);
        Err(DeviceError::Unsupported(
            self.info().id,
            "going back into KV pages held elsewhere".into(),
        ))
    }
    /// [`Backend::attend`] continued from `prefix`, the partial of the same queries over the positions held
    /// elsewhere (folded in page order, e.g. by a worker): the fold goes on over the pages held here, so that the
    /// result is the attention over every position (on the CPU backend, the bits of a cache holding every page).
    ///
    /// Errors: as [`Backend::attend`]; [`DeviceError::Unsupported`] for a backend without offload (the default).
    #[allow(clippy::too_many_arguments)]
    fn attend_after(
        &self,
        kv: &DeviceKv,
        prefix: Partial,
        q: &Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
        scale: f32,
        o: &mut Buf,
        lse: &mut Buf,
    ) -> DeviceResult<()> {
        let _ = (kv, prefix, q, n_tokens, n_heads, pos0, scale, o, lse);
        Err(DeviceError::Unsupported(
            self.info().id,
            "attention over KV pages held elsewhere".into(),
        ))
    }

    /// Rows `ids` of the table `w` (`[vocab, hidden]`) into `out` `[ids.len(), hidden]` (the embedding lookup).
    /// Panics if an id is `>= w.n`.
    fn embed(&self, w: &DeviceMatrix, ids: &[u32], out: &mut Buf) -> DeviceResult<()>;
    /// The `k` largest entries of each row of `logits` (`[n_rows, vocab]`), as `(id, logit)` from the largest down
    /// (equal logits: the lower id first); sampling's candidates without copying the whole row to the host.
    fn top_k(&self, logits: &Buf, n_rows: usize, k: usize) -> DeviceResult<Vec<Vec<(u32, f32)>>>;
}

/// The inputs of [`Backend::delta_rule_decode`].
pub struct DecodeStep<'a> {
    /// Dimensions (`n_tokens` 1).
    pub dims: GdnDims,
    /// The conv's kernel length.
    pub kernel: usize,
    /// The token's fused input projection `[1, width]` (`[qkv | z | b | a]`).
    pub proj: &'a Buf,
    /// `[Hv]` log-decay and write strength (from [`Backend::gdn_gates`]).
    pub g: &'a Buf,
    /// `[Hv]` write strength.
    pub beta: &'a Buf,
    /// `[conv_dim, kernel]` conv weight.
    pub conv_weight: &'a Buf,
    /// `[Dv]` gated-norm weight.
    pub norm_weight: &'a Buf,
    /// Gated-norm epsilon.
    pub eps: f32,
    /// `[conv_dim, kernel − 1]` conv state, advanced.
    pub conv_state: &'a mut Buf,
    /// `[Hv, Dk, Dv]` recurrent state, advanced.
    pub state: &'a mut Buf,
}
