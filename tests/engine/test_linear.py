"""The packed projection paths (engine/model/linear.py: panels for the C kernel, oneDNN) against plain
``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_gemm
from pdserve.engine.model.linear import (
    ONEDNN_MIN_BUCKET,
    ONEDNN_MIN_ROWS,
    SKINNY_ROWS,
    Linear,
    bucket_rows,
    onednn_supported,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def make_linear(in_features: int, out_features: int, bias: bool, seed: int) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    layer.requires_grad_(False)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 33, 300])
def test_packed_matches_f_linear(rows: int, bias: bool) -> None:
    layer = make_linear(96, 160, bias, seed=rows)
    x = torch.randn(rows, 96)
    ref = F.linear(x, layer.weight, layer.bias)
    layer.pack()
    assert layer.packed
    out = layer(x)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_a_few_float32_rows_run_as_the_transposed_product(bias: bool) -> None:
    """Without a packed copy, 2..7 rows (here column-strided, as a slice of a wider activation with a
    step is) run as ``(weight @ x.T).T`` (the BLAS's fast kernel for a skinny right-hand side), equal
    to F.linear to float32 rounding, contiguous; one row stays F.linear."""
    layer = make_linear(96, 160, bias, seed=7)
    for rows in [1, *SKINNY_ROWS]:
        x = torch.randn(rows, 2 * 96)[:, ::2]  # strided, as a slice of a wider activation is
        out = layer(x)
        assert out.shape == (rows, 160) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        if rows in SKINNY_ROWS:
            t = torch.mm(layer.weight, x.t()) if not bias else torch.addmm(layer.bias[:, None], layer.weight, x.t())
            assert torch.equal(out, t.t())  # this path, not F.linear's
        else:
            assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


def test_dispatch_by_rows() -> None:
    """After ``pack`` float32 inputs read the packed copy: every row count where the panel kernel is
    built, else those of ONEDNN_MIN_ROWS+ rows (oneDNN's copy; smaller ones read the live weight)."""
    layer = make_linear(64, 32, True, seed=0)
    layer.pack()
    small, large = torch.randn(ONEDNN_MIN_ROWS - 1, 64), torch.randn(ONEDNN_MIN_ROWS, 64)
    before_small, before_large = layer(small), layer(large)
    layer.weight.mul_(2)  # the packed copy does not see in-place changes until pack()
    if cpu_gemm.panel():
        torch.testing.assert_close(layer(small), before_small)
    else:
        assert not torch.allclose(layer(small), before_small)
    torch.testing.assert_close(layer(large), before_large)
    layer.pack()
    torch.testing.assert_close(layer(large), F.linear(large, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.unpack()
    assert not layer.packed


def test_non_contiguous_input() -> None:
    layer = make_linear(64, 48, False, seed=1)
    layer.pack()
    x = torch.randn(64, 40).t()  # [40, 64], transposed strides
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_unsupported_dtype_refused() -> None:
    assert not onednn_supported(torch.float16, torch.device("cpu"))
    assert not onednn_supported(torch.float32, torch.device("cuda"))
    assert not onednn_supported(torch.bfloat16, torch.device("cuda"))
    layer = make_linear(16, 16, False, seed=2).to(torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU"):
        layer.pack()


needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="oneDNN has no bfloat16 kernels for this CPU")  # fmt: skip


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, ONEDNN_MIN_BUCKET, ONEDNN_MIN_BUCKET + 1, 300])
def test_packed_bf16_matches_f_linear(rows: int, bias: bool) -> None:
    """bfloat16 goes through the prepacked weight at every row count (padded rows included) and
    gives F.linear's bfloat16 result to within one bfloat16 rounding."""
    layer = make_linear(96, 160, bias, seed=rows).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    ref = F.linear(x, layer.weight, layer.bias)
    assert onednn_supported(torch.bfloat16, torch.device("cpu"))
    layer.pack()
    layer.weight.mul_(2)  # the packed copy does not see in-place changes: proof the copy served
    out = layer(x)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out, ref)  # bfloat16's default tolerance: rtol 1.6e-2
    layer.pack()
    torch.testing.assert_close(layer(x.t().contiguous().t()), F.linear(x, layer.weight, layer.bias))


def test_row_buckets_bound_the_shapes_onednn_compiles_for() -> None:
    """oneDNN caches a kernel per input shape: past ONEDNN_MIN_BUCKET rows inputs run padded to a
    bucket, at most 1/8 larger, so a worker's prefills (any length up to a 2,048-token step) make
    about a hundred shapes, not two thousand."""
    for rows in range(1, 8193):
        b = bucket_rows(rows)
        assert b == rows if rows <= ONEDNN_MIN_BUCKET else rows <= b <= rows * 9 / 8, (rows, b)
    assert len({bucket_rows(r) for r in range(1, 2049)}) <= ONEDNN_MIN_BUCKET + 48
