//! Every op of the CUDA backend against the CPU backend on random inputs (skipped with one line on a machine
//! without a CUDA device).
//!
//! Tolerances (|gpu − cpu| ≤ atol + rtol·|cpu|): norms, activations, RoPE, gates, the conv: rtol 1e-5, atol 1e-6
//! (libdevice's `expf`/`sinf` and reduction orders differ from the CPU's by an ulp or two); copies, take_cols,
//! embedding rows, conv states: exact; dense GEMV (≤ 4 rows, f32 arithmetic): atol 1e-3·max|y|;
//! cuBLAS bf16 products (x rounded to bf16) and block formats (the CPU quantizes x to 8 bits): atol 2e-2·max|y|; the
//! delta rule (recurrent on the GPU, chunked on the CPU), the decode step and attention: atol 1e-4·max|cpu| (the
//! kernels' own chunked-vs-recurrent bound), 2e-2 for a bf16 KV cache (the CPU rounds q and the softmax weights).

mod common;

use backburner_kernels::gdn::GdnDims;
use backburner_kernels::kv::KvDtype;
use backburner_kernels::matmul::{PackedMatrix, WeightDtype};
use backburner_model::device::{Backend, CpuBackend, DecodeStep};
use backburner_model::linear::Linear;
use backburner_model::ops::Rope;
use common::{both, check_products, close, close_scaled, gpu, host, max_abs, rand_vec};

#[test]
fn buffers_round_trip_and_row_ops_match_the_cpu() {
    let Some(g) = gpu("row ops") else { return };
    let c = CpuBackend;
    let (rows, dim) = (37, 320);
    let xv = rand_vec(rows * dim, 1, 3.0);
    let (x, xc) = both(&g, &xv);
    assert_eq!(host(g.as_ref(), &x), xv, "upload/download");
    let mut z = g.zeros(5).unwrap();
    assert_eq!(host(g.as_ref(), &z), vec![0.0; 5]);
    g.copy(&x, &mut z).unwrap();
    assert_eq!(host(g.as_ref(), &z), xv, "copy");

    let gv = rand_vec(dim, 2, 1.0);
    let (gg, gc) = both(&g, &gv);
    let (mut o, mut oc) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
    g.rms_norm(&x, &gg, 1e-6, &mut o).unwrap();
    c.rms_norm(&xc, &gc, 1e-6, &mut oc).unwrap();
    close(
        "rms_norm",
        &host(g.as_ref(), &o),
        &host(&c, &oc),
        1e-5,
        1e-6,
    );
    let (mut xi, mut xic) = both(&g, &xv);
    g.rms_norm_inplace(&mut xi, &gg, 1e-6).unwrap();
    c.rms_norm_inplace(&mut xic, &gc, 1e-6).unwrap();
    close(
        "rms_norm_inplace",
        &host(g.as_ref(), &xi),
        &host(&c, &xic),
        1e-5,
        1e-6,
    );

    let zv = rand_vec(rows * dim, 3, 4.0);
    let (zz, zc) = both(&g, &zv);
    let wv = rand_vec(64, 4, 1.5);
    let (w, wc) = both(&g, &wv);
    let (mut go, mut goc) = both(&g, &xv);
    g.gated_rms_norm(&mut go, &zz, &w, 1e-6).unwrap();
    c.gated_rms_norm(&mut goc, &zc, &wc, 1e-6).unwrap();
    close(
        "gated_rms_norm",
        &host(g.as_ref(), &go),
        &host(&c, &goc),
        1e-5,
        1e-6,
    );

    let (mut l2, mut l2c) = both(&g, &xv);
    g.l2_norm_scaled(&mut l2, 32, 0.25).unwrap();
    c.l2_norm_scaled(&mut l2c, 32, 0.25).unwrap();
    close(
        "l2_norm_scaled",
        &host(g.as_ref(), &l2),
        &host(&c, &l2c),
        1e-5,
        1e-6,
    );
}

#[test]
fn element_ops_and_columns_match_the_cpu() {
    let Some(g) = gpu("element ops") else { return };
    let c = CpuBackend;
    let (rows, dim) = (37, 320);
    let xv = rand_vec(rows * dim, 1, 3.0);
    let (x, xc) = both(&g, &xv);
    let (zz, zc) = both(&g, &rand_vec(rows * dim, 3, 4.0));
    let (mut s, mut sc) = both(&g, &xv);
    g.sigmoid_mul(&mut s, &zz).unwrap();
    c.sigmoid_mul(&mut sc, &zc).unwrap();
    close(
        "sigmoid_mul",
        &host(g.as_ref(), &s),
        &host(&c, &sc),
        1e-5,
        1e-6,
    );
    g.add_assign(&mut s, &zz).unwrap();
    c.add_assign(&mut sc, &zc).unwrap();
    close(
        "add_assign",
        &host(g.as_ref(), &s),
        &host(&c, &sc),
        1e-5,
        1e-6,
    );

    let (mut t, mut tc) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
    g.take_cols(&x, dim, 17, 100, &mut t).unwrap();
    c.take_cols(&xc, dim, 17, 100, &mut tc).unwrap();
    assert_eq!(host(g.as_ref(), &t), host(&c, &tc), "take_cols");
}

#[test]
fn rope_and_gates_match_the_cpu() {
    let Some(g) = gpu("rope and gates") else {
        return;
    };
    let c = CpuBackend;
    let rope = Rope::new(64, 256, 10_000_000.0);
    let (t, h, pos0) = (9, 6, 4090);
    let xv = rand_vec(t * h * 256, 5, 2.0);
    let (mut x, mut xc) = both(&g, &xv);
    g.rope(&rope, &mut x, t, h, pos0).unwrap();
    c.rope(&rope, &mut xc, t, h, pos0).unwrap();
    close("rope", &host(g.as_ref(), &x), &host(&c, &xc), 1e-5, 2e-6);

    let (hv, width, col0) = (48, 200, 100);
    let mut pv = rand_vec(5 * width, 6, 8.0);
    pv[col0 + hv] = 30.0; // softplus's linear branch
    pv[col0 + hv + 1] = -30.0;
    let (p, pc) = both(&g, &pv);
    let (na, nac) = both(&g, &rand_vec(hv, 7, 4.0));
    let (dt, dtc) = both(&g, &rand_vec(hv, 8, 2.0));
    let (mut b, mut bc, mut gg, mut gc) = (
        g.zeros(0).unwrap(),
        c.zeros(0).unwrap(),
        g.zeros(0).unwrap(),
        c.zeros(0).unwrap(),
    );
    g.gdn_gates(&p, width, col0, &na, &dt, &mut b, &mut gg)
        .unwrap();
    c.gdn_gates(&pc, width, col0, &nac, &dtc, &mut bc, &mut gc)
        .unwrap();
    close("beta", &host(g.as_ref(), &b), &host(&c, &bc), 1e-5, 1e-7);
    close("g", &host(g.as_ref(), &gg), &host(&c, &gc), 1e-5, 1e-6);
}

#[test]
fn conv_and_delta_rule_match_the_cpu_over_calls() {
    let Some(g) = gpu("conv and delta rule") else {
        return;
    };
    let c = CpuBackend;
    for tiled in [false, true] {
        let d = GdnDims {
            n_tokens: 0,
            n_k_heads: 2,
            n_v_heads: 6,
            d_k: 128,
            d_v: 96,
            tiled_v_heads: tiled,
        };
        let (qk, vd) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v);
        let (conv_dim, kernel) = (2 * qk + vd, 4);
        let (cw, cwc) = both(&g, &rand_vec(conv_dim * kernel, 9, 0.5));
        let (mut cs, mut csc) = both(&g, &vec![0.0; conv_dim * (kernel - 1)]);
        let (mut st, mut stc) = both(&g, &vec![0.0; d.n_v_heads * d.d_k * d.d_v]);
        for (call, t) in [(0u64, 37usize), (1, 2), (2, 70)] {
            let dt = GdnDims { n_tokens: t, ..d };
            let (x, xc) = both(&g, &rand_vec(t * conv_dim, 10 + call, 2.0));
            let (mut o, mut oc) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
            g.causal_conv(&x, t, conv_dim, kernel, &cw, &mut cs, &mut o)
                .unwrap();
            c.causal_conv(&xc, t, conv_dim, kernel, &cwc, &mut csc, &mut oc)
                .unwrap();
            close("conv", &host(g.as_ref(), &o), &host(&c, &oc), 1e-5, 1e-6);
            close(
                "conv state",
                &host(g.as_ref(), &cs),
                &host(&c, &csc),
                0.0,
                0.0,
            );
            // q, k normalized as the layer does; v, gates random
            let mut qv = rand_vec(t * qk, 20 + call, 1.0);
            let mut kv = rand_vec(t * qk, 30 + call, 1.0);
            backburner_kernels::rowops::l2_norm_scaled(&mut qv, d.d_k, 1.0 / (d.d_k as f32).sqrt());
            backburner_kernels::rowops::l2_norm_scaled(&mut kv, d.d_k, 1.0);
            let (q, qc) = both(&g, &qv);
            let (k, kc) = both(&g, &kv);
            let (v, vc) = both(&g, &rand_vec(t * vd, 40 + call, 1.0));
            let gv: Vec<f32> = rand_vec(t * d.n_v_heads, 50 + call, 1.0)
                .iter()
                .map(|x| -x.abs() * 0.3)
                .collect();
            let bv: Vec<f32> = rand_vec(t * d.n_v_heads, 60 + call, 1.0)
                .iter()
                .map(|x| 0.5 + 0.4 * x)
                .collect();
            let ((gg, gc), (bb, bc)) = (both(&g, &gv), both(&g, &bv));
            let (mut o, mut oc) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
            g.delta_rule_chunked(dt, 64, &q, &k, &v, &gg, &bb, &mut st, &mut o)
                .unwrap();
            c.delta_rule_chunked(dt, 64, &qc, &kc, &vc, &gc, &bc, &mut stc, &mut oc)
                .unwrap();
            close_scaled(
                "delta rule out",
                &host(g.as_ref(), &o),
                &host(&c, &oc),
                1e-4,
            );
            close_scaled(
                "delta rule state",
                &host(g.as_ref(), &st),
                &host(&c, &stc),
                1e-4,
            );
        }
        decode_steps(&g, d, kernel, &mut cs, &mut csc, &mut st, &mut stc);
    }
}

/// Three decode steps continuing the states of the prompt.
fn decode_steps(
    g: &backburner_cuda::CudaBackend,
    d: GdnDims,
    kernel: usize,
    cs: &mut backburner_model::device::Buf,
    csc: &mut backburner_model::device::Buf,
    st: &mut backburner_model::device::Buf,
    stc: &mut backburner_model::device::Buf,
) {
    let c = CpuBackend;
    let d = GdnDims { n_tokens: 1, ..d };
    let (qk, vd) = (d.n_k_heads * d.d_k, d.n_v_heads * d.d_v);
    let conv_dim = 2 * qk + vd;
    let (cw, cwc) = both(g, &rand_vec(conv_dim * kernel, 9, 0.5));
    let (nw, nwc) = both(g, &rand_vec(d.d_v, 70, 1.0));
    for step in 0..3u64 {
        let (p, pc) = both(
            g,
            &rand_vec(conv_dim + vd + 2 * d.n_v_heads, 80 + step, 2.0),
        );
        let gv: Vec<f32> = rand_vec(d.n_v_heads, 90 + step, 1.0)
            .iter()
            .map(|x| -x.abs())
            .collect();
        let ((gg, gc), (bb, bc)) = (
            both(g, &gv),
            both(g, &rand_vec(d.n_v_heads, 95 + step, 0.4)),
        );
        let (mut o, mut oc) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
        let s = |proj, gg, bb, cw, nw, conv_state, state| DecodeStep {
            dims: d,
            kernel,
            proj,
            g: gg,
            beta: bb,
            conv_weight: cw,
            norm_weight: nw,
            eps: 1e-6,
            conv_state,
            state,
        };
        g.delta_rule_decode(s(&p, &gg, &bb, &cw, &nw, &mut *cs, &mut *st), &mut o)
            .unwrap();
        c.delta_rule_decode(s(&pc, &gc, &bc, &cwc, &nwc, &mut *csc, &mut *stc), &mut oc)
            .unwrap();
        close_scaled("decode out", &host(g, &o), &host(&c, &oc), 1e-4);
        close_scaled("decode state", &host(g, st), &host(&c, stc), 1e-4);
        close("decode conv state", &host(g, cs), &host(&c, csc), 0.0, 0.0);
    }
}

#[test]
fn attention_partials_match_the_cpu_for_every_kv_dtype() {
    let Some(g) = gpu("attention") else { return };
    let c = CpuBackend;
    for (dtype, hd) in [
        (KvDtype::F16, 256),
        (KvDtype::F32, 64),
        (KvDtype::Bf16, 256),
    ] {
        let (hq, hkv) = (6, 2);
        let (mut kv, mut kvc) = (
            g.kv_new(16, hkv, hd, dtype).unwrap(),
            c.kv_new(16, hkv, hd, dtype).unwrap(),
        );
        let mut pos0 = 0;
        for (call, t) in [(0u64, 37usize), (1, 1), (2, 20)] {
            let (k, kc) = both(&g, &rand_vec(t * hkv * hd, 100 + call, 1.0));
            let (v, vc) = both(&g, &rand_vec(t * hkv * hd, 110 + call, 1.0));
            g.kv_append(&mut kv, &k, &v, t).unwrap();
            c.kv_append(&mut kvc, &kc, &vc, t).unwrap();
            assert_eq!(kv.len, kvc.len);
            let (q, qc) = both(&g, &rand_vec(t * hq * hd, 120 + call, 1.0));
            let (mut o, mut oc, mut l, mut lc) = (
                g.zeros(0).unwrap(),
                c.zeros(0).unwrap(),
                g.zeros(0).unwrap(),
                c.zeros(0).unwrap(),
            );
            let scale = 1.0 / (hd as f32).sqrt();
            g.attend(&kv, &q, t, hq, pos0, scale, &mut o, &mut l)
                .unwrap();
            c.attend(&kvc, &qc, t, hq, pos0, scale, &mut oc, &mut lc)
                .unwrap();
            // bf16: the CPU rounds q and the softmax weights to bf16, the GPU does not
            let tol = if dtype == KvDtype::Bf16 { 2e-2 } else { 1e-4 };
            close_scaled(
                &format!("attend {dtype:?} o"),
                &host(g.as_ref(), &o),
                &host(&c, &oc),
                tol,
            );
            close_scaled(
                &format!("attend {dtype:?} lse"),
                &host(g.as_ref(), &l),
                &host(&c, &lc),
                tol,
            );
            pos0 += t;
        }
    }
}

/// A dense matrix `[n, k]` of random weights in `dtype`.
fn dense(n: usize, k: usize, dtype: WeightDtype, seed: u64) -> Linear {
    Linear::new(PackedMatrix::from_f32(
        n,
        k,
        &rand_vec(n * k, seed, 0.1),
        dtype,
    ))
}

#[test]
fn dense_products_and_embedding_match_the_cpu() {
    let Some(g) = gpu("dense products") else {
        return;
    };
    for (dt, n, k) in [
        (WeightDtype::Bf16, 1000, 512),
        (WeightDtype::F32, 300, 260),
        (WeightDtype::F16, 77, 96),
        (WeightDtype::Bf16, 33, 36),
    ] {
        check_products(
            &g,
            &dense(n, k, dt, n as u64),
            &format!("{dt:?} [{n}, {k}]"),
        );
    }
    // the fused MLP input
    let w = dense(2 * 384, 256, WeightDtype::Bf16, 5);
    let c = CpuBackend;
    let (wg, wc) = (g.upload_matrix(&w).unwrap(), c.upload_matrix(&w).unwrap());
    for rows in [1, 12] {
        let (x, xc) = both(&g, &rand_vec(rows * 256, 3, 1.0));
        let (mut gu, mut guc, mut a, mut ac) = (
            g.zeros(0).unwrap(),
            c.zeros(0).unwrap(),
            g.zeros(0).unwrap(),
            c.zeros(0).unwrap(),
        );
        g.matmul_swiglu(&x, rows, &wg, &mut gu, &mut a).unwrap();
        c.matmul_swiglu(&xc, rows, &wc, &mut guc, &mut ac).unwrap();
        let want = host(&c, &ac);
        close(
            "swiglu",
            &host(g.as_ref(), &a),
            &want,
            0.0,
            2e-2 * max_abs(&want),
        );
    }
    let tk = g
        .top_k(&g.upload(&[0.5, 2.0, 2.0, -1.0, 3.0, 0.0]).unwrap(), 2, 2)
        .unwrap();
    assert_eq!(tk, vec![vec![(1, 2.0), (2, 2.0)], vec![(1, 3.0), (2, 0.0)]]);
}
