"""float32 matrix products on the CPU through weights packed in panels (``cpu_gemm.c``).

A decode step of a few sequences projects a few rows through every weight of the model, so it is
bound by how fast the weights stream from memory; a prefill's products are bound by the FMA units.
torch's BLAS and oneDNN reach a fraction of either on a weight in its plain ``[out, in]`` layout at
these shapes (measured in ``pdserve bench projections``). :class:`PanelWeights` keeps a copy of a
weight reordered once into panels of ``panel()`` output rows, transposed, so that the kernel reads
it from memory once, as one sequential stream, keeping its sums in registers (and, past two groups of
rows, in a buffer in L1 between blocks of inputs), for any number of input rows, on torch's intra-op
threads.

:func:`available` says whether the library is built here (float32 CPU weights only); where it is
not, callers keep torch's products.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_build
from pdserve.engine.kernels.kernel_weights import KernelWeights, interleave_gate_up, pad_rows

_SOURCE = Path(__file__).with_name("cpu_gemm.c")
PROFILER_LABEL = "pdserve::cpu_gemm_linear"  # what torch.profiler calls a kernel call
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn, self.glu = lib.pdserve_gemm_f32, lib.pdserve_gemm_glu_f32
        for fn in (self.fn, self.glu):
            fn.argtypes, fn.restype = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int], ctypes.c_int
        self.panel = int(lib.pdserve_gemm_panel())


@functools.cache
def _get() -> _Kernel | None:
    """The library's entry points, built and loaded on the first call (None where it is not built)."""
    lib = cpu_build.load(_SOURCE)
    return None if lib is None else _Kernel(lib)


def panel() -> int:
    """Output rows per panel; 0 where the library is not built (it builds on the first call)."""
    kernel = _get()
    return 0 if kernel is None else kernel.panel


def available(weight: torch.Tensor) -> bool:
    """Whether :class:`PanelWeights` can be made of ``weight`` here: a 2-D float32 CPU tensor, and
    the library built (the first call builds it, only for weights it could take)."""
    return weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32 and panel() > 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[n, k]`` as ``[ceil(n / panel), k, panel]`` panels (rows past ``n`` are zeros)."""
    p = panel()
    w = pad_rows(weight, p)
    return w.reshape(w.shape[0] // p, p, w.shape[1]).transpose(1, 2).contiguous()


class PanelWeights(KernelWeights):
    """A panel copy of one float32 linear map (weight ``[out, in]``, optional bias) for the kernel
    (:class:`KernelWeights` runs it). Requires :func:`available` for the weight."""

    dtype = torch.float32
    label = PROFILER_LABEL
    name = "panel linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if not available(weight):
            raise ValueError(f"panel weights need a 2-D float32 CPU weight and the built kernel, got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")  # fmt: skip
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != weight.shape[:1]):
            raise ValueError(f"bias: expected float32 of shape {tuple(weight.shape[:1])}, got "
                             f"{tuple(bias.shape)} {bias.dtype}")  # fmt: skip
        kernel = _get()
        assert kernel is not None  # available() built the library
        super().__init__(kernel.fn, pack(weight), weight.shape, None if bias is None else bias.detach().contiguous())


def glu_available(weight: torch.Tensor) -> bool:
    """Whether :class:`PanelGluWeights` can be made of the gate/up ``weight`` here: :func:`available`,
    and an intermediate size that is a multiple of half a panel."""
    return available(weight) and weight.shape[0] % (2 * (panel() // 2)) == 0


def pack_glu(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up ``weight [2 * inter, k]`` (gate rows, then up rows) packed as :func:`pack` packs it
    after interleaving its rows half a panel at a time: panel ``p`` holds gate rows ``[p * h, p * h + h)``
    and then the same up rows (``h = panel() // 2``). Requires :func:`glu_available`."""
    return pack(interleave_gate_up(weight, panel() // 2))


class PanelGluWeights(KernelWeights):
    """SwiGLU's gate/up product with its activation, ``silu(x @ gate.T) * (x @ up.T)`` as ``[rows,
    inter]`` float32, for a fused gate/up weight ``[2 * inter, in]`` (gate rows first) without a bias:
    equal bit for bit to :class:`PanelWeights`' product followed by ``cpu_ops.silu_mul``. Requires
    :func:`glu_available` for the weight."""

    dtype = torch.float32
    label = PROFILER_LABEL
    name = "panel gate/up"

    def __init__(self, weight: torch.Tensor) -> None:
        if not glu_available(weight):
            raise ValueError(f"panel gate/up weights need a 2-D float32 CPU weight of 2 x a multiple of "
                             f"{panel() // 2 or 'half a panel'} rows and the built kernel, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")  # fmt: skip
        kernel = _get()
        assert kernel is not None  # glu_available() built the library
        super().__init__(kernel.glu, pack_glu(weight), torch.Size((weight.shape[0] // 2, weight.shape[1])), None)
