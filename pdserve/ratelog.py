"""RateLimitFilter: a logging filter that lets through at most ``burst`` identical records per
``interval_s`` and then says how many it dropped.

A client can make the server log at will (a request that fails, a malformed message): without a
limit, each of its requests costs a traceback in the log. Records are identical when they come
from the same logger, at the same level, with the same message template (``record.msg`` before
its arguments are applied), so "request failed (%s)" with a different reference each time is one
kind. The first record let through after a suppression carries ``(N similar messages
suppressed)``. Thread-safe; attach with ``logger.addFilter(RateLimitFilter())``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_KINDS = 1024  # distinct templates tracked; beyond it the oldest interval's entries are dropped


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0


class RateLimitFilter(logging.Filter):
    def __init__(self, burst: int = 5, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if burst < 1 or interval_s <= 0:
            raise ValueError(f"burst must be >= 1 and interval_s > 0, got {burst}, {interval_s}")
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            w = self._windows.get(key)
            if w is None or now - w.start >= self.interval_s:
                dropped = w.suppressed if w is not None else 0
                if len(self._windows) >= MAX_KINDS:
                    self._forget_old(now)
                w = self._windows[key] = _Window(now)
                if dropped:
                    _note_suppressed(record, dropped)
            if w.passed >= self.burst:
                w.suppressed += 1
                return False
            w.passed += 1
            return True

    def _forget_old(self, now: float) -> None:
        for k in [k for k, w in self._windows.items() if now - w.start >= self.interval_s] or list(self._windows):
            del self._windows[k]


def _note_suppressed(record: logging.LogRecord, dropped: int) -> None:
    # Appended to the template: the note has no "%", so the record formats with its own arguments.
    record.msg = f"{record.msg} ({dropped} similar messages suppressed in the last interval)"
