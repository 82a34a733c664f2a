#!/bin/bash
# Rebuilds fixtures/gguf/tiny-q-mix.gguf and its reference (every GGUF block type in one file, as llama-quantize
# writes them). Needs LCPP (llama.cpp build/bin), GREEDY (../shared/peers/greedy_ids.cpp built against it),
# PY + GGUF_PY (for ones_imatrix.py). usage: scripts/types_vs_llamacpp/make_mix_fixture.sh WORK_DIR
set -eu
here=$(cd "$(dirname "$0")" && pwd); fx=$here/../../fixtures/gguf; w=$1; mkdir -p "$w"
"$PY" "$here/ones_imatrix.py" "$fx/tiny-q-q8_0.gguf" "$w/ones.imatrix"
tt=()
for a in 'blk\.0\.ffn_gate=iq2_xxs' 'blk\.0\.ffn_up=iq2_xs' 'blk\.0\.ffn_down=iq2_s' 'blk\.0\.attn_qkv=iq3_xxs' \
  'blk\.0\.attn_gate=iq3_s' 'blk\.0\.ssm_out=iq1_s' 'blk\.1\.ffn_gate=iq1_m' 'blk\.1\.ffn_up=iq4_nl' \
  'blk\.1\.ffn_down=tq1_0' 'blk\.1\.attn_qkv=tq2_0' 'blk\.1\.attn_gate=mxfp4' 'blk\.1\.ssm_out=q4_1' \
  'blk\.2\.ffn_gate=q5_0' 'blk\.2\.ffn_up=q5_1' 'blk\.2\.ffn_down=q2_k' 'blk\.2\.attn_qkv=q3_k' \
  'blk\.2\.attn_gate=q4_k' 'blk\.2\.ssm_out=q5_k' 'blk\.3\.attn_q=q6_k' 'blk\.3\.attn_k=iq4_xs' \
  'blk\.3\.attn_v=q4_0' 'blk\.3\.ffn_gate=iq2_xs' 'blk\.3\.ffn_up=iq3_s' 'blk\.3\.ffn_down=q3_k' \
  'ssm_alpha=f32' 'ssm_beta=f32'; do tt+=(--tensor-type "$a"); done
"$LCPP/llama-quantize" --allow-requantize --imatrix "$w/ones.imatrix" "${tt[@]}" "$fx/tiny-q-q8_0.gguf" "$fx/tiny-q-mix.gguf" Q8_0
"$LCPP/llama-quantize" --allow-requantize "$fx/tiny-q-mix.gguf" "$w/deq.gguf" F32
python3 -c "import random; random.seed(11); print(' '.join(str(random.randrange(0, 512)) for _ in range(48)))" > "$w/ids.txt"
"$GREEDY" "$fx/tiny-q-mix.gguf" "$w/ids.txt" 8 1 f32 off "$w/llama.bin" > "$w/llama.json"
"$GREEDY" "$w/deq.gguf" "$w/ids.txt" 8 1 f32 off "$w/exact.bin" > "$w/exact.json"
python3 - "$w" "$fx/tiny-q-mix.reference.json" <<'PY'
import array, json, sys
w, out = sys.argv[1:3]; V = 512
def ld(p):
    a = array.array('f'); a.frombytes(open(p, 'rb').read(4 * V)); return list(a)
l = json.load(open(f"{w}/llama.json")); x = json.load(open(f"{w}/exact.json"))
json.dump({
    "about": "tiny-q-mix.gguf: llama.cpp's greedy run of it, and llama.cpp's f32 run of the same file dequantized by "
             "llama-quantize (--allow-requantize ... F32), i.e. the exact products of the quantized weights "
             "(scripts/types_vs_llamacpp/make_mix_fixture.sh)",
    "prompt": [int(v) for v in open(f"{w}/ids.txt").read().split()],
    "llama_tokens": l["tokens"], "llama_margins": l["margins"],
    "llama_logits0": [round(v, 6) for v in ld(f"{w}/llama.bin")],
    "exact_tokens": x["tokens"], "exact_margins": x["margins"],
    "exact_logits0": [round(v, 6) for v in ld(f"{w}/exact.bin")],
}, open(out, "w"))
PY
