"""Which decode steps the replay takes (``engine/model/decode_replay.py``), and each one's replay.

:class:`Replayer` checks a step against what the replay needs (the module docstring of
``decode_replay``) and makes its :class:`DecodeReplay` from every layer's entries, which it keeps per
row count from step to step.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine.kernels import cpu_decode, cpu_ops, labels
from pdserve.engine.kernels.kernel_weights import KernelWeights
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.kernels.torch_paged import TorchAttentionPlan
from pdserve.engine.model.decode_replay import DecodeReplay, LayerEntry, Parts
from pdserve.engine.model.replay_native import native_layers


class Replayer:
    """Makes each step's :class:`DecodeReplay` for one model's layers (their :func:`parts_of`).

    A layer's entries at a row count (its kernels, packed weights, norms, K/V planes) stay the same from
    step to step, so they are kept per row count and cache, and made again only where one of the objects
    they were made from (:func:`_sources`: the copies each projection takes at that row count, which
    ``pack_onednn``, ``load_weights`` or a change of row paths replace) is no longer the same."""

    def __init__(self, parts: list[Parts]) -> None:
        self.parts = parts
        self._kept: dict[tuple, tuple[list[tuple], list[LayerEntry] | None, ctypes.Array | None]] = {}

    def build(self, kv_cache: torch.Tensor, meta: AttentionMetadata, h: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, native: bool = True) -> DecodeReplay | None:  # fmt: skip
        """The step over ``h [rows, hidden]`` as a :class:`DecodeReplay`, or None where it does not
        qualify (the module docstring); its calls made from C (``cpu_replay``) where ``native`` and the
        library is built, else from Python."""
        parts, plan = self.parts, meta.torch_plan
        if labels.active() or not isinstance(plan, TorchAttentionPlan) or not plan.fused or h.dim() != 2:
            return None
        rows, dtype = h.shape[0], h.dtype
        group = plan.one_group(rows)
        if not rows or group is None or group.spans is None or group.starts is None or plan.sliding_window is not None:
            return None
        cascade = plan.cascade
        if cascade is not None and (cascade.rows.numel() != rows or not cascade.gathered):
            return None
        if not _cache_fits(kv_cache, dtype, len(parts)) or not _tables_fit(h, cos, sin, meta):
            return None
        if plan.block_size != kv_cache.shape[3]:  # the module path refuses such a step; so does the replay
            return None
        attn = parts[0].attn
        if not cpu_decode.supports(dtype, dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim):
            return None
        if kv_cache.shape[4:] != (attn.num_kv_heads, attn.head_dim) or cpu_ops.entries(dtype) is None:
            return None
        kept = self._entries(kv_cache, rows, dtype)
        if kept is None:
            return None
        entries, array = kept
        return DecodeReplay(entries, kv_cache, meta, plan, attn, rows, h.shape[1], parts[0].mlp.inter,
                            array if native else None)  # fmt: skip

    def _entries(self, kv_cache: torch.Tensor, rows: int,
                 dtype: torch.dtype) -> tuple[list[LayerEntry], ctypes.Array | None] | None:  # fmt: skip
        """Every layer's entries at ``rows`` rows, or None where a layer takes another path: kept while
        every layer's :func:`_sources` are the same (:func:`_same`)."""
        if any(p.attn.k_scale != 1.0 or p.attn.v_scale != 1.0 for p in self.parts):
            return None
        sources = [_sources(p, rows) for p in self.parts]
        key = (rows, dtype, kv_cache.data_ptr(), kv_cache.stride())
        kept = self._kept.get(key)
        if kept is not None and not all(_same(a, b) for old, new in zip(kept[0], sources) for a, b in zip(old, new)):
            self._kept.clear()  # copies were replaced: what any row count kept holds the old ones alive
            kept = None
        if kept is None:
            es, stride, base = kv_cache.element_size(), kv_cache.stride(), kv_cache.data_ptr()
            entries: list[LayerEntry] | None = []
            for i, (layer, src) in enumerate(zip(self.parts, sources)):
                k = base + i * stride[1] * es
                entry = _layer(layer, src, k, k + stride[2] * es, dtype)
                if entry is None:
                    entries = None
                    break
                entries.append(entry)  # type: ignore[union-attr]
            kept = self._kept[key] = (sources, entries, None if entries is None else native_layers(entries))
        return None if kept[1] is None else (kept[1], kept[2])


def _sources(parts: Parts, rows: int) -> tuple:
    """What a layer's entries at ``rows`` rows are made of: its projections' copies at that row count
    (None where one takes another path), its norms' weights as the modules hold them now, and where
    those weights' data lie (a weight whose ``.data`` was replaced is the same object over new memory)."""
    w1, w2 = parts.norm1.weight, parts.norm2.weight
    return (parts.qkv.kernel_for(rows), parts.o.kernel_for(rows), parts.mlp.fused_glu_for(rows),
            parts.down.kernel_for(rows), w1, w2, (w1.data_ptr(), w2.data_ptr()))  # fmt: skip


def _same(a: object, b: object) -> bool:
    """One of :func:`_sources`' items unchanged: the same object, or the same addresses."""
    return a is b or (type(a) is tuple and a == b)


def _layer(parts: Parts, sources: tuple, k: int, v: int, dtype: torch.dtype) -> LayerEntry | None:
    """A layer's entries from its :func:`_sources`, or None where a part of it takes another path."""
    *kernels, w1, w2, _ = sources
    if w1.dtype != dtype or w2.dtype != dtype:
        return None
    if not all(isinstance(w, KernelWeights) and w.dtype == dtype for w in kernels):
        return None
    qkv, o, glu, down = (w.entry() for w in kernels)  # type: ignore[union-attr]
    return LayerEntry(w1.data_ptr(), parts.norm1.eps, w2.data_ptr(), parts.norm2.eps, qkv, o, glu, down, k, v)


def _cache_fits(kv_cache: torch.Tensor, dtype: torch.dtype, layers: int) -> bool:
    """A float CPU KV tensor ``[blocks, layers, 2, block_size, Hkv, D]`` of ``dtype``, each token's
    heads adjacent (what the KV write and the decode kernel read)."""
    return (kv_cache.dim() == 6 and kv_cache.dtype == dtype and kv_cache.device.type == "cpu"
            and kv_cache.shape[1] == layers and kv_cache.shape[2] == 2
            and kv_cache.stride(5) == 1 and kv_cache.stride(4) == kv_cache.shape[5])  # fmt: skip


def _tables_fit(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> bool:
    """``h`` contiguous on the CPU, the rotary tables contiguous of its dtype, an int64 contiguous slot
    per row."""
    rows = h.shape[0]
    slots = meta.slot_mapping
    return (h.device.type == "cpu" and h.is_contiguous() and not h.requires_grad
            and all(t.dtype == h.dtype and t.is_contiguous() and t.shape[0] == rows for t in (cos, sin))
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (rows,))  # fmt: skip
