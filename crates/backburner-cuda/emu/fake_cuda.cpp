// A stand-in libcuda.so for tests without a GPU: the driver API calls backburner-cuda makes (through cudarc), with
// host memory as device memory, every operation done at once (streams are in order by construction) and kernels run
// on the CPU emulation of cuda_emu.h, looked up by name (the PTX handed to cuModuleLoadData is ignored). Build and
// use: scripts/gpu/emulate.sh.
#include <math.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cuda_emu.h"
// clang-format off
#include "../src/kernels/common.cuh"
#include "../src/kernels/rowops.cu"
#include "../src/kernels/gdn.cu"
#include "../src/kernels/attention.cu"
#include "../src/kernels/matmul.cu"
// clang-format on

namespace {
using Runner = std::function<void(void**)>;

template <typename... A, size_t... I> void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<A*>(p[I])...);
}
template <typename... A> Runner wrap(void (*f)(A...)) {
    return [f](void** p) { call(f, p, std::index_sequence_for<A...>{}); };
}

std::map<std::string, Runner>& kernels() {
    static std::map<std::string, Runner> k = [] {
        std::map<std::string, Runner> m;
#define K(name) m[#name] = wrap(name)
        K(rms_norm); K(gated_rms_norm); K(l2_norm_scaled); K(sigmoid_mul); K(add_assign); K(silu_mul_halves);
        K(take_cols); K(rope); K(gdn_gates); K(f32_to_bf16_rows); K(conv_out); K(conv_state); K(delta_rule);
        K(kv_store_f32); K(kv_store_f16); K(kv_store_bf16); K(attend_f32); K(attend_f16); K(attend_bf16);
#define G(f) K(gemv_##f##_1); K(gemv_##f##_2); K(gemv_##f##_3); K(gemv_##f##_4); K(deq_##f##_f32); K(deq_##f##_bf16)
        G(bf16); G(f32); G(q4k); G(q6k); G(q8_0);
        return m;
    }();
    return k;
}

std::mutex launch_lock;
thread_local void* current = nullptr;
int primary = 1;  // the one context's address
}  // namespace

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
extern "C" {
CUresult cuInit(unsigned) { return 0; }
// NVRTC opens libcuda.so.1 itself and asks for the driver's private export tables; a real driver answers, the
// stand-in says it has none (NVRTC then compiles without them). Missing, NVRTC would call a null pointer.
CUresult cuGetExportTable(const void** table, const void*) { *table = nullptr; return 801; }  // NOT_SUPPORTED
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGet(int* d, int i) { if (i != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char* s, int len, int) { snprintf(s, len, "CPU emulation of a CUDA device"); return 0; }
CUresult cuDeviceTotalMem_v2(size_t* b, int) { *b = (size_t)8 << 30; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
    *v = attr == 75 ? 9 : attr == 76 ? 0 : 1;  // compute capability 9.0; everything else supported
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** c, int) { *c = &primary; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(void* c) { current = c; return 0; }
CUresult cuCtxSynchronize() { return 0; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { *f = (size_t)7 << 30; *t = (size_t)8 << 30; return 0; }
CUresult cuStreamCreate(void** s, unsigned) { *s = new int(0); return 0; }
CUresult cuStreamDestroy_v2(void* s) { delete (int*)s; return 0; }
CUresult cuStreamSynchronize(void*) { return 0; }
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t b, void*) {
    void* m = aligned_alloc(256, (b + 255) / 256 * 256);
    memset(m, 0xA5, (b + 255) / 256 * 256);  // uninitialized memory is garbage, not zeros
    *p = (CUdeviceptr)m;
    return m ? 0 : 2;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { free((void*)p); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t b, void*) { memcpy((void*)d, s, b); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t b, void*) { memcpy(d, (void*)s, b); return 0; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t b, void*) { memmove((void*)d, (void*)s, b); return 0; }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void*) { memset((void*)d, v, n); return 0; }
CUresult cuModuleLoadData(void** m, const void*) { *m = new int(0); return 0; }
CUresult cuModuleUnload(void* m) { delete (int*)m; return 0; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    auto it = kernels().find(name);
    if (it == kernels().end()) return 500;
    *f = &it->second;
    return 0;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void*, void** params, void**) {
    if (gz != 1 || by != 1 || bz != 1 || smem != 0 || bx == 0 || bx > 1024) return 1;
    std::lock_guard<std::mutex> g(launch_lock);
    auto* r = (Runner*)f;
    launch(dim3{gx, gy, 1}, bx, [&] { (*r)(params); });
    return 0;
}
CUresult cuGetErrorString(CUresult, const char** s) { *s = "emulated error"; return 0; }
CUresult cuGetErrorName(CUresult, const char** s) { *s = "CUDA_ERROR_EMULATED"; return 0; }
}
