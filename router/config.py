"""RouterConfig: how the router picks workers (router/policy.py explains the formula)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    # Uncached prompt tokens at or below this are prefilled on the decode worker (no transfer).
    local_prefill_threshold: int = 32
    # score = overlap_tokens - load_weight * queued_tokens
    load_weight: float = 1.0
    # Retries on another decode worker while no decode token was sent.
    decode_retries: int = 1

    def __post_init__(self) -> None:
        for name in ("local_prefill_threshold", "decode_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        w = self.load_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"load_weight must be a finite number >= 0, got {w!r}")
