"""A cascade's shared-prefix attention in bfloat16 on AMX tiles (``cpu_amx_prefix.c``).

A step's decode sequences that share a prefix read its keys once, in one batched attention whose
queries are every sequence's query heads (``engine/kernels/cascade.py``). In bfloat16 that is two small
matrix products per KV head, which ATen's CPU flash-attention operator runs in about 60 us a layer at
SmolLM2's shapes (32 sequences of 3 query heads a KV head, a 208-token prefix) and the tiles in about
35 us, the call included.

The step packs every layer's prefix K and V once (:func:`pack`, in place of the gather the cascade
makes otherwise), in the tiles' pair layouts; each layer then makes one call
(:meth:`PackedPrefix.attention`). Its result is the flash operator's up to rounding: the scores' sums
in float32, the softmax in float32, its weights rounded to bfloat16 for the second product (as the
flash operator rounds them), the output float32 (the decode kernel merges it as it is).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_amx, cpu_build, labels

_SOURCE = Path(__file__).with_name("cpu_amx_prefix.c")
PROFILER_LABEL = "pdserve::cpu_amx_prefix"  # what torch.profiler calls an attention call
PACK_LABEL = "pdserve::cpu_amx_prefix_pack"  # and a pack
_P, _I = ctypes.c_void_p, ctypes.c_int64
KEY_ALIGN = 32  # keys per block of the second product; a prefix is padded to a multiple of it


@functools.cache
def _get() -> ctypes.CDLL | None:
    """The library, built and loaded on the first call, once ``cpu_amx`` has the tile state (None where
    either fails or the build has no AMX)."""
    if not cpu_amx.ready():
        return None
    lib = cpu_build.load(_SOURCE)
    if lib is None or not lib.pdserve_amx_prefix_built():
        return None
    fn = lib.pdserve_amx_prefix_attention
    fn.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    pack_fn = lib.pdserve_amx_prefix_pack
    pack_fn.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _I, _I, _I, _P, _P, ctypes.c_int]
    pack_fn.restype = ctypes.c_int
    return lib


def available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`pack` and :meth:`PackedPrefix.attention` run here for a ``dtype`` cache of
    ``head_dim``: bfloat16, a head size that is a multiple of 32, and the AMX library built."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and _get() is not None


class PackedPrefix:
    """Every layer's K and V of a step's shared prefix in the kernel's layouts (made by :func:`pack`,
    checked there once), and the prefix attention of one layer over them (:meth:`attention`)."""

    def __init__(self, kp: torch.Tensor, vp: torch.Tensor, keys: int) -> None:
        """``kp [layers, heads, keys_pad / 16, D / 32, 16, 16, 2]``: per 16-key tile and 32 dims, dim
        pairs x keys x the pair; ``vp [layers, heads, keys_pad / 32, D / 16, 16, 16, 2]``: per 32-key
        block and 16 dims, key pairs x dims x the pair; both bfloat16, contiguous, zero past ``keys``."""
        self.kp, self.vp, self.keys = kp, vp, keys
        self.layers, self.heads = kp.shape[:2]
        self.keys_pad, self.head_dim = kp.shape[2] * 16, kp.shape[3] * 32
        self._layer_bytes = kp.stride(0) * kp.element_size()  # kp and vp: the same per layer

    def attention(self, q: torch.Tensor, layer: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``softmax(q k^T * scale) v`` over layer ``layer``'s prefix keys, and its log-sum-exp: ``q [heads,
        rows, D]`` bfloat16 -> ``(out [heads, rows, D], lse [heads, rows])``, both float32."""
        heads, rows, d = q.shape
        if q.dtype != torch.bfloat16 or heads != self.heads or d != self.head_dim or not 0 <= layer < self.layers:
            raise ValueError(f"AMX prefix attention: q {tuple(q.shape)} {q.dtype} at layer {layer} does not match "
                             f"the packed prefix ({self.layers} layers of {self.heads} heads of {self.head_dim})")
        lib = _get()
        assert lib is not None  # pack() made this
        q = q.contiguous()
        out = torch.empty(heads, rows, d, dtype=torch.float32)
        lse = torch.empty(heads, rows, dtype=torch.float32)
        offset = layer * self._layer_bytes
        with labels.label(PROFILER_LABEL):
            failed = lib.pdserve_amx_prefix_attention(q.data_ptr(), self.kp.data_ptr() + offset,
                                                      self.vp.data_ptr() + offset, out.data_ptr(), lse.data_ptr(),
                                                      heads, rows, self.keys, self.keys_pad, d, scale,
                                                      torch.get_num_threads())  # fmt: skip
        if failed:
            raise MemoryError(f"AMX prefix attention: no row buffer for {self.keys_pad} keys")
        return out, lse


def pack(kv_cache: torch.Tensor, heads: slice, block_index: torch.Tensor) -> PackedPrefix:
    """The prefix blocks ``block_index`` (int64) of every layer of ``kv_cache [num_blocks, layers, 2,
    block_size, H, D]`` (bfloat16, each head's ``D`` values contiguous), KV heads ``heads`` of it, packed
    in one pass (keys padded with zeros to a multiple of 32). Requires :func:`available` for the cache;
    every block id must be in range (not checked)."""
    lib = _get()
    view = kv_cache[..., heads, :]
    _, layers, planes, block_size, num_heads, d = view.shape
    keys = block_index.numel() * block_size
    if (lib is None or view.dtype != torch.bfloat16 or planes != 2 or view.stride(5) != 1 or d % 32 or not keys
            or block_index.dtype != torch.int64 or not block_index.is_contiguous()):  # fmt: skip
        raise ValueError(f"AMX prefix pack: needs a bfloat16 [blocks, layers, 2, block_size, H, D] cache, D a "
                         f"multiple of 32, and int64 block ids, got {tuple(view.shape)} {view.dtype}")  # fmt: skip
    keys_pad = keys + -keys % KEY_ALIGN
    kp = torch.empty(layers, num_heads, keys_pad // 16, d // 32, 16, 16, 2, dtype=torch.bfloat16)
    vp = torch.empty(layers, num_heads, keys_pad // 32, d // 16, 16, 16, 2, dtype=torch.bfloat16)
    s = view.stride()
    with labels.label(PACK_LABEL):
        failed = lib.pdserve_amx_prefix_pack(view.data_ptr(), s[0], s[1], s[2], s[3], s[4], block_index.data_ptr(),
                                             keys, block_size, layers, num_heads, d, keys_pad, kp.data_ptr(),
                                             vp.data_ptr(), torch.get_num_threads())  # fmt: skip
    if failed:  # not reached: the checks above are the kernel's
        raise ValueError(f"AMX prefix pack refused {tuple(view.shape)}")
    return PackedPrefix(kp, vp, keys)
