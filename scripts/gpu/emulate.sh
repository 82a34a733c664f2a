#!/usr/bin/env bash
# Runs backburner-cuda's kernels on the CPU (crates/backburner-cuda/emu: each CUDA thread a std::thread) against
# plain references: their index math, warp reductions and barriers checked without a GPU. Needs g++ ≥ 11 (C++20).
set -euo pipefail
cd "$(dirname "$0")/../../crates/backburner-cuda"
out=${TMPDIR:-/tmp}/backburner-cuda-emu-test
g++ -std=c++20 -O1 -pthread -w emu/emu_test.cpp -o "$out"
"$out"
