// The Gated DeltaNet's causal conv and delta rule (backburner_kernels::gdn semantics).

#define MAX_CONV_KERNEL 16
#define MAX_DK 128

// out[t, c] = silu(Σ_j w[c, j]·xe[t + j, c]) with xe = the state's kernel − 1 rows (oldest first) then x's rows
// (x row t at x + t·x_stride). Thread per (t, c).
extern "C" __global__ void conv_out(const float* x, int x_stride, const float* w, const float* state, float* out,
                                    int conv_dim, int kernel, u64 n) {
    const int h = kernel - 1;
    FOR_EACH(i, n) {
        const u64 t = i / conv_dim;
        const int c = (int)(i % conv_dim);
        float acc = 0.0f;
        for (int j = 0; j < kernel; j++) {
            const u64 e = t + j;
            const float xv = e < (u64)h ? state[(u64)c * h + e] : x[(e - h) * x_stride + c];
            acc += w[(u64)c * kernel + j] * xv;
        }
        out[i] = silu_f(acc);
    }
}

// The conv state after n_tokens: rows n_tokens .. n_tokens + kernel − 1 of xe. Thread per channel; run after
// conv_out (which reads the old state).
extern "C" __global__ void conv_state(const float* x, int x_stride, float* state, int n_tokens, int conv_dim,
                                      int kernel) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= conv_dim) return;
    const int h = kernel - 1;
    float tmp[MAX_CONV_KERNEL];
    for (int s = 0; s < h; s++) {
        const int e = n_tokens + s;
        tmp[s] = e < h ? state[(u64)c * h + e] : x[(u64)(e - h) * x_stride + c];
    }
    for (int s = 0; s < h; s++) state[(u64)c * h + s] = tmp[s];
}

// The gated delta rule token by token (the recurrent form; equal in exact arithmetic to the chunked one):
//   S ← exp(g)·S;  u = Sᵀk;  δ = β·(v − u);  S ← S + k ⊗ δ;  o = Sᵀq
// Per v head j (grid.y) and value column c (grid.x·16 + lane % 16), the state column S[:, c] lives in the registers
// of two lanes, lane / 16 holding rows (lane / 16)·MAX_DK/2 onwards (64 registers each, none spilled); the two
// halves of u and o meet by one shuffle. q, k rows of token t at q + t·qk_stride (head kh at kh·dk); v at
// v + t·v_stride; g, beta [T, hv]; state [hv, dk, dv]; o [T, hv·dv]. One warp per block. dk ≤ MAX_DK.
extern "C" __global__ void delta_rule(const float* q, const float* k, const float* v, int qk_stride, int v_stride,
                                      const float* g, const float* beta, float* state, float* o, int n_tokens,
                                      int hk, int hv, int dk, int dv, int tiled) {
    __shared__ float ks[MAX_DK];
    __shared__ float qs[MAX_DK];
    const int j = blockIdx.y, c = blockIdx.x * 16 + (threadIdx.x & 15), i0 = (threadIdx.x >> 4) * (MAX_DK / 2);
    const int kh = tiled ? j % hk : j / (hv / hk);
    const bool act = c < dv;
    float* S = state + (u64)j * dk * dv;
    float s[MAX_DK / 2];
#pragma unroll
    for (int i = 0; i < MAX_DK / 2; i++) s[i] = (act && i0 + i < dk) ? S[(u64)(i0 + i) * dv + c] : 0.0f;
    for (int t = 0; t < n_tokens; t++) {
        __syncwarp();
        for (int i = threadIdx.x; i < dk; i += 32) {
            ks[i] = k[(u64)t * qk_stride + (u64)kh * dk + i];
            qs[i] = q[(u64)t * qk_stride + (u64)kh * dk + i];
        }
        __syncwarp();
        const float decay = expf(g[(u64)t * hv + j]), b = beta[(u64)t * hv + j];
        float u = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DK / 2; i++) {
            if (i0 + i < dk) {
                s[i] *= decay;
                u += s[i] * ks[i0 + i];
            }
        }
        u += __shfl_xor_sync(FULL_MASK, u, 16);
        const float vc = act ? v[(u64)t * v_stride + (u64)j * dv + c] : 0.0f;
        const float delta = b * (vc - u);
        float oc = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DK / 2; i++) {
            if (i0 + i < dk) {
                s[i] += ks[i0 + i] * delta;
                oc += s[i] * qs[i0 + i];
            }
        }
        oc += __shfl_xor_sync(FULL_MASK, oc, 16);
        if (act && i0 == 0) o[(u64)t * hv * dv + (u64)j * dv + c] = oc;
    }
    if (act) {
#pragma unroll
        for (int i = 0; i < MAX_DK / 2; i++)
            if (i0 + i < dk) S[(u64)(i0 + i) * dv + c] = s[i];
    }
}
