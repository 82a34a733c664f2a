#!/usr/bin/env bash
# Experts on a worker vs a layer split vs llama.cpp's RPC with the same placements, alternating, on one MoE GGUF:
# round by round `backburner bench layer-split --experts 0 --layer-split 1 --no-chain` (local, experts on a worker
# process, layer split at 1; host and worker 1 thread) then llama-bench local, `--rpc -ngl 2` (layer 1 and the head on
# a ggml-rpc-server) and `--rpc -ot exps=RPC0[...]` (every routed expert on it), rpc-server 1 thread.
# usage: LCPP=/path/to/llama.cpp-root ROUNDS=3 scripts/zero_to_one_moe.sh FILE.gguf
BB=${BB:-target/release/backburner}; BIN=${LCPP:?set LCPP}/build/bin; F=${1:?a GGUF file}; ROUNDS=${ROUNDS:-3}
PORT=${PORT:-50052}; RPC="127.0.0.1:$PORT"
"$BIN/ggml-rpc-server" -t 1 -H 127.0.0.1 -p "$PORT" > /tmp/zero_to_one_rpc.log 2>&1 & RP=$!; sleep 2
C=(-ub 512 -ctk f16 -ctv f16 -fa on -r 1 -o json)
lb() { "$BIN/llama-bench" -m "$F" -t 1 "$@" "${C[@]}" 2>/dev/null | python3 -c "import sys,json;print(round(json.load(sys.stdin)[0]['avg_ts'],2))"; }
for r in $(seq "$ROUNDS"); do
  $BB bench layer-split --model "$F" --experts 0 --layer-split 1 --no-chain --no-shaped --rounds 1 --prompt-tokens 256 \
    --decode-tokens 32 --json 2>/dev/null | python3 -c "
import sys,json
for c in json.load(sys.stdin)['results']:
    print('rep $r bb', c['config'], round(c['prefill_tok_s'],1), round(c['decode_tok_s'],2), 'host MB', round(c['host_weight_bytes']/1e6,1))"
  echo "rep $r llama local $(lb -p 256 -n 0) $(lb -p 0 -n 32 -d 256)"
  echo "rep $r llama rpc_layer $(lb --rpc $RPC -ngl 2 -p 256 -n 0) $(lb --rpc $RPC -ngl 2 -p 0 -n 32 -d 256)"
  echo "rep $r llama rpc_experts $(lb --rpc $RPC -ot "exps=RPC0[$RPC]" -p 256 -n 0) $(lb --rpc $RPC -ot "exps=RPC0[$RPC]" -p 0 -n 32 -d 256)"
done
kill $RP
