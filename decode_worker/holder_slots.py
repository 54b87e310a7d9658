"""HolderSlots: how many of a decode worker's pull threads one prefill worker may hold at once.

A pull waits on its holder, and a hung holder answers nothing until the puller gives up on it
(``TransferConfig.holder_silence_s``). Without a bound per holder, the pulls of requests that one
hung prefill worker handed over would take every pull thread, and the requests of healthy holders
would queue behind them. So a pull first takes one of its holder's slots (waiting on the event loop,
holding no thread), then a thread; the slot comes back when the pull's work ends, also when its
waiter was cancelled meanwhile (the work runs to its end: ``worker/threads.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class HolderSlots:
    """At most ``per_holder`` pulls of one holder address on the executor at once.

    Used from one event loop (the worker's). A holder's gate lives while it has users (running or
    waiting), so the table holds only the holders with pulls.
    """

    def __init__(self, per_holder: int) -> None:
        if per_holder < 1:
            raise ValueError(f"per_holder must be >= 1, got {per_holder}")
        self.per_holder = per_holder
        self._gates: dict[str, asyncio.Semaphore] = {}
        self._users: dict[str, int] = {}  # running and waiting, per holder

    async def submit(self, address: str, executor: Executor, fn: Callable[[], T]) -> Future[T]:
        """``fn`` on ``executor`` once ``address`` has a free slot; the slot is freed when ``fn`` ends.
        Cancelled while it waits for a slot: nothing was submitted and nothing is held."""
        gate = self._gates.get(address)
        if gate is None:
            gate = self._gates[address] = asyncio.Semaphore(self.per_holder)
        self._users[address] = self._users.get(address, 0) + 1
        try:
            await gate.acquire()
        except BaseException:
            self._leave(address)
            raise
        try:
            future = executor.submit(fn)
        except BaseException:
            self._free(address)
            raise
        loop = asyncio.get_running_loop()

        def ended(_: Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(self._free, address)
            except RuntimeError:  # the loop is closed: nothing waits for this slot any more
                logger.debug("pull slot of %s freed after its loop closed", address)

        future.add_done_callback(ended)
        return future

    def in_use(self, address: str) -> int:
        """Slots of ``address`` taken or waited for."""
        return self._users.get(address, 0)

    def _free(self, address: str) -> None:
        self._gates[address].release()
        self._leave(address)

    def _leave(self, address: str) -> None:
        left = self._users[address] - 1
        if left:
            self._users[address] = left
        else:
            del self._users[address], self._gates[address]
