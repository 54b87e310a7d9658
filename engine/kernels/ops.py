"""Host wrappers for the KV write and paged attention: validation plus dispatch.

``impl`` selects the backend:

* ``None``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the Triton kernels (on CPU tensors only under ``TRITON_INTERPRET=1``);
* ``"torch"``: the vectorised torch path of :mod:`engine.kernels.torch_paged`;
* ``"reference"``: the slow, obviously-correct :mod:`engine.kernels.reference`.

Triton is imported lazily, inside the Triton branch only, so ``engine`` imports on
machines without it. Validation never reads tensor values (no device sync): the
caller guarantees that slots, block ids and lengths are in range and that
``query_start_loc`` is non-decreasing with ``q_len <= seq_len`` per sequence.
"""

from __future__ import annotations

import math

import torch

from pdserve import envs
from pdserve.engine.kernels.cascade import gather_layers
from pdserve.engine.kernels.quant import is_fp8
from pdserve.engine.kernels.reference import paged_attention_ref, write_kv_ref
from pdserve.engine.kernels.torch_paged import TorchAttentionPlan, paged_attention_torch, write_kv_torch

IMPLS = ("triton", "torch", "reference")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_TRITON_HEAD_DIM = 256


def _resolve_impl(impl: str | None, device: torch.device) -> str:
    """Map ``impl`` (possibly ``None``) to a concrete backend name for ``device``."""
    if impl is None:
        return "triton" if device.type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and device.type != "cuda" and not envs.triton_interpret():
        raise ValueError(
            f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return impl


def _check_same_device(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the other inputs)")


def _check_cache(name: str, cache: torch.Tensor, heads_sliced: bool = False) -> None:
    """A cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``, inner three dims contiguous;
    ``heads_sliced`` (the torch and reference paths): or a slice of a cache's heads (a
    tensor-parallel rank's), whose ``head_dim`` rows alone are contiguous."""
    if cache.dim() != 4:
        raise ValueError(f"{name} must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}")
    _, block_size, num_kv_heads, head_dim = cache.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"{name} has an empty dimension: {tuple(cache.shape)}")
    if heads_sliced:
        if cache.stride(3) != 1 or cache.stride(2) < head_dim or cache.stride(1) < num_kv_heads * head_dim:
            raise ValueError(f"{name} must be a head slice of a cache with contiguous head_dim rows, got strides "
                             f"{cache.stride()}")  # fmt: skip
        return
    expected = (num_kv_heads * head_dim, head_dim, 1)
    if tuple(cache.stride()[1:]) != expected:
        raise ValueError(
            f"{name} must have contiguous inner dims (strides {expected} for dims 1..3), got strides {cache.stride()}"
        )


def _check_float_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} to match the other inputs")


def _check_cache_dtype(cache: torch.Tensor, inputs: dict[str, torch.Tensor], k_scale: float, v_scale: float) -> None:
    """A float cache has the inputs' dtype and unit scales; an FP8 cache takes any float inputs
    (of one dtype) and finite positive scales."""
    first = next(iter(inputs.values()))
    for name, t in inputs.items():
        _check_float_dtype(name, t, first.dtype)
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if is_fp8(cache.dtype):
        return
    _check_float_dtype("k_cache", cache, first.dtype)
    if k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"k_scale/v_scale apply to an FP8 cache only; this cache is {cache.dtype}")


def _check_int_vector(name: str, t: torch.Tensor, dtype: torch.dtype, length: int | None = None) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {t.shape[0]}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token K/V into the paged caches in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, last dim contiguous,
            same dtype as the caches (any float dtype for an FP8 cache).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` views
            (any block stride; inner three dims contiguous), same shape and dtype.
        slot_mapping: int64 ``[num_tokens]``; slot ``= block_id * block_size +
            offset``, ``-1`` skips the token. Other slots must be in range.
        impl: backend, see the module docstring.
        k_scale, v_scale: an FP8 cache stores ``clamp(x / scale)`` (``engine.kernels.quant``);
            a float cache needs 1.0.

    Raises:
        ValueError: on a shape, dtype, device or stride mismatch, or unknown ``impl``.
    """
    if key.dim() != 3:
        raise ValueError(f"key must be 3-D [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    sliced = _resolve_impl(impl, k_cache.device) != "triton"  # the Triton kernels read whole-head caches
    _check_cache("k_cache", k_cache, sliced)
    _check_cache("v_cache", v_cache, sliced)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key [num_kv_heads, head_dim] = {tuple(key.shape[1:])} does not match the cache's {tuple(k_cache.shape[2:])}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache has dtype {v_cache.dtype}, k_cache {k_cache.dtype}")
    _check_cache_dtype(k_cache, {"key": key, "value": value}, k_scale, v_scale)
    _check_int_vector("slot_mapping", slot_mapping, torch.int64, key.shape[0])
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] > 0 and t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    device = k_cache.device
    _check_same_device({"key": key, "value": value, "v_cache": v_cache, "slot_mapping": slot_mapping}, device)

    backend = _resolve_impl(impl, device)
    if backend == "triton":
        from pdserve.engine.kernels.triton_kernels import write_kv_triton  # lazy: triton is optional

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    elif backend == "torch":
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    impl: str | None = None,
    plan: TorchAttentionPlan | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    layer: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over a flattened mixed batch (prefill, chunked prefill, decode).

    Semantics are those of :class:`engine.kernels.metadata.AttentionMetadata`: query
    row ``j`` of sequence ``s`` sits at position ``seq_lens[s] - q_len + j`` and
    attends to KV positions ``<=`` that, read through ``block_tables[s]``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` views,
            inner three dims contiguous; ``num_heads % num_kv_heads == 0``; same dtype
            as ``q`` (float16, bfloat16 or float32), or FP8 (read as ``stored * scale``).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, last dim contiguous.
        seq_lens: int32 ``[num_seqs]``.
        query_start_loc: int32 ``[num_seqs + 1]``.
        scale: softmax scale.
        max_query_len, max_seq_len: upper bounds of ``q_len`` and ``seq_lens``; used
            only as tuning hints (results stay correct if they are loose).
        impl: backend, see the module docstring. Triton needs ``head_dim <= 256``
            (padded to a power of two inside the kernel).
        plan: optional per-step index plan for the torch backend (``plan_attention`` over
            the same metadata and window); lets every layer of a forward share that work.
        sliding_window: if set (>= 1), a query at position ``p`` attends only to
            ``(p - sliding_window, p]`` (Mistral); None is full causal attention.
        k_scale, v_scale: the FP8 cache's scales (1.0 for a float cache).
        layer: the layer of the KV tensor these caches are, where :func:`gather_shared_prefix`
            took the step's cascade prefix for every layer at once (the torch backend reads it
            from the plan then); None: this call gathers it.

    Returns:
        A new contiguous ``[num_tokens, num_heads, head_dim]`` tensor in ``q.dtype``;
        rows past ``query_start_loc[-1]`` are zero.

    Raises:
        ValueError: on a shape, dtype, device or stride mismatch, or unknown ``impl``.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    sliced = _resolve_impl(impl, k_cache.device) != "triton"  # the Triton kernels read whole-head caches
    _check_cache("k_cache", k_cache, sliced)
    _check_cache("v_cache", v_cache, sliced)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache has dtype {v_cache.dtype}, k_cache {k_cache.dtype}")
    _check_cache_dtype(k_cache, {"q": q}, k_scale, v_scale)
    if num_tokens > 0 and q.stride(2) != 1:
        raise ValueError(f"q must have a contiguous last dim, got strides {q.stride()}")

    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks_per_seq], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have a contiguous last dim, got strides {block_tables.stride()}")
    _check_int_vector("seq_lens", seq_lens, torch.int32, num_seqs)
    _check_int_vector("query_start_loc", query_start_loc, torch.int32, num_seqs + 1)

    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    for name, hint in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if isinstance(hint, bool) or not isinstance(hint, int) or hint < 0:
            raise ValueError(f"{name} must be a non-negative int, got {hint!r}")
    device = q.device
    _check_same_device(
        {
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "query_start_loc": query_start_loc,
        },
        device,
    )

    backend = _resolve_impl(impl, device)
    if backend == "triton":
        if head_dim > _MAX_TRITON_HEAD_DIM:
            raise ValueError(f"triton paged attention needs head_dim <= 256, got {head_dim}")
        from pdserve.engine.kernels.triton_kernels import paged_attention_triton  # lazy: triton is optional

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale), max_query_len, max_seq_len,
            sliding_window=sliding_window, k_scale=float(k_scale), v_scale=float(v_scale),
        )  # fmt: skip
    if backend == "torch":
        return paged_attention_torch(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale), plan, sliding_window,
            float(k_scale), float(v_scale), layer,
        )  # fmt: skip
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale), sliding_window,
        float(k_scale), float(v_scale),
    )  # fmt: skip


def gather_shared_prefix(plan: object | None, kv_cache: torch.Tensor, kv_heads: slice) -> None:
    """Before a step's layers: where ``plan`` (``AttentionMetadata.torch_plan``) has a cascade, take its
    shared prefix's K and V for every layer of ``kv_cache`` (``[num_blocks, layers, 2, block_size, Hkv,
    D]``; ``kv_heads``: the heads the layers read) in one gather, which each layer's
    :func:`paged_attention` then reads (``layer=``) instead of gathering its own; on a bfloat16 cache
    where AMX runs, the tile kernel's view of it instead, which packs each layer as it runs
    (``cascade.gather_layers``). No-op otherwise."""
    if isinstance(plan, TorchAttentionPlan) and plan.cascade is not None and not plan.cascade.gathered:
        gather_layers(plan.cascade, kv_cache, kv_heads)
