"""Paged-attention and KV-write kernels (Triton on CUDA, vectorised torch on CPU) with torch references.

Public API:

* :func:`write_kv` / :func:`paged_attention`: validated host wrappers that dispatch to
  Triton (CUDA), vectorised torch (CPU) or the reference (``impl=`` overrides);
  :func:`gather_shared_prefix`: a step's cascade prefix for every layer in one gather.
* :func:`write_kv_ref` / :func:`paged_attention_ref`: plain-torch references.
* :class:`AttentionMetadata`: the per-step batch description these ops consume.

Importing this package never imports triton; only the Triton backend does.
"""

from __future__ import annotations

from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.kernels.ops import IMPLS, gather_shared_prefix, paged_attention, write_kv
from pdserve.engine.kernels.reference import paged_attention_ref, write_kv_ref
from pdserve.engine.kernels.torch_paged import TorchAttentionPlan, plan_attention

__all__ = [
    "IMPLS",
    "AttentionMetadata",
    "TorchAttentionPlan",
    "gather_shared_prefix",
    "plan_attention",
    "paged_attention",
    "paged_attention_ref",
    "write_kv",
    "write_kv_ref",
]
