"""Plain-torch references for multi-head latent attention (MLA) over a paged latent cache.

A latent cache row (one token of one layer) is ``[kv_lora_rank latent | qk_rope_head_dim rotary
key]``; caches are ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]``. Batch semantics are
those of :class:`engine.kernels.metadata.AttentionMetadata`. Both forms loop over sequences and
compute in float32; tests hold the fast paths to them and each form to the other. An FP8 cache
stores ``quantize(row, kv_scale)`` (:mod:`engine.kernels.quant`) and is read as ``stored * kv_scale``.

* naive: every visible token's latent is decompressed through ``W_UK``/``W_UV`` (the rows of
  ``kv_b_proj``) to per-head K and V, then standard attention;
* absorbed: ``W_UK`` is folded into the query beforehand (``q_latent = q_nope @ W_UK``), so
  attention runs on the latents themselves (K = the cache row, V = its latent part) and returns
  per-head latents for the caller to map through ``W_UV``.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels.quant import dequantize, is_fp8, quantize
from pdserve.engine.kernels.reference import gather_seq_kv


def write_latent_ref(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_scale: float = 1.0) -> None:  # fmt: skip
    """Write ``latent [num_tokens, D]`` rows to their slots (``-1`` skips a token)."""
    block_size = cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            block_id, offset = divmod(slot, block_size)
            row = quantize(latent[t], kv_scale, cache.dtype) if is_fp8(cache.dtype) else latent[t]
            cache[block_id, offset, 0] = row


def _rows(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int, kv_scale: float) -> torch.Tensor:
    """A sequence's cache rows ``[seq_len, D]`` in float32 (dequantized)."""
    return dequantize(gather_seq_kv(cache, table_row, seq_len)[:, 0], kv_scale, torch.float32)


def _causal_softmax(scores: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Softmax of ``scores [H, q_len, seq_len]`` over the positions each query may see."""
    q_len = scores.shape[1]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=scores.device)
    k_pos = torch.arange(seq_len, device=scores.device)
    return torch.softmax(scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf")), dim=-1)


def _sequences(seq_lens: torch.Tensor, query_start_loc: torch.Tensor):
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        if starts[s + 1] > starts[s]:
            if starts[s + 1] - starts[s] > seq_len:
                raise ValueError(f"sequence {s}: q_len {starts[s + 1] - starts[s]} > seq_len {seq_len}")
            yield s, starts[s], starts[s + 1], seq_len


def mla_naive_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Decompressed MLA: ``[num_tokens, H, v_head_dim]`` in ``q_nope.dtype``.

    Args:
        q_nope: ``[num_tokens, H, qk_nope_head_dim]``; q_pe: ``[num_tokens, H, rope_dim]`` (rotated).
        w_kv_b: ``[H, qk_nope_head_dim + v_head_dim, kv_lora_rank]``: per head, ``W_UK`` rows then ``W_UV`` rows.
    """
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = w_kv_b.shape[2]
    w = w_kv_b.float()
    out = torch.zeros((*q_nope.shape[:2], w_kv_b.shape[1] - nope), dtype=torch.float32, device=q_nope.device)
    for s, start, end, seq_len in _sequences(seq_lens, query_start_loc):
        rows = _rows(cache, block_tables[s], seq_len, kv_scale)  # [L, rank + rope]
        kv = torch.einsum("lr,hdr->hld", rows[:, :rank], w)  # [H, L, nope + v]
        k = torch.cat([kv[..., :nope], rows[None, :, rank:].expand(num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).float().transpose(0, 1)  # [H, q_len, D]
        probs = _causal_softmax((q @ k.transpose(1, 2)) * scale, seq_len)
        out[start:end] = (probs @ kv[..., nope:]).transpose(0, 1)
    return out.to(q_nope.dtype)


def mla_absorbed_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Absorbed MLA: ``q [num_tokens, H, kv_lora_rank + rope_dim]`` (``q_nope @ W_UK`` then the
    rotated ``q_pe``) against the cache rows; returns per-head latents ``[num_tokens, H,
    kv_lora_rank]`` in ``q.dtype`` (rows owned by no sequence are zero)."""
    out = torch.zeros((*q.shape[:2], kv_lora_rank), dtype=torch.float32, device=q.device)
    for s, start, end, seq_len in _sequences(seq_lens, query_start_loc):
        rows = _rows(cache, block_tables[s], seq_len, kv_scale)  # [L, D]
        qs = q[start:end].float().transpose(0, 1)  # [H, q_len, D]
        probs = _causal_softmax((qs @ rows.T) * scale, seq_len)
        out[start:end] = (probs @ rows[:, :kv_lora_rank]).transpose(0, 1)
    return out.to(q.dtype)
