"""Triton kernels for MLA: absorbed attention over a paged latent cache, and the latent write.

Launched by :mod:`engine.kernels.mla` after validation. An attention program owns one query token
and ``BLOCK_H`` (16) of its heads: those heads read the same cache rows, so each row tile is loaded
once for all 16 (a 128-head model reads a token's context 8 times, against 128 times for MHA; there
is no split of long contexts across programs yet). Scores are ``q_latent · latent + q_pe · k_pe`` (two dots, so
``kv_lora_rank`` and the rotary dim are padded to powers of two separately: 512 + 64 stays
512 + 64, not 1024), the online softmax runs in float32 in the exp2 domain, and the output is
``softmax @ latent``, the per-head latents the caller maps through ``W_UV``.

A program finds its sequence by binary search over ``query_start_loc`` (no host-side tables);
KV positions are visited in tiles of ``BLOCK_N``, each position's block looked up in the block
table, so ``BLOCK_N`` need not equal the block size. Runs on CUDA, and on CPU tensors under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pdserve.engine.kernels.quant import is_fp8

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity": exp2(-big - m) is 0, never NaN


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, num_heads, qk_scale, kv_scale,
    stride_qt, stride_qh, stride_cb, stride_co, stride_ot, stride_oh, stride_bt,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head0 = tl.program_id(1) * BLOCK_H
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return  # a padding row: the output stays zero
    # Largest s with query_start_loc[s] <= token (empty sequences share their start with the next).
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.zeros((), dtype=tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        take = tl.load(query_start_loc_ptr + mid) <= token
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    seq = lo
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    pos = tl.load(seq_lens_ptr + seq) - (q_end - token)  # this query's position: it sees [0, pos]

    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_ok = offs_h < num_heads
    l_ok = offs_l < RANK
    r_ok = offs_r < ROPE
    q_row = q_ptr + token.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.zeros((BLOCK_H,), dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, pos + 1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n <= pos
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = cache_ptr + block * stride_cb + (offs_n % BLOCK_SIZE) * stride_co  # [BLOCK_N]
        lat = tl.load(row[:, None] + offs_l[None, :], mask=n_ok[:, None] & l_ok[None, :], other=0.0)
        # The rotary part loaded transposed [BLOCK_R, BLOCK_N] for q_pe @ k_pe^T.
        k_pe = tl.load(row[None, :] + RANK + offs_r[:, None], mask=n_ok[None, :] & r_ok[:, None], other=0.0)
        if KV_FP8:  # dequantized to the query's dtype; kv_scale is folded into qk_scale and the output
            lat = lat.to(q_ptr.dtype.element_ty)
            k_pe = k_pe.to(q_ptr.dtype.element_ty)
        if DOT_F32:
            lat = lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
        s += tl.dot(q_pe, k_pe, input_precision="ieee")
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision="ieee")
        m_i = m_new
    acc = acc * (kv_scale / l_i[:, None])
    out = out_ptr + token.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])


_INTERPRETED = isinstance(_mla_decode_kernel, InterpretedFunction)
# Heads per program and KV positions per tile. tl.dot needs every dimension >= 16 on GPUs (padded
# lanes are masked); 16 heads keep the [heads, kv_lora_rank] query and accumulator in registers
# at DeepSeek's 512-wide latent.
MLA_BLOCK_H = 16
MLA_BLOCK_N = 16


def mla_pad(dim: int) -> int:
    """A latent or rotary width padded to a power of two of at least 16."""
    return max(16, triton.next_power_of_2(dim))


@triton.jit
def _write_latent_kernel(latent_ptr, cache_ptr, slot_mapping_ptr, stride_lt, stride_cb, stride_co,
                         DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # -1: not written (no host sync to filter these out)
    offs = tl.arange(0, BLOCK_D)
    row = tl.load(latent_ptr + token.to(tl.int64) * stride_lt + offs, mask=offs < DIM)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    tl.store(dst + offs, row, mask=offs < DIM)


def write_latent_triton(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See :func:`engine.kernels.mla.write_latent` (inputs validated there)."""
    if latent.shape[0] == 0:
        return
    dim = latent.shape[1]
    _write_latent_kernel[(latent.shape[0],)](
        latent, cache, slot_mapping, latent.stride(0), cache.stride(0), cache.stride(1),
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_SIZE=cache.shape[1],
    )  # fmt: skip


def mla_attention_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """See :func:`engine.kernels.mla.mla_attention` (inputs validated there)."""
    num_tokens, num_heads, dim = q.shape
    out = torch.zeros((num_tokens, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or block_tables.shape[0] == 0:
        return out
    rope = dim - kv_lora_rank
    block_h = MLA_BLOCK_H
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _mla_decode_kernel[grid](
        q, cache, out, block_tables, seq_lens, query_start_loc,
        block_tables.shape[0], num_heads, scale * kv_scale * _LOG2E, kv_scale,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        RANK=kv_lora_rank, ROPE=rope, BLOCK_SIZE=cache.shape[1], BLOCK_H=block_h,
        BLOCK_L=mla_pad(kv_lora_rank), BLOCK_R=mla_pad(rope), BLOCK_N=MLA_BLOCK_N,
        # The CPU interpreter's bfloat16 dot is wrong: interpreted, dots run in float32.
        DOT_F32=q.dtype == torch.float32 or _INTERPRETED, KV_FP8=is_fp8(cache.dtype),
    )  # fmt: skip
    return out
