#!/usr/bin/env bash
# Fetches NVRTC (CUDA 12) from PyPI's nvidia-cuda-nvrtc-cu12 wheel into DIR (once) and prints the directory of its
# libraries, for BACKBURNER_CUDA_LIB_DIRS or LD_LIBRARY_PATH: the NVRTC compile test of backburner-cuda then really
# compiles every kernel on a machine without CUDA. Usage: scripts/get_nvrtc.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
lib="$dir/nvidia/cuda_nvrtc/lib"
if ! ls "$lib"/libnvrtc.so.* >/dev/null 2>&1; then
    mkdir -p "$dir/wheel"
    python3 -m pip download --quiet --no-deps nvidia-cuda-nvrtc-cu12 -d "$dir/wheel" >&2
    python3 -m zipfile -e "$(ls "$dir"/wheel/nvidia_cuda_nvrtc_cu12-*.whl | head -n1)" "$dir"
fi
echo "$lib"
