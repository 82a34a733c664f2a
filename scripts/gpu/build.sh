#!/usr/bin/env bash
# Builds here (no CUDA needed) what scripts/gpu/check.sh runs on a GPU machine that has no Rust toolchain: the
# release test binaries of backburner-cuda (no_gpu, gpu_ops, gpu_model, gpu_offload), the cuda_bench binary and the
# CLI built with the CUDA backend (`backburner`, --features cuda), stripped, into target/gpu-bin/ (ignored by git;
# scripts/gpu/emulate.sh runs them too), then packed into target/gpu-carry/bins.tar.xz (about 12 MB: the device
# tool's 64 MiB covers the whole working tree, about 41 MiB of it tracked files) and prints the `carry` list.
# Run from the repository root.
set -euo pipefail
bin=target/gpu-bin
out=target/gpu-carry
rm -rf "$bin" "$out" && mkdir -p "$bin" "$out"
# the test executables, by target name, from cargo's JSON messages
cargo test --release -p backburner-cuda --no-run --message-format=json 2>/dev/null |
    python3 scripts/cargo_exe.py test |
    while read -r name path; do cp "$path" "$bin/$name"; done
cargo build --release -p backburner-cuda --bin cuda_bench 2>/dev/null
cp target/release/cuda_bench "$bin/"
cargo build --release -p backburner-cli --features cuda 2>/dev/null
cp target/release/backburner "$bin/"
for f in "$bin"/*; do strip "$f" 2>/dev/null || true; done
for t in no_gpu gpu_ops gpu_model gpu_offload cuda_bench backburner; do
    [ -x "$bin/$t" ] || { echo "missing $bin/$t" >&2; exit 1; }
done
tar -C "$bin" -cf - . | xz -6 -T2 >"$out/bins.tar.xz"
ls -l "$bin" "$out" >&2
tracked=$(git ls-files -z | xargs -0 du -cb | tail -n1 | cut -f1)
total=$(( tracked + $(stat -c %s "$out/bins.tar.xz") ))
echo "tracked files + carry: $total bytes" >&2
[ "$total" -lt $((64 << 20)) ] || { echo "over the device tool's 64 MiB" >&2; exit 1; }
echo "carry: [\"$out\"]"
