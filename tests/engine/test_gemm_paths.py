"""Which product a float32 projection takes (engine/model/gemm_paths.py): the row classes, the timed
choice, and the layers and model that follow it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import cpu_gemm
from pdserve.engine.model import gemm_paths
from pdserve.engine.model.gemm_paths import CLASS_ROWS, ROW_CLASSES, RowPaths, faster_is_torch, measure, row_class
from pdserve.engine.model.linear import SKINNY_ROWS, Linear, project
from pdserve.engine.model.llama import MLP
from pdserve.engine.model.loader import load_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def test_row_classes_cover_every_row_count_once() -> None:
    assert [row_class(r) for r in (1, 2, 7, 8, 23, 24, 47, 48, 127, 128, 10**6)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [row_class(r) for r in CLASS_ROWS] == list(range(len(ROW_CLASSES)))


def test_row_paths() -> None:
    paths = RowPaths((True, False, False, False, True, True))
    assert [paths.use_torch(r) for r in (1, 4, 16, 32, 64, 500)] == [True, False, False, False, True, True]
    assert paths.describe() == "torch at 1, 48+ rows; packed at 2-47"
    assert RowPaths.every(False).describe() == "torch at none rows; packed at 1+"
    with pytest.raises(ValueError, match="classes"):
        RowPaths((True,))


def test_a_near_tie_keeps_the_packed_copy() -> None:
    assert faster_is_torch(1.0, 0.9)
    assert not faster_is_torch(1.0, 0.97)  # within the margin
    assert not faster_is_torch(1.0, 1.0)
    assert not faster_is_torch(1.0, 1.5)


def _slow(times: int):
    """A product that computes F.linear ``times`` times: as much slower, whatever the machine's load."""
    w = torch.randn(256, 128)

    def product(x: torch.Tensor) -> torch.Tensor:
        for _ in range(times - 1):
            F.linear(x, w)
        return F.linear(x, w)

    return product


def test_the_timed_choice_takes_the_faster_path() -> None:
    fast, slow = _slow(1), _slow(8)
    assert measure(slow, fast, 128) == RowPaths.every(True)
    assert measure(fast, slow, 128) == RowPaths.every(False)


def test_classes_past_max_rows_are_not_timed_and_take_the_last_choice() -> None:
    seen: list[int] = []
    fast, slow = _slow(1), _slow(8)

    def packed(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return fast(x) if x.shape[0] <= 16 else slow(x)

    assert measure(packed, _slow(3), 128, max_rows=16) == RowPaths.every(False)
    assert max(seen) == 16


@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_takes_the_path_its_choice_names(bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias).requires_grad_(False)
    layer.pack()
    copy = layer.packed_copy
    assert copy is not None
    for rows in (1, 4, 16, 64, 300):
        x = torch.randn(rows, 96)
        layer.paths = RowPaths.every(False)
        assert torch.equal(layer(x), copy(x))
        layer.paths = RowPaths.every(True)
        assert torch.equal(layer(x), project(x, layer.weight, layer.bias, None))
        if rows not in SKINNY_ROWS:
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.unpack()
    assert layer.paths is None


def test_the_model_times_each_shape_once(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, int | None]] = []
    real = gemm_paths.measure

    def counting(packed, unpacked, in_features, max_rows=None):
        timed.append((in_features, max_rows))
        return real(packed, unpacked, in_features, max_rows)

    monkeypatch.setattr(gemm_paths, "measure", counting)
    model = load_model(tiny_model, dtype=torch.float32)
    assert model.pack_onednn("auto")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = {(tuple(m.weight.shape), m.bias is not None) for m in linears}
    assert len(timed) == len(shapes) + 1  # each layer shape once, and the LM head
    # Where the panel kernel is built, each MLP's gate/up takes the fused copy (MLP.fuse_glu) and its paths.
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    fused = cpu_gemm.panel() > 0
    gate_ups = {id(m.gate_up_proj) for m in mlps} if fused else set()
    others = [m for m in linears if id(m) not in gate_ups]
    assert all(m.paths is not None for m in others) and model._head_paths is not None
    assert all((m._glu is not None and m._glu_paths is not None) == fused for m in mlps)
    assert model.pack_onednn("kernel")
    assert all(m.packed and m.paths is None for m in others) and model._head_paths is None
    assert all((m._glu is not None and m._glu_paths is None) == fused for m in mlps)
    assert not model.pack_onednn("torch")
    assert not any(m.packed for m in linears) and model._head_packed is None
    assert all(m._glu is None for m in mlps)
    with pytest.raises(ValueError, match="fp32_gemm"):
        model.pack_onednn("fastest")


def test_the_config_names_the_choices(monkeypatch: pytest.MonkeyPatch, tiny_model: str) -> None:
    with pytest.raises(ValueError, match="cpu_fp32_gemm must be one of auto, kernel, torch"):
        EngineConfig(tiny_model, cpu_fp32_gemm="fastest")
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "torch")
    assert EngineConfig(tiny_model).cpu_fp32_gemm == "torch"
    monkeypatch.delenv("PDSERVE_CPU_FP32_GEMM")
    assert EngineConfig(tiny_model).cpu_fp32_gemm == "auto"
