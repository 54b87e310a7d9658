"""The CPU's fused elementwise ops (engine/kernels/cpu_ops.c) against the torch expressions they
replace in engine/model/llama.py and engine/model/rope.py: the rotation and the residual add bit for
bit, silu bit for bit in bfloat16; within float32 rounding the norm (its sum of squares in another
order) and float32 silu (its exponential)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_build, cpu_ops
from pdserve.engine.kernels.reference import write_kv_ref
from pdserve.engine.model.llama import RMSNorm, rotate_qk
from pdserve.engine.model.rope import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_ops.supports(torch.zeros(1)), reason="no C compiler here: not built")

# rows x columns: one row, a row shorter than a vector, tails past whole vectors, rows enough to split
SHAPES = [(1, 576), (3, 5), (7, 37), (32, 576), (40, 2048)]


def _norm_ref(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(s.float(), (s.shape[1],), eps=eps).to(s.dtype)


def _assert_norm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: within its rounding (the sum of squares in another order). bfloat16: the same values
    but where that last float32 bit moved a rounding (at most 1 in 1,000 elements, by one bfloat16
    step before the weight's product)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
        return
    assert (out != ref).float().mean() <= 1e-3
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(shape: tuple[int, int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 131 + shape[1])
    h, delta = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(shape[1], generator=gen) + 0.5).to(dtype)
    big = torch.randn(shape[0], shape[1] + 9, generator=gen).to(dtype)[:, 3 : 3 + shape[1]]  # a row stride
    for x, d in ((h, delta), (big, delta), (h, big)):
        s, out = cpu_ops.add_rms_norm(x, d, w, 1e-5)
        assert torch.equal(s, x + d)
        _assert_norm_close(out, _norm_ref(x + d, w, 1e-5))
    same, normed = cpu_ops.add_rms_norm(h, None, w, 1e-6)
    assert same is h
    _assert_norm_close(normed, _norm_ref(h, w, 1e-6))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(shape: tuple[int, int], dtype: torch.dtype) -> None:
    rows, inter = shape
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)  # exp's argument up to about +-30
    gate_up[0, 0], gate_up[-1, inter - 1] = 95.0, -95.0  # past float32's exp range
    out = cpu_ops.silu_mul(gate_up, inter)
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize(("rows", "heads", "head_dim", "width"), [(1, 12, 64, 960), (5, 3, 80, 300), (33, 2, 16, 40),
                                                                   (4, 4, 256, 1100)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_is_apply_rotary_exactly(rows: int, heads: int, head_dim: int, width: int,
                                                 dtype: torch.dtype) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(rows * heads)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    angle = torch.rand(rows, 1, head_dim // 2, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    ref = apply_rotary(x[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    y = x.clone()
    cpu_ops.rotary_(y, heads, head_dim, cos, sin)
    assert torch.equal(y[:, : heads * head_dim].view(rows, heads, head_dim), ref)
    assert torch.equal(y[:, heads * head_dim :], x[:, heads * head_dim :])  # v's columns untouched
    assert torch.equal(rotate_qk(x.clone(), heads, head_dim, cos, sin), ref)


def test_bfloat16_nan_and_rounding_ties() -> None:
    """A NaN stays NaN through the norm's add; a product exactly halfway between two bfloat16 values
    rounds to the even one, as torch rounds."""
    h = torch.tensor([[1.0, float("nan"), 2.0, 3.0]], dtype=torch.bfloat16)
    s, out = cpu_ops.add_rms_norm(h, torch.ones_like(h), torch.ones(4, dtype=torch.bfloat16), 1e-6)
    assert s[0, 1].isnan() and out.isnan().all()  # the NaN poisons the row's mean, as in torch
    # 1 + 2^-8 is halfway between bfloat16's 1 and 1 + 2^-7: the rotation's products round it to 1.
    x = torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16)
    cos = torch.tensor([[[1.00390625]]], dtype=torch.float32).to(torch.bfloat16)  # rounds to 1.0 already
    y = x.clone()
    cpu_ops.rotary_(y, 1, 2, cos, torch.zeros_like(cos))
    assert torch.equal(y.view(1, 1, 2), apply_rotary(x.view(1, 1, 2), cos, torch.zeros_like(cos)))


def test_bfloat16_denormals_round_as_torch() -> None:
    """Results below float32's normal range round to bfloat16 as torch rounds them, not to zero (the
    CPU's conversion instruction reads a denormal as zero; vectors holding one take the exact form)."""
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 64, generator=gen) * 1e-39).to(torch.bfloat16)  # denormals, and a few normals
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0, float("nan")])
    cos = torch.full((3, 1, 16), 0.75).to(torch.bfloat16)
    sin = torch.full((3, 1, 16), -0.3).to(torch.bfloat16)
    y = x.clone()
    cpu_ops.rotary_(y, 2, 32, cos, sin)
    ref = apply_rotary(x.view(3, 2, 32), cos, sin)
    assert (ref != 0).sum() > 100
    torch.testing.assert_close(y.view(3, 2, 32), ref, rtol=0, atol=0, equal_nan=True)  # bit for bit
    h = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = torch.full((64,), 1e-39).to(torch.bfloat16)  # the norm's products land below the normal range
    _, out = cpu_ops.add_rms_norm(h, None, w, 1e-6)
    assert (out != 0).sum() > 150 and torch.equal(out, _norm_ref(h, w, 1e-6))


def test_rmsnorm_module_uses_it_and_keeps_the_torch_path() -> None:
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x, d = torch.randn(6, 64), torch.randn(6, 64)
    with torch.inference_mode():
        s, out = norm.add_forward(x, d)
        torch.testing.assert_close(out, _norm_ref(x + d, norm.weight, 1e-5), rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(norm(x.view(2, 3, 64)), _norm_ref(x, norm.weight, 1e-5).view(2, 3, 64))
    x.requires_grad_(True)  # an autograd graph is asked for: torch's expression
    assert norm(x).grad_fn is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_the_reference_write(dtype: torch.dtype) -> None:
    """Rows land in their slots of a layer's strided view of a multi-layer cache, and of a head
    slice of it (a tensor-parallel rank's); -1 slots are skipped; nothing else changes."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(12, 3, 2, 8, 4, 16, generator=gen).to(dtype)  # [blocks, layers, K/V, block, heads, dim]
    slots = torch.tensor([5, -1, 17, 95, 40, -1, 0], dtype=torch.int64)
    for heads in (slice(None), slice(1, 3)):
        k_cache, v_cache = cache[:, 1, 0, :, heads], cache[:, 1, 1, :, heads]
        n_heads = k_cache.shape[2]
        qkv = torch.randn(7, 4 + 2 * n_heads, 16, generator=gen).to(dtype)  # keys and values as views of one row
        key, value = qkv[:, 4 : 4 + n_heads], qkv[:, 4 + n_heads :]
        assert cpu_ops.writes_kv(key, value, k_cache, v_cache)
        want = cache.clone()
        write_kv_ref(key, value, want[:, 1, 0, :, heads], want[:, 1, 1, :, heads], slots)
        cpu_ops.write_kv(key, value, k_cache, v_cache, slots)
        assert torch.equal(cache, want)
    assert not cpu_ops.writes_kv(torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), torch.zeros(3, 8, 4, 16, dtype=torch.bfloat16),
                                 torch.zeros(3, 8, 4, 16, dtype=torch.bfloat16))  # fmt: skip
    assert not cpu_ops.writes_kv(torch.zeros(2, 16, 4).transpose(1, 2), torch.zeros(2, 4, 16), torch.zeros(3, 8, 4, 16),
                                 torch.zeros(3, 8, 4, 16))  # heads not adjacent  # fmt: skip


@pytest.mark.parametrize("cols", [1, 5, 16, 37, 49152, 49157])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_max_indices(cols: int, dtype: torch.dtype) -> None:
    """Random rows, rows of ties (few distinct values), NaNs, a row all -inf, the maximum in a row's
    tail past its whole vectors, and rows a stride apart: the index torch's max gives, every row."""
    gen = torch.Generator().manual_seed(cols)
    for trial in range(12):
        x = torch.randn(16, cols + 3, generator=gen).to(dtype)[:, :cols]
        x[1::3] = torch.randint(0, 3, (len(range(1, 16, 3)), cols), generator=gen).to(dtype)
        x[2, torch.randint(0, cols, (2,), generator=gen)] = float("nan")
        x[4] = float("-inf")
        x[5, -1] = 100.0
        x[6, trial % cols] = float("inf")
        assert x.stride(0) == cols + 3
        assert torch.equal(cpu_ops.argmax_rows(x), x.max(dim=-1).indices)
        assert torch.equal(cpu_ops.argmax_rows(x), x.float().max(dim=-1).indices)


def test_refusals() -> None:
    assert not cpu_ops.supports(torch.zeros(2, 4, dtype=torch.float16))
    assert not cpu_ops.supports(torch.zeros(4, 2).t())  # rows not contiguous
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="columns"):
        cpu_ops.silu_mul(torch.zeros(2, 9), 4)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_ops.rotary_(torch.zeros(2, 60), 2, 32, torch.zeros(2, 16), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="cos"):
        cpu_ops.rotary_(torch.zeros(2, 64), 2, 32, torch.zeros(2, 15), torch.zeros(2, 16))
    # Operands that would make the kernel read or write past a tensor are refused before it runs.
    with pytest.raises(ValueError, match="delta must have h's shape"):
        cpu_ops.add_rms_norm(torch.zeros(4, 8), torch.zeros(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="rows are contiguous"):
        cpu_ops.argmax_rows(torch.zeros(4, 2).t())
    key = torch.zeros(3, 4, 16)
    assert cpu_ops.writes_kv(key, key, torch.zeros(2, 8, 4, 16), torch.zeros(2, 8, 4, 16))
    assert not cpu_ops.writes_kv(key, key, torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16))  # 4 heads into 2
    assert not cpu_ops.writes_kv(key, torch.zeros(3, 2, 16), torch.zeros(2, 8, 4, 16), torch.zeros(2, 8, 4, 16))


def _has_avx2() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx2 " in cpuinfo.read_text() and cpu_build._compiler() is not None


@pytest.mark.skipif(not _has_avx2(), reason="the AVX2 build needs a CPU with AVX2 to run")
def test_the_avx2_build_agrees_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built for x86-64-v3 (vectors of 8), the ops give the same results."""
    flags = [f for f in cpu_build.FLAGS if f != "-march=native"]
    lib_path = tmp_path / "cpu_ops_avx2.so"
    subprocess.run([cpu_build._compiler(), *flags, "-march=x86-64-v3", "-Wno-psabi", str(cpu_ops._SOURCE), "-o",
                    str(lib_path)], check=True, capture_output=True, timeout=300)  # fmt: skip
    monkeypatch.setattr(cpu_ops, "_get", lambda: cpu_ops._Kernel(ctypes.CDLL(str(lib_path))))
    test_add_rms_norm((7, 37), torch.bfloat16)
    test_silu_mul((3, 21), torch.bfloat16)
    test_rotary_in_place_is_apply_rotary_exactly(5, 3, 80, 300, torch.float32)
    test_argmax_rows_is_torch_max_indices(37, torch.bfloat16)
