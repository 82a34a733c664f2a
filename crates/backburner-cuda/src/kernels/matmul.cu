// Products y = x·Wᵀ for few rows of x (decode: memory-bound GEMV, weights dequantized in registers) and the
// dequantization of weight rows (prefill tiles for cuBLAS, embedding rows). x [NR, k] f32, y [NR, ldy] f32 (columns
// 0..n of each row written). Device layouts (src/backend/matrix.rs): bf16 / f32 rows [n, k]; Q4_K GGUF blocks
// (144 B) [n, k/256]; Q6_K blocks without their d (208 B) [n, k/256] plus d (f16) [n, k/256]; Q8_0 quants (i8)
// [n, k] plus d (f16) [n, k/32].

#define GEMV_WARPS 8

__device__ __forceinline__ u32 byte_of(u32 w, int i) { return (w >> (8 * i)) & 0xffu; }

__device__ __forceinline__ void load8(const float* p, float* o) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

// Scale and min `j` of a Q4_K block's 12 scale bytes (ggml get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const u8* q, int j, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

template <int NR, int RPW>
__device__ __forceinline__ void gemv_store(float (*acc)[NR], float* y, int n, int ldy, int r0, int lane) {
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int nr = 0; nr < NR; nr++) {
            const float s = warp_sum(acc[r][nr]);
            if (lane == 0 && r0 + r < n) y[(u64)nr * ldy + r0 + r] = s;
        }
}

// Dense bf16 (BF16 = true) or f32 rows. One warp per RPW consecutive rows.
template <int NR, int RPW, bool BF16>
__device__ void gemv_dense(const void* W, const float* x, float* y, int n, int k, int ldy) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
    if (r0 >= n) return;
    float acc[RPW][NR];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int nr = 0; nr < NR; nr++) acc[r][nr] = 0.0f;
    if ((k & 7) == 0) {
        for (int e = lane * 8; e < k; e += 256) {
            float w[RPW][8];
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                const int row = min(r0 + r, n - 1);
                if (BF16) {
                    const uint4 v = *(const uint4*)((const u16*)W + (u64)row * k + e);
                    const u32 ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        w[r][2 * i] = bf16_to_f32((u16)(ws[i] & 0xffffu));
                        w[r][2 * i + 1] = bf16_to_f32((u16)(ws[i] >> 16));
                    }
                } else {
                    load8((const float*)W + (u64)row * k + e, w[r]);
                }
            }
#pragma unroll
            for (int nr = 0; nr < NR; nr++) {
                float xv[8];
                load8(x + (u64)nr * k + e, xv);
#pragma unroll
                for (int r = 0; r < RPW; r++)
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[r][nr] += w[r][i] * xv[i];
            }
        }
    } else {
        for (int e = lane; e < k; e += 32) {
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                const u64 at = (u64)min(r0 + r, n - 1) * k + e;
                const float wv = BF16 ? bf16_to_f32(((const u16*)W)[at]) : ((const float*)W)[at];
#pragma unroll
                for (int nr = 0; nr < NR; nr++) acc[r][nr] += wv * x[(u64)nr * k + e];
            }
        }
    }
    gemv_store<NR, RPW>(acc, y, n, ldy, r0, lane);
}

// Q4_K: 8 lanes per 256-element block, each 16 bytes of quants (32 elements: 16 low nibbles, 16 high).
template <int NR, int RPW>
__device__ void gemv_q4k(const u8* W, const float* x, float* y, int n, int k, int ldy) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
    if (r0 >= n) return;
    const int nb = k / 256, sub = lane & 7, j = sub >> 1, off = (sub & 1) * 16;
    float acc[RPW][NR];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int nr = 0; nr < NR; nr++) acc[r][nr] = 0.0f;
    for (int sb = lane >> 3; sb < nb; sb += 4) {
        uint4 qv[RPW];
        float d1[RPW], m1[RPW], d2[RPW], m2[RPW];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const u8* blk = W + ((u64)min(r0 + r, n - 1) * nb + sb) * 144;
            qv[r] = *(const uint4*)(blk + 16 + 16 * sub);
            const u32 hd = *(const u32*)blk;
            const float d = f16_to_f32((u16)(hd & 0xffffu)), dmin = f16_to_f32((u16)(hd >> 16));
            float s, m;
            scale_min_k4(blk + 4, 2 * j, &s, &m);
            d1[r] = d * s;
            m1[r] = dmin * m;
            scale_min_k4(blk + 4, 2 * j + 1, &s, &m);
            d2[r] = d * s;
            m2[r] = dmin * m;
        }
        const int e0 = sb * 256 + 64 * j + off;
#pragma unroll
        for (int nr = 0; nr < NR; nr++) {
            float xl[16], xh[16];
            const float* xp = x + (u64)nr * k + e0;
            load8(xp, xl);
            load8(xp + 8, xl + 8);
            load8(xp + 32, xh);
            load8(xp + 40, xh + 8);
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                const u32 ws[4] = {qv[r].x, qv[r].y, qv[r].z, qv[r].w};
                float sql = 0.0f, sxl = 0.0f, sqh = 0.0f, sxh = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const u32 b = byte_of(ws[i >> 2], i & 3);
                    sql += (float)(b & 0xFu) * xl[i];
                    sxl += xl[i];
                    sqh += (float)(b >> 4) * xh[i];
                    sxh += xh[i];
                }
                acc[r][nr] += d1[r] * sql - m1[r] * sxl + d2[r] * sqh - m2[r] * sxh;
            }
        }
    }
    gemv_store<NR, RPW>(acc, y, n, ldy, r0, lane);
}

// Q6_K (208-byte blocks, d apart): 8 lanes per block, each 8 positions l of one 128-half (32 elements).
template <int NR, int RPW>
__device__ void gemv_q6k(const u8* W, const u16* D, const float* x, float* y, int n, int k, int ldy) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
    if (r0 >= n) return;
    const int nb = k / 256, sub = lane & 7, hn = sub >> 2, l0 = (sub & 3) * 8, is = l0 / 16;
    float acc[RPW][NR];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int nr = 0; nr < NR; nr++) acc[r][nr] = 0.0f;
    for (int sb = lane >> 3; sb < nb; sb += 4) {
        uint2 qa[RPW], qb[RPW], qh[RPW];
        float dd[RPW], sc[RPW][4];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const u64 bi = (u64)min(r0 + r, n - 1) * nb + sb;
            const u8* blk = W + bi * 208;
            qa[r] = *(const uint2*)(blk + 64 * hn + l0);
            qb[r] = *(const uint2*)(blk + 64 * hn + 32 + l0);
            qh[r] = *(const uint2*)(blk + 128 + 32 * hn + l0);
            const signed char* s = (const signed char*)(blk + 192 + 8 * hn);
#pragma unroll
            for (int i = 0; i < 4; i++) sc[r][i] = (float)s[is + 2 * i];
            dd[r] = f16_to_f32(D[bi]);
        }
        const int e0 = sb * 256 + 128 * hn + l0;
#pragma unroll
        for (int nr = 0; nr < NR; nr++) {
            float xs[4][8];
#pragma unroll
            for (int p = 0; p < 4; p++) load8(x + (u64)nr * k + e0 + 32 * p, xs[p]);
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const u32 a = byte_of(i < 4 ? qa[r].x : qa[r].y, i & 3);
                    const u32 b = byte_of(i < 4 ? qb[r].x : qb[r].y, i & 3);
                    const u32 h = byte_of(i < 4 ? qh[r].x : qh[r].y, i & 3);
                    s[0] += (float)((int)((a & 0xFu) | ((h & 3u) << 4)) - 32) * xs[0][i];
                    s[1] += (float)((int)((b & 0xFu) | (((h >> 2) & 3u) << 4)) - 32) * xs[1][i];
                    s[2] += (float)((int)((a >> 4) | (((h >> 4) & 3u) << 4)) - 32) * xs[2][i];
                    s[3] += (float)((int)((b >> 4) | (((h >> 6) & 3u) << 4)) - 32) * xs[3][i];
                }
                acc[r][nr] += dd[r] * (sc[r][0] * s[0] + sc[r][1] * s[1] + sc[r][2] * s[2] + sc[r][3] * s[3]);
            }
        }
    }
    gemv_store<NR, RPW>(acc, y, n, ldy, r0, lane);
}

// Q8_0 (quants [n, k] i8, d [n, k/32] f16): 16 quants per lane per step.
template <int NR, int RPW>
__device__ void gemv_q8_0(const u8* Q, const u16* D, const float* x, float* y, int n, int k, int ldy) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
    if (r0 >= n) return;
    float acc[RPW][NR];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int nr = 0; nr < NR; nr++) acc[r][nr] = 0.0f;
    for (int e = lane * 16; e < k; e += 512) {
        uint4 qv[RPW];
        float dd[RPW];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const u64 row = (u64)min(r0 + r, n - 1);
            qv[r] = *(const uint4*)(Q + row * k + e);
            dd[r] = f16_to_f32(D[row * (k / 32) + e / 32]);
        }
#pragma unroll
        for (int nr = 0; nr < NR; nr++) {
            float xv[16];
            load8(x + (u64)nr * k + e, xv);
            load8(x + (u64)nr * k + e + 8, xv + 8);
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                const u32 ws[4] = {qv[r].x, qv[r].y, qv[r].z, qv[r].w};
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; i++) s += (float)(signed char)byte_of(ws[i >> 2], i & 3) * xv[i];
                acc[r][nr] += dd[r] * s;
            }
        }
    }
    gemv_store<NR, RPW>(acc, y, n, ldy, r0, lane);
}

// Every GEMV has the arguments (p1, p2, x, y, n, k, ldy): p1 the weights (quants), p2 the separate scales (Q6_K,
// Q8_0) or unused.
#define GEMV(NAME, NR, RPW, CALL)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME(const u8* p1, const u8* p2, const float* x, float* y,  \
                                                            int n, int k, int ldy) {                               \
        CALL;                                                                                                      \
    }
#define GEMV_ALL(NR, RPW)                                                                                          \
    GEMV(gemv_bf16_##NR, NR, RPW, (gemv_dense<NR, RPW, true>(p1, x, y, n, k, ldy)))                              \
    GEMV(gemv_f32_##NR, NR, RPW, (gemv_dense<NR, RPW, false>(p1, x, y, n, k, ldy)))                              \
    GEMV(gemv_q4k_##NR, NR, RPW, (gemv_q4k<NR, RPW>(p1, x, y, n, k, ldy)))                                       \
    GEMV(gemv_q6k_##NR, NR, RPW, (gemv_q6k<NR, RPW>(p1, (const u16*)p2, x, y, n, k, ldy)))                       \
    GEMV(gemv_q8_0_##NR, NR, RPW, (gemv_q8_0<NR, RPW>(p1, (const u16*)p2, x, y, n, k, ldy)))

// Rows per warp: 4 for one row of x (decode), 2 for 2–4 (registers).
GEMV_ALL(1, 4)
GEMV_ALL(2, 2)
GEMV_ALL(3, 2)
GEMV_ALL(4, 2)

// ---- dequantization: element e of weight row `row`, as the CPU's reference (format.rs dequantize) ----

__device__ __forceinline__ float deq_bf16(const u8* p1, const u8*, u64 row, int k, int e) {
    return bf16_to_f32(((const u16*)p1)[row * k + e]);
}

__device__ __forceinline__ float deq_f32(const u8* p1, const u8*, u64 row, int k, int e) {
    return ((const float*)p1)[row * k + e];
}

__device__ __forceinline__ float deq_q4k(const u8* p1, const u8*, u64 row, int k, int e) {
    const u8* blk = p1 + (row * (k / 256) + e / 256) * 144;
    const int w = e % 256, j = w / 64, hi = (w % 64) >= 32, l = w % 32;
    const u32 qb = blk[16 + 32 * j + l];
    const float q = (float)(hi ? qb >> 4 : qb & 0xFu);
    float sc, m;
    scale_min_k4(blk + 4, 2 * j + hi, &sc, &m);
    const float d = f16_to_f32(((const u16*)blk)[0]), dmin = f16_to_f32(((const u16*)blk)[1]);
    return (d * sc) * q - dmin * m;
}

__device__ __forceinline__ float deq_q6k(const u8* p1, const u8* p2, u64 row, int k, int e) {
    const u64 bi = row * (k / 256) + e / 256;
    const u8* blk = p1 + bi * 208;
    const int w = e % 256, hn = w / 128, quarter = (w % 128) / 32, l = w % 32, is = l / 16;
    const u32 qlb = blk[64 * hn + l + 32 * (quarter & 1)];
    const u32 ql = quarter >= 2 ? qlb >> 4 : qlb & 0xFu;
    const u32 qh = (blk[128 + 32 * hn + l] >> (2 * quarter)) & 3u;
    const int q = (int)(ql | (qh << 4)) - 32;
    const float sc = (float)((const signed char*)blk)[192 + 8 * hn + is + 2 * quarter];
    const float d = f16_to_f32(((const u16*)p2)[bi]);
    return d * sc * (float)q;
}

__device__ __forceinline__ float deq_q8_0(const u8* p1, const u8* p2, u64 row, int k, int e) {
    const float d = f16_to_f32(((const u16*)p2)[row * (k / 32) + e / 32]);
    return (float)((const signed char*)p1)[row * k + e] * d;
}

// out [n_rows, k]: row i is weight row rows[i] (rows non-null; a negative entry leaves row i as it is) or row0 + i.
// n = n_rows·k.
#define DEQ(FMT)                                                                                                   \
    extern "C" __global__ void deq_##FMT##_f32(const u8* p1, const u8* p2, const int* rows, int row0, int k,       \
                                               float* out, u64 n) {                                               \
        FOR_EACH(i, n) {                                                                                           \
            const u64 ri = i / k;                                                                                  \
            if (rows && rows[ri] < 0) continue;                                                                    \
            const u64 row = rows ? (u64)rows[ri] : (u64)row0 + ri;                                                 \
            out[i] = deq_##FMT(p1, p2, row, k, (int)(i % k));                                                      \
        }                                                                                                          \
    }                                                                                                              \
    extern "C" __global__ void deq_##FMT##_bf16(const u8* p1, const u8* p2, const int* rows, int row0, int k,      \
                                                u16* out, u64 n) {                                                 \
        FOR_EACH(i, n) {                                                                                           \
            const u64 ri = i / k;                                                                                  \
            if (rows && rows[ri] < 0) continue;                                                                    \
            const u64 row = rows ? (u64)rows[ri] : (u64)row0 + ri;                                                 \
            out[i] = f32_to_bf16(deq_##FMT(p1, p2, row, k, (int)(i % k)));                                         \
        }                                                                                                          \
    }

DEQ(bf16)
DEQ(f32)
DEQ(q4k)
DEQ(q6k)
DEQ(q8_0)
