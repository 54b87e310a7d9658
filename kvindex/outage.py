"""OutageTracker: one warning when Redis becomes unreachable, one info line when it is back."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class OutageTracker:
    """Logs an outage once (warning) and its end once (info); counts outages."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.outages = 0
        self.down_since: float | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1
            log.warning("%s: Redis unavailable (%s: %s); serving goes on without the index", self.what,
                        type(exc).__name__, exc)  # fmt: skip

    def ok(self) -> None:
        if self.down_since is not None:
            log.info("%s: Redis reachable again after %.1fs", self.what, time.monotonic() - self.down_since)
            self.down_since = None
