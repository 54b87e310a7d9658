"""SwiGLU's gate/up product and activation in one pass of a C kernel: bfloat16 on AMX tiles
(``cpu_amx.AMXGluWeights``, ``pdserve_amx_glu``) and float32 through panels
(``cpu_gemm.PanelGluWeights``, ``pdserve_gemm_glu_f32``). For each: its packed layout, bit for bit the
unfused path (the kernel's product, then ``cpu_ops.silu_mul``) at row counts around the tile, group and
chunk edges, on any thread count, at a row stride and through silu's saturation; within the dtype's
rounding of a float64 reference; its refusals; and the model taking it for every MLP (and dropping it
when the weights are reloaded). The engine's parity tests (transformers, bfloat16 and float32) run
their tiny models through it too."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pdserve.engine.kernels import cpu_amx, cpu_build, cpu_gemm, cpu_ops
from pdserve.engine.model import load_model, make_tiny_model
from pdserve.engine.model.llama import MLP

AMX = pytest.param("amx", marks=pytest.mark.skipif(
    not cpu_amx.available(torch.zeros(32, 32, dtype=torch.bfloat16)),
    reason="no AMX-BF16 here (or no C compiler): the kernel does not run"))  # fmt: skip
PANEL = pytest.param("panel", marks=pytest.mark.skipif(
    not cpu_gemm.available(torch.zeros(1, 1)), reason="the panel kernel is not built here"))  # fmt: skip
KINDS = [AMX, PANEL]
# kind -> (dtype, the fused copy, the product's copy, the packing, the bit type)
KERNELS = {
    "amx": (torch.bfloat16, lambda w: cpu_amx.AMXGluWeights(w), lambda w: cpu_amx.AMXWeights(w, None),
            cpu_amx.pack_glu, torch.int16),
    "panel": (torch.float32, lambda w: cpu_gemm.PanelGluWeights(w), lambda w: cpu_gemm.PanelWeights(w, None),
              cpu_gemm.pack_glu, torch.int32),
}  # fmt: skip


def _unfused(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The path the fused copy replaces: the kernel's product, then silu_mul."""
    return cpu_ops.silu_mul(KERNELS[kind][2](w)(x), w.shape[0] // 2)


def _same_bits(kind: str, a: torch.Tensor, b: torch.Tensor) -> None:
    bits = KERNELS[kind][4]
    assert a.shape == b.shape and a.dtype == b.dtype == KERNELS[kind][0]
    assert torch.equal(a.view(bits), b.view(bits)), int((a.view(bits) != b.view(bits)).sum())


@pytest.mark.parametrize("kind", KINDS)
def test_the_packed_layout(kind: str) -> None:
    """Gate and up rows interleave half a panel at a time: the same packing as the plain kernel's of the
    rows gate[0:h], up[0:h], gate[h:2h], up[h:2h], ... (h: 16 for AMX's tiles, half of the float32 panel)."""
    dtype, _, _, pack_glu, _ = KERNELS[kind]
    half = 16 if kind == "amx" else cpu_gemm.panel() // 2
    inter, k = 3 * half, 64
    w = torch.arange(2 * inter * k, dtype=torch.float32).view(2 * inter, k).to(dtype)
    order = torch.cat([torch.arange(b * half, b * half + half) + part * inter for b in range(3) for part in (0, 1)])
    plain = cpu_amx.pack if kind == "amx" else cpu_gemm.pack
    assert torch.equal(pack_glu(w), plain(w[order]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 13, 16, 17, 32, 33, 49, 70])
@pytest.mark.parametrize(("inter", "k"), [(32, 32), (96, 96), (1536, 576)])
def test_bit_for_bit_the_unfused_path_and_close_to_float64(kind: str, rows: int, inter: int, k: int) -> None:
    dtype = KERNELS[kind][0]
    gen = torch.Generator().manual_seed(rows * 100 + inter + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.2).to(dtype)
    out = KERNELS[kind][1](w)(x)
    _same_bits(kind, out, _unfused(kind, x, w))
    gate_up = x.double() @ w.double().t()
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    err = (out.double() - ref).abs()
    # bfloat16: three roundings (the product's two halves, silu, the result); float32: its sums' order.
    rel = 2.0**-6 if dtype == torch.bfloat16 else 1e-5
    assert (err <= ref.abs() * rel + ref.abs().max() * rel / 8 + 1e-6).all(), float(err.max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_a_row_stride_and_silus_saturation(kind: str, threads: int) -> None:
    """Sums large either way (silu's exponential past float32's range: silu(-x) = -0, silu(x) = x),
    zero rows, a row stride read in place: the same bits as the unfused path, on any thread count, a
    row's result alone or in a batch."""
    dtype = KERNELS[kind][0]
    gen = torch.Generator().manual_seed(threads)
    inter, k = 64, 128
    w = torch.randn(2 * inter, k, generator=gen).to(dtype)
    wide = torch.randn(40, k + 30, generator=gen) * 4
    wide[3] = 0
    wide[9, 20:] = 300  # sums in the thousands: silu saturates
    x = wide.to(dtype)[:, 11 : 11 + k]
    fused = KERNELS[kind][1](w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = fused(x)
        _same_bits(kind, full, _unfused(kind, x.contiguous(), w))
        for lo, hi in ((0, 1), (9, 10), (16, 17), (31, 33), (0, 40)):
            _same_bits(kind, fused(x[lo:hi]), full[lo:hi])
        assert fused(x[:0]).shape == (0, inter)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kind", KINDS)
def test_refusals(kind: str) -> None:
    dtype, make, _, _, _ = KERNELS[kind]
    available = cpu_amx.glu_available if kind == "amx" else cpu_gemm.glu_available
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert available(torch.zeros(64, 64, dtype=dtype))
    assert not available(torch.zeros(48, 64, dtype=dtype))  # an intermediate size of 24
    assert not available(torch.zeros(64, 64, dtype=other))
    with pytest.raises(ValueError, match="multiple of"):
        make(torch.zeros(48, 64, dtype=dtype))
    fused = make(torch.zeros(64, 64, dtype=dtype))
    with pytest.raises(ValueError, match="CPU"):
        fused(torch.zeros(2, 64, dtype=other))
    with pytest.raises(ValueError, match="CPU"):
        fused(torch.zeros(2, 63, dtype=dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_fuses_every_mlp_and_drops_it_on_reload(kind: str, tmp_path: Path) -> None:
    dtype = KERNELS[kind][0]
    checkpoint = make_tiny_model(tmp_path / "tiny", seed=3)  # hidden 64, intermediate 128
    model = load_model(checkpoint, dtype=dtype)
    assert model.pack_onednn("kernel")
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps and all(m._glu is not None and not m.gate_up_proj.packed for m in mlps)
    x = torch.randn(9, 64).to(dtype)
    mlp = mlps[0]
    w = mlp.gate_up_proj.weight
    _same_bits(kind, mlp(x), mlp.down_proj(_unfused(kind, x, w)))
    model.load_weights(load_file(checkpoint / "model.safetensors").items())
    assert all(m._glu is None for m in mlps)
    _same_bits(kind, mlp(x), mlp.down_proj(cpu_ops.silu_mul(F.linear(x, w), w.shape[0] // 2)))


@pytest.mark.skipif(cpu_build._compiler() is None, reason="no C compiler")
def test_a_build_without_amx_refuses(tmp_path: Path) -> None:
    lib_path = tmp_path / "cpu_amx_v3.so"
    flags = [f for f in cpu_build.FLAGS if f != "-march=native"]
    subprocess.run([cpu_build._compiler(), *flags, "-march=x86-64-v3", str(cpu_amx._SOURCE), "-o", str(lib_path)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    assert lib.pdserve_amx_glu(None, ctypes.c_int64(0), None, None, None, ctypes.c_int64(1), ctypes.c_int64(16),
                               ctypes.c_int64(32), 1) == -1  # fmt: skip


@pytest.mark.skipif(cpu_build._compiler() is None or "avx2" not in Path("/proc/cpuinfo").read_text(),
                    reason="no C compiler, or a CPU without AVX2 to run the AVX2 build")  # fmt: skip
def test_the_avx2_panel_build_fuses_alike(tmp_path: Path) -> None:
    """Built for x86-64-v3 (AVX2: panels of 32, so 16 gate rows beside 16 up rows), the fused kernel's
    result is its own product then silu_mul, bit for bit."""
    lib_path = tmp_path / "cpu_gemm_avx2.so"
    flags = [f for f in cpu_build.FLAGS if f != "-march=native"]
    subprocess.run([cpu_build._compiler(), *flags, "-march=x86-64-v3", "-Wno-psabi", str(cpu_gemm._SOURCE), "-o",
                    str(lib_path)], check=True, capture_output=True, timeout=300)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    assert lib.pdserve_gemm_panel() == 32
    gen = torch.Generator().manual_seed(5)
    inter, k = 48, 96
    w = torch.randn(2 * inter, k, generator=gen)
    order = torch.cat([torch.arange(b * 16, b * 16 + 16) + part * inter for b in range(3) for part in (0, 1)])

    def run(fn: str, panels: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], n)
        assert getattr(lib, fn)(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(k), ctypes.c_void_p(panels.data_ptr()),
                                None, ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(n),
                                ctypes.c_int64(k), ctypes.c_int(2)) == 0  # fmt: skip
        return out

    def panels_of(m: torch.Tensor) -> torch.Tensor:
        return m.reshape(m.shape[0] // 32, 32, k).transpose(1, 2).contiguous()

    for rows in (1, 3, 5, 17, 50):
        x = torch.randn(rows, k, generator=gen)
        fused = run("pdserve_gemm_glu_f32", panels_of(w[order]), x, inter)
        product = run("pdserve_gemm_f32", panels_of(w), x, 2 * inter)
        assert torch.equal(fused.view(torch.int32), cpu_ops.silu_mul(product, inter).view(torch.int32))
