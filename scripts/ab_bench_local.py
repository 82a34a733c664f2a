#!/usr/bin/env python3
"""Alternating A/B of decode (and prefill) speed with `backburner bench local`.

Runs every configuration once per round, in a fresh random order each round, and prints each configuration's median
and every round's figure. This machine's speed drifts by 20-30 % within minutes, so only configurations measured in
the same rounds are compared.

Usage:
    scripts/ab_bench_local.py ROUNDS MODEL THREADS NAME:BINARY[:ENV=V,ENV=V] ...

Example (two builds of the engine on a Q8_0 GGUF file, one thread, 12 rounds):
    scripts/ab_bench_local.py 12 bench-q8_0.gguf 1 before:/tmp/bb-old after:target/release/backburner

Each run: `bench local --depths 256 --decode-tokens 48 --no-bandwidth --json` (override with DEPTH and TOKENS in
the environment). With SHARE=1 the runs keep the bandwidth measurement, and each configuration's median decode share
of the read bandwidth in alternation (JSON `paired.read_share`, the steadier figure on a drifting machine) and its
median per-round ratio of decode tok/s to the first configuration's are printed too.
"""
import json
import os
import random
import statistics
import subprocess
import sys


def main() -> None:
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    rounds, model, threads, cfgs = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    depth, tokens = os.environ.get("DEPTH", "256"), os.environ.get("TOKENS", "48")
    with_share = os.environ.get("SHARE") == "1"
    decode = {c.split(":")[0]: [] for c in cfgs}
    share = {c.split(":")[0]: [] for c in cfgs}
    prefill = {c.split(":")[0]: [] for c in cfgs}
    for _ in range(rounds):
        order = cfgs[:]
        random.shuffle(order)
        for cfg in order:
            name, binary, envs = (cfg.split(":") + [""])[:3]
            env = dict(os.environ)
            for kv in filter(None, envs.split(",")):
                k, v = kv.split("=", 1)
                env[k] = v
            out = subprocess.run(
                [binary, "bench", "local", "--model", model, "--depths", depth, "--thread-counts", threads,
                 "--decode-tokens", tokens, *([] if with_share else ["--no-bandwidth"]), "--json"],
                capture_output=True, text=True, env=env, check=True,
            ).stdout
            r = json.loads(out)["results"][0]["depths"][0]
            decode[name].append(r["decode_tok_s"])
            prefill[name].append(r["prefill_tok_s"])
            if with_share:
                share[name].append(r["paired"]["read_share"])
    for name in decode:
        d, p = decode[name], prefill[name]
        print(f"{name:14s} decode median {statistics.median(d):8.2f} tok/s  prefill median {statistics.median(p):8.1f}"
              f"  decode rounds: {' '.join(f'{x:.1f}' for x in d)}")
    if with_share:
        first = next(iter(decode))
        for name in decode:
            ratios = [a / b for a, b in zip(decode[name], decode[first])]
            print(f"{name:14s} share median {100 * statistics.median(share[name]):5.1f} %  decode ÷ {first} median "
                  f"{statistics.median(ratios):.3f} ({sum(x > 1 for x in ratios)} of {len(ratios)} above 1)"
                  f"  shares: {' '.join(f'{100 * x:.1f}' for x in share[name])}")


if __name__ == "__main__":
    main()
