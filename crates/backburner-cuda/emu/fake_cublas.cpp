// A stand-in libcublas.so for tests without a GPU: cublasGemmEx as backburner-cuda calls it (C = op(A)·op(B),
// column-major, bf16 or f32 inputs, f32 output and arithmetic), computed naively on host memory.
#include <cstring>

namespace {
float load(const void* p, int type, long i) {
    if (type == 0) return ((const float*)p)[i];
    unsigned short h = ((const unsigned short*)p)[i];  // CUDA_R_16BF
    unsigned u = (unsigned)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
}  // namespace

extern "C" {
int cublasCreate_v2(void** h) { *h = new int(0); return 0; }
int cublasDestroy_v2(void* h) { delete (int*)h; return 0; }
int cublasSetStream_v2(void*, void*) { return 0; }
int cublasGemmEx(void*, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda,
                 const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc, int, int) {
    if (ct != 0 || (at != 0 && at != 14) || (bt != 0 && bt != 14)) return 7;  // CUBLAS_STATUS_INVALID_VALUE
    const float a = *(const float*)alpha, b = *(const float*)beta;
    float* c = (float*)C;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int l = 0; l < k; l++) {
                const float x = load(A, at, ta ? (long)i * lda + l : (long)l * lda + i);
                const float y = load(B, bt, tb ? (long)l * ldb + j : (long)j * ldb + l);
                s += x * y;
            }
            c[(long)j * ldc + i] = a * s + (b == 0.0f ? 0.0f : b * c[(long)j * ldc + i]);
        }
    return 0;
}
}
