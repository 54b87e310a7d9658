"""A process's state and start time, read from ``/proc/PID/stat``.

The start time (clock ticks since boot) tells a reused pid apart, so an owner recorded as
``(pid, start_time)`` is known to be gone even once its pid names another process.
"""

from __future__ import annotations

from pathlib import Path


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
