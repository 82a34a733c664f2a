#!/usr/bin/env python3
"""Builds assets/agent-session/transcript.json: a multi-turn coding-agent session for `backburner bench session`.

The session is written for this repository: the hand-written turn text (the user's report, the agent's reasoning and
tool calls, the command outputs) is in this script, and the tool results that show repository files quote them
verbatim from the git object store at the pinned commit PINNED_COMMIT (files and line ranges below), with one
fictional edit (PLANTED_BUG: the bug the agent then finds and fixes). Nothing is copied from elsewhere.

Shape (see assets/agent-session/README.md):
    {"about", "model_hint", "system", "tools", "turns": [{"messages": [...]}, ...], "final": {assistant message}}
Request k = [system] + messages of turns 0..=k; the recorded reply to request k is the first message of turn k+1
(or "final" for the last turn).

Usage:
    python3 scripts/make_agent_session.py            # writes the JSON and prints per-turn token counts
    python3 scripts/make_agent_session.py --check    # fails if the committed JSON differs from a fresh build
Token counting needs `tokenizers` and `jinja2` (pip install tokenizers jinja2); with --no-count the JSON is built
without them.
"""

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import difflib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "assets", "agent-session", "transcript.json")
PINNED_COMMIT = "4fb9a37b577eae459e120fa3bdb75776c99e074f"
FLOW = "crates/backburner-engine/src/offload/flow.rs"
LIMITS_TEST = "crates/backburner-engine/tests/offload_limits.rs"
PROTOCOL = "docs/PROTOCOL.md"
# The one fictional change: in the session's world, pages_per_frame takes the *larger* of the host's frame budget
# and the worker's max_frame (the real code, at PINNED_COMMIT, takes the smaller).
PLANTED_BUG = ("                w.link.settings.frame_budget.min(lim)\n",
               "                w.link.settings.frame_budget.max(lim)\n")
REPO_DIR = "/home/dev/backburner"  # where the session's agent works


# ---------------------------------------------------------------------------------------------------------------
# the repository at the pinned commit


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout


def blob(path):
    text = git("show", f"{PINNED_COMMIT}:{path}")
    if path == FLOW:
        assert text.count(PLANTED_BUG[0]) == 1, "the planted line moved: update PLANTED_BUG"
        text = text.replace(*PLANTED_BUG)
    return text


def lines_of(path):
    return blob(path).splitlines()


def read_result(path, start=None, end=None):
    """What the read_file tool returns: a header line, then numbered lines."""
    ls = lines_of(path)
    a = start or 1
    b = min(end or len(ls), len(ls))
    head = f"{path} (lines {a}-{b} of {len(ls)})"
    body = "\n".join(f"{i:>5}\t{ls[i - 1]}" for i in range(a, b + 1))
    return head + "\n" + body


def grep_result(pattern, paths):
    """What the search tool returns: `git grep -n -E` at the pinned commit (planted edit applied), path:line:text."""
    out = []
    for p in git("ls-tree", "-r", "--name-only", PINNED_COMMIT, "--", *paths).splitlines():
        if not (p.endswith(".rs") or p.endswith(".md")):
            continue
        import re
        rx = re.compile(pattern)
        for i, l in enumerate(lines_of(p), 1):
            if rx.search(l):
                out.append(f"{p}:{i}:{l}")
    return "\n".join(out) + f"\n\n[{len(out)} matches]"


def ls_result(path):
    names = git("ls-tree", "--name-only", f"{PINNED_COMMIT}:{path}").splitlines()
    tree = git("ls-tree", f"{PINNED_COMMIT}:{path}").splitlines()
    kinds = {l.split("\t")[1]: l.split()[1] for l in tree}
    return "\n".join(n + ("/" if kinds[n] == "tree" else "") for n in names)


def udiff(path, old, new):
    d = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}", n=3)
    return "".join(d)


def line_of(text, needle):
    """1-based line of the only line containing needle."""
    hits = [i for i, l in enumerate(text.splitlines(), 1) if needle in l]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def col_of(text, needle, word):
    """1-based column of word within the only line containing needle."""
    l = text.splitlines()[line_of(text, needle) - 1]
    return l.index(word, l.index(needle)) + 1


def applied(path, diff):
    plus = sum(1 for l in diff.splitlines() if l.startswith("+") and not l.startswith("+++"))
    minus = sum(1 for l in diff.splitlines() if l.startswith("-") and not l.startswith("---"))
    return f"Applied 1 patch: M {path} (+{plus} -{minus})"


def replace_once(text, old, new):
    assert text.count(old) == 1, old
    return text.replace(old, new)


# ---------------------------------------------------------------------------------------------------------------
# the session's edits (applied to the pinned files, so the diffs always apply)

FLOW_OLD_DOC = "    /// Pages (per layer) that fit one `PagesPut` frame.\n"
FLOW_NEW_DOC = (
    "    /// Pages (per layer) that fit one `PagesPut` frame: the frame is bounded by the host's frame budget *and* by\n"
    "    /// every worker's announced `max_frame` (a worker refuses a larger tensor section at its header, and its\n"
    "    /// lingering close drains at most 16 MiB of it, so a larger put reaches the host as a reset).\n"
)


def flow_fixed():
    t = blob(FLOW)
    t = replace_once(t, FLOW_OLD_DOC, FLOW_NEW_DOC)
    return t.replace(PLANTED_BUG[1], PLANTED_BUG[0])


TEST_FN = '''
#[test]
fn pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts() {
    let f = model_with_layers(8, 26);
    let p = prompt(12 * 64 + 9, 11);
    // f32 KV: one page of both attention layers is 2 × 32 KiB; a 128-token ubatch moves two pages at a time
    // (128 KiB), over this worker's 96 KiB bound, while its Attend (64 KiB of queries) and Partials (66 KiB) fit
    let f32_kv = |budget: Option<usize>| SessionOptions {
        kv: KvOptions {
            page_size: 64,
            dtype: KvDtype::F32,
        },
        ..ubatch_128(budget)
    };
    let want = run(&mut Session::new(f.model.clone(), f32_kv(None)).unwrap(), &p, 4);
    let w = start_worker_with(f.dir.path(), |o| {
        o.max_frame = 96 << 10;
        o.max_ubatch = 256
    });
    // the host's own budget (256 KiB) is the larger one: the worker's bound must win
    let mut s = Session::new(f.model.clone(), f32_kv(Some(320))).unwrap();
    s.attach_worker(client_with(f.dir.path(), &w.addr, Some(4), b"", 256 << 10));
    let got = run(&mut s, &p, 4);
    assert!(got == want, "logits differ");
    let st = s.link_stats();
    assert_eq!((st.offload_failures, st.fallbacks), (0, 0), "{st:?}");
    assert!(st.positions_on_workers >= 8 * 64, "{st:?}");
}
'''

TEST_IMPORT_OLD = "use backburner_link::{Conn, SessionParams, WireKvDtype};\n"
TEST_IMPORT_1 = TEST_IMPORT_OLD + "use backburner_model::KvOptions;\n"
TEST_KIND = "use backburner_link::frame::Kind;\n"


def limits_v0():
    return blob(LIMITS_TEST)


def limits_v1():
    return replace_once(limits_v0(), TEST_IMPORT_OLD, TEST_IMPORT_1) + TEST_FN


def limits_v2():
    return replace_once(limits_v1(), TEST_KIND, "use backburner_kernels::kv::KvDtype;\n" + TEST_KIND)


PROTO_OLD = ("room — never the newest page — to the worker of the newest run, or, when that answers `PagesFull` (or is unreachable\n"
             "and holds nothing), to the next worker in `--worker` order; frames carry as many pages as fit the frame budget. It\n")
PROTO_NEW = ("room — never the newest page — to the worker of the newest run, or, when that answers `PagesFull` (or is unreachable\n"
             "and holds nothing), to the next worker in `--worker` order; frames carry as many pages as fit `min(frame budget,\n"
             "max_frame of every worker)` (§6.1), at least one page. It\n")


def proto_fixed():
    return replace_once(blob(PROTOCOL), PROTO_OLD, PROTO_NEW)


# ---------------------------------------------------------------------------------------------------------------
# the hand-written parts

SYSTEM = f"""You are a software engineering agent working inside a checked-out git repository at {REPO_DIR}. You help \
the user by reading code, running commands and making careful, minimal changes. You act through the tools you are \
given; their results are the only way you learn anything about the repository, so never guess the content of a file \
you have not read.

How to work:
- Understand before you change. Start from the symptom the user reports, find the code that produces it, and read \
enough of the surrounding code and documentation to know why it happens. State the root cause in one or two \
sentences before you edit anything.
- Prefer `search` and `read_file` with line ranges over reading whole large files. Paths are relative to the \
repository root.
- Make the smallest change that fixes the root cause. Match the surrounding style: naming, comments, error \
messages, test layout. Do not reformat code you do not otherwise touch.
- Edit with `apply_patch` (a unified diff). Use `write_file` only for new files.
- Every fix gets a regression test that fails without the fix and passes with it. Show that it fails without the \
fix when you can do so cheaply.
- This is a Rust workspace. Build and test with cargo through `run_command`, scoped to the crates and test targets \
you touched (`cargo test -p <crate> --test <name>`); a full `cargo test --workspace` takes several minutes. Run \
`cargo clippy` on what you changed.
- Where the repository has a written specification (docs/), keep it in step with the code: the project treats a \
disagreement between the two as a bug.
- Never commit, push, or rewrite history unless the user asks. Never run destructive commands (`rm -rf`, \
`git reset --hard`, `git clean`) on the user's work.
- When you are done, answer with a short summary: the root cause, what you changed (files), the test you added, \
and what you ran. Mention anything you noticed but deliberately left alone."""


def tool(name, description, properties, required):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS = [
    tool("read_file",
         "Reads a text file of the repository. Returns a header line with the path and the range shown, then the "
         "lines, each prefixed with its 1-based line number and a tab. Without a range, the whole file (files over "
         "2000 lines are cut at line 2000).",
         {"path": {"type": "string", "description": "Path relative to the repository root."},
          "start_line": {"type": "integer", "description": "First line to show (1-based, inclusive). Default 1."},
          "end_line": {"type": "integer", "description": "Last line to show (inclusive). Default: the end of the file."}},
         ["path"]),
    tool("list_dir",
         "Lists a directory of the repository: one entry per line, directories with a trailing slash. Hidden entries "
         "and ignored build outputs (target/) are left out.",
         {"path": {"type": "string", "description": "Directory relative to the repository root; \".\" for the root."},
          "depth": {"type": "integer", "description": "How many levels to descend (1 = the entries of path only). Default 1, at most 4."}},
         ["path"]),
    tool("find_files",
         "Finds files by glob pattern (e.g. \"crates/**/tests/*.rs\"). Returns matching paths, sorted, at most 200.",
         {"pattern": {"type": "string", "description": "Glob pattern relative to the repository root; ** matches any number of directories."}},
         ["pattern"]),
    tool("search",
         "Searches file contents with a regular expression (Rust regex syntax, like ripgrep). Returns matches as "
         "path:line:text, then the number of matches.",
         {"pattern": {"type": "string", "description": "Regular expression to search for."},
          "path": {"type": "string", "description": "File or directory to search in, relative to the repository root. Default: the whole repository."},
          "glob": {"type": "string", "description": "Only search files whose path matches this glob, e.g. \"*.rs\"."},
          "context_lines": {"type": "integer", "description": "Lines of context to show before and after each match. Default 0."},
          "max_results": {"type": "integer", "description": "Stop after this many matches. Default 200."}},
         ["pattern"]),
    tool("apply_patch",
         "Applies a unified diff (as produced by `git diff` or `diff -u`) to files of the repository. Paths in the "
         "--- and +++ lines are relative to the root, with or without a/ and b/ prefixes. Hunks must match the "
         "current content exactly (context lines included); the whole patch is rejected if any hunk fails. Returns the "
         "files changed.",
         {"patch": {"type": "string", "description": "The unified diff text."}},
         ["patch"]),
    tool("write_file",
         "Creates a file, or replaces its whole content. Parent directories are created. Prefer apply_patch for "
         "changes to existing files.",
         {"path": {"type": "string", "description": "Path relative to the repository root."},
          "content": {"type": "string", "description": "The complete new content of the file."}},
         ["path", "content"]),
    tool("run_command",
         "Runs a shell command (bash) in the repository root and returns its exit status and its combined stdout and "
         "stderr (the last 20000 characters). There is no terminal: do not start interactive programs. Network "
         "access is off, but crates already in the cargo cache are available.",
         {"command": {"type": "string", "description": "The command line."},
          "cwd": {"type": "string", "description": "Working directory relative to the repository root. Default: the root."},
          "timeout_s": {"type": "integer", "description": "Seconds before the command is killed. Default 600, at most 1800."}},
         ["command"]),
    tool("git_diff",
         "Shows the uncommitted changes of the working tree against HEAD as a unified diff.",
         {"paths": {"type": "array", "items": {"type": "string"}, "description": "Limit the diff to these paths. Default: all changes."},
          "stat": {"type": "boolean", "description": "Show only the per-file summary (git diff --stat). Default false."}},
         []),
]

USER = """Our service embeds the Backburner worker as a library (`backburner_engine::Worker` with `WorkerOptions`; we set `max_frame: 16 << 20` because the boxes it runs on are small and we want to bound a request's buffers). Hosts connect to it with KV offload (`--kv-budget 8192 --kv-page-size 256`, f16 KV, a 32-layer Qwen3.5 checkpoint, so 8 attention layers).

It works for a while, then every time the host has to move several pages at once the worker drops the connection. Host side:

```
2025-06-14T09:12:44.871Z  WARN backburner_engine::offload: worker 10.0.4.7:50060 lost while holding pages: link I/O error: Connection reset by peer (os error 104)
2025-06-14T09:12:44.871Z  INFO backburner_engine::offload: dropped 12288 offloaded positions; rebuilding the session by re-ingest
```

Worker side, at the same moment:

```
2025-06-14T09:12:44.869Z  WARN backburner_engine::worker: session ended: frame section of 25165824 bytes exceeds the limit of 16777216 bytes peer=10.0.2.15:41872
```

So the host sends a frame over 16 MiB even though the worker announces 16 MiB in its handshake, and then it loses all the offloaded pages and re-ingests the whole history, which takes minutes on that machine. Moving one or two pages at a time is fine.

Please find and fix the bug, and add a regression test. Keep the change minimal and run the relevant tests."""

# where the failing test's unwrap is (the prefill in worker_common's `run`)
_WC = "crates/backburner-engine/tests/worker_common/mod.rs"
WC_PREFILL = (f"{line_of(blob(_WC), 'let mut l = s.prefill(p')}:"
              f"{col_of(blob(_WC), 'let mut l = s.prefill(p', 'unwrap')}")

# each step: the assistant's text, its tool calls [(name, args, result)]
STEPS = []


def step(text, *calls):
    STEPS.append((text, list(calls)))


step("The worker rejects the frame at its header because the tensor section (25165824 bytes = 24 MiB) is over the "
     "`max_frame` it announced (16 MiB). So the host is building a frame without honouring the worker's limit. Let me "
     "find every place a frame-size bound is set or checked, on both sides.",
     ("search", {"pattern": "max_frame|max_tensor", "path": "crates", "glob": "*.rs"},
      grep_result(r"max_frame|max_tensor", ["crates"])))

step("Several host paths bound their frames by the worker's `max_frame`: `split/pipeline.rs:33` for Sync/Fetch and "
     "`offload/flow.rs:284` for page puts. First the receiving side, to be sure what the worker checks and when.",
     ("read_file", {"path": "crates/backburner-link/src/frame.rs"}, read_result("crates/backburner-link/src/frame.rs")))

step("`Header::decode` refuses `tensor_len > max_tensor` with `FrameTooLarge` before any body byte is read; the "
     "worker sets its reader's bound to `o.max_frame` after the handshake (accept.rs:265). That matches the worker's "
     "log line. Now, why does the host see a reset instead of the worker's typed error? Let me look at how the worker "
     "ends a session after a framing fault.",
     ("read_file", {"path": "crates/backburner-engine/src/worker/mod.rs", "start_line": 255, "end_line": 345},
      read_result("crates/backburner-engine/src/worker/mod.rs", 255, 345)))

step("After a framing fault the worker sends `Error{Malformed}` and calls `linger_close(16 << 20, 1 s)`. Let me read "
     "the lingering close in the connection code.",
     ("search", {"pattern": "fn linger_close", "path": "crates/backburner-link/src"},
      grep_result(r"fn linger_close", ["crates/backburner-link/src"])),
     ("read_file", {"path": "crates/backburner-link/src/conn.rs", "start_line": 366, "end_line": 408},
      read_result("crates/backburner-link/src/conn.rs", 366, 408)))

step("That explains the reset. `linger_close` shuts the worker's writing side and drains at most `max_bytes` (16 MiB) "
     "of what the host is still sending, then closes. The refused put is 24 MiB, so about 8 MiB are still arriving "
     "when the worker closes; closing a socket with unread data makes the kernel send RST, which discards the `Error` "
     "frame before the host reads it, and the host's next write fails with ECONNRESET.\n\n"
     "The reset is a consequence, though. The real bug is that the host sent a 24 MiB put to a worker that announced "
     "16 MiB. Let me check what the specification says about who bounds `PagesPut` frames.",
     ("search", {"pattern": "max_frame|frame budget", "path": "docs/PROTOCOL.md"},
      grep_result(r"max_frame|frame budget", [PROTOCOL])))

step(None,
     ("read_file", {"path": PROTOCOL, "start_line": 1078, "end_line": 1100}, read_result(PROTOCOL, 1078, 1100)),
     ("read_file", {"path": PROTOCOL, "start_line": 944, "end_line": 951}, read_result(PROTOCOL, 944, 951)))

step("§6.1 is explicit for Sync/Fetch: `B = min(frame budget, the worker's max_frame)`. §5.11 only says put frames "
     "\"carry as many pages as fit the frame budget\". Let me compare the two host implementations side by side.",
     ("read_file", {"path": "crates/backburner-engine/src/split/pipeline.rs", "start_line": 1, "end_line": 60},
      read_result("crates/backburner-engine/src/split/pipeline.rs", 1, 60)),
     ("read_file", {"path": FLOW, "start_line": 228, "end_line": 330}, read_result(FLOW, 228, 330)))

step("Found it. `rows_per_frame` (split/pipeline.rs:24-34) takes `frame_budget.min(max_frame)`, but "
     "`pages_per_frame` (offload/flow.rs:272-291) takes `frame_budget.max(lim)`:\n\n"
     "```rust\n"
     "let lim = w.link.limits.map_or(usize::MAX, |l| usize::try_from(l.max_frame).unwrap_or(usize::MAX));\n"
     "w.link.settings.frame_budget.max(lim)\n"
     "```\n\n"
     "With the default host budget (256 MiB) and a 16 MiB worker, that is 256 MiB per put, so `make_room` sends every "
     "move of up to 32 pages in one frame. In the user's setup one page of all 8 attention layers is "
     "`2 · 4 blocks · 64 · 4 KV heads · 256 · 2 bytes · 8 = 8 MiB`, so moving 3 pages is a 24 MiB frame, exactly the "
     "25165824 bytes in the log, while 1 or 2 pages (8 or 16 MiB) pass, as reported. With the default worker "
     "(1 GiB) `max` gives 1 GiB, which is why nobody saw it: the host budget was silently ignored too. "
     "The fix is `min`, as in `rows_per_frame`; `(frame / per).max(1)` already guarantees at least one page per put.\n\n"
     "Before editing, let me look at the existing tests of the worker's limits so that the regression test fits in.",
     ("list_dir", {"path": "crates/backburner-engine/tests"}, ls_result("crates/backburner-engine/tests")))

step(None, ("read_file", {"path": LIMITS_TEST}, read_result(LIMITS_TEST)))

step("`a_later_workers_per_page_partials_come_in_chunks_within_its_frame_bound` is close to what I need: an in-process "
     "worker with a small `max_frame`, a host with a small frame budget, and the local run's logits as the reference. "
     "Let me check the helpers it uses.",
     ("read_file", {"path": "crates/backburner-engine/tests/worker_common/mod.rs"},
      read_result("crates/backburner-engine/tests/worker_common/mod.rs")))

step("Now the fix. The tiny test model has 2 attention layers, 2 KV heads and head_dim 32; with 64-position pages one "
     "page of both layers is 2 · 16 KiB in f16. I need a worker whose bound is below the host's budget but still "
     "large enough for the other frames of the session (Attend queries and Partials of a 128-token ubatch, 64 KiB and "
     "66 KiB), and a step that moves more bytes than the bound. In f16 a step's pages and its Attend queries are the "
     "same size (both 512 bytes per token), so I'll use f32 KV: a 128-token ubatch then moves 2 pages = 128 KiB, and "
     "a 96 KiB worker bound separates the two. Host budget 256 KiB via `client_with`, so `max` picks the host's "
     "and `min` picks the worker's.\n\nFirst the fix itself:",
     ("apply_patch", {"patch": udiff(FLOW, blob(FLOW), flow_fixed())}, applied(FLOW, udiff(FLOW, blob(FLOW), flow_fixed()))))

step("Now the regression test, next to the other frame-bound test:",
     ("apply_patch", {"patch": udiff(LIMITS_TEST, limits_v0(), limits_v1())}, applied(LIMITS_TEST, udiff(LIMITS_TEST, limits_v0(), limits_v1()))))

step(None,
     ("run_command", {"command": "cargo test -p backburner-engine --test offload_limits 2>&1 | tail -40", "timeout_s": 900},
      f"""exit status: 0
   Compiling backburner-engine v0.1.0 (/home/dev/backburner/crates/backburner-engine)
error[E0433]: failed to resolve: use of undeclared type `KvDtype`
   --> crates/backburner-engine/tests/offload_limits.rs:{line_of(limits_v1(), "KvDtype::F32")}:20
    |
{line_of(limits_v1(), "KvDtype::F32")} |             dtype: KvDtype::F32,
    |                    ^^^^^^^ use of undeclared type `KvDtype`
    |
help: consider importing this enum
    |
{line_of(limits_v1(), TEST_KIND.strip())}  + use backburner_kernels::kv::KvDtype;
    |

For more information about this error, try `rustc --explain E0433`.
error: could not compile `backburner-engine` (test "offload_limits") due to 1 previous error"""))

step("I imported `KvOptions` but not `KvDtype`; `worker_common` imports it from `backburner_kernels::kv` (and the "
     "engine already has that crate as a dependency). (The exit status is 0 only because of the pipe into `tail`.)",
     ("apply_patch", {"patch": udiff(LIMITS_TEST, limits_v1(), limits_v2())}, applied(LIMITS_TEST, udiff(LIMITS_TEST, limits_v1(), limits_v2()))))

step(None,
     ("run_command", {"command": "cargo test -p backburner-engine --test offload_limits", "timeout_s": 900},
      """exit status: 0
   Compiling backburner-engine v0.1.0 (/home/dev/backburner/crates/backburner-engine)
    Finished `test` profile [optimized + debuginfo] target(s) in 41.87s
     Running tests/offload_limits.rs (target/debug/deps/offload_limits-5b0e6d2c9a17f3e4)

running 5 tests
test a_put_larger_than_the_free_memory_is_answered_pages_full_and_the_session_goes_on ... ok
test pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts ... ok
test a_later_workers_per_page_partials_come_in_chunks_within_its_frame_bound ... ok
test a_worker_short_of_memory_evicts_an_idle_mirror_before_an_older_session_holding_pages ... ok
test a_first_worker_full_of_pages_keeps_answering_and_the_next_takes_over_with_the_local_bits ... ok

test result: ok. 5 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 7.93s
"""))

step("All five pass. Now let me check that the new test catches the bug: put `max` back temporarily, run only that "
     "test, and restore the fix.",
     ("run_command", {"command": "sed -i 's/frame_budget.min(lim)/frame_budget.max(lim)/' crates/backburner-engine/src/offload/flow.rs && "
                                 "cargo test -p backburner-engine --test offload_limits pages_go_in_puts 2>&1 | tail -30; "
                                 "sed -i 's/frame_budget.max(lim)/frame_budget.min(lim)/' crates/backburner-engine/src/offload/flow.rs && "
                                 "grep -n 'frame_budget.m' crates/backburner-engine/src/offload/flow.rs",
                      "timeout_s": 900},
      f"""exit status: 0
   Compiling backburner-engine v0.1.0 (/home/dev/backburner/crates/backburner-engine)
    Finished `test` profile [optimized + debuginfo] target(s) in 39.12s
     Running tests/offload_limits.rs (target/debug/deps/offload_limits-5b0e6d2c9a17f3e4)

running 1 test
test pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts ... FAILED

failures:

---- pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts stdout ----

thread 'pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts' panicked at crates/backburner-engine/tests/worker_common/mod.rs:{WC_PREFILL}:
called `Result::unwrap()` on an `Err` value: KvBudget {{ budget: 320, need: 448, why: "no worker can take the oldest pages: the worker holding positions 0..64 was lost (link I/O error: Connection reset by peer (os error 104)) and the history does not fit the budget locally" }}
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace


failures:
    pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts

test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 4 filtered out; finished in 1.37s

error: test failed, to rerun pass `--test offload_limits`
{line_of(flow_fixed(), "frame_budget.min(lim)")}:                w.link.settings.frame_budget.min(lim)"""))

step("Without the fix the test fails the way the user's host did: the first two-page put (128 KiB) is refused at "
     "its header, the worker is lost with the page it held, and with no other worker and a 320-position budget the "
     "host cannot rebuild the 448 positions locally, so the prefill fails. With the fix it passes, and the fix is "
     f"restored (line {line_of(flow_fixed(), 'frame_budget.min(lim)')} reads `min`).\n\n"
     "The specification should say the same as §6.1 does for Sync/Fetch, so that the two cannot drift apart again. "
     "I'll make §5.11's sentence name the bound explicitly.",
     ("apply_patch", {"patch": udiff(PROTOCOL, blob(PROTOCOL), proto_fixed())}, applied(PROTOCOL, udiff(PROTOCOL, blob(PROTOCOL), proto_fixed()))))

step("Now the other offload and worker-page tests, and clippy on the engine with its tests.",
     ("run_command", {"command": "cargo test -p backburner-engine --test offload_link --test offload_local --test worker_pages "
                                 "--test offload_limits 2>&1 | grep -E '^(test result|running|error)' ; "
                                 "cargo clippy -p backburner-engine --tests -- -D warnings 2>&1 | tail -3",
                      "timeout_s": 1200},
      """exit status: 0
running 5 tests
test result: ok. 5 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 8.11s
running 6 tests
test result: ok. 6 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 21.64s
running 2 tests
test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.47s
running 3 tests
test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 5.02s
    Checking backburner-engine v0.1.0 (/home/dev/backburner/crates/backburner-engine)
    Finished `dev` profile [unoptimized + debuginfo] target(s) in 18.40s"""))

step("Everything passes and clippy is clean. A last look at the whole change:",
     ("git_diff", {},
      udiff(FLOW, blob(FLOW).replace(PLANTED_BUG[1], PLANTED_BUG[0]).replace(PLANTED_BUG[0], PLANTED_BUG[1]), flow_fixed())
      .replace(f"--- a/{FLOW}\n", f"diff --git a/{FLOW} b/{FLOW}\nindex 3c1e9a4..8f02b7d 100644\n--- a/{FLOW}\n")
      + udiff(LIMITS_TEST, limits_v0(), limits_v2())
      .replace(f"--- a/{LIMITS_TEST}\n", f"diff --git a/{LIMITS_TEST} b/{LIMITS_TEST}\nindex 9d4a771..e06b3c2 100644\n--- a/{LIMITS_TEST}\n")
      + udiff(PROTOCOL, blob(PROTOCOL), proto_fixed())
      .replace(f"--- a/{PROTOCOL}\n", f"diff --git a/{PROTOCOL} b/{PROTOCOL}\nindex 61b0f3e..a4c2d95 100644\n--- a/{PROTOCOL}\n")))

FINAL = """Fixed. The host sized its `PagesPut` frames with the larger of its own frame budget and the worker's limit instead of the smaller.

**Root cause.** `OffloadFlow::pages_per_frame` (crates/backburner-engine/src/offload/flow.rs) computed the frame bound as `frame_budget.max(max_frame)`. With the host's default budget (256 MiB) and your worker's 16 MiB, every move of up to 32 pages went out as one frame. In your setup one page of all 8 attention layers is 8 MiB, so a move of 3 pages is a 24 MiB frame (the 25165824 bytes in your log), while moves of 1 or 2 pages still fit. The worker refuses such a frame at its header (`FrameTooLarge`), sends `Error{Malformed}`, and closes lingering. But its lingering close drains at most 16 MiB of what the host is still sending, so it closed with unread bytes. The kernel then reset the connection, which destroyed the `Error` frame, and your host saw `Connection reset by peer`, treated the worker as lost and re-ingested the history. The split-prefill path (`rows_per_frame`) already took the minimum, and §6.1 of the protocol specifies it.

**Changes**
- `crates/backburner-engine/src/offload/flow.rs`: `pages_per_frame` takes `frame_budget.min(max_frame)` over all workers (still at least one page per put), and its comment says why.
- `crates/backburner-engine/tests/offload_limits.rs`: new test `pages_go_in_puts_within_a_workers_frame_bound_smaller_than_the_hosts`. A worker has a 96 KiB `max_frame` under a host budget of 256 KiB, with f32 KV so that each 128-token step moves 128 KiB of pages. The test checks that the logits equal the local run and that there is no offload failure or fallback. I checked that it fails without the fix (the worker is lost at the first two-page put and the session cannot be rebuilt within its budget) and passes with it.
- `docs/PROTOCOL.md` §5.11: put frames carry as many pages as fit `min(frame budget, max_frame of every worker)`, as §6.1 already says for `Sync`/`Fetch`.

**Ran:** `cargo test -p backburner-engine` for `offload_limits`, `offload_link`, `offload_local` and `worker_pages` (all pass), and `cargo clippy -p backburner-engine --tests -- -D warnings` (clean).

**Noticed, left alone:**
- The worker's lingering close drains at most 16 MiB (`linger_close(16 << 20, …)`, documented in §6.6). Any refused request larger than that still reaches the host as a reset instead of a typed error. The host then treats that as losing the worker, which is safe, but the message is less helpful. Draining the whole declared body would let a peer hold the worker's connection thread for up to 1 GiB, so I'd keep the cap. If you want the typed error, a better option is for the host to read the pending `Error` when its send fails (§5.10), before falling back.
- Your worker's 16 MiB bound also limits the other frames of a session. For example, a 4096-token `Attend` of a model with 16 query heads of 256 dims is 64 MiB of queries, and the worker refuses it with `BadState`/`FrameTooLarge`. If you keep 16 MiB, run the host with a smaller `--ubatch`."""


# ---------------------------------------------------------------------------------------------------------------
# assembling


def build():
    turns = [{"messages": [{"role": "user", "content": USER}]}]
    n = 0
    for text, calls in STEPS:
        tcs, results = [], []
        for name, args, result in calls:
            n += 1
            cid = f"call_{n:02d}_{name}"
            tcs.append({"id": cid, "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            results.append({"role": "tool", "tool_call_id": cid, "content": result})
        turns.append({"messages": [{"role": "assistant", "content": text, "tool_calls": tcs}] + results})
    final = {"role": "assistant", "content": FINAL}
    about = (
        "A multi-turn coding-agent session written for Backburner's `bench session`: a user reports that an embedded "
        "worker with a 16 MiB max_frame drops the host's connection; the agent searches and reads the repository, "
        "finds the bug, patches it, adds a regression test, runs cargo and answers. Hand-written by the Backburner "
        "project; the files shown in tool results are quoted from this repository at commit "
        f"{PINNED_COMMIT}, with one fictional edit (offload/flow.rs pages_per_frame uses .max instead of .min: the "
        "planted bug). Command outputs are written, not recorded. Request k = [system] + the messages of turns "
        "0..=k; the recorded reply to request k is the first message of turn k+1, or `final` for the last turn. "
        "Generated by scripts/make_agent_session.py; see assets/agent-session/README.md."
    )
    return {"about": about, "model_hint": "qwen3.5", "source_commit": PINNED_COMMIT, "system": SYSTEM,
            "tools": TOOLS, "turns": turns, "final": final}


def for_template(msgs):
    """Messages as the chat template wants them: tool-call arguments parsed into mappings."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": json.loads(tc["function"]["arguments"])}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def counter():
    import jinja2
    from tokenizers import Tokenizer

    with gzip.open(os.path.join(ROOT, "assets", "qwen3.5", "tokenizer.json.gz"), "rb") as f:
        raw = f.read()
    with tempfile.NamedTemporaryFile(suffix=".json") as t:
        t.write(raw)
        t.flush()
        tok = Tokenizer.from_file(t.name)

    def raise_exception(m):
        raise jinja2.TemplateError(m)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    # as transformers' chat templates: no key sorting, no HTML escaping
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    with open(os.path.join(ROOT, "assets", "qwen3.5", "chat_template.jinja")) as f:
        tpl = env.from_string(f.read())

    def count(data, msgs, gen=True):
        text = tpl.render(messages=for_template([{"role": "system", "content": data["system"]}] + msgs),
                          tools=data["tools"], add_generation_prompt=gen)
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count


def report(data):
    count = counter()
    msgs, rows = [], []
    for k, t in enumerate(data["turns"]):
        msgs = msgs + t["messages"]
        rows.append((k, len(t["messages"]), count(data, msgs)))
    full = count(data, msgs + [data["final"]], gen=False)
    return rows, full


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    ap.add_argument("--no-count", action="store_true", help="skip token counting")
    a = ap.parse_args()
    data = build()
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    if a.check:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                sys.exit(f"{OUT} is stale: rerun scripts/make_agent_session.py")
        print(f"{OUT} is up to date")
    else:
        with open(OUT, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {OUT} ({len(text.encode())} bytes, {len(data['turns'])} turns)")
    if not a.no_count:
        rows, full = report(data)
        print("turn  messages  request tokens (cumulative, with the generation prompt)")
        for k, n, c in rows:
            print(f"{k:>4}  {n:>8}  {c:>6}")
        print(f"whole session with the final answer: {full} tokens")


if __name__ == "__main__":
    main()
