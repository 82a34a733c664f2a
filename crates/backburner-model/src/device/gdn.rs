//! The Gated DeltaNet mixer of a layer on a device (`model/mixer.rs`'s `gdn_core` with its projections, written
//! against [`Backend`]'s ops), and the checkpoints it takes inside a prefill (`model/capture.rs`).

use backburner_kernels::gdn::GdnDims;

use super::backend::{Buf, DecodeStep, DeviceResult};
use super::layer::{DMixer, DeviceLayers, Pass};
use super::state::Scratch;
use crate::model::{conv_window, Capture, GDN_CHUNK};
use crate::state::LinearState;

impl DeviceLayers {
    /// The Gated DeltaNet mixer on `s.h`, output in `s.out` (`model/mixer.rs`'s `gdn_core` with its projections).
    pub(super) fn gdn(
        &self,
        m: &DMixer,
        at: Pass,
        conv: &mut Buf,
        recurrent: &mut Buf,
        s: &mut Scratch,
        capture: &mut Capture,
    ) -> DeviceResult<()> {
        let t = at.t;
        let rows = capture.rows(at.pos0, t, GDN_CHUNK);
        let DMixer::Gdn {
            in_proj,
            conv_weight,
            dt_bias,
            neg_a,
            norm,
            out_proj,
        } = m
        else {
            unreachable!("gdn on an attention layer")
        };
        let be = self.backend.as_ref();
        let c = &self.cfg;
        let dims = c.gdn_dims(t);
        let (hk, hv, dk, dv) = (dims.n_k_heads, dims.n_v_heads, dims.d_k, dims.d_v);
        let conv_dim = c.conv_dim();
        let width = conv_dim + hv * dv + 2 * hv;
        let eps = c.rms_norm_eps as f32;
        let kernel = c.linear_conv_kernel_dim;
        be.matmul(&s.h, t, in_proj, &mut s.proj)?;
        be.gdn_gates(
            &s.proj,
            width,
            conv_dim + hv * dv,
            neg_a,
            dt_bias,
            &mut s.beta,
            &mut s.g,
        )?;
        if t == 1 {
            let step = DecodeStep {
                dims,
                kernel,
                proj: &s.proj,
                g: &s.g,
                beta: &s.beta,
                conv_weight,
                norm_weight: norm,
                eps,
                conv_state: conv,
                state: recurrent,
            };
            be.delta_rule_decode(step, &mut s.o)?;
            if !rows.is_empty() {
                // one token: the decode step, whose only checkpoint is its end
                let st = self.download_state(conv, recurrent)?;
                capture.keep(at.pos0 + 1, at.idx, st);
            }
        } else {
            be.take_cols(&s.proj, width, 0, conv_dim, &mut s.a)?;
            be.take_cols(&s.proj, width, conv_dim, hv * dv, &mut s.z)?;
            let before = match rows.is_empty() {
                true => Vec::new(),
                false => self.download_state(conv, recurrent)?.conv,
            };
            be.causal_conv(&s.a, t, conv_dim, kernel, conv_weight, conv, &mut s.b)?;
            be.take_cols(&s.b, conv_dim, 0, hk * dk, &mut s.q)?;
            be.take_cols(&s.b, conv_dim, hk * dk, hk * dk, &mut s.k)?;
            be.take_cols(&s.b, conv_dim, 2 * hk * dk, hv * dv, &mut s.v)?;
            be.l2_norm_scaled(&mut s.q, dk, 1.0 / (dk as f32).sqrt())?;
            be.l2_norm_scaled(&mut s.k, dk, 1.0)?;
            if rows.is_empty() {
                let (q, k, v, g, beta) = (&s.q, &s.k, &s.v, &s.g, &s.beta);
                be.delta_rule_chunked(dims, GDN_CHUNK, q, k, v, g, beta, recurrent, &mut s.o)?;
            } else {
                let cap = Checkpoints {
                    at,
                    rows: &rows,
                    before: &before,
                };
                self.delta_rule_capturing(dims, s, conv, recurrent, cap, capture)?;
            }
            be.gated_rms_norm(&mut s.o, &s.z, norm, eps)?;
        }
        be.matmul(&s.o, t, out_proj, &mut s.out)
    }

    /// A Gated DeltaNet layer's conv and recurrent states copied to the host.
    fn download_state(&self, conv: &Buf, recurrent: &Buf) -> DeviceResult<LinearState> {
        let mut st = LinearState {
            conv: vec![0.0; conv.len()],
            recurrent: vec![0.0; recurrent.len()],
        };
        self.backend.download(conv, &mut st.conv)?;
        self.backend.download(recurrent, &mut st.recurrent)?;
        Ok(st)
    }

    /// The chunked delta rule of a call (inputs in `s.q`, `s.k`, `s.v`, `s.g`, `s.beta`) run as consecutive calls
    /// split at the checkpoint rows (each a chunk boundary or the call's end: the same chunks, so the same bits as
    /// one call), each checkpoint's state copied to the host between them (`model/capture.rs`). `conv` is the conv
    /// state after the call; the windows before its end come from the call's raw rows `s.a`.
    fn delta_rule_capturing(
        &self,
        dims: GdnDims,
        s: &mut Scratch,
        conv: &Buf,
        recurrent: &mut Buf,
        cap: Checkpoints<'_>,
        capture: &mut Capture,
    ) -> DeviceResult<()> {
        let be = self.backend.as_ref();
        let t = dims.n_tokens;
        let (qk, vv, hv) = (
            dims.n_k_heads * dims.d_k,
            dims.n_v_heads * dims.d_v,
            dims.n_v_heads,
        );
        let conv_dim = 2 * qk + vv;
        let kc = self.cfg.linear_conv_kernel_dim - 1;
        let mut raw = vec![0.0f32; s.a.len()];
        be.download(&s.a, &mut raw)?;
        s.o = be.zeros(t * vv)?;
        let mut a = 0;
        for &b in cap
            .rows
            .iter()
            .chain((cap.rows.last() != Some(&t)).then_some(&t))
        {
            let n = b - a;
            let part = |src: &Buf, w: usize| -> DeviceResult<Buf> {
                let mut d = be.zeros(n * w)?;
                be.copy_rows(src, w, a..b, &mut d, 0)?;
                Ok(d)
            };
            let (q, k, v) = (part(&s.q, qk)?, part(&s.k, qk)?, part(&s.v, vv)?);
            let (g, beta) = (part(&s.g, hv)?, part(&s.beta, hv)?);
            let d = GdnDims {
                n_tokens: n,
                ..dims
            };
            let mut o = be.zeros(0)?;
            be.delta_rule_chunked(d, GDN_CHUNK, &q, &k, &v, &g, &beta, recurrent, &mut o)?;
            be.copy_rows(&o, vv, 0..n, &mut s.o, a)?;
            if cap.rows.contains(&b) {
                let mut st = self.download_state(conv, recurrent)?;
                if b < t {
                    st.conv = conv_window(cap.before, &raw, conv_dim, kc, b);
                }
                capture.keep(cap.at.pos0 + b, cap.at.idx, st);
            }
            a = b;
        }
        Ok(())
    }
}

/// Where one Gated DeltaNet call takes its checkpoints: the pass, the rows (increasing, each a chunk boundary or the
/// call's end) and the conv state the call began with.
struct Checkpoints<'a> {
    at: Pass,
    rows: &'a [usize],
    before: &'a [f32],
}
