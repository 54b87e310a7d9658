"""Processes by pid, read from /proc: which network namespace, stopping every process in one, the
processes a run started or saw (``RunProcesses``), and polling until something holds (liveness and
start times: ``pdserve.procstat``).

Namespaces share the process table, so ``ray stop`` or a ``pkill`` would reach every node (and every Ray
on the machine); the harness stops only the processes whose network namespace (``/proc/PID/ns/net``) is
one of its run's, by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from pdserve.cluster.simnet.errors import SimnetError
from pdserve.cluster.simnet.netns import NETNS_DIR
from pdserve.procstat import proc_start_time, proc_stat

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy and return that; SimnetError naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise SimnetError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def pids_in_netns(ns: str) -> set[int]:
    """Processes whose network namespace is ``ns`` (what ``ip netns pids`` lists), read from /proc."""
    try:
        st = os.stat(NETNS_DIR / ns)
    except OSError:
        return set()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            pst = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:  # gone, or a zombie (it has no namespaces any more)
            continue
        if (pst.st_dev, pst.st_ino) == (st.st_dev, st.st_ino):
            found.add(int(entry.name))
    return found


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` and every live process below them (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        if pid != os.getpid():  # never ourselves, whatever a namespace holds
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def empty_netns(ns: str, keep: Callable[[], set[int]] = set, grace: float = 1.0, timeout: float = 10.0) -> set[int]:
    """Stop every process in network namespace ``ns`` except those ``keep()`` names; returns their pids.

    SIGTERM first, SIGKILL to whatever is left after ``grace`` seconds (at once, without SIGTERM, when
    ``grace`` is 0), repeated until none is left (a dying raylet may still start a worker). SimnetError
    when some survive ``timeout`` seconds.
    """
    stopped: set[int] = set()

    def left() -> set[int]:
        pids = pids_in_netns(ns) - keep() - {os.getpid()}
        stopped.update(pids)
        return pids

    if grace > 0:
        _signal(left(), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while left() and time.monotonic() < deadline:
            time.sleep(0.05)
    deadline = time.monotonic() + timeout
    while pids := left():
        if time.monotonic() >= deadline:
            raise SimnetError(f"processes {sorted(pids)} in {ns} survive SIGKILL")
        _signal(pids, signal.SIGKILL)
        time.sleep(0.05)
    return stopped


class RunProcesses:
    """The processes of a run: those it started (``start``) and every pid seen in its namespaces
    (``record``), each with its start time, so a reused pid is told apart."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[Any]] = []
        self.recorded: dict[int, int] = {}  # pid -> start time

    def start(self, argv: Sequence[str], env: Mapping[str, str], **popen: Any) -> subprocess.Popen[Any]:
        """Popen ``argv`` in a session of its own, tracked and recorded."""
        proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True, **popen)
        self.started.append(proc)
        self.record([proc.pid])
        return proc

    def record(self, pids: Iterable[int]) -> None:
        for pid in pids:
            start = proc_start_time(pid)
            if start is not None:
                self.recorded.setdefault(pid, start)

    def running(self, but: subprocess.Popen[Any] | None = None) -> list[int]:
        """Pids of the started processes that still run, ``but`` excepted."""
        return [p.pid for p in self.started if p is not but and p.poll() is None]

    def reap(self) -> list[str]:
        """Kill every started process still running and reap it (a zombie child would keep its pid);
        returns those that do not exit."""
        problems = []
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append(f"pid {proc.pid} does not exit")
        return problems
