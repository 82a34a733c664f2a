#!/usr/bin/env bash
# Regenerate fixtures/ (tiny random Qwen3.5 checkpoints + transformers reference outputs).
# Not run by CI. Needs PyPI access the first time (creates .venv-fixtures/ in the repository root, several GB because
# of torch).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-fixtures"
PYTHON="${PYTHON:-python3}"

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
"$VENV/bin/python" scripts/make_fixtures.py "$@"
du -sh fixtures
