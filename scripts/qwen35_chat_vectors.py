"""Records how transformers renders the Qwen3.5 chat template for a few conversations, so the Rust minijinja
rendering can be tested against it without Python. Run with the fixtures venv (transformers installed):

    .venv-fixtures/bin/python scripts/qwen35_chat_vectors.py .venv-tokenizer/build/tokenizer.json

Writes assets/qwen3.5/chat_vectors.json.
"""
import json
import sys
from pathlib import Path

from transformers import PreTrainedTokenizerFast

root = Path(__file__).resolve().parent.parent
assets = root / "assets" / "qwen3.5"
cfg = json.loads((assets / "tokenizer_config.json").read_text())
tok = PreTrainedTokenizerFast(tokenizer_file=sys.argv[1], eos_token="<|im_end|>", pad_token="<|endoftext|>")
tok.chat_template = cfg["chat_template"]

conversations = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about a slow cable."}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]
out = []
for msgs in conversations:
    for agp in (True, False):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
        out.append({"messages": msgs, "add_generation_prompt": agp, "text": text, "ids": tok.encode(text, add_special_tokens=False)})
(assets / "chat_vectors.json").write_text(json.dumps({"about": "transformers apply_chat_template renderings of the Qwen3.5 template", "cases": out}, ensure_ascii=False, indent=1) + "\n")
print(f"wrote {len(out)} cases")
