"""FP8 KV cache in the kernels: quantize on write, dequantize on read, every backend against the
plain-torch reference (Triton under the interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import paged_attention, paged_attention_ref, write_kv, write_kv_ref
from pdserve.engine.kernels.quant import KV_CACHE_DTYPES, dequantize, fp8_max, quantize
from tests.engine.test_kernels import (
    LAYER,
    NUM_LAYERS,
    SCENARIOS,
    Batch,
    device_for,
    make_batch,
    rel_err,
    skip_without_triton_fp8,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def fp8_batch(batch: Batch, dtype: torch.dtype, k_scale: float, v_scale: float) -> Batch:
    """``batch`` with its KV quantized (NaN poison in unused slots stays NaN)."""
    kv = torch.empty(batch.kv.shape, dtype=dtype)
    kv[:, :, 0] = quantize(batch.kv[:, :, 0], k_scale, dtype)
    kv[:, :, 1] = quantize(batch.kv[:, :, 1], v_scale, dtype)
    return Batch(**{**batch.__dict__, "kv": kv})


@pytest.mark.parametrize("dtype", FP8)
def test_round_trip_is_within_the_formats_error(dtype: torch.dtype) -> None:
    scale = 0.37
    m = fp8_max(dtype)
    gen = torch.Generator().manual_seed(1)
    # Values across the whole normal range of the format (after scaling), both signs.
    x = torch.exp(torch.empty(100_000).uniform_(-6, 5.5, generator=gen)) * torch.randn(100_000, generator=gen).sign()
    x = x * scale
    back = dequantize(quantize(x, scale, dtype), scale, torch.float32)
    normal = x.abs() / scale >= torch.finfo(dtype).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal & (x.abs() / scale <= m)]
    assert float(rel.max()) <= 2.0 ** -(MANTISSA_BITS[dtype] + 1) + 1e-7
    # Out of range: clamped to the largest value, never inf or NaN (a plain cast gives NaN in e4m3).
    big = torch.tensor([1e9, -1e9]) * scale
    assert torch.equal(dequantize(quantize(big, scale, dtype), scale, torch.float32), torch.tensor([m, -m]) * scale)
    assert KV_CACHE_DTYPES["fp8"] is torch.float8_e4m3fn and KV_CACHE_DTYPES["auto"] is None


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_quantizes_exactly_like_the_reference(impl: str, dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    if impl == "triton":
        skip_without_triton_fp8(dtype)
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, heads, head_dim, num_tokens = 5, 16, 2, 64, 19
    kv = quantize(torch.randn(num_blocks, NUM_LAYERS, 2, block_size, heads, head_dim, generator=gen), 1.0, dtype)
    kv_ref = kv.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1
    proj = (torch.randn(num_tokens, 2 * heads, head_dim, generator=gen) * 40).to(src_dtype)  # some values clamp
    device = device_for(impl)
    kv_dev, slots_dev, proj_dev = kv.to(device), slots.to(device), proj.to(device)
    write_kv(proj_dev[:, :heads], proj_dev[:, heads:], kv_dev[:, LAYER, 0], kv_dev[:, LAYER, 1], slots_dev,
             impl=impl, k_scale=0.5, v_scale=2.0)  # fmt: skip
    write_kv_ref(proj[:, :heads], proj[:, heads:], kv_ref[:, LAYER, 0], kv_ref[:, LAYER, 1], slots, 0.5, 2.0)
    assert torch.equal(kv_dev.cpu().view(torch.uint8), kv_ref.view(torch.uint8))  # bit for bit
    b, o = divmod(int(slots[0]), block_size)
    expect = quantize(proj[0, :heads], 0.5, dtype)
    assert torch.equal(kv_ref[b, LAYER, 0, o].view(torch.uint8), expect.view(torch.uint8))


TORCH_FP8_CASES = [(s, h) for s in SCENARIOS for h in [(4, 4), (8, 2), (4, 1)]]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scenario,heads", TORCH_FP8_CASES)
def test_torch_attention_over_fp8_matches_reference(dtype: torch.dtype, scenario: str, heads: tuple[int, int]) -> None:
    b = make_batch(SCENARIOS[scenario], num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, seed=5)
    q8 = fp8_batch(b, dtype, k_scale=0.25, v_scale=3.0)
    ref = paged_attention_ref(*q8.args()[:7], k_scale=0.25, v_scale=3.0)
    out = paged_attention(*q8.args(), impl="torch", k_scale=0.25, v_scale=3.0)
    assert rel_err(out, ref) < 1e-5
    # Quantization costs little: against attention over the unquantized cache.
    assert rel_err(ref, b.ref()) < (0.05 if dtype == torch.float8_e4m3fn else 0.1)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scenario", ["decode", "mixed", "chunked"])
def test_triton_attention_over_fp8_matches_reference(dtype: torch.dtype, scenario: str) -> None:
    skip_without_triton_fp8(dtype)
    b = make_batch(SCENARIOS[scenario], num_heads=8, num_kv_heads=2, head_dim=64, seed=9)
    q8 = fp8_batch(b, dtype, k_scale=0.5, v_scale=1.5)
    ref = paged_attention_ref(*q8.args()[:7], k_scale=0.5, v_scale=1.5)
    dev = q8.to(device_for("triton"))
    out = paged_attention(*dev.args(), impl="triton", k_scale=0.5, v_scale=1.5)
    assert rel_err(out.cpu(), ref) < 1e-4


def test_triton_split_kv_over_fp8_applies_v_scale_once() -> None:
    """The split-KV path merges partials in a second kernel: v_scale must apply exactly once."""
    from pdserve.engine.kernels.triton_kernels import paged_attention_triton

    skip_without_triton_fp8(torch.float8_e4m3fn)
    b = make_batch([(70, 1), (33, 1)], num_heads=4, num_kv_heads=2, head_dim=32, seed=3)
    q8 = fp8_batch(b, torch.float8_e4m3fn, k_scale=2.0, v_scale=0.125)
    ref = paged_attention_ref(*q8.args()[:7], k_scale=2.0, v_scale=0.125)
    dev = q8.to(device_for("triton"))
    out = paged_attention_triton(*dev.args(), num_segments=4, block_n=16, k_scale=2.0, v_scale=0.125)
    assert rel_err(out.cpu(), ref) < 1e-4


def test_scales_and_dtypes_are_checked() -> None:
    b = make_batch([(5, 3)], num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="FP8 cache only"):
        paged_attention(*b.args(), k_scale=2.0)  # a float32 cache has no scale
    q8 = fp8_batch(b, torch.float8_e4m3fn, 1.0, 1.0)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="k_scale"):
            paged_attention(*q8.args(), k_scale=bad)
    # An FP8 cache takes queries of any float dtype; K and V caches must agree.
    paged_attention(q8.q.bfloat16(), *q8.args()[1:])
    with pytest.raises(ValueError, match="v_cache has dtype"):
        paged_attention(q8.q, q8.k_cache, b.v_cache, *q8.args()[3:])
