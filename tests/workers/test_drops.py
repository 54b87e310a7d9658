"""Drops (``worker/drops.py``) alone: which call a drop reaches, and how long an early one is kept."""

from __future__ import annotations

import pytest

from pdserve.worker.drops import Drops


class Call:
    def __init__(self) -> None:
        self.dropped = 0

    def __call__(self) -> None:
        self.dropped += 1


def test_a_drop_reaches_the_running_call_of_its_id_only() -> None:
    drops, a, b = Drops(), Call(), Call()
    assert drops.begin("a", a) and drops.begin("b", b) and drops.num_running == 2
    assert drops.drop("a") is True
    assert (a.dropped, b.dropped) == (1, 0)
    drops.end("a", a)
    drops.end("b", b)
    assert drops.num_running == 0 and drops.num_kept == 0
    assert drops.drop("a") is False and a.dropped == 1  # ended: no longer reached (kept instead)


def test_a_drop_before_its_call_began_ends_that_call_once_within_keep_s() -> None:
    now = [0.0]
    drops = Drops(keep_s=60.0, clock=lambda: now[0])
    assert drops.drop("early") is False and drops.num_kept == 1
    assert drops.kept("early") and drops.kept("early") and not drops.kept("other")  # asking keeps it
    assert drops.begin("early", Call()) is False  # ends as it begins
    assert drops.begin("early", Call()) is True  # once: the drop is used up
    drops.drop("late")
    now[0] = 61.0
    assert not drops.kept("late")
    assert drops.begin("late", Call()) is True and drops.num_kept == 0  # kept keep_s, no longer


def test_drops_kept_are_bounded_the_oldest_forgotten_first() -> None:
    drops = Drops(max_kept=3)
    for i in range(5):
        drops.drop(f"r{i}")
    assert drops.num_kept == 3
    assert drops.begin("r1", Call()) is True and drops.begin("r2", Call()) is False


def test_a_second_call_of_a_running_id_does_not_take_the_first_ones_drops() -> None:
    drops, first, second = Drops(), Call(), Call()
    assert drops.begin("r", first) and drops.begin("r", second)
    drops.end("r", second)  # the second ends (its registration failed): the first is still reachable
    assert drops.drop("r") is True and (first.dropped, second.dropped) == (1, 0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="keep_s"):
        Drops(keep_s=0)
    with pytest.raises(ValueError, match="max_kept"):
        Drops(max_kept=0)
