"""Vectorised torch implementations of the KV write and paged attention (CPU serving path).

Inputs are assumed validated by :mod:`engine.kernels.ops`. Semantics match
:mod:`engine.kernels.reference`, but attention runs in the input dtype through
``scaled_dot_product_attention`` (which accumulates in float32 internally).

Strategy: all decode sequences (``q_len == 1``) go through ONE batched SDPA call over
K/V gathered into a padded ``[B, max_len]`` layout, with the GQA group folded into
the query-length axis (``[B, Hkv, group, D]`` queries need no KV head expansion and
hit the fast SDPA kernels on CPU; ``enable_gqa`` falls back to a slow path for
``q_len == 1`` in bf16). Prefill sequences run one SDPA call each: their cost is
dominated by compute, so the Python loop is negligible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots in place; ``-1`` slots are skipped."""
    if key.shape[0] == 0:
        return
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    # The caches are strided views (block stride != block_size * H * D), so no flat
    # slot view exists; a (block, offset) index pair addresses them directly.
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k_cache.index_put_((blocks, offsets), key)
    v_cache.index_put_((blocks, offsets), value)


def _gather_padded(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Gather ``[B, max_len_padded, H, D]`` K or V for the sequences of ``block_tables``.

    Positions past a sequence's length are zeroed (never-written cache memory may
    hold NaN, and a zero probability times a NaN value is still NaN), but the
    caller must still mask them out of the softmax. Table entries past a sequence's last block
    are replaced by block 0 so stale or sentinel ids cannot index out of range.
    """
    block_size = cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    needed = (seq_lens.long() + block_size - 1) // block_size
    in_use = torch.arange(num_blocks, device=table.device)[None, :] < needed[:, None]
    table = torch.where(in_use, table, torch.zeros_like(table))
    # index_select is several times faster than advanced indexing (cache[table]) on CPU.
    gathered = cache.index_select(0, table.view(-1))  # fresh contiguous [B*num_blocks, block_size, H, D]
    rows = gathered.view(table.shape[0] * num_blocks * block_size, -1)
    positions = torch.arange(num_blocks * block_size, device=table.device)
    pad = (positions[None, :] >= seq_lens.long()[:, None]).view(-1).nonzero().view(-1)
    # Only the padded rows are touched, not a full masked pass over K/V.
    rows.index_fill_(0, pad, 0)
    return gathered.view(table.shape[0], num_blocks * block_size, *cache.shape[2:])


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention for ``B`` single-token queries ``q [B, Hq, D]``; returns ``[B, Hq, D]``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = _gather_padded(k_cache, block_tables, seq_lens, max_len).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_padded(v_cache, block_tables, seq_lens, max_len).transpose(1, 2)
    # Pad positions were zeroed by the gather; the mask drops them from the softmax.
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < seq_lens.to(q.device)[:, None]).view(batch, 1, 1, -1)
    # Query heads h*group .. h*group+group-1 share KV head h: fold them into q_len.
    qg = q.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention for one sequence's ``q [q_len, Hq, D]`` (its last ``q_len`` positions)."""
    q_len = q.shape[0]
    lens = torch.tensor([seq_len], device=q.device)
    k = _gather_padded(k_cache, block_table_row[None], lens, seq_len)[0, :seq_len].transpose(0, 1)
    v = _gather_padded(v_cache, block_table_row[None], lens, seq_len)[0, :seq_len].transpose(0, 1)
    qh = q.transpose(0, 1)  # [Hq, q_len, D]
    context_len = seq_len - q_len
    if context_len == 0:
        # Square causal mask: SDPA's built-in causal path skips masked blocks.
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # is_causal aligns the diagonal top-left; cached context needs it bottom-right.
        q_pos = torch.arange(context_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see ``reference.paged_attention_ref``.

    Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``; rows owned by no
    sequence are zero.
    """
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    # Batch structure on the host: this path serves CPU tensors, so .tolist() is cheap.
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[s + 1] - starts[s] for s in range(num_seqs)]

    decode = [s for s in range(num_seqs) if q_lens[s] == 1]
    if decode:
        if len(decode) == num_seqs:
            # Hot path: a pure decode batch needs no index selection at all.
            rows = query_start_loc[:-1].long()
            tables, dec_lens = block_tables, seq_lens
        else:
            idx = torch.tensor(decode, device=q.device)
            rows = query_start_loc[idx].long()
            tables, dec_lens = block_tables[idx], seq_lens[idx]
        max_len = max(lens[s] for s in decode)
        dec_out = _decode_batch(q[rows], k_cache, v_cache, tables, dec_lens, max_len, scale)
        out.index_copy_(0, rows, dec_out)

    for s in range(num_seqs):
        if q_lens[s] > 1:
            start, end = starts[s], starts[s + 1]
            out[start:end] = _prefill_one(q[start:end], k_cache, v_cache, block_tables[s], lens[s], scale)
    return out
