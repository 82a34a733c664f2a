#!/usr/bin/env bash
# The GPU machine's one script (run from the repository root after scripts/gpu/build.sh's archive was carried):
# the no-GPU and GPU tests of backburner-cuda, the cuda_bench figures, PyTorch's reference rates, then the CLI's
# greedy text on cuda:0 against its CPU path on the fixtures, then `bench local` on 27B-shaped models (8 of its
# layers, random weights made here by `bench gen-gguf`) on cuda:0 and on the CPU. A summary on stdout and in
# $OUT/summary.txt (default ./gpu-out); the logs in $OUT/logs.tar.gz, repacked after every step (the device tool
# brings back at most 8 files, and what a timeout left). About 8 minutes on an H100/H200; every step has its own
# timeout.
set -u
OUT=${OUT:-gpu-out}
W=${TMPDIR:-/tmp}/backburner-gpu-logs
C=target/gpu-bin
mkdir -p "$OUT" "$C" "$W"
A=target/gpu-carry/bins.tar.xz
[ -f "$A" ] && { tar -C "$C" -xJf "$A" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$A" "$C"; }
log() {
    echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"
    tar -C "$W" -czf "$OUT/logs.tar.gz" . 2>/dev/null
    [ -f "$W/bench.json" ] && cp "$W/bench.json" "$OUT/"
}

# CUDA libraries: the toolkit's first, then those of the PyTorch wheels (an NVRTC newer than the driver makes PTX
# the driver cannot load: the probe below falls back to the other set).
toolkit=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libnvrtc.so" ] || ls "$d"/libnvrtc.so.* >/dev/null 2>&1 && { toolkit="$d"; break; }
done
wheels=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "lib")))))' 2>/dev/null || true)
nvidia-smi >"$W/nvidia-smi.txt" 2>&1 || true
log "toolkit libs: ${toolkit:-none}; wheel libs: ${wheels:-none}"

chosen=""
for dirs in "$toolkit" "$wheels"; do
    [ -n "$dirs" ] || continue
    if BACKBURNER_CUDA_LIB_DIRS="$dirs" timeout 120 "$C/cuda_bench" --probe >"$W/probe.json" 2>"$W/probe.err"; then
        chosen="$dirs"
        break
    fi
    log "probe failed with $dirs: $(tail -n 3 "$W/probe.err")"
done
[ -n "$chosen" ] || { chosen="$toolkit"; log "no probe succeeded; running with ${chosen:-the default loader path}"; }
export BACKBURNER_CUDA_LIB_DIRS="$chosen"
export LD_LIBRARY_PATH="${chosen}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log "using $chosen; device: $(cat "$W/probe.json" 2>/dev/null | tr -d '\n')"

run_test() { # name timeout
    timeout "$2" "$C/$1" --nocapture --test-threads=1 >"$W/$1.txt" 2>&1
    local rc=$?
    log "$1: rc $rc; $(grep -E '^test result' "$W/$1.txt" | tail -n1)"
    grep -E 'FAILED|panicked|skipped' "$W/$1.txt" | head -n 20 | tee -a "$OUT/summary.txt"
}
run_test no_gpu 90
run_test gpu_ops 150
run_test gpu_model 180
run_test gpu_offload 120

timeout 240 "$C/cuda_bench" --layers 8 --dir "${TMPDIR:-/tmp}" >"$W/bench.json" 2>"$W/bench.err"
log "cuda_bench: rc $?; $(tail -n 2 "$W/bench.err" | tr '\n' ' ')"
timeout 90 python3 scripts/gpu/torch_bf16_rate.py >"$W/torch.json" 2>"$W/torch.err"
log "torch: rc $?; $(tr -d '\n' <"$W/torch.json")"
python3 - "$W" <<'PY' | tee -a "$OUT/summary.txt"
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
timeout 60 "$C/backburner" devices >"$W/devices.txt" 2>&1
log "devices: rc $?; $(grep -E 'cuda|not built|cannot' "$W/devices.txt" | head -n 3 | tr '\n' ' ')"
for m in fixtures/tiny-f32 fixtures/tiny-bf16 fixtures/gguf/tiny-q-mix.gguf fixtures/gguf/tiny-q-iq4_xs.gguf; do
    p="The capital of France is"
    want=$(timeout 60 "$C/backburner" run -m "$m" -p "$p" -n 16 --temp 0 2>/dev/null)
    want16=$(timeout 60 "$C/backburner" run -m "$m" -p "$p" -n 16 --temp 0 --precision bf16 2>/dev/null)
    got=$(timeout 120 "$C/backburner" run -m "$m" -p "$p" -n 16 --temp 0 --device cuda:0 2>"$W/cli.err")
    rc=$?
    # prefill products on the GPU take bf16 activations (docs/DEVICES.md): a bf16 model may follow --precision bf16
    if [ "$want" = "$got" ]; then
        same="text equal to the CPU's"
    elif [ "$want16" = "$got" ]; then
        same="text equal to the CPU's --precision bf16 (the default's: '$want')"
    else
        same="DIFFERENT: cpu '$want', cpu bf16 '$want16', cuda:0 '$got'"
    fi
    log "cli $m: rc $rc; $same; $(grep -E 'on cuda|prompt' "$W/cli.err" | tr '\n' ' ')"
done

# Whole 27B-shaped models through the CLI: 8 of the 27B's 64 layers with its real shapes and its vocabulary, random
# weights; prefill 512 tokens and decode 32 greedy tokens, every layer and the head on cuda:0, then on the CPU.
G=${TMPDIR:-/tmp}/backburner-gguf
mkdir -p "$G"
for t in Q4_K BF16; do
    f="$G/b27-8l-$t.gguf"
    timeout 150 "$C/backburner" bench gen-gguf --shape 27b --layers 8 --type "$t" --out "$f" >"$W/gen-$t.txt" 2>&1
    log "gen-gguf $t: rc $?; $(tail -n 1 "$W/gen-$t.txt")"
    for dev in cuda:0 cpu; do
        j="$W/local-$t-${dev%%:*}.json"
        timeout 240 "$C/backburner" bench local -m "$f" --depths 512 --decode-tokens 32 --json --no-bandwidth \
            --device "$dev" >"$j" 2>"${j%.json}.err"
        rc=$?
        log "bench local $t $dev: rc $rc; $(python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
d = v["results"][0]["depths"][0]
p, q = d["prefill_tok_s"], d["decode_tok_s"]
print("prefill %.1f tok/s, decode %.2f tok/s; %s" % (p, q, v.get("placement")))
' "$j" 2>/dev/null || tail -n 2 "${j%.json}.err" | tr '\n' ' ')"
    done
    rm -f "$f"
done
