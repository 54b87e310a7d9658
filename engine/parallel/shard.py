"""Which slice of a model one tensor-parallel rank holds (Megatron-style).

Attention heads, KV heads and MLP columns split evenly across ranks; with fewer KV heads than ranks
each KV head is replicated on ``size / num_kv_heads`` consecutive ranks (as vLLM does); each of them
writes the head's K/V itself (the same bytes), so that what it reads in a step is its own write. An
MLA latent is whole on every rank, and MoE experts split by their intermediate columns (every rank
holds a share of every expert). The vocabulary splits in ``ceil(V / size)`` rows per rank (the last
rank may hold fewer). Block ids, block tables and block hashes do not depend on any of this.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.model.config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``; ``size == 1`` is the whole model."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")

    def split(self, total: int) -> tuple[int, int]:
        """(start, count) of an evenly divisible dimension (heads, MLP columns)."""
        if total % self.size:
            raise ValueError(f"{total} does not divide by tensor_parallel_size {self.size}")
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(start, count) of the KV heads this rank attends with (replicated when ``total < size``)."""
        if total >= self.size:
            return self.split(total)
        return self.rank * total // self.size, 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(start, count) of this rank's embedding / LM-head rows; every rank's padded width is
        :meth:`vocab_width`."""
        width = self.vocab_width(vocab_size)
        start = min(self.rank * width, vocab_size)
        return start, min(width, vocab_size - start)

    def vocab_width(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError, naming the sizes, when ``config`` cannot be split ``size`` ways."""
    if size == 1:
        return
    name = config.architecture
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % size:
        raise ValueError(f"{name}: num_attention_heads={heads} does not divide by tensor_parallel_size={size}; "
                         f"use a size that divides {heads}")  # fmt: skip
    if config.mla is None and kv % size and size % kv:  # (an MLA latent is whole on every rank)
        raise ValueError(f"{name}: num_key_value_heads={kv} and tensor_parallel_size={size}: one must divide the "
                         "other (KV heads are split, or replicated when fewer than the ranks)")  # fmt: skip
    moe = config.moe
    dense = moe is None or any(not moe.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if dense and inter % size:
        raise ValueError(f"{name}: intermediate_size={inter} does not divide by tensor_parallel_size={size}")
    if moe is not None and moe.moe_intermediate_size % size:
        raise ValueError(f"{name}: moe_intermediate_size={moe.moe_intermediate_size} does not divide by "
                         f"tensor_parallel_size={size}")  # fmt: skip
