#!/usr/bin/env python3
"""Generate the GGUF fixtures under fixtures/gguf/ (llama.cpp's file format, architecture `qwen35`).

1. Conversions of the existing tiny checkpoints (fixtures/tiny-f32, tiny-bf16, tiny-hub), written here with gguf-py's
   GGUFWriter while applying exactly the transforms of llama.cpp's convert_hf_to_gguf.py (Qwen3_5TextModel): tensor
   renames, V heads reordered from grouped to tiled, A_log stored as -exp(A_log), RMSNorm1p weights stored as 1+w,
   conv1d squeezed, 1-D tensors and ssm_conv1d kept F32, every metadata key the converter writes and the tokenizer
   keys. The hub checkpoint is written as two split files, tagged the way llama.cpp splits files.
2. `tiny-q`: a random model of the real architecture with every matrix input width a multiple of 256, written as an HF
   checkpoint (temporary) and converted to an f32 GGUF (temporary), then quantized: Q8_0 and Q4_0 with gguf-py's
   reference quantizers, laid out as llama-quantize lays out a file; Q4_K, Q6_K and IQ4_XS with llama.cpp's
   `llama-quantize --pure` (Q5_K is left out to keep fixtures/ small; see QUANT_FORMATS).
3. References for the tiny-q files: transformers float32 logits of the dequantized weights (loaded back into
   Qwen3_5ForCausalLM with every converter transform undone), llama.cpp's greedy ids / logits and perplexity on the
   same files, and per-tensor check values of the dequantized tensors.
4. A cross-check of this writer against llama.cpp's own converter, run on the same checkpoints: every tensor (name,
   shape, type, bytes) and every metadata key, and the file bytes.

Run through scripts/make_gguf_fixtures.sh (pinned virtualenv, llama.cpp locations). Everything is seeded; a rerun
rewrites the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
FIX = ROOT / "fixtures"
OUT = FIX / "gguf"

EXPECTED_TRANSFORMERS = "5.23.0"
EXPECTED_GGUF = "0.19.0"
ARCH = "qwen35"

# ----------------------------------------------------------------------------------------------------------------
# What convert_hf_to_gguf.py (Qwen3_5TextModel) writes, restated
# ----------------------------------------------------------------------------------------------------------------

# HF name (after `model.language_model.` -> `model.`) -> GGUF name. `{i}` is the layer.
NAME_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.linear_attn.in_proj_qkv.weight": "blk.{i}.attn_qkv.weight",
    "model.layers.{i}.linear_attn.in_proj_z.weight": "blk.{i}.attn_gate.weight",
    "model.layers.{i}.linear_attn.in_proj_a.weight": "blk.{i}.ssm_alpha.weight",
    "model.layers.{i}.linear_attn.in_proj_b.weight": "blk.{i}.ssm_beta.weight",
    "model.layers.{i}.linear_attn.conv1d.weight": "blk.{i}.ssm_conv1d.weight",
    "model.layers.{i}.linear_attn.dt_bias": "blk.{i}.ssm_dt.bias",  # the converter renames it .dt_proj.bias first
    "model.layers.{i}.linear_attn.A_log": "blk.{i}.ssm_a",  # no suffix
    "model.layers.{i}.linear_attn.norm.weight": "blk.{i}.ssm_norm.weight",
    "model.layers.{i}.linear_attn.out_proj.weight": "blk.{i}.ssm_out.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
_LAYER_RE = re.compile(r"^(model\.layers\.|blk\.)(\d+)\.")


def _templ(name: str) -> tuple[str, int | None]:
    m = _LAYER_RE.match(name)
    if not m:
        return name, None
    return m.group(1) + "{i}." + name[m.end():], int(m.group(2))


GGUF_TO_HF = {v: k for k, v in NAME_MAP.items()}


def hf_to_gguf_name(name: str) -> str:
    t, i = _templ(name)
    return NAME_MAP[t].format(i=i)


def gguf_to_hf_name(name: str) -> str:
    t, i = _templ(name)
    return GGUF_TO_HF[t].format(i=i)


# The Qwen3.5 chat/pre-tokenizer name in llama.cpp (convert_hf_to_gguf.py maps Qwen3.5's tokenizer hash to it).
TOKENIZER_PRE = "qwen35"
# _Qwen35MRopeMixin: written when rope_parameters has no mrope_section (whatever the rotary width).
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED = 1, 3, 4, 5
FTYPE = {"f32": (gguf.LlamaFileType.ALL_F32, QT.F32), "f16": (gguf.LlamaFileType.MOSTLY_F16, QT.F16),
         "bf16": (gguf.LlamaFileType.MOSTLY_BF16, QT.BF16)}


def load_hparams(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    hp = dict(cfg)
    if "text_config" in cfg:  # the converter moves text_config to the root level
        hp.update(cfg["text_config"])
    return hp


def hf_tensor_order(model_dir: Path) -> list[tuple[str, str, str]]:
    """(file, stored name, converter name) in the order the converter reads them: shard files sorted (from the index
    when there is one), names sorted within each file. Vision tower and MTP tensors are dropped (--no-mtp)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        parts = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        parts = sorted(p for p in os.listdir(model_dir) if p.startswith("model") and p.endswith(".safetensors"))
    out = []
    for part in parts:
        with safe_open(str(model_dir / part), framework="pt") as f:
            keys = sorted(f.keys())
        for k in keys:
            if "visual." in k or "vision" in k:
                continue
            name = k.replace("language_model.", "") if "language_model." in k else k
            if name.startswith("mtp.") or name.startswith("model.mtp."):
                continue  # --no-mtp
            out.append((part, k, name))
    return out


def tile_v_heads(t: torch.Tensor, dim: int, n_k: int, r: int, head_dim: int) -> torch.Tensor:
    """V heads grouped by k head [g0v0..g0v(r-1), g1v0, ...] -> tiled [g0v0, g1v0, ..., g0v1, g1v1, ...] along dim."""
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], n_k, r, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(*shape)


def untile_v_heads(t: torch.Tensor, dim: int, n_k: int, r: int, head_dim: int) -> torch.Tensor:
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], r, n_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(*shape)


def converter_transform(name: str, t: torch.Tensor, hp: dict) -> tuple[str, torch.Tensor]:
    """One HF tensor -> (GGUF name, tensor), in the converter's order of operations and dtypes."""
    if t.dtype not in (torch.float16, torch.float32):
        t = t.to(torch.float32)  # bf16 -> f32 before any arithmetic; f16 stays f16
    n_k, n_v = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    if n_k != n_v and "linear_attn." in name:
        dk, dv, r = hp["linear_key_head_dim"], hp["linear_value_head_dim"], n_v // n_k
        if ".in_proj_qkv." in name:
            qk = 2 * n_k * dk
            t = torch.cat([t[:qk], tile_v_heads(t[qk:], 0, n_k, r, dv)], dim=0)
        elif ".in_proj_z." in name:
            t = tile_v_heads(t, 0, n_k, r, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            t = tile_v_heads(t, 0, n_k, r, 1)
        elif name.endswith(".A_log") or name.endswith(".dt_bias"):
            t = tile_v_heads(t.unsqueeze(-1), 0, n_k, r, 1).squeeze(-1)
        elif ".conv1d" in name:
            t = t.squeeze()
            qk = 2 * n_k * dk
            t = torch.cat([t[:qk], tile_v_heads(t[qk:], 0, n_k, r, dv)], dim=0)
        elif ".out_proj." in name:
            t = tile_v_heads(t, 1, n_k, r, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)  # in the tensor's dtype (f16 for an f16 checkpoint)
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1  # RMSNorm1p weights: 1 + w, in the tensor's dtype
    return hf_to_gguf_name(name), t


def converter_qtype(gname: str, ndim: int, file_qtype: QT) -> QT:
    if ndim <= 1 or gname.endswith("_norm.weight"):
        return QT.F32
    if ".ssm_conv1d." in gname or not gname.endswith(".weight"):
        return QT.F32
    return file_qtype


def vocab_entries(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    reverse = {i: s for s, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        reverse[i] = a["content"]
    assert max(reverse) < vocab_size
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_TYPE_UNUSED)
            continue
        s = reverse[i]
        if i in added:
            looks_special = s.startswith("<|") and s.endswith("|>")
            types.append(TOKEN_TYPE_CONTROL if added[i]["special"] or looks_special else TOKEN_TYPE_USER_DEFINED)
        else:
            types.append(TOKEN_TYPE_NORMAL)
        tokens.append(s)
    return tokens, types


def special_vocab(model_dir: Path) -> dict:
    """merges, special token ids, add_*_token flags and chat template, as gguf-py's SpecialVocab reads them."""
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    merges = []
    for m in tj["model"]["merges"]:
        if isinstance(m, str):
            merges.append(m)
        else:
            merges.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m))
    assert tj.get("post_processor") is None, "only tokenizers without a post_processor are handled here"
    types = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
    ids: dict[str, int] = {}
    add: dict[str, bool] = {}
    added = tj.get("added_tokens", [])
    for typ in types:
        flag = tc.get(f"add_{typ}_token")
        if isinstance(flag, bool):
            add[typ] = flag
        entry = tc.get(f"{typ}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not isinstance(content, str):
            continue
        tid = next((a["id"] for a in added if a["content"] == content), None)
        if isinstance(tid, int) and typ not in ids:
            ids[typ] = tid
    cfg = json.loads((model_dir / "config.json").read_text())
    for typ in types:
        tid = cfg.get(f"{typ}_token_id")
        if tid is None and "text_config" in cfg:
            tid = cfg["text_config"].get(f"{typ}_token_id")
        if isinstance(tid, int) and typ not in ids:
            ids[typ] = tid
    template = None
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    elif (model_dir / "chat_template.json").is_file():
        template = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    template = tc.get("chat_template", template)
    return dict(merges=merges, ids=ids, add=add, chat_template=template)


def model_display_name(model_dir: Path) -> str:
    # gguf-py's Metadata heuristics with no model card: the directory name, title-cased word by word
    return " ".join(w.title() if w.islower() and not re.match(r"^(v\d+(?:\.\d+)*|\d.*)$", w) else w
                    for w in model_dir.name.strip().replace("-", " ").split())


def convert_hf(model_dir: Path, out_path: Path, outtype: str, split_max_tensors: int = 0) -> dict:
    """Write model_dir as GGUF, as `convert_hf_to_gguf.py --outtype <outtype> --no-mtp [--split-max-tensors N]`."""
    hp = load_hparams(model_dir)
    ftype, file_qtype = FTYPE[outtype]
    w = gguf.GGUFWriter(path=None, arch=ARCH, split_max_tensors=split_max_tensors)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, hp["num_hidden_layers"])
    written = []
    handles = {}
    for part, key, name in hf_tensor_order(model_dir):
        if part not in handles:
            handles[part] = safe_open(str(model_dir / part), framework="pt")
        t = handles[part].get_tensor(key)
        src_dtype = str(t.dtype).replace("torch.", "")
        gname, t = converter_transform(name, t, hp)
        lookup = name[: -len(".dt_bias")] + ".dt_proj.bias" if name.endswith(".dt_bias") else name
        assert name_map.get_name(lookup, try_suffixes=(".weight", ".bias")) == gname, (name, gname)
        data = t.numpy()
        qtype = converter_qtype(gname, data.ndim, file_qtype)
        data = gguf.quants.quantize(data, qtype)
        w.add_tensor(gname, data, raw_dtype=qtype)
        written.append(dict(hf=key, gguf=gname, hf_dtype=src_dtype, type=qtype.name,
                            shape_ggml=list(reversed(t.shape))))
    handles.clear()

    total, shared, expert, n_expert = w.get_total_parameter_count()
    # ---- metadata, in the converter's order ----
    w.add_type("model")
    w.add_name(model_display_name(model_dir))
    w.add_size_label(gguf.size_label(total, shared, expert, n_expert))
    # TextModel.set_gguf_parameters
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or {}
    if "mrope_section" in rope:
        sec = list(rope["mrope_section"]) + [0] * max(0, 4 - len(rope["mrope_section"]))
        w.add_rope_dimension_sections(sec[:4])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)
    # Qwen3NextModel.set_gguf_parameters
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if hp.get("layer_types") is not None:
        assert len(hp["layer_types"]) == hp["num_hidden_layers"]
        # {arch}.attention.recurrent_layers (gguf-py 0.19.0 on PyPI has no add_ method for it yet)
        w.add_array(f"{ARCH}.attention.recurrent_layers", [lt == "linear_attention" for lt in hp["layer_types"]])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(hp["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    # _Qwen35MRopeMixin
    if "mrope_section" not in rope:
        w.add_rope_dimension_sections(DEFAULT_MROPE_SECTION)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # TextModel.set_vocab -> _set_vocab_gpt2
    tokens, toktypes = vocab_entries(model_dir, hp["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(TOKENIZER_PRE)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    sv = special_vocab(model_dir)
    w.add_token_merges(sv["merges"])
    for typ, tid in sv["ids"].items():
        getattr(w, f"add_{typ}_token_id")(tid)
    for typ, flag in sv["add"].items():
        getattr(w, f"add_add_{typ}_token")(flag)
    if sv["chat_template"] is not None:
        w.add_chat_template(sv["chat_template"])

    w.write_header_to_file(path=out_path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    files = w.format_shard_names(out_path)
    return dict(files=[p.name for p in files], tensors=written, n_params=total, ftype=ftype.name,
                special_ids=sv["ids"], add_flags=sv["add"])


# ----------------------------------------------------------------------------------------------------------------
# Reading GGUF back
# ----------------------------------------------------------------------------------------------------------------


def field_value(f):
    if f.types[0] == VT.ARRAY:
        return list(f.contents())
    return f.contents()


def read_gguf(path: Path) -> tuple[list[tuple[str, int, int | None, object]], list]:
    r = gguf.GGUFReader(str(path))
    kv = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == VT.ARRAY else None
        kv.append((name, int(f.types[0]), None if sub is None else int(sub), field_value(f)))
    return kv, r.tensors


def dequantized(t) -> np.ndarray:
    """A reader tensor as float32 in numpy order (= HF [out, in] order for matrices)."""
    shape = tuple(int(x) for x in reversed(t.shape))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def a_log_of(a: torch.Tensor) -> torch.Tensor:
    """A_log = log(-A) in f32, nudged by an ulp or two where that makes -exp(A_log) give back A's exact bits
    (log then exp does not always round-trip in f32). exp is evaluated on the whole vector, as transformers does."""
    t = torch.log(-a)
    for i in range(t.numel()):
        if torch.equal((-torch.exp(t))[i], a[i]):
            continue
        up, down = t[i].clone(), t[i].clone()
        for _ in range(4):
            up = torch.nextafter(up, torch.tensor(float("inf")))
            down = torch.nextafter(down, torch.tensor(float("-inf")))
            for c in (up, down):
                cand = t.clone()
                cand[i] = c
                if torch.equal((-torch.exp(cand))[i], a[i]):
                    t = cand
                    break
            else:
                continue
            break
    return t


def gguf_to_hf_state(tensors: dict[str, np.ndarray], hp: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Undo the converter transforms: GGUF tensors (float32) -> an HF state dict (float32)."""
    n_k, n_v = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv, r = hp["linear_key_head_dim"], hp["linear_value_head_dim"], n_v // n_k
    out, notes = {}, dict(a_log_roundtrip_max_abs=0.0, a_log_roundtrip_exact=True, norm_minus_one_exact=True,
                         norm_minus_one_max_abs=0.0)
    for gname, arr in tensors.items():
        hname = gguf_to_hf_name(gname)
        t = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
        if gname.endswith(".ssm_a"):
            a = t
            t = a_log_of(a)  # A_log; transformers then computes -exp(A_log)
            back = -torch.exp(t)
            d = float((back.double() - a.double()).abs().max())
            notes["a_log_roundtrip_max_abs"] = max(notes["a_log_roundtrip_max_abs"], d)
            notes["a_log_roundtrip_exact"] &= bool(torch.equal(back, a))
        elif gname.endswith("_norm.weight") and not gname.endswith(".ssm_norm.weight"):
            W = t
            t = W - 1
            back = 1 + t
            d = float((back.double() - W.double()).abs().max())
            notes["norm_minus_one_max_abs"] = max(notes["norm_minus_one_max_abs"], d)
            notes["norm_minus_one_exact"] &= bool(torch.equal(back, W))
        if n_k != n_v and (".attn_qkv." in gname or ".attn_gate." in gname or ".ssm_" in gname):
            if ".attn_qkv." in gname:
                qk = 2 * n_k * dk
                t = torch.cat([t[:qk], untile_v_heads(t[qk:], 0, n_k, r, dv)], dim=0)
            elif ".attn_gate." in gname:
                t = untile_v_heads(t, 0, n_k, r, dv)
            elif ".ssm_alpha." in gname or ".ssm_beta." in gname:
                t = untile_v_heads(t, 0, n_k, r, 1)
            elif gname.endswith(".ssm_a") or ".ssm_dt." in gname:
                t = untile_v_heads(t.unsqueeze(-1), 0, n_k, r, 1).squeeze(-1)
            elif ".ssm_conv1d." in gname:
                qk = 2 * n_k * dk
                t = torch.cat([t[:qk], untile_v_heads(t[qk:], 0, n_k, r, dv)], dim=0)
            elif ".ssm_out." in gname:
                t = untile_v_heads(t, 1, n_k, r, dv)
        if ".ssm_conv1d." in gname:
            t = t.unsqueeze(1)  # [C, K] -> [C, 1, K]
        out[hname] = t.contiguous()
    return out, notes


def causal_config_dict(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    if "text_config" in cfg:
        tc = dict(cfg["text_config"])
        tc["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
        tc["architectures"] = ["Qwen3_5ForCausalLM"]
        tc["model_type"] = "qwen3_5_text"
        return tc
    return cfg


def write_hf_dir(d: Path, cfg: dict, state: dict[str, torch.Tensor]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def load_f32(d: Path):
    model = Qwen3_5ForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, (n, p.dtype)
    return model


def forward(model, ids, cache=None):
    return model(input_ids=torch.tensor([ids], dtype=torch.long), past_key_values=cache, use_cache=cache is not None)


@torch.no_grad()
def greedy_run(model, prompt_ids: list[int], n_steps: int, forced: list[int] | None = None) -> dict:
    """Prefill logits [T, V]; then n_steps decode rows (row 0 = last prefill row, row s = cached step fed token s-1).
    Greedy (argmax of raw logits) unless `forced` tokens are given."""
    cache = transformers.DynamicCache(config=model.config)
    prefill = forward(model, prompt_ids, cache).logits[0].float()
    rows, toks, margins = [], [], []
    logits = prefill[-1]
    for s in range(n_steps):
        rows.append(logits.clone())
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        t = int(torch.argmax(logits)) if forced is None else forced[s]
        toks.append(t)
        if s + 1 < n_steps:
            logits = forward(model, [t], cache).logits[0, -1].float()
    return dict(prefill=prefill, decode=torch.stack(rows), tokens=toks, margins=margins)


@torch.no_grad()
def ppl_lcpp_convention(model, ids: list[int], n_ctx: int) -> dict:
    """llama-perplexity's estimate: chunks of n_ctx tokens from an empty state, only the second half scored
    (positions n_ctx/2 .. n_ctx-2 predict the next token), no BOS (the vocab has add_bos false)."""
    first = n_ctx // 2
    nll, count = 0.0, 0
    n_chunk = len(ids) // n_ctx
    for c in range(n_chunk):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        lg = forward(model, chunk).logits[0].double()
        lp = F.log_softmax(lg[first:n_ctx - 1], dim=-1)
        tgt = torch.tensor(chunk[first + 1:], dtype=torch.long)
        nll += float(-lp.gather(1, tgt[:, None]).sum())
        count += n_ctx - 1 - first
    return dict(n_ctx=n_ctx, n_chunks=n_chunk, n_scored=count, nll=nll / count, ppl=math.exp(nll / count))


def max_abs(a, b) -> float:
    return float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# tiny-q: a random model whose matrices all have input widths that are multiples of 256
# ----------------------------------------------------------------------------------------------------------------

TINY_Q_SEED = 3456
TINY_Q_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    hidden_act="silu",
    attention_bias=False,
)
# rotary dims R = 128 * 0.25 = 32, so the MRoPE sections cover R/2 = 16 (real Qwen3.5: [11, 11, 10] of 32)
TINY_Q_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [6, 5, 5], "mrope_interleaved": True}
QUANT_FORMATS = [
    # name, GGML type, tool
    ("q8_0", QT.Q8_0, "gguf-py"),
    ("q4_0", QT.Q4_0, "gguf-py"),
    ("q4_k", QT.Q4_K, "llama-quantize"),
    # ("q5_k", QT.Q5_K, "llama-quantize"),  # left out to keep fixtures/ small (+1.4 MB); uncomment to add it
    ("q6_k", QT.Q6_K, "llama-quantize"),
    ("iq4_xs", QT.IQ4_XS, "llama-quantize"),
]
# llama_ftype values that llama-quantize writes in general.file_type for these type names
LLAMA_FTYPE = {"q8_0": 7, "q4_0": 2, "q4_k": 15, "q5_k": 17, "q6_k": 18, "iq4_xs": 30}
LLAMA_QUANTIZE_NAME = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K",
                       "iq4_xs": "IQ4_XS"}
# make_fixtures.py draws the embedding from N(0, 0.5) at hidden 64, i.e. N(0, 4/sqrt(H)); the same rule at H = 256
# keeps the logits' spread as in the tiny fixtures (std ~4; N(0, 0.5) here gives std ~8 and a greedy loop on 2 ids).
EMBED_STD = 4.0 / math.sqrt(TINY_Q_SHAPE["hidden_size"])
N_PROMPT = 24
N_DECODE = 16
PPL_CTX = 64


def build_tiny_q(d: Path) -> None:
    """HF checkpoint (config.json, model.safetensors f32, tokenizer files) of the tiny-q model into d."""
    torch.manual_seed(TINY_Q_SEED)
    src = FIX / "tiny-f32"
    cfg = Qwen3_5TextConfig(
        **TINY_Q_SHAPE, rope_parameters=dict(TINY_Q_ROPE), full_attention_interval=4, tie_word_embeddings=True,
        eos_token_id=json.loads((src / "config.json").read_text())["eos_token_id"], bos_token_id=None,
        pad_token_id=None,
    )
    cfg.full_attention_interval = 4
    model = Qwen3_5ForCausalLM(cfg).eval()
    rng = np.random.default_rng(TINY_Q_SEED)

    def normal(shape, std, mean=0.0):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)

    with torch.no_grad():
        for name, p in model.named_parameters():  # deduplicated: the tied lm_head is the embedding
            shape = tuple(p.shape)
            if name.endswith("embed_tokens.weight"):
                v = normal(shape, EMBED_STD)
            elif name.endswith("linear_attn.norm.weight"):
                v = normal(shape, 0.2, mean=1.0)
            elif name.endswith("norm.weight"):
                v = normal(shape, 0.2)
            elif name.endswith("A_log"):
                v = np.log(rng.random(shape, dtype=np.float32) * np.float32(1.9) + np.float32(0.1))
            elif name.endswith("dt_bias") or name.endswith("conv1d.weight"):
                v = normal(shape, 0.5)
            elif p.ndim == 2:
                v = normal(shape, 1.0 / math.sqrt(shape[1]))
            else:
                raise RuntimeError(f"unexpected parameter {name} {shape}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)))
    d.mkdir(parents=True)
    model.save_pretrained(str(d))
    eot = 445
    GenerationConfig(bos_token_id=None, eos_token_id=[447, eot], pad_token_id=eot).save_pretrained(str(d))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)


def quantize_like_llama_quantize(src: Path, dst: Path, fmt: str, qtype: QT) -> list[dict]:
    """Quantize an f32 GGUF with gguf-py's reference quantizer, laid out as `llama-quantize --pure` writes files:
    metadata copied in order with general.quantization_version and general.file_type moved to the end, tensors
    sorted by (layer, name) with the non-layer tensors first, every 2-D `*weight` tensor that is not a norm and not
    ssm_conv1d quantized (token_embd included), the rest kept as they are."""
    kv, tensors = read_gguf(src)
    w = gguf.GGUFWriter(path=None, arch=ARCH)
    for name, vtype, sub, val in kv:
        if name in ("general.architecture", "general.quantization_version", "general.file_type"):
            continue
        w.add_key_value(name, val, VT(vtype), None if sub is None else VT(sub))
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    w.add_uint32("general.file_type", LLAMA_FTYPE[fmt])

    def order(t):
        m = re.match(r"^blk\.(\d+)\.", t.name)
        return (int(m.group(1)) if m else -1, t.name)

    info = []
    for t in sorted(tensors, key=order):
        arr = dequantized(t)  # F32 source: the exact values
        ok = (arr.ndim >= 2 and t.name.endswith("weight") and "_norm.weight" not in t.name
              and "ssm_conv1d" not in t.name)
        tt = qtype if ok else QT(t.tensor_type)
        w.add_tensor(t.name, gguf.quants.quantize(arr, tt), raw_dtype=tt)
        info.append(dict(name=t.name, type=tt.name))
    w.write_header_to_file(path=dst)
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return info


def tensor_checks(path: Path) -> dict:
    _, tensors = read_gguf(path)
    out = {}
    for t in tensors:
        a = dequantized(t).astype(np.float64)
        row0 = a.reshape(-1, a.shape[-1])[0] if a.ndim > 1 else a
        out[t.name] = dict(type=QT(t.tensor_type).name, shape_ggml=[int(x) for x in t.shape],
                           n_bytes=int(t.n_bytes), sum=float(a.sum()), sum_sq=float((a * a).sum()),
                           row0_first8=[float(x) for x in row0[:8]])
    return out


# ----------------------------------------------------------------------------------------------------------------
# llama.cpp
# ----------------------------------------------------------------------------------------------------------------


class Lcpp:
    def __init__(self, bin_dir: Path | None, src: Path | None, py: Path | None):
        self.bin = bin_dir
        self.src = src
        self.py = py

    def has(self, tool: str) -> bool:
        return self.bin is not None and (self.bin / tool).is_file()

    def run(self, args: list, **kw) -> subprocess.CompletedProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, **kw)

    def quantize(self, src: Path, dst: Path, fmt: str) -> str:
        p = self.run([self.bin / "llama-quantize", "--pure", src, dst, LLAMA_QUANTIZE_NAME[fmt], 1])
        if p.returncode != 0:
            raise RuntimeError(f"llama-quantize failed: {p.stderr[-2000:]}")
        return p.stdout + p.stderr

    def greedy(self, model: Path, ids: list[int], n: int, tmp: Path) -> dict:
        ids_file, dump = tmp / "ids.txt", tmp / "logits.bin"
        ids_file.write_text(" ".join(map(str, ids)) + "\n")
        if dump.exists():
            dump.unlink()
        p = self.run([self.bin / "greedy_ids", model, ids_file, n, 1, "f32", "off", dump])
        if p.returncode != 0:
            return dict(error=" | ".join(p.stderr.strip().splitlines()[-3:])[:600], returncode=p.returncode)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        logits = np.fromfile(dump, dtype=np.float32).reshape(n, -1)
        return dict(tokens=res["tokens"], top2=res["top2"], margins=res["margins"], logits=logits)

    def perplexity(self, model: Path, text: Path, n_ctx: int, tmp: Path) -> dict:
        kl = tmp / "ppl-base.bin"
        for attempt in range(3):  # one transient failure was seen on the busy build machine; retry
            p = self.run([self.bin / "llama-perplexity", "-m", model, "-f", text, "-c", n_ctx, "-b", n_ctx, "-t", 1,
                          "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--kl-divergence-base", kl])
            m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", p.stdout + p.stderr)
            if p.returncode == 0 and m:
                break
            print(f"warning: llama-perplexity on {model.name} failed (rc {p.returncode}): "
                  f"{(p.stdout + p.stderr)[-800:]}", file=sys.stderr)
        else:
            raise RuntimeError(f"llama-perplexity failed on {model}")
        raw = kl.read_bytes()
        # --kl-divergence-base file: "_logits_" magic, n_ctx, n_vocab, n_chunk (i32 each), then the tokens (i32)
        n_ctx_f, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype=np.int32)
        toks = np.frombuffer(raw[20:20 + 4 * n_ctx_f * n_chunk], dtype=np.int32).tolist()
        return dict(ppl=float(m.group(1)), ppl_err=float(m.group(2)), n_ctx=n_ctx, n_chunks=int(n_chunk),
                    tokens=toks, n_vocab=int(n_vocab))

    def build_dequant_tool(self, tmp: Path) -> Path | None:
        """scripts/gguf_dequant_ggml.c against this build's libggml-base (needs a C compiler and LCPP_SRC)."""
        if self.src is None or shutil.which("cc") is None:
            return None
        exe = tmp / "gguf_dequant_ggml"
        p = self.run(["cc", "-O1", "-I", self.src / "ggml" / "include", SCRIPTS / "gguf_dequant_ggml.c",
                      "-L", self.bin, "-lggml-base", f"-Wl,-rpath,{self.bin}", "-o", exe])
        if p.returncode != 0:
            print(f"warning: cannot build gguf_dequant_ggml: {p.stderr[-1000:]}", file=sys.stderr)
            return None
        return exe

    def convert(self, model_dir: Path, out: Path, outtype: str, split: int = 0) -> str:
        args = [self.py, SCRIPTS / "gguf_lcpp_convert.py", model_dir, "--outfile", out, "--outtype", outtype,
                "--no-mtp"]
        if split:
            args += ["--split-max-tensors", split]
        env = dict(os.environ, LCPP_SRC=str(self.src), OMP_NUM_THREADS="1")
        p = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"llama.cpp converter failed on {model_dir}: {p.stderr[-3000:]}")
        return p.stderr


def ggml_dequant_check(tool: Path | None, path: Path, tmp: Path) -> dict | None:
    """gguf-py's dequantization (what the references and tensor_checks use) vs ggml's own to_float, bit for bit."""
    if tool is None:
        return None
    out = tmp / "ggml-deq.bin"
    p = subprocess.run([str(tool), str(path), str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        return dict(error=p.stderr[-400:])
    raw = out.read_bytes()
    theirs, off = {}, 0
    while off < len(raw):
        n = int.from_bytes(raw[off:off + 4], "little")
        name = raw[off + 4:off + 4 + n].decode()
        off += 4 + n
        cnt = int.from_bytes(raw[off:off + 8], "little")
        off += 8
        theirs[name] = np.frombuffer(raw[off:off + 4 * cnt], dtype=np.float32)
        off += 4 * cnt
    differ = {}
    tensors = read_gguf(path)[1]
    for t in tensors:
        ours = dequantized(t).reshape(-1)
        if ours.tobytes() != theirs[t.name].tobytes():
            differ[t.name] = dict(max_abs_diff=float(np.abs(ours.astype(np.float64) - theirs[t.name]).max()),
                                  n_values_differ=int((ours != theirs[t.name]).sum()))
    return dict(n_tensors=len(tensors), n_bitwise_equal=len(tensors) - len(differ), differing=differ)


def compare_gguf(ours: list[Path], theirs: list[Path]) -> dict:
    """Every metadata key (order, type, value) and every tensor (name, shape, type, bytes); and the file bytes."""
    res = dict(files_identical=[], kv_differences=[], tensor_differences=[], n_kv=[], n_tensors=[])
    for a, b in zip(ours, theirs):
        res["files_identical"].append(a.read_bytes() == b.read_bytes())
        kva, ta = read_gguf(a)
        kvb, tb = read_gguf(b)
        res["n_kv"].append(len(kva))
        res["n_tensors"].append(len(ta))
        if [k[0] for k in kva] != [k[0] for k in kvb]:
            res["kv_differences"].append(dict(file=a.name, what="key order", ours=[k[0] for k in kva],
                                              theirs=[k[0] for k in kvb]))
        db = {k[0]: k for k in kvb}
        for k in kva:
            o = db.get(k[0])
            if o is None:
                res["kv_differences"].append(dict(file=a.name, key=k[0], what="missing in llama.cpp's file"))
            elif o[1:] != k[1:]:
                res["kv_differences"].append(dict(file=a.name, key=k[0], ours=str(k[1:])[:300],
                                                  theirs=str(o[1:])[:300]))
        for k in kvb:
            if k[0] not in {x[0] for x in kva}:
                res["kv_differences"].append(dict(file=a.name, key=k[0], what="only in llama.cpp's file",
                                                  theirs=str(k[1:])[:300]))
        if [t.name for t in ta] != [t.name for t in tb]:
            res["tensor_differences"].append(dict(file=a.name, what="tensor order or names"))
        tbm = {t.name: t for t in tb}
        for t in ta:
            o = tbm.get(t.name)
            if o is None:
                res["tensor_differences"].append(dict(file=a.name, tensor=t.name, what="missing"))
                continue
            same = (list(t.shape) == list(o.shape) and t.tensor_type == o.tensor_type
                    and t.data.tobytes() == o.data.tobytes())
            if not same:
                d = dict(file=a.name, tensor=t.name, ours=[QT(t.tensor_type).name, [int(x) for x in t.shape]],
                         theirs=[QT(o.tensor_type).name, [int(x) for x in o.shape]])
                if list(t.shape) == list(o.shape):
                    da, db_ = dequantized(t), dequantized(o)
                    d["max_abs_diff"] = float(np.abs(da.astype(np.float64) - db_).max())
                    d["n_values_differ"] = int((da != db_).sum())
                res["tensor_differences"].append(d)
    res["all_equal"] = (all(res["files_identical"]) and not res["kv_differences"] and not res["tensor_differences"])
    return res


# ----------------------------------------------------------------------------------------------------------------


def ref_prompt_ids(src_dir: Path) -> list[int]:
    with safe_open(str(src_dir / "reference.safetensors"), framework="pt") as f:
        return f.get_tensor("prompt_ids").tolist()


def ref_prompt(n: int) -> list[int]:
    tok = Tokenizer.from_file(str(FIX / "tiny-f32" / "tokenizer.json"))
    return tok.encode((SCRIPTS / "fixture_prompt.txt").read_text()).ids[:n]


def ppl_ids() -> list[int]:
    tok = Tokenizer.from_file(str(FIX / "tiny-f32" / "tokenizer.json"))
    return tok.encode((SCRIPTS / "fixture_ppl.txt").read_text()).ids


CONVERSIONS = [
    # output stem, source fixture, outtype, split into this many files
    ("tiny-f32", "tiny-f32", "f32", 1),
    ("tiny-bf16", "tiny-bf16", "bf16", 1),
    ("tiny-f16-split", "tiny-hub", "f16", 2),
]


def roundtrip_check(paths: list[Path], src_dir: Path, tmp: Path) -> tuple[dict, dict]:
    """The GGUF read back, converter transforms undone, vs the source checkpoint: the weights, and transformers'
    logits on the fixture's prompt (teacher-forced with the stored greedy tokens) computed here from both, and vs the
    stored reference.safetensors (which was computed on another machine). Returns (report, run on the read-back
    weights with free-running greedy decoding)."""
    hp = load_hparams(src_dir)
    tensors = {}
    for p in paths:
        for t in read_gguf(p)[1]:
            tensors[t.name] = dequantized(t)
    state, notes = gguf_to_hf_state(tensors, hp)
    orig = {}
    for part, key, name in hf_tensor_order(src_dir):
        with safe_open(str(src_dir / part), framework="pt") as f:
            orig[name] = f.get_tensor(key).float()
    assert set(orig) == set(state), set(orig) ^ set(state)
    w_diff = {k: max_abs(v, state[k]) for k, v in orig.items() if not torch.equal(v, state[k])}
    ref = {}
    with safe_open(str(src_dir / "reference.safetensors"), framework="pt") as f:
        for k in ("prompt_ids", "prefill_logits", "greedy_tokens", "decode_logits"):
            ref[k] = f.get_tensor(k)
    ids, greedy = ref["prompt_ids"].tolist(), ref["greedy_tokens"].tolist()
    d = tmp / "roundtrip"
    if d.exists():
        shutil.rmtree(d)
    write_hf_dir(d, causal_config_dict(src_dir), state)
    model = load_f32(d)
    rt = greedy_run(model, ids, len(greedy), forced=greedy)
    free = greedy_run(model, ids, len(greedy))
    del model
    shutil.rmtree(d)
    model = load_f32(src_dir)  # Qwen3_5ForCausalLM, also for the hub layout
    fresh = greedy_run(model, ids, len(greedy), forced=greedy)
    del model
    report = dict(
        weights_differing_from_checkpoint=dict(sorted(w_diff.items())),
        undo_notes=notes,
        read_back_vs_checkpoint_same_machine=dict(
            prefill_logits_max_abs_diff=max_abs(rt["prefill"], fresh["prefill"]),
            decode_logits_max_abs_diff=max_abs(rt["decode"], fresh["decode"])),
        read_back_vs_stored_reference=dict(
            prefill_logits_max_abs_diff=max_abs(rt["prefill"], ref["prefill_logits"]),
            decode_logits_max_abs_diff=max_abs(rt["decode"], ref["decode_logits"]),
            greedy_tokens_equal=free["tokens"] == greedy),
        checkpoint_here_vs_stored_reference=dict(
            prefill_logits_max_abs_diff=max_abs(fresh["prefill"], ref["prefill_logits"]),
            decode_logits_max_abs_diff=max_abs(fresh["decode"], ref["decode_logits"]),
            note="the same checkpoint and code on this machine vs the stored reference: CPU kernel rounding"),
    )
    return report, free


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lcpp-bin", type=Path, default=os.environ.get("LCPP_BIN"),
                    help="llama.cpp build/bin with llama-quantize, llama-perplexity and greedy_ids")
    ap.add_argument("--lcpp-src", type=Path, default=os.environ.get("LCPP_SRC"),
                    help="llama.cpp source tree (convert_hf_to_gguf.py) for the converter cross-check")
    ap.add_argument("--lcpp-python", type=Path, default=os.environ.get("LCPP_PYTHON"),
                    help="a python with torch + transformers 4.57.6 to run llama.cpp's converter")
    args = ap.parse_args()
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures were made with {EXPECTED_TRANSFORMERS}",
              file=sys.stderr)
    from importlib.metadata import version as pkg_version
    if pkg_version("gguf") != EXPECTED_GGUF:
        print(f"warning: gguf {pkg_version('gguf')}, fixtures were made with {EXPECTED_GGUF}", file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    lcpp = Lcpp(args.lcpp_bin, args.lcpp_src, args.lcpp_python)
    for tool in ("llama-quantize", "llama-perplexity", "greedy_ids"):
        if not lcpp.has(tool):
            print(f"error: {tool} not found in --lcpp-bin ({args.lcpp_bin})", file=sys.stderr)
            return 2
    crosscheck = args.lcpp_src is not None and args.lcpp_python is not None
    if not crosscheck:
        print("warning: no --lcpp-src/--lcpp-python: the converter cross-check is skipped", file=sys.stderr)

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tmp_root = Path(tempfile.mkdtemp(prefix="gguf-fixtures-"))
    manifest: dict = dict(
        generated_with=dict(gguf=pkg_version("gguf"), transformers=transformers.__version__,
                            torch=torch.__version__, numpy=np.__version__,
                            llama_cpp=None),
        conversions={}, tiny_q={}, crosscheck={},
    )
    try:
        deq_tool = lcpp.build_dequant_tool(tmp_root)
        # ---------------- 1. conversions of the existing fixtures ----------------
        prompt24 = ref_prompt(N_PROMPT)
        for stem, src, outtype, n_split in CONVERSIONS:
            src_dir = FIX / src
            n_tensors = len(hf_tensor_order(src_dir))
            split = math.ceil(n_tensors / n_split) if n_split > 1 else 0
            info = convert_hf(src_dir, OUT / f"{stem}.gguf", outtype, split)
            paths = [OUT / f for f in info["files"]]
            rt, free = roundtrip_check(paths, src_dir, tmp_root)
            own_ref = None
            if rt["weights_differing_from_checkpoint"] and any(
                    v > 1e-6 for v in rt["weights_differing_from_checkpoint"].values()):
                # the converter rounded some values (f16 arithmetic): the checkpoint's reference does not describe
                # this file; record transformers on the weights read back from it
                own_ref = f"{stem}.reference.safetensors"
                T = len(free["prefill"])
                rows = sorted(set(range(0, T, 16)) | {T - 1})
                save_file({
                    "prompt_ids": torch.tensor(ref_prompt_ids(src_dir), dtype=torch.int64),
                    "prefill_rows": torch.tensor(rows, dtype=torch.int64),
                    "prefill_logits_rows": free["prefill"][rows].contiguous(),
                    "greedy_tokens": torch.tensor(free["tokens"], dtype=torch.int64),
                    "decode_logits": free["decode"].contiguous(),
                }, str(OUT / own_ref), metadata={"format": "pt"})
                rt["own_reference"] = dict(file=own_ref, greedy_tokens=free["tokens"],
                                           min_top1_top2_margin=min(free["margins"]))
            g = lcpp.greedy(paths[0], ref_prompt(N_PROMPT), N_DECODE, tmp_root)
            g.pop("logits", None)
            entry = dict(source=f"fixtures/{src}", outtype=outtype, written_by="scripts/make_gguf_fixtures.py "
                         "(gguf-py GGUFWriter, converter transforms restated)", files=info["files"],
                         split_max_tensors=split or None, n_params=info["n_params"], file_type=info["ftype"],
                         reference=(f"fixtures/gguf/{own_ref} (transformers f32 on the weights read back from "
                                    "this file; the checkpoint's reference does not apply, see roundtrip)"
                                    if own_ref else
                                    f"fixtures/{src}/reference.json + reference.safetensors (transformers f32)"),
                         sizes={p.name: p.stat().st_size for p in paths},
                         sha256={p.name: sha256(p) for p in paths},
                         tensors=info["tensors"], special_token_ids=info["special_ids"],
                         add_special_token_flags=info["add_flags"], roundtrip=rt,
                         llama_cpp_greedy_ids=dict(prompt_ids=prompt24, **g),
                         ggml_dequant_check=[ggml_dequant_check(deq_tool, p, tmp_root) for p in paths])
            manifest["conversions"][stem] = entry
            rb = rt["read_back_vs_checkpoint_same_machine"]
            print(f"== {stem}: {info['files']} ({sum(entry['sizes'].values())} bytes), read back vs checkpoint: "
                  f"prefill {rb['prefill_logits_max_abs_diff']:.2e} decode {rb['decode_logits_max_abs_diff']:.2e}; "
                  f"own reference {own_ref}; llama.cpp: {g.get('error', g.get('tokens'))}")

        # ---------------- 2. tiny-q ----------------
        qdir = tmp_root / "tiny-q"  # the directory name gives general.name "Tiny Q"
        build_tiny_q(qdir)
        hp_q = load_hparams(qdir)
        f32_gguf = tmp_root / "tiny-q-f32.gguf"
        q_info = convert_hf(qdir, f32_gguf, "f32")
        (OUT / "tiny-q.config.json").write_text((qdir / "config.json").read_text())
        manifest["tiny_q"] = dict(
            seed=TINY_Q_SEED, shape=TINY_Q_SHAPE, rope_parameters=TINY_Q_ROPE, tied=True,
            layer_types=hp_q["layer_types"], hf_config="tiny-q.config.json",
            f32_gguf=dict(not_committed=True, n_bytes=f32_gguf.stat().st_size, sha256=sha256(f32_gguf),
                          n_params=q_info["n_params"]),
            prompt_ids=prompt24, n_decode=N_DECODE, files={},
        )
        # the original (unquantized) model, for scale
        orig_model = load_f32(qdir)
        orig_run = greedy_run(orig_model, prompt24, N_DECODE)
        del orig_model
        # llama.cpp on the f32 file: no quantized weights, no quantized activations, so the same model should give
        # the same numbers up to f32 rounding (this separates llama.cpp's int8 activations from any model mismatch)
        g = lcpp.greedy(f32_gguf, prompt24, N_DECODE, tmp_root)
        if "error" not in g:
            n_same = next((s for s in range(N_DECODE) if g["tokens"][s] != orig_run["tokens"][s]), N_DECODE)
            lg = torch.from_numpy(g["logits"].copy())
            g = dict(tokens=g["tokens"], tokens_equal=n_same == N_DECODE,
                     max_abs_logit_diff_vs_transformers=max_abs(lg[:n_same], orig_run["decode"][:n_same]),
                     transformers_greedy_tokens=orig_run["tokens"],
                     transformers_min_margin=min(orig_run["margins"]))
        manifest["tiny_q"]["f32_gguf"]["llama_cpp_greedy"] = g
        ppl = lcpp.perplexity(f32_gguf, SCRIPTS / "fixture_ppl.txt", PPL_CTX, tmp_root)
        ppl.pop("tokens", None)
        orig_model = load_f32(qdir)
        manifest["tiny_q"]["f32_gguf"]["llama_perplexity"] = ppl
        manifest["tiny_q"]["f32_gguf"]["transformers_ppl_llama_perplexity_convention"] = ppl_lcpp_convention(
            orig_model, ppl_ids(), PPL_CTX)
        del orig_model
        print(f"== tiny-q f32 (not committed): llama.cpp vs transformers {g}")
        ppl_tokens = ppl_ids()
        for fmt, qtype, tool in QUANT_FORMATS:
            path = OUT / f"tiny-q-{fmt}.gguf"
            if tool == "gguf-py":
                quantize_like_llama_quantize(f32_gguf, path, fmt, qtype)
            else:
                log = lcpp.quantize(f32_gguf, path, fmt)
                manifest["generated_with"]["llama_cpp"] = lcpp_version(log)
            kv, tensors = read_gguf(path)
            types = {t.name: QT(t.tensor_type).name for t in tensors}
            deq = {t.name: dequantized(t) for t in tensors}
            state, notes = gguf_to_hf_state(deq, hp_q)
            d = tmp_root / f"deq-{fmt}"
            write_hf_dir(d, json.loads((qdir / "config.json").read_text()), state)
            model = load_f32(d)
            run = greedy_run(model, prompt24, N_DECODE)
            hf_ppl = ppl_lcpp_convention(model, ppl_tokens, PPL_CTX)
            del model
            shutil.rmtree(d)
            g = lcpp.greedy(path, prompt24, N_DECODE, tmp_root)
            ppl = lcpp.perplexity(path, SCRIPTS / "fixture_ppl.txt", PPL_CTX, tmp_root)
            tensors_out = {
                "prompt_ids": torch.tensor(prompt24, dtype=torch.int64),
                "prefill_logits": run["prefill"].contiguous(),
                "greedy_tokens": torch.tensor(run["tokens"], dtype=torch.int64),
                "decode_logits": run["decode"].contiguous(),
            }
            rec = dict(
                file=path.name, n_bytes=path.stat().st_size, sha256=sha256(path), made_by=tool,
                quantizer=("gguf.quants.quantize (gguf-py reference quantizer), file laid out as llama-quantize "
                           "--pure lays it out" if tool == "gguf-py" else
                           f"llama-quantize --pure tiny-q-f32.gguf {path.name} {LLAMA_QUANTIZE_NAME[fmt]} 1"),
                general_file_type=next(v for k, _, _, v in kv if k == "general.file_type"),
                tensor_types=types, undo_notes=notes,
                transformers=dict(
                    greedy_tokens=run["tokens"], margins=run["margins"], min_margin=min(run["margins"]),
                    ppl_llama_perplexity_convention=hf_ppl,
                    vs_unquantized_f32=dict(
                        prefill_logits_max_abs_diff=max_abs(run["prefill"], orig_run["prefill"]),
                        decode_row0_max_abs_diff=max_abs(run["decode"][0], orig_run["decode"][0]),
                        greedy_tokens_equal=run["tokens"] == orig_run["tokens"]),
                ),
            )
            if "error" in g:
                rec["llama_cpp_greedy"] = g
            else:
                n_same = next((s for s in range(N_DECODE) if g["tokens"][s] != run["tokens"][s]), N_DECODE)
                lg = torch.from_numpy(g["logits"].copy())
                tensors_out["lcpp_greedy_tokens"] = torch.tensor(g["tokens"], dtype=torch.int64)
                tensors_out["lcpp_decode_logits"] = lg.contiguous()
                rec["llama_cpp_greedy"] = dict(
                    tokens=g["tokens"], margins=g["margins"], top2=g["top2"], tokens_equal=n_same == N_DECODE,
                    steps_equal_before_divergence=n_same,
                    max_abs_logit_diff_vs_transformers=(max_abs(lg[:n_same], run["decode"][:n_same])
                                                        if n_same else None),
                    max_abs_logit_diff_row0=max_abs(lg[0], run["decode"][0]),
                    per_step_max_abs_diff=[max_abs(lg[s], run["decode"][s]) for s in range(n_same)],
                    settings="greedy_ids MODEL ids 16 1 f32 off: 1 thread, f32 KV cache, flash attention off",
                )
            if "error" not in ppl:
                toks = ppl.pop("tokens")
                ppl["tokens_equal_our_tokenizer"] = toks == ppl_tokens[:len(toks)]
            rec["llama_perplexity"] = ppl
            rec["ggml_dequant_check"] = ggml_dequant_check(deq_tool, path, tmp_root)
            rec["tensor_checks"] = tensor_checks(path)
            save_file(tensors_out, str(OUT / f"tiny-q-{fmt}.reference.safetensors"), metadata={"format": "pt"})
            manifest["tiny_q"]["files"][fmt] = rec
            lr = rec["llama_cpp_greedy"]
            dq = rec["ggml_dequant_check"]
            print(f"   ggml to_float vs gguf-py dequantize: {dq and (dq.get('n_bitwise_equal'), dq.get('n_tensors'))}"
                  f" {dq and dq.get('differing')}")
            print(f"== {path.name} ({tool}, {rec['n_bytes']} bytes): HF greedy {run['tokens']} min margin "
                  f"{min(run['margins']):.3f}; llama.cpp {lr.get('tokens', lr.get('error'))} max|dlogit| "
                  f"{lr.get('max_abs_logit_diff_vs_transformers')}; ppl llama.cpp {ppl.get('ppl')} HF "
                  f"{hf_ppl['ppl']:.4f}")

        # ---------------- 3. cross-checks ----------------
        cc = manifest["crosscheck"]
        # gguf-py quantized files vs llama-quantize on the same f32 file
        for fmt, qtype, tool in QUANT_FORMATS:
            if tool != "gguf-py":
                continue
            other = tmp_root / f"lq-{fmt}.gguf"
            lcpp.quantize(f32_gguf, other, fmt)
            cc[f"tiny-q-{fmt}_vs_llama-quantize"] = compare_gguf([OUT / f"tiny-q-{fmt}.gguf"], [other])
        # the split files vs llama-gguf-split (optional tool): merge ours, split the result again the same way
        if lcpp.has("llama-gguf-split"):
            gs = tmp_root / "gguf-split"
            gs.mkdir()
            stem = "tiny-f16-split"
            parts = manifest["conversions"][stem]["files"]
            p1 = lcpp.run([lcpp.bin / "llama-gguf-split", "--merge", OUT / parts[0], gs / "merged.gguf"])
            p2 = lcpp.run([lcpp.bin / "llama-gguf-split", "--split-max-tensors",
                           manifest["conversions"][stem]["split_max_tensors"], gs / "merged.gguf", gs / stem])
            if p1.returncode == 0 and p2.returncode == 0:
                res = compare_gguf([OUT / n for n in parts], [gs / n for n in parts])
                merged_kv = read_gguf(gs / "merged.gguf")[0]
                res["merged_file_split_keys"] = {k: v for k, _, _, v in merged_kv if k.startswith("split.")}
                res["command"] = ("llama-gguf-split --merge (ours) merged.gguf; llama-gguf-split --split-max-tensors "
                                  f"{manifest['conversions'][stem]['split_max_tensors']} merged.gguf {stem}")
                cc[f"{stem}_vs_llama-gguf-split"] = res
        if crosscheck:
            jobs = [(stem, FIX / src, outtype, n_split) for stem, src, outtype, n_split in CONVERSIONS]
            jobs.append(("tiny-q-f32", qdir, "f32", 1))
            for stem, src_dir, outtype, n_split in jobs:
                lc_dir = tmp_root / f"lcpp-{stem}"
                lc_dir.mkdir()
                ours_dir = OUT if stem != "tiny-q-f32" else tmp_root
                n_tensors = len(hf_tensor_order(src_dir))
                split = math.ceil(n_tensors / n_split) if n_split > 1 else 0
                lcpp.convert(src_dir, lc_dir / f"{stem}.gguf", outtype, split)
                if split:
                    names = [f"{stem}-{i:05d}-of-{n_split:05d}.gguf" for i in range(1, n_split + 1)]
                else:
                    names = [f"{stem}.gguf"]
                res = compare_gguf([ours_dir / n for n in names], [lc_dir / n for n in names])
                res["command"] = (f"convert_hf_to_gguf.py {src_dir.name} --outtype {outtype} --no-mtp"
                                  + (f" --split-max-tensors {split}" if split else "")
                                  + " (via scripts/gguf_lcpp_convert.py)")
                cc[f"{stem}_vs_convert_hf_to_gguf"] = res
        for k, v in cc.items():
            print(f"== cross-check {k}: all equal {v['all_equal']} (files identical {v['files_identical']}); "
                  f"kv diffs {len(v['kv_differences'])}, tensor diffs {len(v['tensor_differences'])}")
            for dd in v["kv_differences"][:10] + v["tensor_differences"][:10]:
                print("     ", json.dumps(dd)[:300])
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    (OUT / "reference.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    for f in OUT.iterdir():
        f.chmod(0o644)
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"fixtures/gguf: {len(list(OUT.iterdir()))} files, {total} bytes")
    return 0


def lcpp_version(log: str) -> str | None:
    m = re.search(r"version: (\S+) \(build (\d+), commit ([0-9a-f]+)\)", log)
    return f"{m.group(1)} build {m.group(2)} commit {m.group(3)}" if m else None


if __name__ == "__main__":
    sys.exit(main())
