"""The CPU kernels name their calls for torch.profiler inside ``labels.labelled()`` only (labelling
costs two operator calls per kernel call, profiler or not)."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.engine.kernels import cpu_gemm, labels


def _names(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.skipif(cpu_gemm.panel() == 0, reason="the kernel is not built here")
def test_a_kernel_call_is_named_only_while_labelled() -> None:
    packed = cpu_gemm.PanelWeights(torch.randn(64, 32), None)
    x = torch.randn(4, 32)
    assert cpu_gemm.PROFILER_LABEL not in _names(lambda: packed(x))
    with labels.labelled():
        with labels.labelled():  # nested: still on after the inner one ends
            pass
        assert cpu_gemm.PROFILER_LABEL in _names(lambda: packed(x))
    assert cpu_gemm.PROFILER_LABEL not in _names(lambda: packed(x))


def test_labelled_in_one_thread_labels_every_thread() -> None:
    """A profiler sees every thread's calls, so the switch is the process's: entered in one thread,
    another thread's kernel calls are labelled too, until the last block ends."""
    inside, done = threading.Event(), threading.Event()

    def hold() -> None:
        with labels.labelled():
            inside.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(30)
        assert isinstance(labels.label("x"), torch.profiler.record_function)
    finally:
        done.set()
        t.join(30)
    assert not isinstance(labels.label("x"), torch.profiler.record_function)
