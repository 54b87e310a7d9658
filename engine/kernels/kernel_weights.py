"""A linear map's weight packed once for a C kernel, and the checked call into it.

The CPU's packed projections (``cpu_gemm.PanelWeights`` for float32, ``cpu_amx.AMXWeights`` for
bfloat16) differ in how they lay the weight out and which kernel reads it; their entry points take
the same arguments: ``(x, x's row stride, packed weight, float32 bias or NULL, out, rows,
out_features, in_features, threads)``, returning nonzero where they refuse. :class:`KernelWeights`
holds what they share: the input checks, the output, the profiler label and the call.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

import torch

from pdserve.engine.kernels import labels


def pad_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """``weight`` ``[n, k]`` (detached) with zero rows appended up to a multiple of ``multiple``:
    the whole panels a packing lays out."""
    n, k = weight.shape
    w = weight.detach()
    pad = -n % multiple
    return torch.cat([w, w.new_zeros(pad, k)]) if pad else w


def interleave_gate_up(weight: torch.Tensor, half: int) -> torch.Tensor:
    """A SwiGLU gate/up ``weight [2 * inter, k]`` (gate rows, then up rows), detached, with its rows
    interleaved ``half`` at a time: ``gate[0:half], up[0:half], gate[half:2 * half], ...``, so that each
    run of ``2 * half`` rows holds matching gate and up rows (a fused kernel's panel). ``inter`` must be a
    multiple of ``half``."""
    n, k = weight.shape
    if n % (2 * half):
        raise ValueError(f"a gate/up weight needs 2 x a multiple of {half} rows, got {n}")
    return weight.detach().view(2, n // (2 * half), half, k).transpose(0, 1).reshape(n, k)


class KernelWeights:
    """A packed copy of one linear map (weight ``[out, in]``, optional bias) for a C kernel.

    Derived state like ``linear.OneDNNWeights``: never saved or moved with the model; its owner
    rebuilds it from the dense weight when that changes. ``min_rows`` (1): every 2-D input runs
    through it. A subclass names its ``dtype``, its ``label`` (what ``torch.profiler`` calls a call)
    and its ``name`` (in errors), checks the weight and packs it.
    """

    min_rows = 1
    dtype: ClassVar[torch.dtype]
    label: ClassVar[str]
    name: ClassVar[str]

    def __init__(self, fn: ctypes._CFuncPtr, packed: torch.Tensor, shape: torch.Size,
                 bias: torch.Tensor | None) -> None:  # fmt: skip
        """``fn``: the kernel's entry point; ``packed``: the weight in its layout; ``shape``: the
        dense weight's ``[out, in]``; ``bias``: float32, contiguous, or None."""
        self.out_features, self.in_features = shape
        self._fn = fn
        self.packed = packed
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` as a new contiguous ``[rows, out]`` tensor of the dtype, equal to
        ``F.linear`` up to the dtype's rounding (a different summation order). ``x``: 2-D, of the
        dtype, on the CPU, ``in_features`` columns; a row stride is fine, a column stride is copied
        first. Raises ValueError for anything else."""
        if x.dim() != 2 or x.dtype != self.dtype or not x.is_cpu or x.shape[1] != self.in_features:
            dtype = str(self.dtype).removeprefix("torch.")
            raise ValueError(f"{self.name}: x must be a {dtype} CPU [rows, {self.in_features}] tensor, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")  # fmt: skip
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=self.dtype)
        if rows == 0:
            return out
        with labels.label(self.label):
            failed = self._fn(x.data_ptr(), x.stride(0), self.packed.data_ptr(),
                              None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows,
                              self.out_features, self.in_features, torch.get_num_threads())  # fmt: skip
        if failed:  # not reached: the subclass checked what its kernel refuses
            raise ValueError(f"{self.name}: the kernel refused a [{rows}, {self.in_features}] input")
        return out

    def entry(self) -> tuple[ctypes._CFuncPtr, int, int | None]:
        """``(fn, packed, bias)``: the call :meth:`__call__` makes, unchecked, as
        ``fn(x, x's row stride, packed, bias, out, rows, out_features, in_features, threads)`` (nonzero
        where it refuses), with ``packed`` and ``bias`` the addresses of the weight's layout and of the
        float32 bias (None: none). For callers that check their inputs once for many calls
        (``engine/model/decode_replay.py``); the addresses hold while this object lives."""
        return self._fn, self.packed.data_ptr(), None if self.bias is None else self.bias.data_ptr()
