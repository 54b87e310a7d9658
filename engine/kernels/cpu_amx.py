"""bfloat16 matrix products on the CPU's AMX tiles through weights packed for them (``cpu_amx.c``).

A decode step of a few rows is bound by how fast the weights stream from memory; oneDNN's blocked
bfloat16 kernels read them at about two thirds of that speed at a small model's shapes. The kernel
here reads each weight packed once in panels of 32 output columns, each one sequential stream, and
keeps a chunk of up to 32 rows' sums on the tile registers while a panel passes
(``pdserve bench projections --dtype bfloat16`` measures it against oneDNN).

:class:`AMXGluWeights` is SwiGLU's gate/up product and its activation in one call: the panels hold
16 gate columns beside the same 16 up columns, and each item writes ``silu(gate) * up`` from its sums,
rounded as the unfused product and ``cpu_ops.silu_mul`` round (bit for bit the same), without writing
the product's ``[rows, 2 * inter]`` columns and reading them back.

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
from pdserve.engine.kernels.kernel_weights import KernelWeights, interleave_gate_up, pad_rows

_SOURCE = Path(__file__).with_name("cpu_amx.c")
PROFILER_LABEL = "pdserve::cpu_amx_linear"  # what torch.profiler calls a kernel call
_P, _I = ctypes.c_void_p, ctypes.c_int64
PANEL = 32  # output columns per panel
BLOCK = 32  # inputs per tile row


@functools.cache
def _get() -> ctypes.CDLL | None:
    """The library with its entry points' signatures set: built, loaded and granted the tile state on
    the first call (None where any of that fails or the build has no AMX)."""
    lib = cpu_build.load(_SOURCE)
    if lib is None or lib.pdserve_amx_init() != 0:
        return None
    for fn in (lib.pdserve_amx_linear, lib.pdserve_amx_glu):
        fn.argtypes, fn.restype = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int], ctypes.c_int
    return lib


def ready() -> bool:
    """Whether the tile kernels run in this process: the library built with AMX and the tile state granted."""
    return _get() is not None


def available(weight: torch.Tensor) -> bool:
    """Whether :class:`AMXWeights` can be made of ``weight`` here (module docstring)."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.shape[1] % BLOCK == 0 and _get() is not None)  # fmt: skip


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [n, k]`` as ``[ceil(n / 32), k / 32, 2, 16, 16, 2]``: per panel of 32 output columns
    and block of 32 inputs, its two column tiles, each 16 input pairs x 16 columns x the pair
    (``w[p * 32 + t * 16 + c, b * 32 + 2 * i + e]`` at ``[p, b, t, i, c, e]``); columns past ``n`` are zero."""
    w = pad_rows(weight, PANEL)
    k = w.shape[1]
    return w.reshape(w.shape[0] // PANEL, 2, 16, k // BLOCK, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


class AMXWeights(KernelWeights):
    """An AMX copy of one bfloat16 linear map (weight ``[out, in]``, optional bias) for the kernel
    (:class:`KernelWeights` runs it: float32 sums rounded once to bfloat16, as ``F.linear`` rounds).
    Requires :func:`available` for the weight."""

    dtype = torch.bfloat16
    label = PROFILER_LABEL
    name = "AMX linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if not available(weight):
            raise ValueError(f"AMX weights need a 2-D bfloat16 CPU weight whose input size is a multiple of "
                             f"{BLOCK}, on a CPU with AMX-BF16, got {tuple(weight.shape)} {weight.dtype} on "
                             f"{weight.device}")  # fmt: skip
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"bias: expected shape {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
        # The bias is added to the float32 sums before the rounding (oneDNN adds a bfloat16 bias the same way).
        lib = _get()
        assert lib is not None  # available() loaded it
        super().__init__(lib.pdserve_amx_linear, pack(weight), weight.shape,
                         None if bias is None else bias.detach().float().contiguous())  # fmt: skip


def pack_glu(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up ``weight [2 * inter, k]`` (gate rows, then up rows) packed as :func:`pack` packs it
    after interleaving its rows 16 at a time (``gate[0:16], up[0:16], gate[16:32], ...``): panel ``p``
    holds gate and up columns ``16 p .. 16 p + 15``. ``inter`` must be a multiple of 16."""
    return pack(interleave_gate_up(weight, 16))


def glu_available(weight: torch.Tensor) -> bool:
    """Whether :class:`AMXGluWeights` can be made of the gate/up ``weight`` here: :func:`available`,
    and an intermediate size that is a multiple of 16."""
    return available(weight) and weight.shape[0] % 32 == 0


class AMXGluWeights(KernelWeights):
    """SwiGLU's gate/up product with its activation, ``silu(x @ gate.T) * (x @ up.T)`` as ``[rows,
    inter]`` bfloat16, for a fused gate/up weight ``[2 * inter, in]`` (gate rows first) without a bias:
    equal bit for bit to :class:`AMXWeights`' product followed by ``cpu_ops.silu_mul``. Requires
    :func:`glu_available` for the weight."""

    dtype = torch.bfloat16
    label = PROFILER_LABEL
    name = "AMX gate/up"

    def __init__(self, weight: torch.Tensor) -> None:
        if not glu_available(weight):
            raise ValueError(f"AMX gate/up weights need a 2-D bfloat16 CPU weight of 2 x a multiple of 16 rows and "
                             f"a multiple of {BLOCK} inputs, on a CPU with AMX-BF16, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")  # fmt: skip
        lib = _get()
        assert lib is not None  # glu_available() loaded it
        shape = torch.Size((weight.shape[0] // 2, weight.shape[1]))  # [inter, in]: what a call returns per row
        super().__init__(lib.pdserve_amx_glu, pack_glu(weight), shape, None)
