#!/usr/bin/env bash
# Side-by-side speed of Backburner and llama.cpp on the same model, threads and machine, in alternating runs (this
# kind of machine drifts ±20-30 % within minutes, so only alternating runs and their medians give a ratio to trust).
#
#   LCPP=/path/to/llama.cpp-work bash scripts/compare_llamacpp.sh [short] [long] [split]
#
# LCPP is a folder holding a llama.cpp build (build/bin/llama-bench, build/bin/ggml-rpc-server) and the bench model
# converted by llama.cpp's own converter (models/bench-f32.gguf, models/bench-bf16.gguf); docs/BENCHMARKS.md says how
# to make them. Sections (default: all):
#   short  prefill 2048 tokens and decode 16 tokens at depth 2048, 1 and 2 threads (llama.cpp: f32 and bf16 GGUF)
#   long   prefill 8192 and 16384 tokens, 1 and 2 threads (llama.cpp: f32 GGUF)
#   split  16384 tokens, host 1 thread + worker 1 thread: `backburner bench split-prefill` beside llama.cpp's RPC
#          split (one ggml-rpc-server holding layers 4..7) and its 2-server pipeline
#   gguf   the same GGUF file in both engines, for each of FORMATS (default "q8_0 q4_k_m iq4_xs"; the files are
#          models/bench-<format>.gguf, made with llama-quantize from bench-f32.gguf): prefill 2048 tokens and
#          decode 16 tokens at depth 2048, 1 and 2 threads, plus our decode's share of the read bandwidth (against
#          the best-of-5 pass at the start, and measured in alternation with reads of the weights: `bench_share.rs`)
# Env: REPS (default 4 short, 3 long, 2 split, 3 gguf), BB (default target/release/backburner), OUT (default a temp
# dir).
# Prints one line per run and the medians per column at the end of each section.
set -uo pipefail
LCPP=${LCPP:?set LCPP to the llama.cpp work folder}
BB=${BB:-target/release/backburner}
LB=$LCPP/build/bin/llama-bench
RPC=$LCPP/build/bin/ggml-rpc-server
F32=$LCPP/models/bench-f32.gguf
BF16=$LCPP/models/bench-bf16.gguf
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
SECTIONS=${*:-short long split gguf}
COMMON=(-ub 512 -ctk f16 -ctv f16 -fa on -r 1 -o json)

py_ts() { python3 -c "import sys,json;print(' '.join(str(round(r['avg_ts'],2)) for r in json.load(sys.stdin)))"; }
free_port() { python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }
start_rpc() {  # one ggml-rpc-server, 1 thread, on a free loopback port; echoes "pid port"
    local port; port=$(free_port)
    "$RPC" -t 1 -H 127.0.0.1 -p "$port" > "$OUT/rpc_$port.log" 2>&1 &
    local pid=$!
    sleep 2
    echo "$pid $port"
}
medians() {  # medians of the numeric columns of the lines in file $1 (lines "label | a b | c d ...")
    python3 - "$1" <<'PY'
import sys, statistics, re
rows = {}
for line in open(sys.argv[1]):
    key = re.search(r"t=(\d+)", line)
    nums = [float(x) for x in re.findall(r"(?<![\w.])(\d+\.\d+|\d+)(?![\w.])", line.split("|", 1)[1])]
    rows.setdefault(key.group(1) if key else "-", []).append(nums)
for k, rs in sorted(rows.items()):
    cols = list(zip(*rs))
    print(f"median t={k}: " + " ".join(f"{statistics.median(c):.2f}" for c in cols))
PY
}

if [[ " $SECTIONS " == *" short "* ]]; then
    f=$OUT/short.txt; : > "$f"
    for rep in $(seq 1 "${REPS:-4}"); do for t in 1 2; do
        bb=$($BB bench local --depths 2048 --thread-counts $t --decode-tokens 16 --no-bandwidth 2>/dev/null |
            python3 -c "import sys,json;d=json.load(sys.stdin)['results'][0]['depths'][0];print(round(d['prefill_tok_s'],2),round(d['decode_tok_s'],2))")
        lp=$($LB -m "$F32" -t $t -p 2048 -n 0 "${COMMON[@]}" 2>/dev/null | py_ts)
        ld=$($LB -m "$F32" -t $t -p 0 -n 16 -d 2048 "${COMMON[@]}" 2>/dev/null | py_ts)
        lb=$($LB -m "$BF16" -t $t -p 0 -n 16 -d 2048 "${COMMON[@]}" 2>/dev/null | py_ts)
        echo "rep $rep t=$t | bb prefill decode $bb | llama f32 prefill $lp decode $ld | llama bf16 decode $lb" | tee -a "$f"
    done; done
    echo "short: columns = bb prefill, bb decode, llama f32 prefill, llama f32 decode, llama bf16 decode"
    medians "$f"
fi

if [[ " $SECTIONS " == *" long "* ]]; then
    f=$OUT/long.txt; : > "$f"
    for rep in $(seq 1 "${REPS:-3}"); do for t in 1 2; do
        bb=$($BB bench local --depths 8192,16384 --thread-counts $t --decode-tokens 4 --no-bandwidth 2>/dev/null |
            python3 -c "import sys,json;print(' '.join(str(round(d['prefill_tok_s'],2)) for d in json.load(sys.stdin)['results'][0]['depths']))")
        ll=$($LB -m "$F32" -t $t -p 8192,16384 -n 0 "${COMMON[@]}" 2>/dev/null | py_ts)
        echo "rep $rep t=$t | bb prefill 8k 16k $bb | llama f32 prefill 8k 16k $ll" | tee -a "$f"
    done; done
    echo "long: columns = bb 8k, bb 16k, llama f32 8k, llama f32 16k"
    medians "$f"
fi

if [[ " $SECTIONS " == *" split "* ]]; then
    f=$OUT/split.txt; : > "$f"
    for rep in $(seq 1 "${REPS:-2}"); do
        bb=$($BB bench split-prefill --depths 16384 --no-shaped --pings 100 2>/dev/null |
            python3 -c "import sys,json;r=json.load(sys.stdin)['results'][0];print(round(r['local_tok_s'],2),round(r['split_tok_s'],2))")
        read -r pid port < <(start_rpc)
        one=$($LB -m "$F32" --rpc "127.0.0.1:$port" -ngl 5 -t 1 -p 16384 -n 0 -b 16384 "${COMMON[@]}" 2>/dev/null | py_ts)
        kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
        read -r p1 port1 < <(start_rpc); read -r p2 port2 < <(start_rpc)
        pipe=$($LB -m "$F32" --rpc "127.0.0.1:$port1,127.0.0.1:$port2" -ngl 99 -ts 4/5 -t 1 -p 16384 -n 0 -b 16384 \
            "${COMMON[@]}" 2>/dev/null | py_ts)
        kill "$p1" "$p2" 2>/dev/null; wait "$p1" "$p2" 2>/dev/null
        echo "rep $rep t=1 | bb local split $bb | llama rpc split $one pipeline $pipe" | tee -a "$f"
    done
    echo "split: columns = bb local 1 thread, bb split 1+1, llama rpc split 1+1, llama rpc pipeline 1+1"
    medians "$f"
fi
if [[ " $SECTIONS " == *" gguf "* ]]; then
    for fmt in ${FORMATS:-q8_0 q4_k_m iq4_xs}; do
        file=$LCPP/models/bench-$fmt.gguf
        f=$OUT/gguf-$fmt.txt; : > "$f"
        for rep in $(seq 1 "${REPS:-3}"); do for t in 1 2; do
            bb=$($BB bench local --model "$file" --depths 2048 --thread-counts $t --decode-tokens 16 2>/dev/null |
                python3 -c "import sys,json;o=json.load(sys.stdin);r=o['results'][0];d=r['depths'][0];bw=r.get('read_bandwidth_gb_s') or 0;p=d.get('paired') or {};print(round(d['prefill_tok_s'],2),round(d['decode_tok_s'],2),round(100*d['decode_weight_gb_s']/bw if bw else 0,1),round(100*d['decode_read_gb_s']/bw if bw else 0,1),round(100*p.get('read_share',0),1))")
            lp=$($LB -m "$file" -t $t -p 2048 -n 0 "${COMMON[@]}" 2>/dev/null | py_ts)
            ld=$($LB -m "$file" -t $t -p 0 -n 16 -d 2048 "${COMMON[@]}" 2>/dev/null | py_ts)
            echo "rep $rep t=$t | bb prefill decode weights-bw% all-bw% paired-share% $bb | llama prefill $lp decode $ld" | tee -a "$f"
        done; done
        echo "gguf $fmt: columns = bb prefill, bb decode, bb decode weight bytes/s and all bytes/s (weights, KV, state) as % of the best-of-5 read pass at the start, the same in alternation with reads of the weights (median of rounds), llama prefill, llama decode"
        medians "$f"
    done
fi
echo "raw lines in $OUT"
