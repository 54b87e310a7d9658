"""A cascade's shared-prefix attention in bfloat16 on AMX tiles (``cpu_amx_prefix.c``).

A step's decode sequences that share a prefix read its keys once, in one batched attention whose
queries are every sequence's query heads (``engine/kernels/cascade.py``). In bfloat16 that is two small
matrix products per KV head, which ATen's CPU flash-attention operator runs in about 70 us a layer at
SmolLM2's shapes (32 sequences of 3 query heads a KV head, a 208-token prefix; the queries' copy
included) and the tiles in about 36 us, the call included (``pdserve bench prefix-cpu``).

Each layer packs its prefix K and V straight from the paged cache in the tiles' pair layouts (in place
of the gather the cascade makes otherwise) right before its attention call, into buffers every layer
reuses, so the packed prefix is read hot (:class:`PrefixTiles`); the queries are read where the qkv
projection left them. The result is the flash operator's up to rounding: the scores' sums in float32,
the softmax in float32, its weights rounded to bfloat16 for the second product (as the flash operator
rounds them), the output float32 (the decode kernel merges it as it is).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.engine.kernels import cpu_amx, cpu_build, labels

_SOURCE = Path(__file__).with_name("cpu_amx_prefix.c")
PROFILER_LABEL = "pdserve::cpu_amx_prefix"  # what torch.profiler calls a call (a layer's pack and attention)
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
    fn.argtypes = [_P, _I, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float,
                   ctypes.c_int]  # fmt: skip
    fn.restype = ctypes.c_int
    return lib


def entry() -> ctypes._CFuncPtr | None:
    """The kernel :meth:`PrefixTiles.attend_into` calls (its argument list), None where it is not built."""
    lib = _get()
    return None if lib is None else lib.pdserve_amx_prefix_attention


def available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`tiles` and :meth:`PrefixTiles.attention` run here for a ``dtype`` cache of
    ``head_dim``: bfloat16, a head size that is a multiple of 32, and the AMX library built."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and _get() is not None


class PrefixTiles:
    """A step's shared prefix for the kernel: each layer's K and V packed in the tiles' layouts when
    that layer's attention asks (:meth:`attention`), into buffers of one layer that every layer reuses,
    so a layer's packed prefix is still in the cache when its attention reads it. Made by :func:`tiles`,
    which checks the cache once. Not thread-safe: one step's layers, in turn."""

    def __init__(self, view: torch.Tensor, block_index: torch.Tensor) -> None:
        """``view [num_blocks, layers, 2, block_size, H, D]``: the cache's heads for this rank (checked by
        :func:`tiles`); ``block_index``: the prefix's blocks, int64, contiguous."""
        _, self.layers, _, self.block_size, self.heads, self.head_dim = view.shape
        self.keys = block_index.numel() * self.block_size
        self.keys_pad = self.keys + -self.keys % KEY_ALIGN
        self._view, self._blocks = view, block_index
        d = self.head_dim
        # kp: per 16-key tile and 32 dims, dim pairs x keys x the pair; vp: per 32-key block and 16 dims,
        # key pairs x dims x the pair; zero past the prefix's keys.
        self.kp = torch.empty(self.heads, self.keys_pad // 16, d // 32, 16, 16, 2, dtype=torch.bfloat16)
        self.vp = torch.empty(self.heads, self.keys_pad // 32, d // 16, 16, 16, 2, dtype=torch.bfloat16)
        self.packed_layer: int | None = None  # whose K and V kp and vp hold

    def pack(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(kp, vp)``, packed now unless they already are (valid until another layer is)."""
        self._run(None, layer, 1.0)
        return self.kp, self.vp

    def attention(self, q: torch.Tensor, layer: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's attention over layer ``layer``'s prefix keys, and its log-sum-exp: ``q [B, Hq, D]``
        bfloat16 (one query row a sequence, read where it lies: any row stride, its heads adjacent;
        ``Hq`` a multiple of the prefix's KV heads) -> ``(out [B, Hkv, G, D], lse [B, Hkv, G])``, both
        float32 (views of ``[Hkv, G, B]``-ordered tensors), G = Hq / Hkv. The layer is packed in the
        same call unless it already is."""
        batch, num_heads, d = q.shape
        if q.dtype != torch.bfloat16 or num_heads % self.heads or d != self.head_dim or not batch:
            raise ValueError(f"AMX prefix attention: q {tuple(q.shape)} {q.dtype} does not match the prefix's "
                             f"{self.heads} KV heads of {self.head_dim}")  # fmt: skip
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        return self._run(q, layer, scale)

    def _run(self, q: torch.Tensor | None, layer: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's one call: pack ``layer`` unless it is packed, then attend ``q`` (checked; None: pack only)."""
        batch, num_heads, d = q.shape if q is not None else (0, self.heads, self.head_dim)
        group = num_heads // self.heads
        out = torch.empty(self.heads, group, batch, d, dtype=torch.float32)
        lse = torch.empty(self.heads, group, batch, dtype=torch.float32)
        with labels.label(PROFILER_LABEL):
            self.attend_into(None if q is None else q.data_ptr(), 0 if q is None else q.stride(0), batch, group, layer,
                             scale, out, lse, torch.get_num_threads())  # fmt: skip
        return out.permute(2, 0, 1, 3), lse.permute(2, 0, 1)

    def addresses(self) -> tuple[int, tuple[int, ...], int, int, int]:
        """What :meth:`attend_into` passes the kernel besides a call's own values, for callers that make the
        call themselves (``engine/model/replay_native.py``): the cache view's address and strides (elements),
        and the addresses of the prefix's block ids, of ``kp`` and of ``vp``."""
        view, blocks = self._view, self._blocks
        return view.data_ptr(), tuple(view.stride()), blocks.data_ptr(), self.kp.data_ptr(), self.vp.data_ptr()

    def attend_into(self, q: int | None, q_stride: int, batch: int, group: int, layer: int, scale: float,
                    out: torch.Tensor, lse: torch.Tensor, threads: int) -> None:  # fmt: skip
        """:meth:`attention`'s kernel call with its inputs unchecked (for callers that checked them once
        for many calls: ``engine/model/decode_replay.py``): ``batch`` query rows at address ``q`` (None:
        pack only), ``q_stride`` elements apart, each ``Hkv x group`` heads of ``head_dim`` bfloat16
        values; results into float32 contiguous ``out [Hkv, group, batch, head_dim]`` and ``lse [Hkv,
        group, batch]``. Packs ``layer`` first unless it is packed. Raises ValueError for a layer out of
        range, MemoryError where the kernel found no row buffer."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"AMX prefix: layer {layer} of a cache of {self.layers}")
        lib = _get()
        assert lib is not None  # tiles() made this
        s = self._view.stride()
        cache = None if layer == self.packed_layer else self._view.data_ptr() + layer * s[1] * self._view.element_size()
        failed = lib.pdserve_amx_prefix_attention(
            cache, s[0], s[2], s[3], s[4], self._blocks.data_ptr(), self.block_size, q, q_stride, self.kp.data_ptr(),
            self.vp.data_ptr(), out.data_ptr(), lse.data_ptr(), batch, self.heads, group, self.keys, self.keys_pad,
            self.head_dim, scale, threads,
        )  # fmt: skip
        self.packed_layer = None if failed else layer  # after a failure, the next call packs again
        if failed:
            raise MemoryError(f"AMX prefix attention: no row buffer for {self.keys_pad} keys")


def tiles(kv_cache: torch.Tensor, heads: slice, block_index: torch.Tensor) -> PrefixTiles:
    """The prefix blocks ``block_index`` (int64) of ``kv_cache [num_blocks, layers, 2, block_size, H, D]``
    (bfloat16, each head's ``D`` values contiguous), KV heads ``heads`` of it, for the kernel: each layer
    is packed when its attention asks. Requires :func:`available` for the cache; every block id must be
    in range (not checked)."""
    view = kv_cache[..., heads, :]
    if (_get() is None or view.dim() != 6 or view.dtype != torch.bfloat16 or view.shape[2] != 2
            or view.stride(5) != 1 or view.shape[5] % 32 or not block_index.numel()
            or block_index.dtype != torch.int64 or not block_index.is_contiguous()):  # fmt: skip
        raise ValueError(f"AMX prefix: needs a bfloat16 [blocks, layers, 2, block_size, H, D] cache, D a multiple "
                         f"of 32, and int64 block ids, got {tuple(view.shape)} {view.dtype}")  # fmt: skip
    return PrefixTiles(view, block_index)
