"""A Llama decoder stack's decode step on the CPU as the C kernels' calls alone.

In a decode step on the CPU every part of a layer is one C kernel (the norms, the projections, the
rotary embedding, the KV write, the attention), and what runs between them in the module path
(module calls, the checks of every wrapper, views, a new output tensor per call) cost about 8 ms of
a 33 ms step of SmolLM2-135M over 32 sequences in bfloat16, whose kernels took 24 ms. Where a step
allows it (``replayer.Replayer``), the stack instead runs as those kernels' calls in a row: the step's
inputs checked once, every layer's entries kept from step to step, its outputs in buffers allocated once
a step. The calls are made from C (``engine/kernels/cpu_replay.c``, one ctypes call a step) where that
library is built and the step's shared-prefix part, if any, is a kernel's; else from Python. The kernels
and their inputs are the same, so the results are the module path's, bit for bit (``tests/engine/
test_decode_replay.py``).

A step qualifies when its attention plan is the torch backend's in-place decode over every query
row (a decode step, or short prefills taken row by row: ``torch_paged.plan_attention``), every
projection and the fused gate/up run on a C kernel's copy at this row count, the norms and the KV
write on ``cpu_ops``, on one device (no tensor parallelism), with a float KV cache of the model's
dtype. Anything else, and a profiling run that asks the kernels' names (``labels.labelled``), runs
the module path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.kernels import cpu_decode, cpu_ops, cpu_prefix, cpu_replay
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.kernels.torch_paged import TorchAttentionPlan, prefix_part
from pdserve.engine.model.replay_native import native_step

Entry = tuple[ctypes._CFuncPtr, int, int | None]  # KernelWeights.entry()


@dataclass(frozen=True)
class LayerEntry:
    """One layer's weights as the kernels take them, and its K and V planes' addresses."""

    norm1: int  # input_layernorm's weight
    eps1: float
    norm2: int  # post_attention_layernorm's weight
    eps2: float
    qkv: Entry
    o: Entry
    glu: Entry
    down: Entry
    k: int
    v: int


@dataclass(frozen=True)
class Parts:
    """A decoder layer's modules and norm weights that the replay reads (:func:`parts_of`)."""

    attn: nn.Module
    mlp: nn.Module
    qkv: nn.Module
    o: nn.Module
    down: nn.Module
    norm1: nn.Module
    norm2: nn.Module


def parts_of(layers: Iterable[nn.Module]) -> list[Parts] | None:
    """Every layer's :class:`Parts`, or None where a layer is not ``llama.DecoderLayer``'s kind (with its
    ``Attention``, ``MLP`` and ``RMSNorm`` s, on one device, no sliding window): what no step of this
    model changes, taken once (the module tree is fixed after the model is built)."""
    from pdserve.engine.model.llama import MLP, Attention, DecoderLayer, RMSNorm  # llama imports this module

    parts = []
    for layer in layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if type(attn) is not Attention or type(mlp) is not MLP or any(type(n) is not RMSNorm for n in norms):
            return None
        if attn.kv_slice is not None or attn.comm is not None or mlp.comm is not None or attn.sliding_window:
            return None
        parts.append(Parts(attn, mlp, attn.qkv_proj, attn.o_proj, mlp.down_proj, *norms))
    return parts or None


class _Buffers:
    """A step's outputs of each part of a layer, allocated once a step and written again by every layer."""

    def __init__(self, rows: int, hidden: int, heads: int, head_dim: int, qkv_width: int, inter: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.x, self.o, self.down = (torch.empty(rows, hidden, dtype=dtype) for _ in range(3))  # norm, o_proj, down
        self.residuals = (torch.empty(rows, hidden, dtype=dtype), torch.empty(rows, hidden, dtype=dtype))
        self.qkv = torch.empty(rows, qkv_width, dtype=dtype)
        self.attn = torch.empty(rows, heads, head_dim, dtype=dtype)
        self.lse = torch.empty(rows, heads, dtype=torch.float32)
        self.act = torch.empty(rows, inter, dtype=dtype)
        # The AMX prefix kernel's results (out [Hkv, G, rows, D], lse [Hkv, G, rows]) where the step's
        # cascade runs on it, and the decode kernel's arguments that read them (prefix_args).
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_init: tuple = (None, 0, None, None, None)

    def share(self, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
        """Allocate :attr:`shared` and set :attr:`shared_init` to read it."""
        rows = self.x.shape[0]
        out = torch.empty(kv_heads, group, rows, head_dim, dtype=torch.float32)
        lse = torch.empty(kv_heads, group, rows, dtype=torch.float32)
        self.shared = (out, lse)
        self.shared_init = cpu_decode.prefix_args((out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)), dtype,
                                                  (rows, kv_heads, group, head_dim))  # fmt: skip


class DecodeReplay:
    """One step's decoder stack as kernel calls (made by ``replayer.Replayer.build``, run once by :meth:`run`)."""

    def __init__(self, layers: list[LayerEntry], kv_cache: torch.Tensor, meta: AttentionMetadata,
                 plan: TorchAttentionPlan, attn: nn.Module, rows: int, hidden: int, inter: int,
                 native: ctypes.Array | None = None) -> None:  # fmt: skip
        """``native``: ``layers`` as ``cpu_replay``'s array, where the step's calls may be made from C."""
        self.layers, self.kv_cache, self.plan = layers, kv_cache, plan
        self.rows, self.hidden, self.inter = rows, hidden, inter
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.group = self.heads // self.kv_heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_width = self.q_size + 2 * self.kv_size
        self.scale = attn.scale
        self.dtype = kv_cache.dtype
        self.ops = cpu_ops.entries(self.dtype)
        self.decode = cpu_decode.entry(self.dtype)
        self.slots = meta.slot_mapping
        decode = plan.one_group(rows)
        assert decode is not None and decode.starts is not None and decode.spans is not None  # Replayer.build checked
        # The decode kernel's step-wide arguments: every row's blocks, read positions, the cache's strides.
        stride = kv_cache.stride()
        self.block_size = kv_cache.shape[3]
        self.reads = (decode.block_index.data_ptr(), decode.block_index.numel() // rows, decode.starts.data_ptr(),
                      decode.spans.data_ptr(), rows, self.kv_heads, self.group, self.head_dim, self.block_size,
                      self.scale)  # fmt: skip
        self.cache_strides = (stride[0], stride[3], stride[4])
        cascade = plan.cascade
        tiles = None if cascade is None else cascade.tiles
        # The cascade's prefix on AMX tiles where the step packed them for these heads, in float32 on
        # cpu_prefix where the step gathered it (prefix_part's choices): into the step's buffers.
        on_tiles = tiles is not None and self.dtype == torch.bfloat16 and tiles.heads == self.kv_heads
        self.tiles = tiles if on_tiles else None
        self.prefix32: tuple[ctypes._CFuncPtr, torch.Tensor] | None = None
        fn, kv = cpu_prefix.entry(), None if cascade is None else cascade.kv
        if (kv is not None and self.dtype == kv.dtype == torch.float32 and fn is not None
                and kv.shape[3] == self.kv_heads and cpu_prefix.available(self.dtype, self.head_dim)):  # fmt: skip
            self.prefix32 = (fn, cpu_prefix.workspace(kv.shape[2], self.kv_heads, self.head_dim))
        # From C where the prefix part, if any, is a kernel's (the torch prefix_part is Python's).
        self.native = native if cascade is None or self.tiles is not None or self.prefix32 is not None else None

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stack over the embeddings ``h [rows, hidden]`` with the step's rotary tables
        ``cos``/``sin`` (``RotaryEmbedding.lookup``'s): ``(delta, residual)`` as the module loop's
        last layer returns them (the final norm adds them)."""
        n, width, inter = self.rows, self.hidden, self.inter
        b = _Buffers(n, width, self.heads, self.head_dim, self.qkv_width, inter, self.dtype)
        if self.tiles is not None or self.prefix32 is not None:
            b.share(self.kv_heads, self.group, self.head_dim, self.dtype)
        threads = torch.get_num_threads()
        if self.native is not None:
            step = native_step(self, b, h, cos, sin, threads)
            try:
                cpu_replay.run(step, self.native)
            finally:
                if self.tiles is not None:
                    self.tiles.packed_layer = None if step.packed_layer < 0 else step.packed_layer
            return b.down, h if step.residual < 0 else b.residuals[step.residual]
        x, o, down, qkv, act = (t.data_ptr() for t in (b.x, b.o, b.down, b.qkv, b.act))
        norm = self.ops.norm  # type: ignore[union-attr]
        q_view = b.qkv[:, : self.q_size].view(n, self.heads, self.head_dim)
        rope = (cos.data_ptr(), sin.data_ptr())
        # Each norm after a residual add writes the new residual into the buffer its input is not in.
        residual, turn = h, 0
        for i, layer in enumerate(self.layers):
            if i == 0:  # the first layer: its norm's input is the residual itself, no add
                norm(h.data_ptr(), width, None, 0, h.data_ptr(), layer.norm1, x, n, width, layer.eps1, threads)
            else:
                residual, last, turn = b.residuals[turn], residual, turn ^ 1
                norm(last.data_ptr(), width, down, width, residual.data_ptr(), layer.norm1, x, n, width, layer.eps1,
                     threads)  # fmt: skip
            _project(layer.qkv, x, width, qkv, n, self.qkv_width, width, threads)
            self._attend(i, layer, q_view, b, rope, threads)
            _project(layer.o, b.attn.data_ptr(), self.q_size, o, n, width, self.q_size, threads)
            residual, last, turn = b.residuals[turn], residual, turn ^ 1
            norm(last.data_ptr(), width, o, width, residual.data_ptr(), layer.norm2, x, n, width, layer.eps2, threads)
            _project(layer.glu, x, width, act, n, inter, width, threads)
            _project(layer.down, act, inter, down, n, width, inter, threads)
        return b.down, residual

    def _attend(self, i: int, layer: LayerEntry, q: torch.Tensor, b: _Buffers, rope: tuple[int, int],
                threads: int) -> None:  # fmt: skip
        """Layer ``i``'s q and k rotated in ``b.qkv``, its K and V written to the cache, its attention
        into ``b.attn`` (the cascade's prefix part first, where the step has one)."""
        _, rotary, write_kv = self.ops  # type: ignore[misc]
        n, es, qkv = self.rows, b.qkv.element_size(), b.qkv.data_ptr()
        rotary(qkv, self.qkv_width, n, self.heads + self.kv_heads, self.head_dim, *rope, threads)
        row_bytes, s0, s1, _ = self.qkv_width * es, *self.cache_strides
        write_kv(qkv + self.q_size * es, row_bytes, qkv + (self.q_size + self.kv_size) * es, row_bytes, layer.k,
                 layer.v, s0 * es, s1 * es, self.slots.data_ptr(), n, self.block_size, self.kv_size * es)  # fmt: skip
        init = b.shared_init
        if b.shared is not None and self.tiles is not None:  # the AMX tiles: into the step's buffers
            self.tiles.attend_into(qkv, self.qkv_width, n, self.group, i, self.scale, *b.shared, threads)
        elif b.shared is not None and self.prefix32 is not None:  # float32: into the step's buffers too
            self._prefix32(i, qkv, b.shared, threads)
        elif (cascade := self.plan.cascade) is not None:
            shared = prefix_part(q, *self.kv_cache[:, i].unbind(1), cascade, self.scale, 1.0, 1.0, i)
            init = cpu_decode.prefix_args(shared, self.dtype, (n, self.kv_heads, self.group, self.head_dim))
        if self.decode(qkv, self.qkv_width, layer.k, layer.v, *self.cache_strides, *self.reads, *init,  # type: ignore[misc]
                       b.attn.data_ptr(), b.lse.data_ptr(), threads):  # fmt: skip
            raise ValueError("the decode kernel refused the step")  # not reached: Replayer.build checked what it refuses

    def _prefix32(self, i: int, qkv: int, shared: tuple[torch.Tensor, torch.Tensor], threads: int) -> None:
        """Layer ``i``'s attention over the gathered float32 prefix (``cpu_prefix``) into ``shared``."""
        fn, kt = self.prefix32  # type: ignore[misc]
        k, v = self.plan.cascade.kv[i]  # type: ignore[union-attr]  # each [keys, Hkv, D], contiguous
        out, lse = (t.data_ptr() for t in shared)
        if fn(qkv, self.qkv_width, k.data_ptr(), v.data_ptr(), kt.data_ptr(), self.rows, self.kv_heads, self.group,
              k.shape[0], self.head_dim, self.scale, out, lse, threads):  # fmt: skip
            raise ValueError("the prefix kernel refused the step")  # not reached: __init__ checked the head size


def _project(entry: Entry, x: int, x_stride: int, out: int, rows: int, out_features: int, in_features: int,
             threads: int) -> None:  # fmt: skip
    fn, packed, bias = entry
    if fn(x, x_stride, packed, bias, out, rows, out_features, in_features, threads):
        raise ValueError("a projection kernel refused the step")  # not reached: Replayer.build checked the shapes
