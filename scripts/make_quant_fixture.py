#!/usr/bin/env python3
"""Writes fixtures/quants/ggml_blocks.bin: random blocks of every GGUF block type with gguf-py's `dequantize` of each
(the oracle the Rust dequantization and panel packing are tested against, value for value).

Blocks are random bytes with the scale fields made finite f16 values (MXFP4: exponents near 2^-6); the i-quant
grid-index fields are set so that, over the type's blocks, every grid row is used at least once.
File: b"BBQF", u32 types; per type: u32 ggml id, u32 blocks, u32 block bytes, u32 block elements, the block bytes,
then blocks × elements f32 values (all little-endian).
usage: make_quant_fixture.py GGUF_PY_DIR (the folder holding gguf/quants.py)
"""
import struct
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
from gguf import quants, GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

rng = np.random.default_rng(20261205)


def f16(v):
    return np.array([v], dtype=np.float16).view(np.uint8)


def set_f16(b, at, lo=0.002, hi=0.06):
    s = rng.choice([-1.0, 1.0]) * rng.uniform(lo, hi)
    b[at:at + 2] = f16(s)


def cycle(n_blocks, per_block, n_rows):
    """Row indices cycling through 0..n_rows, per_block per block."""
    total = n_blocks * per_block
    idx = (np.arange(total) * 7919) % n_rows if total >= n_rows else rng.integers(0, n_rows, total)
    return idx.reshape(n_blocks, per_block)


def fix(t, blocks):
    n = blocks.shape[0]
    for b in blocks:
        if t in (T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S,
                 T.IQ4_XS):
            set_f16(b, 0)
        elif t in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K):
            set_f16(b, 0)
            set_f16(b, 2)
        elif t == T.Q2_K:
            set_f16(b, 80)
            set_f16(b, 82)
        elif t == T.Q3_K:
            set_f16(b, 108)
        elif t == T.Q6_K:
            set_f16(b, 208)
        elif t == T.TQ1_0:
            set_f16(b, 52)
        elif t == T.TQ2_0:
            set_f16(b, 64)
        elif t == T.MXFP4:
            b[0] = rng.integers(118, 130)
        elif t == T.IQ1_M:
            d = int(f16(rng.uniform(0.002, 0.06)).view(np.uint16)[0])
            sc = b[48:56].view(np.uint16)
            for i in range(4):
                sc[i] = (sc[i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
    if t == T.IQ2_XXS:
        idx = cycle(n, 32, 256)
        for b, ix in zip(blocks, idx):
            for g in range(8):
                b[2 + 8 * g:2 + 8 * g + 4] = ix[4 * g:4 * g + 4]
    elif t == T.IQ2_XS:
        idx = cycle(n, 32, 512)
        for b, ix in zip(blocks, idx):
            q = b[2:66].view(np.uint16)
            q[:] = (q & 0xFE00) | ix
    elif t in (T.IQ2_S, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.IQ3_XXS):
        rows = {T.IQ2_S: 1024, T.IQ3_S: 512, T.IQ1_S: 2048, T.IQ1_M: 2048, T.IQ3_XXS: 256}[t]
        per = {T.IQ2_S: 32, T.IQ3_S: 64, T.IQ1_S: 32, T.IQ1_M: 32, T.IQ3_XXS: 64}[t]
        idx = cycle(n, per, rows)
        for b, ix in zip(blocks, idx):
            if t == T.IQ3_XXS:
                b[2:66] = ix
            elif t == T.IQ2_S:
                b[2:34] = ix & 0xFF
                qh = np.zeros(8, dtype=np.uint8)
                for i in range(32):
                    qh[i // 4] |= ((ix[i] >> 8) & 3) << (2 * (i % 4))
                b[66:74] = qh
            elif t == T.IQ3_S:
                b[2:66] = ix & 0xFF
                qh = np.zeros(8, dtype=np.uint8)
                for i in range(64):
                    qh[i // 8] |= ((ix[i] >> 8) & 1) << (i % 8)
                b[66:74] = qh
            elif t == T.IQ1_S:
                b[2:34] = ix & 0xFF
                qh = b[34:50].view(np.uint16)
                for g in range(8):
                    v = int(qh[g]) & 0xF000
                    for j in range(4):
                        v |= ((int(ix[4 * g + j]) >> 8) & 7) << (3 * j)
                    qh[g] = v
            else:  # IQ1_M
                b[0:32] = ix & 0xFF
                for i in range(16):
                    lo, hi = (ix[2 * i] >> 8) & 7, (ix[2 * i + 1] >> 8) & 7
                    b[32 + i] = (b[32 + i] & 0x88) | lo | (hi << 4)


TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.IQ2_XS,
         T.IQ3_XXS, T.IQ1_S, T.IQ4_NL, T.IQ3_S, T.IQ2_S, T.IQ4_XS, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.MXFP4]
out = bytearray(b"BBQF") + struct.pack("<I", len(TYPES))
for t in TYPES:
    elems, size = GGML_QUANT_SIZES[t]
    n = 64 if t in (T.IQ1_S, T.IQ1_M) else (32 if elems == 256 else 64)
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    fix(t, blocks)
    vals = quants.dequantize(blocks.reshape(-1), t).astype(np.float32).reshape(-1)
    assert vals.size == n * elems and np.isfinite(vals).all(), t.name
    out += struct.pack("<IIII", int(t), n, size, elems) + blocks.tobytes() + vals.tobytes()
open("fixtures/quants/ggml_blocks.bin", "wb").write(out)
print("fixtures/quants/ggml_blocks.bin:", len(out), "bytes")
