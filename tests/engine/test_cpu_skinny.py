"""The skinny float32 product kernel (engine/kernels/cpu_skinny.c) against a float64 torch reference,
what it refuses, and the linear layers' use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_skinny
from pdserve.engine.model import linear

pytestmark = pytest.mark.skipif(cpu_skinny.max_rows() == 0, reason="no C compiler here: the kernel is not built")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _close(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # float32 sums of k products of N(0,1) numbers: error grows like sqrt(k) * eps * |terms|.
    assert out.dtype == torch.float32 and out.is_contiguous()
    err = (out.double() - ref).abs().max().item()
    assert err <= 4e-6 * k**0.5 * 4, err


@pytest.mark.parametrize("rows", range(1, 17))
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 13), (33, 576), (961, 577), (96, 1536)])
def test_every_row_count_against_the_reference(rows: int, n: int, k: int) -> None:
    """Output widths that end mid-tile and below one tile, and inner sizes with a scalar tail."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    _close(cpu_skinny.linear(x, w), _reference(x, w, None), k)
    _close(cpu_skinny.linear(x, w, b), _reference(x, w, b), k)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_rows_without_gaps_or_overlap(threads: int) -> None:
    """Every output column is computed whatever the thread count and the split (ranges of 48 weight
    rows, tiles of 4-16): a column left unwritten keeps ``torch.empty``'s garbage and fails."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for rows in (4, 11):  # one group of input rows; two (a tile read twice)
            for n in (1, 15, 16, 17, 47, 48, 49, 1000):
                x, w = torch.randn(rows, 64, generator=gen), torch.randn(n, 64, generator=gen)
                _close(cpu_skinny.linear(x, w), _reference(x, w, None), 64)
    finally:
        torch.set_num_threads(before)


def test_a_strided_input_row_view() -> None:
    """Rows of a wider tensor (a slice of columns, as a fused projection's output is split)."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 300, generator=gen)
    x = wide[:, 100:260]
    assert not x.is_contiguous() and x.stride(1) == 1
    w = torch.randn(40, 160, generator=gen)
    _close(cpu_skinny.linear(x, w), _reference(x, w, None), 160)


def test_what_it_does_not_run() -> None:
    """Too many rows, other dtypes, a transposed weight, a column-strided input, a wrong bias: refused
    by ``supports`` and by ``linear`` with a message, never computed wrong."""
    w = torch.randn(16, 32)
    cases = [
        (torch.randn(cpu_skinny.max_rows() + 1, 32), w, None),
        (torch.randn(2, 32, dtype=torch.float64), w.double(), None),
        (torch.randn(2, 32).bfloat16(), w.bfloat16(), None),
        (torch.randn(2, 16), torch.randn(32, 16).t(), None),
        (torch.randn(32, 2).t(), w, None),
        (torch.randn(2, 32), w, torch.randn(15)),
        (torch.randn(2, 31), w, None),
        (torch.randn(0, 32), w, None),
    ]
    for x, weight, bias in cases:
        assert not cpu_skinny.supports(x, weight, bias)
        with pytest.raises(ValueError, match="skinny linear does not run"):
            cpu_skinny.linear(x, weight, bias)


def test_linear_layers_use_it_for_few_rows_and_agree_with_f_linear() -> None:
    """``Linear`` sends float32 inputs of 1-16 rows through the kernel (seen by the profiler) and larger
    ones elsewhere; every path agrees with ``F.linear``, with and without the oneDNN copy."""
    gen = torch.Generator().manual_seed(4)
    layer = linear.Linear(96, 200, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
        layer.bias.copy_(torch.randn(200, generator=gen))
    for packed in (False, True):
        if packed:
            layer.pack()
        for rows in (1, 4, 8, 9, 16, 17, 32):
            x = torch.randn(rows, 96, generator=gen)
            with torch.profiler.profile() as prof:
                out = layer(x)
            used = any(e.name == cpu_skinny.PROFILER_LABEL for e in prof.events())
            assert used == (rows <= linear.SKINNY_KERNEL_ROWS), (rows, packed)
            _close(out, _reference(x, layer.weight.detach(), layer.bias.detach()), 96)


def test_a_row_s_result_does_not_depend_on_its_batch_or_the_threads() -> None:
    """A decode's projections are bit-identical whichever other rows share its step (1-16) and however
    many threads run it: every output is one thread's sum over the same vectors in the same order."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(200, 584, generator=gen), torch.randn(16, 584, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_skinny.linear(x[:1], w)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in range(1, 17):
                assert torch.equal(cpu_skinny.linear(x[:rows], w)[:1], alone), (threads, rows)
    finally:
        torch.set_num_threads(before)
