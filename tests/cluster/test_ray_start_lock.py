"""Local Ray starts of one user take turns (a file lock), and a lock file that cannot be opened
(a link put in its place) does not stop a start."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest

from pdserve.cluster import launcher


def test_a_second_start_waits_for_the_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    first_in, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        with launcher._one_local_start_at_a_time():
            order.append("first in")
            first_in.set()
            release.wait(30)
            order.append("first out")

    def second() -> None:
        with launcher._one_local_start_at_a_time():
            order.append("second in")

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(30)
    b = threading.Thread(target=second)
    b.start()
    b.join(0.3)  # a chance to get in wrongly: it cannot while the first holds the lock
    assert b.is_alive() and order == ["first in"]
    release.set()
    a.join(30)
    b.join(30)
    assert order == ["first in", "first out", "second in"]
    assert (tmp_path / f"pdserve-ray-start-{os.getuid()}.lock").stat().st_mode & 0o777 == 0o600


def test_a_link_in_place_of_the_lock_file_is_not_followed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    target = tmp_path / "victim"
    target.write_text("kept")
    (tmp_path / f"pdserve-ray-start-{os.getuid()}.lock").symlink_to(target)
    with launcher._one_local_start_at_a_time():
        pass
    assert target.read_text() == "kept"
    assert "starting without it" in capsys.readouterr().err
