#!/usr/bin/env python3
"""Generate fixtures/tiny-mtp and fixtures/tiny-mtp-moe: tiny random Qwen3.5 checkpoints WITH an MTP block, and the
reference outputs of the block (docs/MTP.md).

transformers ignores `mtp.*` (`_keys_to_ignore_on_load_unexpected`), so the MTP forward here is this script's own,
written from the definition in docs/MTP.md: norms of the next token's embedding and of the trunk's final-normed
hidden state, `fc` on [embedding | hidden], one full-attention decoder layer (transformers' own decoder layer class of
the model, as vLLM reuses the model's decoder layer), the block's final norm, the shared head. The trunk is
transformers' model (its `model.norm` output is the hidden state the block reads).

- tiny-mtp: dense Qwen3.5, the hub layout (`Qwen3_5ForConditionalGeneration` config, text settings under
  text_config, `model.language_model.*`), bf16, tied embeddings, two shards + index (the `mtp.*` tensors in the
  second). Also `model.gguf` beside it: the same weights as llama.cpp's converter writes them (`conversion/qwen.py`
  `_Qwen35MtpMixin`: the block as block L with `nextn.*` tensors, `qwen35.nextn_predict_layers` = 1, every norm
  stored as 1 + w), the trunk bf16, the MTP block's matrices Q8_0 (gguf-py's reference quantizer), with references
  of its own computed from the dequantized Q8_0 weights.
- tiny-mtp-moe: Qwen3.5-MoE, the causal-LM layout, bf16, untied head, 2 layers; the MTP layer's experts stored fused
  (`mtp.layers.0.mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]).

References (float32, from the stored weights upcast exactly): for a 24-token prompt, the trunk's hidden rows
(`hidden`), the block's logits for every prompt pair (`mtp_logits`), 4 greedy drafts after the prompt, a verify
of them by the trunk, the accepted pairs and 4 more drafts. Seeds are searched until every argmax involved has a
top-2 margin above MARGIN (MARGIN_Q8 for the GGUF file's references; and, for the MoE model, every router decision
one above 1e-3), so rounding cannot flip a token, and until the two rounds of drafts differ.

    bash scripts/make_fixtures.sh   # creates .venv-fixtures/ once (or any venv with requirements-fixtures.txt)
    .venv-fixtures/bin/python scripts/make_mtp_fixture.py

Seeded and single-threaded; a rerun rewrites the same bytes.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import gguf
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import randomize_  # noqa: E402  (the other fixtures' draws)
from make_gguf_fixtures import converter_qtype, converter_transform  # noqa: E402  (llama.cpp's transforms, restated)

ROOT = Path(__file__).resolve().parent.parent
N_PROMPT, K = 24, 4
MARGIN = 0.05  # smallest top-2 logit gap accepted for a greedy pick of the f32 references
MARGIN_Q8 = 0.5  # the same for the Q8_0 block of the GGUF file (8-bit activations move logits by ~0.1)

BASE = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, mtp_num_hidden_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
DENSE = dict(BASE, intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=True,
             layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4)
MOE = dict(BASE, num_hidden_layers=2, tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"],
           full_attention_interval=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


class RmsNorm1p(nn.Module):
    """Qwen3.5's RMSNorm: x / rms(x) · (1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class Mtp(nn.Module):
    """The MTP block; parameter names are the checkpoint's `mtp.*` names."""

    def __init__(self, trunk):
        super().__init__()
        c = trunk.config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = RmsNorm1p(h, eps), RmsNorm1p(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        full = c.layer_types.index("full_attention")  # the model's decoder layer class, built as a full-attention one
        self.layers = nn.ModuleList([type(trunk.model.layers[full])(c, full)])
        self.norm = RmsNorm1p(h, eps)

    def forward(self, trunk, hidden, nxt):
        """Pairs (hidden[p], nxt[p]) at positions 0..T (hidden [T, H] final-normed, nxt [T]) -> (g [T, H], logits)."""
        t = len(nxt)
        e = trunk.model.embed_tokens(torch.tensor(nxt))
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))[None]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
        u = self.layers[0](u, position_embeddings=trunk.model.rotary_emb(u, pos), attention_mask=mask,
                           position_ids=pos)
        g = self.norm(u[0])
        return g, trunk.lm_head(g)


def margin(row) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def draft(trunk, mtp, hidden, nxt, k, margins):
    """k greedy drafts from the last pair of (hidden, nxt): each step feeds the block's own output and its draft."""
    hidden, nxt, out = hidden.clone(), list(nxt), []
    for _ in range(k):
        g, logits = mtp(trunk, hidden, nxt)
        d = int(logits[-1].argmax())
        margins.append(margin(logits[-1]))
        out.append(d)
        hidden, nxt = torch.cat([hidden, g[-1:]]), nxt + [d]
    return out


def reference(trunk, mtp, prompt, margins):
    """The trunk's prefill, the block over the prompt pairs, drafts, a verify and drafts after it."""
    with torch.no_grad():
        hid = trunk.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        logits = trunk.lm_head(hid)
        assert torch.allclose(logits, trunk(torch.tensor([prompt])).logits[0], atol=1e-5)
        x_n = int(logits[-1].argmax())
        margins.append(margin(logits[-1]))
        nxt = prompt[1:] + [x_n]
        _, mtp_logits = mtp(trunk, hid, nxt)
        drafts = draft(trunk, mtp, hid, nxt, K, margins)
        # verify [x_n, d_1..d_k] with the trunk: accept the drafts equal to its own greedy picks, then its bonus token
        full = prompt + [x_n] + drafts
        hid_full = trunk.model(input_ids=torch.tensor([full])).last_hidden_state[0]
        verify = trunk.lm_head(hid_full[N_PROMPT:])
        picks = [int(r.argmax()) for r in verify]
        margins.extend(margin(r) for r in verify)
        a = next((j for j in range(K) if drafts[j] != picks[j]), K)
        bonus = picks[a]
        accepted = [x_n] + drafts[:a] + [bonus]
        drafts2 = draft(trunk, mtp, hid_full[: N_PROMPT + a + 1], (prompt + accepted)[1:], K, margins)
    return dict(hidden=hid, mtp_logits=mtp_logits, x_n=x_n, drafts=drafts, verify_tokens=[x_n] + drafts,
                verify_picks=picks, accepted=a, bonus=bonus, drafts_after_verify=drafts2)


def randomize_mtp_(mtp: Mtp, seed: int) -> None:
    """The other fixtures' draws for the layer; the block's own norms N(0, 0.2) (1 + w in use), fc N(0, 1/√(2H))."""
    randomize_(mtp.layers, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for norm in (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.2)
        mtp.fc.weight.copy_(torch.randn(mtp.fc.weight.shape, generator=g) / math.sqrt(mtp.fc.weight.shape[1]))


def router_margins(trunk, mtp) -> list:
    gaps: list[float] = []
    k = trunk.config.num_experts_per_tok

    def hook(_m, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    mods = [m for n, m in list(trunk.named_modules()) + list(mtp.named_modules()) if n.endswith("mlp.gate")]
    assert mods, "no router found"
    return gaps, [m.register_forward_hook(hook) for m in mods]


def mtp_tensors(mtp: Mtp, fused_experts: bool) -> dict:
    out = {}
    for name, p in mtp.state_dict().items():
        if not fused_experts and p.ndim == 3:
            raise RuntimeError("per-expert MTP names are not written here")
        out["mtp." + name] = p.contiguous()
    return out


def write_dense(d: Path, trunk, mtp, dtype) -> dict:
    """The hub layout in two shards: the text model in the first, the MTP block in the second."""
    text = {("model.language_model." + k[len("model."):]): v.to(dtype).contiguous()
            for k, v in trunk.state_dict().items() if k != "lm_head.weight"}  # tied
    block = {k: v.to(dtype) for k, v in mtp_tensors(mtp, False).items()}
    shards = {"model-00001-of-00002.safetensors": text, "model-00002-of-00002.safetensors": block}
    weight_map, total = {}, 0
    for fname, tensors in shards.items():
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n")
    tc = dict(DENSE, model_type="qwen3_5_text", hidden_act="silu", attention_bias=False,
              mtp_use_dedicated_embeddings=False)
    cfg = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=tc,
               tie_word_embeddings=True, transformers_version="5.23.0")
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return dict(layout="hub", shards=list(shards))


def write_moe(d: Path, trunk, mtp, dtype) -> dict:
    """The causal-LM layout, one file; the trunk's experts as save_pretrained names them, the block's fused."""
    sd = {k: v.to(dtype) for k, v in trunk.state_dict().items()}
    trunk.save_pretrained(d, safe_serialization=True, state_dict=sd)
    from safetensors.torch import load_file
    tensors = load_file(str(d / "model.safetensors"))
    tensors.update({k: v.to(dtype) for k, v in mtp_tensors(mtp, True).items()})
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["mtp_num_hidden_layers"], cfg["mtp_use_dedicated_embeddings"] = 1, False
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return dict(layout="causal", shards=["model.safetensors"])


def q8_roundtrip(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """gguf-py's reference Q8_0 bytes of a matrix and the values they decode to."""
    q = gguf.quants.quantize(t.float().numpy(), QT.Q8_0)
    return q, torch.from_numpy(gguf.quants.dequantize(q, QT.Q8_0).reshape(t.shape).copy())


def write_gguf(path: Path, trunk, mtp, hp: dict) -> Mtp:
    """The checkpoint as llama.cpp's converter writes it with the MTP block (trunk bf16, block matrices Q8_0);
    returns the block with its matrices replaced by their Q8_0 values (the GGUF references' weights)."""
    L = hp["num_hidden_layers"]
    w = gguf.GGUFWriter(path=None, arch="qwen35")
    trunk_sd = {k: v for k, v in trunk.state_dict().items() if k != "lm_head.weight"}
    for name in sorted(trunk_sd):
        gname, t = converter_transform(name, trunk_sd[name].to(torch.bfloat16), hp)
        qt = converter_qtype(gname, t.ndim, QT.BF16)
        w.add_tensor(gname, gguf.quants.quantize(t.float().numpy(), qt), raw_dtype=qt)
    T = gguf.MODEL_TENSOR  # gguf-py's names of the nextn tensors
    nextn = {"fc.weight": T.NEXTN_EH_PROJ, "pre_fc_norm_embedding.weight": T.NEXTN_ENORM,
             "pre_fc_norm_hidden.weight": T.NEXTN_HNORM, "norm.weight": T.NEXTN_SHARED_HEAD_NORM}
    q8 = Mtp(trunk)
    q8.load_state_dict(mtp.state_dict())
    q8_sd = q8.state_dict()
    for name, p in sorted(mtp.state_dict().items()):
        p = p.to(torch.bfloat16).float()
        if name in nextn:
            gname = gguf.TENSOR_NAMES[nextn[name]].format(bid=L) + ".weight"
            # the converter renames first (`model.layers.L.enorm.weight`, …) and adds 1 to every `*norm.weight`
            t = p + 1 if gname.endswith("norm.weight") else p
        else:  # layers.0.<rest> -> the trunk name of block L
            gname, t = converter_transform(f"model.layers.{L}.{name[len('layers.0.'):]}", p, hp)
        if t.ndim == 2:
            data, deq = q8_roundtrip(t)
            q8_sd[name].copy_(deq)
            w.add_tensor(gname, data, raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(gname, t.numpy().astype(np.float32), raw_dtype=QT.F32)
    w.add_block_count(L + 1)
    w.add_nextn_predict_layers(1)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    w.add_array("qwen35.attention.recurrent_layers", [lt == "linear_attention" for lt in hp["layer_types"]])
    w.add_full_attention_interval(hp["full_attention_interval"])
    w.add_rope_dimension_count(int(hp["head_dim"] * hp["rope_parameters"]["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    q8.load_state_dict(q8_sd)
    return q8


def tensors_of(r: dict, prefix: str = "") -> dict:
    return {prefix + "hidden": r["hidden"].contiguous(), prefix + "mtp_logits": r["mtp_logits"].contiguous()}


def meta_of(r: dict) -> dict:
    return {k: r[k] for k in ("x_n", "drafts", "verify_tokens", "verify_picks", "accepted", "bonus",
                               "drafts_after_verify")}


def make(name: str, moe: bool, seed0: int) -> None:
    d = ROOT / "fixtures" / name
    d.mkdir(parents=True, exist_ok=True)
    for seed in range(seed0, seed0 + 400):
        torch.manual_seed(seed)
        cfg = Qwen3_5MoeTextConfig(**MOE) if moe else Qwen3_5TextConfig(**DENSE)
        cfg._attn_implementation = "eager"
        trunk = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(cfg).eval()
        randomize_(trunk, seed)
        mtp = Mtp(trunk).eval()
        randomize_mtp_(mtp, seed + 100_000)
        # the stored values: bf16, computed with in float32 (parameters only: RoPE's inv_freq buffer stays f32)
        with torch.no_grad():
            for p in list(trunk.parameters()) + list(mtp.parameters()):
                p.copy_(p.to(torch.bfloat16).float())
        g = torch.Generator().manual_seed(seed + 1)
        prompt = torch.randint(0, cfg.vocab_size, (N_PROMPT,), generator=g).tolist()
        margins: list[float] = []
        gaps, hooks = router_margins(trunk, mtp) if moe else ([], [])
        ref = reference(trunk, mtp, prompt, margins)
        for h in hooks:
            h.remove()
        # the two rounds of drafts must differ (a round that starts from the same token as the first could hide a
        # block that ignores its hidden input)
        ok = min(margins) > MARGIN and (not gaps or min(gaps) > 1e-3) and ref["drafts_after_verify"] != ref["drafts"]
        gguf_ref, q8_margins = None, []
        if ok and not moe:
            q8 = write_gguf(d / "model.gguf", trunk, mtp, dict(DENSE))
            gguf_ref = reference(trunk, q8.eval(), prompt, q8_margins)
            ok = min(q8_margins) > MARGIN_Q8
        print(name, seed, "margin", min(margins), "router", min(gaps) if gaps else None,
              "q8", min(q8_margins) if q8_margins else None, flush=True)
        if ok:
            break
    else:
        raise RuntimeError("no seed gave clear margins")
    files = (write_moe if moe else write_dense)(d, trunk, mtp, torch.bfloat16)
    out = tensors_of(ref)
    meta = dict(transformers=__import__("transformers").__version__, torch=torch.__version__, seed=seed,
                stored_dtype="bfloat16", reference_dtype="float32", prompt_ids=prompt, k=K,
                margin_min=min(margins), router_margin_min=min(gaps) if gaps else None, **files, **meta_of(ref))
    if gguf_ref is not None:
        out.update(tensors_of(gguf_ref, "gguf_"))
        meta["gguf"] = dict(file="model.gguf", mtp_matrices="Q8_0", trunk="BF16", margin_min=min(q8_margins),
                            **meta_of(gguf_ref))
    meta["note"] = ("hidden [n, H]: the trunk's final-normed rows of prompt_ids; mtp_logits [n, V]: the block on pairs "
                    "(hidden[p], (prompt_ids + [x_n])[p + 1]) at positions p; drafts: greedy from the last pair; "
                    "verify_tokens = [x_n] + drafts run by the trunk, verify_picks its greedy picks, accepted the "
                    "drafts kept, bonus its pick after them; drafts_after_verify: greedy after ingesting the accepted "
                    "pairs. gguf_*: the same from model.gguf (the block's matrices Q8_0, dequantized).")
    save_file(out, str(d / "reference.safetensors"), metadata={"format": "pt"})
    (d / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(d, "seed", seed)


def main() -> int:
    torch.set_num_threads(1)
    only = sys.argv[1:]
    for name, moe, seed in [("tiny-mtp", False, 7000), ("tiny-mtp-moe", True, 8000)]:
        if not only or name in only:
            make(name, moe, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
