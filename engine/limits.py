"""RequestLimits: what a request must fit to be served (one rule for the engine and the router)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.kvcache.manager import blocks_for_request
from pdserve.engine.model.config import ModelConfig


@dataclass(frozen=True)
class RequestLimits:
    """The vocabulary, the context length and, when known, the KV pool a request must fit.

    The router checks requests with the same limits as the engines behind it (``kv_blocks``: the
    smallest worker pool), so nothing is prefilled that a worker would refuse.
    """

    vocab_size: int
    max_model_len: int
    block_size: int
    kv_blocks: int | None = None
    sliding_window: int | None = None
    max_chunk_tokens: int | None = None

    @classmethod
    def for_engine(cls, model: ModelConfig, config: EngineConfig, kv_blocks: int | None = None) -> RequestLimits:
        max_model_len = min(config.scheduler.max_model_len or model.max_context_len, model.max_context_len)
        return cls(model.vocab_size, max_model_len, config.cache.block_size, kv_blocks, model.sliding_window,
                   config.scheduler.max_num_batched_tokens)  # fmt: skip

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return blocks_for_request(num_prompt_tokens, max_tokens, self.max_model_len, self.block_size,
                                  self.sliding_window, self.max_chunk_tokens)  # fmt: skip

    @property
    def usable_len(self) -> int:
        """The longest sequence (prompt + output) a request can reach: ``max_model_len``, or less
        when the pool cannot hold one request that long. What the API advertises as the model's
        ``max_model_len``: any prompt shorter than this can generate at least one token."""
        if self.kv_blocks is None:
            return self.max_model_len
        lo, hi = 1, self.max_model_len  # fits(L): a prompt of L - 1 tokens and one output token fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(mid - 1, 1) <= self.kv_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_tokens_for(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt of this length may generate: up to ``max_model_len`` and, when
        the pool is known, within it (at least 1; ``check`` says when even that does not fit)."""
        hi = max(self.max_model_len - num_prompt_tokens, 1)
        if self.kv_blocks is None or self.blocks_needed(num_prompt_tokens, hi) <= self.kv_blocks:
            return hi
        lo = 1  # blocks_needed grows with max_tokens: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(num_prompt_tokens, mid) <= self.kv_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def check(self, token_ids: Sequence[int], max_tokens: int) -> None:
        """ValueError whose message starts with the offending field, if the request cannot be served."""
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within max_model_len={self.max_model_len}")
        if self.kv_blocks is not None:
            need = self.blocks_needed(n, max_tokens)
            if need > self.kv_blocks:
                raise ValueError(
                    f"max_tokens: {n} prompt tokens + max_tokens={max_tokens} need {need} KV blocks, "
                    f"the pool holds {self.kv_blocks}"
                )
