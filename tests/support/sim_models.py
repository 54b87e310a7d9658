"""Models for the tests on the simulated cluster: a seeded checkpoint saved by transformers, and
transformers' own greedy tokens for it (the reference the service's tokens must equal)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.support.models import copy_tiny_tokenizer, load_hf_reference, randomise


def make_checkpoint(out: Path) -> Path:
    """A seeded random Llama saved by transformers into ``out`` (created; it must not exist), with KV
    big enough (4 KiB a token in float32) that a pull stands out of the Ray traffic on a link."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)  # fmt: skip
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).float()
    randomise(model, 3)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    copy_tiny_tokenizer(out)
    return out


def greedy_reference(model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """``reference(prompt, n)``: the ``n`` tokens transformers' greedy ``generate`` continues
    ``prompt`` with, EOS ignored (as ``SamplingParams(ignore_eos=True)``)."""
    hf = load_hf_reference(model_dir)

    @torch.no_grad()
    def reference(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(prompt):].tolist()

    return reference
