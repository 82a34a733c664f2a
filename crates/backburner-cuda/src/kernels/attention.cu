// The KV cache's rows and causal attention as a normalized partial and its LSE
// (backburner_kernels::attention::Partial). Cache rows [positions, n_kv, head_dim] in f32 (DT 0), f16 (1) or
// bf16 (2); every product and the softmax in f32.

#define MAX_HEAD_DIM 512
#define ATT_WARPS 4

template <int DT> __device__ __forceinline__ float kv_ld(const void* p, u64 i) {
    if (DT == 0) return ((const float*)p)[i];
    if (DT == 1) return f16_to_f32(((const u16*)p)[i]);
    return bf16_to_f32(((const u16*)p)[i]);
}

template <int DT> __device__ __forceinline__ void kv_st(void* p, u64 i, float v) {
    if (DT == 0) ((float*)p)[i] = v;
    else if (DT == 1) ((u16*)p)[i] = f32_to_f16(v);
    else ((u16*)p)[i] = f32_to_bf16(v);
}

// Writes n elements of k and v (f32) at element offset `at` of the caches.
template <int DT> __device__ void kv_store(const float* k, const float* v, void* kc, void* vc, u64 at, u64 n) {
    FOR_EACH(i, n) {
        kv_st<DT>(kc, at + i, k[i]);
        kv_st<DT>(vc, at + i, v[i]);
    }
}

// One block of ATT_WARPS warps per (head h = blockIdx.x, token t = blockIdx.y). Token t sees the cache's positions
// kv_start ..= pos0 + t (at most kv_len; those below kv_start are held elsewhere: KV offload). GQA: head h reads kv head h / (n_heads / n_kv). Each warp runs an online softmax
// over every ATT_WARPS-th key; the warps' states merge at the end.
template <int DT>
__device__ void attend(const float* q, const void* kc, const void* vc, float* o, float* lse, int n_heads, int n_kv,
                       int head_dim, int pos0, int kv_start, int kv_len, float scale) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][MAX_HEAD_DIM];
    const int h = blockIdx.x, t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (n_heads / n_kv);
    const u64 qoff = ((u64)t * n_heads + h) * head_dim;
    float qv[MAX_HEAD_DIM / 32], acc[MAX_HEAD_DIM / 32];
#pragma unroll
    for (int i = 0; i < MAX_HEAD_DIM / 32; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? q[qoff + d] : 0.0f;
        acc[i] = 0.0f;
    }
    const int n_keys = min(pos0 + t + 1, kv_len);
    float m = NEG_INF, l = 0.0f;
    for (int j = kv_start + warp; j < n_keys; j += ATT_WARPS) {
        const u64 base = ((u64)j * n_kv + kvh) * head_dim;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_HEAD_DIM / 32; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) dot += qv[i] * kv_ld<DT>(kc, base + d);
        }
        const float s = warp_sum(dot) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < MAX_HEAD_DIM / 32; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * corr + p * kv_ld<DT>(vc, base + d);
        }
        m = mn;
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_HEAD_DIM / 32; i++) {
        const int d = lane + 32 * i;
        if (d < head_dim) sacc[warp][d] = acc[i];
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) mx = fmaxf(mx, sm[w]);
    float wt[ATT_WARPS], tot = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = sm[w] == NEG_INF ? 0.0f : expf(sm[w] - mx);
        tot += sl[w] * wt[w];
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) v += sacc[w][d] * wt[w];
        o[qoff + d] = tot > 0.0f ? v / tot : 0.0f;
    }
    if (threadIdx.x == 0) lse[(u64)t * n_heads + h] = tot > 0.0f ? mx + logf(tot) : NEG_INF;
}

#define KV_KERNELS(SUF, DT)                                                                                        \
    extern "C" __global__ void kv_store_##SUF(const float* k, const float* v, void* kc, void* vc, u64 at, u64 n) { \
        kv_store<DT>(k, v, kc, vc, at, n);                                                                         \
    }                                                                                                              \
    extern "C" __global__ void attend_##SUF(const float* q, const void* kc, const void* vc, float* o, float* lse,   \
                                            int n_heads, int n_kv, int head_dim, int pos0, int kv_start,           \
                                            int kv_len, float scale) {                                             \
        attend<DT>(q, kc, vc, o, lse, n_heads, n_kv, head_dim, pos0, kv_start, kv_len, scale);                     \
    }

KV_KERNELS(f32, 0)
KV_KERNELS(f16, 1)
KV_KERNELS(bf16, 2)
