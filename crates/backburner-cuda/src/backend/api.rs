//! [`Backend`] for [`CudaBackend`]: each op's implementation is in the module of its kind.

use backburner_kernels::attention::Partial;
use backburner_kernels::gdn::GdnDims;
use backburner_kernels::kv::{KvDtype, KvPage};
use backburner_model::device::{
    top_k_row, Backend, Buf, DecodeStep, DeviceInfo, DeviceKv, DeviceMatrix, DeviceResult,
};
use backburner_model::linear::Linear;
use backburner_model::ops::Rope;

use super::mem::{ptr, DevBuf};
use super::CudaBackend;

impl Backend for CudaBackend {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn upload(&self, host: &[f32]) -> DeviceResult<Buf> {
        let mut b = self.zeros(0)?;
        self.bind()?;
        let p = self.ensure(&mut b, host.len())?;
        self.htod(p, host)?;
        Ok(b)
    }

    fn upload_into(&self, host: &[f32], dst: &mut Buf) -> DeviceResult<()> {
        self.bind()?;
        let p = self.ensure(dst, host.len())?;
        self.htod(p, host)
    }

    fn download(&self, b: &Buf, out: &mut [f32]) -> DeviceResult<()> {
        assert_eq!(out.len(), b.len(), "download: lengths differ");
        self.bind()?;
        self.dtoh(ptr(b), out)
    }

    fn zeros(&self, len: usize) -> DeviceResult<Buf> {
        let mut b = Buf::new(0, Box::new(DevBuf::default()));
        if len > 0 {
            self.bind()?;
            let p = self.ensure(&mut b, len)?;
            // SAFETY: `p` holds `len` f32 (just allocated).
            unsafe {
                cudarc::driver::result::memset_d8_async(p, 0, 4 * len, self.stream.cu_stream())
            }
            .map_err(|e| super::mem::driver_err(self.id, "zeroing a buffer", e))?;
        }
        Ok(b)
    }

    fn copy(&self, src: &Buf, dst: &mut Buf) -> DeviceResult<()> {
        self.bind()?;
        let d = self.ensure(dst, src.len())?;
        self.dtod(d, ptr(src), 4 * src.len())
    }

    fn upload_matrix(&self, w: &Linear) -> DeviceResult<DeviceMatrix> {
        self.upload_matrix_op(w)
    }

    fn matmul(&self, x: &Buf, n_rows: usize, w: &DeviceMatrix, y: &mut Buf) -> DeviceResult<()> {
        self.matmul_op(x, n_rows, w, y)
    }

    fn matmul_swiglu(
        &self,
        x: &Buf,
        n_rows: usize,
        w: &DeviceMatrix,
        gu: &mut Buf,
        act: &mut Buf,
    ) -> DeviceResult<()> {
        self.matmul_swiglu_op(x, n_rows, w, gu, act)
    }

    fn rms_norm(&self, x: &Buf, g: &Buf, eps: f32, out: &mut Buf) -> DeviceResult<()> {
        self.rms_norm_to(x, g, eps, Some(out))
    }

    fn rms_norm_inplace(&self, x: &mut Buf, g: &Buf, eps: f32) -> DeviceResult<()> {
        self.rms_norm_to(x, g, eps, None)
    }

    fn gated_rms_norm(&self, o: &mut Buf, z: &Buf, w: &Buf, eps: f32) -> DeviceResult<()> {
        self.gated_rms_norm_op(o, z, w, eps)
    }

    fn l2_norm_scaled(&self, x: &mut Buf, dim: usize, scale: f32) -> DeviceResult<()> {
        self.l2_norm_op(x, dim, scale)
    }

    fn sigmoid_mul(&self, o: &mut Buf, gate: &Buf) -> DeviceResult<()> {
        self.elementwise("sigmoid_mul", o, gate)
    }

    fn add_assign(&self, x: &mut Buf, y: &Buf) -> DeviceResult<()> {
        self.elementwise("add_assign", x, y)
    }

    fn take_cols(
        &self,
        src: &Buf,
        width: usize,
        col0: usize,
        n_cols: usize,
        dst: &mut Buf,
    ) -> DeviceResult<()> {
        self.take_cols_op(src, width, col0, n_cols, dst)
    }

    fn rope(
        &self,
        rope: &Rope,
        x: &mut Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
    ) -> DeviceResult<()> {
        self.rope_op(rope, x, n_tokens, n_heads, pos0)
    }

    fn gdn_gates(
        &self,
        proj: &Buf,
        width: usize,
        col0: usize,
        neg_a: &Buf,
        dt_bias: &Buf,
        beta: &mut Buf,
        g: &mut Buf,
    ) -> DeviceResult<()> {
        self.gdn_gates_op(proj, width, col0, neg_a, dt_bias, beta, g)
    }

    fn causal_conv(
        &self,
        x: &Buf,
        n_tokens: usize,
        conv_dim: usize,
        kernel: usize,
        weight: &Buf,
        state: &mut Buf,
        out: &mut Buf,
    ) -> DeviceResult<()> {
        self.causal_conv_op(x, n_tokens, conv_dim, kernel, weight, state, out)
    }

    fn delta_rule_chunked(
        &self,
        d: GdnDims,
        _chunk: usize,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        g: &Buf,
        beta: &Buf,
        state: &mut Buf,
        o: &mut Buf,
    ) -> DeviceResult<()> {
        self.delta_rule_op(d, q, k, v, g, beta, state, o)
    }

    fn delta_rule_decode(&self, step: DecodeStep<'_>, o: &mut Buf) -> DeviceResult<()> {
        self.decode_op(step, o)
    }

    fn kv_new(
        &self,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> DeviceResult<DeviceKv> {
        self.kv_new_op(page_size, n_kv_heads, head_dim, dtype)
    }

    fn kv_append(&self, kv: &mut DeviceKv, k: &Buf, v: &Buf, n_rows: usize) -> DeviceResult<()> {
        self.kv_append_op(kv, k, v, n_rows)
    }

    fn kv_truncate(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        self.kv_truncate_op(kv, len)
    }

    fn kv_clone(&self, kv: &DeviceKv) -> DeviceResult<DeviceKv> {
        self.kv_clone_op(kv)
    }

    fn kv_offloaded(&self, kv: &DeviceKv) -> usize {
        super::attn::kv_of(kv).offloaded
    }

    fn kv_movable_pages(&self, kv: &DeviceKv) -> usize {
        super::offload::movable(kv)
    }

    fn kv_copy_oldest(&self, kv: &DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        self.kv_copy_oldest_op(kv, n)
    }

    fn kv_take_oldest(&self, kv: &mut DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        self.kv_take_oldest_op(kv, n)
    }

    fn kv_truncate_offloaded(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        self.kv_truncate_offloaded_op(kv, len)
    }

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
        self.attend_after_op(kv, prefix, q, n_tokens, n_heads, pos0, scale, o, lse)
    }

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
    ) -> DeviceResult<()> {
        self.attend_op(kv, q, n_tokens, n_heads, pos0, scale, o, lse)
    }

    fn embed(&self, w: &DeviceMatrix, ids: &[u32], out: &mut Buf) -> DeviceResult<()> {
        self.embed_op(w, ids, out)
    }

    /// Copies the logits to the host and selects there ([`top_k_row`]).
    fn top_k(&self, logits: &Buf, n_rows: usize, k: usize) -> DeviceResult<Vec<Vec<(u32, f32)>>> {
        assert!(
            n_rows > 0 && logits.len().is_multiple_of(n_rows),
            "top_k: logits are not [n_rows, vocab]"
        );
        let mut host = vec![0.0f32; logits.len()];
        self.download(logits, &mut host)?;
        Ok(host
            .chunks_exact(logits.len() / n_rows)
            .map(|row| top_k_row(row, k))
            .collect())
    }
}
