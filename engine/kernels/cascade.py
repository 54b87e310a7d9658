"""Cascade attention for decodes that share a prefix (the torch path, CPU serving).

When every decode sequence of a step starts with the same physical KV blocks (a shared system
prompt, a prefix-cache hit), each sequence's attention splits into two parts over disjoint keys:
the shared prefix, read ONCE for all of them in one batched call whose queries are every
sequence's query heads, and each sequence's own suffix, gathered as before. The two partial
results are merged exactly through their log-sum-exps (the softmax over the union of two key
sets). Without it every sequence gathers (copies) the shared blocks out of the paged cache again,
every layer: for 32 sequences sharing 221 of ~280 tokens, most of the step's K/V traffic.

The log-sum-exp comes from ATen's CPU flash-attention operator, the kernel
``scaled_dot_product_attention`` dispatches to on the CPU, which returns it (the public function
does not). Where that operator is missing, :data:`AVAILABLE` is False and plans use no cascade. On a
bfloat16 cache where the CPU has AMX, the prefix part runs on the tiles instead
(``cpu_amx_prefix.py``), each layer's prefix packed for them right before (:func:`gather_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kernels import cpu_amx_prefix

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
AVAILABLE = _FLASH is not None

# Cascade only pays when the shared part is long and shared widely (vLLM's heuristic has the same
# two knobs): below these, the extra call and the merge cost more than the gathers they save.
MIN_PREFIX_TOKENS = 128
MIN_SEQS = 8


@dataclass
class CascadePrefix:
    """The blocks every decode sequence of a step starts with, and the query rows reading them."""

    block_index: torch.Tensor  # int64 [num_blocks]: the shared physical blocks, in order
    num_tokens: int  # block_index.numel() * block_size
    rows: torch.Tensor  # int64 [B]: the decode rows, ascending
    # Every layer's K and V of these blocks, [layers, planes, num_tokens, Hkv, D], when gather_layers
    # took them for the whole step at once (else each layer gathers its own).
    kv: torch.Tensor | None = None
    # Instead of kv on a bfloat16 cache where AMX runs: the AMX prefix kernel's view of the prefix
    # (cpu_amx_prefix.tiles), which packs each layer's K and V when its prefix part runs.
    tiles: cpu_amx_prefix.PrefixTiles | None = None

    @property
    def gathered(self) -> bool:
        """Whether gather_layers took the step's prefix (in either form)."""
        return self.kv is not None or self.tiles is not None


def gather_layers(prefix: CascadePrefix, kv_cache: torch.Tensor, heads: slice) -> None:
    """Set ``prefix.kv`` from ``kv_cache [num_blocks, layers, planes, block_size, Hkv, D]``, the KV heads
    ``heads`` of it (a tensor-parallel rank's; all of them on one device), in one gather for every layer;
    on a bfloat16 cache where the AMX prefix kernel runs, ``prefix.tiles`` instead (which packs each
    layer in the kernel's layouts when it runs). Call it before the step's layers run (it reads the
    prefix blocks, which are full: the step writes only past them)."""
    if kv_cache.dim() == 6 and kv_cache.stride(-1) == 1 and cpu_amx_prefix.available(kv_cache.dtype,
                                                                                    kv_cache.shape[-1]):
        prefix.tiles = cpu_amx_prefix.tiles(kv_cache, heads, prefix.block_index)
        return
    blocks = kv_cache[..., heads, :].permute(1, 2, 0, 3, 4, 5)  # [layers, planes, blocks, block_size, H, D]
    prefix.kv = torch.index_select(blocks, 2, prefix.block_index).flatten(2, 3)


def common_prefix_blocks(table: torch.Tensor, lens: list[int], block_size: int) -> int:
    """How many leading block ids all rows of ``table`` (``[n, width]``, each a decode sequence's
    block table, ``lens`` its length) share, counting only blocks every sequence has filled before
    its last: each sequence then keeps at least one position (its query's own) for its suffix."""
    if table.shape[0] == 0:
        return 0
    limit = min(min((n - 1) // block_size for n in lens), table.shape[1])
    same = (table[:, :limit] == table[:1, :limit]).all(0)
    return limit if bool(same.all()) else int(same.to(torch.int8).argmin())  # the first block not shared


def plan_prefix(block_tables: torch.Tensor, lens: list[int], decode: list[int], starts: list[int],
                block_size: int) -> CascadePrefix | None:  # fmt: skip
    """The step's shared prefix when a cascade pays (enough sequences, enough shared tokens), else None."""
    if not AVAILABLE or len(decode) < MIN_SEQS:
        return None
    # common_prefix_blocks reads no further than the blocks every sequence has filled before its last.
    width = min((lens[s] - 1) // block_size for s in decode)
    rows = block_tables[decode, :width]
    shared = common_prefix_blocks(rows, [lens[s] for s in decode], block_size)
    if shared * block_size < MIN_PREFIX_TOKENS:
        return None
    device = block_tables.device
    return CascadePrefix(
        block_index=rows[0, :shared].to(torch.int64),
        num_tokens=shared * block_size,
        rows=torch.tensor(sorted(starts[s] for s in decode), dtype=torch.int64, device=device),
    )


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``softmax(q k^T * scale + mask) v`` and its float32 log-sum-exp per query row.

    ``q [B, H, Lq, D]``, ``k``/``v [B, H, Lk, D]`` (same dtype), ``mask`` additive in ``q.dtype``
    broadcastable to ``[B, H, Lq, Lk]`` (``-inf`` hides a key); every row must see a key.
    """
    assert _FLASH is not None
    out, lse = _FLASH(q, k, v, attn_mask=mask, scale=scale)
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over keys A ∪ B from the two partial results (``out [..., D]``, ``lse [...]``),
    in float32: each part weighted by its share of the total softmax mass."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    return out_a.float() * (wa / total).unsqueeze(-1) + out_b.float() * (wb / total).unsqueeze(-1)
