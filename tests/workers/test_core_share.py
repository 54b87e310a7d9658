"""worker/core_share.py: a worker's steps take the cores its host's idle workers leave, and give
them back; a table that is not the user's own is refused.

The peers are real processes (a worker's table is shared between processes, never within one)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve.worker.core_share import CoreShare, start_core_share
from pdserve.worker.outside_load import OutsideLoad, host_busy_s, process_cpu_s
from tests.support.polling import wait_until

PEER = """
import sys
from pdserve.worker.core_share import CoreShare
share = CoreShare(int(sys.argv[2]), lambda n: None, sys.argv[1], max_cpus=int(sys.argv[3]))
print(share._slot, flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "busy":
        print("ok", share.before_step(), flush=True)
        continue
    elif cmd == "idle":
        share.idle()
    elif cmd == "close":
        share.close()
        print("closed", flush=True)
        break
    print("ok", flush=True)
"""


class Peer:
    """Another worker process in the same table, driven step by step."""

    def __init__(self, path: str, cpus: int, max_cpus: int = 64) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, path, str(cpus), str(max_cpus)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.slot = int(self._read())

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the peer process ended"
        return line.strip()

    def tell(self, cmd: str) -> int | None:
        """Send ``cmd``; for ``busy``, the peer's thread count for its step."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        answer = self._read().split()
        assert answer[0] in ("ok", "closed")
        return int(answer[1]) if len(answer) > 1 else None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.tell("close")
            self.proc.wait(timeout=30)


class Outside:
    """What programs outside the table use, as the test sets it (the machine's real load varies)."""

    def __init__(self, cores: float = 0.0) -> None:
        self.value = cores
        self.asked: list[list[int]] = []

    def cores(self, pids) -> float:
        self.asked.append(list(pids))
        return self.value


def share(table: str, cpus: int, max_cpus: int, outside: float = 0.0, threads: list[int] | None = None,
          reclaim_wait_s: float = 60.0) -> CoreShare:  # fmt: skip
    sink = threads.append if threads is not None else (lambda n: None)
    return CoreShare(cpus, sink, table, max_cpus=max_cpus, outside=Outside(outside),  # type: ignore[arg-type]
                     reclaim_wait_s=reclaim_wait_s)  # fmt: skip


class Stepping:
    """``share.before_step()`` on a thread of its own: an owner waiting for its cores."""

    def __init__(self, share: CoreShare) -> None:
        self.threads: int | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(share,), daemon=True)
        self._thread.start()
        assert wait_until(lambda: share.busy)  # marked busy: now waiting, or (wrongly) already done

    def _run(self, share: CoreShare) -> None:
        self.threads = share.before_step()
        self.done.set()

    def join(self) -> int | None:
        assert self.done.wait(30)
        self._thread.join(30)
        return self.threads


@pytest.fixture()
def table(tmp_path: Path) -> str:
    return str(tmp_path / "cores.table")


def test_a_step_borrows_what_idle_peers_leave_and_gives_it_back(table: str) -> None:
    threads: list[int] = []
    me = share(table, 1, 8, threads=threads)
    assert me.before_step() == 1 and threads == []  # alone: its own CPU, nothing to set
    peer = Peer(table, 2)
    try:
        assert me.before_step() == 3  # the peer's engine is idle: its 2 CPUs are lent
        peer.tell("busy")
        assert me.before_step() == 1  # the peer steps again: returned at this step
        peer.tell("idle")
        assert me.before_step() == 3
        assert threads == [3, 1, 3]  # set only when the count changes
        me.idle()
        peer.tell("busy")
        assert me.lendable() == 0
    finally:
        peer.end()
        me.close()


def test_an_owner_turning_busy_waits_for_the_step_on_its_core_to_end(table: str) -> None:
    """Two workers of one core each on a 2-core host. The peer borrows the idle worker's core; that
    worker turns busy during the peer's step and waits: the peer's next step runs on its own core
    and only then does the owner's step start. Their teams never share a core."""
    me = share(table, 1, 2)
    peer = Peer(table, 1, max_cpus=2)
    try:
        assert peer.tell("busy") == 2  # borrowed
        owner = Stepping(me)
        assert not owner.done.is_set()  # the peer's step is still on its core
        assert peer.tell("busy") == 1  # the peer's next step gives it back ...
        assert owner.join() == 1  # ... and the owner's step starts
        me.idle()
        assert peer.tell("busy") == 2
        owner = Stepping(me)
        assert not owner.done.is_set()
        peer.tell("idle")  # a borrower that goes idle gives the core back too
        assert owner.join() == 2  # and lends its own
    finally:
        peer.end()
        me.close()


def test_an_owner_waits_at_most_reclaim_wait_and_not_for_a_dead_borrower(table: str) -> None:
    me = share(table, 1, 2, reclaim_wait_s=0.05)
    peer = Peer(table, 1, max_cpus=2)
    try:
        assert peer.tell("busy") == 2
        assert me.before_step() == 1  # the borrower never stepped again: the owner went on
    finally:
        peer.end()
        me.close()
    me = share(table, 1, 2)
    peer = Peer(table, 1, max_cpus=2)
    try:
        assert peer.tell("busy") == 2
        owner = Stepping(me)
        assert not owner.done.is_set()
        peer.kill()
        assert owner.join() == 1
    finally:
        peer.end()
        me.close()
    with pytest.raises(ValueError, match="reclaim_wait_s"):
        share(table, 1, 2, reclaim_wait_s=-1)


def test_a_borrower_gives_back_what_an_owner_took_between_its_looks(table: str) -> None:
    """A borrower announces what it borrows and then looks again: an owner that turned busy in
    between keeps its core (the owner saw no borrowing and did not wait)."""
    peer = Peer(table, 1, max_cpus=2)
    me: CoreShare | None = None
    try:
        me = share(table, 1, 2)
        looks = iter([1, 0])  # the first look sees the peer idle, the second sees it busy
        me.borrowable = lambda: next(looks)  # type: ignore[method-assign]
        assert me.before_step() == 1
    finally:
        peer.end()
        if me is not None:
            me.close()


def test_never_more_threads_than_the_host_has(table: str) -> None:
    me = share(table, 1, 2)
    peers = [Peer(table, 2), Peer(table, 1)]
    try:
        assert me.lendable() == 3
        assert me.before_step() == 2
    finally:
        for p in peers:
            p.end()
        me.close()


def test_a_killed_or_closed_peer_lends_nothing_and_its_slot_is_taken_again(table: str) -> None:
    me = share(table, 1, 8)
    killed, closed = Peer(table, 2), Peer(table, 3)
    try:
        assert me.lendable() == 5
        killed.kill()  # no close: its slot still names it
        assert me.lendable() == 3
        closed.end()
        assert me.lendable() == 0
        again = Peer(table, 1)
        try:
            assert again.slot in (killed.slot, closed.slot)
            assert me.lendable() == 1
        finally:
            again.end()
    finally:
        killed.end()
        closed.end()
        me.close()


def test_workers_of_one_process_lend_each_other_nothing(table: str) -> None:
    """Torch's thread count is the process's: two workers built in one process (tests, benchmarks)
    take separate slots and do not count each other."""
    a, b = share(table, 1, 8), share(table, 2, 8)
    try:
        assert a._slot != b._slot
        assert a.lendable() == 0 and b.lendable() == 0
    finally:
        a.close()
        b.close()


def test_cores_that_other_programs_keep_busy_are_not_borrowed(table: str) -> None:
    """Two workers own the host's 4 cores; the other one idles. What programs outside the table use
    comes off what it lends; a core still counts while a quarter of it is free."""
    me = share(table, 2, 4)
    peer = Peer(table, 2)
    try:
        for outside, borrowed in [(0.0, 2), (0.7, 2), (1.0, 1), (1.8, 0), (2.5, 0)]:
            me.outside.value = outside  # type: ignore[attr-defined]
            assert me.before_step() == 2 + borrowed, outside
        assert sorted(me.outside.asked[-1]) == sorted([os.getpid(), peer.proc.pid])  # type: ignore[attr-defined]
    finally:
        peer.end()
        me.close()
    # Cores no worker owns take outside load first: of 8 cores the workers own 3; 6 busy outside fill
    # the 5 others and one of the idle peer's 2.
    me = share(table, 1, 8, outside=6.0)
    peer = Peer(table, 2)
    try:
        assert me.before_step() == 1 + 1
    finally:
        peer.end()
        me.close()


def test_outside_load_is_the_hosts_busy_time_less_the_tables_processes() -> None:
    """Measured for real, side by side over the same windows: a busy process counts as outside
    load for a measure that does not list it, and not for one that does (from the second window:
    a process new in the list counts as outside for its first). Other load on the machine counts
    for both alike."""
    assert host_busy_s() is not None and process_cpu_s(os.getpid()) is not None
    assert process_cpu_s(2**22 + 12345) is None  # no such process (above the largest pid)
    me = os.getpid()
    without, with_it = OutsideLoad(window_s=0.2), OutsideLoad(window_s=0.2)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:

        def gap() -> float:
            return without.cores([me]) - with_it.cores([me, hog.pid])

        assert wait_until(lambda: gap() >= 0.2, timeout=60)
    finally:
        hog.kill()
        hog.wait(timeout=30)


def test_a_table_planted_by_someone_else_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An attacker who can write the directory plants the table's name first: a link to a file of
    the victim's, a file others can write, or (as root here) a file another user owns. The worker
    then runs on its own CPUs, leaves the planted file as it was, and says why."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "link.table"
    link.symlink_to(victim)
    shared = tmp_path / "shared.table"
    shared.write_bytes(b"")
    shared.chmod(0o666)
    planted = [str(link), str(shared)]
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign.table"
        foreign.write_bytes(b"")
        foreign.chmod(0o600)
        os.chown(foreign, 65534, 65534)
        planted.append(str(foreign))
    with caplog.at_level(logging.WARNING, logger="pdserve.worker.core_share"):
        for path in planted:
            assert start_core_share(1, lambda n: None, path) is None
    assert victim.read_bytes() == b"precious" and shared.stat().st_size == 0
    assert sum("not sharing idle CPUs" in r.getMessage() for r in caplog.records) == len(planted)
    ok = start_core_share(1, lambda n: None, str(tmp_path / "own.table"))
    assert ok is not None
    assert (tmp_path / "own.table").stat().st_mode & 0o777 == 0o600
    ok.close()
