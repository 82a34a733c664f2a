//! The Gated DeltaNet ops (kernels/gdn.cu): the causal conv, the delta rule over a prompt and the decode step.
//!
//! The prompt's delta rule runs the recurrent form token by token (`delta_rule`: each value column's state in the
//! registers of two lanes): the chunked form of the CPU computes the same function in exact arithmetic, in another
//! order of floating-point operations.

use backburner_kernels::gdn::GdnDims;
use backburner_model::device::{Buf, DecodeStep, DeviceError, DeviceResult};

use super::mem::{int, ptr, Arg};
use super::CudaBackend;

/// The conv kernel lengths and q/k head dims the kernels hold in registers (gdn.cu's MAX_CONV_KERNEL, MAX_DK).
const MAX_CONV_KERNEL: usize = 16;
const MAX_DK: usize = 128;

/// The addresses and strides of one delta-rule launch.
struct DeltaArgs {
    q: u64,
    k: u64,
    v: u64,
    qk_stride: usize,
    v_stride: usize,
    g: u64,
    beta: u64,
    state: u64,
    o: u64,
}

impl CudaBackend {
    fn check_gdn(&self, kernel: usize, d_k: usize) -> DeviceResult<()> {
        if kernel == 0 || kernel > MAX_CONV_KERNEL || d_k > MAX_DK {
            return Err(DeviceError::Unsupported(
                self.id,
                format!("Gated DeltaNet with conv kernel {kernel} and key head dim {d_k} (at most {MAX_CONV_KERNEL} and {MAX_DK})"),
            ));
        }
        Ok(())
    }

    /// The conv over `n_tokens` rows of x (row t at `x + 4·t·x_stride`) into `out` `[n_tokens, conv_dim]`, then the
    /// state's advance.
    #[allow(clippy::too_many_arguments)]
    fn conv_at(
        &self,
        x: u64,
        x_stride: usize,
        n_tokens: usize,
        conv_dim: usize,
        kernel: usize,
        weight: u64,
        state: u64,
        out: u64,
    ) -> DeviceResult<()> {
        let n = n_tokens * conv_dim;
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(x),
            int(x_stride),
            Arg::P(weight),
            Arg::P(state),
            Arg::P(out),
            int(conv_dim),
            int(kernel),
            Arg::N(n as u64),
        ];
        self.run("conv_out", (super::mem::blocks_for(n), 1), 256, &args)?;
        let args = [
            Arg::P(x),
            int(x_stride),
            Arg::P(state),
            int(n_tokens),
            int(conv_dim),
            int(kernel),
        ];
        self.run("conv_state", (conv_dim.div_ceil(256) as u32, 1), 256, &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn causal_conv_op(
        &self,
        x: &Buf,
        n_tokens: usize,
        conv_dim: usize,
        kernel: usize,
        weight: &Buf,
        state: &mut Buf,
        out: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        self.check_gdn(kernel, 0)?;
        assert_eq!(
            x.len(),
            n_tokens * conv_dim,
            "causal_conv: x is not [T, conv_dim]"
        );
        assert_eq!(
            weight.len(),
            conv_dim * kernel,
            "causal_conv: weight is not [conv_dim, kernel]"
        );
        assert_eq!(
            state.len(),
            conv_dim * (kernel - 1),
            "causal_conv: state is not [conv_dim, kernel - 1]"
        );
        let o = self.ensure(out, n_tokens * conv_dim)?;
        self.conv_at(
            ptr(x),
            conv_dim,
            n_tokens,
            conv_dim,
            kernel,
            ptr(weight),
            ptr(state),
            o,
        )
    }

    /// One delta-rule launch over `d.n_tokens` tokens.
    fn delta_at(&self, d: GdnDims, a: DeltaArgs) -> DeviceResult<()> {
        if d.n_tokens == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(a.q),
            Arg::P(a.k),
            Arg::P(a.v),
            int(a.qk_stride),
            int(a.v_stride),
            Arg::P(a.g),
            Arg::P(a.beta),
            Arg::P(a.state),
            Arg::P(a.o),
            int(d.n_tokens),
            int(d.n_k_heads),
            int(d.n_v_heads),
            int(d.d_k),
            int(d.d_v),
            Arg::I(d.tiled_v_heads as i32),
        ];
        self.run(
            "delta_rule",
            (d.d_v.div_ceil(16) as u32, d.n_v_heads as u32),
            32,
            &args,
        )
    }

    /// Asserts the head counts (as GdnDims::ratio does on the CPU).
    fn check_heads(d: &GdnDims) {
        assert!(
            d.n_k_heads > 0
                && d.n_v_heads > 0
                && d.n_v_heads.is_multiple_of(d.n_k_heads)
                && d.d_k > 0
                && d.d_v > 0,
            "GdnDims: bad heads {d:?}"
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_rule_op(
        &self,
        d: GdnDims,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        g: &Buf,
        beta: &Buf,
        state: &mut Buf,
        o: &mut Buf,
    ) -> DeviceResult<()> {
        self.bind()?;
        Self::check_heads(&d);
        self.check_gdn(1, d.d_k)?;
        let (t, qk, vd) = (d.n_tokens, d.n_k_heads * d.d_k, d.n_v_heads * d.d_v);
        assert!(
            q.len() == t * qk && k.len() == t * qk,
            "delta_rule: q, k are not [T, Hk·Dk]"
        );
        assert_eq!(v.len(), t * vd, "delta_rule: v is not [T, Hv·Dv]");
        assert!(
            g.len() == t * d.n_v_heads && beta.len() == t * d.n_v_heads,
            "delta_rule: g, beta are not [T, Hv]"
        );
        assert_eq!(
            state.len(),
            d.n_v_heads * d.d_k * d.d_v,
            "delta_rule: state is not [Hv, Dk, Dv]"
        );
        let op = self.ensure(o, t * vd)?;
        let a = DeltaArgs {
            q: ptr(q),
            k: ptr(k),
            v: ptr(v),
            qk_stride: qk,
            v_stride: vd,
            g: ptr(g),
            beta: ptr(beta),
            state: ptr(state),
            o: op,
        };
        self.delta_at(d, a)
    }

    /// The decode step as separate kernels: conv of the qkv columns into scratch, the q/k l2 norms, the recurrent
    /// step, the gated norm with the z columns.
    pub(super) fn decode_op(&self, s: DecodeStep<'_>, o: &mut Buf) -> DeviceResult<()> {
        self.bind()?;
        let d = s.dims;
        Self::check_heads(&d);
        assert_eq!(d.n_tokens, 1, "delta_rule_decode: one token");
        self.check_gdn(s.kernel, d.d_k)?;
        let (qk, vd) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v);
        let conv_dim = 2 * qk + vd;
        assert!(
            s.proj.len() >= conv_dim + vd,
            "delta_rule_decode: proj is too short"
        );
        assert_eq!(
            s.conv_weight.len(),
            conv_dim * s.kernel,
            "delta_rule_decode: conv weight"
        );
        assert_eq!(
            s.conv_state.len(),
            conv_dim * (s.kernel - 1),
            "delta_rule_decode: conv state"
        );
        assert_eq!(
            s.state.len(),
            d.n_v_heads * d.d_k * d.d_v,
            "delta_rule_decode: state"
        );
        assert_eq!(s.norm_weight.len(), d.d_v, "delta_rule_decode: norm weight");
        let op = self.ensure(o, vd)?;
        let mut sc = self.scratch();
        let a = self.scratch_at(&mut sc.conv, 4 * conv_dim, "the decode step's conv output")?;
        let proj = ptr(s.proj);
        let cw = ptr(s.conv_weight);
        self.conv_at(
            proj,
            conv_dim,
            1,
            conv_dim,
            s.kernel,
            cw,
            ptr(s.conv_state),
            a,
        )?;
        self.l2_norm_at(a, d.n_k_heads, d.d_k, 1.0 / (d.d_k as f32).sqrt())?;
        self.l2_norm_at(a + 4 * qk as u64, d.n_k_heads, d.d_k, 1.0)?;
        let da = DeltaArgs {
            q: a,
            k: a + 4 * qk as u64,
            v: a + 8 * qk as u64,
            qk_stride: conv_dim,
            v_stride: conv_dim,
            g: ptr(s.g),
            beta: ptr(s.beta),
            state: ptr(s.state),
            o: op,
        };
        self.delta_at(d, da)?;
        let z = proj + 4 * conv_dim as u64;
        self.gated_norm_at(op, z, ptr(s.norm_weight), d.n_v_heads, d.d_v, s.eps)
    }
}
