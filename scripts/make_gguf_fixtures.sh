#!/usr/bin/env bash
# Regenerate fixtures/gguf/ (GGUF conversions of the tiny fixtures, the quantized tiny-q files and their references).
# Not run by CI. Needs the pinned .venv-fixtures (created here like scripts/make_fixtures.sh does; PyPI access the
# first time, several GB because of torch) and a llama.cpp build:
#   LCPP_BIN     build/bin with llama-quantize, llama-perplexity and greedy_ids (shared/peers/greedy_ids.cpp)
#   LCPP_SRC     the llama.cpp source tree (convert_hf_to_gguf.py), for the cross-check against its converter
#   LCPP_PYTHON  a python with the converter's requirements (torch, transformers 4.57.6, numpy, safetensors)
# Optional: llama-gguf-split in LCPP_BIN (the split files are also compared with its output) and a C compiler `cc`
# (scripts/gguf_dequant_ggml.c, to check gguf-py's dequantizers against ggml's).
# Defaults: the scratch build described in shared/PEERS.md (LCPP=/work/scratch/lcpp).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-fixtures"
PYTHON="${PYTHON:-python3}"
LCPP="${LCPP:-/work/scratch/lcpp}"
export LCPP_BIN="${LCPP_BIN:-$LCPP/build/bin}"
export LCPP_SRC="${LCPP_SRC:-$LCPP/llama_cpp_python-0.3.36/vendor/llama.cpp}"
export LCPP_PYTHON="${LCPP_PYTHON:-$LCPP/venv/bin/python}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet -r "$ROOT/scripts/requirements-fixtures.txt"

# Single-threaded: faster for these tiny models and keeps float reductions identical between runs.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# Never reach for a model hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

cd "$ROOT"
"$VENV/bin/python" scripts/make_gguf_fixtures.py "$@"
du -sh fixtures/gguf
