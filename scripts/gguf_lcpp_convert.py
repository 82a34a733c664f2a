#!/usr/bin/env python3
"""Run llama.cpp's own convert_hf_to_gguf.py on a tiny fixture checkpoint, for the cross-check in
scripts/make_gguf_fixtures.py. Runs under a python that has llama.cpp's converter requirements (torch,
transformers 4.57.6); LCPP_SRC is llama.cpp's source tree.

The only change to the converter: the tiny fixtures' BPE tokenizer was trained here, so its pre-tokenizer hash is
not in the converter's table of known tokenizers, and get_vocab_base_pre would refuse it. When (and only when) the
hash is unknown, it answers "qwen35", the name the converter gives to Qwen3.5's own tokenizer (the fixtures use the
same split regex). Every tensor, hyper-parameter and the rest of the vocabulary go through the unmodified code.

usage: gguf_lcpp_convert.py MODEL_DIR --outfile OUT.gguf --outtype f32|bf16|f16 --no-mtp [--split-max-tensors N]
"""
import os
import sys

LCPP = os.environ["LCPP_SRC"]
sys.path.insert(0, LCPP)
sys.path.insert(1, os.path.join(LCPP, "gguf-py"))

from conversion import base  # noqa: E402

_original = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return _original(self, tokenizer)
    except NotImplementedError:
        return "qwen35"


base.TextModel.get_vocab_base_pre = get_vocab_base_pre

import convert_hf_to_gguf  # noqa: E402

if __name__ == "__main__":
    convert_hf_to_gguf.main()
