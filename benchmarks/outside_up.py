"""What ``pdserve bench outside`` runs an outside load generator against: a ``pdserve up`` of its own,
and the model's tokenizer as a Hugging Face directory for the load generator's synthetic prompts.

``UpProcess`` starts ``pdserve up`` (1 prefill + 1 decode worker) as a child process, the way a user
starts it, on free ports and with a private state directory (the state file of a ``pdserve up`` the
user runs on this machine is left alone). It is ready once ``up`` prints ``http listening on
HOST:PORT``; ``stop`` sends SIGINT (``up`` drains, then stops its workers, router, Ray and Redis) and
waits. ``up``'s stderr goes to a file, from which ``access_statuses`` counts the router's access-log
lines by status: the server's own account of every request it ended or refused.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

READY_PREFIX = "http listening on "
# "pdserve.access: request <id> <status>": one line per request the router ended or refused
# (router/accounting.py, router/http_limits.py).
ACCESS_LINE = re.compile(r"pdserve\.access: request \S+ (\S+)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_tokenizer(model: str, out: Path) -> Path:
    """A directory that ``transformers.AutoTokenizer.from_pretrained`` loads as ``model``'s tokenizer.

    A checkpoint directory is its own (it has ``tokenizer.json``). For a GGUF file, pdserve's reading
    of the file's tokenizer (the one the server encodes with) is written to ``out`` as
    ``tokenizer.json`` plus a ``tokenizer_config.json`` naming the special tokens and the chat
    template: the load generator then counts tokens exactly as the server does, and needs neither
    the ``gguf`` package nor the Hub."""
    path = Path(model)
    if path.is_dir():
        return path
    from pdserve.engine.model.gguf_tokenizer import read_gguf_tokenizer

    tokenizer, info = read_gguf_tokenizer(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              **{name: token for name, token in info.special_tokens.items() if token},
              "chat_template": info.chat_template}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


class UpProcess:
    """``pdserve up --model MODEL --prefill 1 --decode 1`` on free ports, its state file in
    ``workdir/state``, its stderr in ``workdir/up.stderr``; ``extra`` adds flags. The constructor
    returns once ``up`` is ready (``http`` is its HTTP API's HOST:PORT); RuntimeError with the end of
    its stderr when it exits first or takes longer than ``ready_timeout`` seconds (it is stopped then)."""

    def __init__(self, model: str, workdir: Path, extra: list[str] | None = None,
                 ready_timeout: float = 300.0) -> None:  # fmt: skip
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "up.stderr"
        env = dict(os.environ, PDSERVE_STATE_DIR=str(workdir / "state"))
        argv = [sys.executable, "-m", "pdserve.cli.main", "up", "--model", model, "--prefill", "1", "--decode", "1",
                "--port", str(free_port()), "--http-port", str(free_port()), *(extra or [])]  # fmt: skip
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.http = ""
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"pdserve up not ready after {timeout:.0f}s:\n{self.stderr()}") from None
            if line is None:
                raise RuntimeError(f"pdserve up exited ({self.proc.wait()}):\n{self.stderr()}")
            if line.startswith(READY_PREFIX):
                self.http = line.removeprefix(READY_PREFIX).strip()
                return

    def stderr(self, chars: int = 3000) -> str:
        """The end of ``up``'s stderr."""
        return self.log.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGINT (``up`` drains and stops everything it started), wait up to ``timeout`` seconds, then
        SIGKILL. Returns ``up``'s exit code. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def access_statuses(self) -> dict[str, int]:
        """Requests by the status of their access-log line (``length``, ``stop``, ``abort``, ``error``,
        ``rejected:REASON``, ...). Complete once ``up`` has stopped."""
        return dict(Counter(m.group(1) for m in ACCESS_LINE.finditer(self.log.read_text(errors="replace"))))
