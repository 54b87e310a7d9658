"""The KV pool's size: from a memory budget, checked against ``max_model_len`` at start.

An engine's pool is sized, first rule that applies:

1. ``cache.num_blocks``: exactly that many blocks (a knob for tests and experts). The engine serves
   what fits them and says so: ``RequestLimits.usable_len`` is what the API advertises.
2. ``cache.kv_cache_memory_bytes``: a budget in bytes (vLLM's ``--kv-cache-memory-bytes``).
3. The default budget. On a GPU, ``cache.gpu_memory_utilization`` of the device's memory, less what
   the process holds once the model is loaded (weights, CUDA context) and an activation reserve
   (vLLM's ``--gpu-memory-utilization``, without its profiling run). On the CPU, room for one
   request of ``max_model_len`` tokens, and at least ``CPU_DEFAULT_MIN_BYTES``.

With a budget (2 or 3) the pool must hold one request of ``max_model_len`` tokens, as vLLM requires:
``KVBudgetError`` at start otherwise, with the numbers and the two ways out (a bigger budget or a
smaller ``--max-model-len``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MiB = 1024**2
CPU_DEFAULT_MIN_BYTES = 256 * MiB


class KVBudgetError(ValueError):
    """The KV budget cannot hold one request of ``max_model_len`` tokens."""


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory once the model is loaded: what is free and the device's total (bytes)."""

    free: int
    total: int


@dataclass(frozen=True)
class KVPoolPlan:
    num_blocks: int
    budget_bytes: int | None  # None: an exact block count was given
    source: str  # where the size came from, for messages and the log


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def activation_reserve(hidden_size: int, intermediate_size: int, vocab_size: int, max_num_batched_tokens: int,
                       max_num_seqs: int, elem_bytes: int) -> int:  # fmt: skip
    """GPU memory kept out of the KV budget for one step's activations (an estimate, where vLLM
    measures with a profiling run): a few hidden-sized and MLP-sized tensors per batched token, the
    float32 logits of every sequence, and 256 MiB for the allocator and kernels' workspaces."""
    per_token = (8 * hidden_size + 3 * intermediate_size) * elem_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * vocab_size * 4 + 256 * MiB


def plan_kv_pool(
    num_blocks: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    block_nbytes: int,
    blocks_for_max_len: int,
    device_memory: Callable[[], DeviceMemory] | None,
    activation_reserve_bytes: int = 0,
) -> KVPoolPlan:
    """The pool's block count by the module's rules. ``blocks_for_max_len``: the blocks one request
    of ``max_model_len`` tokens needs; ``device_memory``: the GPU's memory now (None on the CPU)."""
    if num_blocks is not None:
        return KVPoolPlan(num_blocks, None, f"num_blocks={num_blocks}")
    if kv_cache_memory_bytes is not None:
        budget, source = kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes} ({_mib(kv_cache_memory_bytes)})"
    elif device_memory is not None:
        mem = device_memory()
        budget = int(mem.free - (1.0 - gpu_memory_utilization) * mem.total - activation_reserve_bytes)
        source = (f"gpu_memory_utilization={gpu_memory_utilization:g} of {_mib(mem.total)}, with {_mib(mem.free)} "
                  f"free after loading the model and {_mib(activation_reserve_bytes)} kept for activations")  # fmt: skip
    else:
        budget = max(CPU_DEFAULT_MIN_BYTES, blocks_for_max_len * block_nbytes)
        source = f"the CPU default ({_mib(budget)}: one request of max_model_len, at least {_mib(CPU_DEFAULT_MIN_BYTES)})"
    return KVPoolPlan(max(budget, 0) // block_nbytes, budget, source)


def check_max_model_len(
    plan: KVPoolPlan, max_model_len: int, blocks_for_max_len: int, usable_len: int, block_size: int,
    block_nbytes: int,
) -> None:  # fmt: skip
    """``KVBudgetError`` when a budget-sized pool cannot hold one request of ``max_model_len``
    tokens (``usable_len``: the longest it can hold); an exact block count is never refused."""
    if plan.budget_bytes is None or plan.num_blocks >= blocks_for_max_len:
        return
    need = blocks_for_max_len * block_nbytes
    raise KVBudgetError(
        f"the KV cache cannot hold one request of max_model_len={max_model_len} tokens: that needs "
        f"{blocks_for_max_len} blocks of {block_size} tokens ({_mib(need)} at {block_nbytes // block_size} bytes "
        f"per token), and {plan.source} gives {plan.num_blocks} blocks ({plan.num_blocks * block_size} tokens). "
        f"Give the KV cache at least {need} bytes (--kv-cache-memory-bytes {-(-need // MiB)}MiB), or lower "
        f"--max-model-len to at most {usable_len}"
    )
