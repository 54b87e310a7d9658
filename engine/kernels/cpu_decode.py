"""Decode attention that reads K/V in place from the paged cache, on the CPU (``cpu_decode.c``).

The torch path (:mod:`engine.kernels.torch_paged`) copies every decode sequence's K/V out of its
blocks each layer before one batched SDPA call; this kernel instead walks each sequence's block
table and reads the rows where they are, once per KV head for all of the head's query heads (GQA),
with an online softmax in float32. It returns the log-sum-exp as well, so a cascade's shared-prefix
part merges with it exactly (:func:`engine.kernels.cascade.merge`).

:func:`supports` says whether a call can run here (the library built, float32 or bfloat16 K/V of
the query's dtype, a GQA group of at most 16 query heads per KV head, a head size the kernel is
instantiated for: 16, 32, 64, 80, 96, 128 or 256); otherwise callers gather.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_build, labels

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_DTYPES = {torch.float32: "pdserve_paged_decode_f32", torch.bfloat16: "pdserve_paged_decode_bf16"}
PROFILER_LABEL = "pdserve::cpu_decode_attention"  # what torch.profiler calls a kernel call
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _P, _I, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float,
             _P, ctypes.c_int, _P, _P, _P, _P, _P, ctypes.c_int]


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fns = {}
        for dtype, name in _DTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self.fns[dtype] = fn
        self.max_group = int(lib.pdserve_max_group())
        lib.pdserve_supports_head_dim.argtypes, lib.pdserve_supports_head_dim.restype = [_I], ctypes.c_int
        self.head_dim_ok = lib.pdserve_supports_head_dim


@functools.cache
def _get() -> _Kernel | None:
    """The library's entry points, built and loaded on the first call (None where it is not built)."""
    lib = cpu_build.load(_SOURCE)
    return None if lib is None else _Kernel(lib)


def supports(dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`decode_attention` runs for queries of ``dtype`` over a ``cache_dtype`` cache of
    these head sizes (it builds the library on the first call)."""
    if dtype != cache_dtype or dtype not in _DTYPES or num_heads % num_kv_heads:
        return False
    kernel = _get()
    return kernel is not None and num_heads // num_kv_heads <= kernel.max_group and bool(kernel.head_dim_ok(head_dim))


def entry(dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """The kernel :func:`decode_attention` calls for ``dtype`` queries, unchecked (its argument list),
    for callers that check their inputs once for many calls (``engine/model/decode_replay.py``); None
    where it is not built or takes no ``dtype``."""
    kernel = _get()
    return None if kernel is None else kernel.fns.get(dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    starts: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's attention over its positions ``[starts[b], spans[b])``, and over other keys
    whose partial result ``prefix`` gives (a cascade's shared prefix), merged exactly in the kernel.

    ``q [B, Hq, D]`` (one query per sequence; a row stride is fine, each row's heads adjacent);
    ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` with each head's ``D`` values contiguous (a
    tensor-parallel rank's head slice is fine); ``blocks [B, max_blocks]`` int64: position ``p`` of row
    ``b`` is in block ``blocks[b, p // block_size]``; ``starts``/``spans`` int64 ``[B]``. ``prefix``:
    ``(out, lse)`` viewable as ``[B, Hkv, G, D]`` and ``[B, Hkv, G]`` (G = Hq / Hkv), ``out`` of ``q``'s
    dtype or float32 and ``lse`` float32 are read where they lie (any strides, ``D`` contiguous), other
    float dtypes after a copy. Every block id named for a read position must be in range (the caller's
    guarantee: the kernel does not check). Returns ``(out [B, Hq, D]`` in ``q``'s dtype (a bfloat16
    result rounded once from the float32 sums), ``lse [B, Hq]`` float32). Requires :func:`supports`
    for these shapes and dtypes.
    """
    kernel = _get()
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if kernel is None or not supports(q.dtype, k_cache.dtype, num_heads, num_kv_heads, head_dim):
        raise ValueError(f"decode_attention does not run for {q.dtype} queries over {k_cache.dtype} K/V here")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share strides and dtype, head_dim contiguous")
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [blocks, block_size, {num_kv_heads}, {head_dim}] (q's "
                         f"head size), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")  # fmt: skip
    for name, t in (("blocks", blocks), ("starts", starts), ("spans", spans)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape[0] != batch:
            raise ValueError(f"{name} must be a contiguous int64 tensor with {batch} rows")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    lse = torch.empty(batch, num_heads, dtype=torch.float32)
    init = prefix_args(prefix, q.dtype, (batch, num_kv_heads, num_heads // num_kv_heads, head_dim))
    with labels.label(PROFILER_LABEL):
        failed = kernel.fns[q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), blocks.data_ptr(), blocks.shape[1], starts.data_ptr(), spans.data_ptr(), batch,
            num_kv_heads, num_heads // num_kv_heads, head_dim, k_cache.shape[1], scale, *init, out.data_ptr(),
            lse.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    if failed:  # not reached: supports() above checks what the kernel refuses
        raise ValueError(f"the decode kernel refused head_dim={head_dim}, group={num_heads // num_kv_heads}")
    return out, lse


def prefix_args(prefix: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype,
                 shape: tuple[int, int, int, int]) -> tuple:  # fmt: skip
    """The kernel's ``init_out, init_f32, is, init_lse, ls`` for ``prefix`` (:func:`decode_attention`'s,
    viewable as ``shape`` ``[B, Hkv, G, D]``): the tensors themselves where the kernel reads them in
    place, else float32 copies; the stride arrays hold the tensors they describe, so the caller keeps
    them alive by keeping the tuple."""
    if prefix is None:
        return (None, 0, None, None, None)
    out, lse = prefix[0].view(shape), prefix[1].view(shape[:3])
    if out.dtype not in (dtype, torch.float32) or out.stride(3) != 1:
        out = out.float().contiguous()
    if lse.dtype != torch.float32:
        lse = lse.float()
    return (out.data_ptr(), int(out.dtype == torch.float32), _strides(out), lse.data_ptr(), _strides(lse))


def _strides(t: torch.Tensor) -> ctypes.Array:
    """``t``'s first three strides as the kernel's ``int64_t[3]``, holding ``t``."""
    arr = (ctypes.c_int64 * 3)(*t.stride()[:3])
    arr._tensor = t  # type: ignore[attr-defined]
    return arr


def supports_model(config: object, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether a model of ``config`` (an ``engine.model.config.ModelConfig``) computing in ``dtype``
    over a ``kv_dtype`` cache runs its decodes here: per-head K/V (not MLA's latents), see
    :func:`supports`."""
    if getattr(config, "mla", None) is not None:
        return False
    heads, kv_heads, head_dim = (getattr(config, n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    return supports(dtype, kv_dtype, heads, kv_heads, head_dim)
