#!/usr/bin/env python3
"""Step-0 logits of llama.cpp and of Backburner on one quantized GGUF, each against the 'exact' logits: Backburner's
f32 run of the same file dequantized by llama.cpp (`llama-quantize --allow-requantize ... F32`), i.e. the products
of the quantized weights without activation rounding. A wrong dequantization or product shows as an error far above
llama.cpp's; activation rounding gives both engines errors of the same size.
usage: compare.py NAME LLAMA_LOGITS OURS_LOGITS EXACT_LOGITS VOCAB"""
import array
import sys

name, lf, bf, xf, vocab = sys.argv[1:6]
V = int(vocab)


def step0(p):
    a = array.array('f')
    with open(p, 'rb') as f:
        a.frombytes(f.read(4 * V))
    return a


L, B, X = step0(lf), step0(bf), step0(xf)
el = max(abs(p - q) for p, q in zip(L, X))
eb = max(abs(p - q) for p, q in zip(B, X))
am = lambda x: max(range(V), key=x.__getitem__)  # noqa: E731
print(f"{name:12s} max|logit - exact|: llama.cpp {el:.4f}  ours {eb:.4f}  (ours / llama.cpp {eb / el:.2f});"
      f" argmax exact/llama.cpp/ours {am(X)}/{am(L)}/{am(B)}")
