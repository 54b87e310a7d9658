"""The driver's side of a tensor-parallel worker: ranks 1..N-1 as child processes.

The engine's own process is rank 0 (the driver): it holds the scheduler, the block pool and the
sampler, and before each forward sends the step's plan (``step_plan``) down every other rank's
standard input; then all ranks run the same forward, joined by the group's collectives. The KV
cache is one shared-memory tensor (``KVTensor(shared=True)``) that every rank maps and in which
each rank reads and writes only its own heads' slice, so block ids, block bytes and everything
that moves blocks (the KV wire, the offload tier) are those of a single-device worker.

Lifetime: :class:`RankProcesses` owns the children. A rank that dies fails the step it was in (its
sockets close: the driver's collective raises at once) or the next send (its pipe is closed),
with an error naming it; the worker cannot step again (:attr:`failure`). :meth:`close` ends every
child (closing its input ends it; a kill after a grace period).
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.parallel.group import TPGroup

logger = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """A tensor-parallel rank of this worker died or stopped answering: it cannot step again."""


class RankProcesses:
    """Start ranks ``1..size-1`` of a worker whose rank 0 is this process, each loading its shard.

    ``spec``: what every rank needs besides its number (model path, dtype, layout...: see
    ``rank_main``). Returns once every rank has loaded its shard and joined :attr:`group`;
    RuntimeError naming the rank and its error when one fails to, or takes longer than
    ``start_timeout_s`` (every child started is ended first).

    ``on_lost``: called once (from a watcher thread) with the reason when a rank exits before
    :meth:`close`, even while the worker is idle; a serving worker ends its process there so that
    its supervisor (Ray) restarts it whole.
    """

    def __init__(self, spec: dict[str, Any], kv: KVTensor, size: int, collective_timeout_s: float,
                 start_timeout_s: float, on_lost: Callable[[str], None] | None = None) -> None:  # fmt: skip
        if kv.fd is None:
            raise ValueError("tensor-parallel ranks share the KV cache: make it with KVTensor(shared=True)")
        self.size = size
        self.failure: str | None = None
        self._closed = threading.Event()
        self._on_lost = on_lost
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")  # mode 0700: the group's rendezvous file
        self._procs: list[subprocess.Popen[bytes]] = []
        store = os.path.join(self._dir, "store")
        try:
            for rank in range(1, size):
                self._procs.append(self._spawn({**spec, "rank": rank, "size": size, "kv_fd": kv.fd,
                                                "store": store, "timeout_s": collective_timeout_s}, kv.fd))  # fmt: skip
            self._wait_loaded(time.monotonic() + start_timeout_s)
            self.group = TPGroup(store, 0, size, collective_timeout_s)
            # Past this barrier every rank has joined: the rendezvous file is done with. Removed now, it
            # is not left behind by a worker that is killed rather than closed.
            self.group.barrier()
            shutil.rmtree(self._dir, ignore_errors=True)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            why = self.exited()
            if why is not None:
                self.fail(why)
                if self._on_lost is not None and not self._closed.is_set():
                    self._on_lost(why)
                return

    @staticmethod
    def _spawn(spec: dict[str, Any], fd: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.parallel.rank_main"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,))  # fmt: skip
        assert proc.stdin is not None
        body = json.dumps(spec).encode()
        proc.stdin.write(len(body).to_bytes(8, "little") + body)
        proc.stdin.flush()
        return proc

    def _wait_loaded(self, deadline: float) -> None:
        waiting = {p.stdout.fileno(): (rank, p) for rank, p in enumerate(self._procs, 1) if p.stdout is not None}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel rank(s) {sorted(r for r, _ in waiting.values())} did not load "
                                   "their shard in time (ParallelConfig.start_timeout_s)")  # fmt: skip
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                rank, proc = waiting.pop(fd)
                assert proc.stdout is not None
                line = proc.stdout.readline()
                try:
                    message = json.loads(line) if line else {}
                except ValueError:
                    message = {}
                if not message.get("loaded"):
                    why = message.get("error") or f"exited with code {proc.wait(timeout=10)} before loading"
                    raise RuntimeError(f"tensor-parallel rank {rank}: {why}")

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, rank 1 first."""
        return [p.pid for p in self._procs]

    def send(self, frame: bytes) -> None:
        """Hand every rank the next step (RankLost when one is gone)."""
        if self.failure is not None:
            raise RankLost(self.failure)
        for rank, proc in enumerate(self._procs, 1):
            assert proc.stdin is not None
            try:
                proc.stdin.write(frame)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                self.fail(f"tensor-parallel rank {rank} exited with code {proc.poll()}")
                raise RankLost(self.failure) from None

    def fail(self, why: str, log: bool = True) -> None:
        """Mark the worker unable to step (the first reason is kept)."""
        if self.failure is None:
            self.failure = why
            if log:
                logger.error("%s: this worker cannot step any more", why)

    def exited(self, wait_s: float = 0.0) -> str | None:
        """Which rank has exited, and how, if one has (or does within ``wait_s``: a rank whose
        socket just closed may not have been reaped yet)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._procs, 1):
                if proc.poll() is not None:
                    return f"tensor-parallel rank {rank} exited with code {proc.returncode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        """End every rank (idempotent): closing a rank's input ends it; a kill after 5 s."""
        self._closed.set()
        for proc in self._procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs = []
        shutil.rmtree(self._dir, ignore_errors=True)
