"""MLA kernels: the naive and absorbed references agree; torch and Triton paths match them.

The Triton cases run compiled on CUDA when a GPU is present, else in Triton's CPU interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if TRITON_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from pdserve.engine.kernels.mla import (
    absorb_query,
    expand_latent,
    mla_attention,
    mla_attention_mixed,
    mla_attention_naive,
    plan_mixed,
    write_latent,
)
from pdserve.engine.kernels.mla_reference import mla_absorbed_ref, mla_naive_ref, write_latent_ref
from pdserve.engine.kernels.torch_paged import plan_attention
from tests.engine.test_kernels import skip_without_triton_fp8

NUM_LAYERS, LAYER = 2, 1  # a non-zero layer: cache views have an offset and a block stride


@dataclass
class MLABatch:
    cache: torch.Tensor  # [blocks, bs, 1, rank + rope] view of a block-major tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    w_kv_b: torch.Tensor  # [H, nope + v, rank]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    rank: int
    scale: float

    @property
    def q_absorbed(self) -> torch.Tensor:
        """``[q_nope @ W_UK | q_pe]``: the absorbed form's query, written out here."""
        nope = self.q_nope.shape[2]
        q_latent = torch.einsum("nhd,hdr->nhr", self.q_nope, self.w_kv_b[:, :nope])
        return torch.cat([q_latent, self.q_pe], dim=-1).contiguous()

    def meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.block_tables, self.seq_lens, self.query_start_loc

    def to(self, device: str) -> MLABatch:
        return MLABatch(*(getattr(self, f).to(device) for f in ("cache", "q_nope", "q_pe", "w_kv_b", "block_tables",
                                                                 "seq_lens", "query_start_loc")),
                        self.rank, self.scale)  # fmt: skip


def make_mla_batch(seqs: list[tuple[int, int]], *, heads: int = 4, rank: int = 32, rope: int = 8, nope: int = 16,
                   v_dim: int = 12, block_size: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32,
                   padding_rows: int = 0) -> MLABatch:  # fmt: skip
    """``(context_len, q_len)`` pairs over shuffled blocks; slots no sequence owns hold NaN."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seqs), max(per_seq) + 1), 10**6, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    nxt = 0
    for s, n in enumerate(seq_lens):
        ids = perm[nxt : nxt + per_seq[s]]
        nxt += per_seq[s]
        tables[s, : len(ids)] = ids.to(torch.int32)
        for p in range(n):
            used[ids[p // block_size], p % block_size] = True
    kv = torch.randn(num_blocks, NUM_LAYERS, 1, block_size, 1, rank + rope, generator=g).to(dtype)
    cache = kv[:, LAYER, 0]
    cache[~used] = float("nan")
    tokens = sum(n for _, n in seqs) + padding_rows
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor([n for _, n in seqs]).cumsum(0)
    return MLABatch(
        cache=cache,
        q_nope=torch.randn(tokens, heads, nope, generator=g).to(dtype),
        q_pe=torch.randn(tokens, heads, rope, generator=g).to(dtype),
        w_kv_b=(torch.randn(heads, nope + v_dim, rank, generator=g) * rank**-0.5).to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        rank=rank,
        scale=(nope + rope) ** -0.5,
    )


# Mixed: a fresh prefill, a chunk over cached context, decodes of several lengths, an idle sequence.
MIXED = [(0, 9), (13, 6), (30, 1), (7, 1), (1, 1), (5, 0), (0, 1)]


def test_naive_and_absorbed_references_agree() -> None:
    """The two forms are one computation: W_UV(absorbed(W_UK q)) == naive(q)."""
    b = make_mla_batch(MIXED)
    naive = mla_naive_ref(b.q_nope, b.q_pe, b.cache, b.w_kv_b, *b.meta(), b.scale)
    latent = mla_absorbed_ref(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank)
    absorbed = torch.einsum("nhr,hvr->nhv", latent, b.w_kv_b[:, b.q_nope.shape[2] :])
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)
    assert not naive.isnan().any()
    # The helpers the model uses compute the same absorption.
    torch.testing.assert_close(absorb_query(b.q_nope, b.q_pe, b.w_kv_b), b.q_absorbed)
    torch.testing.assert_close(expand_latent(latent, b.w_kv_b, b.q_nope.shape[2]), absorbed)


@pytest.mark.parametrize("impl", [None, "triton"])
def test_mixed_form_matches_naive_reference(impl: str | None) -> None:
    """Decodes absorbed, prefills decompressed, in one batch: the naive reference's result."""
    b = make_mla_batch(MIXED, block_size=5, seed=11, padding_rows=1)
    want = mla_naive_ref(b.q_nope, b.q_pe, b.cache, b.w_kv_b, *b.meta(), b.scale)
    d = b if impl is None else b.to(TRITON_DEVICE)
    got = mla_attention_mixed(d.q_nope, d.q_pe, d.cache, d.w_kv_b, *d.meta(), d.scale, impl=impl)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    assert not got[-1].any()
    # The step's plan, made once and passed to every layer, gives the same result.
    plan = plan_mixed(*d.meta()[:3], d.cache.shape[1])
    assert plan.prefills and plan.decode_rows is not None
    assert (plan.decode_torch_plan is not None) == (d.cache.device.type == "cpu")
    again = mla_attention_mixed(d.q_nope, d.q_pe, d.cache, d.w_kv_b, *d.meta(), d.scale, impl=impl, plan=plan)
    assert torch.equal(again, got)


def test_reference_is_plain_attention_over_decompressed_kv() -> None:
    """One sequence, no paging tricks: the naive reference equals attention written out by hand."""
    b = make_mla_batch([(0, 6)], block_size=16)
    rows = b.cache[b.block_tables[0, 0].long(), :6, 0]  # [6, rank + rope]
    nope = b.q_nope.shape[2]
    kv = torch.einsum("lr,hdr->lhd", rows[:, : b.rank], b.w_kv_b)
    k = torch.cat([kv[..., :nope], rows[:, None, b.rank :].expand(-1, 4, -1)], dim=-1)
    q = torch.cat([b.q_nope, b.q_pe], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * b.scale
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khv->qhv", scores.softmax(-1), kv[..., nope:])
    got = mla_naive_ref(b.q_nope, b.q_pe, b.cache, b.w_kv_b, *b.meta(), b.scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
def test_torch_paths_match_references(block_size: int) -> None:
    b = make_mla_batch(MIXED, block_size=block_size, seed=block_size, padding_rows=2)
    want_latent = mla_absorbed_ref(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank)
    plan = plan_attention(*b.meta(), block_size)
    got = mla_attention(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank, impl="torch", plan=plan)
    torch.testing.assert_close(got, want_latent, atol=1e-5, rtol=1e-5)
    assert not got[-2:].any()  # padding rows stay zero
    want = mla_naive_ref(b.q_nope, b.q_pe, b.cache, b.w_kv_b, *b.meta(), b.scale)
    got_naive = mla_attention_naive(b.q_nope, b.q_pe, b.cache, b.w_kv_b, *b.meta(), b.scale)
    torch.testing.assert_close(got_naive, want, atol=1e-5, rtol=1e-5)


def test_torch_decode_only_batch() -> None:
    """The hot path: every row a decode, one length group."""
    b = make_mla_batch([(20, 1), (18, 1), (17, 1)], seed=4)
    got = mla_attention(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank)
    torch.testing.assert_close(got, mla_absorbed_ref(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "seqs,block_size,dims",
    [
        (MIXED, 4, dict(heads=4, rank=32, rope=8)),
        ([(40, 1), (3, 1), (16, 1)], 16, dict(heads=20, rank=24, rope=6)),  # two head tiles, padded dims
        ([(10, 3), (0, 2)], 5, dict(heads=2, rank=16, rope=16)),
    ],
    ids=["mixed", "decode-multitile", "odd-blocks"],
)
def test_triton_matches_reference(seqs: list, block_size: int, dims: dict) -> None:
    b = make_mla_batch(seqs, block_size=block_size, seed=block_size, padding_rows=1, **dims)
    want = mla_absorbed_ref(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank)
    d = b.to(TRITON_DEVICE)
    got = mla_attention(d.q_absorbed, d.cache, *d.meta(), d.scale, d.rank, impl="triton")
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    assert not got[-1].any()


def test_triton_bfloat16() -> None:
    b = make_mla_batch([(12, 1), (0, 3)], seed=9)
    want = mla_absorbed_ref(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank)
    d = b.to(TRITON_DEVICE)
    q, cache = d.q_absorbed.to(torch.bfloat16), d.cache.to(torch.bfloat16)
    got = mla_attention(q, cache, *d.meta(), d.scale, d.rank, impl="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("impl", ["torch", "reference", "triton"])
def test_write_latent(impl: str) -> None:
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    g = torch.Generator().manual_seed(1)
    kv = torch.zeros(6, NUM_LAYERS, 1, 4, 1, 10)
    rows = torch.randn(5, 10, generator=g)
    slots = torch.tensor([3, -1, 17, 8, 0], dtype=torch.int64)
    kv_d = kv.to(device)
    write_latent(rows.to(device), kv_d[:, LAYER, 0], slots.to(device), impl=impl)
    cache = kv_d[:, LAYER, 0].cpu()
    expected = torch.zeros(6, 4, 1, 10)
    write_latent_ref(rows, expected, slots)
    torch.testing.assert_close(cache, expected)
    assert cache[0, 3, 0].equal(rows[0]) and cache[4, 1, 0].equal(rows[2]) and not kv_d[:, 0].any()


@pytest.mark.parametrize("breaker", ["q_width", "cache_heads", "rank", "dtype", "tables_dtype", "impl"])
def test_mla_attention_rejects_bad_inputs(breaker: str) -> None:
    b = make_mla_batch([(3, 1)])
    q, cache, (tables, lens, qsl) = b.q_absorbed, b.cache, b.meta()
    rank, impl = b.rank, None
    if breaker == "q_width":
        q = q[..., :-1].contiguous()
    elif breaker == "cache_heads":
        cache = torch.zeros(*cache.shape[:2], 2, cache.shape[3])  # contiguous: only the head count is wrong
    elif breaker == "rank":
        rank = cache.shape[-1]
    elif breaker == "dtype":
        q = q.double()
    elif breaker == "tables_dtype":
        tables = tables.long()
    else:
        impl = "cuda-magic"
    with pytest.raises(ValueError, match={"q_width": "q must be", "cache_heads": "one row per token",
                                          "rank": "kv_lora_rank", "dtype": "float16, bfloat16 or float32",
                                          "tables_dtype": "block_tables", "impl": "impl"}[breaker]):  # fmt: skip
        mla_attention(q, cache, tables, lens, qsl, b.scale, rank, impl=impl)


def test_naive_form_has_no_triton_kernel() -> None:
    b = make_mla_batch([(3, 1)])
    with pytest.raises(ValueError, match="naive form"):
        mla_attention_naive(b.q_nope, b.q_pe, b.cache, b.w_kv_b, *b.meta(), b.scale, impl="triton")


def test_write_latent_rejects_bad_rows() -> None:
    cache = torch.zeros(2, 4, 1, 10)
    with pytest.raises(ValueError, match="latent must be"):
        write_latent(torch.zeros(3, 9), cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_latent(torch.zeros(3, 10), cache, torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache_every_path_matches_the_references(fp8: torch.dtype) -> None:
    """Rows written quantized (the same bits by every writer), read back as stored * kv_scale."""
    skip_without_triton_fp8(fp8)
    kv_scale = 0.37
    b = make_mla_batch(MIXED, block_size=4, seed=21, padding_rows=1)
    rows = b.cache.nan_to_num(0.0).reshape(-1, b.cache.shape[-1])  # every slot, in order
    slots = torch.arange(rows.shape[0], dtype=torch.int64)
    written = {}
    for impl in ("reference", "torch", "triton"):
        device = TRITON_DEVICE if impl == "triton" else "cpu"
        cache = torch.zeros(b.cache.shape, dtype=fp8, device=device)
        write_latent(rows.to(device), cache, slots.to(device), impl=impl, kv_scale=kv_scale)
        written[impl] = cache.cpu()
    for impl in ("torch", "triton"):
        assert written[impl].view(torch.uint8).equal(written["reference"].view(torch.uint8)), impl
    cache = written["reference"]
    q = b.q_absorbed
    want_latent = mla_absorbed_ref(q, cache, *b.meta(), b.scale, b.rank, kv_scale)
    deq = cache.float() * kv_scale
    torch.testing.assert_close(want_latent, mla_absorbed_ref(q, deq, *b.meta(), b.scale, b.rank), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    got = mla_attention(q, cache, *b.meta(), b.scale, b.rank, impl="torch", kv_scale=kv_scale)
    torch.testing.assert_close(got, want_latent, atol=1e-5, rtol=1e-5)
    d = b.to(TRITON_DEVICE)
    got = mla_attention(d.q_absorbed, cache.to(TRITON_DEVICE), *d.meta(), d.scale, d.rank, impl="triton",
                        kv_scale=kv_scale)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want_latent, atol=2e-5, rtol=2e-5)
    want = mla_naive_ref(b.q_nope, b.q_pe, cache, b.w_kv_b, *b.meta(), b.scale, kv_scale)
    for fn in (mla_attention_naive, mla_attention_mixed):
        got = fn(b.q_nope, b.q_pe, cache, b.w_kv_b, *b.meta(), b.scale, kv_scale=kv_scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_float_cache_refuses_a_scale() -> None:
    b = make_mla_batch([(3, 1)])
    with pytest.raises(ValueError, match="kv_scale applies to an FP8 cache only"):
        mla_attention(b.q_absorbed, b.cache, *b.meta(), b.scale, b.rank, kv_scale=0.5)
