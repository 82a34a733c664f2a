#!/usr/bin/env bash
# Runs backburner-cuda without a GPU, on the CPU emulation of crates/backburner-cuda/emu (each CUDA thread a
# std::thread; barriers and warp shuffles emulated). Needs g++ ≥ 11 (C++20).
#   scripts/gpu/emulate.sh            the kernels against plain references (emu/emu_test.cpp; seconds)
#   scripts/gpu/emulate.sh NVRTC_DIR  also the whole crate: stand-in libcuda.so / libcublas.so (emu/fake_*.cpp: host
#                                     memory as device memory, kernels by name) under the test binaries of
#                                     scripts/gpu/build.sh, with the real NVRTC of NVRTC_DIR (scripts/get_nvrtc.sh):
#                                     no_gpu and gpu_ops (about a minute), gpu_model with EMU_MODEL=1 (about 10).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
emu="$root/crates/backburner-cuda/emu"
out=${TMPDIR:-/tmp}/backburner-cuda-emu
mkdir -p "$out"
g++ -std=c++20 -O1 -pthread -w "$emu/emu_test.cpp" -o "$out/emu_test"
"$out/emu_test"
[ $# -ge 1 ] || exit 0
g++ -std=c++20 -O2 -shared -fPIC -pthread -w "$emu/fake_cuda.cpp" -o "$out/libcuda.so"
g++ -O2 -shared -fPIC -w "$emu/fake_cublas.cpp" -o "$out/libcublas.so"
cd "$root"
[ -x target/gpu-carry/gpu_ops ] || scripts/gpu/build.sh >/dev/null
tests="no_gpu gpu_ops"
[ "${EMU_MODEL:-0}" = 1 ] && tests="$tests gpu_model"
for t in $tests; do
    LD_LIBRARY_PATH="$out" BACKBURNER_CUDA_LIB_DIRS="$1" target/gpu-carry/$t --test-threads=1 2>&1 | grep -E "^test |test result"
done
