"""BackgroundWriter: callers enqueue without blocking; a daemon thread writes batches to Redis."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import TypeVar

import redis

from pdserve.kvindex.config import REDIS_ERRORS, IndexConfig
from pdserve.kvindex.outage import OutageTracker

log = logging.getLogger(__name__)
_W = TypeVar("_W", bound="BackgroundWriter")


class BackgroundWriter:
    """A queue the caller fills without blocking and a daemon thread that writes it in batches.

    Subclasses implement ``_write(pipe, batch)`` (queue the commands of a batch on a pipeline)
    and may override ``_dropped(batch)`` (remember what a batch that could not be written would
    have changed) and ``_resync(client)`` (write that back once Redis answers again, or once it
    answers as a new server: every ``restart_check_s``, idle or not, the thread compares the
    server's ``run_id``, so a restart that lost the data is followed by a resync). All three
    run on the writer thread; ``_dropped`` and the caller share ``self._cv``, which subclasses
    also use to guard their own state. On failure the whole queue is dropped (it is covered by the
    resync) and retried with exponential backoff; ``outages``, ``dropped_batches`` and
    ``dropped_items`` count what happened.
    """

    client_retries = 1  # immediate retries of a failed batch; 0 where a batch is not idempotent
    client_timeout_s: float | None = None  # per-call timeout; None: the config's socket_timeout_s

    def __init__(self, config: IndexConfig, name: str) -> None:
        self.config = config
        self.name = name
        self._client = config.client(retries=self.client_retries, timeout_s=self.client_timeout_s)
        self._run_id: str | None = None  # the Redis server's run_id: a new one means a restart
        self._next_check = 0.0
        self._cv = threading.Condition()
        self._items: deque = deque()
        self._unfinished = 0  # items enqueued and not yet written or dropped
        self._resync_pending = False
        self._busy = False  # the thread holds a batch or runs a resync (flush must wait for it)
        self._closed = False
        self._stop = threading.Event()
        self._outage = OutageTracker(name)
        self.dropped_batches = 0
        self.dropped_items = 0
        self.failed_attempts = 0  # batches or resyncs that failed (one outage may see many)
        self.resyncs = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def outages(self) -> int:
        return self._outage.outages

    @property
    def restart_check_enabled(self) -> bool:
        """False once Redis refused ``INFO`` (the check is then off for good)."""
        return not math.isinf(self._next_check)

    def _enqueue(self, item: object) -> None:
        """Queue one item; the caller holds ``self._cv``. Never blocks on I/O, never raises."""
        if self._closed:
            return
        if len(self._items) >= self.config.max_queue:
            # Redis is too slow to keep up: drop, and let a resync restore the state later.
            self._dropped([item])
            self.dropped_items += 1
            self._resync_pending = True
        else:
            self._items.append(item)
            self._unfinished += 1
        self._cv.notify_all()

    def _write(self, pipe: redis.client.Pipeline, batch: list) -> None:
        raise NotImplementedError

    def _dropped(self, batch: list) -> None:
        """Called with ``self._cv`` held for items that will never be written."""

    def _resync(self, client: redis.Redis) -> None:
        """Restore in Redis what dropped items would have written."""

    def _run(self) -> None:
        delay = self.config.retry_initial_s
        while True:
            with self._cv:
                while not self._items and not self._resync_pending and not self._closed:
                    wait_s = self._next_check - time.monotonic()  # inf: restart checks are off
                    if not self._cv.wait(None if math.isinf(wait_s) else max(wait_s, 0.0)):
                        break  # idle until the next restart check
                if self._closed and (self._outage.down or not (self._items or self._resync_pending)):
                    return
                batch = [self._items.popleft() for _ in range(min(len(self._items), self.config.batch_max))]
                resync = self._resync_pending
                self._busy = True
            try:
                if time.monotonic() >= self._next_check:
                    self._next_check = time.monotonic() + self.config.restart_check_s
                    if self._server_restarted():
                        resync = True
                if resync:
                    with self._cv:
                        self._resync_pending = False  # a drop during the resync sets it again
                    self._resync(self._client)
                    self.resyncs += 1
                if batch:
                    pipe = self._client.pipeline(transaction=False)
                    self._write(pipe, batch)
                    pipe.execute()
                if self._outage.down and not batch:
                    self._answers()  # a resync with nothing to write sent nothing: ask before saying so
                self._outage.ok()
                delay = self.config.retry_initial_s
                self._finish(len(batch))
            except Exception as exc:  # noqa: BLE001 - the writer thread must survive anything
                if not isinstance(exc, REDIS_ERRORS):
                    log.exception("%s: unexpected error writing to Redis; batch dropped", self.name)
                self._outage.failed(exc)
                self.failed_attempts += 1
                with self._cv:
                    # The rest of the queue would fail too: drop it now, the resync covers it.
                    rest = list(self._items)
                    self._items.clear()
                    self._dropped(batch + rest)
                    self.dropped_batches += 1
                    self.dropped_items += len(batch) + len(rest)
                    self._resync_pending = True
                self._finish(len(batch) + len(rest))
                self._stop.wait(delay)
                delay = min(delay * 2, self.config.retry_max_s)

    def _answers(self) -> None:
        """One round trip (PING); raises when Redis does not answer. A refusal is an answer."""
        try:
            self._client.ping()
        except redis.ResponseError:  # e.g. an ACL without PING: the server is there all the same
            pass

    def _server_restarted(self) -> bool:
        """True when Redis answers with another ``run_id`` than last time (it restarted).

        A Redis user not allowed ``INFO`` (ACL ``-@dangerous``) turns the check off, with one
        warning: that is a permission, not an outage.
        """
        try:
            run_id = self._client.info("server").get("run_id")
        except redis.ResponseError as exc:  # NoPermissionError and other refusals; not a dead server
            log.warning("%s: cannot read Redis INFO (%s); a Redis restart will be noticed only when a "
                        "write fails", self.name, exc)
            self._next_check = float("inf")
            return False
        restarted = self._run_id is not None and run_id != self._run_id
        if restarted:
            log.warning("%s: Redis restarted (run_id changed); rewriting this worker's state", self.name)
        self._run_id = run_id
        return restarted

    def _finish(self, n: int) -> None:
        with self._cv:
            self._unfinished -= n
            self._busy = False
            self._cv.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued item is handled and nothing awaits a resync; False on timeout.

        During an outage this returns False (a resync is pending until Redis answers).
        """
        with self._cv:
            return self._cv.wait_for(
                lambda: self._unfinished == 0 and not self._resync_pending and not self._busy, timeout
            )

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued if Redis answers (bounded by ``timeout``), then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._stop.set()
        # A call in flight may take up to the client's own timeout: do not close under it.
        self._thread.join(timeout + (self.client_timeout_s or self.config.socket_timeout_s))
        self._client.close()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
