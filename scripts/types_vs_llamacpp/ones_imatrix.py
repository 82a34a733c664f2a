"""Writes a legacy-format importance matrix of ones for every weight tensor of a GGUF (so that llama-quantize makes
its very-low-bit types: uniform importance, i.e. plain least squares).
usage: ones_imatrix.py MODEL.gguf OUT.imatrix"""
import struct, sys
import os
sys.path.insert(0, os.environ["GGUF_PY"])
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
ents = []
for t in r.tensors:
    if not t.name.endswith(".weight") or len(t.shape) < 2:
        continue
    n = int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1)
    ents.append((t.name, n))
out = bytearray(struct.pack("<i", len(ents)))
for name, n in ents:
    b = name.encode()
    out += struct.pack("<i", len(b)) + b + struct.pack("<ii", 1, n) + struct.pack(f"<{n}f", *([1.0] * n))
out += struct.pack("<i", 1) + struct.pack("<i", 4) + b"ones"
open(sys.argv[2], "wb").write(out)
print(len(ents), "entries")
