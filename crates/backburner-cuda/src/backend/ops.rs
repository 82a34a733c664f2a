//! The row-wise and element-wise ops (kernels/rowops.cu).

use backburner_model::device::{Buf, DeviceResult};
use backburner_model::ops::Rope;

use super::mem::{blocks_for, int, ptr, Arg};
use super::CudaBackend;

impl CudaBackend {
    /// `[rows, dim]` with `dim = g_len` (panics otherwise: caller bug).
    fn rows_of(len: usize, dim: usize, what: &str) -> usize {
        assert!(dim > 0 && len.is_multiple_of(dim), "{what}: not [n, {dim}]");
        len / dim
    }

    pub(super) fn rms_norm_to(
        &self,
        x: &Buf,
        g: &Buf,
        eps: f32,
        out: Option<&mut Buf>,
    ) -> DeviceResult<()> {
        self.bind()?;
        let dim = g.len();
        let rows = Self::rows_of(x.len(), dim, "rms_norm");
        let o = match out {
            Some(o) => self.ensure(o, x.len())?,
            None => ptr(x),
        };
        if rows == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(ptr(x)),
            Arg::P(ptr(g)),
            Arg::P(o),
            int(dim),
            Arg::F(eps),
        ];
        self.run("rms_norm", (rows as u32, 1), 256, &args)
    }

    pub(super) fn gated_rms_norm_op(
        &self,
        o: &mut Buf,
        z: &Buf,
        w: &Buf,
        eps: f32,
    ) -> DeviceResult<()> {
        self.bind()?;
        assert_eq!(o.len(), z.len(), "gated_rms_norm: o and z differ in length");
        let dim = w.len();
        let rows = Self::rows_of(o.len(), dim, "gated_rms_norm");
        self.gated_norm_at(ptr(o), ptr(z), ptr(w), rows, dim, eps)
    }

    /// The gated norm of `rows` rows of `dim` at device addresses.
    pub(super) fn gated_norm_at(
        &self,
        o: u64,
        z: u64,
        w: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> DeviceResult<()> {
        if rows == 0 {
            return Ok(());
        }
        let args = [Arg::P(o), Arg::P(z), Arg::P(w), int(dim), Arg::F(eps)];
        self.run("gated_rms_norm", (rows as u32, 1), 256, &args)
    }

    pub(super) fn l2_norm_op(&self, x: &mut Buf, dim: usize, scale: f32) -> DeviceResult<()> {
        self.bind()?;
        let rows = Self::rows_of(x.len(), dim, "l2_norm_scaled");
        self.l2_norm_at(ptr(x), rows, dim, scale)
    }

    /// The l2 norm of `rows` rows of `dim` at a device address.
    pub(super) fn l2_norm_at(
        &self,
        x: u64,
        rows: usize,
        dim: usize,
        scale: f32,
    ) -> DeviceResult<()> {
        if rows == 0 {
            return Ok(());
        }
        let args = [Arg::P(x), int(rows), int(dim), Arg::F(scale)];
        self.run("l2_norm_scaled", (rows.div_ceil(4) as u32, 1), 128, &args)
    }

    /// An element-wise kernel `name(a, b, n)` over equal lengths.
    pub(super) fn elementwise(&self, name: &str, a: &mut Buf, b: &Buf) -> DeviceResult<()> {
        self.bind()?;
        assert_eq!(a.len(), b.len(), "{name}: lengths differ");
        let n = a.len();
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::P(ptr(a)), Arg::P(ptr(b)), Arg::N(n as u64)];
        self.run(name, (blocks_for(n), 1), 256, &args)
    }

    /// `act = silu(gate)·up` of `gu` `[rows, 2·inter]` at device addresses.
    pub(super) fn silu_mul_at(
        &self,
        gu: u64,
        act: u64,
        rows: usize,
        inter: usize,
    ) -> DeviceResult<()> {
        let n = rows * inter;
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::P(gu), Arg::P(act), int(inter), Arg::N(n as u64)];
        self.run("silu_mul_halves", (blocks_for(n), 1), 256, &args)
    }

    pub(super) fn take_cols_op(
        &self,
        src: &Buf,
        width: usize,
        col0: usize,
        n_cols: usize,
        dst: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        assert!(
            col0 + n_cols <= width && src.len().is_multiple_of(width),
            "take_cols: columns outside [rows, {width}]"
        );
        let n = src.len() / width * n_cols;
        let d = self.ensure(dst, n)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(ptr(src)),
            Arg::P(d),
            int(width),
            int(col0),
            int(n_cols),
            Arg::N(n as u64),
        ];
        self.run("take_cols", (blocks_for(n), 1), 256, &args)
    }

    /// The device copy of `rope`'s inverse frequencies (uploaded once per distinct table).
    fn rope_table(&self, rope: &Rope) -> DeviceResult<u64> {
        let mut s = self.scratch();
        if let Some((_, m)) = s.rope.iter().find(|(f, _)| f.as_slice() == rope.inv_freq()) {
            return Ok(m.ptr);
        }
        let f = rope.inv_freq().to_vec();
        let m = self.alloc(4 * f.len().max(1), "the RoPE table")?;
        self.htod(m.ptr, &f)?;
        let p = m.ptr;
        s.rope.push((f, m));
        Ok(p)
    }

    pub(super) fn rope_op(
        &self,
        rope: &Rope,
        x: &mut Buf,
        n_tokens: usize,
        n_heads: usize,
        pos0: usize,
    ) -> DeviceResult<()> {
        self.bind()?;
        let hd = rope.head_dim();
        assert_eq!(x.len(), n_tokens * n_heads * hd, "rope: x is not [T, H, D]");
        let half = rope.inv_freq().len();
        let n = n_tokens * n_heads * half;
        if n == 0 {
            return Ok(());
        }
        let table = self.rope_table(rope)?;
        let args = [
            Arg::P(ptr(x)),
            Arg::P(table),
            int(n_heads),
            int(hd),
            int(half),
            int(pos0),
            Arg::N(n as u64),
        ];
        self.run("rope", (blocks_for(n), 1), 256, &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn gdn_gates_op(
        &self,
        proj: &Buf,
        width: usize,
        col0: usize,
        neg_a: &Buf,
        dt_bias: &Buf,
        beta: &mut Buf,
        g: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        let hv = neg_a.len();
        assert!(
            col0 + 2 * hv <= width && dt_bias.len() == hv,
            "gdn_gates: bad columns"
        );
        let t = Self::rows_of(proj.len(), width, "gdn_gates");
        let n = t * hv;
        let (b, gp) = (self.ensure(beta, n)?, self.ensure(g, n)?);
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(ptr(proj)),
            int(width),
            int(col0),
            Arg::P(ptr(neg_a)),
            Arg::P(ptr(dt_bias)),
            Arg::P(b),
            Arg::P(gp),
            int(hv),
            Arg::N(n as u64),
        ];
        self.run("gdn_gates", (blocks_for(n), 1), 256, &args)
    }
}
