#!/usr/bin/env bash
# Alternating pairs, ours then the peer, on 27B-shape GGUF files (the figures of docs/BENCHMARKS.md, 2026-12-05).
#   scripts/pairs_27b.sh ik FILE THREADS PAIRS       decode of 32 tokens at depth 128 vs ik_llama.cpp (-rtr 1; IK=its root)
#   scripts/pairs_27b.sh bf16 FILE THREADS PAIRS     512-token prefill with --precision bf16 vs llama.cpp (LCPP=its root)
#   scripts/pairs_27b.sh prefill FILE THREADS PAIRS  512-token prefill vs llama.cpp and ik_llama.cpp (-rtr 1), in turn
#   scripts/pairs_27b.sh types TYPE...               per type: a 4-layer 27B-shape file (written, then removed), two
#                                                     pairs at 1 thread and one at 2: 512-token prefill, 32 decoded tokens
# BB: our binary (default target/release/backburner; use a copy while building). OUT: where `types` writes its files.
set -euo pipefail
BB=${BB:-target/release/backburner}
ours() { # FILE THREADS DEPTH EXTRA... -> "prefill decode"
  $BB bench local -m "$1" -t "$2" --depths "$3" --decode-tokens 32 --no-bandwidth --json "${@:4}" 2>/dev/null \
    | python3 -c "import sys,json;d=json.load(sys.stdin)['results'][0]['depths'][0];print(d['prefill_tok_s'],d['decode_tok_s'])"
}
peer() { # BENCH FILE THREADS ARGS... -> the avg_ts of each test, in order
  "$1" -m "$2" -t "$3" "${@:4}" -r 1 -o json 2>/dev/null \
    | python3 -c "import sys,json;print(*[round(t['avg_ts'],2) for t in json.load(sys.stdin)])"
}
ratio() { python3 -c "print(round($1/$2,3))"; }
case "$1" in
ik)
  for _ in $(seq "$4"); do
    read -r _ od < <(ours "$2" "$3" 128)
    kd=$(peer "${IK:?set IK}/build/bin/llama-bench" "$2" "$3" -p 0 -n 0 -gp 128,32 -rtr 1)
    echo "$(basename "$2") t$3 decode ours $od ik $kd ratio $(ratio "$od" "$kd")"
  done ;;
bf16)
  for _ in $(seq "$4"); do
    read -r op _ < <(ours "$2" "$3" 512 --precision bf16)
    lp=$(peer "${LCPP:?set LCPP}/build/bin/llama-bench" "$2" "$3" -p 512 -n 0 -ub 512 -fa on -ctk f16 -ctv f16)
    echo "$(basename "$2") t$3 prefill ours $op llama.cpp $lp ratio $(ratio "$op" "$lp")"
  done ;;
prefill)
  for _ in $(seq "$4"); do
    read -r op _ < <(ours "$2" "$3" 512)
    lp=$(peer "${LCPP:?set LCPP}/build/bin/llama-bench" "$2" "$3" -p 512 -n 0 -ub 512 -fa on -ctk f16 -ctv f16)
    kp=$(peer "${IK:?set IK}/build/bin/llama-bench" "$2" "$3" -p 512 -n 0 -ub 512 -rtr 1)
    echo "$(basename "$2") t$3 prefill ours $op llama.cpp $lp ik $kp ratios $(ratio "$op" "$lp") $(ratio "$op" "$kp")"
  done ;;
types)
  shift
  for ty in "$@"; do
    f=${OUT:-.}/t4l-$ty.gguf
    $BB bench gen-gguf --out "$f" --shape 27b --layers 4 --type "$ty" --tensor-type 'ssm_alpha=F32,ssm_beta=F32' >/dev/null
    for t in 1 1 2; do
      read -r op od < <(ours "$f" "$t" 512)
      read -r lp ld < <(peer "${LCPP:?set LCPP}/build/bin/llama-bench" "$f" "$t" -p 512 -n 32 -fa on -ctk f16 -ctv f16 -ub 512)
      echo "$ty t$t prefill ours $op llama.cpp $lp ratio $(ratio "$op" "$lp") | decode ours $od llama.cpp $ld ratio $(ratio "$od" "$ld")"
    done
    rm -f "$f"
  done ;;
*) echo "usage: see the head of $0" >&2; exit 2 ;;
esac
