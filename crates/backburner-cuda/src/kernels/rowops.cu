// Row-wise and element-wise ops (backburner_kernels::rowops semantics). f32 activations, row-major.

// 1 / rms of a row from its f64 sum of squares (as rowops::inv_rms: the f32 form unless the f32 sum overflows).
__device__ __forceinline__ float inv_rms(double ss, int dim, float eps) {
    const float s = (float)ss;
    if (isfinite(s)) return 1.0f / sqrtf(s / (float)dim + eps);
    return (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
}

// out = x·rsqrt(mean(x²) + eps)·g per row of `dim`; one block per row; `out` may be `x`.
extern "C" __global__ void rms_norm(const float* x, const float* g, float* out, int dim, float eps) {
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const double v = xr[i];
        ss += v * v;
    }
    const float r = inv_rms(block_sum_d(ss), dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = (xr[i] * r) * g[i];
}

// o = w·(o·rsqrt(mean(o²) + eps))·silu(z) per row of `dim`; one block per row.
extern "C" __global__ void gated_rms_norm(float* o, const float* z, const float* w, int dim, float eps) {
    float* orow = o + (u64)blockIdx.x * dim;
    const float* zr = z + (u64)blockIdx.x * dim;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const double v = orow[i];
        ss += v * v;
    }
    const float r = inv_rms(block_sum_d(ss), dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = (w[i] * (orow[i] * r)) * silu_f(zr[i]);
}

// x = x·rsqrt(Σx² + 1e-6)·scale per row of `dim`; one warp per row, 4 rows per block of 128.
extern "C" __global__ void l2_norm_scaled(float* x, int n_rows, int dim, float scale) {
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    float* xr = x + (u64)row * dim;
    float ss = 0.0f;
    double ssd = 0.0;
    for (int i = lane; i < dim; i += 32) {
        ss += xr[i] * xr[i];
        ssd += (double)xr[i] * (double)xr[i];
    }
    ss = warp_sum(ss);
    ssd = warp_sum_d(ssd);
    const float r = isfinite(ss) ? 1.0f / sqrtf(ss + 1e-6f) : (float)(1.0 / sqrt(ssd + 1e-6));
    for (int i = lane; i < dim; i += 32) xr[i] = xr[i] * r * scale;
}

extern "C" __global__ void sigmoid_mul(float* o, const float* g, u64 n) {
    FOR_EACH(i, n) o[i] *= sigmoid_f(g[i]);
}

extern "C" __global__ void add_assign(float* x, const float* y, u64 n) {
    FOR_EACH(i, n) x[i] += y[i];
}

// act[r, c] = silu(gu[r, c])·gu[r, inter + c]; act [rows, inter], gu [rows, 2·inter].
extern "C" __global__ void silu_mul_halves(const float* gu, float* act, int inter, u64 n) {
    FOR_EACH(i, n) {
        const u64 r = i / inter, c = i % inter;
        const float* row = gu + r * 2 * inter;
        act[i] = silu_f(row[c]) * row[inter + c];
    }
}

// dst[r, c] = src[r, col0 + c]; dst [rows, n_cols], src [rows, width].
extern "C" __global__ void take_cols(const float* src, float* dst, int width, int col0, int n_cols, u64 n) {
    FOR_EACH(i, n) {
        const u64 r = i / n_cols, c = i % n_cols;
        dst[i] = src[r * width + col0 + c];
    }
}

// Partial NeoX RoPE in place: x [n_tokens, n_heads, head_dim]; pairs (j, j + half) for j < half.
extern "C" __global__ void rope(float* x, const float* inv_freq, int n_heads, int head_dim, int half, int pos0, u64 n) {
    FOR_EACH(i, n) {
        const u64 j = i % half, th = i / half;
        const u64 t = th / n_heads;
        float* hp = x + th * head_dim;
        const float ang = (float)(pos0 + (int)t) * inv_freq[j];
        const float c = cosf(ang), s = sinf(ang);
        const float a = hp[j], b = hp[j + half];
        hp[j] = a * c - b * s;
        hp[j + half] = b * c + a * s;
    }
}

// beta = σ(b), g = neg_a·softplus(a + dt_bias) (torch: linear above 20) from proj's [b | a] columns at col0.
extern "C" __global__ void gdn_gates(const float* proj, int width, int col0, const float* neg_a, const float* dt_bias,
                                     float* beta, float* g, int hv, u64 n) {
    FOR_EACH(i, n) {
        const u64 t = i / hv, j = i % hv;
        const float* row = proj + t * width + col0;
        beta[i] = sigmoid_f(row[j]);
        const float a = row[hv + j] + dt_bias[j];
        const float sp = a > 20.0f ? a : log1pf(expf(a));
        g[i] = neg_a[j] * sp;
    }
}

// out[i] = bf16(x[i]) (round to nearest even).
extern "C" __global__ void f32_to_bf16_rows(const float* x, u16* out, u64 n) {
    FOR_EACH(i, n) out[i] = f32_to_bf16(x[i]);
}
