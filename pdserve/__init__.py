"""pdserve: prefill/decode disaggregated LLM serving.

The offline API is ``from pdserve import LLM, SamplingParams``. Both are imported lazily,
so that importing a pure-Python part (``pdserve.engine.kvcache``) does not load torch.

Packages, bottom to top (each imports only those before it)::

    pdserve.engine          the inference engine and its KV-handover API
    pdserve.kvtransfer      the KV wire (gRPC block server and client)
    pdserve.kvindex         the Redis block index
    pdserve.worker          what both workers share (runtime, messages)
    pdserve.prefill_worker, pdserve.decode_worker
    pdserve.router          the client-facing service and routing policy
    pdserve.cluster         starting Ray, Redis, the workers and the router
    pdserve.cli             the ``pdserve`` command line
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
