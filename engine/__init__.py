"""pdserve's inference engine: paged KV cache, model, kernels, scheduler, sampler, offline API.

``LLM`` and ``SamplingParams`` are imported lazily so that the pure-Python parts
(``engine.kvcache``) load without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
