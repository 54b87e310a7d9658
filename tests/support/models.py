"""Test helpers for engine.model: tiny random HF checkpoints and a paged-KV runner.

Checkpoints are built WITH transformers (the reference implementation) and saved
with ``save_pretrained``; our loader then reads the same files. Weights are
re-randomised with unit-scale std so logits are far from uniform and a wrong
mapping/rope/bias shows up well above the comparison tolerance.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.model import LlamaForCausalLM, make_tiny_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HF_VARIANTS: tuple[str, ...] = ("llama_gqa", "qwen2_bias", "mqa", "llama3_rope", "sharded", "tied", "mistral_window")

_BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
)


def _hf_config(variant: str) -> PretrainedConfig:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kw: dict[str, object] = dict(_BASE)
    if variant in ("llama_gqa", "sharded"):
        return LlamaConfig(**kw)
    if variant == "qwen2_bias":
        kw.update(rope_theta=1_000_000.0, eos_token_id=[257, 256])
        return Qwen2Config(**kw)
    if variant == "mqa":
        kw.update(num_key_value_heads=1, num_attention_heads=8, hidden_size=64, head_dim=8)
        return LlamaConfig(**kw)
    if variant == "llama3_rope":
        # Small original context so all three frequency bands are exercised.
        kw.update(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500_000.0,
        )
        return LlamaConfig(**kw)
    if variant == "tied":
        kw.update(tie_word_embeddings=True)
        return LlamaConfig(**kw)
    if variant == "mistral_window":
        # A window shorter than the test prompts, not a multiple of any block size used.
        kw.update(sliding_window=11)
        return MistralConfig(**kw)
    raise ValueError(f"unknown variant {variant!r}; known: {HF_VARIANTS}")


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        elif p.dim() >= 2:  # matrices and stacked experts: unit-scale outputs per row
            std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            p.copy_(std * torch.randn(p.shape, generator=g))


def copy_tiny_tokenizer(dst: Path) -> None:
    """Put the byte-level tokenizer.json written by make_tiny_model into ``dst``."""
    tmp = dst / "_tok"
    make_tiny_model(tmp, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8)
    shutil.copy(tmp / "tokenizer.json", dst / "tokenizer.json")
    shutil.rmtree(tmp)


def make_hf_checkpoint(out_dir: str | Path, variant: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                       overrides: dict[str, object] | None = None) -> Path:
    """Save a seeded random transformers model of ``variant`` (see HF_VARIANTS) to ``out_dir``, its
    weights stored in ``dtype`` (randomised in float32, then cast; config.json names ``dtype``);
    ``overrides`` set config attributes on top of the variant's (e.g. a wider ``hidden_size`` and
    ``head_dim``)."""
    from transformers import LlamaForCausalLM as HFLlama
    from transformers import MistralForCausalLM as HFMistral
    from transformers import Qwen2ForCausalLM as HFQwen2

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(variant)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    cls = {"qwen2_bias": HFQwen2, "mistral_window": HFMistral}.get(variant, HFLlama)
    model = cls(config).float()
    randomise(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype)
    shard = "60KB" if variant == "sharded" else "50GB"
    model.save_pretrained(out, max_shard_size=shard)
    copy_tiny_tokenizer(out)
    return out


def load_hf_reference(model_dir: str | Path) -> torch.nn.Module:
    """transformers' own model for ``model_dir`` (float32, eager attention, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """float32 ``[len, vocab]`` logits of one unbatched sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@dataclass
class PagedRunner:
    """Drives our model like the engine would: a flat batch over a paged KV cache.

    Blocks are handed out from a shuffled free list so block tables are
    non-contiguous and out of order; the cache starts as random noise so any read
    outside a sequence's causal window changes the logits.
    """

    model: LlamaForCausalLM
    block_size: int
    num_blocks: int = 64
    seed: int = 0
    kv_cache: torch.Tensor = field(init=False)
    _free: list[int] = field(init=False)
    _tables: dict[int, list[int]] = field(init=False, default_factory=dict)
    _lens: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        c = self.model.config
        p = next(self.model.parameters())
        g = torch.Generator().manual_seed(self.seed)
        planes = 1 if c.kv_cache_kind == "mla" else 2
        shape = (self.num_blocks, c.num_hidden_layers, planes, self.block_size, c.kv_cache_heads, c.kv_cache_head_dim)
        # Garbage in unused slots: any read outside the causal window would show up.
        self.kv_cache = torch.randn(shape, generator=g).to(dtype=p.dtype, device=p.device)
        self._free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self._free)

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Append ``tokens`` to each ``seq_id`` in one forward; float32 logits for every token."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq_id, tokens in chunks:
            start = self._lens.get(seq_id, 0)
            table = self._tables.setdefault(seq_id, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self._free.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids.extend(tokens)
            positions.extend(range(start, end))
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self._lens[seq_id] = end
        width = max(len(self._tables[s]) for s, _ in chunks)
        tables = [self._tables[s] + [0] * (width - len(self._tables[s])) for s, _ in chunks]
        device = self.kv_cache.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                self.kv_cache,
                meta,
            )
            return self.model.compute_logits(hidden)


def paged_prefill_logits(
    model: LlamaForCausalLM, token_ids: list[int], block_size: int, seed: int = 0
) -> torch.Tensor:
    """Logits ``[len, vocab]`` of one sequence prefilled in a single paged step."""
    num_blocks = 2 * (len(token_ids) // block_size + 1) + 4
    return PagedRunner(model, block_size, num_blocks=num_blocks, seed=seed).step([(0, token_ids)])
