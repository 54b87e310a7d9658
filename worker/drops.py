"""Drops: a worker's calls by request id, so that the router can end one by its id.

The router ends a call it gave up on (the client left) by cancelling the call's Ray task. Ray can
lose that cancel when it arrives while the actor is still starting the task: a decode stream then
ran to ``max_tokens`` with nobody reading it, holding a running slot and its blocks all the while,
and a prefill computed a prompt nobody wanted. So the router also sends ``drop(request_id)``: the
call's ``on_drop`` runs (it makes the call end at its next wait, and the call's own exit frees what
it holds). A drop that arrives before its call began is kept for ``keep_s`` and ends the call as it
begins. Request ids are the router's (uuid4), so a kept drop cannot end another client's call.

Not thread-safe: every call comes from the actor's event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

KEEP_S = 60.0  # how long a drop waits for a call that has not begun
MAX_KEPT = 65536  # drops kept at most (the oldest go first)


class Dropped(Exception):
    """What a dropped call ends with: the router stopped waiting for it."""


class Drops:
    """The running calls' ``on_drop`` by request id, and the drops that came before their call."""

    def __init__(self, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if keep_s <= 0 or max_kept < 1:
            raise ValueError(f"keep_s ({keep_s}) must be > 0 and max_kept ({max_kept}) >= 1")
        self._keep_s = keep_s
        self._max_kept = max_kept
        self._clock = clock
        self._running: dict[str, Callable[[], None]] = {}
        self._early: OrderedDict[str, float] = OrderedDict()  # request id -> when its drop came

    def begin(self, request_id: str, on_drop: Callable[[], None]) -> bool:
        """A call of ``request_id`` begins: a drop of its id runs ``on_drop`` until ``end``.
        False when it was dropped before it began (it should end at once, holding nothing).
        A second call of an id already running is not reachable by drops (its registration then
        fails as an id in use)."""
        self._forget_old()
        if self._early.pop(request_id, None) is not None:
            return False
        self._running.setdefault(request_id, on_drop)
        return True

    def end(self, request_id: str, on_drop: Callable[[], None]) -> None:
        """The call that ``begin`` gave ``on_drop`` ended: drops of its id no longer reach it."""
        if self._running.get(request_id) is on_drop:
            del self._running[request_id]

    def drop(self, request_id: str) -> bool:
        """End the call of ``request_id``: True when it runs (its ``on_drop`` ran), False when it
        does not (kept, it ends as it begins within ``keep_s``)."""
        on_drop = self._running.get(request_id)
        if on_drop is not None:
            on_drop()
            return True
        self._forget_old()
        self._early[request_id] = self._clock()
        self._early.move_to_end(request_id)
        while len(self._early) > self._max_kept:
            self._early.popitem(last=False)
        return False

    def kept(self, request_id: str) -> bool:
        """A drop of ``request_id`` came before its call and is kept (the call will end as it begins)."""
        self._forget_old()
        return request_id in self._early

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_kept(self) -> int:
        return len(self._early)

    def _forget_old(self) -> None:
        horizon = self._clock() - self._keep_s
        while self._early and next(iter(self._early.values())) < horizon:
            self._early.popitem(last=False)
