//! KV offload on the device (the device layer's `Backend::kv_*` page ops): the oldest whole pages of a layer's cache
//! copied to the host in the wire's page layout ([`KvPage`]) for a worker, then left out of attention (their rows
//! stay allocated; `CudaKv::offloaded` marks them), and the worker's partial over them folded with the device's own.

use backburner_kernels::attention::{fold_partials, Partial};
use backburner_kernels::kv::{KvDtype, KvPage};
use backburner_model::device::{Buf, DeviceError, DeviceKv, DeviceResult};

use super::attn::{kv_of, CudaKv};
use super::CudaBackend;

/// Full pages held here that may move: every full page before the newest (which may still be written).
pub(super) fn movable(kv: &DeviceKv) -> usize {
    let c = kv_of(kv);
    (kv.len - c.offloaded)
        .div_ceil(c.page_size)
        .saturating_sub(1)
}

impl CudaBackend {
    /// Rows `r0..r1` of the cache as f32 K and V (`[rows, n_kv, head_dim]` each): the stored values widened exactly.
    fn kv_rows_f32(&self, c: &CudaKv, r0: usize, r1: usize) -> DeviceResult<(Vec<f32>, Vec<f32>)> {
        let n = (r1 - r0) * c.n_kv * c.head_dim;
        let off = (r0 * c.row_bytes()) as u64;
        let (Some(k), Some(v)) = (&c.k, &c.v) else {
            return Ok((Vec::new(), Vec::new()));
        };
        let mut out = (vec![0.0f32; n], vec![0.0f32; n]);
        for (src, dst) in [(k.ptr, &mut out.0), (v.ptr, &mut out.1)] {
            match c.dtype {
                KvDtype::F32 => self.dtoh(src + off, dst)?,
                KvDtype::F16 | KvDtype::Bf16 => {
                    let mut raw = vec![0u16; n];
                    self.dtoh(src + off, &mut raw)?;
                    for (d, r) in dst.iter_mut().zip(raw) {
                        *d = match c.dtype {
                            KvDtype::F16 => half::f16::from_bits(r).to_f32(),
                            _ => half::bf16::from_bits(r).to_f32(),
                        };
                    }
                }
            }
        }
        Ok(out)
    }

    pub(super) fn kv_copy_oldest_op(&self, kv: &DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        if n > movable(kv) {
            let why = format!("moving {n} KV pages: {} may move", movable(kv));
            return Err(DeviceError::Unsupported(self.id, why));
        }
        self.bind()?;
        let c = kv_of(kv);
        let ps = c.page_size;
        (0..n)
            .map(|p| {
                let start = c.offloaded + p * ps;
                let (k, v) = self.kv_rows_f32(c, start, start + ps)?;
                let mut page = KvPage::new(start, ps, c.n_kv, c.head_dim, c.dtype);
                page.append(&k, &v, ps);
                Ok(page)
            })
            .collect()
    }

    pub(super) fn kv_take_oldest_op(
        &self,
        kv: &mut DeviceKv,
        n: usize,
    ) -> DeviceResult<Vec<KvPage>> {
        let pages = self.kv_copy_oldest_op(kv, n)?;
        let c: &mut CudaKv = kv.inner.downcast_mut().expect("a CUDA KV cache");
        c.offloaded += n * c.page_size;
        Ok(pages)
    }

    pub(super) fn kv_truncate_op(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        let off = kv_of(kv).offloaded;
        if len < off {
            let why = format!("truncating to {len}: positions below {off} are held elsewhere");
            return Err(DeviceError::Unsupported(self.id, why));
        }
        // the rows are contiguous: those past `len` are overwritten by later appends
        kv.len = kv.len.min(len);
        Ok(())
    }

    pub(super) fn kv_truncate_offloaded_op(
        &self,
        kv: &mut DeviceKv,
        len: usize,
    ) -> DeviceResult<()> {
        let c: &mut CudaKv = kv.inner.downcast_mut().expect("a CUDA KV cache");
        if len > c.offloaded || !len.is_multiple_of(c.page_size) {
            let why = format!(
                "going back to {len} inside the {} positions held elsewhere (pages of {})",
                c.offloaded, c.page_size
            );
            return Err(DeviceError::Unsupported(self.id, why));
        }
        c.offloaded = len;
        kv.len = len;
        Ok(())
    }

    /// The partial over the pages here (from the first position not held elsewhere), folded after `prefix` on the
    /// host (the merge of `backburner_kernels::attention`, as a CPU cache continues its fold).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_after_op(
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
        self.attend_op(kv, q, n_tokens, n_heads, pos0, scale, o, lse)?;
        let d = kv_of(kv).head_dim;
        let mut own = Partial::empty(n_tokens, n_heads, d);
        backburner_model::device::Backend::download(self, o, &mut own.o)?;
        backburner_model::device::Backend::download(self, lse, &mut own.lse)?;
        let mut acc = prefix;
        fold_partials(&mut acc, [&own]);
        *o = backburner_model::device::Backend::upload(self, &acc.o)?;
        *lse = backburner_model::device::Backend::upload(self, &acc.lse)?;
        Ok(())
    }
}
