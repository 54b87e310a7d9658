"""Plain-torch reference implementations of the KV write and paged attention.

These are written for clarity, not speed: they loop over tokens and sequences and
compute attention in float32. Tests compare the Triton and vectorised torch paths
against them. Semantics follow :class:`engine.kernels.metadata.AttentionMetadata`.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels.quant import dequantize, is_fp8, quantize


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its cache slot, in place (quantized for an FP8 cache).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (may be
            strided views into a larger block-major tensor).
        slot_mapping: int64 ``[num_tokens]``; slot ``= block_id * block_size + offset``,
            ``-1`` means the token is not written.
    """
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        if is_fp8(k_cache.dtype):
            k_cache[block_id, offset] = quantize(key[t], k_scale, k_cache.dtype)
            v_cache[block_id, offset] = quantize(value[t], v_scale, v_cache.dtype)
        else:
            k_cache[block_id, offset] = key[t]
            v_cache[block_id, offset] = value[t]


def gather_seq_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Return the first ``seq_len`` logical positions of one sequence's K or V.

    ``cache`` is ``[num_blocks, block_size, H, D]``; the result is ``[seq_len, H, D]``.
    """
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention over a flattened mixed batch, computed in float32 (an FP8 cache
    is read as ``stored * k_scale`` / ``stored * v_scale``).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; sequence ``s`` owns rows
            ``query_start_loc[s]:query_start_loc[s+1]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` with
            ``num_heads % num_kv_heads == 0`` (query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``).
        block_tables: int ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: int ``[num_seqs]``: KV length of each sequence including this step.
        query_start_loc: int ``[num_seqs + 1]``.
        scale: softmax scale applied to ``q @ k^T``.
        sliding_window: if set, a query at position ``p`` sees only the last
            ``sliding_window`` positions ``(p - sliding_window, p]`` (Mistral).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``. Query row ``j`` of
        sequence ``s`` sits at position ``seq_lens[s] - q_len + j`` and attends to KV
        positions ``<=`` that. Rows not owned by any sequence are zero.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {s}: q_len {q_len} > seq_len {seq_len}")
        k = dequantize(gather_seq_kv(k_cache, block_tables[s], seq_len), k_scale, torch.float32)  # [L, Hkv, D]
        v = dequantize(gather_seq_kv(v_cache, block_tables[s], seq_len), v_scale, torch.float32)
        # Expand KV heads so that query head h uses KV head h // group.
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        scores = (qs @ k.transpose(1, 2)) * scale  # [H, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = (probs @ v).transpose(0, 1)
    return out.to(q.dtype)
