"""A decode step's decoder stack as one call from Python (``cpu_replay.c``).

``engine/model/decode_replay.py`` runs a decode step's layers as the C kernels' calls alone; made from
Python, those calls (about ten a layer) each convert their arguments through ctypes. This library makes
the same calls from C: the caller fills a :class:`Step` (the kernels' addresses, the step's shapes,
buffers and reads) and an array of :class:`Layer` (each layer's weights and K/V planes, the same every
step while the weights' copies are), and :func:`run` makes every layer's calls in one ctypes call.

The structures mirror ``cpu_replay.c``'s field for field (pointers as ``c_void_p``, counts as
``c_int64``, float arguments as ``c_double``: the C side rounds them to float as ctypes would).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.engine.kernels import cpu_build

_SOURCE = Path(__file__).with_name("cpu_replay.c")
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

PREFIX_NONE, PREFIX_TILES, PREFIX_F32 = 0, 1, 2
REFUSED = {1: "a projection kernel", 2: "the decode kernel", 3: "the float32 prefix kernel"}
NO_ROW_BUFFER = 4  # the AMX prefix kernel found no row buffer


class Projection(ctypes.Structure):
    _fields_ = [("fn", _P), ("packed", _P), ("bias", _P)]


class Layer(ctypes.Structure):
    """One layer: its norms' weights and eps, its projections (kernel, packed weight, bias), its K and V planes."""

    _fields_ = [("norm1", _P), ("norm2", _P), ("eps1", _D), ("eps2", _D), ("qkv", Projection), ("o", Projection),
                ("glu", Projection), ("down", Projection), ("k", _P), ("v", _P)]  # fmt: skip


class Step(ctypes.Structure):
    """A step's kernels, shapes, buffers and reads (``cpu_replay.c``'s ``struct step``); ``packed_layer``
    goes in and out, ``failed_layer`` and ``residual`` come out."""

    _fields_ = [
        ("norm", _P), ("rotary", _P), ("write_kv", _P), ("decode", _P), ("prefix_fn", _P), ("prefix", _I),
        ("rows", _I), ("hidden", _I), ("inter", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
        ("elem_bytes", _I), ("threads", _I), ("scale", _D),
        ("h", _P), ("x", _P), ("o", _P), ("down", _P), ("res", _P * 2), ("qkv", _P), ("act", _P), ("attn", _P),
        ("lse", _P), ("cos", _P), ("sin", _P), ("slots", _P),
        ("block_stride", _I), ("token_stride", _I), ("head_stride", _I), ("block_size", _I),
        ("blocks", _P), ("starts", _P), ("spans", _P), ("max_blocks", _I),
        ("init_out", _P), ("is_", _P), ("init_lse", _P), ("ls", _P), ("init_f32", _I),
        ("tiles_view", _P), ("tv_block", _I), ("tv_layer", _I), ("tv_plane", _I), ("tv_token", _I), ("tv_head", _I),
        ("tiles_blocks", _P), ("kp", _P), ("vp", _P), ("keys", _I), ("keys_pad", _I),
        ("prefix_kv", _P), ("kt", _P), ("shared_out", _P), ("shared_lse", _P),
        ("packed_layer", _I), ("failed_layer", _I), ("residual", _I),
    ]  # fmt: skip


@functools.cache
def _get() -> ctypes._CFuncPtr | None:
    """The entry point, built and loaded on the first call (None where the library is not built)."""
    lib = cpu_build.load(_SOURCE)
    if lib is None:
        return None
    fn = lib.pdserve_replay_stack
    fn.argtypes, fn.restype = [ctypes.POINTER(Step), ctypes.POINTER(Layer), _I], ctypes.c_int
    return fn


def available() -> bool:
    """Whether :func:`run` can be called here (the library built)."""
    return _get() is not None


def address(fn: ctypes._CFuncPtr) -> int:
    """A ctypes function's address, as :class:`Step` and :class:`Projection` take it."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def layers(entries: Sequence[Any]) -> ctypes.Array:
    """An array of :class:`Layer` from entries with the same fields (``decode_replay.LayerEntry``), each
    projection ``(fn, packed, bias)`` with ``fn`` a ctypes function (its address is taken)."""
    out = (Layer * len(entries))()
    for dst, e in zip(out, entries):
        dst.norm1, dst.norm2, dst.eps1, dst.eps2, dst.k, dst.v = e.norm1, e.norm2, e.eps1, e.eps2, e.k, e.v
        for name in ("qkv", "o", "glu", "down"):
            fn, packed, bias = getattr(e, name)
            setattr(dst, name, Projection(address(fn), packed, bias))
    return out


def run(step: Step, layer_array: ctypes.Array) -> None:
    """Every layer's calls (``cpu_replay.c``); ``step.residual`` then says where the last residual is.
    Requires :func:`available`. Raises MemoryError where the AMX prefix kernel found no row buffer, ValueError
    where a kernel refused the step (not reached where the caller checked what each refuses)."""
    fn = _get()
    assert fn is not None, "cpu_replay.run without the library"
    failed = fn(ctypes.byref(step), layer_array, len(layer_array))
    if failed == NO_ROW_BUFFER:
        raise MemoryError(f"AMX prefix attention: no row buffer for {step.keys_pad} keys")
    if failed:
        raise ValueError(f"{REFUSED.get(failed, 'a kernel')} refused layer {step.failed_layer} of the step")
