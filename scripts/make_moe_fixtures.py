#!/usr/bin/env python3
"""Generate the tiny mixture-of-experts reference fixtures under fixtures/ (issue 34).

Builds small random checkpoints of `qwen3_5_moe` with transformers' own classes, writes them with save_pretrained
(which stores each expert's gate/up/down as its own 2-D tensor, `mlp.experts.{e}.gate_proj.weight`, as the hub's
`Qwen3_5Moe*` checkpoints are read), and records float32 reference outputs of transformers 5.23: the prefill logits
of a 100-token prompt (one chunk of 64 and a partial one) and 16 greedy decode steps with their logits.

    bash scripts/make_fixtures.sh   # creates .venv-fixtures/ (torch, transformers) once
    .venv-fixtures/bin/python scripts/make_moe_fixtures.py

Seeded and single-threaded (OMP_NUM_THREADS=1). No tokenizer: the references are token ids.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from make_fixtures import randomize_  # the dense fixtures' draws, with the router's and the experts'
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)

# Tiny vision tower for the hub layout (skipped by a text engine). out_hidden_size must equal the text hidden size.
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=TEXT["hidden_size"],
              num_position_embeddings=16)


def hub_config(**text):
    """The hub layout's config: the text settings under text_config, a vision tower beside them."""
    return Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION), tie_word_embeddings=False,
                            image_token_id=508, video_token_id=509, vision_start_token_id=510,
                            vision_end_token_id=511)


SPECS = [
    dict(name="tiny-moe-f32", dtype=torch.float32, seed=3456, cls=Qwen3_5MoeForCausalLM, cfg=Qwen3_5MoeTextConfig,
         extra={}),
    # bf16 storage: the reference computes in f32 on the stored weights upcast exactly
    dict(name="tiny-moe-bf16", dtype=torch.bfloat16, seed=5678, cls=Qwen3_5MoeForCausalLM, cfg=Qwen3_5MoeTextConfig,
         extra={}),
    # the hub layout (`Qwen3_5MoeForConditionalGeneration`: model.language_model.*, a vision tower), bf16
    dict(name="tiny-moe-hub", dtype=torch.bfloat16, seed=6789, cls=Qwen3_5MoeForConditionalGeneration, cfg=hub_config,
         extra={}),
    # Qwen3-Next: fused Gated DeltaNet projections, a dense layer among the MoE ones, the top k not renormalized
    dict(name="tiny-next-f32", dtype=torch.float32, seed=4567, cls=Qwen3NextForCausalLM, cfg=Qwen3NextConfig,
         extra=dict(intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=False)),
]


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def watch_router(model, gaps: list[float]) -> list:
    """Hooks recording, per router call, the smallest gap between a token's k-th and (k+1)-th router logit (the
    softmax is monotonic: the logits decide the top k)."""
    k = model.config.get_text_config().num_experts_per_tok

    def hook(_m, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    text = getattr(model.model, "language_model", model.model)  # the hub layout nests the text model
    return [layer.mlp.gate.register_forward_hook(hook) for layer in text.layers if hasattr(layer.mlp, "gate")]


def reference(model, ids: list[int], steps: int):
    """Prefill logits, greedy tokens, decode logits, and the smallest router gap over all of it."""
    gaps: list[float] = []
    hooks = watch_router(model, gaps)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        prefill = out.logits[0].float()
        cache = out.past_key_values
        tok = int(prefill[-1].argmax())
        greedy, decode = [], []
        for _ in range(steps):
            greedy.append(tok)
            o = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            row = o.logits[0, -1].float()
            decode.append(row)
            tok = int(row.argmax())
    for h in hooks:
        h.remove()
    return prefill, greedy, torch.stack(decode), min(gaps)


def make(spec: dict) -> None:
    """Tries seeds from `spec["seed"]` until no router decision of the reference run is within 1e-3 (in logits) of a
    tie (a near-tie would let f32 rounding pick another expert), then writes the fixture."""
    d = ROOT / "fixtures" / spec["name"]
    d.mkdir(parents=True, exist_ok=True)
    for seed in range(spec["seed"], spec["seed"] + 200):
        torch.manual_seed(seed)
        model = spec["cls"](spec["cfg"](**TEXT, **spec["extra"])).eval()
        randomize_(model, seed)
        model = model.to(spec["dtype"])
        model.save_pretrained(d, safe_serialization=True)
        # the reference: the stored weights loaded back in float32, eager attention
        ref = spec["cls"].from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        ids = prompt_ids(100, TEXT["vocab_size"], seed + 1)
        prefill, greedy, decode, margin = reference(ref, ids, 16)
        print(seed, margin)
        if margin > 1e-3:
            break
    else:
        raise RuntimeError("no seed gave router margins above 1e-3")
    save_file(
        {"prefill_logits": prefill.contiguous(), "decode_logits": decode.contiguous()},
        str(d / "reference.safetensors"),
        metadata={"format": "pt"},
    )
    meta = dict(
        transformers=__import__("transformers").__version__,
        torch=torch.__version__,
        seed=seed,
        stored_dtype=str(spec["dtype"]).replace("torch.", ""),
        reference_dtype="float32",
        prompt_ids=ids,
        greedy_ids=greedy,
        router_margin_min=margin,
        note="prefill_logits [100, V] of prompt_ids; greedy_ids[i] is the argmax before decode_logits[i]",
    )
    (d / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(d, "seed", seed, "router margin", margin)


def main() -> int:
    torch.set_num_threads(1)
    only = sys.argv[1:]
    for spec in SPECS:
        if not only or spec["name"] in only:
            make(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
