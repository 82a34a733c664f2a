//! The CPU backend: every op of [`Backend`] on host `Vec<f32>` buffers with the kernels the CPU path calls, so a
//! layer run through the device layer on it gives the CPU path's bits (`tests/device.rs` checks it).

use backburner_kernels::attention::Partial;
use backburner_kernels::gdn::{self, GdnDims};
use backburner_kernels::kv::{KvDtype, KvPage, PagedKvCache};
use backburner_kernels::rowops;

use super::backend::{Backend, Buf, DecodeStep, DeviceKv, DeviceMatrix, DeviceResult};
use super::id::{DeviceError, DeviceId, DeviceInfo};
use crate::linear::Linear;
use crate::ops::{self, Rope};
use crate::state::PageStore;

/// The host's cores as a [`Backend`].
#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

/// A buffer's storage.
fn v(b: &Buf) -> &Vec<f32> {
    b.get::<Vec<f32>>()
}

/// A buffer's storage, set to `len` elements (zero-filled where it grows).
fn sized(b: &mut Buf, len: usize) -> &mut Vec<f32> {
    b.set_len(len);
    let s = b.get_mut::<Vec<f32>>();
    s.resize(len, 0.0);
    s
}

/// A buffer's storage, mutable, at its length.
fn vm(b: &mut Buf) -> &mut Vec<f32> {
    b.get_mut::<Vec<f32>>()
}

fn host(v: Vec<f32>) -> Buf {
    Buf::new(v.len(), Box::new(v))
}

impl CpuBackend {
    /// A Vec-backed buffer holding `v` (no copy).
    pub fn wrap(v: Vec<f32>) -> Buf {
        host(v)
    }

    /// The host slice of a buffer of this backend.
    pub fn slice(b: &Buf) -> &[f32] {
        v(b)
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> DeviceInfo {
        super::registry::cpu_info()
    }

    fn upload(&self, h: &[f32]) -> DeviceResult<Buf> {
        Ok(host(h.to_vec()))
    }

    fn upload_into(&self, h: &[f32], dst: &mut Buf) -> DeviceResult<()> {
        sized(dst, h.len()).copy_from_slice(h);
        Ok(())
    }

    fn download(&self, b: &Buf, out: &mut [f32]) -> DeviceResult<()> {
        out.copy_from_slice(v(b));
        Ok(())
    }

    fn zeros(&self, len: usize) -> DeviceResult<Buf> {
        Ok(host(vec![0.0; len]))
    }

    fn copy(&self, src: &Buf, dst: &mut Buf) -> DeviceResult<()> {
        sized(dst, src.len()).copy_from_slice(v(src));
        Ok(())
    }

    fn upload_matrix(&self, w: &Linear) -> DeviceResult<DeviceMatrix> {
        Ok(DeviceMatrix {
            n: w.out_features(),
            k: w.in_features(),
            bytes: w.bytes() as u64,
            inner: Box::new(w.clone()),
        })
    }

    fn matmul(&self, x: &Buf, n_rows: usize, w: &DeviceMatrix, y: &mut Buf) -> DeviceResult<()> {
        let lin = w.inner.downcast_ref::<Linear>().expect("a CPU matrix");
        lin.forward_into(v(x), n_rows, vm(y));
        y.set_len(n_rows * w.n);
        Ok(())
    }

    fn matmul_swiglu(
        &self,
        x: &Buf,
        n_rows: usize,
        w: &DeviceMatrix,
        gu: &mut Buf,
        act: &mut Buf,
    ) -> DeviceResult<()> {
        let lin = w.inner.downcast_ref::<Linear>().expect("a CPU matrix");
        lin.forward_swiglu(v(x), n_rows, vm(gu), vm(act));
        gu.set_len(n_rows * w.n);
        act.set_len(n_rows * w.n / 2);
        Ok(())
    }

    fn rms_norm(&self, x: &Buf, g: &Buf, eps: f32, out: &mut Buf) -> DeviceResult<()> {
        rowops::rms_norm(v(x), v(g), eps, sized(out, x.len()));
        Ok(())
    }

    fn rms_norm_inplace(&self, x: &mut Buf, g: &Buf, eps: f32) -> DeviceResult<()> {
        rowops::rms_norm_inplace(vm(x), v(g), eps);
        Ok(())
    }

    fn gated_rms_norm(&self, o: &mut Buf, z: &Buf, w: &Buf, eps: f32) -> DeviceResult<()> {
        rowops::gated_rms_norm(vm(o), v(z), v(w), eps);
        Ok(())
    }

    fn l2_norm_scaled(&self, x: &mut Buf, dim: usize, scale: f32) -> DeviceResult<()> {
        rowops::l2_norm_scaled(vm(x), dim, scale);
        Ok(())
    }

    fn sigmoid_mul(&self, o: &mut Buf, gate: &Buf) -> DeviceResult<()> {
        rowops::sigmoid_mul(vm(o), v(gate));
        Ok(())
    }

    fn add_assign(&self, x: &mut Buf, y: &Buf) -> DeviceResult<()> {
        rowops::add_assign(vm(x), v(y));
        Ok(())
    }

    fn take_cols(
        &self,
        src: &Buf,
        width: usize,
        col0: usize,
        n_cols: usize,
        dst: &mut Buf,
    ) -> DeviceResult<()> {
        assert!(
            col0 + n_cols <= width && src.len().is_multiple_of(width),
            "take_cols: columns outside [rows, {width}]"
        );
        let rows = src.len() / width;
        let out = sized(dst, rows * n_cols);
        for (d, s) in out.chunks_exact_mut(n_cols).zip(v(src).chunks_exact(width)) {
            d.copy_from_slice(&s[col0..col0 + n_cols]);
        }
        Ok(())
    }

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
        vm(dst)[d0..d0 + n].copy_from_slice(&v(src)[s0..s0 + n]);
        Ok(())
    }

    fn rope(
        &self,
        rope: &Rope,
        x: &mut Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
    ) -> DeviceResult<()> {
        rope.apply(vm(x), n_tokens, n_heads, pos0);
        Ok(())
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
        let hv = neg_a.len();
        let t = proj.len() / width;
        let (na, dt) = (v(neg_a), v(dt_bias));
        let beta = sized(beta, t * hv);
        let g = sized(g, t * hv);
        for (row, (bt, gt)) in v(proj)
            .chunks_exact(width)
            .zip(beta.chunks_exact_mut(hv).zip(g.chunks_exact_mut(hv)))
        {
            let ba = &row[col0..col0 + 2 * hv];
            for j in 0..hv {
                bt[j] = ops::sigmoid(ba[j]);
                gt[j] = na[j] * ops::softplus(ba[hv + j] + dt[j]);
            }
        }
        Ok(())
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
        let o = sized(out, n_tokens * conv_dim);
        gdn::causal_conv1d_silu(v(x), n_tokens, conv_dim, kernel, v(weight), vm(state), o);
        Ok(())
    }

    fn delta_rule_chunked(
        &self,
        d: GdnDims,
        chunk: usize,
        q: &Buf,
        k: &Buf,
        v_: &Buf,
        g: &Buf,
        beta: &Buf,
        state: &mut Buf,
        o: &mut Buf,
    ) -> DeviceResult<()> {
        let out = sized(o, d.n_tokens * d.n_v_heads * d.d_v);
        let (q, k, vv, g, b) = (v(q), v(k), v(v_), v(g), v(beta));
        gdn::delta_rule_chunked(d, chunk, q, k, vv, g, b, vm(state), out);
        Ok(())
    }

    fn delta_rule_decode(&self, s: DecodeStep<'_>, o: &mut Buf) -> DeviceResult<()> {
        let d = s.dims;
        let hvdv = d.n_v_heads * d.d_v;
        let conv_dim = 2 * d.n_k_heads * d.d_k + hvdv;
        let proj = v(s.proj);
        let inp = gdn::DecodeInputs {
            qkv: &proj[..conv_dim],
            z: &proj[conv_dim..conv_dim + hvdv],
            g: v(s.g),
            beta: v(s.beta),
            conv_weight: v(s.conv_weight),
            norm_weight: v(s.norm_weight),
            eps: s.eps,
        };
        let out = sized(o, hvdv);
        let (cs, st) = (vm(s.conv_state), vm(s.state));
        gdn::delta_rule_decode_step(d, s.kernel, &inp, cs, st, out);
        Ok(())
    }

    fn kv_new(
        &self,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> DeviceResult<DeviceKv> {
        Ok(DeviceKv {
            len: 0,
            inner: Box::new(PagedKvCache::new(page_size, n_kv_heads, head_dim, dtype)),
        })
    }

    fn kv_append(&self, kv: &mut DeviceKv, k: &Buf, v_: &Buf, n_rows: usize) -> DeviceResult<()> {
        let c = kv
            .inner
            .downcast_mut::<PagedKvCache>()
            .expect("a CPU cache");
        c.append(v(k), v(v_), n_rows);
        kv.len = c.len();
        Ok(())
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
        let p = PageStore::attend(cache(kv), v(q), n_tokens, n_heads, pos0, scale, None);
        set_partial(p, o, lse);
        Ok(())
    }

    fn kv_clone(&self, kv: &DeviceKv) -> DeviceResult<DeviceKv> {
        let c = kv
            .inner
            .downcast_ref::<PagedKvCache>()
            .expect("a CPU cache");
        Ok(DeviceKv {
            len: kv.len,
            inner: Box::new(c.clone()),
        })
    }

    fn kv_truncate(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        let c = kv
            .inner
            .downcast_mut::<PagedKvCache>()
            .expect("a CPU cache");
        c.try_truncate(len)
            .map_err(|e| DeviceError::Unsupported(DeviceId::CPU, e.to_string()))?;
        kv.len = c.len();
        Ok(())
    }

    fn kv_offloaded(&self, kv: &DeviceKv) -> usize {
        cache(kv).offloaded()
    }

    fn kv_movable_pages(&self, kv: &DeviceKv) -> usize {
        cache(kv).movable_pages()
    }

    fn kv_take_oldest(&self, kv: &mut DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        let c = kv
            .inner
            .downcast_mut::<PagedKvCache>()
            .expect("a CPU cache");
        c.take_oldest(n)
            .map_err(|e| DeviceError::Unsupported(DeviceId::CPU, e.to_string()))
    }

    fn kv_copy_oldest(&self, kv: &DeviceKv, n: usize) -> DeviceResult<Vec<KvPage>> {
        let c = cache(kv);
        if n > c.movable_pages() {
            let why = format!("{n} pages asked, {} may move", c.movable_pages());
            return Err(DeviceError::Unsupported(DeviceId::CPU, why));
        }
        Ok(c.pages()[..n].to_vec())
    }

    fn kv_truncate_offloaded(&self, kv: &mut DeviceKv, len: usize) -> DeviceResult<()> {
        let c = kv
            .inner
            .downcast_mut::<PagedKvCache>()
            .expect("a CPU cache");
        c.truncate_offloaded(len)
            .map_err(|e| DeviceError::Unsupported(DeviceId::CPU, e.to_string()))?;
        kv.len = c.len();
        Ok(())
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
        let p = cache(kv).attend_after(prefix, v(q), n_tokens, n_heads, pos0, scale);
        set_partial(p, o, lse);
        Ok(())
    }

    fn embed(&self, w: &DeviceMatrix, ids: &[u32], out: &mut Buf) -> DeviceResult<()> {
        let lin = w.inner.downcast_ref::<Linear>().expect("a CPU matrix");
        let o = sized(out, ids.len() * w.k);
        for (row, &id) in o.chunks_exact_mut(w.k).zip(ids) {
            lin.row_into(id as usize, row);
        }
        Ok(())
    }

    fn top_k(&self, logits: &Buf, n_rows: usize, k: usize) -> DeviceResult<Vec<Vec<(u32, f32)>>> {
        let l = v(logits);
        assert!(
            n_rows > 0 && l.len().is_multiple_of(n_rows),
            "top_k: logits are not [n_rows, vocab]"
        );
        Ok(l.chunks_exact(l.len() / n_rows)
            .map(|row| top_k_row(row, k))
            .collect())
    }
}

/// A CPU device cache.
fn cache(kv: &DeviceKv) -> &PagedKvCache {
    kv.inner
        .downcast_ref::<PagedKvCache>()
        .expect("a CPU cache")
}

/// Moves a partial's vectors into `o` and `lse` (no copy).
fn set_partial(p: Partial, o: &mut Buf, lse: &mut Buf) {
    o.set_len(p.o.len());
    lse.set_len(p.lse.len());
    *vm(o) = p.o;
    *vm(lse) = p.lse;
}

/// The `k` largest `(id, logit)` of `row`, largest first, equal logits by lower id (NaN sorts last).
pub fn top_k_row(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &x)| (i as u32, x))
        .collect();
    let by = |a: &(u32, f32), b: &(u32, f32)| {
        let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
        key(b.1).total_cmp(&key(a.1)).then(a.0.cmp(&b.0))
    };
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, by);
    idx.truncate(k);
    idx.sort_by(by);
    idx
}
