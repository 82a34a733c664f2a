// Shared helpers of every kernel source (prepended to each; no CUDA headers are needed, so NVRTC compiles them
// without a toolkit's include directory).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF (__int_as_float(0xff800000))

#ifdef BB_EMU
// The CPU emulation of emu/ (scripts/gpu/emulate.sh): the same conversions without PTX.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    const _Float16 h = (_Float16)f;
    u16 b;
    memcpy(&b, &h, 2);
    return b;
}
#else
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ __forceinline__ double block_sum_d(double v) {
    __shared__ double sh[32];
    v = warp_sum_d(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < nw ? sh[l] : 0.0;
    return warp_sum_d(v);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// Grid-stride loop over `n` elements with 64-bit indices.
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)gridDim.x * blockDim.x)
