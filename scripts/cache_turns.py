#!/usr/bin/env python3
"""What the prompt cache saves and costs per chat turn: runs multi-turn chats against a running `backburner serve`
and prints, per turn, the prompt tokens, the tokens taken from the cache, the tokens prefilled and the time to the
first token. With `--compare URL2` it runs the same chats against a second server (another build) turn by turn,
alternating which goes first, and prints both side by side.

    backburner serve --port 8090 &                    # the build to measure
    python3 scripts/cache_turns.py --url http://127.0.0.1:8090 --chats 4 --turns 6

Only the standard library. The answers of a random model are gibberish; what matters is the token counts.
"""

import argparse
import json
import statistics
import time
import urllib.request

QUESTIONS = [
    "Name three rivers in Europe and say which is longest.",
    "Now explain, in two sentences, why rivers meander.",
    "Write a haiku about the second river you named.",
    "Summarise our conversation so far in one line.",
    "Give me a short list of five words that rhyme with 'flow'.",
    "Which of those words would you use in a poem about a cable, and why?",
    "Thank you. One last question: what is a delta?",
    "And an estuary?",
]


def post(url, body):
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        # stream: the first content chunk's arrival is the time to the first token
        ttft, text, usage = None, [], None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                d = ch.get("delta", {})
                piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(d.get("content") or "")
    return "".join(text), usage, ttft if ttft is not None else time.perf_counter() - t0


def turn(url, messages, max_tokens, system):
    body = {
        "messages": ([{"role": "system", "content": system}] if system else []) + messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return post(url, body)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--compare", help="a second server to run the same chats against")
    ap.add_argument("--chats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    urls = [args.url] + ([args.compare] if args.compare else [])
    rows = {u: [] for u in urls}
    for c in range(args.chats):
        system = f"You are assistant number {c}. Answer briefly." if c % 2 else None
        hist = {u: [] for u in urls}
        for t in range(args.turns):
            q = QUESTIONS[(c + t) % len(QUESTIONS)]
            order = urls if (c + t) % 2 == 0 else urls[::-1]
            for u in order:
                hist[u].append({"role": "user", "content": q})
                text, usage, ttft = turn(u, hist[u], args.max_tokens, system)
                hist[u].append({"role": "assistant", "content": text})
                p = usage["prompt_tokens"]
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                rows[u].append((c, t, p, cached, p - cached, ttft))
    print("chat turn | " + " | ".join(f"prompt cached prefilled ttft_ms ({u})" for u in urls))
    for i in range(len(rows[urls[0]])):
        cells = []
        for u in urls:
            c, t, p, cached, pre, ttft = rows[u][i]
            cells.append(f"{p:6d} {cached:6d} {pre:6d} {ttft * 1e3:8.1f}")
        print(f"{rows[urls[0]][i][0]:4d} {rows[urls[0]][i][1]:4d} | " + " | ".join(cells))
    for u in urls:
        later = [r for r in rows[u] if r[1] > 0]
        pre = [r[4] for r in later]
        ttft = [r[5] * 1e3 for r in later]
        print(
            f"{u}: turns after the first: prefilled median {statistics.median(pre):.0f} "
            f"(mean {statistics.mean(pre):.1f}, max {max(pre)}), ttft median {statistics.median(ttft):.1f} ms"
        )
    if args.compare:
        a, b = rows[urls[0]], rows[urls[1]]
        extra = [x[4] - y[4] for x, y in zip(a, b) if x[1] > 0]
        ratio = [x[5] / y[5] for x, y in zip(a, b) if x[1] > 0]
        print(
            f"extra tokens prefilled per turn (first minus second): median {statistics.median(extra):.0f}, "
            f"mean {statistics.mean(extra):.1f}, max {max(extra)}; ttft ratio median {statistics.median(ratio):.3f}"
        )


if __name__ == "__main__":
    main()
