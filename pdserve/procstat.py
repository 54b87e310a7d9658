"""A process's state and start time, read from ``/proc/PID/stat``, and temporary directories that
name their owner so that the next owner removes those a killed one left.

The start time (clock ticks since boot) tells a reused pid apart, so an owner recorded as
``(pid, start_time)`` is known to be gone even once its pid names another process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner"  # in an owned directory: "PID START_TIME" of the process that made it


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None when gone."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields else None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not) and, when ``start_time`` is given, is that same process."""
    fields = proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def child_pids(pid: int) -> set[int]:
    """The live (not zombie) children of ``pid``."""
    children = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[1]) == pid:
                children.add(int(entry.name))
    return children


def owner_stamp(pid: int) -> str | None:
    """``"PID START_TIME"`` of a running process, None when gone (or a zombie)."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else f"{pid} {fields[19]}"


def make_owned_dir(prefix: str) -> str:
    """A new private (0700) directory under the temp directory, stamped with this process as its owner,
    after removing this user's ``prefix`` directories whose owner is gone (a killed process runs no
    cleanup). The caller still removes its own directory when done."""
    sweep_dead_owners(prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    Path(path, OWNER_FILE).write_text(f"{owner_stamp(os.getpid()) or os.getpid()}\n")
    return path


def sweep_dead_owners(prefix: str, base: str | None = None) -> int:
    """Remove the directories named ``prefix*`` under ``base`` (default: the temp directory) that
    belong to this user and whose stamped owner is gone. Directories without a stamp (one being
    made) are kept; so is everything where there is no ``/proc`` to tell. Returns how many went."""
    base = base or tempfile.gettempdir()
    if owner_stamp(os.getpid()) is None:
        return 0
    removed = 0
    for entry in os.scandir(base):
        if not entry.name.startswith(prefix):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            stamp = Path(entry.path, OWNER_FILE).read_text().strip()
            if owner_stamp(int(stamp.split()[0])) != stamp:
                shutil.rmtree(entry.path)
                removed += 1
        except (OSError, ValueError, IndexError):  # removed meanwhile, not ours, or no stamp yet
            continue
    return removed
