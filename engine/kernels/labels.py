"""Names for the CPU kernels' calls in ``torch.profiler``, given only while a profiling run asks.

``torch.profiler.record_function`` costs about 5 us per call even with no profiler running (it enters
and leaves through two operator calls), and a decode step makes about 300 kernel calls (projections,
attention, norms): about 1.5 ms a step. torch offers no public way to ask whether a profiler runs, so
the kernels name their calls only inside :func:`labelled`, which a profiling run enters (``pdserve
bench steps`` and ``bench gemm`` do; so should anyone profiling the engine who wants the kernels'
names: without it their time shows as the calling operator's or Python's).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


class _Switch:
    """How many :func:`labelled` blocks are open (any thread): labels are on while there is one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0


_SWITCH = _Switch()


@contextmanager
def labelled() -> Iterator[None]:
    """While inside (in any thread, nested or not), the kernels' calls carry their profiler labels."""
    with _SWITCH.lock:
        _SWITCH.open += 1
    try:
        yield
    finally:
        with _SWITCH.lock:
            _SWITCH.open -= 1


def active() -> bool:
    """Whether a :func:`labelled` block is open (a profiling run that wants the kernels' names)."""
    return bool(_SWITCH.open)


def label(name: str) -> AbstractContextManager[object]:
    """``record_function(name)`` inside :func:`labelled`, else a context that does nothing."""
    return torch.profiler.record_function(name) if _SWITCH.open else nullcontext()
