//! The attention layer's KV cache and attention partials (kernels/attention.cu).
//!
//! The cache holds K and V rows `[positions, n_kv_heads, head_dim]` contiguously, in the requested dtype, with a
//! capacity of whole pages that doubles when an append needs more (a device copy of the rows so far). `f16` and
//! `f32` give the CPU cache's stored values; `bf16` stores bf16 values (rounded to nearest even, as the CPU) but
//! attends in f32, where the CPU also rounds the queries and softmax weights to bf16.

use backburner_kernels::kv::KvDtype;
use backburner_model::device::{Buf, DeviceError, DeviceKv, DeviceResult};

use super::mem::{blocks_for, int, ptr, Arg, DevMem};
use super::CudaBackend;

/// The head dims the attention kernel holds (attention.cu's MAX_HEAD_DIM).
const MAX_HEAD_DIM: usize = 512;
/// Threads per attention block (4 warps).
const ATT_THREADS: u32 = 128;
/// The most tokens one launch covers (the grid's y limit).
const MAX_GRID_Y: usize = 65_535;

/// A KV cache on the device.
pub(super) struct CudaKv {
    pub(super) page_size: usize,
    pub(super) n_kv: usize,
    pub(super) head_dim: usize,
    pub(super) dtype: KvDtype,
    /// Positions the allocations hold.
    cap: usize,
    pub(super) k: Option<DevMem>,
    pub(super) v: Option<DevMem>,
    /// Positions `[0, offloaded)` held elsewhere (KV offload): their rows stay allocated but are not attended.
    pub(super) offloaded: usize,
}

impl CudaKv {
    fn suffix(&self) -> &'static str {
        match self.dtype {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Bytes of one position (all heads).
    pub(super) fn row_bytes(&self) -> usize {
        self.n_kv * self.head_dim * self.dtype.size_of()
    }
}

pub(super) fn kv_of(kv: &DeviceKv) -> &CudaKv {
    kv.inner.downcast_ref().expect("a CUDA KV cache")
}

impl CudaBackend {
    pub(super) fn kv_new_op(
        &self,
        page_size: usize,
        n_kv: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> DeviceResult<DeviceKv> {
        assert!(
            page_size > 0 && n_kv > 0 && head_dim > 0,
            "kv_new: empty shape"
        );
        if head_dim > MAX_HEAD_DIM {
            return Err(DeviceError::Unsupported(
                self.id,
                format!("attention with head_dim {head_dim} (at most {MAX_HEAD_DIM})"),
            ));
        }
        let c = CudaKv {
            page_size,
            n_kv,
            head_dim,
            dtype,
            cap: 0,
            k: None,
            v: None,
            offloaded: 0,
        };
        Ok(DeviceKv {
            len: 0,
            inner: Box::new(c),
        })
    }

    /// Grows `c` to hold `need` positions (whole pages, at least double), keeping the first `len`.
    fn kv_grow(&self, c: &mut CudaKv, len: usize, need: usize) -> DeviceResult<()> {
        if need <= c.cap {
            return Ok(());
        }
        let cap = need.max(2 * c.cap).div_ceil(c.page_size) * c.page_size;
        let bytes = cap * c.row_bytes();
        let (k, v) = (
            self.alloc(bytes, "KV pages")?,
            self.alloc(bytes, "KV pages")?,
        );
        if let (Some(ok), Some(ov)) = (&c.k, &c.v) {
            self.dtod(k.ptr, ok.ptr, len * c.row_bytes())?;
            self.dtod(v.ptr, ov.ptr, len * c.row_bytes())?;
        }
        c.k = Some(k);
        c.v = Some(v);
        c.cap = cap;
        Ok(())
    }

    /// A new cache with `src`'s positions copied (device to device) and its offloaded count.
    pub(super) fn kv_clone_op(&self, src: &DeviceKv) -> DeviceResult<DeviceKv> {
        let s = kv_of(src);
        let mut out = self.kv_new_op(s.page_size, s.n_kv, s.head_dim, s.dtype)?;
        self.bind()?;
        let c: &mut CudaKv = out.inner.downcast_mut().expect("a CUDA KV cache");
        if src.len > 0 {
            self.kv_grow(c, 0, src.len)?;
            let bytes = src.len * s.row_bytes();
            let (dk, dv) = (
                c.k.as_ref().map_or(0, |m| m.ptr),
                c.v.as_ref().map_or(0, |m| m.ptr),
            );
            let (sk, sv) = (
                s.k.as_ref().map_or(0, |m| m.ptr),
                s.v.as_ref().map_or(0, |m| m.ptr),
            );
            self.dtod(dk, sk, bytes)?;
            self.dtod(dv, sv, bytes)?;
        }
        c.offloaded = s.offloaded;
        out.len = src.len;
        Ok(out)
    }

    pub(super) fn kv_append_op(
        &self,
        kv: &mut DeviceKv,
        k: &Buf,
        v: &Buf,
        n_rows: usize,
    ) -> DeviceResult<()> {
        self.bind()?;
        let len = kv.len;
        let c: &mut CudaKv = kv.inner.downcast_mut().expect("a CUDA KV cache");
        let row = c.n_kv * c.head_dim;
        assert!(
            k.len() == n_rows * row && v.len() == n_rows * row,
            "kv_append: k, v are not [n, n_kv, head_dim]"
        );
        if n_rows == 0 {
            return Ok(());
        }
        self.kv_grow(c, len, len + n_rows)?;
        let (kc, vc) = (
            c.k.as_ref().map_or(0, |m| m.ptr),
            c.v.as_ref().map_or(0, |m| m.ptr),
        );
        let n = n_rows * row;
        let name = format!("kv_store_{}", c.suffix());
        let args = [
            Arg::P(ptr(k)),
            Arg::P(ptr(v)),
            Arg::P(kc),
            Arg::P(vc),
            Arg::N((len * row) as u64),
            Arg::N(n as u64),
        ];
        self.run(&name, (blocks_for(n), 1), 256, &args)?;
        kv.len = len + n_rows;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_op(
        &self,
        kv: &DeviceKv,
        q: &Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
        scale: f32,
        o: &mut Buf,
        lse: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        let c = kv_of(kv);
        let d = c.head_dim;
        assert!(
            n_heads > 0 && n_heads.is_multiple_of(c.n_kv),
            "attend: n_heads ({n_heads}) is not a multiple of n_kv ({})",
            c.n_kv
        );
        assert_eq!(
            q.len(),
            n_tokens * n_heads * d,
            "attend: q is not [T, H, D]"
        );
        let (op, lp) = (
            self.ensure(o, n_tokens * n_heads * d)?,
            self.ensure(lse, n_tokens * n_heads)?,
        );
        let (kc, vc) = (
            c.k.as_ref().map_or(0, |m| m.ptr),
            c.v.as_ref().map_or(0, |m| m.ptr),
        );
        let name = format!("attend_{}", c.suffix());
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(MAX_GRID_Y);
            let args = [
                Arg::P(ptr(q) + (4 * t0 * n_heads * d) as u64),
                Arg::P(kc),
                Arg::P(vc),
                Arg::P(op + (4 * t0 * n_heads * d) as u64),
                Arg::P(lp + (4 * t0 * n_heads) as u64),
                int(n_heads),
                int(c.n_kv),
                int(d),
                int(pos0 + t0),
                int(c.offloaded),
                int(kv.len),
                Arg::F(scale),
            ];
            self.run(&name, (n_heads as u32, nt as u32), ATT_THREADS, &args)?;
            t0 += nt;
        }
        Ok(())
    }
}
