"""``GGUFFile`` against ``gguf.GGUFReader`` on the same files: metadata of every value type, tensors
of plain and quantized types, a custom alignment, the real SmolLM2 file; and the refusals."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from pdserve.engine.model.gguf_file import GGUFFile
from tests.support.gguf_files import smollm2_path, write_gguf
from tests.support.models import make_hf_checkpoint


def assert_same_as_reader(path: Path) -> GGUFFile:
    ours, ref = GGUFFile(path), GGUFReader(path)
    expected = {name: field.contents() for name, field in ref.fields.items()}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return ours


def write_every_type(path: Path, alignment: int | None = None) -> Path:
    w = GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 7)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcödé 😀")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "世界"])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path, alignment: int | None) -> None:
    f = assert_same_as_reader(write_every_type(tmp_path / "every.gguf", alignment))
    assert f.metadata["t.u64"] == 2**63 + 7 and f.metadata["t.strs"] == ["a", "", "世界"]
    assert f.metadata.get("general.alignment", 32) == (alignment or 32)


def test_written_checkpoints_and_the_real_file_read_as_gguf_reads_them(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", "llama_gqa", seed=5)
    assert_same_as_reader(write_gguf(hf, tmp_path / "bpe.gguf"))
    assert_same_as_reader(write_gguf(hf, tmp_path / "spm.gguf", tokenizer="llama"))
    real = assert_same_as_reader(smollm2_path())
    assert len(real.metadata["tokenizer.ggml.tokens"]) == 49152


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0, order: str = "<") -> bytes:
    return b"GGUF" + struct.pack(f"{order}IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize(("data", "message"), [
    (b"GGML" + bytes(20), "no GGUF magic"),
    (_header(version=1), "GGUF version 1 is not supported"),
    (_header(order=">"), "big-endian GGUF files are not supported"),
    (_header(n_kv=1) + struct.pack("<Q", 3) + b"key", "ends early"),
    (_header(n_kv=1) + struct.pack("<Q", 1000) + b"key", "runs past the end"),
    (_header(n_kv=1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 99), "not a valid GGUFValueType"),
    (_header(n_tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<IQIQ", 1, 1024, 0, 0), "runs past the end"),
])  # fmt: skip
def test_bad_headers_are_refused_with_the_reason(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


def test_a_bad_file_is_a_clear_error_from_the_loader(tmp_path: Path) -> None:
    from pdserve.engine.model import ModelConfig

    path = tmp_path / "bad.gguf"
    path.write_bytes(_header(version=9))
    with pytest.raises(ValueError, match=r"bad.gguf is not a readable GGUF file: GGUF version 9 is not supported"):
        ModelConfig.from_path(path)
