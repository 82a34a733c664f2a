#!/usr/bin/env python3
"""A bounded soak of the server with workers, faults and a cold reference (issue 33, item 6).

Starts two `backburner worker`s, a fault-injecting TCP relay in front of the first, a `serve` with `--parallel 4`
using both (the first for split prefill, both for KV offload under a small `--kv-budget`), and a reference `serve`
with no worker. Client threads hold multi-turn chats (some with tools, some streamed and cancelled midway); every
answer that finished is asked again of the reference with `cache_prompt: false` and must be equal (text, reasoning,
tool calls, finish reason, completion tokens). Every few minutes the second worker is killed (SIGKILL) and
restarted; the relay cuts a live connection to the first every few tens of seconds. The server's and workers' RSS
are sampled over time. At the end it prints a report (JSON with `--out`): requests served, answers checked and
mismatches, failures by type (and whether a worker was down or a link cut just before), RSS over time.

    cargo build --release -p backburner-cli
    python3 scripts/soak.py --bin target/release/backburner --minutes 30 --out soak.json

Only the standard library. Ports are taken from --base-port upwards (10 of them).
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

TOPICS = ["rivers", "cables", "phones", "compilers", "gardens", "bridges", "trains", "clocks", "maps", "tides"]
LONG = " ".join(
    f"Paragraph {i}: the {TOPICS[i % len(TOPICS)]} of the valley were described at length by the surveyor, who "
    f"counted {i * 7} of them and noted each one's width, depth and the colour of its water."
    for i in range(40)
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


class Relay:
    """Forwards 127.0.0.1:listen to 127.0.0.1:upstream; `cut()` closes one live connection (a transient fault)."""

    def __init__(self, listen, upstream):
        self.upstream = upstream
        self.lock = threading.Lock()
        self.live = []
        self.cuts = 0
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", listen))
        self.srv.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            pair = (c, u)
            with self.lock:
                self.live.append(pair)
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b, pair), daemon=True).start()

    def _pump(self, a, b, pair):
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.lock:
            if pair in self.live:
                self.live.remove(pair)

    def cut(self):
        with self.lock:
            if not self.live:
                return False
            pair = random.choice(self.live)
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.cuts += 1
        return True


def wait_port(port, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing listens on {port} after {timeout} s")


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def chat(port, body, cancel_after=None):
    """POSTs a chat request; returns (status, json_or_None, error_text). With `cancel_after`, streams and closes the
    connection after that many chunks."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            if cancel_after is None:
                return r.status, json.loads(r.read()), None
            n = 0
            for line in r:
                if line.startswith(b"data: "):
                    n += 1
                    if n >= cancel_after:
                        break
            return r.status, None, "cancelled"
    except urllib.error.HTTPError as e:
        return e.code, None, e.read().decode(errors="replace")
    except OSError as e:
        return 0, None, f"{type(e).__name__}: {e}"


def answer_of(v):
    m = v["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return {
        "content": m.get("content"),
        "reasoning": m.get("reasoning_content"),
        "tool_calls": calls,
        "finish": v["choices"][0]["finish_reason"],
        "completion_tokens": v["usage"]["completion_tokens"],
        "prompt_tokens": v["usage"]["prompt_tokens"],
    }


class Soak:
    def __init__(self, args):
        self.a = args
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.time()
        self.events = []  # (t, kind, detail)
        self.served = self.checked = self.cancelled = self.cached = 0
        self.mismatches = []
        self.failures = []
        self.rss = []
        self.down = []  # (start, end) of worker B's outages
        self.cut_times = []

    def now(self):
        return time.time() - self.t0

    def log(self, kind, detail=""):
        with self.lock:
            self.events.append((round(self.now(), 1), kind, detail))
        print(f"[{self.now():7.1f}s] {kind} {detail}", flush=True)

    def start_worker(self, port):
        cmd = [self.a.bin, "worker", "--listen", f"127.0.0.1:{port}", "--threads", "1"]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{self.a.logs}/worker-{port}.log", "a"))
        wait_port(port)
        return p

    def run(self):
        a = self.a
        os.makedirs(a.logs, exist_ok=True)
        p = a.base_port
        self.ports = {"wa": p, "wb": p + 1, "relay": p + 2, "serve": p + 3, "ref": p + 4}
        self.wa = self.start_worker(self.ports["wa"])
        self.wb = self.start_worker(self.ports["wb"])
        self.relay = Relay(self.ports["relay"], self.ports["wa"])
        common = ["--ubatch", str(a.ubatch), "--kv-page-size", "64", "--threads", "1", "-c", "8192"]
        serve = [a.bin, "serve", "--port", str(self.ports["serve"]), "--parallel", "4", "--queue", "64"] + common
        serve += ["--worker", f"127.0.0.1:{self.ports['relay']}", "--worker", f"127.0.0.1:{self.ports['wb']}"]
        serve += ["--kv-budget", str(a.kv_budget), "--split-min-tokens", "64", "--worker-timeout", "20"]
        ref = [a.bin, "serve", "--port", str(self.ports["ref"]), "--parallel", "2", "--queue", "64"] + common
        env = dict(os.environ, BACKBURNER_LOG="info")
        self.srv = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=open(f"{a.logs}/serve.log", "w"), env=env)
        self.ref = subprocess.Popen(ref, stdout=subprocess.DEVNULL, stderr=open(f"{a.logs}/ref.log", "w"))
        wait_port(self.ports["serve"])
        wait_port(self.ports["ref"])
        self.log("started", json.dumps(self.ports))
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(a.clients)]
        threads += [threading.Thread(target=f, daemon=True) for f in (self.killer, self.cutter, self.sampler)]
        for t in threads:
            t.start()
        deadline = self.t0 + a.minutes * 60
        while time.time() < deadline:
            time.sleep(1)
        self.stop.set()
        for t in threads[: a.clients]:
            t.join(timeout=900)
        self.sample()
        self.metrics = self.scrape()
        for proc in (self.srv, self.ref, self.wa, self.wb):
            proc.send_signal(signal.SIGTERM)
        for proc in (self.srv, self.ref, self.wa, self.wb):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        return self.report()

    def scrape(self):
        """The server's counters that show which paths ran (split prefill, KV offload, retries, the cache)."""
        keep = ("split_prefill_calls", "worker_tokens", "kv_pages_on_workers", "fallbacks", "offload", "delayed",
                "cache_", "requests_total", "bad_requests", "prefill_tokens_total", "prompt_tokens_total")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['serve']}/metrics", timeout=30) as r:
                page = r.read().decode()
        except OSError as e:
            return {"error": str(e)}
        out = {}
        for line in page.splitlines():
            if line.startswith("backburner_") and any(k in line for k in keep):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def killer(self):
        while not self.stop.wait(self.a.kill_every):
            t = self.now()
            self.wb.kill()
            self.wb.wait()
            self.log("worker B killed")
            if self.stop.wait(self.a.down_for):
                self.down.append((t, self.now()))
                return
            self.wb = self.start_worker(self.ports["wb"])
            self.down.append((t, self.now()))
            self.log("worker B restarted")

    def cutter(self):
        while not self.stop.wait(random.uniform(0.5, 1.5) * self.a.cut_every):
            if self.relay.cut():
                with self.lock:
                    self.cut_times.append(self.now())
                self.log("relay cut a connection to worker A")

    def sample(self):
        row = {"t": round(self.now(), 1)}
        for name, proc in (("serve", self.srv), ("ref", self.ref), ("worker_a", self.wa), ("worker_b", self.wb)):
            row[name] = rss_kb(proc.pid)
        with self.lock:
            self.rss.append(row)

    def sampler(self):
        while not self.stop.wait(30):
            self.sample()

    def client(self, i):
        rng = random.Random(1000 + i)
        while not self.stop.is_set():
            system = f"You are a terse assistant about {rng.choice(TOPICS)}." if rng.random() < 0.5 else None
            msgs = [{"role": "system", "content": system}] if system else []
            for turn in range(rng.randint(2, 7)):
                if self.stop.is_set():
                    return
                q = rng.choice(
                    [
                        f"Tell me about {rng.choice(TOPICS)}.",
                        f"Summarise this: {LONG[: rng.randint(200, len(LONG))]}",
                        "And then?",
                        f"What is the weather in city number {rng.randint(1, 99)}?",
                    ]
                )
                msgs.append({"role": "user", "content": q})
                body = {"messages": msgs, "max_tokens": rng.randint(4, 48), "temperature": 0}
                if rng.random() < 0.2:
                    body["tools"] = TOOLS
                if rng.random() < 0.1:
                    body["stream"] = True
                    st, _, err = chat(self.ports["serve"], body, cancel_after=rng.randint(1, 4))
                    with self.lock:
                        self.cancelled += 1
                    msgs.pop()
                    break  # a cancelled turn ends the chat
                t = self.now()
                st, v, err = chat(self.ports["serve"], body)
                if st != 200:
                    self.failure(t, st, err)
                    msgs.pop()
                    break
                got = answer_of(v)
                with self.lock:
                    self.served += 1
                    self.cached += v["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                ref_body = dict(body, cache_prompt=False)
                st2, w, err2 = chat(self.ports["ref"], ref_body)
                if st2 == 200:
                    want = answer_of(w)
                    with self.lock:
                        self.checked += 1
                        if want != got:
                            self.mismatches.append({"t": round(t, 1), "messages": msgs, "got": got, "want": want})
                    if want != got:
                        self.log("MISMATCH", f"client {i} turn {turn}")
                else:
                    self.log("reference failed", f"{st2} {err2}")
                msgs.append({"role": "assistant", "content": got["content"] or ""})

    def failure(self, t, status, err):
        down = any(s - 1 <= t <= e + 5 for s, e in self.down) or (self.wb.poll() is not None)
        cut = any(0 <= t - c <= 30 for c in self.cut_times)
        kind = f"{status}"
        try:
            kind += " " + json.loads(err)["error"].get("type", "")
        except (ValueError, TypeError, KeyError):
            pass
        with self.lock:
            self.failures.append({"t": round(t, 1), "status": status, "kind": kind, "error": (err or "")[:400],
                                  "worker_b_down": down, "after_a_cut": cut})
        self.log("FAILED", f"{kind} down={down} cut={cut}: {(err or '')[:160]}")

    def report(self):
        kinds = {}
        for f in self.failures:
            key = f"{f['kind']} ({'worker down' if f['worker_b_down'] else 'after a cut' if f['after_a_cut'] else 'no fault'})"
            kinds[key] = kinds.get(key, 0) + 1
        r = {
            "minutes": self.a.minutes,
            "served": self.served,
            "checked_against_cold": self.checked,
            "mismatches": len(self.mismatches),
            "cancelled": self.cancelled,
            "cached_tokens": self.cached,
            "failures": len(self.failures),
            "failures_by_kind": kinds,
            "worker_b_outages": len(self.down),
            "relay_cuts": self.relay.cuts,
            "server_metrics": getattr(self, "metrics", {}),
            "rss_kb": self.rss,
            "mismatch_details": self.mismatches[:5],
            "failure_details": self.failures[:20],
        }
        return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/backburner")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--ubatch", type=int, default=64)
    ap.add_argument("--kv-budget", type=int, default=384)
    ap.add_argument("--kill-every", type=float, default=180, help="seconds between kills of worker B")
    ap.add_argument("--down-for", type=float, default=20, help="seconds worker B stays down")
    ap.add_argument("--cut-every", type=float, default=40, help="mean seconds between relay cuts")
    ap.add_argument("--base-port", type=int, default=18400)
    ap.add_argument("--logs", default="/tmp/bb-soak")
    ap.add_argument("--out")
    args = ap.parse_args()
    r = Soak(args).run()
    summary = {k: v for k, v in r.items() if k not in ("rss_kb", "mismatch_details", "failure_details")}
    print(json.dumps(summary, indent=1))
    first, last = r["rss_kb"][0] if r["rss_kb"] else {}, r["rss_kb"][-1] if r["rss_kb"] else {}
    print(f"RSS first/last (kB): {first} / {last}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    sys.exit(1 if r["mismatches"] else 0)


if __name__ == "__main__":
    main()
