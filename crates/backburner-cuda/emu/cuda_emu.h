// A CPU emulation of the CUDA features the kernels of src/kernels use, to run them without a GPU (emu/emu_test.cpp):
// every thread of a block is a std::thread; blocks run one after another, so `__shared__` (static) variables are the
// block's; __syncthreads and __syncwarp are barriers, shuffles exchange through per-warp slots between barriers.
// Threads that return early drop out of their barriers. Slow and for small shapes only.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define BB_EMU 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
struct float4 {
    float x, y, z, w;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

struct Block {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<double> slots;  // [threads]
};
inline Block* g_block = nullptr;

inline void __syncthreads() { g_block->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_block->warps[threadIdx.x / 32]->arrive_and_wait(); }

template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    const unsigned t = threadIdx.x, lane = t & 31, base = t - lane;
    g_block->slots[t] = (double)v;
    __syncwarp();
    const T r = (T)g_block->slots[base + (lane ^ o)];
    __syncwarp();
    return r;
}

inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
using std::isfinite;
using std::max;
using std::min;

// Runs `kernel` (a lambda calling the kernel with its arguments) on grid × block threads.
inline void launch(dim3 grid, unsigned block, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = dim3{block, 1, 1};
    for (unsigned by = 0; by < grid.y; by++)
        for (unsigned bx = 0; bx < grid.x; bx++) {
            Block b;
            b.all = std::make_unique<std::barrier<>>(block);
            for (unsigned w = 0; w < (block + 31) / 32; w++)
                b.warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, block - 32 * w)));
            b.slots.assign(block, 0.0);
            g_block = &b;
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < block; t++)
                ts.emplace_back([&, t, bx, by] {
                    threadIdx = dim3{t, 0, 0};
                    blockIdx = dim3{bx, by, 0};
                    kernel();
                    b.warps[t / 32]->arrive_and_drop();
                    b.all->arrive_and_drop();
                });
            for (auto& th : ts) th.join();
        }
}
