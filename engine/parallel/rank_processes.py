"""Ranks as child processes of the driver (``python -m pdserve.engine.parallel.rank_main``): the
launcher of an engine that runs on its own (``LLM``, benchmarks, tests). A rank's plans go down its
standard input, its report comes up its standard output, and it inherits the KV cache's memfd."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from pdserve.engine.parallel.ranks import RankLauncher, RankLink, end_links


class ProcessLink(RankLink):
    """A rank in a child process; closing its input ends it."""

    def __init__(self, rank: int, spec: dict[str, Any], kv_fd: int) -> None:
        self.rank = rank
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.parallel.rank_main"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(kv_fd,))  # fmt: skip
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
