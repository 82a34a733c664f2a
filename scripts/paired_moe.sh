#!/usr/bin/env bash
# Alternates `backburner bench local` and llama-bench on the same GGUF files, 1 and 2 threads, ROUNDS rounds:
# prefill of 512 tokens and 16 decode tokens at depth 512 (f16 KV, flash attention on llama.cpp's side).
# usage: LCPP=/path/to/llama.cpp-build-root ROUNDS=3 scripts/paired_moe.sh FILE.gguf [FILE.gguf ...]
BB=${BB:-target/release/backburner}; LB=${LCPP:?set LCPP}/build/bin/llama-bench; ROUNDS=${ROUNDS:-3}
lb() { $LB -m "$1" -t "$2" "${@:3}" -ub 512 -ctk f16 -ctv f16 -fa on -r 1 -o json 2>/dev/null \
  | python3 -c "import sys,json;print(round(json.load(sys.stdin)[0]['avg_ts'],2))"; }
for rep in $(seq "$ROUNDS"); do for f in "$@"; do for t in 1 2; do
  bb=$($BB bench local --model "$f" --depths 512 --thread-counts "$t" --decode-tokens 16 --no-bandwidth --json 2>/dev/null \
    | python3 -c "import sys,json;o=json.load(sys.stdin);d=o['results'][0]['depths'][0];print(round(d['prefill_tok_s'],1),round(d['decode_tok_s'],2))")
  lp=$(lb "$f" "$t" -p 512 -n 0); ld=$(lb "$f" "$t" -p 0 -n 16 -d 512)
  echo "rep $rep $(basename "$f") t=$t | bb prefill/decode $bb | llama prefill $lp decode $ld | load $(cut -d' ' -f1 /proc/loadavg)"
done; done; done
