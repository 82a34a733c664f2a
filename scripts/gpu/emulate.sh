#!/usr/bin/env bash
# Runs backburner-cuda without a GPU, on the CPU emulation of crates/backburner-cuda/emu (each CUDA thread a
# std::thread; barriers and warp shuffles emulated). Needs g++ ≥ 11 (C++20).
#   scripts/gpu/emulate.sh            the kernels against plain references (emu/emu_test.cpp; seconds)
#   scripts/gpu/emulate.sh NVRTC_DIR  also the whole crate: stand-in libcuda.so.1 / libcublas.so.13 (emu/fake_*.cpp:
#                                     host memory as device memory, kernels by name) under the test binaries of
#                                     scripts/gpu/build.sh, with the real NVRTC of NVRTC_DIR (scripts/get_nvrtc.sh):
#                                     no_gpu and gpu_ops (about a minute), gpu_model with EMU_MODEL=1 (about 10).
#                                     EMU_TESTS="path/to/test-binary …" runs those binaries instead of build.sh's.
#                                     EMU_CLI=path/to/backburner (a `--features cuda` build) also runs the CLI on
#                                     fixtures (EMU_CLI_MODELS, default two; about 25 s each) with --device cuda:0
#                                     and checks its text equals --device cpu's.
# The stand-in libraries carry the real ones' file names and sonames: NVRTC opens libcuda.so.1 itself (and asks it
# for cuGetExportTable), so the emulation goes through what a real driver install offers.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
emu="$root/crates/backburner-cuda/emu"
out=${TMPDIR:-/tmp}/backburner-cuda-emu
mkdir -p "$out"
g++ -std=c++20 -O1 -pthread -w "$emu/emu_test.cpp" -o "$out/emu_test"
"$out/emu_test"
[ $# -ge 1 ] || exit 0
rm -f "$out"/libcuda.so* "$out"/libcublas.so*
g++ -std=c++20 -O2 -shared -fPIC -pthread -w -Wl,-soname,libcuda.so.1 "$emu/fake_cuda.cpp" -o "$out/libcuda.so.1"
g++ -O2 -shared -fPIC -w -Wl,-soname,libcublas.so.13 "$emu/fake_cublas.cpp" -o "$out/libcublas.so.13"
ln -s libcuda.so.1 "$out/libcuda.so"
ln -s libcublas.so.13 "$out/libcublas.so"
cd "$root"
if [ -n "${EMU_TESTS:-}" ]; then
    bins=$EMU_TESTS
else
    [ -x target/gpu-bin/gpu_ops ] || scripts/gpu/build.sh >/dev/null
    bins="target/gpu-bin/no_gpu target/gpu-bin/gpu_ops"
    [ "${EMU_MODEL:-0}" = 1 ] && bins="$bins target/gpu-bin/gpu_model target/gpu-bin/gpu_offload"
fi
for t in $bins; do
    echo "== $(basename "$t") on the emulation"
    rc=0
    LD_LIBRARY_PATH="$out" BACKBURNER_CUDA_LIB_DIRS="$1" "$t" --test-threads=1 >"$out/test.log" 2>&1 || rc=$?
    grep -E "^test |test result|panicked" "$out/test.log" || true
    [ "$rc" = 0 ] || { echo "$t failed on the emulation (rc $rc)" >&2; tail -n 20 "$out/test.log" >&2; exit 1; }
done
[ -n "${EMU_CLI:-}" ] || exit 0
# The CLI: greedy text on the emulated device equals the CPU path's (these fixtures' margins are clear).
for m in ${EMU_CLI_MODELS:-fixtures/tiny-f32 fixtures/gguf/tiny-q-mix.gguf}; do
    want=$("$EMU_CLI" run -m "$m" -p "hello" -n 3 --temp 0 2>/dev/null)
    got=$(LD_LIBRARY_PATH="$out" BACKBURNER_CUDA_LIB_DIRS="$1" "$EMU_CLI" run -m "$m" -p "hello" -n 3 --temp 0 \
        --device cuda:0 2>"$out/cli.err") || { cat "$out/cli.err" >&2; exit 1; }
    grep -q "on cuda:0" "$out/cli.err" || { echo "$m: no layers on cuda:0" >&2; cat "$out/cli.err" >&2; exit 1; }
    [ "$want" = "$got" ] || { echo "$m: cuda:0 gave '$got', cpu '$want'" >&2; exit 1; }
    echo "cli $m: cuda:0 text equals cpu's ('$got')"
done
