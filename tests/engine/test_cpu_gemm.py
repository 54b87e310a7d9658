"""The panel float32 product kernel (engine/kernels/cpu_gemm.c) against a float64 torch reference,
what it refuses, and the linear layers' use of it."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_build, cpu_gemm, labels
from pdserve.engine.model import linear

pytestmark = pytest.mark.skipif(cpu_gemm.panel() == 0, reason="no C compiler here: the kernel is not built")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _close(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # float32 sums of k products of N(0,1) numbers: error grows like sqrt(k) * eps * |terms|.
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= 4e-6 * k**0.5 * 4, err


def test_the_panel_layout() -> None:
    """Panel p, position c holds the weights of output rows p * panel .. + panel at input c; rows past
    the weight's end are zeros."""
    p = cpu_gemm.panel()
    w = torch.randn(p + 5, 7)
    panels = cpu_gemm.pack(w)
    assert panels.shape == (2, 7, p) and panels.is_contiguous()
    assert torch.equal(panels[0], w[:p].t()) and torch.equal(panels[1, :, :5], w[p:].t())
    assert not panels[1, :, 5:].any()


@pytest.mark.parametrize("rows", [*range(1, 14), 47, 48, 49, 100])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 13), (65, 576), (961, 577), (96, 1536)])
def test_every_row_count_against_the_reference(rows: int, n: int, k: int) -> None:
    """Row counts across every group size (1-6) and past a work item's chunk (48 rows); output
    widths below one panel and ending mid-panel; any inner size."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    _close(cpu_gemm.PanelWeights(w, None)(x), _reference(x, w, None), k)
    _close(cpu_gemm.PanelWeights(w, b)(x), _reference(x, w, b), k)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_share_the_work_without_gaps_or_overlap(threads: int) -> None:
    """Every output is computed whatever the thread count and the items (a panel against up to 48
    rows): a column left unwritten keeps ``torch.empty``'s garbage and fails."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for rows in (4, 11, 97):
            for n in (1, 63, 64, 65, 127, 1000):
                x, w = torch.randn(rows, 64, generator=gen), torch.randn(n, 64, generator=gen)
                _close(cpu_gemm.PanelWeights(w, None)(x), _reference(x, w, None), 64)
    finally:
        torch.set_num_threads(before)


def test_strided_inputs() -> None:
    """Rows of a wider tensor (a slice of columns, as a fused projection's output is split) run in
    place; a column-strided input is copied first; an empty batch gives an empty result."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 160, generator=gen)
    packed = cpu_gemm.PanelWeights(w, None)
    wide = torch.randn(5, 300, generator=gen)
    x = wide[:, 100:260]
    assert not x.is_contiguous() and x.stride(1) == 1
    _close(packed(x), _reference(x, w, None), 160)
    x = torch.randn(5, 320, generator=gen)[:, ::2]
    _close(packed(x), _reference(x, w, None), 160)
    assert packed(torch.randn(0, 160)).shape == (0, 40)


def test_what_it_does_not_take() -> None:
    """Other dtypes, a weight that is not 2-D, a wrong bias, an input of the wrong width: a
    ValueError with a message, never a wrong result."""
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        cpu_gemm.PanelWeights(torch.randn(4, 8, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        cpu_gemm.PanelWeights(torch.randn(4, 8, 2), None)
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.PanelWeights(torch.randn(4, 8), torch.randn(5))
    assert not cpu_gemm.available(torch.randn(4, 8).bfloat16())
    packed = cpu_gemm.PanelWeights(torch.randn(4, 8), None)
    for x in (torch.randn(2, 9), torch.randn(2, 8, dtype=torch.float64), torch.randn(8)):
        with pytest.raises(ValueError, match="panel linear"):
            packed(x)


def test_packed_linear_layers_run_every_row_count_through_it() -> None:
    """After ``pack`` a float32 ``Linear`` sends every 2-D input through the kernel (seen by the
    profiler), and agrees with ``F.linear``; unpacked, it never does."""
    gen = torch.Generator().manual_seed(4)
    layer = linear.Linear(96, 200, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
        layer.bias.copy_(torch.randn(200, generator=gen))
    for packed in (False, True):
        if packed:
            layer.pack()
        for rows in (1, 4, 8, 17, 300):
            x = torch.randn(rows, 96, generator=gen)
            with labels.labelled(), torch.profiler.profile() as prof:
                out = layer(x)
            used = any(e.name == cpu_gemm.PROFILER_LABEL for e in prof.events())
            assert used == packed, (rows, packed)
            _close(out, _reference(x, layer.weight.detach(), layer.bias.detach()), 96)


def test_a_row_s_result_does_not_depend_on_its_batch_or_the_threads() -> None:
    """A decode's projections are bit-identical whichever other rows share its step and however many
    threads run it: every output is one thread's sum over the same products in the same order, in a
    pass per group (up to 12 rows) as in blocks of inputs (more rows, an inner size not a multiple of
    the block here)."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(200, 584, generator=gen), torch.randn(60, 584, generator=gen)
    packed = cpu_gemm.PanelWeights(w, None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = packed(x[:1])
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in (*range(1, 20), 48, 49, 60):
                assert torch.equal(packed(x[:rows])[:1], alone), (threads, rows)
    finally:
        torch.set_num_threads(before)


def _has_avx2() -> bool:
    try:
        return any(line.startswith("flags") and " avx2 " in f"{line} " for line in Path("/proc/cpuinfo").open())
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="the AVX2 build needs a CPU with AVX2 to run")
def test_the_avx2_build_agrees_too(tmp_path: Path) -> None:
    """Without AVX-512 the kernel builds with AVX2's panel of 32 rows and groups of 2 (its 16 vector
    registers): built here for x86-64-v3 and checked against float64 the same way."""
    cc = cpu_build._compiler()
    flags = [f for f in cpu_build.FLAGS if f != "-march=native"]
    lib_path = tmp_path / "cpu_gemm_avx2.so"
    subprocess.run([cc, *flags, "-march=x86-64-v3", "-Wno-psabi", str(cpu_gemm._SOURCE), "-o", str(lib_path)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    assert lib.pdserve_gemm_panel() == 32
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 2, 3, 4, 5, 17, 50):
        for n, k in ((7, 13), (65, 576), (100, 33)):
            x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            padded = -(-n // 32) * 32
            panels = torch.cat([w, w.new_zeros(padded - n, k)]).reshape(padded // 32, 32, k).transpose(1, 2).contiguous()
            out = torch.empty(rows, n)
            assert lib.pdserve_gemm_f32(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(k),
                                        ctypes.c_void_p(panels.data_ptr()), ctypes.c_void_p(b.data_ptr()),
                                        ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(n),
                                        ctypes.c_int64(k), ctypes.c_int(2)) == 0  # fmt: skip
            _close(out, _reference(x, w, b), k)
