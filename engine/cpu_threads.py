"""Torch's CPU threads in a worker process: one OpenMP team, the engine loop's.

Torch runs its CPU ops on OpenMP (GNU libgomp here). Each thread that runs a parallel op gets a
team of OpenMP threads of its own, kept for as long as that thread lives. Once a process holds more
OpenMP threads than it has CPUs, libgomp stops spinning between parallel regions ("throttled"
waiting) and every region of every team pays a sleep and a wake-up. A decode step runs hundreds of
regions, so a second team alive anywhere in the process slows the engine: measured on 2 cores,
SmolLM2-135M float32, 4 sequences, torch on 2 threads, a decode step took 93 ms on 1.4 cores with a
long-lived helper thread that had made one large ``copy_``, against 69 ms on 2 cores without it.

A worker therefore leaves torch's threads to the one thread that steps its engine:

- the engine is built on a thread that ends when it is built (``on_passing_thread``), so the team
  that loading the weights made ends with it;
- helper threads that touch tensors (KV pulls, the transfer server's handlers) call
  ``single_threaded_torch()`` first; their copies are memory-bound and gain little from a team.

With one torch thread per worker (the default ``cpus_per_worker`` 1) there are no teams and none of
this matters.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def _omp_set_num_threads() -> Callable[[int], None] | None:
    """OpenMP's ``omp_set_num_threads`` (the standard API, per calling thread) from the OpenMP
    runtime torch loaded; None when torch does not run on OpenMP."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    fn = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    return fn


_SET_THREADS = _omp_set_num_threads()


def single_threaded_torch() -> None:
    """Make torch's CPU ops on the calling thread run on that thread alone; other threads keep
    their thread counts. Call it at the start of a helper thread (an executor's ``initializer``).
    No effect where torch does not run on OpenMP."""
    if _SET_THREADS is None:
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP count at its first use: let it, then override
    _SET_THREADS(1)


def set_torch_threads(n: int) -> None:
    """Run torch's CPU ops of the calling thread (the engine loop's) on ``n`` threads from now on."""
    torch.set_num_threads(n)


def torch_threads() -> int:
    """The CPU threads torch runs a parallel op with (the engine loop's, where nothing confined it)."""
    return torch.get_num_threads()


def on_passing_thread(fn: Callable[[], T], name: str = "build") -> T:
    """``fn()`` run on a new thread that ends with it: whatever OpenMP team it made ends too.
    Returns its result or raises what it raised."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
