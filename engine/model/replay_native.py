"""The decode replay's step as ``cpu_replay``'s structures, so that its calls are made from C.

:func:`native_layers` converts a replay's layers once (they hold while the weights' copies do);
:func:`native_step` fills a step's :class:`cpu_replay.Step` from a :class:`DecodeReplay` and its
buffers: the same addresses and values the Python loop passes to each kernel.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kernels import cpu_amx_prefix, cpu_replay

if TYPE_CHECKING:
    from pdserve.engine.model.decode_replay import DecodeReplay, LayerEntry, _Buffers


def native_layers(layers: list[LayerEntry]) -> ctypes.Array | None:
    """``layers`` as ``cpu_replay``'s array, or None where the library is not built here."""
    if not cpu_replay.available():
        return None
    return cpu_replay.layers(layers)


def native_step(r: DecodeReplay, b: _Buffers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                threads: int) -> cpu_replay.Step:  # fmt: skip
    """The step of ``r`` over ``h`` into the buffers ``b``; holds what it points to while ``b``, ``h``,
    ``cos``, ``sin`` and ``r`` live (the float32 prefix's per-layer addresses are kept on the step)."""
    s = cpu_replay.Step()
    norm, rotary, write_kv = r.ops  # type: ignore[misc]
    s.norm, s.rotary, s.write_kv = (cpu_replay.address(f) for f in (norm, rotary, write_kv))
    s.decode = cpu_replay.address(r.decode)  # type: ignore[arg-type]
    s.rows, s.hidden, s.inter = r.rows, r.hidden, r.inter
    s.heads, s.kv_heads, s.head_dim = r.heads, r.kv_heads, r.head_dim
    s.elem_bytes, s.threads, s.scale = b.qkv.element_size(), threads, r.scale
    s.h, s.x, s.o, s.down, s.qkv, s.act = (t.data_ptr() for t in (h, b.x, b.o, b.down, b.qkv, b.act))
    s.res[0], s.res[1] = (t.data_ptr() for t in b.residuals)
    s.attn, s.lse = b.attn.data_ptr(), b.lse.data_ptr()
    s.cos, s.sin, s.slots = cos.data_ptr(), sin.data_ptr(), r.slots.data_ptr()
    s.block_stride, s.token_stride, s.head_stride = r.cache_strides
    s.blocks, s.max_blocks, s.starts, s.spans = r.reads[:4]
    s.block_size = r.block_size
    init_out, init_f32, is_, init_lse, ls = b.shared_init
    s.init_out, s.init_f32, s.init_lse = init_out, init_f32, init_lse
    s.is_, s.ls = (None if a is None else ctypes.addressof(a) for a in (is_, ls))
    s.packed_layer = -1
    if b.shared is not None:
        s.shared_out, s.shared_lse = (t.data_ptr() for t in b.shared)
    if r.tiles is not None:
        _tiles(s, r)
    elif r.prefix32 is not None:
        _prefix32(s, r)
    return s


def _tiles(s: cpu_replay.Step, r: DecodeReplay) -> None:
    """The AMX prefix kernel's arguments (``PrefixTiles.attend_into``'s)."""
    t, fn = r.tiles, cpu_amx_prefix.entry()
    assert t is not None and fn is not None  # the step's tiles were made by the library
    s.prefix, s.prefix_fn = cpu_replay.PREFIX_TILES, cpu_replay.address(fn)
    s.tiles_view, strides, s.tiles_blocks, s.kp, s.vp = t.addresses()
    s.tv_block, s.tv_layer, s.tv_plane, s.tv_token, s.tv_head = strides[:5]
    s.keys, s.keys_pad = t.keys, t.keys_pad
    s.packed_layer = -1 if t.packed_layer is None else t.packed_layer


def _prefix32(s: cpu_replay.Step, r: DecodeReplay) -> None:
    """The float32 prefix kernel's arguments (``DecodeReplay._prefix32``'s): each layer's K and V."""
    fn, kt = r.prefix32  # type: ignore[misc]
    kv = r.plan.cascade.kv  # type: ignore[union-attr]
    pairs = (ctypes.c_void_p * (2 * len(kv)))(*(t.data_ptr() for k, v in kv for t in (k, v)))
    s.prefix, s.prefix_fn = cpu_replay.PREFIX_F32, cpu_replay.address(fn)
    s.prefix_kv, s.kt, s.keys = ctypes.addressof(pairs), kt.data_ptr(), kv[0][0].shape[0]
    s._keep = pairs  # type: ignore[attr-defined]
