"""The streaming copy (engine/kernels/stream_copy.c) against its reference, the slice assignment:
the same bytes at every alignment of either end and every length around the vector widths and the
page, nothing written outside the destination, and the same errors where the library is not built."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.kernels import stream_copy as sc

LENGTHS = [1, 63, 64, 255, 256, 257, 4095, 4096, 4097, 65536 + 129, (256 << 10) + 13, 2 << 20]
GUARD = 192  # bytes on either side of the destination that must stay as they were


def _copy_case(n: int, dest_shift: int, src_shift: int) -> None:
    rng = np.random.default_rng(n * 131 + dest_shift * 7 + src_shift)
    src = rng.integers(0, 256, n + src_shift, dtype=np.uint8).tobytes()
    fill = rng.integers(0, 256, n + 2 * GUARD + dest_shift, dtype=np.uint8)
    ours, ref = bytearray(fill.tobytes()), bytearray(fill.tobytes())
    lo = GUARD + dest_shift
    sc.stream_copy(memoryview(ours)[lo : lo + n], memoryview(src)[src_shift:])
    memoryview(ref)[lo : lo + n] = memoryview(src)[src_shift:]  # the reference
    assert ours == ref


@pytest.mark.skipif(not sc.available(), reason="no C compiler here: the streaming copy is not built")
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dest_shift,src_shift", [(0, 0), (1, 0), (0, 3), (13, 61), (63, 64)])
def test_streaming_copy_matches_slice_assignment(n: int, dest_shift: int, src_shift: int) -> None:
    _copy_case(n, dest_shift, src_shift)


def test_without_the_library_the_plain_copy_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sc, "_copy", lambda: None)
    for n in (1, 4097, (256 << 10) + 13):
        _copy_case(n, 5, 3)


@pytest.mark.parametrize("built", [True, False])
def test_bad_destinations_are_refused(monkeypatch: pytest.MonkeyPatch, built: bool) -> None:
    if not built:
        monkeypatch.setattr(sc, "_copy", lambda: None)
    data = bytes(range(256)) * 64
    with pytest.raises(ValueError, match="bytes into a view of"):
        sc.stream_copy(memoryview(bytearray(len(data) - 1)), data)
    with pytest.raises(ValueError, match="read-only"):
        sc.stream_copy(memoryview(bytes(len(data))), data)


def test_empty_copy_does_nothing() -> None:
    dest = bytearray(b"abc")
    sc.stream_copy(memoryview(dest)[1:1], b"")
    assert dest == b"abc"
