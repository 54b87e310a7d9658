"""Multi-head latent attention (MLA) over a paged latent cache: host wrappers and the torch paths.

The cache of one layer is ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]`` (a strided
view of the block-major KV tensor; inner dims contiguous); see :mod:`engine.kernels.mla_reference`
for the two forms and their references.

* :func:`write_latent`: scatter this step's rows into their slots (one ``index_put_`` on any device);
* :func:`mla_attention`: the absorbed form (decode): ``impl`` ``None`` picks Triton on CUDA and
  torch elsewhere, as in :mod:`engine.kernels.ops`; ``"reference"`` is the float32 loop;
* :func:`mla_attention_naive`: the decompressed form (prefill, and the baseline the benchmark
  compares decode against): torch on every device, or ``"reference"``.

Validation never reads tensor values (no device sync); the caller guarantees in-range slots,
block ids and lengths, as for :func:`engine.kernels.paged_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.kernels.mla_reference import mla_absorbed_ref, mla_naive_ref, write_latent_ref
from pdserve.engine.kernels.ops import _check_cache, _check_float_dtype, _check_int_vector, _check_same_device
from pdserve.engine.kernels.ops import _resolve_impl as _resolve
from pdserve.engine.kernels.torch_paged import TorchAttentionPlan, _gather, _gather_seq, plan_attention


def _check_latent_cache(cache: torch.Tensor, dtype: torch.dtype) -> None:
    _check_cache("cache", cache)
    if cache.shape[2] != 1:
        raise ValueError(f"an MLA cache has one row per token ([num_blocks, block_size, 1, D]), got {tuple(cache.shape)}")
    _check_float_dtype("cache", cache, dtype)


def _check_batch(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")  # fmt: skip
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have a contiguous last dim, got strides {block_tables.stride()}")
    _check_int_vector("seq_lens", seq_lens, torch.int32, block_tables.shape[0])
    _check_int_vector("query_start_loc", query_start_loc, torch.int32, block_tables.shape[0] + 1)


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, impl: str | None = None) -> None:
    """Write ``latent [num_tokens, D]`` (``[c_kv | rotated k_pe]``, the cache's dtype) into
    ``cache`` at ``slot_mapping`` (int64, ``block_id * block_size + offset``; ``-1`` skips)."""
    if latent.dim() != 2 or latent.shape[1] != cache.shape[-1]:
        raise ValueError(f"latent must be [num_tokens, {cache.shape[-1]}], got {tuple(latent.shape)}")
    _check_latent_cache(cache, latent.dtype)
    _check_int_vector("slot_mapping", slot_mapping, torch.int64, latent.shape[0])
    _check_same_device({"latent": latent, "slot_mapping": slot_mapping}, cache.device)
    if impl == "reference":
        write_latent_ref(latent, cache, slot_mapping)
        return
    if impl not in (None, "torch", "triton"):
        raise ValueError(f"impl must be 'torch', 'triton', 'reference' or None, got {impl!r}")
    valid = slot_mapping >= 0
    if not bool(valid.all()):  # -1 slots (rare): drop them (one sync, as the K/V write does)
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
) -> torch.Tensor:
    """Absorbed MLA over a mixed batch: ``q [num_tokens, H, kv_lora_rank + rope_dim]``; returns
    the per-head latents ``[num_tokens, H, kv_lora_rank]`` (``softmax(q·row * scale) @ latent``)
    in ``q.dtype``; rows owned by no sequence are zero. ``plan``: the torch path's step plan
    (``plan_attention`` without a window), shared by every layer."""
    if q.dim() != 3 or q.shape[2] != cache.shape[-1]:
        raise ValueError(f"q must be [num_tokens, num_heads, {cache.shape[-1]}], got {tuple(q.shape)}")
    if q.shape[0] and q.stride(2) != 1:
        raise ValueError(f"q must have a contiguous last dim, got strides {q.stride()}")
    if not 0 < kv_lora_rank < cache.shape[-1]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must lie in (0, {cache.shape[-1]})")
    _check_float_dtype("q", q)
    _check_latent_cache(cache, q.dtype)
    _check_batch(block_tables, seq_lens, query_start_loc)
    _check_same_device({"cache": cache, "block_tables": block_tables, "seq_lens": seq_lens,
                        "query_start_loc": query_start_loc}, q.device)  # fmt: skip
    backend = _resolve(impl, q.device)
    if backend == "reference":
        return mla_absorbed_ref(q, cache, block_tables, seq_lens, query_start_loc, float(scale), kv_lora_rank)
    if backend == "triton":
        from pdserve.engine.kernels.mla_triton import mla_attention_triton  # lazy: triton is optional

        return mla_attention_triton(q, cache, block_tables, seq_lens, query_start_loc, float(scale), kv_lora_rank)
    return _absorbed_torch(q, cache, block_tables, query_start_loc, seq_lens, float(scale), kv_lora_rank, plan)


def _bottom_right_causal(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def _absorbed_torch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, rank: int, plan: TorchAttentionPlan | None) -> torch.Tensor:  # fmt: skip
    """Decodes batched per length group (one SDPA each, K = the gathered rows, V = their latent
    part, every head against the one row); a prefill's rows attend its whole gathered sequence."""
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, cache.shape[1])
    out = q.new_zeros((*q.shape[:2], rank))
    for group in plan.decode_groups:
        rows = _gather(cache, group, 0).transpose(1, 2)  # [B, 1, padded, D]
        qg = (q if group.all_rows else q[group.rows]).unsqueeze(1)  # [B, 1, H, D]
        o = F.scaled_dot_product_attention(qg, rows, rows[..., :rank], attn_mask=group.mask, scale=scale)
        if group.all_rows:
            out[: o.shape[0]] = o.squeeze(1)
        else:
            out.index_copy_(0, group.rows, o.squeeze(1))
    for s, start, seq_len in plan.prefills:
        end = plan.starts[s + 1]
        rows = _gather_seq(cache, block_tables[s], 0, seq_len).transpose(0, 1)[None]  # [1, 1, L, D]
        mask = _bottom_right_causal(end - start, seq_len, q.device)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], rows, rows[..., :rank],
                                           attn_mask=mask, scale=scale, enable_gqa=True)  # fmt: skip
        out[start:end] = o[0].transpose(0, 1)
    return out


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
) -> torch.Tensor:
    """Decompressed MLA (see :func:`engine.kernels.mla_reference.mla_naive_ref` for the contract):
    each sequence's latents are mapped through ``w_kv_b [H, nope + v_head_dim, kv_lora_rank]`` to
    per-head K/V every call. Returns ``[num_tokens, H, v_head_dim]`` in ``q_nope.dtype``."""
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope/q_pe must be [num_tokens, H, *] alike, got {tuple(q_nope.shape)}/{tuple(q_pe.shape)}")
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = cache.shape[-1] - q_pe.shape[2]
    if w_kv_b.dim() != 3 or w_kv_b.shape[0] != heads or w_kv_b.shape[2] != rank or w_kv_b.shape[1] <= nope:
        raise ValueError(f"w_kv_b must be [{heads}, {nope} + v_head_dim, {rank}], got {tuple(w_kv_b.shape)}")
    _check_float_dtype("q_nope", q_nope)
    for name, t in (("q_pe", q_pe), ("w_kv_b", w_kv_b)):
        _check_float_dtype(name, t, q_nope.dtype)
    _check_latent_cache(cache, q_nope.dtype)
    _check_batch(block_tables, seq_lens, query_start_loc)
    _check_same_device({"q_pe": q_pe, "cache": cache, "w_kv_b": w_kv_b, "block_tables": block_tables,
                        "seq_lens": seq_lens, "query_start_loc": query_start_loc}, q_nope.device)  # fmt: skip
    if impl == "reference":
        return mla_naive_ref(q_nope, q_pe, cache, w_kv_b, block_tables, seq_lens, query_start_loc, float(scale))
    if impl not in (None, "torch", "triton"):
        raise ValueError(f"impl must be 'torch', 'reference' or None, got {impl!r}")
    v_dim = w_kv_b.shape[1] - nope
    w_flat = w_kv_b.reshape(-1, rank)  # [H * (nope + v), rank]
    out = q_nope.new_zeros((*q_nope.shape[:2], v_dim))
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        rows = _gather_seq(cache, block_tables[s], 0, seq_len)[:, 0]  # [L, rank + rope]
        kv = F.linear(rows[:, :rank], w_flat).view(seq_len, heads, nope + v_dim).transpose(0, 1)  # [H, L, .]
        k = torch.cat([kv[..., :nope], rows[None, :, rank:].expand(heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).transpose(0, 1)  # [H, q_len, D]
        if end - start == seq_len:
            o = F.scaled_dot_product_attention(q, k, kv[..., nope:], is_causal=True, scale=scale)
        else:
            mask = _bottom_right_causal(end - start, seq_len, q.device)
            o = F.scaled_dot_product_attention(q, k, kv[..., nope:], attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
