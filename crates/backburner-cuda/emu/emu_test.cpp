// Runs the CUDA kernels of src/kernels on the CPU (cuda_emu.h) against plain references: the index math, the warp
// reductions and the barriers of every kernel kind, without a GPU. Build and run: scripts/gpu/emulate.sh.
#include <math.h>

#include <cstdio>
#include <random>

#include "cuda_emu.h"
// clang-format off
#include "../src/kernels/common.cuh"
#include "../src/kernels/rowops.cu"
#include "../src/kernels/gdn.cu"
#include "../src/kernels/attention.cu"
#include "../src/kernels/matmul.cu"
// clang-format on

static std::mt19937 rng(7);
static int failures = 0;

static std::vector<float> rnd(size_t n, float s) {
    std::uniform_real_distribution<float> d(-s, s);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

static void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
    double scale = 0, err = 0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    for (size_t i = 0; i < want.size(); i++) err = std::max(err, std::fabs(got[i] - want[i]));
    const bool ok = err <= tol * std::max(scale, 1e-30);
    if (!ok) failures++;
    printf("%-34s %s  max err %.3e of scale %.3e\n", what, ok ? "ok  " : "FAIL", err, scale);
}

static u16 f2h(float f) {
    const _Float16 h = (_Float16)f;
    u16 b;
    memcpy(&b, &h, 2);
    return b;
}
static float h2f(const u8* p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}
static u16 f2bf(float f) { return f32_to_bf16(f); }

// ---- reference dequantization (format.rs) ----
static void ksm(const u8* q, int j, int* sc, int* m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}
static void ref_q4k(const u8* b, double* y) {
    const double d = h2f(b), dmin = h2f(b + 2);
    for (int j = 0; j < 4; j++) {
        int s1, m1, s2, m2;
        ksm(b + 4, 2 * j, &s1, &m1);
        ksm(b + 4, 2 * j + 1, &s2, &m2);
        for (int l = 0; l < 32; l++) {
            const u8 q = b[16 + 32 * j + l];
            y[64 * j + l] = d * s1 * (q & 0xF) - dmin * m1;
            y[64 * j + 32 + l] = d * s2 * (q >> 4) - dmin * m2;
        }
    }
}
static void ref_q6k(const u8* b, double* y) {
    const double d = h2f(b + 208);
    for (int n = 0; n < 2; n++) {
        const u8 *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        const signed char* sc = (const signed char*)(b + 192 + 8 * n);
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32, q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32, q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[128 * n + l] = d * sc[is] * q1;
            y[128 * n + l + 32] = d * sc[is + 2] * q2;
            y[128 * n + l + 64] = d * sc[is + 4] * q3;
            y[128 * n + l + 96] = d * sc[is + 6] * q4;
        }
    }
}
static void ref_q8_0(const u8* b, double* y) {
    const double d = h2f(b);
    for (int j = 0; j < 32; j++) y[j] = d * (signed char)b[2 + j];
}

// A random matrix [n, k] of `fmt` in the device layout (p1, p2) and its reference rows.
struct Mat {
    std::vector<u8> p1, p2;
    std::vector<double> ref;
};
static Mat make(const char* fmt, int n, int k) {
    Mat m;
    m.ref.resize((size_t)n * k);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> sc(0.005f, 0.05f);
    const bool q4 = !strcmp(fmt, "q4k"), q6 = !strcmp(fmt, "q6k"), q8 = !strcmp(fmt, "q8_0");
    if (!q4 && !q6 && !q8) {
        auto w = rnd((size_t)n * k, 0.1f);
        const bool bf = !strcmp(fmt, "bf16");
        m.p1.resize((size_t)n * k * (bf ? 2 : 4));
        for (size_t i = 0; i < w.size(); i++) {
            if (bf) {
                const u16 h = f2bf(w[i]);
                memcpy(&m.p1[2 * i], &h, 2);
                m.ref[i] = bf16_to_f32(h);
            } else {
                memcpy(&m.p1[4 * i], &w[i], 4);
                m.ref[i] = w[i];
            }
        }
        return m;
    }
    const int be = q8 ? 32 : 256, bb = q4 ? 144 : q6 ? 210 : 34, nb = k / be;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < nb; b++) {
            std::vector<u8> blk(bb);
            for (auto& x : blk) x = (u8)byte(rng);
            const u16 d = f2h(sc(rng)), dm = f2h(sc(rng));
            double* y = &m.ref[(size_t)r * k + (size_t)b * be];
            if (q4) {
                memcpy(&blk[0], &d, 2);
                memcpy(&blk[2], &dm, 2);
                ref_q4k(blk.data(), y);
                m.p1.insert(m.p1.end(), blk.begin(), blk.end());
            } else if (q6) {
                memcpy(&blk[208], &d, 2);
                ref_q6k(blk.data(), y);
                m.p1.insert(m.p1.end(), blk.begin(), blk.begin() + 208);
                m.p2.insert(m.p2.end(), blk.begin() + 208, blk.end());
            } else {
                memcpy(&blk[0], &d, 2);
                ref_q8_0(blk.data(), y);
                m.p1.insert(m.p1.end(), blk.begin() + 2, blk.end());
                m.p2.insert(m.p2.end(), blk.begin(), blk.begin() + 2);
            }
        }
    if (q8) {  // planes: quants [n, k] then scales [n, k/32], already in row order
    }
    return m;
}

typedef void (*Gemv)(const u8*, const u8*, const float*, float*, int, int, int);
typedef void (*Deq)(const u8*, const u8*, const int*, int, int, float*, u64);

static void test_products() {
    struct F {
        const char* name;
        Gemv g[4];
        Deq d;
        int k;
    } fs[] = {
        {"bf16", {gemv_bf16_1, gemv_bf16_2, gemv_bf16_3, gemv_bf16_4}, deq_bf16_f32, 520},
        {"bf16", {gemv_bf16_1, gemv_bf16_2, gemv_bf16_3, gemv_bf16_4}, deq_bf16_f32, 36},
        {"f32", {gemv_f32_1, gemv_f32_2, gemv_f32_3, gemv_f32_4}, deq_f32_f32, 264},
        {"f32", {gemv_f32_1, gemv_f32_2, gemv_f32_3, gemv_f32_4}, deq_f32_f32, 30},
        {"q4k", {gemv_q4k_1, gemv_q4k_2, gemv_q4k_3, gemv_q4k_4}, deq_q4k_f32, 512},
        {"q6k", {gemv_q6k_1, gemv_q6k_2, gemv_q6k_3, gemv_q6k_4}, deq_q6k_f32, 768},
        {"q8_0", {gemv_q8_0_1, gemv_q8_0_2, gemv_q8_0_3, gemv_q8_0_4}, deq_q8_0_f32, 544},
    };
    for (auto& f : fs) {
        const int n = 37, k = f.k, ldy = n + 3;
        Mat m = make(f.name, n, k);
        for (int nr = 1; nr <= 4; nr++) {
            auto x = rnd((size_t)nr * k, 1.0f);
            std::vector<float> y((size_t)nr * ldy, 0.0f);
            const int rpw = nr == 1 ? 4 : 2;
            launch(dim3{(unsigned)((n + 8 * rpw - 1) / (8 * rpw)), 1, 1}, 256,
                   [&] { f.g[nr - 1](m.p1.data(), m.p2.data(), x.data(), y.data(), n, k, ldy); });
            std::vector<float> got;
            std::vector<double> want;
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < n; c++) {
                    double s = 0;
                    for (int e = 0; e < k; e++) s += m.ref[(size_t)c * k + e] * x[(size_t)r * k + e];
                    want.push_back(s);
                    got.push_back(y[(size_t)r * ldy + c]);
                }
            char what[64];
            snprintf(what, sizeof what, "gemv %s k %d × %d rows", f.name, k, nr);
            check(what, got, want, 1e-5);
        }
        // dequantized rows by index (-1: left alone), as the embedding
        std::vector<int> rows = {3, -1, 36, 0};
        std::vector<float> out(rows.size() * k, 7.0f);
        launch(dim3{4, 1, 1}, 256, [&] { f.d(m.p1.data(), m.p2.data(), rows.data(), 0, k, out.data(), out.size()); });
        std::vector<double> want;
        for (int r : rows)
            for (int e = 0; e < k; e++) want.push_back(r < 0 ? 7.0 : m.ref[(size_t)r * k + e]);
        char what[64];
        snprintf(what, sizeof what, "deq %s k %d rows", f.name, k);
        check(what, out, want, 0.0);
    }
}

static void test_rows() {
    const int rows = 5, dim = 300;
    auto x = rnd(rows * dim, 3.0f), g = rnd(dim, 1.0f);
    std::vector<float> out(x.size());
    launch(dim3{rows, 1, 1}, 256, [&] { rms_norm(x.data(), g.data(), out.data(), dim, 1e-6f); });
    std::vector<double> want;
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
        const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
        for (int i = 0; i < dim; i++) want.push_back(x[r * dim + i] * inv * g[i]);
    }
    check("rms_norm", out, want, 1e-6);
    const int n2 = 7, d2 = 128;
    auto y = rnd(n2 * d2, 2.0f);
    auto y0 = y;
    launch(dim3{(n2 + 3) / 4, 1, 1}, 128, [&] { l2_norm_scaled(y.data(), n2, d2, 0.5f); });
    want.clear();
    for (int r = 0; r < n2; r++) {
        double ss = 0;
        for (int i = 0; i < d2; i++) ss += (double)y0[r * d2 + i] * y0[r * d2 + i];
        for (int i = 0; i < d2; i++) want.push_back(y0[r * d2 + i] / std::sqrt(ss + 1e-6) * 0.5);
    }
    check("l2_norm_scaled", y, want, 1e-6);
}

static void test_attention() {
    for (int hd : {64, 256}) {
        const int hq = 6, hkv = 2, t = 3, pos0 = 5, len = pos0 + t;
        auto k = rnd((size_t)len * hkv * hd, 1.0f), v = rnd((size_t)len * hkv * hd, 1.0f), q = rnd((size_t)t * hq * hd, 1.0f);
        std::vector<u16> kc(k.size()), vc(v.size());
        // store through the kernel (f16), in two appends
        const u64 first = (u64)pos0 * hkv * hd;
        launch(dim3{4, 1, 1}, 256, [&] { kv_store_f16(k.data(), v.data(), kc.data(), vc.data(), 0, first); });
        launch(dim3{4, 1, 1}, 256, [&] { kv_store_f16(k.data() + first, v.data() + first, kc.data(), vc.data(), first, k.size() - first); });
        std::vector<float> o((size_t)t * hq * hd), lse((size_t)t * hq);
        const float scale = 1.0f / std::sqrt((float)hd);
        launch(dim3{hq, t, 1}, 128, [&] { attend_f16(q.data(), kc.data(), vc.data(), o.data(), lse.data(), hq, hkv, hd, pos0, 0, len, scale); });
        std::vector<double> wo, wl;
        for (int tt = 0; tt < t; tt++)
            for (int h = 0; h < hq; h++) {
                const int kvh = h / (hq / hkv), nk = pos0 + tt + 1;
                std::vector<double> s(nk);
                double m = -1e300;
                for (int j = 0; j < nk; j++) {
                    double dot = 0;
                    for (int d = 0; d < hd; d++)
                        dot += (double)q[((size_t)tt * hq + h) * hd + d] * f16_to_f32(kc[((size_t)j * hkv + kvh) * hd + d]);
                    s[j] = dot * scale;
                    m = std::max(m, s[j]);
                }
                double l = 0;
                for (double x : s) l += std::exp(x - m);
                for (int d = 0; d < hd; d++) {
                    double acc = 0;
                    for (int j = 0; j < nk; j++) acc += std::exp(s[j] - m) / l * f16_to_f32(vc[((size_t)j * hkv + kvh) * hd + d]);
                    wo.push_back(acc);
                }
                wl.push_back(m + std::log(l));
            }
        check(hd == 64 ? "attend f16 hd 64 o" : "attend f16 hd 256 o", o, wo, 1e-5);
        check(hd == 64 ? "attend f16 hd 64 lse" : "attend f16 hd 256 lse", lse, wl, 1e-5);
    }
}

static void test_gdn() {
    for (int tiled : {0, 1}) {
        const int t = 5, hk = 2, hv = 4, dk = 16, dv = 40, qk = hk * dk, vd = hv * dv;
        auto q = rnd(t * qk, 0.3f), k = rnd(t * qk, 0.3f), v = rnd(t * vd, 1.0f), g = rnd(t * hv, 0.3f), beta = rnd(t * hv, 0.4f);
        for (auto& x : g) x = -std::fabs(x);
        for (auto& x : beta) x += 0.5f;
        auto st = rnd((size_t)hv * dk * dv, 0.2f);
        std::vector<double> s(st.begin(), st.end());
        std::vector<float> o((size_t)t * vd);
        launch(dim3{(dv + 15) / 16, hv, 1}, 32, [&] {
            delta_rule(q.data(), k.data(), v.data(), qk, vd, g.data(), beta.data(), st.data(), o.data(), t, hk, hv, dk, dv, tiled);
        });
        std::vector<double> wo((size_t)t * vd);
        for (int j = 0; j < hv; j++) {
            const int kh = tiled ? j % hk : j / (hv / hk);
            double* S = &s[(size_t)j * dk * dv];
            for (int tt = 0; tt < t; tt++) {
                const double dec = std::exp(g[tt * hv + j]), b = beta[tt * hv + j];
                const float *kt = &k[tt * qk + kh * dk], *qt = &q[tt * qk + kh * dk];
                for (int c = 0; c < dv; c++) {
                    double u = 0;
                    for (int i = 0; i < dk; i++) u += (S[i * dv + c] *= dec) * kt[i];
                    const double delta = b * (v[tt * vd + j * dv + c] - u);
                    double oc = 0;
                    for (int i = 0; i < dk; i++) oc += (S[i * dv + c] += kt[i] * delta) * qt[i];
                    wo[(size_t)tt * vd + j * dv + c] = oc;
                }
            }
        }
        check(tiled ? "delta_rule tiled out" : "delta_rule grouped out", o, wo, 1e-5);
        check(tiled ? "delta_rule tiled state" : "delta_rule grouped state", st, s, 1e-5);
    }
    // conv: two calls continue the state
    const int cd = 70, kern = 4, h = kern - 1;
    auto w = rnd(cd * kern, 0.5f);
    std::vector<float> state(cd * h, 0.0f);
    std::vector<double> hist(cd * h, 0.0);  // reference state, [c][s]
    for (int call = 0; call < 2; call++) {
        const int t = call == 0 ? 6 : 2;
        auto x = rnd(t * cd, 2.0f);
        std::vector<float> out(t * cd);
        launch(dim3{2, 1, 1}, 256, [&] { conv_out(x.data(), cd, w.data(), state.data(), out.data(), cd, kern, (u64)t * cd); });
        launch(dim3{1, 1, 1}, 256, [&] { conv_state(x.data(), cd, state.data(), t, cd, kern); });
        std::vector<double> want, ws;
        for (int tt = 0; tt < t; tt++)
            for (int c = 0; c < cd; c++) {
                double acc = 0;
                for (int j = 0; j < kern; j++) {
                    const int e = tt + j;
                    acc += w[c * kern + j] * (e < h ? hist[c * h + e] : x[(e - h) * cd + c]);
                }
                want.push_back(acc / (1 + std::exp(-acc)));
            }
        for (int c = 0; c < cd; c++) {
            std::vector<double> xe;
            for (int s2 = 0; s2 < h; s2++) xe.push_back(hist[c * h + s2]);
            for (int tt = 0; tt < t; tt++) xe.push_back(x[tt * cd + c]);
            for (int s2 = 0; s2 < h; s2++) hist[c * h + s2] = xe[t + s2];
        }
        check("conv out", out, want, 1e-6);
        check("conv state", state, hist, 0.0);
    }
}

int main() {
    test_rows();
    test_products();
    test_attention();
    test_gdn();
    printf(failures ? "%d FAILED\n" : "all ok\n", failures);
    return failures ? 1 : 0;
}
