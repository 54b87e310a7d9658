"""Skinny float32 matrix products on the CPU (``cpu_skinny.c``): ``x @ weight.T + bias`` for 1-16 rows.

A decode step of a few sequences projects a few rows through every weight of the model, so it is
bound by how fast the weights stream from memory. torch's BLAS reaches a fraction of that at these
shapes (measured in ``pdserve bench projections``); this kernel streams each weight once on torch's
intra-op threads. :func:`supports` says whether a call can run here (the library built, float32 CPU
tensors, 1 to ``max_rows()`` rows, a contiguous weight); otherwise callers use torch.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_build

_SOURCE = Path(__file__).with_name("cpu_skinny.c")
PROFILER_LABEL = "pdserve::cpu_skinny_linear"  # what torch.profiler calls a kernel call
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.pdserve_skinny_f32
        self.fn.argtypes, self.fn.restype = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int], ctypes.c_int
        self.max_rows = int(lib.pdserve_skinny_max_rows())


@functools.cache
def _get() -> _Kernel | None:
    """The library's entry points, built and loaded on the first call (None where it is not built)."""
    lib = cpu_build.load(_SOURCE)
    return None if lib is None else _Kernel(lib)


def max_rows() -> int:
    """The most rows :func:`linear` takes; 0 where the library is not built (it builds on the first call)."""
    kernel = _get()
    return 0 if kernel is None else kernel.max_rows


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` runs for these tensors here."""
    # The library is built (first call) only for inputs it could take: never for GPU tensors.
    return (
        x.dim() == 2 and x.device.type == "cpu" == weight.device.type and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2 and weight.is_contiguous() and x.shape[1] == weight.shape[1] and x.stride(1) == 1
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == weight.shape[:1]))
        and 1 <= x.shape[0] <= max_rows()
    )  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` as a new contiguous ``[rows, out]`` float32 tensor, equal to
    ``F.linear`` up to float32 rounding (a different summation order). Requires :func:`supports`;
    raises ValueError otherwise."""
    out = try_linear(x, weight, bias)
    if out is None:
        raise ValueError(f"skinny linear does not run for x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} here")  # fmt: skip
    return out


def try_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`linear`'s result, or None where :func:`supports` is false (the caller's fallback runs)."""
    if not supports(x, weight, bias):
        return None
    kernel = _get()
    assert kernel is not None  # supports() is false without the library
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    with torch.profiler.record_function(PROFILER_LABEL):
        kernel.fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                  out.data_ptr(), rows, n, weight.shape[1], torch.get_num_threads())  # fmt: skip
    return out
