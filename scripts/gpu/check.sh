#!/usr/bin/env bash
# The GPU machine's one script (run from the repository root after scripts/gpu/build.sh's archive was carried):
# the no-GPU and GPU tests of backburner-cuda, the cuda_bench figures, PyTorch's reference rates, then the CLI's
# greedy text on cuda:0 against its CPU path on the fixtures; each output in $OUT (default ./gpu-out), a summary
# on stdout. About 6 minutes on an H100/H200; every step has its own timeout.
set -u
OUT=${OUT:-gpu-out}
C=target/gpu-bin
mkdir -p "$OUT" "$C"
A=target/gpu-carry/bins.tar.xz
[ -f "$A" ] && { tar -C "$C" -xJf "$A" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$A" "$C"; }
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

# CUDA libraries: the toolkit's first, then those of the PyTorch wheels (an NVRTC newer than the driver makes PTX
# the driver cannot load: the probe below falls back to the other set).
toolkit=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libnvrtc.so" ] || ls "$d"/libnvrtc.so.* >/dev/null 2>&1 && { toolkit="$d"; break; }
done
wheels=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "lib")))))' 2>/dev/null || true)
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
log "toolkit libs: ${toolkit:-none}; wheel libs: ${wheels:-none}"

chosen=""
for dirs in "$toolkit" "$wheels"; do
    [ -n "$dirs" ] || continue
    if BACKBURNER_CUDA_LIB_DIRS="$dirs" timeout 120 "$C/cuda_bench" --probe >"$OUT/probe.json" 2>"$OUT/probe.err"; then
        chosen="$dirs"
        break
    fi
    log "probe failed with $dirs: $(tail -n 3 "$OUT/probe.err")"
done
[ -n "$chosen" ] || { chosen="$toolkit"; log "no probe succeeded; running with ${chosen:-the default loader path}"; }
export BACKBURNER_CUDA_LIB_DIRS="$chosen"
export LD_LIBRARY_PATH="${chosen}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log "using $chosen; device: $(cat "$OUT/probe.json" 2>/dev/null | tr -d '\n')"

run_test() { # name timeout
    timeout "$2" "$C/$1" --nocapture --test-threads=1 >"$OUT/$1.txt" 2>&1
    local rc=$?
    log "$1: rc $rc; $(grep -E '^test result' "$OUT/$1.txt" | tail -n1)"
    grep -E 'FAILED|panicked|skipped' "$OUT/$1.txt" | head -n 20 | tee -a "$OUT/summary.txt"
}
run_test no_gpu 90
run_test gpu_ops 150
run_test gpu_model 180
run_test gpu_offload 120

timeout 240 "$C/cuda_bench" --layers 8 --dir "${TMPDIR:-/tmp}" >"$OUT/bench.json" 2>"$OUT/bench.err"
log "cuda_bench: rc $?; $(tail -n 2 "$OUT/bench.err" | tr '\n' ' ')"
timeout 90 python3 scripts/gpu/torch_bf16_rate.py >"$OUT/torch.json" 2>"$OUT/torch.err"
log "torch: rc $?; $(tr -d '\n' <"$OUT/torch.json")"
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
o = sys.argv[1]
try:
    b = json.load(open(f"{o}/bench.json"))
except Exception as e:
    sys.exit(f"no bench.json: {e}")
print(f"copy {b['copy_dtod_gbs']:.0f} GB/s")
for fmt in ("q4_k", "bf16"):
    for name, r in b[fmt].items():
        print(f"{fmt:5} {name:13} decode {r['decode_us']:8.1f} us {r['decode_pct_of_copy']:5.1f} % of copy; "
              f"prefill512 {r['prefill512_tflops']:6.1f} TFLOP/s")
print("layers:", json.dumps(b["layers_q4_k"]))
PY

# The CLI: what `devices` lists, then greedy text with every layer on cuda:0 against the CPU path (equal where the
# fixtures' margins are clear; a difference is reported, with both texts).
timeout 60 "$C/backburner" devices >"$OUT/devices.txt" 2>&1
log "devices: rc $?; $(grep -E 'cuda|not built|cannot' "$OUT/devices.txt" | head -n 3 | tr '\n' ' ')"
for m in fixtures/tiny-f32 fixtures/tiny-bf16 fixtures/gguf/tiny-q-mix.gguf fixtures/gguf/tiny-q-iq4_xs.gguf; do
    p="The capital of France is"
    want=$(timeout 60 "$C/backburner" run -m "$m" -p "$p" -n 16 --temp 0 2>/dev/null)
    got=$(timeout 120 "$C/backburner" run -m "$m" -p "$p" -n 16 --temp 0 --device cuda:0 2>"$OUT/cli.err")
    rc=$?
    if [ "$want" = "$got" ]; then same="text equal"; else same="DIFFERENT: cpu '$want' cuda:0 '$got'"; fi
    log "cli $m: rc $rc; $same; $(grep -E 'on cuda|prompt' "$OUT/cli.err" | tr '\n' ' ')"
done
