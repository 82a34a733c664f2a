#!/bin/bash
# Every GGUF block type, as llama-quantize writes it, on both engines (docs/QUANT_TYPES.md).
# usage: scripts/types_vs_llamacpp/run.sh F32.gguf VOCAB OUT_DIR [NAME:TYPE:OPTS ...]
# needs LCPP (llama.cpp build/bin with llama-quantize), GREEDY (../shared/peers/greedy_ids.cpp built against it),
# PY (a python with gguf-py importable: GGUF_PY=.../gguf-py), BB (target/release/backburner).
set -u
here=$(cd "$(dirname "$0")" && pwd)
src=$1 vocab=$2 out=$3; shift 3
mkdir -p "$out"
[ -f "$out/ones.imatrix" ] || "$PY" "$here/ones_imatrix.py" "$src" "$out/ones.imatrix"
[ -s "$out/ids.txt" ] || python3 -c "import random; random.seed(5); print(' '.join(str(random.randrange(1000, $vocab)) for _ in range(200)))" > "$out/ids.txt"
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(Q4_1:Q4_1:--pure Q5_0:Q5_0:--pure Q5_1:Q5_1:--pure Q2_K:Q2_K:--pure Q3_K:Q3_K_M:--pure
  IQ2_XXS:IQ2_XXS:--pure IQ2_XS:IQ2_XS:--pure IQ2_S:IQ2_M:--pure IQ3_XXS:IQ3_XXS:--pure IQ3_S:IQ3_S:--pure
  IQ1_S:IQ1_S:--pure IQ1_M:IQ1_M:--pure IQ4_NL:IQ4_NL:--pure TQ1_0:TQ1_0:--pure TQ2_0:TQ2_0:--pure
  "MXFP4:Q8_0:--pure --tensor-type blk=mxfp4" Q8_0:Q8_0:--pure Q4_K:Q4_K_M:--pure
  mix-Q2_K:Q2_K: mix-Q3_K_M:Q3_K_M: mix-IQ2_XS:IQ2_XS: mix-IQ3_M:IQ3_M: mix-IQ1_M:IQ1_M:)
for spec in "${specs[@]}"; do
  IFS=: read -r name qtype opts <<< "$spec"
  q=$out/$name.gguf d=$out/$name-deq.gguf
  # shellcheck disable=SC2086
  "$LCPP/llama-quantize" --imatrix "$out/ones.imatrix" $opts "$src" "$q" "$qtype" > "$out/$name.log" 2>&1 || { echo "$name: quantize failed"; continue; }
  "$LCPP/llama-quantize" --allow-requantize "$q" "$d" F32 > /dev/null 2>&1 || { echo "$name: dequantize failed"; continue; }
  "$GREEDY" "$q" "$out/ids.txt" 1 2 f32 off "$out/$name-llama.bin" > /dev/null 2>&1 || { echo "$name: llama.cpp failed"; continue; }
  for f in "$q:$out/$name-ours.bin" "$d:$out/$name-exact.bin"; do
    "$BB" run --model "${f%%:*}" --prompt-tokens-file "$out/ids.txt" --max-tokens 1 --threads 2 \
      --dump-logits "${f#*:}" > /dev/null 2>&1 || { echo "$name: ours failed on ${f%%:*}"; continue 2; }
  done
  python3 "$here/compare.py" "$name" "$out/$name-llama.bin" "$out/$name-ours.bin" "$out/$name-exact.bin" "$vocab"
done
