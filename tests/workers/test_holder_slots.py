"""HolderSlots: one holder's pulls cannot take every pull thread (decode_worker/holder_slots.py).

Real threads and a real event loop: pulls that hang on one holder (work blocked on an event) and a
pull from another holder, which must run while they hang."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.decode_worker.holder_slots import HolderSlots
from pdserve.worker.threads import wait_to_end


def test_a_hung_holders_pulls_leave_threads_to_the_others() -> None:
    hung = threading.Event()  # set: the hung holder answers at last
    running: list[str] = []
    lock = threading.Lock()
    peak = {"a": 0}

    def pull(address: str) -> str:
        with lock:
            running.append(address)
            peak["a"] = max(peak["a"], running.count("a"))
        try:
            if address == "a":
                hung.wait(60)
            return address
        finally:
            with lock:
                running.remove(address)

    async def main(pool: ThreadPoolExecutor) -> None:
        slots = HolderSlots(2)
        stuck = [asyncio.ensure_future(slots.submit("a", pool, lambda: pull("a"))) for _ in range(5)]
        await asyncio.sleep(0)
        assert slots.in_use("a") == 5  # two running, three waiting for a slot, on the loop
        other = await slots.submit("b", pool, lambda: pull("b"))
        assert await asyncio.wait_for(wait_to_end(other), 30) == "b"  # not behind the hung holder's
        assert not any(f.done() for f in stuck[2:])
        stuck[4].cancel()  # a waiter cancelled before it got a slot holds nothing
        hung.set()
        ended = await asyncio.wait_for(asyncio.gather(*stuck[:4]), 30)
        assert [await asyncio.wait_for(wait_to_end(f), 30) for f in ended] == ["a"] * 4
        assert await _until(lambda: slots.in_use("a") == 0)

    with ThreadPoolExecutor(4) as pool:
        asyncio.run(main(pool))
    assert peak["a"] == 2


def test_a_slot_comes_back_when_the_work_ends_not_when_its_waiter_is_cancelled() -> None:
    release = threading.Event()

    async def main(pool: ThreadPoolExecutor) -> None:
        slots = HolderSlots(1)
        first = await slots.submit("a", pool, lambda: release.wait(60))
        waiter = asyncio.ensure_future(wait_to_end(first))
        await asyncio.sleep(0)
        waiter.cancel()  # the work runs on: its slot stays taken
        second = asyncio.ensure_future(slots.submit("a", pool, lambda: "second"))
        await asyncio.sleep(0.05)
        assert not second.done() and slots.in_use("a") == 2
        release.set()
        assert await wait_to_end(await asyncio.wait_for(second, 30)) == "second"
        assert await _until(lambda: slots.in_use("a") == 0)

    with ThreadPoolExecutor(2) as pool:
        asyncio.run(main(pool))


def test_a_closing_executor_frees_the_slot_it_refused() -> None:
    async def main() -> None:
        slots = HolderSlots(1)
        pool = ThreadPoolExecutor(1)
        pool.shutdown()
        with pytest.raises(RuntimeError):
            await slots.submit("a", pool, lambda: None)
        assert slots.in_use("a") == 0

    asyncio.run(main())
    with pytest.raises(ValueError, match="per_holder"):
        HolderSlots(0)


async def _until(check, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``check`` on the loop (slots come back through call_soon_threadsafe)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
