"""Tiny random DeepSeek-V2/V3 checkpoints built and saved by transformers itself.

Variants cover the MLA and MoE choices the family makes:

* ``v2_lite``: no ``q_lora_rank``, greedy top-k over softmax scores, two shared experts
  (DeepSeek-V2-Lite's shape);
* ``v2``: ``q_lora_rank``, group-limited greedy routing, YaRN rope (DeepSeek-V2's);
* ``v3``: ``q_lora_rank``, sigmoid scores with the correction bias and grouped top-k (noaux_tc),
  normalised weights, YaRN rope with mscale, interleaved rotary dims (DeepSeek-V3's);
* ``v3_halves``: V3 with ``rope_interleave=False``.

Weights are re-randomised at unit scale so logits are far from uniform and any mapping, rope or
routing error shows up well above the comparison tolerance.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import copy_tiny_tokenizer, randomise

DEEPSEEK_VARIANTS: tuple[str, ...] = ("v2_lite", "v2", "v3", "v3_halves")

_BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,  # != qk_nope_head_dim: K and V widths differ, as in the real models
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
    first_k_dense_replace=1,
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
         "beta_slow": 1, "rope_theta": 10000.0}  # fmt: skip


def _hf_config(variant: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    kw: dict[str, object] = dict(_BASE)
    if variant == "v2_lite":
        kw.update(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                  topk_method="greedy", routed_scaling_factor=1.0)  # fmt: skip
        return DeepseekV2Config(**kw)
    if variant == "v2":
        kw.update(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
                  topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                  rope_parameters={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707})  # fmt: skip
        return DeepseekV2Config(**kw)
    if variant in ("v3", "v3_halves"):
        kw.update(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  rope_interleave=variant == "v3", num_key_value_heads=4,
                  rope_parameters={**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0})  # fmt: skip
        return DeepseekV3Config(**kw)
    raise ValueError(f"unknown variant {variant!r}; known: {DEEPSEEK_VARIANTS}")


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    randomise(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


def make_deepseek_checkpoint(out_dir: str | Path, variant: str, seed: int = 0) -> Path:
    """Save a seeded random transformers DeepSeek model of ``variant`` to ``out_dir``."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(variant)
    torch.manual_seed(seed)
    cls = DeepseekV2ForCausalLM if variant.startswith("v2") else DeepseekV3ForCausalLM
    model = cls(config).float()
    _randomise(model, seed)
    model.save_pretrained(out)
    copy_tiny_tokenizer(out)
    return out
