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

A plan built with ``fused=True`` instead puts every decode in one group that
:mod:`engine.kernels.cpu_decode` runs in place (no gather, no padding); the caller checks
``cpu_decode.supports`` for its dtypes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_decode, cpu_ops, cpu_prefix
from pdserve.engine.kernels.cascade import CascadePrefix, attention_lse, merge, plan_prefix
from pdserve.engine.kernels.quant import dequantize, is_fp8, quantize


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots in place (quantized for an FP8
    cache); ``-1`` slots are skipped."""
    if key.shape[0] == 0:
        return
    if cpu_ops.writes_kv(key, value, k_cache, v_cache) and slot_mapping.is_contiguous():
        cpu_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)  # one call for the ops below
        return
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    # The caches are strided views (block stride != block_size * H * D), so no flat
    # slot view exists; a (block, offset) index pair addresses them directly.
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    if is_fp8(k_cache.dtype):
        key, value = quantize(key, k_scale, k_cache.dtype), quantize(value, v_scale, v_cache.dtype)
    k_cache.index_put_((blocks, offsets), key)
    v_cache.index_put_((blocks, offsets), value)


@dataclass
class DecodeGroup:
    """One batched SDPA call: decode sequences padded to ``padded_len`` KV positions."""

    rows: torch.Tensor  # int64 [B]: their query rows
    block_index: torch.Tensor  # int64 [B * num_blocks]: physical blocks to gather, row-major
    pad_rows: torch.Tensor  # int64: rows of the gathered [B * padded_len] that are past a sequence's end
    mask: torch.Tensor  # bool [B, 1, 1, padded_len]
    padded_len: int
    all_rows: bool  # rows == arange(num_tokens): no row selection needed
    buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # With a cascade (``TorchAttentionPlan.cascade``): where each of these rows sits among the
    # prefix's rows (None: no cascade, or the group holds all of them in order). The gathered
    # blocks are then each sequence's suffix only.
    prefix_pos: torch.Tensor | None = None
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive form of ``mask``, per dtype
    # A fused group (``plan_attention(fused=True)``) is read in place: ``block_index`` viewed as
    # [B, padded_len // block_size], each row's positions [starts, spans) of it; no mask, no padding rows.
    starts: torch.Tensor | None = None
    spans: torch.Tensor | None = None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as 0 / -inf in ``dtype`` (what the flash operator takes)."""
        found = self.masks.get(dtype)
        if found is None:
            found = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            found.masked_fill_(~self.mask, float("-inf"))
            self.masks[dtype] = found
        return found


@dataclass
class TorchAttentionPlan:
    """Per-step index work of the torch path, computed once and shared by every layer.

    Build it with :func:`plan_attention` from the step's metadata; passing it is an
    optimisation only (``paged_attention_torch`` builds one itself when it gets none).
    """

    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[tuple[int, int, int]]  # (seq, start row, seq_len) of sequences with q_len > 1
    starts: list[int]  # query_start_loc as a list; starts[-1] is the number of query rows
    sliding_window: int | None = None
    cascade: CascadePrefix | None = None  # the decodes' shared prefix, read once (engine/kernels/cascade.py)
    fused: bool = False  # decode groups run in engine/kernels/cpu_decode.py

    def one_group(self, rows: int) -> DecodeGroup | None:
        """The decode group when it is the step's only one and holds every one of its ``rows`` query
        rows in order (the hot path: no prefills, no row selection), else None."""
        groups = self.decode_groups
        if len(groups) == 1 and groups[0].all_rows and rows == self.starts[-1]:
            return groups[0]
        return None


def _length_buckets(seqs: list[int], lens: list[int], min_fill: float = 0.75) -> list[list[int]]:
    """Split decode sequences into groups, longest first, padded to the group's longest.

    A new group starts when a sequence is shorter than ``min_fill`` of the group's longest,
    so at most ~25% of a group's gathered K/V is padding (memory traffic, not compute,
    bounds CPU decode attention). Each group is one batched SDPA call.
    """
    groups: list[list[int]] = []
    for s in sorted(seqs, key=lambda x: -lens[x]):
        if groups and lens[s] >= min_fill * lens[groups[-1][0]]:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


# A prefill of at most this many query rows may run as one decode per row (plan_attention).
ROWWISE_MAX_ROWS = 128


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    cascade: bool = False,
    fused: bool = False,
) -> TorchAttentionPlan:
    """Group the decodes, precompute gather indices, padding rows and masks for one step.

    With a ``sliding_window`` a decode reads only the blocks that hold its last
    ``sliding_window`` positions; the mask hides the rest of those blocks. With ``cascade``
    (no window), decodes that all start with the same blocks read those once together
    (:mod:`engine.kernels.cascade`) and gather only the rest. With ``fused``, all decodes form one
    group read in place by :mod:`engine.kernels.cpu_decode` (the caller has checked
    ``cpu_decode.supports``); with ``cascade`` too, the rows of short prefills join them where that
    gives the step a shared prefix (:func:`_rowwise_plan`).
    """
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if fused and cascade and sliding_window is None:
        rowwise = _rowwise_plan(block_tables, lens, starts, block_size)
        if rowwise is not None:
            return rowwise
    return _plan(block_tables, lens, starts, block_size, sliding_window, cascade, fused)


def _rowwise_plan(block_tables: torch.Tensor, lens: list[int], starts: list[int],
                  block_size: int) -> TorchAttentionPlan | None:  # fmt: skip
    """A fused cascade plan in which each query row of a prefill of 2 to ``ROWWISE_MAX_ROWS`` rows is
    a decode of its own: row ``j`` of a sequence of length ``n`` and ``q`` new rows attends to
    positions ``[0, n - q + j]``, exactly what causal attention gives it. Those rows then read the
    step's shared prefix once with the decodes (on AMX tiles in bfloat16) and their own suffix in
    place, instead of a gather, a mask and an SDPA call per sequence and layer (a prefix-cache hit's
    tail, a chunk after a cached prefix). None where no prefill is that short, where one is longer,
    or where the rows share no prefix (the kernel would then read each row's whole context:
    per-sequence SDPA is kept).

    Why none longer: a prompt can hit blocks that another prompt of the same step computes, and the
    cascade may read its prefix before the step's writes (``gather_layers``). The shared blocks lie
    before every cascade row's own context, so no cascade sequence writes them in this step; a
    sequence left out of the cascade (a longer prefill) could."""
    seq_of: list[int] = []  # the caller's sequence of each entry: a whole sequence or one of its rows
    row_lens: list[int] = []
    row_starts: list[int] = []
    for s, n in enumerate(lens):
        q = starts[s + 1] - starts[s]
        if q > ROWWISE_MAX_ROWS:
            return None
        if q > 1:
            seq_of += [s] * q
            row_lens += range(n - q + 1, n + 1)
            row_starts += range(starts[s], starts[s + 1])
        else:
            seq_of.append(s)
            row_lens.append(n)
            row_starts.append(starts[s])
    if len(seq_of) == len(lens):
        return None
    row_starts.append(starts[-1])
    table = block_tables.index_select(0, torch.tensor(seq_of, dtype=torch.int64, device=block_tables.device))
    plan = _plan(table, row_lens, row_starts, block_size, None, True, True)
    if plan.cascade is None:
        return None
    plan.starts = starts  # every row is a decode now: no prefills to point back to the caller's sequences
    return plan


def _plan(block_tables: torch.Tensor, lens: list[int], starts: list[int], block_size: int,
          sliding_window: int | None, cascade: bool, fused: bool) -> TorchAttentionPlan:  # fmt: skip
    """:func:`plan_attention` on the metadata as lists (``starts``: query_start_loc)."""
    num_seqs = len(lens)
    q_lens = [starts[s + 1] - starts[s] for s in range(num_seqs)]
    device = block_tables.device
    groups: list[DecodeGroup] = []
    decode = [s for s in range(num_seqs) if q_lens[s] == 1]
    shared = plan_prefix(block_tables, lens, decode, starts, block_size) if cascade and sliding_window is None else None
    # First block each decode reads: past the window, whole blocks are skipped; with a cascade,
    # the shared ones.
    first = [0 if sliding_window is None else max(lens[s] - sliding_window, 0) // block_size for s in range(num_seqs)]
    if shared is not None:
        for s in decode:
            first[s] = shared.num_tokens // block_size
    spans = [lens[s] - first[s] * block_size for s in range(num_seqs)]  # positions gathered
    for group in [sorted(decode)] if fused and decode else _length_buckets(decode, spans):
        group.sort()  # batch order = row order, so a single all-decode group needs no row shuffle
        padded_blocks = -(-max(spans[s] for s in group) // block_size)
        padded = padded_blocks * block_size
        table = _group_blocks(block_tables, group, [first[s] for s in group],
                              [-(-lens[s] // block_size) - first[s] for s in group], padded_blocks)  # fmt: skip
        gspans = torch.tensor([spans[s] for s in group], device=device)
        # Gathered position p is logical position first*block_size + p; the query sits at len-1.
        gstarts = None if sliding_window is None else (gspans - sliding_window).clamp_(min=0)
        rows = [starts[s] for s in group]
        row_t = torch.tensor(rows, dtype=torch.int64, device=device)
        found = DecodeGroup(
            rows=row_t,
            block_index=table.view(-1),
            pad_rows=torch.empty(0, dtype=torch.int64, device=device),
            mask=torch.empty(0, dtype=torch.bool, device=device),
            padded_len=padded,
            all_rows=rows == list(range(starts[-1])),
            prefix_pos=None if shared is None or len(group) == len(decode) else torch.searchsorted(shared.rows, row_t),
        )
        if fused:
            found.spans = gspans
            found.starts = torch.zeros_like(gspans) if gstarts is None else gstarts
        else:
            pos = torch.arange(padded, device=device)[None, :]
            # Gathered rows b * padded + p with p past sequence b's span, ascending.
            found.pad_rows = (pos >= gspans[:, None]).view(-1).nonzero().view(-1)
            visible = pos < gspans[:, None]
            if gstarts is not None:
                visible &= pos >= gstarts[:, None]
            found.mask = visible.view(len(group), 1, 1, padded)
        groups.append(found)
    prefills = [(s, starts[s], lens[s]) for s in range(num_seqs) if q_lens[s] > 1]
    return TorchAttentionPlan(block_size, groups, prefills, starts, sliding_window, shared, fused)


def _group_blocks(block_tables: torch.Tensor, group: list[int], first: list[int], count: list[int],
                  width: int) -> torch.Tensor:  # fmt: skip
    """int64 ``[len(group), width]``: row ``b`` holds the ``count[b]`` block ids of sequence
    ``group[b]`` from its block ``first[b]`` on, then zeros; one gather for the group (no per-sequence
    Python work, whose cost grows with every sequence's blocks)."""
    device = block_tables.device
    cols = torch.arange(width, device=device)[None, :]
    index = (torch.tensor(first, device=device)[:, None] + cols).clamp_(max=max(block_tables.shape[1] - 1, 0))
    seqs = torch.tensor(group, dtype=torch.int64, device=device)[:, None]
    table = block_tables[seqs, index].to(torch.int64)
    return table.masked_fill_(cols >= torch.tensor(count, device=device)[:, None], 0)


def _gather(cache: torch.Tensor, group: DecodeGroup, which: int) -> torch.Tensor:
    """``[B, padded_len, H, D]`` gather of K (``which=0``) or V into the group's reused buffer.

    Padding rows are zeroed: never-written cache memory may hold NaN, and a zero
    probability times NaN is still NaN.
    """
    key = (cache.dtype, cache.shape[2], cache.shape[3])
    bufs = group.buffers.get(key)
    if bufs is None:
        shape = (group.block_index.numel(), *cache.shape[1:])
        bufs = (torch.empty(shape, dtype=cache.dtype, device=cache.device),
                torch.empty(shape, dtype=cache.dtype, device=cache.device))  # fmt: skip
        group.buffers[key] = bufs
    out = torch.index_select(cache, 0, group.block_index, out=bufs[which])
    flat = out.view(-1, cache.shape[2] * cache.shape[3])
    if group.pad_rows.numel():
        # FP8 tensors have no index_fill_; zero is the all-zero bit pattern in every float format.
        (flat.view(torch.uint8) if is_fp8(flat.dtype) else flat).index_fill_(0, group.pad_rows, 0)
    return out.view(group.rows.numel(), group.padded_len, *cache.shape[2:])


def _read(kv: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Gathered K or V as ``dtype``: FP8 values dequantized, float ones as they are."""
    return dequantize(kv, kv_scale, dtype) if is_fp8(kv.dtype) else kv


def _decode_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float,
    k_scale: float = 1.0, v_scale: float = 1.0, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention for the group's single-token queries ``q [B, Hq, D]``; returns ``[B, Hq, D]``.

    ``prefix``: these rows' attention over the cascade's shared prefix (``prefix_part``), merged
    with theirs over the gathered suffixes."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if group.spans is not None and group.starts is not None:
        blocks = group.block_index.view(batch, -1)
        return cpu_decode.decode_attention(q, k_cache, v_cache, blocks, group.starts, group.spans, scale, prefix)[0]
    k = _read(_gather(k_cache, group, 0), q.dtype, k_scale).transpose(1, 2)  # [B, Hkv, L, D]
    v = _read(_gather(v_cache, group, 1), q.dtype, v_scale).transpose(1, 2)
    # Query heads h*group .. h*group+group-1 share KV head h: fold them into q_len.
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if prefix is None:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)
    else:
        own, own_lse = attention_lse(qg, k, v, scale, group.additive_mask(q.dtype))
        out = merge(*prefix, own, own_lse).to(q.dtype)
    return out.reshape(batch, num_heads, head_dim)


def prefix_part(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix: CascadePrefix, scale: float,
                k_scale: float, v_scale: float, layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every decode row's attention over the shared prefix, in one call: ``([B, Hkv, group, D],
    float32 log-sum-exp [B, Hkv, group])``, B in ``prefix.rows`` order. Where the step set the AMX
    kernel up (``prefix.tiles``, ``cascade.gather_layers``), that kernel runs it (``out`` then float32);
    a float32 prefix goes to ``cpu_prefix`` where it is built; else ATen's flash operator. Either reads
    ``prefix.kv[layer]`` where the step gathered it, else a gather from the caches."""
    rows = q if prefix.rows.numel() == q.shape[0] else q[prefix.rows]
    if prefix.tiles is not None and layer is not None and q.dtype == torch.bfloat16 and k_scale == v_scale == 1.0:
        return prefix.tiles.attention(rows, layer, scale)
    if (q.dtype == k_cache.dtype == torch.float32 and k_scale == v_scale == 1.0
            and cpu_prefix.available(q.dtype, q.shape[-1])):  # fmt: skip
        if prefix.kv is not None and layer is not None:
            k, v = prefix.kv[layer].unbind(0)
        else:
            k, v = (c.index_select(0, prefix.block_index).flatten(0, 1) for c in (k_cache, v_cache))
        return cpu_prefix.attention(rows, k, v, scale)
    batch, num_heads, head_dim = rows.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # Every sequence's query heads of KV head h read the same keys: one query axis of B * group rows.
    qa = rows.view(batch, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, batch * group,
                                                                                 head_dim)  # fmt: skip
    out, lse = _prefix_flash(qa, k_cache, v_cache, prefix, scale, k_scale, v_scale, layer)
    return (out.view(num_kv_heads, batch, group, head_dim).transpose(0, 1),
            lse.view(num_kv_heads, batch, group).transpose(0, 1))  # fmt: skip


def _prefix_flash(qa: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix: CascadePrefix,
                  scale: float, k_scale: float, v_scale: float,
                  layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``qa [Hkv, rows, D]`` over the prefix through ATen's flash operator: ``(out [Hkv, rows, D], lse
    [Hkv, rows])``, K/V from ``prefix.kv`` where the step gathered them, else from the caches."""
    num_kv_heads, _, head_dim = qa.shape
    if prefix.kv is not None and layer is not None:
        k, v = prefix.kv[layer]
    else:
        k, v = (c.index_select(0, prefix.block_index) for c in (k_cache, v_cache))
    k = _read(k, qa.dtype, k_scale).view(1, -1, num_kv_heads, head_dim)
    v = _read(v, qa.dtype, v_scale).view(1, -1, num_kv_heads, head_dim)
    out, lse = attention_lse(qa[None], k.transpose(1, 2), v.transpose(1, 2), scale)
    return out[0], lse[0]


def _gather_seq(cache: torch.Tensor, table_row: torch.Tensor, start: int, seq_len: int) -> torch.Tensor:
    """``[seq_len - start, H, D]``: K or V of positions ``[start, seq_len)`` (a fresh copy)."""
    block_size = cache.shape[1]
    first = start // block_size
    blocks = table_row[first : -(-seq_len // block_size)].long()
    skip = start - first * block_size
    return cache.index_select(0, blocks).view(-1, *cache.shape[2:])[skip : seq_len - first * block_size]


def _prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention for one sequence's ``q [q_len, Hq, D]`` (its last ``q_len`` positions)."""
    q_len = q.shape[0]
    context_len = seq_len - q_len
    # Keys no query of this chunk can see (before the first query's window) are not read.
    start = 0 if sliding_window is None else max(context_len - sliding_window + 1, 0)
    k = _read(_gather_seq(k_cache, block_table_row, start, seq_len), q.dtype, k_scale).transpose(0, 1)
    v = _read(_gather_seq(v_cache, block_table_row, start, seq_len), q.dtype, v_scale).transpose(0, 1)
    qh = q.transpose(0, 1)  # [Hq, q_len, D]
    if context_len == 0 and (sliding_window is None or sliding_window >= seq_len):
        # Square causal mask: SDPA's built-in causal path skips masked blocks.
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # is_causal aligns the diagonal top-left; cached context needs it bottom-right.
        q_pos = torch.arange(context_len, seq_len, device=q.device)
        k_pos = torch.arange(start, seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
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
    plan: TorchAttentionPlan | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    layer: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see ``reference.paged_attention_ref``.

    ``plan`` must come from :func:`plan_attention` over these same metadata tensors and
    this ``sliding_window``; ``layer`` is the caches' layer, where the plan's cascade holds
    every layer's prefix K/V (``cascade.gather_layers``).
    Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``; rows owned by no
    sequence are zero.
    """
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], sliding_window)
    elif plan.block_size != k_cache.shape[1]:
        raise ValueError(f"plan was built for block_size {plan.block_size}, cache has {k_cache.shape[1]}")
    elif plan.sliding_window != sliding_window:
        raise ValueError(f"plan was built for sliding_window {plan.sliding_window}, not {sliding_window}")
    if q.shape[0] == 0 or not plan.starts[-1]:
        return torch.zeros_like(q, memory_format=torch.contiguous_format)
    groups = plan.decode_groups
    shared = (None if plan.cascade is None
              else prefix_part(q, k_cache, v_cache, plan.cascade, scale, k_scale, v_scale, layer))  # fmt: skip
    if (group := plan.one_group(q.shape[0])) is not None:  # hot path
        return _decode_group(q, k_cache, v_cache, group, scale, k_scale, v_scale, shared)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    for group in groups:
        part = shared
        if shared is not None and group.prefix_pos is not None:
            part = (shared[0][group.prefix_pos], shared[1][group.prefix_pos])
        out.index_copy_(0, group.rows, _decode_group(q[group.rows], k_cache, v_cache, group, scale, k_scale, v_scale,
                                                     part))  # fmt: skip
    for s, start, seq_len in plan.prefills:
        end = plan.starts[s + 1]
        out[start:end] = _prefill_one(q[start:end], k_cache, v_cache, block_tables[s], seq_len, scale, sliding_window,
                                      k_scale, v_scale)  # fmt: skip
    return out
