"""CoreShare: the CPU workers of one host lend each other the cores they leave idle.

On a CPU host each worker runs torch on the CPUs Ray gave it (``--prefill-cpus``/``--decode-cpus``,
one by default): a 1P+1D service on two cores gives each worker one. A decode worker's steps then
use half the machine while the prefill worker waits for its next prompt, and a prefill worker's
steps half of it while no decode runs. A CoreShare makes the split work-conserving: a worker whose
engine has work runs torch on its own CPUs plus those of every worker of the host that is idle at
the start of the step, and gives them back at its next step once their owner is busy again. An
owner that turns busy while a peer's step runs on its cores waits for that step to end (at most
``RECLAIM_WAIT_S``) rather than start a team beside it: two OpenMP teams on one core make every
parallel region of both wait for a time slice, and the borrower's step (a decode step whose tokens
clients are waiting for) would take several times as long.

The workers of a host (this user's, every service) meet in one table: a file mapped by each, of
``SLOTS`` slots of (pid, CPUs, busy, CPUs borrowed by its current step). A worker claims a slot at
start (under an exclusive lock of the file), writes its busy flag and what it borrows when its
engine loop starts a step and when it waits, and reads the table before each step (a few
microseconds). A slot whose process is gone counts for nothing
and is claimed again.

Guarantees and limits:

- A worker never runs on fewer threads than its own CPUs nor on more than the host has.
- Borrowed cores are returned at a step boundary: after a worker turns busy, a peer that borrowed
  its cores keeps them for at most the peer's current step, and the owner's first step waits for
  that step's end, for at most ``RECLAIM_WAIT_S``.
- Only the cores of registered workers are lent: a core that no pdserve worker owns is never taken.
- Cores that other programs keep busy are not borrowed: what the host's processes outside the table
  used over the last half second (``worker/outside_load.py``), beyond the cores no worker owns, is
  taken off what idle workers lend, so a busy host does not get an OpenMP team larger than the cores
  free to it.
- The file is the user's own (mode 0600, in the user's private runtime directory when there is one,
  else the temp directory, opened without following links); when it is not, or cannot be made,
  the worker runs on its own CPUs and says why once.

This module does not import torch: the caller passes the function that sets the thread count.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

from pdserve.kvtransfer.shm_socket import own_runtime_dir
from pdserve.worker.outside_load import OutsideLoad

logger = logging.getLogger(__name__)

TABLE_NAME = "pdserve-cores-{uid}.table"
SLOTS = 64
_SLOT = struct.Struct("<iIiI")  # pid (0: free), CPUs, busy (0/1), CPUs borrowed by the current step
_TABLE_BYTES = SLOTS * _SLOT.size
# How long a worker that turns busy waits for a peer's step on its cores to end: a few decode steps.
RECLAIM_WAIT_S = 0.25
_RECLAIM_POLL_S = 0.001  # its cores are the peer's meanwhile: waking a thousand times a second costs ~1%


def table_path(base: str | None = None) -> str:
    """Where this user's table lies: under ``base``, else the user's runtime directory when it is
    theirs and private, else the system's temp directory."""
    if base is None:
        base = own_runtime_dir() or tempfile.gettempdir()
    return os.path.join(base, TABLE_NAME.format(uid=os.geteuid()))


def host_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, but never in this user's table
    return True


def _open_table(path: str) -> int:
    """The table's file descriptor, the file created 0600 and sized if new. Raises OSError when
    the path is a link, not a regular file, or not this user's alone."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OSError(f"{path} is not a private file of this user")
        if st.st_size < _TABLE_BYTES:
            with _locked(fd):
                if os.fstat(fd).st_size < _TABLE_BYTES:
                    os.ftruncate(fd, _TABLE_BYTES)
        return fd
    except BaseException:
        os.close(fd)
        raise


class _locked:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class _Scan(NamedTuple):
    idle: int  # CPUs of the other live workers that are idle
    owned: int  # CPUs of every live worker, this one's included
    stepping: int  # CPUs the other live workers' current steps run on (their own and borrowed)
    pids: list[int]  # every live worker's, this one's first


class CoreShare:
    """One worker's place in its host's table (see the module docstring).

    ``cpus``: the worker's own CPUs (its threads when nothing is lent, >= 1). ``set_threads`` is
    called on the stepping thread with the count for the coming step, only when it changes.
    ``before_step`` and ``idle`` must be called from that one thread; ``close`` from any, once.
    """

    def __init__(self, cpus: int, set_threads: Callable[[int], None], path: str | None = None,
                 max_cpus: int | None = None, outside: OutsideLoad | None = None,
                 reclaim_wait_s: float = RECLAIM_WAIT_S) -> None:  # fmt: skip
        if cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        if reclaim_wait_s < 0:
            raise ValueError(f"reclaim_wait_s must be >= 0, got {reclaim_wait_s}")
        self.cpus = cpus
        self.reclaim_wait_s = reclaim_wait_s
        self.max_cpus = max(cpus, max_cpus if max_cpus is not None else host_cpus())
        self.path = path or table_path()
        self._set_threads = set_threads
        self.outside = outside if outside is not None else OutsideLoad()
        self.threads = cpus
        self._busy = False
        self._borrowed = 0  # as this worker's slot says
        self._fd = _open_table(self.path)
        try:
            self._map = mmap.mmap(self._fd, _TABLE_BYTES)
            self._slot = self._claim()
        except BaseException:
            os.close(self._fd)
            raise

    def _claim(self) -> int:
        pid = os.getpid()
        with _locked(self._fd):
            for i in range(SLOTS):
                owner = _SLOT.unpack_from(self._map, i * _SLOT.size)[0]
                if owner == 0 or (owner != pid and not _alive(owner)):
                    _SLOT.pack_into(self._map, i * _SLOT.size, pid, self.cpus, 0, 0)
                    return i
        raise OSError(f"{self.path}: all {SLOTS} slots are taken by live workers")

    @property
    def busy(self) -> bool:
        """Whether this worker is marked as stepping."""
        return self._busy

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _scan(self) -> _Scan:
        """The other live workers of the host, as the table says now."""
        pid = os.getpid()
        idle, owned, stepping, pids = 0, self.cpus, 0, [pid]
        for owner, cpus, busy, borrowed in _SLOT.iter_unpack(self._map):
            if owner and owner != pid and _alive(owner):
                owned += cpus
                pids.append(owner)
                if busy:
                    stepping += cpus + borrowed
                else:
                    idle += cpus
        return _Scan(idle, owned, stepping, pids)

    def lendable(self) -> int:
        """The CPUs that the other live workers of the host leave idle right now."""
        return self._scan().idle

    def borrowable(self) -> int:
        """What this worker may borrow now: the idle workers' CPUs, less what programs outside the
        table keep busy beyond the cores no worker owns (a core counts while a quarter of it is free)."""
        scan = self._scan()
        if not scan.idle:
            return 0
        excess = max(0.0, self.outside.cores(scan.pids) - max(0, self.max_cpus - scan.owned))
        return max(0, min(scan.idle, int(scan.idle - excess + 0.75)))

    def _reclaim(self) -> None:
        """Wait until the steps of the other workers run on no more cores than this worker leaves
        them, at most ``reclaim_wait_s``. A borrower gives a core back at its next step or when it
        goes idle; a borrower that dies gives it back at once."""
        deadline = time.monotonic() + self.reclaim_wait_s
        while self._scan().stepping + self.cpus > self.max_cpus and time.monotonic() < deadline:
            time.sleep(_RECLAIM_POLL_S)

    def before_step(self) -> int:
        """Mark this worker busy and set the step's thread count: its own CPUs plus the idle
        workers', at most the host's. The first step after an idle period first waits for peers'
        steps on this worker's cores to end (``_reclaim``). Returns the count."""
        if not self._busy:
            self._busy = True
            self._write(1, 0)
            self._reclaim()
        threads = min(self.max_cpus, self.cpus + self.borrowable())
        if threads > self.cpus:
            # Announce the borrowing, then look again: an owner that turned busy in between (and saw
            # no borrowing yet) keeps its cores.
            self._write(1, threads - self.cpus)
            threads = min(threads, self.cpus + self.borrowable())
        if threads - self.cpus != self._borrowed:
            self._write(1, threads - self.cpus)
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        return threads

    def idle(self) -> None:
        """This worker has no step to run: its CPUs are the others' until its next step, and it
        holds none of theirs."""
        if self._busy and self._fd >= 0:
            self._busy = False
            self._write(0, 0)

    def _write(self, busy: int, borrowed: int) -> None:
        _SLOT.pack_into(self._map, self._slot * _SLOT.size, os.getpid(), self.cpus, busy, borrowed)
        self._borrowed = borrowed

    def close(self) -> None:
        """Leave the table (the slot is free for another worker)."""
        if self._fd < 0:
            return
        with _locked(self._fd):
            _SLOT.pack_into(self._map, self._slot * _SLOT.size, 0, 0, 0, 0)
        self._map.close()
        os.close(self._fd)
        self._fd = -1


def start_core_share(cpus: int, set_threads: Callable[[int], None], path: str | None = None,
                     reclaim_wait_s: float = RECLAIM_WAIT_S) -> CoreShare | None:  # fmt: skip
    """A CoreShare, or None (with a warning) when the host's table cannot be used."""
    try:
        return CoreShare(cpus, set_threads, path, reclaim_wait_s=reclaim_wait_s)
    except OSError as exc:
        logger.warning("not sharing idle CPUs with this host's other workers: %s", exc)
        return None
