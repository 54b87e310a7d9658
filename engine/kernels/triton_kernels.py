"""Triton kernels: KV-cache write and unified paged attention for mixed batches.

The launchers here assume their inputs were validated by :mod:`engine.kernels.ops`
(shapes, dtypes, devices, inner-dim contiguity). They run on CUDA, and on CPU tensors
under ``TRITON_INTERPRET=1`` (which must be set before triton is imported).

Paged attention design
----------------------
One launch handles a whole mixed batch (prefill, chunked prefill with cached
context, decode). A program owns one *query tile* of one sequence and one KV head:
``BLOCK_M`` rows, each row a (query token, query head) pair, packing the ``GROUP``
query heads that share the KV head next to each other. So a decode token with
GQA ratio 4 fills 4 rows of one tile instead of wasting 15 of 16 rows, and each
K/V tile is loaded once for the whole group.

Query tiles are numbered over the flattened batch: sequence ``s`` owns tile ids
starting at ``query_start_loc[s] // BLOCK_Q + s``. That start is strictly
increasing and leaves room for ``cdiv(q_len, BLOCK_Q)`` tiles, so the grid is just
``num_tokens // BLOCK_Q + num_seqs`` and a program finds its sequence by binary
search, with no host-side tile list (no device->host sync).

KV is visited in tiles of ``BLOCK_N`` logical positions, each position's physical
block looked up in the block table, so ``BLOCK_N`` need not equal the block size.
Tiles entirely above the causal diagonal are never visited; tiles entirely below it
skip the mask. Softmax is online (running max/sum in float32, exp2 domain).

For decode batches too small to fill the GPU the KV range can be split into
``NUM_SEGMENTS`` segments (flash-decoding): each program writes a partial
(max, sum, acc) and a second kernel merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pdserve.engine.kernels.quant import fp8_grid, fp8_max, is_fp8

_LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: a row whose first visited tile is
# fully masked then yields exp2(-inf - m) = 0 instead of NaN from (-inf) - (-inf).
_NEG_BIG = tl.constexpr(-1.0e30)  # constexpr: compiled kernels may read no other globals


# --------------------------------------------------------------------------- KV write


@triton.jit
def _round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x`` (float32, within the format's range) rounded to the nearest value of an FP8 grid
    (ties to even), still as float32: the cast that follows is then exact. Rounding here, not
    in the cast, gives one result everywhere (Triton's interpreter rounds some values that
    carry into the next binade wrongly)."""
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)  # subnormals share the smallest normal's step
    step = ((exp - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** (exp - MANT_BITS)
    y = x / step  # exact: a power of two
    return ((y + 12582912.0) - 12582912.0) * step  # 1.5 * 2**23: float32 addition rounds to an integer, ties to even


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    num_kv_heads,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    """Copy token ``program_id(0)``'s K and V (all heads) into its cache slot; with ``FP8_MAX``
    (an FP8 cache) as ``clamp(x / scale, -FP8_MAX, FP8_MAX)``, computed in float32."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # A skipped token (slot -1) masks out every head: branch-free, and avoids mixing a
    # scalar boolean into a block mask (the interpreter mis-types that combination).
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < heads_to_write) & (d < HEAD_DIM)

    k = tl.load(key_ptr + t * stride_key_t + h * stride_key_h + d, mask=mask)
    v = tl.load(value_ptr + t * stride_value_t + h * stride_value_h + d, mask=mask)
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
        k = _round_to_fp8_grid(k, FP8_MANT_BITS, FP8_MIN_EXP).to(k_cache_ptr.dtype.element_ty)
        v = _round_to_fp8_grid(v, FP8_MANT_BITS, FP8_MIN_EXP).to(v_cache_ptr.dtype.element_ty)
    # int64 block offset: block * stride overflows int32 for large caches.
    tl.store(k_cache_ptr + block * stride_kc_b + offset * stride_kc_o + h * stride_kc_h + d, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vc_b + offset * stride_vc_o + h * stride_vc_h + d, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Launch :func:`_write_kv_kernel` (inputs already validated by ``ops.write_kv``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = is_fp8(k_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        float(k_scale),
        float(v_scale),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        FP8_MAX=fp8_max(k_cache.dtype) if fp8 else 0.0,
        FP8_MANT_BITS=fp8_grid(k_cache.dtype)[0] if fp8 else 0,
        FP8_MIN_EXP=fp8_grid(k_cache.dtype)[1] if fp8 else 0,
    )


# ---------------------------------------------------------------- paged attention


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """Largest ``s`` in ``[0, num_seqs)`` with ``qsl[s] // BLOCK_Q + s <= tile_id``."""
    # Start from tensors (not Python ints) so the loop-carried types stay fixed.
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.zeros((), dtype=tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        take = start <= tile_id
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    tile_idx,
    kv_end,
    k_base,
    v_base,
    block_table_row,
    stride_kc_b,
    stride_kc_o,
    stride_vc_b,
    stride_vc_o,
    qk_scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Fold KV positions ``[tile_idx*BLOCK_N, +BLOCK_N)`` into the online softmax.

    ``MASKED`` tiles may cross the causal diagonal, ``kv_end`` or (``HAS_WINDOW``) the
    lower edge of a row's sliding window; unmasked tiles are known to be fully visible
    to every row, so they skip all position masks.
    """
    offs_n = tile_idx * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        n_ok = offs_n < kv_end
    else:
        n_ok = offs_n >= 0  # all true
    # Physical block of each logical position; masked lanes read block 0 (never used).
    if MASKED:
        block = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        block = tl.load(block_table_row + offs_n // BLOCK_SIZE).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_off = block * stride_kc_b + in_block * stride_kc_o  # [BLOCK_N]
    v_off = block * stride_vc_b + in_block * stride_vc_o
    # K loaded transposed [HEAD_DIM_PAD, BLOCK_N] so q @ k needs no tl.trans.
    k_ptrs = k_base + k_off[None, :] + offs_d[:, None]
    v_ptrs = v_base + v_off[:, None] + offs_d[None, :]
    if MASKED or HEAD_DIM != HEAD_DIM_PAD:
        k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)  # interior tile, unpadded head_dim: no predication needed
        v = tl.load(v_ptrs)

    if KV_FP8:
        # Dequantized to the query's dtype; the scales are applied outside the tile loop
        # (k_scale folded into qk_scale, v_scale into the output).
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # input_precision only affects float32 operands: keep those exact (no TF32).
    s = tl.dot(q, k, input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, l_i, m_new


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    acc_part_ptr,
    ml_part_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    v_scale,
    num_seqs,
    num_heads,
    tiles_per_segment,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_bt_s,
    window,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads, NUM_SEGMENTS)``."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return  # spare tile id: this sequence has fewer query tiles
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_tok = q_tile * BLOCK_Q + offs_m // GROUP  # token index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = context_len + q_tok

    # KV positions this query tile can see: up to its last valid row's position.
    last_tok = tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    # Tiles wholly at or before the tile's first row position need no causal mask.
    first_pos = context_len + q_tile * BLOCK_Q
    num_full = (first_pos + 1) // BLOCK_N
    if HAS_WINDOW:
        # Row p sees (p - window, p]: tiles before the first row's window are skipped, and a
        # tile needs no window mask only when it starts inside the last row's window.
        start_tile = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
        full_lo = tl.cdiv(tl.maximum(context_len + last_tok - window + 1, 0), BLOCK_N)
    else:
        start_tile = 0
        full_lo = 0
    # Tiles [start_tile, num_tiles) split into: masked below full_lo, unmasked, masked from num_full.
    unmasked_lo = tl.maximum(start_tile, tl.minimum(full_lo, num_full))
    unmasked_hi = tl.maximum(unmasked_lo, num_full)

    if NUM_SEGMENTS == 1:
        lo = start_tile
        hi = num_tiles
    else:
        lo = start_tile + segment * tiles_per_segment
        # The last segment takes any remainder, so a stale max_seq_len hint stays correct.
        hi = tl.where(segment == NUM_SEGMENTS - 1, num_tiles, tl.minimum(lo + tiles_per_segment, num_tiles))

    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kc_h
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vc_h
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s

    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + _NEG_BIG

    if HAS_WINDOW:
        for j in range(lo, tl.minimum(hi, unmasked_lo)):
            acc, l_i, m_i = _attend_kv_tile(
                acc, l_i, m_i, q, q_pos, j, kv_end, k_base, v_base, block_table_row,
                stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o, qk_scale, window,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_WINDOW, DOT_F32, KV_FP8,
            )  # fmt: skip
    for j in range(tl.maximum(lo, unmasked_lo), tl.minimum(hi, unmasked_hi)):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, j, kv_end, k_base, v_base, block_table_row,
            stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o, qk_scale, window,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, HAS_WINDOW, DOT_F32, KV_FP8,
        )  # fmt: skip
    for j in range(tl.maximum(lo, unmasked_hi), hi):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, j, kv_end, k_base, v_base, block_table_row,
            stride_kc_b, stride_kc_o, stride_vc_b, stride_vc_o, qk_scale, window,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_WINDOW, DOT_F32, KV_FP8,
        )  # fmt: skip

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SEGMENTS == 1:
        # Every valid row saw its own position, so l_i > 0; the guard covers padding rows.
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        o_ptrs = out_ptr + q_row[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: ml_part [num_tokens, num_heads, NUM_SEGMENTS, 2] (max, sum),
        # acc_part [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD], float32.
        part = (q_row * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(ml_part_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_part_ptr + part * 2 + 1, l_i, mask=row_ok)
        tl.store(acc_part_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    acc_part_ptr,
    ml_part_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    stride_o_t,
    stride_o_h,
    v_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Grid ``(num_tokens, num_heads)``: combine the segment partials of one row."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    o_ptrs = out_ptr + row * stride_o_t + head * stride_o_h + offs_d
    # Padding rows past the last sequence have no partials; they are left as zeros.
    if row >= tl.load(query_start_loc_ptr + num_seqs):
        return
    seg = tl.arange(0, NUM_SEGMENTS)
    part = (row * num_heads + head) * NUM_SEGMENTS + seg
    m = tl.load(ml_part_ptr + part * 2)
    l_seg = tl.load(ml_part_ptr + part * 2 + 1)
    acc = tl.load(acc_part_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)  # empty segments carry m = _NEG_BIG, so w = 0
    l_tot = tl.sum(w * l_seg, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) * (v_scale / l_tot)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# The interpreter stores bfloat16 as raw uint16 and its tl.dot multiplies those bits
# as integers, so under TRITON_INTERPRET bf16 dot operands are upcast to float32.
_INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); a nominal 1 on CPU."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _choose_num_segments(
    num_programs: int, max_query_len: int, max_seq_len: int, block_n: int, device: torch.device
) -> int:
    """Split KV across segments only for decode batches that cannot fill the GPU."""
    if device.type != "cuda" or max_query_len != 1:
        return 1
    target = 2 * _sm_count(device)
    if num_programs >= target:
        return 1
    kv_tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    # Keep at least ~4 KV tiles per segment so the merge stays cheap.
    segments = min(triton.next_power_of_2(triton.cdiv(target, num_programs)), 16, max(kv_tiles // 4, 1))
    # Round down to a power of two (tl.arange in the merge kernel needs one).
    return 1 << (segments.bit_length() - 1)


def attention_tile_sizes(group: int, head_dim: int, element_size: int, max_query_len: int) -> tuple[int, int]:
    """Default ``(block_m, block_n)`` of the attention kernel for these shapes.

    Decode tiles hold only ``group`` useful rows; prefill tiles want many tokens. K and V
    tiles sit in shared memory: 64-token tiles of 128 x 2-byte heads need ~49 KB, of 128 x
    4-byte (float32) heads ~113 KB, over the ~99 KB an sm_86/sm_89 block may use.
    """
    block_m = max(16 if max_query_len <= 1 else 64, triton.next_power_of_2(group))
    block_n = 64 if head_dim * element_size <= 256 else 32
    return block_m, block_n


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_segments: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Launch the unified paged attention (inputs validated by ``ops.paged_attention``).

    ``max_query_len``/``max_seq_len`` only tune tile sizes and KV splitting; results
    stay correct if they are loose. ``block_m``/``block_n``/``num_segments`` override
    the heuristics (tests use them to exercise small tiles and the split-KV path);
    each must be a power of two, ``block_m >= num_heads // num_kv_heads`` and
    ``block_m, block_n >= 16``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    # Zero-filled so rows outside every sequence (e.g. padding) are deterministic.
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out

    default_m, default_n = attention_tile_sizes(group, head_dim, q.element_size(), max_query_len)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if block_m < group or block_m < 16 or block_n < 16:
        raise ValueError(f"block_m={block_m}/block_n={block_n} too small for group {group}")
    block_q = block_m // group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))

    grid_tiles = num_tokens // block_q + num_seqs
    # KV positions one query tile reads: the whole context, or at most window + tile rows.
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + max_query_len + block_n)
    if num_segments is None:
        num_segments = _choose_num_segments(grid_tiles * num_kv_heads, max_query_len, span, block_n, q.device)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    tiles_per_segment = triton.cdiv(triton.cdiv(max(span, 1), block_n), num_segments)

    if num_segments > 1:
        acc_part = torch.empty(
            (num_tokens, num_heads, num_segments, head_dim_pad), dtype=torch.float32, device=q.device
        )
        ml_part = torch.empty((num_tokens, num_heads, num_segments, 2), dtype=torch.float32, device=q.device)
    else:
        acc_part = ml_part = out  # unused placeholders (pointer arguments must be tensors)

    _paged_attention_kernel[(grid_tiles, num_kv_heads, num_segments)](
        q,
        k_cache,
        v_cache,
        out,
        acc_part,
        ml_part,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * k_scale * _LOG2E,  # an FP8 cache's k_scale scales every score alike
        v_scale,
        num_seqs,
        num_heads,
        tiles_per_segment,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        sliding_window or 0,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SEGMENTS=num_segments,
        HAS_WINDOW=sliding_window is not None,
        DOT_F32=_INTERPRETED and q.dtype == torch.bfloat16,
        KV_FP8=is_fp8(k_cache.dtype),
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out,
            acc_part,
            ml_part,
            query_start_loc,
            num_seqs,
            num_heads,
            out.stride(0),
            out.stride(1),
            v_scale,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SEGMENTS=num_segments,
        )
    return out
