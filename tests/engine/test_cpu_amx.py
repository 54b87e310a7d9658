"""bfloat16 products on AMX tiles (engine/kernels/cpu_amx.c) against a float64 reference: the packed
layout, row counts around the tile and chunk edges, widths inside and past a panel, bias, strides,
threads, a row's result independent of its batch, and the Linear layer using it."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from pdserve.engine.kernels import cpu_amx, cpu_build
from pdserve.engine.model.linear import Linear, OneDNNWeights

needs_amx = pytest.mark.skipif(not cpu_amx.available(torch.zeros(32, 32, dtype=torch.bfloat16)),
                               reason="no AMX-BF16 here (or no C compiler): the kernel does not run")  # fmt: skip


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """One bfloat16 rounding of a float32 sum: half a unit in the last place, and float32's rounding
    of the sum against the largest term."""
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0**-8 + ref.abs().max() * 1e-5 + 1e-6
    assert (err <= bound).all(), float((err - bound).max())


@needs_amx
def test_the_packed_layout() -> None:
    w = torch.randn(40, 64).bfloat16()
    tiles = cpu_amx.pack(w)
    assert tiles.shape == (2, 2, 2, 16, 16, 2)
    for p, b, t, i, c, e in ((0, 0, 0, 0, 0, 0), (1, 1, 0, 3, 7, 1), (0, 1, 1, 15, 15, 1), (1, 0, 0, 2, 5, 0)):
        assert tiles[p, b, t, i, c, e] == w[p * 32 + t * 16 + c, b * 32 + 2 * i + e]
    assert (tiles[1, :, 0, :, 8:] == 0).all() and (tiles[1, :, 1] == 0).all()  # columns 40..63 are padding


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 40, 48, 56, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(7, 32), (32, 64), (33, 576), (100, 96), (960, 576)])
def test_products_match_the_reference(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    _close(cpu_amx.AMXWeights(w, None)(x), _reference(x, w, None))
    _close(cpu_amx.AMXWeights(w, b)(x), _reference(x, w, b))


@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strides_threads_and_a_row_alone_or_in_any_batch(threads: int) -> None:
    """A row's sums run in one order whatever chunk or tile holds it: bit for bit its own result in
    any batch, on any thread count; a row stride is read in place, a column stride copied."""
    gen = torch.Generator().manual_seed(threads)
    w = torch.randn(70, 160, generator=gen).bfloat16()
    packed = cpu_amx.AMXWeights(w, torch.randn(70, generator=gen))
    wide = torch.randn(45, 200, generator=gen).bfloat16()
    x = wide[:, 17:177]  # a row stride of 200
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = packed(x)
        _close(full, _reference(x, w, packed.bias))
        assert torch.equal(packed(x.t().contiguous().t()), full)
        for lo, hi in ((0, 1), (3, 4), (16, 17), (10, 45), (31, 33)):
            assert torch.equal(packed(x[lo:hi]), full[lo:hi])
        assert packed(x[:0]).shape == (0, 70)
    finally:
        torch.set_num_threads(saved)


@needs_amx
def test_refusals_and_the_linear_layer() -> None:
    assert not cpu_amx.available(torch.zeros(8, 72, dtype=torch.bfloat16))  # inputs not whole tile rows
    assert not cpu_amx.available(torch.zeros(8, 64))  # float32: the panel kernel's
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_amx.AMXWeights(torch.zeros(8, 72, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="bias"):
        cpu_amx.AMXWeights(torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(9))
    packed = cpu_amx.AMXWeights(torch.zeros(8, 64, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="bfloat16 CPU"):
        packed(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="bfloat16 CPU"):
        packed(torch.zeros(2, 63, dtype=torch.bfloat16))
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    layer.pack()
    assert isinstance(layer._packed, cpu_amx.AMXWeights)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    _close(layer(x), _reference(x, layer.weight, layer.bias))
    odd = Linear(72, 48, bias=False).to(torch.bfloat16)
    odd.pack()
    assert isinstance(odd._packed, OneDNNWeights)  # 72 inputs: oneDNN's copy


@pytest.mark.skipif(cpu_build._compiler() is None, reason="no C compiler")
def test_a_build_without_amx_refuses(tmp_path: Path) -> None:
    """Built for a CPU without AMX (x86-64-v3), the library says so: no tile state asked for, no
    product run, and callers keep oneDNN's copy."""
    lib_path = tmp_path / "cpu_amx_v3.so"
    flags = [f for f in cpu_build.FLAGS if f != "-march=native"]
    subprocess.run([cpu_build._compiler(), *flags, "-march=x86-64-v3", str(cpu_amx._SOURCE), "-o", str(lib_path)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    assert lib.pdserve_amx_init() == -1
    assert lib.pdserve_amx_linear(None, ctypes.c_int64(0), None, None, None, ctypes.c_int64(1), ctypes.c_int64(1),
                                  ctypes.c_int64(32), 1) == -1  # fmt: skip
