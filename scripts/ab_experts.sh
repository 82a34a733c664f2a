#!/bin/bash
# usage: M=DIR [P=prompt tokens] [N=decode tokens] scripts/ab_experts.sh   (prints mode, prefill tok/s, decode tok/s, first tokens, host weight bytes)
# alternating A/B: local vs experts of every layer on a worker (loopback), host and worker 1 thread each
B=${B:-target/release/backburner}; M=${M:?set M to a MoE checkpoint directory}; PORT=50992
IDS=$(python3 -c "print(','.join(str((i*7919+13)%32000) for i in range(${P:-256})))")
$B worker --model $M --listen 127.0.0.1:$PORT --threads 1 > /tmp/wbench.log 2>&1 &
WP=$!; sleep 3
for r in 1 2 3; do
  for mode in local experts; do
    extra=""; [ $mode = experts ] && extra="--worker 127.0.0.1:$PORT --expert-split 0"
    $B run --model $M --prompt-tokens $IDS --max-tokens ${N:-32} --temp 0 --ignore-eos --threads 1 --json $extra 2>/dev/null \
      | python3 -c "import json,sys; d=json.load(sys.stdin); t=d['timings']; print('$mode', round(t['prefill_tok_s'],2), round(t['decode_tok_s'],2), d['tokens'][:6], d['memory']['weights'])"
  done
done
kill $WP
