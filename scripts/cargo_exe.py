#!/usr/bin/env python3
"""Reads cargo's JSON messages (`--message-format=json`) on stdin and prints `NAME PATH` for each executable built
for a target of kind KIND (`test`, `bin`), or only PATH for the target named NAME when it is given.
Used by .ci/run and scripts/gpu/build.sh."""
import json
import sys

kind = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else None
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or kind not in t.get("kind", []):
        continue
    if name is None:
        print(t["name"], m["executable"])
    elif t["name"] == name:
        print(m["executable"])
