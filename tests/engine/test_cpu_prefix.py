"""The cascade's shared-prefix attention in float32 (engine/kernels/cpu_prefix.c): the kernel against a
float64 softmax, on shapes that cross its tiles (16 keys), its chunks (256 keys) and its groups of six
query rows; queries read at a row stride; what it refuses; and the cascade taking it in a float32 step.

Accuracy, stated: scores, softmax and output in float32; against float64 the output is within 1e-5 and
the log-sum-exp within 1e-5 (absolute, on N(0, 1) inputs)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_prefix, gather_shared_prefix
from pdserve.engine.kernels.cascade import MIN_SEQS
from pdserve.engine.kernels.torch_paged import plan_attention, prefix_part

pytestmark = pytest.mark.skipif(not cpu_prefix.available(torch.float32, 64), reason="the C kernel is not built here")

TOL = 1e-5


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hkv, G, D], lse [B, Hkv, G])`` in float64 by the definition: softmax(q k^T scale) v."""
    batch, num_heads, d = q.shape
    heads = k.shape[1]
    qg = q.double().view(batch, heads, num_heads // heads, d)
    scores = torch.einsum("bhgd,phd->bhgp", qg, k.double()) * scale
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("bhgp,phd->bhgd", torch.softmax(scores, -1), v.double()), lse


@pytest.mark.parametrize(("batch", "num_heads", "heads", "d", "keys"), [
    (32, 9, 3, 64, 221),  # SmolLM2-135M's shapes: 96 rows a head, 14 tiles
    (1, 1, 1, 64, 1),  # one row, one key
    (5, 4, 4, 32, 16),  # exactly one tile; no GQA
    (7, 8, 1, 16, 17),  # MQA: 56 rows, a tile and one key
    (3, 16, 2, 128, 300),  # two chunks: the online softmax across them
    (2, 6, 2, 80, 40),  # 80 = 5 vectors
    (4, 2, 1, 256, 33),  # the largest head size
])  # fmt: skip
def test_the_kernel_against_float64(batch: int, num_heads: int, heads: int, d: int, keys: int) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + keys)
    q = torch.randn(batch, num_heads, d, generator=gen)
    k, v = torch.randn(keys, heads, d, generator=gen), torch.randn(keys, heads, d, generator=gen)
    scale = d**-0.5
    out, lse = cpu_prefix.attention(q, k, v, scale)
    want, want_lse = _reference(q, k, v, scale)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert torch.allclose(out.double(), want, atol=TOL, rtol=0), (out.double() - want).abs().max()
    assert torch.allclose(lse.double(), want_lse, atol=TOL, rtol=0), (lse.double() - want_lse).abs().max()


def test_scores_far_below_zero() -> None:
    """Every score near -128 (17 keys: a tile and one key, the rest of the last tile padding): the
    padding's lanes must not set the maximum, or every exponential underflows to the same value."""
    gen = torch.Generator().manual_seed(11)
    q = torch.full((3, 2, 64), 4.0) + torch.randn(3, 2, 64, generator=gen) * 0.1
    k = torch.full((17, 1, 64), -4.0) + torch.randn(17, 1, 64, generator=gen) * 0.1
    v = torch.randn(17, 1, 64, generator=gen)
    out, lse = cpu_prefix.attention(q, k, v, 0.125)
    want, want_lse = _reference(q, k, v, 0.125)
    assert want_lse.max() < -100
    # Scores of magnitude 128 carry float32 rounding about 1e-5 of it: the weights, and so the output, 1e-4.
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=0)
    assert torch.allclose(lse.double(), want_lse, atol=1e-4, rtol=0)


def test_queries_are_read_at_their_row_stride() -> None:
    """The query rows as a view of a wider row (the qkv projection's output), unchanged results."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(20, 9 * 64 + 2 * 3 * 64, generator=gen)
    q = qkv[:, : 9 * 64].view(20, 9, 64)
    k, v = torch.randn(50, 3, 64, generator=gen), torch.randn(50, 3, 64, generator=gen)
    strided = cpu_prefix.attention(q, k, v, 0.125)
    packed = cpu_prefix.attention(q.contiguous(), k, v, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(strided, packed, strict=True))


def test_inputs_it_does_not_take_are_refused() -> None:
    q, k = torch.randn(2, 4, 64), torch.randn(10, 2, 64)
    with pytest.raises(ValueError):
        cpu_prefix.attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0.125)  # not float32
    with pytest.raises(ValueError):
        cpu_prefix.attention(q, k, torch.randn(11, 2, 64), 0.125)  # K and V of different lengths
    with pytest.raises(ValueError):
        cpu_prefix.attention(torch.randn(2, 3, 64), k, k, 0.125)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError):
        cpu_prefix.attention(q, k.transpose(0, 1).contiguous().transpose(0, 1), k, 0.125)  # K not contiguous
    assert not cpu_prefix.available(torch.float32, 24)  # no instantiation for 24 dims


@pytest.mark.parametrize("gathered", [True, False])
def test_a_float32_cascade_runs_the_kernel(gathered: bool) -> None:
    """``prefix_part`` over a step's float32 prefix, gathered for every layer before the layers or taken
    from the caches by the layer itself: the kernel's result (the same bits either way), against float64."""
    gen = torch.Generator().manual_seed(5)
    bs, shared, heads, d, seqs = 16, 9, 3, 64, MIN_SEQS + 2  # 144 shared tokens: past MIN_PREFIX_TOKENS
    kv_cache = torch.randn(shared + seqs, 2, 2, bs, heads, d, generator=gen)  # 2 layers
    # Every sequence: the shared blocks, then a block of its own, 5 tokens into it.
    table = torch.tensor([[*range(shared), shared + i] for i in range(seqs)], dtype=torch.int32)
    lens = torch.full((seqs,), shared * bs + 5, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    plan = plan_attention(table, lens, qsl, bs, cascade=True)
    assert plan.cascade is not None and plan.cascade.block_index.numel() == shared
    if gathered:
        gather_shared_prefix(plan, kv_cache, slice(None))
        assert plan.cascade.kv is not None
    q = torch.randn(seqs, 9, d, generator=gen)

    for layer in range(2):
        k_cache, v_cache = kv_cache[:, layer].unbind(1)
        out, lse = prefix_part(q, k_cache, v_cache, plan.cascade, d**-0.5, 1.0, 1.0, layer)
        keys = k_cache[:shared].flatten(0, 1), v_cache[:shared].flatten(0, 1)
        want, want_lse = _reference(q, *keys, d**-0.5)
        assert torch.allclose(out.double(), want, atol=TOL, rtol=0)
        assert torch.allclose(lse.double(), want_lse, atol=TOL, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip((out, lse), cpu_prefix.attention(q, *keys, d**-0.5), strict=True))

