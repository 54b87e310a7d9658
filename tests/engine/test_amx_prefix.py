"""The cascade's shared-prefix attention in bfloat16 on AMX tiles (engine/kernels/cpu_amx_prefix.c):
its packing of a layer's paged prefix against a torch permutation, the kernel against a float64 softmax and
ATen's flash operator (the path it replaces), the cascade through it against the float32 reference
kernel, and the engine in bfloat16 with a cached shared prefix against transformers in bfloat16.

Accuracy, stated: the kernel's scores and softmax are float32 and its output float32; what it rounds
is the softmax weights, to bfloat16, before the second product (as the flash operator does). Against
float64 its output is within ``ATOL`` (3e-3) plus 1% of each value, the log-sum-exp within 1e-4,
and never further from float64 than the flash operator is plus ``ATOL``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.kernels import cpu_amx_prefix, gather_shared_prefix, paged_attention_ref
from pdserve.engine.kernels.cascade import MIN_SEQS, attention_lse
from pdserve.engine.kernels.torch_paged import paged_attention_torch, plan_attention

pytestmark = pytest.mark.skipif(not cpu_amx_prefix.available(torch.bfloat16, 64),
                                reason="no AMX-BF16 kernel on this CPU or build")  # fmt: skip

ATOL = 3e-3


def _reference_pack(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layouts ``PackedPrefix`` documents, by torch permutations of ``k``, ``v [layers, keys, heads, D]``."""
    layers, keys, heads, d = k.shape
    pad = -keys % 32
    kt, vt = (torch.nn.functional.pad(t.permute(0, 2, 1, 3), (0, 0, 0, pad)) for t in (k, v))
    n = keys + pad
    kp = kt.reshape(layers, heads, n // 16, 16, d // 32, 16, 2).permute(0, 1, 2, 4, 5, 3, 6)
    vp = vt.reshape(layers, heads, n // 32, 16, 2, d // 16, 16).permute(0, 1, 2, 5, 3, 6, 4)
    return kp, vp


def _paged_prefix(blocks: int, block_size: int, cache_heads: int, heads: slice, d: int,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A 3-layer block-major bfloat16 cache of ``blocks + 8`` blocks, NaN except the prefix's ``blocks``
    shuffled blocks; returns (cache, block ids, K and V [layers, keys, heads, D] of the prefix)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.full((blocks + 8, 3, 2, block_size, cache_heads, d), float("nan"), dtype=torch.bfloat16)
    ids = torch.randperm(blocks + 8, generator=gen)[:blocks]
    cache[ids] = torch.randn(blocks, 3, 2, block_size, cache_heads, d, generator=gen).to(torch.bfloat16)
    prefix = cache[ids][:, :, :, :, heads].permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # [layers, 2, keys, H, D]
    return cache, ids, prefix[:, 0], prefix[:, 1]


@pytest.mark.parametrize(("blocks", "block_size", "cache_heads", "heads", "d"), [
    (13, 16, 3, slice(None), 64),  # SmolLM2's: 208 keys, padded to 224
    (1, 5, 4, slice(2, None), 64),  # a tensor-parallel rank's heads; 5 keys in one 32-key block
    (9, 16, 2, slice(None), 128),
    (2, 16, 1, slice(None), 32),  # exactly one block of 32
    (7, 16, 2, slice(0, 1), 96),  # 96 = 6 dim tiles: a group of 4, then 2
])  # fmt: skip
def test_pack_lays_out_the_paged_prefix(blocks: int, block_size: int, cache_heads: int, heads: slice,
                                        d: int) -> None:  # fmt: skip
    """Each layer as its attention asks, into the same buffers: layer 2, then 0, then 2 again."""
    cache, ids, k, v = _paged_prefix(blocks, block_size, cache_heads, heads, d, seed=blocks)
    tiles = cpu_amx_prefix.tiles(cache, heads, ids)
    kp, vp = _reference_pack(k, v)
    assert tiles.keys == blocks * block_size and tiles.keys_pad % 32 == 0 and tiles.packed_layer is None
    for layer in (2, 0, 2):
        got_k, got_v = tiles.pack(layer)
        assert tiles.packed_layer == layer
        assert torch.equal(got_k, kp[layer]) and torch.equal(got_v, vp[layer])  # the padding is zeros, no NaN read


def _float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``q [B, Hq, D]`` over ``k``, ``v [keys, Hkv, D]`` in float64: ``(out [B, Hkv, G, D], lse [B, Hkv, G])``."""
    batch, num_heads, d = q.shape
    hkv = k.shape[1]
    qg = q.double().view(batch, hkv, num_heads // hkv, d)
    s = torch.einsum("bhgd,khd->bhgk", qg, k.double()) * scale
    return torch.einsum("bhgk,khd->bhgd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1)


@pytest.mark.parametrize(("blocks", "block_size", "kv_heads", "group", "batch", "d"), [
    (13, 16, 3, 3, 32, 64),  # SmolLM2's: 32 sequences of 3 query heads a KV head over a 208-token prefix
    (1, 5, 2, 1, 7, 64),  # fewer sequences than a tile, fewer keys than a tile
    (9, 16, 2, 2, 33, 128),  # a tile of one sequence; two groups of four dim tiles
    (2, 16, 1, 4, 16, 32),
    (63, 16, 4, 1, 17, 96),  # 1,008 keys
])  # fmt: skip
def test_attention_matches_float64_and_the_flash_operator(blocks: int, block_size: int, kv_heads: int, group: int,
                                                          batch: int, d: int) -> None:  # fmt: skip
    """The queries are read where they lie: rows of a wider tensor (a qkv projection's q columns)."""
    cache, ids, k, v = _paged_prefix(blocks, block_size, kv_heads, slice(None), d, seed=batch)
    tiles = cpu_amx_prefix.tiles(cache, slice(None), ids)
    heads = kv_heads * group
    wide = (torch.randn(batch, heads + 2, d, generator=torch.Generator().manual_seed(d)) * 2).to(torch.bfloat16)
    q = wide[:, :heads]
    scale = d**-0.5
    for layer in (0, 2):
        out, lse = tiles.attention(q, layer, scale)
        want, want_lse = _float64_attention(q, k[layer], v[layer], scale)
        qa = q.reshape(batch, kv_heads, group, d).transpose(0, 1).reshape(1, kv_heads, batch * group, d)
        flash, flash_lse = attention_lse(qa, k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None], scale)
        flash = flash[0].view(kv_heads, batch, group, d).transpose(0, 1)
        flash_lse = flash_lse[0].view(kv_heads, batch, group).transpose(0, 1)
        err = (out.double() - want).abs()
        assert out.dtype == lse.dtype == torch.float32
        assert out.shape == (batch, kv_heads, group, d) and lse.shape == (batch, kv_heads, group)
        assert (err <= ATOL + 0.01 * want.abs()).all(), err.max()
        assert (lse.double() - want_lse).abs().max() <= 1e-4
        assert err.max() <= (flash.double() - want).abs().max() + ATOL
        assert (lse - flash_lse).abs().max() <= 1e-4


def test_a_query_that_does_not_match_the_prefix_is_refused() -> None:
    cache, ids, _, _ = _paged_prefix(2, 16, 2, slice(None), 64, seed=0)
    tiles = cpu_amx_prefix.tiles(cache, slice(None), ids)
    with pytest.raises(ValueError, match="does not match"):
        tiles.attention(torch.zeros(4, 3, 64, dtype=torch.bfloat16), 0, 0.1)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="layer 3 of a cache of 3"):
        tiles.attention(torch.zeros(4, 2, 64, dtype=torch.bfloat16), 3, 0.1)
    with pytest.raises(ValueError, match="does not match"):
        tiles.attention(torch.zeros(4, 2, 32, dtype=torch.bfloat16), 0, 0.1)  # head size 32, not 64
    with pytest.raises(ValueError, match="does not match"):
        tiles.attention(torch.zeros(4, 2, 64), 0, 0.1)  # float32
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_amx_prefix.tiles(cache.float(), slice(None), ids)
    assert tiles.packed_layer is None  # nothing was packed for a refused call


def test_the_cascade_runs_its_prefix_on_amx() -> None:
    """A step's decodes over 9 shared blocks: the step sets the AMX prefix up (no float gather), and a
    layer's attention through it matches the float32 reference and the plan without a
    cascade. Unused cache slots are NaN: a read outside a sequence would poison the output."""
    from tests.engine.test_cascade import BS, HEAD_DIM, KV_HEADS, _batch, _rel

    assert HEAD_DIM % 32 == 0
    q, k, v, table, lens, qsl = _batch(9, [1, 5, 16, 17, 40, 90, 120, 200, 230], [(9 * BS + 3, 7)], torch.bfloat16)
    kv = torch.full((k.shape[0], 2, 2, BS, KV_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    kv[:, 1, 0], kv[:, 1, 1] = k, v  # layer 1 holds the batch
    plan = plan_attention(table, lens, qsl, BS, cascade=True)
    assert plan.cascade is not None
    gather_shared_prefix(plan, kv, slice(None))
    assert plan.cascade.tiles is not None and plan.cascade.kv is None
    got = paged_attention_torch(q, kv[:, 1, 0], kv[:, 1, 1], table, lens, qsl, HEAD_DIM**-0.5, plan, layer=1)
    ref = paged_attention_ref(q, k, v, table, lens, qsl, HEAD_DIM**-0.5)
    plain = paged_attention_torch(q, k, v, table, lens, qsl, HEAD_DIM**-0.5, plan_attention(table, lens, qsl, BS))
    assert not got.isnan().any()
    assert _rel(got, ref) < 2e-2 and _rel(got, plain) < 2e-2


def test_the_engine_in_bfloat16_with_a_shared_prefix_agrees_with_transformers(tmp_path: Path) -> None:
    """Eight prompts that hit a cached 160-token prefix decode together in bfloat16, every decode step a
    cascade whose prefix runs on AMX; each generated token is transformers-bf16's top-1 on the engine's
    sequence, or a near tie (test_bf16_cpu's rule)."""
    from tests.engine.test_bf16_cpu import check_greedy_bf16
    from tests.engine.test_cascade import record_plans
    from tests.support.models import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "d32", "llama_gqa", seed=21, dtype=torch.bfloat16,
                              overrides={"hidden_size": 128, "head_dim": 32})  # fmt: skip
    llm = LLM(str(path), dtype="bfloat16", num_blocks=128, block_size=16)
    plans = record_plans(llm)
    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(160)]
    prompts = [prefix + [rng.randrange(256) for _ in range(3 + i)] for i in range(MIN_SEQS)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate([prefix + [1]], params)  # caches the prefix's blocks
    plans.clear()
    outs = llm.generate(prompts, params)
    assert sum(p is not None and p.cascade is not None and p.cascade.tiles is not None for p in plans) >= 8
    check_greedy_bf16(path, prompts, outs)
