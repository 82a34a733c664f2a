#!/usr/bin/env bash
# Builds here (no CUDA needed) what scripts/gpu/check.sh runs on a GPU machine that has no Rust toolchain: the
# release test binaries of backburner-cuda (no_gpu, gpu_ops, gpu_model) and the cuda_bench binary, stripped, into
# target/gpu-carry/ (ignored by git), and prints the `carry` list for the device tool. Run from the repository root.
set -euo pipefail
out=target/gpu-carry
rm -rf "$out" && mkdir -p "$out"
# the test executables, by target name, from cargo's JSON messages
cargo test --release -p backburner-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in t.get("kind", []):
        shutil.copy(m["executable"], sys.argv[1] + "/" + t["name"])
' "$out"
cargo build --release -p backburner-cuda --bin cuda_bench 2>/dev/null
cp target/release/cuda_bench "$out/"
for f in "$out"/*; do strip "$f" 2>/dev/null || true; done
for t in no_gpu gpu_ops gpu_model cuda_bench; do
    [ -x "$out/$t" ] || { echo "missing $out/$t" >&2; exit 1; }
done
total=$(du -cb "$out"/* | tail -n1 | cut -f1)
ls -l "$out" >&2
echo "total $total bytes" >&2
[ "$total" -lt $((64 << 20)) ] || { echo "over 64 MiB" >&2; exit 1; }
echo "carry: [\"$out\"]"
