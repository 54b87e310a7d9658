"""How the HTTP edge merges the streams of one request's choices (pure asyncio, no server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.router.http import _merged
from pdserve.router.output import Chunk, Usage


def chunk(text: str, finished: bool = False) -> Chunk:
    return Chunk([1], text, finished, "length" if finished else None, Usage())


async def stream(name: str, log: list[str], n: int = 2, fail: BaseException | None = None) -> AsyncIterator[Chunk]:
    log.append(f"{name} start")
    for k in range(n):
        await asyncio.sleep(0)
        if fail is not None and k == 1:
            raise fail
        yield chunk(f"{name}{k}", k == n - 1)
    log.append(f"{name} end")


async def collect(agen: AsyncIterator[tuple[int, Chunk]]) -> list[tuple[int, str]]:
    return [(i, c.text) async for i, c in agen]


def test_followers_start_after_their_leaders_first_chunk() -> None:
    log: list[str] = []
    out = asyncio.run(collect(_merged([stream("a", log), stream("b", log), stream("c", log)], [None, 0, None])))
    assert sorted(out) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (2, "c0"), (2, "c1")]
    assert out.index((0, "a0")) < out.index((1, "b0"))  # b waited for a's first chunk
    assert log.index("b start") > log.index("a start")


class Stopped(BaseException):
    """Not an Exception: what a stream can end with when something above it is torn down."""


@pytest.mark.parametrize("failure", [ValueError("worker refused"), Stopped()])
def test_a_failing_choice_ends_the_merge_and_cancels_the_others(failure: BaseException) -> None:
    log: list[str] = []

    async def run() -> None:
        merged = _merged([stream("a", log, n=50), stream("b", log, fail=failure)], [None, None])
        await asyncio.wait_for(collect(merged), timeout=10)  # never hangs

    with pytest.raises(ValueError if isinstance(failure, ValueError) else RuntimeError):
        asyncio.run(run())
    assert "a end" not in log  # cancelled, not run to its end
