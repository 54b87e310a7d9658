"""Multi-head latent attention (MLA) over a paged latent cache: host wrappers and the torch paths.

The cache of one layer is ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]`` (a strided
view of the block-major KV tensor; inner dims contiguous); see :mod:`engine.kernels.mla_reference`
for the two forms and their references.

* :func:`write_latent`: scatter this step's rows into their slots (Triton on CUDA, ``index_put_`` on CPU);
* :func:`mla_attention`: the absorbed form (decode): ``impl`` ``None`` picks Triton on CUDA and
  torch elsewhere, as in :mod:`engine.kernels.ops`; ``"reference"`` is the float32 loop;
* :func:`mla_attention_naive`: the decompressed form (the baseline the benchmark compares decode
  against): torch on every device, or ``"reference"``;
* :func:`mla_attention_mixed`: per sequence, decodes absorbed and prefills decompressed (the engine's
  steps that hold a prefill).

Validation never reads tensor values (no device sync); the caller guarantees in-range slots,
block ids and lengths, as for :func:`engine.kernels.paged_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.kernels.mla_reference import mla_absorbed_ref, mla_naive_ref, write_latent_ref
from pdserve.engine.kernels.ops import _check_cache, _check_float_dtype, _check_int_vector, _check_same_device
from pdserve.engine.kernels.ops import _resolve_impl as _resolve
from pdserve.engine.kernels.quant import is_fp8, quantize
from pdserve.engine.kernels.torch_paged import TorchAttentionPlan, _gather, _gather_seq, _read, plan_attention


def _check_latent_cache(cache: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> None:
    """One row per token; the inputs' dtype and scale 1.0, or FP8 with a finite scale > 0."""
    _check_cache("cache", cache)
    if cache.shape[2] != 1:
        raise ValueError(f"an MLA cache has one row per token ([num_blocks, block_size, 1, D]), got {tuple(cache.shape)}")
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)) or not (math.isfinite(kv_scale)
                                                                                   and kv_scale > 0):
        raise ValueError(f"kv_scale must be a finite number > 0, got {kv_scale!r}")
    if is_fp8(cache.dtype):
        return
    _check_float_dtype("cache", cache, dtype)
    if kv_scale != 1.0:
        raise ValueError(f"kv_scale applies to an FP8 cache only; this cache is {cache.dtype}")


def _check_batch(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")  # fmt: skip
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have a contiguous last dim, got strides {block_tables.stride()}")
    _check_int_vector("seq_lens", seq_lens, torch.int32, block_tables.shape[0])
    _check_int_vector("query_start_loc", query_start_loc, torch.int32, block_tables.shape[0] + 1)


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, impl: str | None = None,
                 kv_scale: float = 1.0) -> None:  # fmt: skip
    """Write ``latent [num_tokens, D]`` (``[c_kv | rotated k_pe]``, the cache's dtype) into
    ``cache`` at ``slot_mapping`` (int64, ``block_id * block_size + offset``; ``-1`` skips). An FP8
    cache stores ``quantize(latent, kv_scale)``."""
    if latent.dim() != 2 or latent.shape[1] != cache.shape[-1]:
        raise ValueError(f"latent must be [num_tokens, {cache.shape[-1]}], got {tuple(latent.shape)}")
    _check_float_dtype("latent", latent)
    _check_latent_cache(cache, latent.dtype, kv_scale)
    _check_int_vector("slot_mapping", slot_mapping, torch.int64, latent.shape[0])
    _check_same_device({"latent": latent, "slot_mapping": slot_mapping}, cache.device)
    if latent.shape[0] and latent.stride(1) != 1:
        raise ValueError(f"latent must have a contiguous last dim, got strides {latent.stride()}")
    backend = _resolve(impl, cache.device)
    if backend == "reference":
        write_latent_ref(latent, cache, slot_mapping, kv_scale)
        return
    if is_fp8(cache.dtype):  # quantized in bulk (the reference's bits), then scattered as they are
        latent = quantize(latent, kv_scale, cache.dtype)
    if backend == "triton":
        from pdserve.engine.kernels.mla_triton import write_latent_triton  # lazy: triton is optional

        write_latent_triton(latent, cache, slot_mapping)
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):  # -1 slots (rare): dropped (a sync, free on the CPU)
        slot_mapping, latent = slot_mapping[valid], latent[valid]
    block_size = cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    # The cache is a strided view: a (block, offset) index pair addresses it directly.
    cache[:, :, 0].index_put_((blocks, slot_mapping - blocks * block_size), latent)


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    impl: str | None = None,
    plan: TorchAttentionPlan | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Absorbed MLA over a mixed batch: ``q [num_tokens, H, kv_lora_rank + rope_dim]``; returns
    the per-head latents ``[num_tokens, H, kv_lora_rank]`` (``softmax(q·row * scale) @ latent``)
    in ``q.dtype``; rows owned by no sequence are zero. ``plan``: the torch path's step plan
    (``plan_attention`` without a window), shared by every layer. An FP8 cache is read as
    ``stored * kv_scale``."""
    if q.dim() != 3 or q.shape[2] != cache.shape[-1]:
        raise ValueError(f"q must be [num_tokens, num_heads, {cache.shape[-1]}], got {tuple(q.shape)}")
    if q.shape[0] and q.stride(2) != 1:
        raise ValueError(f"q must have a contiguous last dim, got strides {q.stride()}")
    if not 0 < kv_lora_rank < cache.shape[-1]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must lie in (0, {cache.shape[-1]})")
    _check_float_dtype("q", q)
    _check_latent_cache(cache, q.dtype, kv_scale)
    _check_batch(block_tables, seq_lens, query_start_loc)
    _check_same_device({"cache": cache, "block_tables": block_tables, "seq_lens": seq_lens,
                        "query_start_loc": query_start_loc}, q.device)  # fmt: skip
    backend = _resolve(impl, q.device)
    args = (q, cache, block_tables, seq_lens, query_start_loc, float(scale), kv_lora_rank)
    if backend == "reference":
        return mla_absorbed_ref(*args, float(kv_scale))
    if backend == "triton":
        from pdserve.engine.kernels.mla_triton import mla_attention_triton  # lazy: triton is optional

        return mla_attention_triton(*args, float(kv_scale))
    return _absorbed_torch(*args, plan, float(kv_scale))


def _bottom_right_causal(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def _absorbed_torch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, rank: int, plan: TorchAttentionPlan | None,
                    kv_scale: float) -> torch.Tensor:  # fmt: skip
    """Decodes batched per length group (one SDPA each, K = the gathered rows, V = their latent
    part, every head against the one row); a prefill's rows attend its whole gathered sequence."""
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, cache.shape[1])
    out = q.new_zeros((*q.shape[:2], rank))
    for group in plan.decode_groups:
        rows = _read(_gather(cache, group, 0), q.dtype, kv_scale).transpose(1, 2)  # [B, 1, padded, D]
        qg = (q if group.all_rows else q[group.rows]).unsqueeze(1)  # [B, 1, H, D]
        o = F.scaled_dot_product_attention(qg, rows, rows[..., :rank], attn_mask=group.mask, scale=scale)
        if group.all_rows:
            out[: o.shape[0]] = o.squeeze(1)
        else:
            out.index_copy_(0, group.rows, o.squeeze(1))
    for s, start, seq_len in plan.prefills:
        end = plan.starts[s + 1]
        rows = _read(_gather_seq(cache, block_tables[s], 0, seq_len), q.dtype, kv_scale).transpose(0, 1)[None]
        mask = _bottom_right_causal(end - start, seq_len, q.device)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], rows, rows[..., :rank],
                                           attn_mask=mask, scale=scale, enable_gqa=True)  # fmt: skip
        out[start:end] = o[0].transpose(0, 1)
    return out


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv_b: torch.Tensor) -> torch.Tensor:
    """The absorbed form's query ``[q_nope @ W_UK | q_pe]``: ``[num_tokens, H, kv_lora_rank + rope_dim]``."""
    return torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_kv_b[:, : q_nope.shape[2]]), q_pe], dim=-1)


def expand_latent(latent: torch.Tensor, w_kv_b: torch.Tensor, nope: int) -> torch.Tensor:
    """Per-head latents through ``W_UV``: ``[num_tokens, H, v_head_dim]``."""
    return torch.einsum("nhr,hvr->nhv", latent, w_kv_b[:, nope:])


def _check_naive(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_kv_b: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 kv_scale: float) -> None:  # fmt: skip
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope/q_pe must be [num_tokens, H, *] alike, got {tuple(q_nope.shape)}/{tuple(q_pe.shape)}")
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = cache.shape[-1] - q_pe.shape[2]
    if w_kv_b.dim() != 3 or w_kv_b.shape[0] != heads or w_kv_b.shape[2] != rank or w_kv_b.shape[1] <= nope:
        raise ValueError(f"w_kv_b must be [{heads}, {nope} + v_head_dim, {rank}], got {tuple(w_kv_b.shape)}")
    _check_float_dtype("q_nope", q_nope)
    for name, t in (("q_pe", q_pe), ("w_kv_b", w_kv_b)):
        _check_float_dtype(name, t, q_nope.dtype)
    _check_latent_cache(cache, q_nope.dtype, kv_scale)
    _check_batch(block_tables, seq_lens, query_start_loc)
    _check_same_device({"q_pe": q_pe, "cache": cache, "w_kv_b": w_kv_b, "block_tables": block_tables,
                        "seq_lens": seq_lens, "query_start_loc": query_start_loc}, q_nope.device)  # fmt: skip


def mla_attention_naive(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    impl: str | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Decompressed MLA (see :func:`engine.kernels.mla_reference.mla_naive_ref` for the contract):
    each sequence's latents are mapped through ``w_kv_b [H, nope + v_head_dim, kv_lora_rank]`` to
    per-head K/V every call. Returns ``[num_tokens, H, v_head_dim]`` in ``q_nope.dtype``. ``impl``:
    ``None``/``"torch"`` (any device) or ``"reference"``; this form has no Triton kernel."""
    _check_naive(q_nope, q_pe, cache, w_kv_b, block_tables, seq_lens, query_start_loc, kv_scale)
    if impl == "reference":
        return mla_naive_ref(q_nope, q_pe, cache, w_kv_b, block_tables, seq_lens, query_start_loc, float(scale),
                             float(kv_scale))  # fmt: skip
    if impl not in (None, "torch"):
        raise ValueError(f"impl must be 'torch', 'reference' or None for the naive form, got {impl!r}")
    out = q_nope.new_zeros((*q_nope.shape[:2], w_kv_b.shape[1] - q_nope.shape[2]))
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    _naive_torch(q_nope, q_pe, cache, w_kv_b, block_tables, starts, lens, float(scale), float(kv_scale),
                 range(len(lens)), out)  # fmt: skip
    return out


@dataclass(frozen=True)
class MixedPlan:
    """How a mixed step splits, built once per step (one host read of its lengths) and shared by
    every layer: decodes go absorbed as one sub-batch (its rows, block tables, lengths, and the torch
    path's plan on the CPU), prefills and chunks decompressed per sequence."""

    starts: list[int]
    lens: list[int]
    prefills: list[int]
    decode_rows: torch.Tensor | None  # int64 query rows of the decodes; None without decodes
    decode_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # block tables, seq lens, query starts
    decode_torch_plan: TorchAttentionPlan | None


def plan_mixed(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
               block_size: int | None = None) -> MixedPlan:  # fmt: skip
    """The :class:`MixedPlan` of one step (``block_size``: the cache's, for the torch path's decode
    plan on the CPU; None skips it)."""
    _check_batch(block_tables, seq_lens, query_start_loc)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    prefills = [s for s in range(len(lens)) if starts[s + 1] - starts[s] > 1]
    if not decodes:
        return MixedPlan(starts, lens, prefills, None, None, None)
    device = seq_lens.device
    rows = torch.tensor([starts[s] for s in decodes], dtype=torch.int64, device=device)
    seqs = torch.tensor(decodes, dtype=torch.int64, device=device)
    batch = (block_tables[seqs].contiguous(), seq_lens[seqs].contiguous(),
             torch.arange(len(decodes) + 1, dtype=torch.int32, device=device))  # fmt: skip
    torch_plan = plan_attention(*batch, block_size) if block_size is not None and device.type == "cpu" else None
    return MixedPlan(starts, lens, prefills, rows, batch, torch_plan)


def mla_attention_mixed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    impl: str | None = None,
    kv_scale: float = 1.0,
    plan: MixedPlan | None = None,
) -> torch.Tensor:
    """Each sequence in the form that suits it: decodes (one query) absorbed, through
    :func:`mla_attention` with ``impl``; prefills and chunks decompressed. Same contract and result
    as :func:`mla_attention_naive`. ``plan``: ``plan_mixed`` of this batch, shared by every layer of
    the step; without it one is built here (a host read of the lengths)."""
    _check_naive(q_nope, q_pe, cache, w_kv_b, block_tables, seq_lens, query_start_loc, kv_scale)
    if plan is None:
        plan = plan_mixed(block_tables, seq_lens, query_start_loc, cache.shape[1])
    elif len(plan.lens) != seq_lens.shape[0] or len(plan.starts) != query_start_loc.shape[0]:
        raise ValueError(f"the plan is for {len(plan.lens)} sequences, the batch has {seq_lens.shape[0]}")
    nope, rank = q_nope.shape[2], w_kv_b.shape[2]
    out = q_nope.new_zeros((*q_nope.shape[:2], w_kv_b.shape[1] - nope))
    if plan.decode_rows is not None and plan.decode_batch is not None:
        rows = plan.decode_rows
        latent = mla_attention(absorb_query(q_nope[rows], q_pe[rows], w_kv_b).contiguous(), cache, *plan.decode_batch,
                               scale, rank, impl=impl, plan=plan.decode_torch_plan, kv_scale=kv_scale)  # fmt: skip
        out[rows] = expand_latent(latent, w_kv_b, nope)
    _naive_torch(q_nope, q_pe, cache, w_kv_b, block_tables, plan.starts, plan.lens, float(scale), float(kv_scale),
                 plan.prefills, out)  # fmt: skip
    return out


def _naive_torch(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_kv_b: torch.Tensor,
                 block_tables: torch.Tensor, starts: list[int], lens: list[int], scale: float, kv_scale: float,
                 seqs: Iterable[int], out: torch.Tensor) -> None:  # fmt: skip
    """Decompressed attention of sequences ``seqs`` into their rows of ``out``."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = w_kv_b.shape[2]
    v_dim = w_kv_b.shape[1] - nope
    w_flat = w_kv_b.reshape(-1, rank)  # [H * (nope + v), rank]
    for s in seqs:
        start, end, seq_len = starts[s], starts[s + 1], lens[s]
        if end == start:
            continue
        rows = _read(_gather_seq(cache, block_tables[s], 0, seq_len)[:, 0], q_nope.dtype, kv_scale)  # [L, rank + rope]
        kv = F.linear(rows[:, :rank], w_flat).view(seq_len, heads, nope + v_dim).transpose(0, 1)  # [H, L, .]
        k = torch.cat([kv[..., :nope], rows[None, :, rank:].expand(heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).transpose(0, 1)  # [H, q_len, D]
        if end - start == seq_len:
            o = F.scaled_dot_product_attention(q, k, kv[..., nope:], is_causal=True, scale=scale)
        else:
            mask = _bottom_right_causal(end - start, seq_len, q.device)
            o = F.scaled_dot_product_attention(q, k, kv[..., nope:], attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
