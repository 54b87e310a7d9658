"""engine/cpu_threads.py: helper threads make no OpenMP team of their own; the build thread's ends."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.engine.cpu_threads import on_passing_thread, single_threaded_torch
from tests.support.polling import wait_until

pytestmark = pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch without OpenMP")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """Torch on 2 threads for the test (the suite runs it on 1 under xdist)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_added_by_a_copy(setup: Callable[[], None]) -> tuple[int, int]:
    """Run ``setup`` then one large copy on a thread that stays alive (as a pool thread does);
    the torch thread count that thread sees and the OS threads the copy added to the process."""
    seen: list[int] = []
    copied, done = threading.Event(), threading.Event()

    def helper() -> None:
        before = _os_threads()
        setup()
        seen.append(torch.get_num_threads())
        src = torch.ones(1 << 24, dtype=torch.uint8)  # large enough to run as a parallel region
        torch.empty_like(src).copy_(src)
        seen.append(_os_threads() - before)
        copied.set()
        done.wait(30)

    at_start = _os_threads()
    thread = threading.Thread(target=helper)
    thread.start()
    try:
        assert copied.wait(30)
    finally:
        done.set()
        thread.join()
    assert wait_until(lambda: _os_threads() == at_start, timeout=30)  # its team ends with it
    return seen[0], seen[1]


def test_a_helper_thread_runs_torch_alone_and_others_keep_their_threads(two_torch_threads: None) -> None:
    # The control: an ordinary thread gets a team (the effect the helper avoids is real here).
    threads, added = _threads_added_by_a_copy(lambda: None)
    assert (threads, added) == (2, 1)
    threads, added = _threads_added_by_a_copy(single_threaded_torch)
    assert (threads, added) == (1, 0)
    assert torch.get_num_threads() == 2  # this thread, and the process's setting, are untouched


def test_a_passing_thread_returns_or_raises_and_its_team_ends(two_torch_threads: None) -> None:
    def build() -> int:
        src = torch.ones(1 << 24, dtype=torch.uint8)
        torch.empty_like(src).copy_(src)  # this thread's team
        return 7

    before = _os_threads()
    assert on_passing_thread(build) == 7
    assert wait_until(lambda: _os_threads() == before, timeout=30)  # the thread and its team end

    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_passing_thread(fail)
