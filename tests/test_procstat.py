"""Owned temporary directories: a killed owner runs no cleanup, so the next owner of the same kind
removes what it left (real processes, real /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pdserve.procstat import OWNER_FILE, make_owned_dir, owner_stamp, proc_start_time, process_alive
from tests.support import REPO
from tests.support.polling import process_gone, wait_until


def test_a_killed_owners_directory_goes_when_the_next_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its own temp directory: no other test sweeps it
    script = ("from pdserve.procstat import make_owned_dir\nprint(make_owned_dir('pdserve-tp-'), flush=True)\n"
              "import time\ntime.sleep(600)\n")  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert owner.stdout is not None
        killed = Path(owner.stdout.readline().strip())
        assert killed.parent == tmp_path and killed.name.startswith("pdserve-tp-")
        assert (killed / OWNER_FILE).read_text().split()[0] == str(owner.pid)
        live = make_owned_dir("pdserve-tp-")  # the owner still runs: its directory stays
        assert killed.is_dir() and Path(live).is_dir()
        owner.kill()
        owner.wait(timeout=30)
        assert wait_until(lambda: process_gone(owner.pid), timeout=30)
        unstamped = tmp_path / "pdserve-tp-being-made"  # no stamp yet: kept
        unstamped.mkdir()
        other_kind = tmp_path / "pdserve-redis-x"  # another prefix: not this sweep's
        other_kind.mkdir()
        (other_kind / OWNER_FILE).write_text(f"{owner.pid} 1\n")
        newest = make_owned_dir("pdserve-tp-")
        assert not killed.exists()
        assert Path(live).is_dir() and Path(newest).is_dir() and unstamped.is_dir() and other_kind.is_dir()
        assert oct(Path(newest).stat().st_mode & 0o777) == "0o700"
    finally:
        owner.kill()


def test_a_reused_pid_is_not_its_old_owner() -> None:
    me = os.getpid()
    assert owner_stamp(me) == f"{me} {proc_start_time(me)}" and process_alive(me, proc_start_time(me))
    assert not process_alive(me, (proc_start_time(me) or 0) + 1)  # same pid, another start: another process
