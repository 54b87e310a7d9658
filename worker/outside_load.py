"""OutsideLoad: how many of the host's cores processes other than its pdserve workers kept busy.

A worker borrows an idle peer's cores only where nothing else runs on them: the router, Ray, a
client or any other program may use the cores the table says are idle, and an OpenMP team larger
than the cores free to it waits at its barriers for threads that are not running. The measure is
the host's busy CPU time (``/proc/stat``) less the CPU time of the workers in the table
(``/proc/PID/stat``), over windows of at least ``window_s``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def host_busy_s() -> float | None:
    """CPU seconds the host's CPUs spent busy since boot (all CPUs summed); None where ``/proc/stat``
    cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) * _TICK_S


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` (all its threads) has used; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


class OutsideLoad:
    """``cores(pids)``: cores busy outside the processes ``pids``, averaged over the last completed
    window of at least ``window_s`` (0 until one completes, and where the host's times cannot be
    read). A process new in a window counts as outside for that window. A window left open longer
    than ``stale_s`` (nobody asked meanwhile) is dropped, not averaged, and the last value stands
    until the next one completes."""

    def __init__(self, window_s: float = 0.5, stale_s: float = 5.0,
                 host_busy: Callable[[], float | None] = host_busy_s, process_cpu: Callable[[int], float | None] = process_cpu_s,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.window_s = window_s
        self.stale_s = stale_s
        self._host_busy = host_busy
        self._process_cpu = process_cpu
        self._clock = clock
        self._cores = 0.0
        self._start: tuple[float, float] | None = None
        self._cpu: dict[int, float] = {}

    def cores(self, pids: Iterable[int]) -> float:
        now = self._clock()
        if self._start is not None and now - self._start[0] < self.window_s:
            return self._cores
        host = self._host_busy()
        if host is None:
            return 0.0
        cpu = {pid: c for pid in pids if (c := self._process_cpu(pid)) is not None}
        if self._start is not None and now - self._start[0] <= self.stale_s:
            t0, host0 = self._start
            ours = sum(c - self._cpu.get(pid, c) for pid, c in cpu.items())
            self._cores = max(0.0, (host - host0 - ours) / (now - t0))
        self._start, self._cpu = (now, host), cpu
        return self._cores
