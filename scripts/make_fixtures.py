#!/usr/bin/env python3
"""Generate the tiny Qwen3.5 reference fixtures under fixtures/.

Builds small random checkpoints of the real architecture with transformers' own classes, saves them with
save_pretrained, trains one small byte-level BPE tokenizer, and records float32 reference outputs computed by
transformers from the checkpoints as they are stored on disk, plus float64 logits (prefill_logits_f64,
decode_logits_f64) from a float64 copy of transformers' Qwen3.5 code, to measure how far the f32 run is from the
exact result.

Run through scripts/make_fixtures.sh (it sets up the pinned virtualenv). Everything is seeded, so a rerun with the
same package versions rewrites the same numbers. Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import tokenizers
import transformers
import transformers.models.qwen3_5.modeling_qwen3_5 as hf_qwen3_5
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
OUT = ROOT / "fixtures"

EXPECTED_TRANSFORMERS = "5.23.0"

# ----------------------------------------------------------------------------------------------------------------
# Shapes and constants
# ----------------------------------------------------------------------------------------------------------------

TEXT_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    hidden_act="silu",
    attention_bias=False,
)
FULL_ATTENTION_INTERVAL = 4

# Tiny vision tower for the hub layout. out_hidden_size must equal the text hidden size.
VISION_SHAPE = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    in_channels=3,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=TEXT_SHAPE["hidden_size"],
    num_position_embeddings=16,
)

TOKENIZER_VOCAB = 445  # BPE vocab before the 3 special tokens are appended (ids 445, 446, 447)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style split pattern (the one Qwen3.5 uses: letters may carry combining marks \p{M}).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
CHAT_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
]
TOKENIZER_CHECKS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "na\u00efve caf\u00e9, r\u00e9sum\u00e9; Zo\u00eb's jalape\u00f1o",
    "cafe\u0301 (decomposed accent, NFC composes it)",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587",
    "emoji \U0001f642\U0001f680 and \U0001f469\u200d\U0001f4bb!",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    "tabs\tand   spaces     here",
    "  leading and trailing  ",
    "line one\nline two\n\n\nline five\r\n",
    "numbers 1234567 and 3.14159",
    "it's they'll WE'RE I'D",
    "<|im_start|>user\nHi<|im_end|>\n",
    "",
]

N_GREEDY = 32
PPL_WINDOW = 64
PROMPT_RANGE = (320, 360)
PPL_RANGE = (250, 400)

FIXTURES = [
    # name, seed, layout, on-disk dtype, tied, rope_theta
    dict(name="tiny-f32", seed=1234, layout="causal", dtype=torch.float32, tied=False, rope_theta=10000.0),
    dict(name="tiny-bf16", seed=5678, layout="causal", dtype=torch.bfloat16, tied=True, rope_theta=10000.0),
    dict(name="tiny-hub", seed=9012, layout="hub", dtype=torch.float16, tied=False, rope_theta=1000000.0),
]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train([str(SCRIPTS / "fixture_corpus.txt")], trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB, tok.get_vocab_size()
    # Specials go after the BPE vocab, as in Qwen's real tokenizer (they are not id 0).
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def tokenizer_config(with_template: bool) -> dict:
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(TOKENIZER_VOCAB + i)] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    cfg = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": TEXT_SHAPE["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if with_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    return cfg


def write_tokenizer_files(tok: Tokenizer, d: Path, template_in_config: bool) -> None:
    tok.save(str(d / "tokenizer.json"))
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(template_in_config), f, indent=2, ensure_ascii=False)
        f.write("\n")
    if not template_in_config:
        (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def text_config_kwargs(spec: dict, tok: Tokenizer) -> dict:
    eot = tok.token_to_id("<|endoftext|>")
    kw = dict(TEXT_SHAPE)
    rope = {"rope_type": "default", "rope_theta": spec["rope_theta"], "partial_rotary_factor": 0.25}
    if spec["layout"] == "hub":
        # Hub checkpoints carry the MRoPE fields; for text-only input they change nothing.
        # mrope_section must sum to R/2 = head_dim * 0.25 / 2 = 4.
        rope.update({"mrope_section": [2, 1, 1], "mrope_interleaved": True})
    kw.update(
        rope_parameters=rope,
        full_attention_interval=FULL_ATTENTION_INTERVAL,
        tie_word_embeddings=spec["tied"],
        eos_token_id=eot,
        bos_token_id=None,
        pad_token_id=None,
    )
    return kw


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every text-model parameter with seeded random values whose layout mistakes would show."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():  # deduplicated: a tied lm_head is the embedding
            if ".visual." in name or name.startswith("visual."):
                continue  # the vision tower keeps transformers' (seeded) init; nothing text-side reads it
            shape = tuple(p.shape)
            if name.endswith("embed_tokens.weight"):
                v = normal(shape, 0.5)
            elif name == "lm_head.weight":
                v = normal(shape, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                v = normal(shape, 0.2, mean=1.0)  # plain weight of the gated RMSNorm
            elif name.endswith("norm.weight"):
                v = normal(shape, 0.2)  # zero-centred RMSNorm1p weights (input/post/final/q_norm/k_norm)
            elif name.endswith("A_log"):
                v = torch.log(torch.rand(shape, generator=g) * 1.9 + 0.1)  # A in [0.1, 2.0)
            elif name.endswith("dt_bias"):
                v = normal(shape, 0.5)
            elif name.endswith("conv1d.weight"):
                v = normal(shape, 0.5)
            elif name.endswith("mlp.gate.weight"):  # an MoE router, spread wide so that routing is decisive
                v = normal(shape, 4.0 / math.sqrt(shape[1]))
            elif p.ndim == 3:  # MoE experts held fused in memory: [E, out, in]
                v = normal(shape, 1.0 / math.sqrt(shape[2]))
            elif p.ndim == 2:
                v = normal(shape, 1.0 / math.sqrt(shape[1]))
            else:
                raise RuntimeError(f"unexpected parameter {name} {shape}")
            p.copy_(v)


def build_model(spec: dict, tok: Tokenizer):
    torch.manual_seed(spec["seed"])
    text_kw = text_config_kwargs(spec, tok)
    if spec["layout"] == "causal":
        cfg = Qwen3_5TextConfig(**text_kw)
        cfg.full_attention_interval = FULL_ATTENTION_INTERVAL  # real configs carry both this and layer_types
        model = Qwen3_5ForCausalLM(cfg)
    else:
        eot = tok.token_to_id("<|endoftext|>")
        cfg = Qwen3_5Config(
            text_config=text_kw,
            vision_config=dict(VISION_SHAPE),
            tie_word_embeddings=spec["tied"],
            # Real checkpoints use ids ~248k; ours sit at the top of the 512-row model vocab, past the tokenizer.
            image_token_id=508,
            video_token_id=509,
            vision_start_token_id=510,
            vision_end_token_id=511,
        )
        cfg.text_config.full_attention_interval = FULL_ATTENTION_INTERVAL
        cfg.eos_token_id = eot
        model = Qwen3_5ForConditionalGeneration(cfg)
    model.eval()
    randomize_(model, spec["seed"])
    return model


def add_fake_mtp(d: Path, seed: int) -> list[str]:
    """Add an MTP head's worth of fake tensors into the last shard and the index, as hub checkpoints have."""
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    target = shards[-1]
    tensors = {}
    with safe_open(str(d / target), framework="pt") as f:
        meta = f.metadata()
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    g = torch.Generator().manual_seed(seed + 7)
    H = TEXT_SHAPE["hidden_size"]
    fake = {
        "mtp.fc.weight": torch.randn(H, 2 * H, generator=g),
        "mtp.norm.weight": torch.randn(H, generator=g) * 0.2,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(H, generator=g) * 0.2,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(H, generator=g) * 0.2,
    }
    for k, v in fake.items():
        tensors[k] = v.to(torch.float16)
        index["weight_map"][k] = target
    save_file(tensors, str(d / target), metadata=meta)
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    total = 0
    for shard in shards:
        with safe_open(str(d / shard), framework="pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                total += math.prod(t.get_shape()) * 2  # all f16
    meta_idx = index.setdefault("metadata", {})
    meta_idx["total_size"] = total
    if "total_parameters" in meta_idx:
        meta_idx["total_parameters"] += sum(v.numel() for v in fake.values())
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return sorted(fake)


def save_fixture_model(spec: dict, model, tok: Tokenizer, d: Path) -> None:
    model = model.to(spec["dtype"])
    if spec["layout"] == "hub":
        model.save_pretrained(str(d), max_shard_size="400KB")
    else:
        model.save_pretrained(str(d))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    # Replace the generation_config.json save_pretrained wrote: eos is a list [<|im_end|>, <|endoftext|>]
    # (config.json's eos_token_id is <|endoftext|> only, as in real Qwen checkpoints).
    GenerationConfig(bos_token_id=None, eos_token_id=[im_end, eot], pad_token_id=eot).save_pretrained(str(d))


# ----------------------------------------------------------------------------------------------------------------
# Reference outputs
# ----------------------------------------------------------------------------------------------------------------


def load_f32(spec: dict, d: Path):
    cls = Qwen3_5ForCausalLM if spec["layout"] == "causal" else Qwen3_5ForConditionalGeneration
    model = cls.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, (n, p.dtype)
    return model


# float64 reference. Loading with dtype=torch.float64 is not enough: transformers' qwen3_5 code casts to float32
# inside the model whatever the load dtype (RoPE inv_freq/cos/sin, every RMSNorm1p, the gated RMSNorm, the GDN decay g,
# both GDN cores with their recurrent state, the attention softmax), and the non-persistent inv_freq buffer stays
# float32. Such a "float64" run is about as far from the exact result as the float32 one (about 3e-4 on the logits),
# so it cannot serve as the reference. This loads the model from a copy of transformers' own modeling_qwen3_5.py
# with every float32 cast rewritten to float64. Nothing else in the code changes.
F32_CASTS = [
    (r"torch\.float32\b", "torch.float64"),
    (r"\.float\(\)", ".double()"),
    (r"torch\.float(?![\w])", "torch.float64"),
]
_F64_MODULE = None


def f64_modeling_module():
    global _F64_MODULE
    if _F64_MODULE is None:
        path = hf_qwen3_5.__file__
        src = Path(path).read_text()
        n_subs = 0
        for pat, rep in F32_CASTS:
            src, k = re.subn(pat, rep, src)
            n_subs += k
        assert n_subs > 0 and not any(re.search(pat, src) for pat, _ in F32_CASTS)
        name = hf_qwen3_5.__name__ + "_float64"
        mod = types.ModuleType(name)
        mod.__file__ = path
        mod.__package__ = hf_qwen3_5.__package__  # for the module's relative imports
        sys.modules[name] = mod
        # dont_inherit: not this file's `from __future__ import annotations` (transformers reads real annotations)
        exec(compile(src, path, "exec", dont_inherit=True), mod.__dict__)
        # Qwen3_5Model builds its sub-models with AutoModel.from_config, which would return the stock classes.
        sub_models = {"qwen3_5_text": mod.Qwen3_5TextModel, "qwen3_5_vision": mod.Qwen3_5VisionModel}

        class AutoModelF64:
            @staticmethod
            def from_config(config, **kwargs):
                return sub_models[config.model_type]._from_config(config, **kwargs)

        mod.AutoModel = AutoModelF64
        mod.N_CASTS_REWRITTEN = n_subs
        _F64_MODULE = mod
    return _F64_MODULE


def load_f64(spec: dict, d: Path, exact: bool = True):
    """The fixture directory loaded with dtype=float64. exact=False: transformers' stock code (f32 casts inside)."""
    mod = f64_modeling_module() if exact else hf_qwen3_5
    cls = mod.Qwen3_5ForCausalLM if spec["layout"] == "causal" else mod.Qwen3_5ForConditionalGeneration
    model = cls.from_pretrained(str(d), dtype=torch.float64, attn_implementation="eager")
    model.eval()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float64, (n, p.dtype)
    if exact:
        for n, m in model.named_modules():  # every qwen3_5 module must come from the float64 copy
            assert not type(m).__module__.startswith(hf_qwen3_5.__package__) or type(m).__module__ == mod.__name__, (n, type(m))
        for n, b in model.named_buffers():  # the text rotary inv_freq; the (unused) vision tower's may stay f32
            assert ".visual." in n or not b.is_floating_point() or b.dtype == torch.float64, (n, b.dtype)
    return model


@torch.no_grad()
def teacher_forced_logits(model, prompt_ids: list[int], forced: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits [T, V], then the decode loop of make_reference with its tokens forced: row 0 = last prefill
    row, row s >= 1 = a single-token cached decode step fed forced[s-1]. Returned in the model's dtype."""
    cache = new_cache(model)
    prefill = forward(model, prompt_ids, cache=cache).logits[0]
    rows = [prefill[-1]]
    for step in range(1, len(forced)):
        rows.append(forward(model, [forced[step - 1]], cache=cache).logits[0, -1])
    return prefill, torch.stack(rows)


def text_cfg(model):
    return model.config.get_text_config(decoder=True)


def snapshot_cache(cache, layer_types) -> dict[str, torch.Tensor]:
    """Copy the per-layer cache tensors (batch dim dropped). Clones: HF updates conv/recurrent states in place."""
    out = {}
    for i, lt in enumerate(layer_types):
        layer = cache.layers[i]
        if lt == "linear_attention":
            out[f"conv_state.{i}"] = layer.conv_states[0][0].detach().clone()  # [conv_dim, Kc]
            out[f"recurrent_state.{i}"] = layer.recurrent_states[0][0].detach().clone()  # [Hv, Dk, Dv]
        else:
            out[f"key_cache.{i}"] = layer.keys[0].detach().clone()  # [Hkv, T, D]
            out[f"value_cache.{i}"] = layer.values[0].detach().clone()
    return out


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def forward(model, ids: list[int], cache=None, **kw):
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, past_key_values=cache, use_cache=cache is not None, **kw)


def new_cache(model):
    return transformers.DynamicCache(config=model.config)


def score_nll(model, ids: list[int]) -> tuple[float, int]:
    """Sum of NLL (nats, float64) over tokens 1..n-1 of one independent window."""
    if len(ids) < 2:
        return 0.0, 0
    with torch.no_grad():
        logits = forward(model, ids).logits[0].double()
    lp = F.log_softmax(logits[:-1], dim=-1)
    tgt = torch.tensor(ids[1:], dtype=torch.long)
    return float(-lp.gather(1, tgt[:, None]).sum()), len(ids) - 1


def ppl_record(total_nll: float, n_pred: int, n_tokens: int, **extra) -> dict:
    nll = total_nll / n_pred
    return dict(n_tokens=n_tokens, n_predicted=n_pred, nll=nll, ppl=math.exp(nll), **extra)


@torch.no_grad()
def make_reference(spec: dict, d: Path, tok: Tokenizer, prompt_text: str, ppl_text: str) -> dict:
    model = load_f32(spec, d)
    tcfg = text_cfg(model)
    layer_types = list(tcfg.layer_types)
    L = tcfg.num_hidden_layers
    prompt_ids = tok.encode(prompt_text).ids
    T = len(prompt_ids)
    assert PROMPT_RANGE[0] <= T <= PROMPT_RANGE[1], f"prompt has {T} tokens"
    tensors: dict[str, torch.Tensor] = {}
    sanity: dict[str, float] = {}

    # ---- prefill: one full forward, with a cache so the post-prefill states can be read ----
    # Also capture the raw output of the last decoder layer (before the final norm) with a hook.
    captured = {}
    lm = model.model.language_model if spec["layout"] == "hub" else model.model
    hook = lm.layers[L - 1].register_forward_hook(lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        cache = new_cache(model)
        out = forward(model, prompt_ids, cache=cache, output_hidden_states=True)
    hook.remove()
    prefill_logits = out.logits[0].float()
    hs = torch.stack([h[0] for h in out.hidden_states]).float()
    assert hs.shape == (L + 1, T, TEXT_SHAPE["hidden_size"]), hs.shape
    last_prenorm = captured["last"][0].float()
    # Pin down the hidden_states convention numerically.
    sanity["hidden_states_last_vs_norm_of_last_layer_output"] = max_abs(hs[L], lm.norm(last_prenorm))
    sanity["hidden_states_last_vs_raw_last_layer_output"] = max_abs(hs[L], last_prenorm)
    sanity["hidden_states_0_vs_embeddings"] = max_abs(hs[0], lm.embed_tokens.weight[prompt_ids].float())
    lm_head_w = model.lm_head.weight
    sanity["lm_head_of_hidden_states_last_vs_logits"] = max_abs(hs[L] @ lm_head_w.T, prefill_logits)
    assert sanity["hidden_states_last_vs_norm_of_last_layer_output"] < 1e-5
    assert sanity["hidden_states_0_vs_embeddings"] == 0.0
    states = snapshot_cache(cache, layer_types)

    # ---- greedy decode: raw-logit argmax, never stops at eos (eos is neither suppressed nor a stop) ----
    greedy, dlogits, margins = [], [], []
    logits = prefill_logits[-1]
    with torch.no_grad():
        for step in range(N_GREEDY):
            dlogits.append(logits.clone())
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            t = int(torch.argmax(logits))
            greedy.append(t)
            if step + 1 < N_GREEDY:
                logits = forward(model, [t], cache=cache).logits[0, -1].float()
    decode_logits = torch.stack(dlogits)
    assert len(set(greedy)) >= N_GREEDY // 2, f"greedy decoding too repetitive: {greedy}"

    # Cross-check against transformers' generate() (greedy). It stops at eos, so compare the common prefix.
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=N_GREEDY, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )
    gen_tokens = gen.sequences[0, T:].tolist()
    n_cmp = len(gen_tokens)
    assert gen_tokens == greedy[:n_cmp], (gen_tokens, greedy)
    sanity["generate_logits_max_abs_diff"] = max_abs(torch.stack([x[0] for x in gen.logits]), decode_logits[:n_cmp])
    sanity["generate_tokens_compared"] = n_cmp

    # ---- sanity: token-by-token (recurrent decode path) vs the one-shot chunked prefill ----
    with torch.no_grad():
        c1 = new_cache(model)
        rows = [forward(model, [t], cache=c1).logits[0, -1].float() for t in prompt_ids]
    tbt = torch.stack(rows)
    sanity["token_by_token_vs_prefill_last_logits"] = max_abs(tbt[-1], prefill_logits[-1])
    sanity["token_by_token_vs_prefill_all_logits"] = max_abs(tbt, prefill_logits)
    s1 = snapshot_cache(c1, layer_types)
    sanity["token_by_token_vs_prefill_states"] = max(max_abs(s1[k], states[k]) for k in states)

    # ---- sanity: prefill split into pieces (chunked path on top of an existing state) ----
    cuts = [0, 1, 100, 230, T]
    with torch.no_grad():
        c2 = new_cache(model)
        parts = [forward(model, prompt_ids[a:b], cache=c2).logits[0].float() for a, b in zip(cuts, cuts[1:])]
    split = torch.cat(parts)
    sanity["split_prefill_vs_prefill_all_logits"] = max_abs(split, prefill_logits)
    s2 = snapshot_cache(c2, layer_types)
    sanity["split_prefill_vs_prefill_states"] = max(max_abs(s2[k], states[k]) for k in states)

    # ---- hub only: the same directory loaded as Qwen3_5ForCausalLM (model.language_model.* -> model.*) ----
    if spec["layout"] == "hub":
        try:
            alt = Qwen3_5ForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
            with torch.no_grad():
                alt_logits = forward(alt, prompt_ids).logits[0].float()
            sanity["hub_dir_as_causal_lm_vs_prefill_logits"] = max_abs(alt_logits, prefill_logits)
        except Exception as e:  # recorded, not fatal
            sanity["hub_dir_as_causal_lm_error"] = f"{type(e).__name__}: {e}"[:300]

    # ---- perplexity ----
    ppl_ids = tok.encode(ppl_text).ids
    assert PPL_RANGE[0] <= len(ppl_ids) <= PPL_RANGE[1], f"ppl text has {len(ppl_ids)} tokens"
    nll_full, n_full = score_nll(model, ppl_ids)
    ppl_full = ppl_record(nll_full, n_full, len(ppl_ids))
    tot, npred, nwin = 0.0, 0, 0
    for start in range(0, len(ppl_ids), PPL_WINDOW):
        w = ppl_ids[start : start + PPL_WINDOW]
        if len(w) < 2:
            continue
        a, b = score_nll(model, w)
        tot, npred, nwin = tot + a, npred + b, nwin + 1
    ppl_ctx64 = ppl_record(tot, npred, len(ppl_ids), window=PPL_WINDOW, n_windows=nwin)

    # ---- chat template + tokenizer checks, through transformers' AutoTokenizer from the fixture dir ----
    hf_tok = AutoTokenizer.from_pretrained(str(d))
    chat_text = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    expect = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT_MESSAGES) + "<|im_start|>assistant\n"
    assert chat_text == expect, repr(chat_text)
    chat_ids = tok.encode(chat_text).ids
    assert hf_tok(chat_text, add_special_tokens=False)["input_ids"] == chat_ids
    checks = []
    for s in TOKENIZER_CHECKS:
        ids = tok.encode(s).ids
        hf_ids = hf_tok(s, add_special_tokens=False)["input_ids"]
        assert ids == hf_ids, (s, ids, hf_ids)
        dec = tok.decode(ids, skip_special_tokens=False)
        checks.append(dict(text=s, ids=ids, decoded=dec, roundtrip_equal=dec == s))
    assert hf_tok(prompt_text, add_special_tokens=False)["input_ids"] == prompt_ids

    # ---- float64 reference: same prompt, same 32 steps with the f32 greedy tokens forced ----
    m64 = load_f64(spec, d)
    assert m64.lm_head.weight.shape[0] == TEXT_SHAPE["vocab_size"]
    prefill64, decode64 = teacher_forced_logits(m64, prompt_ids, greedy)
    assert prefill64.dtype == decode64.dtype == torch.float64
    del m64
    # transformers' stock code loaded with dtype=float64, for the record of why it is not used
    stock = load_f64(spec, d, exact=False)
    prefill_stock, decode_stock = teacher_forced_logits(stock, prompt_ids, greedy)
    del stock
    arg64 = decode64.argmax(-1).tolist()
    mismatch = [s for s in range(N_GREEDY) if arg64[s] != greedy[s]]
    top2_64 = torch.topk(decode64, 2, dim=-1).values
    pf_rows_diff = int((prefill64.argmax(-1) != prefill_logits.argmax(-1)).sum())
    f64_check = dict(
        method=(
            "transformers' modeling_qwen3_5.py with every float32 cast rewritten to float64 (RoPE inv_freq/cos/sin, "
            "RMSNorm1p, gated RMSNorm, GDN decay g, chunked and recurrent GDN cores and their state, attention "
            "softmax); model loaded from this directory with dtype=float64 (stored weights upcast exactly), eager "
            "attention. Same prompt as prefill_logits; decode rows teacher-forced with the f32 greedy_tokens, so row s "
            "is comparable with decode_logits[s]. Differences below are computed in float64 before rounding."
        ),
        stored_as="float32, rounded to nearest from float64 (at most 0.5 ulp of f32, under 1e-6 for |logit| < 16)",
        f32_casts_rewritten=f64_modeling_module().N_CASTS_REWRITTEN,
        prefill_logits_max_abs_diff=max_abs(prefill_logits, prefill64),
        prefill_last_row_max_abs_diff=max_abs(prefill_logits[-1], prefill64[-1]),
        prefill_argmax_rows_differ=pf_rows_diff,
        decode_logits_max_abs_diff=max_abs(decode_logits, decode64),
        decode_logits_max_abs_diff_per_step=[max_abs(decode_logits[s], decode64[s]) for s in range(N_GREEDY)],
        greedy_argmax_agrees=not mismatch,
        greedy_argmax_mismatch_steps=mismatch,
        f64_min_top1_top2_margin=float((top2_64[:, 0] - top2_64[:, 1]).min()),
        max_abs_logit=float(prefill64.abs().max()),
        f32_storage_rounding_max_abs=max(max_abs(prefill64.float(), prefill64), max_abs(decode64.float(), decode64)),
        stock_hf_float64=dict(
            note=(
                "transformers' unmodified code loaded with dtype=float64: it still computes RoPE, the norms, the GDN "
                "core and the softmax in float32, so it is not an exact reference"
            ),
            prefill_logits_max_abs_diff_vs_f64=max_abs(prefill_stock, prefill64),
            decode_logits_max_abs_diff_vs_f64=max_abs(decode_stock, decode64),
            prefill_logits_max_abs_diff_vs_f32=max_abs(prefill_stock, prefill_logits),
        ),
    )

    # ---- write ----
    tensors["prompt_ids"] = torch.tensor(prompt_ids, dtype=torch.int64)
    tensors["prefill_logits"] = prefill_logits
    tensors["greedy_tokens"] = torch.tensor(greedy, dtype=torch.int64)
    tensors["decode_logits"] = decode_logits
    tensors["prefill_logits_f64"] = prefill64.float()
    tensors["decode_logits_f64"] = decode64.float()
    tensors["hidden_states"] = hs
    tensors["last_layer_output"] = last_prenorm
    for k, v in states.items():
        tensors[k] = v.float()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})

    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    ref = dict(
        fixture=spec["name"],
        generated_with=dict(transformers=transformers.__version__, torch=torch.__version__, tokenizers=tokenizers.__version__),
        model_class=type(model).__name__,
        weights_dtype_on_disk=str(spec["dtype"]).replace("torch.", ""),
        reference_dtype="float32",
        reference_note="model loaded from this directory with dtype=float32 (stored weights upcast), eager attention",
        layer_types=layer_types,
        eos_token_id=[im_end, eot],
        prompt_file="prompt.txt",
        n_prompt_tokens=T,
        prompt_ids=prompt_ids,
        greedy=dict(
            n_steps=N_GREEDY,
            tokens=greedy,
            text=tok.decode(greedy, skip_special_tokens=False),
            distinct_tokens=len(set(greedy)),
            eos_handling="argmax over the full raw logits (eos not suppressed); decoding does not stop at eos",
            eos_generated=any(t in (im_end, eot) for t in greedy),
            min_top1_top2_margin=min(margins),
            decode_logits_row0="last row of prefill_logits",
        ),
        hidden_states_convention=(
            "hidden_states[0] = token embeddings; hidden_states[i] (1 <= i < L) = output of decoder layer i-1 "
            "(residual stream, no norm); hidden_states[L] = output of the last layer WITH the final norm "
            "(model.norm) applied, i.e. the input of lm_head. last_layer_output = the last layer's raw output "
            "before the final norm."
        ),
        cache_layout=dict(
            conv_state="conv_state.{i} [conv_dim, Kc]: last Kc raw in_proj_qkv outputs (before conv and SiLU), oldest column first; zero-padded on the left if T < Kc",
            recurrent_state="recurrent_state.{i} [Hv, Dk, Dv] float32",
            key_cache="key_cache.{i} [Hkv, T, D], after k_norm and RoPE",
            value_cache="value_cache.{i} [Hkv, T, D]",
        ),
        ppl_file="ppl.txt",
        ppl_ids=ppl_ids,
        ppl_full=ppl_full,
        ppl_ctx64=ppl_ctx64,
        chat_reference=dict(messages=CHAT_MESSAGES, add_generation_prompt=True, text=chat_text, ids=chat_ids),
        tokenizer_checks=checks,
        sanity_checks=sanity,
        sanity_checks_note=(
            "max abs differences measured while generating (float32): token_by_token_* = prompt fed one token at a "
            "time through the cache (recurrent GDN path) vs the one-shot prefill; split_prefill_* = prompt fed as "
            "pieces [0:1],[1:100],[100:230],[230:T] (chunked path on an existing state); *_states covers every "
            "conv/recurrent/K/V tensor. hidden_states_last_vs_raw_last_layer_output is expected to be large (it "
            "proves hidden_states[L] is post-norm)."
        ),
        f64_check=f64_check,
    )
    (d / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    (d / "prompt.txt").write_text(prompt_text)
    (d / "ppl.txt").write_text(ppl_text)

    # ---- summary ----
    lg = prefill_logits
    print(f"== {spec['name']}  ({type(model).__name__}, on disk {ref['weights_dtype_on_disk']})")
    print(f"   prompt {T} tokens; prefill logits std {float(lg.std()):.3f}, mean row range {float((lg.max(1).values - lg.min(1).values).mean()):.2f}")
    print(f"   greedy {greedy}")
    print(f"   greedy distinct {len(set(greedy))}/{N_GREEDY}, min top1-top2 margin {min(margins):.4f}, eos generated {ref['greedy']['eos_generated']}")
    print(f"   ppl_full {ppl_full['ppl']:.3f} (nll {ppl_full['nll']:.4f}, {ppl_full['n_tokens']} tok)  ppl_ctx64 {ppl_ctx64['ppl']:.3f} ({nwin} windows)")
    for k, v in sanity.items():
        print(f"   {k}: {v:.3e}" if isinstance(v, float) else f"   {k}: {v}")
    fc = f64_check
    print(
        f"   f32 vs f64: prefill {fc['prefill_logits_max_abs_diff']:.3e} (last row {fc['prefill_last_row_max_abs_diff']:.3e}), "
        f"decode {fc['decode_logits_max_abs_diff']:.3e}; greedy argmax agrees {fc['greedy_argmax_agrees']} {fc['greedy_argmax_mismatch_steps']}; "
        f"stock HF f64 vs f64: prefill {fc['stock_hf_float64']['prefill_logits_max_abs_diff_vs_f64']:.3e}"
    )
    return ref


# ----------------------------------------------------------------------------------------------------------------


def main() -> int:
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures were made with {EXPECTED_TRANSFORMERS}", file=sys.stderr)
    # One thread: tiny matmuls are far slower with OpenMP threads on a busy 2-core box, and a fixed thread count
    # keeps the float reductions (and so the recorded numbers) the same from run to run.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = build_tokenizer()
    prompt_text = (SCRIPTS / "fixture_prompt.txt").read_text()
    ppl_text = (SCRIPTS / "fixture_ppl.txt").read_text()
    OUT.mkdir(exist_ok=True)
    for spec in FIXTURES:
        d = OUT / spec["name"]
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        model = build_model(spec, tok)
        save_fixture_model(spec, model, tok, d)
        if spec["layout"] == "hub":
            added = add_fake_mtp(d, spec["seed"])
            print(f"   {spec['name']}: added fake tensors {added}")
        del model
        write_tokenizer_files(tok, d, template_in_config=spec["layout"] != "hub")
        make_reference(spec, d, tok, prompt_text, ppl_text)
        for f in d.iterdir():
            f.chmod(0o644)  # save_pretrained/safetensors write 0600
    return 0


if __name__ == "__main__":
    sys.exit(main())
