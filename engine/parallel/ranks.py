"""The driver's side of a tensor-parallel worker: ranks 1..N-1, wherever they run.

The engine's own process is rank 0 (the driver): it holds the scheduler, the block pool and the
sampler, and before each forward sends the step's plan (``step_plan``) to every other rank; then
all ranks run the same forward, joined by the group's collectives. The KV cache is one
shared-memory tensor (``KVTensor(shared=True)``) that every rank maps and in which each rank reads
and writes only its own heads' slice, so block ids, block bytes and everything that moves blocks
(the KV wire, the offload tier) are those of a single-device worker.

Where the other ranks run is a :class:`RankLauncher`'s business: child processes
(``rank_processes``, for an engine of its own) or Ray actors in the worker's placement group
(``rank_actors``, for a served worker). Each started rank is a :class:`RankLink`: a byte stream
for its plans, one for its reports, and a way to tell whether it is still there.

Lifetime: :class:`Ranks` owns them. A rank that dies fails the step it was in (its sockets close:
the driver's collective raises at once) or the next send (its input is closed), with an error
naming it; a rank that hangs fails the step after the collective timeout. Either way the worker
cannot step again (:attr:`Ranks.failure`): the watcher then ends every rank (a hung one is killed)
and reports the loss once (``on_lost``). :meth:`Ranks.close` ends every rank.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, BinaryIO

from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.parallel.group import TPGroup
from pdserve.procstat import make_owned_dir

logger = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """A tensor-parallel rank of this worker died or stopped answering: it cannot step again."""


class RankLink(ABC):
    """One started rank, as its driver sees it."""

    rank: int
    reports: BinaryIO  # the rank's report lines (one JSON object each)

    @abstractmethod
    def write(self, frame: bytes) -> None:
        """Send the rank a frame; OSError or ValueError when it is gone."""

    @abstractmethod
    def exit_status(self) -> str | None:
        """How the rank ended ("exited with code 1"), or None while it runs."""

    @abstractmethod
    def close_input(self) -> None:
        """Close the rank's input: a rank that reads it returns. Idempotent."""

    @abstractmethod
    def finish(self, deadline: float) -> None:
        """Wait until the rank ends or ``deadline`` (``time.monotonic()``) passes, then kill it and release
        its link. Idempotent."""


def end_links(links: list[RankLink], grace_s: float) -> None:
    """End every rank of ``links``: all inputs are closed first, then the ranks still running ``grace_s``
    later are killed (one grace for all, not one each)."""
    for link in links:
        link.close_input()
    deadline = time.monotonic() + grace_s
    for link in links:
        link.finish(deadline)


class RankLauncher(ABC):
    """Starts ranks 1..size-1 of one worker."""

    shares_cpus: bool = False  # True: the ranks run on the driver's CPUs, which it shares out among them

    @abstractmethod
    def launch(self, specs: list[dict[str, Any]], kv_fd: int, deadline: float) -> list[RankLink]:
        """Start one rank per spec (rank 1 first), each handed ``kv_fd`` (the shared KV cache's memfd)
        and its spec; return their links once all are started. RuntimeError (every rank started
        ended first) when one cannot be by ``deadline``."""

    def close(self) -> None:
        """Release what launching held (not the ranks: their links end them)."""


class Ranks:
    """Ranks ``1..size-1`` of a worker whose rank 0 is this process, each with its shard loaded.

    ``spec``: what every rank needs besides its number (model path, dtype, layout...: see
    ``rank_main``). Returns once every rank has loaded its shard and joined :attr:`group`;
    RuntimeError naming the rank and its error when one fails to, or takes longer than
    ``start_timeout_s`` (every rank started is ended first).

    ``on_lost``: called once (from a watcher thread) with the reason when the worker can no
    longer step before :meth:`close`: a rank exited (even while the worker is idle), or a step
    failed the group (:meth:`fail`: a rank that hung past the collective timeout). Every rank is
    ended first (one still running is killed after ``LOST_GRACE_S``); a serving worker ends its
    process there so that its supervisor (Ray) restarts it whole.
    """

    LOST_GRACE_S = 1.0  # how long the ranks of a lost worker get to return before they are killed
    WATCH_INTERVAL_S = 0.2

    def __init__(self, launcher: RankLauncher, spec: dict[str, Any], kv: KVTensor, size: int,
                 collective_timeout_s: float, start_timeout_s: float,
                 on_lost: Callable[[str], None] | None = None) -> None:  # fmt: skip
        if kv.fd is None:
            raise ValueError("tensor-parallel ranks share the KV cache: make it with KVTensor(shared=True)")
        self.size = size
        self.failure: str | None = None
        self.loaded: list[dict[str, Any]] = []  # each rank's report once loaded (its pid, where it runs), rank 1 first
        self._closed = threading.Event()
        self._on_lost = on_lost
        self._launcher = launcher
        self._links: list[RankLink] = []
        self._ending = threading.Lock()  # the watcher and close() may end the ranks at the same time
        # Mode 0700: the group's rendezvous file. Owned, so that the next worker removes one a worker
        # killed while its ranks started left behind.
        self._dir = make_owned_dir("pdserve-tp-")
        store = os.path.join(self._dir, "store")
        deadline = time.monotonic() + start_timeout_s
        try:
            specs = [{**spec, "rank": rank, "size": size, "store": store, "timeout_s": collective_timeout_s}
                     for rank in range(1, size)]  # fmt: skip
            self._links = launcher.launch(specs, kv.fd, deadline)
            self._wait_loaded(deadline)
            self.group = TPGroup(store, 0, size, collective_timeout_s)
            # Past this barrier every rank has joined: the rendezvous file is done with. Removed now, it
            # is not left behind by a worker that is killed rather than closed.
            self.group.barrier()
            shutil.rmtree(self._dir, ignore_errors=True)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    @property
    def rendezvous_dir(self) -> str:
        """The private directory of this worker's rendezvous (and launcher sockets); gone once started."""
        return self._dir

    def _watch(self) -> None:
        """Until :meth:`close`: once a rank exits or a step fails the group, end every rank and
        report the loss (``on_lost``), once."""
        while not self._closed.wait(self.WATCH_INTERVAL_S):
            why = self.exited()
            if why is not None:
                self.fail(why)
            if self.failure is not None:
                self._end_links(self.LOST_GRACE_S)
                if self._on_lost is not None and not self._closed.is_set():
                    self._on_lost(self.failure)
                return

    def _end_links(self, grace_s: float) -> None:
        """End every rank still linked (idempotent)."""
        with self._ending:
            end_links(self._links, grace_s)
            self._links = []

    def _wait_loaded(self, deadline: float) -> None:
        waiting = {link.reports.fileno(): link for link in self._links}
        loaded: dict[int, dict[str, Any]] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel rank(s) {sorted(k.rank for k in waiting.values())} did not "
                                   "load their shard in time (ParallelConfig.start_timeout_s)")  # fmt: skip
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                link = waiting.pop(fd)
                line = link.reports.readline()
                try:
                    message = json.loads(line) if line else {}
                except ValueError:
                    message = {}
                if not message.get("loaded"):
                    why = message.get("error") or self._ended(link, 10.0) or "ended before loading"
                    raise RuntimeError(f"tensor-parallel rank {link.rank}: {why}")
                loaded[link.rank] = message
        self.loaded = [loaded[link.rank] for link in self._links]

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank 1 first."""
        return [int(message["pid"]) for message in self.loaded]

    @staticmethod
    def _ended(link: RankLink, wait_s: float) -> str | None:
        deadline = time.monotonic() + wait_s
        while (why := link.exit_status()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return why

    def send(self, frame: bytes) -> None:
        """Hand every rank the next step (RankLost when one is gone)."""
        if self.failure is not None:
            raise RankLost(self.failure)
        for link in self._links:
            try:
                link.write(frame)
            except (OSError, ValueError):
                self.fail(f"tensor-parallel rank {link.rank} {self._ended(link, 1.0) or 'stopped reading its plans'}")
                raise RankLost(self.failure) from None

    def fail(self, why: str, log: bool = True) -> None:
        """Mark the worker unable to step (the first reason is kept). Before :meth:`close`, the
        watcher then ends the ranks and reports the loss (``on_lost``)."""
        if self.failure is None:
            self.failure = why
            if log:
                logger.error("%s: this worker cannot step any more", why)

    def exited(self, wait_s: float = 0.0) -> str | None:
        """Which rank has exited, and how, if one has (or does within ``wait_s``: a rank whose
        socket just closed may not have been reaped yet)."""
        deadline = time.monotonic() + wait_s
        while True:
            for link in self._links:
                if (why := link.exit_status()) is not None:
                    return f"tensor-parallel rank {link.rank} {why}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, grace_s: float = 5.0) -> None:
        """End every rank (idempotent): closing a rank's input ends it; the ranks still running
        ``grace_s`` after all inputs were closed are killed (one grace for all, not one each)."""
        self._closed.set()
        self._end_links(grace_s)
        self._launcher.close()
        shutil.rmtree(self._dir, ignore_errors=True)
