"""A cascade's shared-prefix attention in float32 on the CPU (``cpu_prefix.c``).

A step's decode sequences that share a prefix read its keys once, in one batched attention whose
queries are every sequence's query heads (``engine/kernels/cascade.py``). ATen's CPU flash-attention
operator ran it at about 90 GFLOP/s in float32 at SmolLM2's shapes (32 sequences of 3 query heads a KV
head, a 221-token prefix): 7.4 ms of a 71 ms decode step over 30 layers. The kernel lays each head's K
out transposed by 16-key tiles, so that a query row's scores are a vector of broadcast FMAs, and keeps
six rows' P V sums in registers. bfloat16 prefixes go to the AMX tiles instead (``cpu_amx_prefix.py``).

The result is the flash operator's up to float32 rounding (scores summed over the dims in order, a
softmax over chunks of 256 keys, online across chunks): ``tests/engine/test_cpu_prefix.py``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_build, labels

_SOURCE = Path(__file__).with_name("cpu_prefix.c")
PROFILER_LABEL = "pdserve::cpu_prefix_attention"  # what torch.profiler calls a call
TILE = 16  # keys per tile of the transposed K (cpu_prefix.c)
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _get() -> ctypes.CDLL | None:
    """The library, built and loaded on the first call (None where it is not built)."""
    lib = cpu_build.load(_SOURCE)
    if lib is None:
        return None
    fn = lib.pdserve_prefix_attention_f32
    fn.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.pdserve_prefix_supports_head_dim.argtypes = [_I]
    lib.pdserve_prefix_supports_head_dim.restype = ctypes.c_int
    return lib


def available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`attention` runs here for a ``dtype`` prefix of ``head_dim``: float32, a head size
    the kernel is instantiated for (16, 32, 64, 80, 96, 128 or 256), and the library built for AVX-512
    (elsewhere ATen's flash operator stays faster)."""
    lib = _get() if dtype == torch.float32 else None
    return lib is not None and bool(lib.pdserve_prefix_supports_head_dim(head_dim))


def workspace(keys: int, heads: int, head_dim: int) -> torch.Tensor:
    """The kernel's buffer for ``keys`` prefix keys of ``heads`` KV heads (each call lays K out in it)."""
    return torch.empty(heads * -(-keys // TILE) * head_dim * TILE, dtype=torch.float32)


def entry() -> ctypes._CFuncPtr | None:
    """The kernel's unchecked entry point, as :func:`attention` calls it (its argument list), for callers that
    check their inputs once for many calls (``engine/model/decode_replay.py``); None where it is not built."""
    lib = _get()
    return None if lib is None else lib.pdserve_prefix_attention_f32


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's attention over the prefix keys, and its log-sum-exp: ``q [B, Hq, D]`` float32 (one
    query row a sequence, read where it lies: any row stride, its heads adjacent), ``k``/``v [P, Hkv, D]``
    float32, contiguous, ``Hq`` a multiple of ``Hkv`` -> ``(out [B, Hkv, G, D], lse [B, Hkv, G])``, float32
    views of ``[Hkv, G, B]``-ordered tensors, G = Hq / Hkv. Requires :func:`available`; raises ValueError
    for inputs that break this."""
    batch, num_heads, d = q.shape
    keys, heads = k.shape[:2]
    if (not available(q.dtype, d) or q.dtype != k.dtype or k.dtype != v.dtype or k.shape != v.shape or k.dim() != 3
            or k.shape[2] != d or not heads or num_heads % heads or not batch or not keys
            or not k.is_contiguous() or not v.is_contiguous()):  # fmt: skip
        raise ValueError(f"float32 prefix attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"v {tuple(v.shape)} {v.dtype}")  # fmt: skip
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    group = num_heads // heads
    kt = workspace(keys, heads, d)
    out = torch.empty(heads, group, batch, d, dtype=torch.float32)
    lse = torch.empty(heads, group, batch, dtype=torch.float32)
    lib = _get()
    assert lib is not None  # available() built it
    with labels.label(PROFILER_LABEL):
        failed = lib.pdserve_prefix_attention_f32(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), kt.data_ptr(),
                                                  batch, heads, group, keys, d, scale, out.data_ptr(), lse.data_ptr(),
                                                  torch.get_num_threads())  # fmt: skip
    if failed:  # not reached: available() checked the head size
        raise ValueError(f"float32 prefix attention: the kernel refused head size {d}")
    return out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)
