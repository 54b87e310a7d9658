"""A decoder layer's elementwise work on the CPU, its KV write and greedy sampling's argmax, one call
each (``cpu_ops.c``).

At a decode step's few rows, RMSNorm (with the residual add before it), SwiGLU's activation and the
rotary embedding are each several torch operators over a few kilobytes, and what they cost is the
operators' dispatch. These functions do each in one pass, with the rounding of the torch expressions
they replace (``engine/model/llama.py``, ``engine/model/rope.py``); float32 differs from those only
in the order of RMSNorm's sum of squares and the last bits of silu's exponential. The argmax of a
step's logits (:func:`argmax_rows`) is exact: one pass where torch's reduction takes several.

:func:`supports` says whether a tensor can take them here (float32 or bfloat16 on the CPU, the
library built, no autograd graph wanted); callers keep the torch expressions otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.engine.kernels import cpu_build, labels

_SOURCE = Path(__file__).with_name("cpu_ops.c")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
PROFILER_LABEL = "pdserve::cpu_ops"  # what torch.profiler calls a kernel call
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.norm, self.silu_mul, self.rotary, self.argmax = {}, {}, {}, {}
        for dtype, suffix in _SUFFIX.items():
            self.norm[dtype] = _bind(lib, f"pdserve_add_rms_norm_{suffix}", [_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, _N])
            self.silu_mul[dtype] = _bind(lib, f"pdserve_silu_mul_{suffix}", [_P, _I, _P, _I, _I, _I, _N])
            self.rotary[dtype] = _bind(lib, f"pdserve_rotary_{suffix}", [_P, _I, _I, _I, _I, _P, _P, _N])
            self.argmax[dtype] = _bind(lib, f"pdserve_argmax_rows_{suffix}", [_P, _I, _I, _I, _P, _N])
        self.write_kv = _bind(lib, "pdserve_write_kv", [_P, _I, _P, _I, _P, _P, _I, _I, _P, _I, _I, _I])


def _bind(lib: ctypes.CDLL, name: str, argtypes: list[type]) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


@functools.cache
def _get() -> _Kernel | None:
    """The library's entry points, built and loaded on the first call (None where it is not built)."""
    lib = cpu_build.load(_SOURCE)
    return None if lib is None else _Kernel(lib)


class Entries(NamedTuple):
    """The unchecked entry points of one dtype (``norm``, ``rotary``) and the KV write, as
    :func:`add_rms_norm`, :func:`rotary_` and :func:`write_kv` call them (their argument lists)."""

    norm: ctypes._CFuncPtr
    rotary: ctypes._CFuncPtr
    write_kv: ctypes._CFuncPtr


def entries(dtype: torch.dtype) -> Entries | None:
    """The entry points for ``dtype``, for callers that check their inputs once for many calls
    (``engine/model/decode_replay.py``); None where the library is not built or takes no ``dtype``."""
    kernel = _get()
    if kernel is None or dtype not in _SUFFIX:
        return None
    return Entries(kernel.norm[dtype], kernel.rotary[dtype], kernel.write_kv)


def supports(x: torch.Tensor) -> bool:
    """Whether ``x`` can go through these functions: a float32 or bfloat16 CPU tensor whose last
    dimension is contiguous, no autograd graph asked of it, and the library built here."""
    # Cheapest tests first: a decode step asks this a few hundred times.
    return (x.dtype in _SUFFIX and x.is_cpu and x.stride(-1) == 1
            and not (x.requires_grad and torch.is_grad_enabled()) and _get() is not None)  # fmt: skip


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(s, weight * rms_norm(s))`` for ``s = h + delta`` (``s = h`` when ``delta`` is None): rows of
    ``h [n, d]``, the norm in float32 rounded to ``h``'s dtype before the weight, as
    ``llama.RMSNorm``. ``h``, ``delta`` and ``weight`` share a dtype that :func:`supports` takes;
    ``weight`` is contiguous ``[d]``. ``s`` is ``h`` itself when there is no ``delta``."""
    n, d = h.shape
    _check(h.dtype, h, weight, delta)
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"delta must have h's shape {tuple(h.shape)}, not {tuple(delta.shape)}")
    if weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{d}] tensor, not {tuple(weight.shape)}")
    out = torch.empty(n, d, dtype=h.dtype)
    s = h if delta is None else torch.empty(n, d, dtype=h.dtype)
    with labels.label(PROFILER_LABEL):
        _get().norm[h.dtype](  # type: ignore[union-attr]
            h.data_ptr(), h.stride(0), None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0), s.data_ptr(), weight.data_ptr(), out.data_ptr(), n, d, eps,
            torch.get_num_threads(),
        )  # fmt: skip
    return s, out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` as ``[n, inter]``, silu rounded to the
    dtype before the product (``F.silu(g) * u``)."""
    n, width = gate_up.shape
    if width != 2 * inter:
        raise ValueError(f"gate_up has {width} columns, not 2 x {inter}")
    _check(gate_up.dtype, gate_up)
    out = torch.empty(n, inter, dtype=gate_up.dtype)
    with labels.label(PROFILER_LABEL):
        _get().silu_mul[gate_up.dtype](  # type: ignore[union-attr]
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, n, inter, torch.get_num_threads()
        )
    return out


def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate in place the first ``heads`` heads of ``head_dim`` columns of each row of ``x [n, w]``
    (``rope.apply_rotary``'s halves form); ``cos``/``sin`` hold ``n x head_dim / 2`` contiguous
    values of ``x``'s dtype (``RotaryEmbedding.lookup``'s ``[n, 1, head_dim / 2]``)."""
    n, width = x.shape
    half = head_dim // 2
    if heads * head_dim > width or head_dim % 2:
        raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {width}")
    _check(x.dtype, x, cos, sin)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != n * half or not t.is_contiguous():
            raise ValueError(f"{name} must hold {n} x {half} contiguous values")
    with labels.label(PROFILER_LABEL):
        _get().rotary[x.dtype](  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), n, heads, head_dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
        )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: each row's first largest value's index, a NaN's first where the row has one, as
    ``x.max(dim=-1).indices`` (and of ``x.float()``: widening keeps the order). ``x`` is ``[n, vocab]``
    and :func:`supports` it. One pass over each row, where torch's reduction makes several."""
    n, cols = x.shape
    _check(x.dtype, x)
    out = torch.empty(n, dtype=torch.int64)
    with labels.label(PROFILER_LABEL):
        _get().argmax[x.dtype](  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), n, cols, out.data_ptr(), torch.get_num_threads()
        )
    return out


def writes_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`write_kv` takes these: ``key``/``value [n, heads, head_dim]`` and the caches
    ``[blocks, block_size, heads, head_dim]`` of one dtype :func:`supports` takes, each token's heads
    adjacent (a strided cache or a head slice of one is fine), the caches' strides equal."""
    head_dim = key.shape[-1]
    return (key.dim() == 3 and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and supports(key)
            and value.shape == key.shape and k_cache.dim() == 4 and k_cache.shape[2:] == key.shape[1:]
            and v_cache.shape == k_cache.shape
            and k_cache.device.type == "cpu" and k_cache.stride() == v_cache.stride()
            and k_cache.stride()[2:] == (head_dim, 1)
            and all(t.stride()[1:] == (head_dim, 1) for t in (key, value)))  # fmt: skip


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """Copy each token's K and V rows into slot ``slot_mapping[t]`` of the caches (``-1`` skips the
    token), as ``engine.kernels.torch_paged.write_kv_torch`` does. Requires :func:`writes_kv` and a
    contiguous int64 ``slot_mapping`` of in-range slots (the caller's checks)."""
    size = key.element_size()
    with labels.label(PROFILER_LABEL):
        _get().write_kv(  # type: ignore[union-attr]
            key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride(0) * size, k_cache.stride(1) * size, slot_mapping.data_ptr(),
            key.shape[0], k_cache.shape[1], key.shape[1] * key.shape[2] * size,
        )  # fmt: skip


def _check(dtype: torch.dtype, *others: torch.Tensor | None) -> None:
    if dtype not in _SUFFIX or _get() is None:
        raise ValueError(f"cpu_ops does not run for {dtype} here")
    for t in others:
        if t is not None and (t.dtype != dtype or t.device.type != "cpu" or t.stride(-1) != 1):
            raise ValueError(f"every operand must be a {dtype} CPU tensor whose rows are contiguous")
