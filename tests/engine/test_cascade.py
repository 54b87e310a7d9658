"""Cascade attention (engine/kernels/cascade.py): decodes that share prefix blocks read them once,
merged with their own suffixes by log-sum-exp. Against the float32 reference kernel, on batches
whose unused cache slots are NaN (any read outside a sequence poisons the output), and through
the engine against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.kernels import cpu_decode, gather_shared_prefix, paged_attention_ref
from pdserve.engine.kernels.cascade import MIN_PREFIX_TOKENS, MIN_SEQS, common_prefix_blocks
from pdserve.engine.kernels.quant import quantize
from pdserve.engine.kernels.torch_paged import ROWWISE_MAX_ROWS, paged_attention_torch, plan_attention

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                                reason="this torch has no CPU flash-attention operator")  # fmt: skip

BS = 16
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32


def _batch(shared_blocks: int, suffixes: list[int], prefills: list[tuple[int, int]], dtype: torch.dtype,
           seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Decodes whose tables start with the same ``shared_blocks`` blocks, then ``suffixes[i]``
    positions of their own (the query's included); then prefills ``(context, q_len)``, the first
    of them over the shared prefix too. Returns (q, k_cache, v_cache, tables, lens, qsl)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [shared_blocks * BS + n for n in suffixes] + [c + q for c, q in prefills]
    own = [-(-n // BS) - shared_blocks for n in lens[: len(suffixes)]]
    own += [-(-n // BS) - (shared_blocks if i == 0 else 0) for i, n in enumerate(lens[len(suffixes) :])]
    total = shared_blocks + sum(own) + 2
    ids = list(range(total))
    rng.shuffle(ids)
    prefix, taken = ids[:shared_blocks], shared_blocks
    tables = []
    for i, count in enumerate(own):
        start = prefix if i < len(suffixes) or i == len(suffixes) else []
        tables.append(start + ids[taken : taken + count])
        taken += count
    width = max(len(t) for t in tables) + 1
    table = torch.full((len(tables), width), 10**6, dtype=torch.int32)
    used = torch.zeros(total, BS, dtype=torch.bool)
    for s, row in enumerate(tables):
        table[s, : len(row)] = torch.tensor(row, dtype=torch.int32)
        for pos in range(lens[s]):
            used[row[pos // BS], pos % BS] = True
    kv = torch.randn(total, 2, BS, KV_HEADS, HEAD_DIM, generator=gen)
    kv[:, 0][~used] = float("nan")
    kv[:, 1][~used] = float("nan")
    q_lens = [1] * len(suffixes) + [q for _, q in prefills]
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen).to(dtype if dtype.is_floating_point and
                                                                      dtype.itemsize > 1 else torch.float32)  # fmt: skip
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    kv = kv.to(dtype) if dtype.itemsize > 1 else quantize(kv, 0.5, dtype)
    return q, kv[:, 0], kv[:, 1], table, torch.tensor(lens, dtype=torch.int32), qsl


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def test_the_common_prefix_stops_before_any_sequence_s_last_block() -> None:
    rows = torch.tensor([[4, 7, 9, 1], [4, 7, 9, 2], [4, 7, 3, 5]], dtype=torch.int32)
    assert common_prefix_blocks(rows, [64, 64, 64], 16) == 2
    assert common_prefix_blocks(rows[:2], [64, 64], 16) == 3
    assert common_prefix_blocks(rows[:2], [48, 64], 16) == 2  # the first sequence's third block is its last
    assert common_prefix_blocks(torch.tensor([[1, 2], [1, 2]]), [17, 32], 16) == 1
    assert common_prefix_blocks(torch.tensor([[5, 2], [6, 2]]), [64, 64], 16) == 0  # the first block differs
    assert common_prefix_blocks(torch.zeros((0, 4), dtype=torch.int32), [], 16) == 0


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                            (torch.float8_e4m3fn, 1e-5)])  # fmt: skip
def test_cascade_matches_the_reference(dtype: torch.dtype, tol: float) -> None:
    """Ten decodes over 9 shared blocks with suffixes of 1 to 260 positions (three length groups, so
    the prefix results are picked per group) beside two prefills, one of them over the prefix."""
    suffixes = [1, 5, 16, 17, 40, 90, 120, 200, 230, 260]
    q, k, v, table, lens, qsl = _batch(9, suffixes, [(9 * BS + 3, 7), (0, 20)], dtype)
    plan = plan_attention(table, lens, qsl, BS, cascade=True)
    assert plan.cascade is not None and plan.cascade.num_tokens == 9 * BS
    assert len(plan.decode_groups) >= 3
    scale = HEAD_DIM**-0.5
    scales = (0.5, 0.5) if dtype.itemsize == 1 else (1.0, 1.0)
    got = paged_attention_torch(q, k, v, table, lens, qsl, scale, plan, k_scale=scales[0], v_scale=scales[1])
    ref = paged_attention_ref(q, k, v, table, lens, qsl, scale, k_scale=scales[0], v_scale=scales[1])
    assert not got.isnan().any()
    assert _rel(got, ref) < tol
    plain = paged_attention_torch(q, k, v, table, lens, qsl, scale, plan_attention(table, lens, qsl, BS),
                                  k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    assert _rel(got, plain) < tol


needs_kernel = pytest.mark.skipif(not cpu_decode.supports(torch.float32, torch.float32, HEADS, KV_HEADS, HEAD_DIM),
                                  reason="the in-place decode kernel is not built here")  # fmt: skip


@needs_kernel
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_short_prefill_over_the_prefix_joins_the_cascade_row_by_row(dtype: torch.dtype, tol: float) -> None:
    """A prefill's 7-row tail after the shared prefix, beside decodes: with the in-place kernel each of its
    rows is a decode of its own (row j reads up to its own position), the prefix read once for all of
    them. A prefill longer than ROWWISE_MAX_ROWS in the step keeps every prefill as its own call."""
    decodes = [1, 5, 16, 17, 40, 90, 120, 200]
    q, k, v, table, lens, qsl = _batch(9, decodes, [(9 * BS + 3, 7)], dtype)
    plan = plan_attention(table, lens, qsl, BS, cascade=True, fused=True)
    assert plan.cascade is not None and plan.cascade.num_tokens == 9 * BS
    assert plan.prefills == [] and plan.cascade.rows.tolist() == list(range(8 + 7))
    scale = HEAD_DIM**-0.5
    got = paged_attention_torch(q, k, v, table, lens, qsl, scale, plan)
    assert not got.isnan().any()
    assert _rel(got, paged_attention_ref(q, k, v, table, lens, qsl, scale)) < tol
    q, k, v, table, lens, qsl = _batch(9, decodes, [(9 * BS + 3, 7), (0, ROWWISE_MAX_ROWS + 1)], dtype)
    plan = plan_attention(table, lens, qsl, BS, cascade=True, fused=True)
    assert [s for s, _, _ in plan.prefills] == [8, 9] and plan.cascade.rows.tolist() == list(range(8))
    assert _rel(paged_attention_torch(q, k, v, table, lens, qsl, scale, plan),
                paged_attention_ref(q, k, v, table, lens, qsl, scale)) < tol  # fmt: skip


@needs_kernel
def test_short_prefills_sharing_no_prefix_keep_their_own_calls() -> None:
    """Row by row, each row would read its whole context: without a shared prefix the plan keeps the
    prefill as one call."""
    q, k, v, table, lens, qsl = _batch(0, [30, 40] * 5, [(50, 6)], torch.float32, seed=2)
    plan = plan_attention(table, lens, qsl, BS, cascade=True, fused=True)
    assert plan.cascade is None and plan.prefills == [(10, int(qsl[10]), int(lens[10]))]
    got = paged_attention_torch(q, k, v, table, lens, qsl, 0.2, plan)
    assert _rel(got, paged_attention_ref(q, k, v, table, lens, qsl, 0.2)) < 1e-5


def test_prompts_hitting_blocks_another_prompt_computes_in_the_same_step(tiny_model: str) -> None:
    """Ten prompts sharing a 160-token prefix, none cached, in one step: the first computes the prefix's
    blocks and the others hit them in the same step (their tails are short prefills). Those blocks are
    written during the step, so no cascade may read them as a prefix taken before it; every prompt
    equals transformers' greedy continuation, as when sent one at a time."""
    from tests.engine.test_engine import hf_greedy
    from tests.support.models import load_hf_reference

    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(160)]
    prompts = [prefix + [rng.randrange(256) for _ in range(20 + i)] for i in range(10)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = LLM(tiny_model, num_blocks=256, block_size=BS).generate(prompts, params)
    assert sum(o.num_cached_tokens == 160 for o in outs) == 9  # hits on blocks computed in the same step
    hf = load_hf_reference(tiny_model)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 4)


def test_the_hot_path_one_group_of_every_row() -> None:
    q, k, v, table, lens, qsl = _batch(10, [30 + i for i in range(MIN_SEQS)], [], torch.float32, seed=4)
    plan = plan_attention(table, lens, qsl, BS, cascade=True)
    assert plan.cascade is not None and len(plan.decode_groups) == 1 and plan.decode_groups[0].all_rows
    got = paged_attention_torch(q, k, v, table, lens, qsl, HEAD_DIM**-0.5, plan)
    assert _rel(got, paged_attention_ref(q, k, v, table, lens, qsl, HEAD_DIM**-0.5)) < 1e-5


@pytest.mark.parametrize(("cache_heads", "heads"), [(KV_HEADS, slice(None)), (2 * KV_HEADS, slice(KV_HEADS, None))])
def test_the_step_gathers_every_layer_s_prefix_at_once(cache_heads: int, heads: slice) -> None:
    """``gather_shared_prefix`` takes the prefix of every layer of a block-major KV tensor (of a
    tensor-parallel rank's heads, or all of them) in one gather; a layer reading it (``layer=``) gets
    exactly what it gets gathering its own."""
    q, k, v, table, lens, qsl = _batch(9, [1, 5, 16, 17, 40, 90, 120, 200], [], torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(k.shape[0], 3, 2, BS, cache_heads, HEAD_DIM, generator=gen)  # 3 layers
    kv[:, 1, 0, :, heads], kv[:, 1, 1, :, heads] = k, v  # layer 1 holds the batch, in the rank's heads
    layer_k, layer_v = kv[:, 1, 0, :, heads], kv[:, 1, 1, :, heads]
    plan = plan_attention(table, lens, qsl, BS, cascade=True)
    assert plan.cascade is not None
    alone = paged_attention_torch(q, layer_k, layer_v, table, lens, qsl, 0.2, plan, layer=1)
    gather_shared_prefix(plan, kv, heads)
    assert plan.cascade.kv is not None and plan.cascade.kv.shape == (3, 2, 9 * BS, KV_HEADS, HEAD_DIM)
    blocks = plan.cascade.block_index
    for layer in range(3):
        for plane in range(2):
            want = kv[blocks, layer, plane, :, heads].reshape(9 * BS, KV_HEADS, HEAD_DIM)
            assert torch.equal(plan.cascade.kv[layer, plane], want)
    assert torch.equal(paged_attention_torch(q, layer_k, layer_v, table, lens, qsl, 0.2, plan, layer=1), alone)
    assert _rel(alone, paged_attention_ref(q, k, v, table, lens, qsl, 0.2)) < 1e-5


def test_no_cascade_for_few_sequences_a_short_prefix_or_a_window() -> None:
    blocks = MIN_PREFIX_TOKENS // BS
    few = _batch(blocks, [20] * (MIN_SEQS - 1), [], torch.float32)
    assert plan_attention(*few[3:], BS, cascade=True).cascade is None
    short = _batch(blocks - 1, [20] * MIN_SEQS, [], torch.float32)
    assert plan_attention(*short[3:], BS, cascade=True).cascade is None
    enough = _batch(blocks, [20] * MIN_SEQS, [], torch.float32)
    assert plan_attention(*enough[3:], BS, cascade=True).cascade is not None
    assert plan_attention(*enough[3:], BS, sliding_window=64, cascade=True).cascade is None
    assert plan_attention(*enough[3:], BS).cascade is None  # off unless asked (MLA plans never ask)


def record_plans(llm: LLM) -> list:
    """A list that gets each step's attention plan (``AttentionMetadata.torch_plan``) from now on."""
    plans: list = []
    runner = llm.engine.runner
    prepare = runner.prepare

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - records each step's plan
        out = prepare(*args, **kwargs)
        plans.append(out[2].torch_plan)
        return out

    runner.prepare = spy  # type: ignore[method-assign]
    return plans


def test_the_engine_with_a_cached_shared_prefix_equals_transformers(tiny_model: str) -> None:
    """Eight prompts that hit a cached 160-token prefix decode together, every step a cascade over
    the same physical blocks; each equals transformers' greedy continuation."""
    from tests.engine.test_engine import hf_greedy
    from tests.support.models import load_hf_reference

    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(160)]
    prompts = [prefix + [rng.randrange(256) for _ in range(3 + i)] for i in range(MIN_SEQS)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_model, num_blocks=256, block_size=BS)
    plans = record_plans(llm)
    llm.generate([prefix + [1]], params)  # caches the prefix's blocks
    plans.clear()
    outs = llm.generate(prompts, params)
    assert all(o.num_cached_tokens == 160 for o in outs)
    assert sum(p.cascade is not None for p in plans) >= 8  # the decode steps read the prefix once
    if llm.engine.runner.fused_decode:  # the prompts' tails too, each row a decode of the prefill step's cascade
        assert plans[0].cascade is not None and plans[0].prefills == []
        assert plans[0].cascade.rows.numel() == sum(len(p) - 160 for p in prompts)
    hf = load_hf_reference(tiny_model)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 10)


def test_disable_cascade_attn_turns_it_off(tiny_model: str) -> None:
    """vLLM's option name; a layout without K/V heads (MLA) never plans one either."""
    assert LLM(tiny_model, num_blocks=16).engine.runner.cascade
    assert not LLM(tiny_model, num_blocks=16, disable_cascade_attn=True).engine.runner.cascade
    with pytest.raises(ValueError, match="disable_cascade_attn must be a bool"):
        LLM(tiny_model, num_blocks=16, disable_cascade_attn="yes")
