"""A GGUF file's header: its metadata and its tensor index, read in one pass over a memory map.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, so a real
vocabulary costs it seconds (SmolLM2's 49,152 tokens and 48,900 merges: 4-6 s, in every process
that loads the model). This reads the same header with ``struct`` (0.2 s there) and leaves
the tensors on disk, mapped as the reader maps them: ``metadata`` equals ``{name:
field.contents()}`` of ``GGUFReader.fields``, and each tensor's name, type, shape and data equal the
reader's (tests/engine/test_gguf_file.py). The format's constants (value and tensor types, block
sizes) are ``gguf``'s; tensors are dequantized by ``gguf.quants``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # as gguf's reader: version 1 stored lengths in 32 bits
DEFAULT_ALIGNMENT = 32

# Fixed-size value types: struct format and numpy dtype (little-endian).
_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")), GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")), GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")), GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")), GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")), GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}  # fmt: skip
# Tensor types numpy holds as they are; every other type is bytes, one row of blocks per row.
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's index entry. ``shape`` is GGUF's order (innermost dimension first); ``data`` is a
    read-only view of the file: the values for plain types, the quantized blocks' bytes otherwise."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """``GGUFFile(path)``: the header of a little-endian GGUF file of version 2 or 3.

    Raises ValueError, naming what is wrong, for anything else (another magic, version or byte
    order, a truncated header, an unknown type, a tensor past the end of the file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        # Plain-ndarray views of the map: numpy calls ``memmap.__array_finalize__`` on every slice of a
        # memmap, and dequantization slices each tensor into thousands of row groups (~0.5 s a model).
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self.metadata, self.tensors = self._read()
        except (struct.error, IndexError) as e:
            raise ValueError(f"the GGUF header ends early ({e})") from None

    def _read(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self._pos = 4
        version = self._scalar(GGUFValueType.UINT32)
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in VERSIONS:
                raise ValueError("big-endian GGUF files are not supported")
            raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS})")
        n_tensors, n_kv = self._scalar(GGUFValueType.UINT64), self._scalar(GGUFValueType.UINT64)
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self._string()
            meta[key] = self._value(GGUFValueType(self._scalar(GGUFValueType.UINT32)))
        index = [self._tensor_info() for _ in range(n_tensors)]
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        names = [name for name, *_ in index]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")
        return meta, [self._tensor(start, *info) for info in index]

    def _scalar(self, kind: GGUFValueType) -> Any:
        fmt, _ = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar(GGUFValueType.UINT64)
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        s = str(self._buf[self._pos : end], encoding="utf-8")
        self._pos = end
        return s

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(kind)
        item, n = GGUFValueType(self._scalar(GGUFValueType.UINT32)), self._scalar(GGUFValueType.UINT64)
        if item in _SCALARS:  # one read for the whole array
            dtype = _SCALARS[item][1]
            values = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._pos)
            self._pos += n * dtype.itemsize
            return values.tolist()
        return [self._value(item) for _ in range(n)]  # strings, or arrays of arrays

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar(GGUFValueType.UINT64) for _ in range(self._scalar(GGUFValueType.UINT32)))
        kind = GGMLQuantizationType(self._scalar(GGUFValueType.UINT32))
        return name, dims, kind, self._scalar(GGUFValueType.UINT64)

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:  # fmt: skip
        n = int(np.prod(dims, dtype=np.int64))
        block, type_size = GGML_QUANT_SIZES[kind]
        nbytes = n * type_size // block
        begin = start + offset
        if begin + nbytes > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file")
        np_shape = tuple(reversed(dims))
        if kind in _PLAIN:
            data = self._map[begin : begin + nbytes].view(_PLAIN[kind]).reshape(np_shape)
        else:
            data = self._map[begin : begin + nbytes].reshape(quant_shape_to_byte_shape(np_shape, kind))
        return GGUFTensor(name, kind, dims, data)
