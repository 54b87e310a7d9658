"""bfloat16 matrix products on the CPU's AMX tiles through weights packed for them (``cpu_amx.c``).

A decode step of a few rows is bound by how fast the weights stream from memory; oneDNN's blocked
bfloat16 kernels read them at about two thirds of that speed at a small model's shapes. The kernel
here reads each weight packed once in panels of 32 output columns, each one sequential stream, and
keeps a chunk of up to 32 rows' sums on the tile registers while a panel passes
(``pdserve bench projections --dtype bfloat16`` measures it against oneDNN).

:func:`available` says whether :class:`AMXWeights` can be made of a weight here: a bfloat16 CPU
weight whose input size is a multiple of 32, on a CPU with AMX-BF16 whose kernel the library built
and Linux granted the tile state; callers keep oneDNN's copy otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_build

_SOURCE = Path(__file__).with_name("cpu_amx.c")
PROFILER_LABEL = "pdserve::cpu_amx_linear"  # what torch.profiler calls a kernel call
_P, _I = ctypes.c_void_p, ctypes.c_int64
PANEL = 32  # output columns per panel
BLOCK = 32  # inputs per tile row


@functools.cache
def _get() -> ctypes._CFuncPtr | None:
    """The kernel's entry point: built, loaded and granted the tile state on the first call (None
    where any of that fails or the build has no AMX)."""
    lib = cpu_build.load(_SOURCE)
    if lib is None or lib.pdserve_amx_init() != 0:
        return None
    fn = lib.pdserve_amx_linear
    fn.argtypes, fn.restype = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int], ctypes.c_int
    return fn


def available(weight: torch.Tensor) -> bool:
    """Whether :class:`AMXWeights` can be made of ``weight`` here (module docstring)."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.shape[1] % BLOCK == 0 and _get() is not None)  # fmt: skip


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [n, k]`` as ``[ceil(n / 32), k / 32, 2, 16, 16, 2]``: per panel of 32 output columns
    and block of 32 inputs, its two column tiles, each 16 input pairs x 16 columns x the pair
    (``w[p * 32 + t * 16 + c, b * 32 + 2 * i + e]`` at ``[p, b, t, i, c, e]``); columns past ``n`` are zero."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    w = weight.detach()
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.reshape(padded // PANEL, 2, 16, k // BLOCK, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


class AMXWeights:
    """An AMX copy of one bfloat16 linear map (weight ``[out, in]``, optional bias) for the kernel.

    Derived state like ``linear.OneDNNWeights``: never saved or moved with the model; its owner
    rebuilds it from the dense weight when that changes. ``min_rows`` (1): every 2-D input runs
    through it. Requires :func:`available` for the weight.
    """

    min_rows = 1

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if not available(weight):
            raise ValueError(f"AMX weights need a 2-D bfloat16 CPU weight whose input size is a multiple of "
                             f"{BLOCK}, on a CPU with AMX-BF16, got {tuple(weight.shape)} {weight.dtype} on "
                             f"{weight.device}")  # fmt: skip
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"bias: expected shape {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
        self.out_features, self.in_features = weight.shape
        self._fn = _get()
        self.tiles = pack(weight)
        # Added to the float32 sums before the rounding (oneDNN adds a bfloat16 bias the same way).
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` as a new contiguous ``[rows, out]`` bfloat16 tensor: float32 sums
        rounded once, as ``F.linear`` rounds (the order of the sums may differ). ``x``: 2-D bfloat16
        CPU, ``in_features`` columns; a row stride is fine, a column stride is copied first. Raises
        ValueError for anything else."""
        if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != self.in_features:
            raise ValueError(f"AMX linear: x must be a bfloat16 CPU [rows, {self.in_features}] tensor, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")  # fmt: skip
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        if rows == 0:
            return out
        with torch.profiler.record_function(PROFILER_LABEL):
            failed = self._fn(x.data_ptr(), x.stride(0), self.tiles.data_ptr(),  # type: ignore[misc]
                              None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows,
                              self.out_features, self.in_features, torch.get_num_threads())  # fmt: skip
        if failed:  # not reached: available() checked what the kernel refuses
            raise ValueError(f"the AMX kernel refused a [{rows}, {self.in_features}] input")
        return out
