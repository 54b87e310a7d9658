"""Ranks as child processes of the driver (``python -P -m pdserve.engine.parallel.rank_main``): the
launcher of an engine that runs on its own (``LLM``, benchmarks, tests). A rank's plans go down its
standard input, its report comes up its standard output, and it inherits the KV cache's memfd.

A rank imports nothing from the driver's current directory: ``-m`` alone would put that directory
first on the rank's ``sys.path``, so a module planted there (a ``json.py`` in a shared, writable
directory the operator happens to run from) would run in every rank."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from pdserve.engine.parallel.ranks import RankLauncher, RankLink, end_links

RANK_MODULE = "pdserve.engine.parallel.rank_main"


def rank_command(python: tuple[int, int] | None = None) -> list[str]:
    """The command line of a rank process: ``rank_main`` run with the current directory left off
    its import path (``-P``, Python 3.11+; before that, removed by hand before anything is imported
    from it). ``python``: the version to write it for (None: this interpreter's)."""
    if (python or sys.version_info[:2]) >= (3, 11):
        return [sys.executable, "-P", "-m", RANK_MODULE]
    # -c puts "" (the current directory) first on sys.path; only built-in and stdlib modules are
    # imported before it is dropped.
    boot = (f"import sys; del sys.path[0]; import runpy; "
            f"runpy.run_module({RANK_MODULE!r}, run_name='__main__', alter_sys=True)")  # fmt: skip
    return [sys.executable, "-c", boot]


class ProcessLink(RankLink):
    """A rank in a child process; closing its input ends it."""

    def __init__(self, rank: int, spec: dict[str, Any], kv_fd: int) -> None:
        self.rank = rank
        self.proc = subprocess.Popen(rank_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(kv_fd,))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.reports = self.proc.stdout
        body = json.dumps({**spec, "kv_fd": kv_fd}).encode()
        self.write(len(body).to_bytes(8, "little") + body)

    def write(self, frame: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()

    def exit_status(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"

    def close_input(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def finish(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class ProcessLauncher(RankLauncher):
    """Each rank a child process of this one (so on this host, by construction)."""

    shares_cpus = True

    def launch(self, specs: list[dict[str, Any]], kv_fd: int, deadline: float) -> list[RankLink]:
        links: list[RankLink] = []
        try:
            for spec in specs:
                links.append(ProcessLink(int(spec["rank"]), spec, kv_fd))
        except BaseException:
            end_links(links, 5.0)
            raise
        return links
