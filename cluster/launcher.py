"""Service: start (or join) Ray, Redis, the workers and the router; stop them all cleanly."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import math
import os
import re
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import ray
import redis
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.errors import WorkerStartError
from pdserve.cluster.placement import placement_problem, worker_placement
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.checkpoint import check_model
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.parallel.shard import check_tensor_parallel
from pdserve.kvindex.config import REDIS_ERRORS, IndexConfig, redact_url
from pdserve.kvindex.embedded import EmbeddedRedis
from pdserve.logs import configure_text_logging
from pdserve.procstat import child_pids
from pdserve.worker.config import WorkerConfig


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


GCS_TASK_EVENTS = 10_000  # task records a local Ray's GCS keeps (Ray's default: 100,000)
LOCAL_RAY_STARTS = 3  # tries of a local Ray's start before its error is raised
LOCAL_RAY_RETRY_PAUSE_S = 2.0  # pause between them
GCS_PORT_WAIT_S = 60  # seconds a local Ray's GCS may take to bind its port (Ray's default: 30)


def ray_token_path() -> Path:
    """Where Ray reads its auth token from a file: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_private_ray_token() -> Path | None:
    """Make Ray's auth token file private (mode 0600); returns its path, or None when there is none.

    Ray (2.5x) writes ``~/.ray/auth_token`` with the process umask, i.e. 0644 on most machines:
    every local user could read the token that lets anyone run code on the cluster. So, before a
    local Ray starts (token mode, no ``RAY_AUTH_TOKEN`` in the environment, no file yet), this
    writes the token itself (``secrets.token_hex(32)``, what Ray would generate) with mode 0600 in
    a directory created 0700; an existing file of ours with group/other bits is chmod'ed to 0600
    (one Ray wrote earlier). A file owned by someone else is left alone.
    """
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = ray_token_path()
    try:
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another process wrote one meanwhile: fixed below
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(32))
        st = path.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            path.chmod(0o600)
    except OSError as exc:  # a read-only home: Ray reports a missing token itself
        _log(f"warning: cannot make the Ray auth token file {path} private: {exc}")
        return None
    return path


@contextmanager
def _ray_on_loopback() -> Iterator[None]:
    """While it is open, a new local Ray takes 127.0.0.1 as its node address.

    Ray has no public option for this on Linux: ``ray.init(_node_ip_address="127.0.0.1")``
    is rewritten to the machine's routable address, and with that address GCS, raylet, every
    worker's gRPC port, the dashboard agent and the metrics export port listen on all interfaces
    (metrics without authentication). Ray's single-machine mode (its default on macOS and
    Windows, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) uses 127.0.0.1 as the node address, and
    then every one of those binds to loopback only. That switch is read once, when Ray is
    imported, into ``ray_constants.ENABLE_RAY_CLUSTER``; only ``ray.init``'s choice of the node
    address consults it, so it is flipped for that call and restored (a later join of a real
    cluster in this process is unaffected). The node address is then passed to every Ray process
    on their command lines; none of them needs the switch itself.
    """
    from ray._private import ray_constants

    # (A Ray without the switch leaves its default; tests/cli's e2e test then finds the exposed ports.)
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """This process's SIGINT and SIGTERM handlers, put back after ``ray.init`` replaced them
    (Ray's own ends the process at once: ``pdserve up`` would not stop what it started)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except SystemExit as e:  # Ray's SIGTERM handler, while ray.init ran: an interruption like Ctrl-C
        raise KeyboardInterrupt from e
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def _is_loopback(address: str) -> bool:
    """Whether a Ray address (``HOST:PORT``) names this machine's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "auto"
        return False


def join_ray(address: str, log_options: dict) -> None:
    """Connect this process to the Ray at ``address`` (``HOST:PORT`` or ``auto``).

    Ray rewrites a loopback host to the machine's routable address before it connects; a Ray on
    loopback (the one ``pdserve up`` starts without ``--ray-address``) does not listen there, and the
    connection would wait forever. So a loopback address is joined under ``_ray_on_loopback``.
    """
    _check_reachable(address)
    with _ray_on_loopback() if _is_loopback(address) else contextlib.nullcontext(), _own_signal_handlers():
        ray.init(address=address, **log_options)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` Ray address whose port takes no connection is refused (ValueError) here:
    ``ray.init`` would retry it for minutes. Other forms (``auto``, ``ray://``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        reason = e or type(e).__name__
        raise ValueError(f"no Ray at {address}: {reason} (is `ray start --head` running there?)") from None


@contextmanager
def _one_local_start_at_a_time() -> Iterator[None]:
    """Hold this user's lock on starting a local Ray. Ray's driver picks free ports for the
    processes it starts before they bind them, so two local Rays starting at once on one machine
    (two ``pdserve up``, test processes) may pick the same port and one of them fail."""
    path = Path(tempfile.gettempdir()) / f"pdserve-ray-start-{os.getuid()}.lock"
    fd: int | None = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:  # another user's file, a link: start unserialized, as without the lock
        _log(f"ray: no start lock at {path} ({e}); starting without it")
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # and the lock with it


def _init_local_ray(cpus: int, log_options: dict, progress: Callable[[str], None]) -> None:
    """Start a local Ray on loopback (``_ray_on_loopback``), trying up to ``LOCAL_RAY_STARTS`` times.

    On a loaded machine a local Ray's start has been seen to fail now and then (about once in 30
    starts beside two CPU-bound processes, and twice in a row once in a CI run): a GCS that never
    binds its port nor writes a line of its log, or a raylet that never registers while the dashboard
    process ends on SIGABRT before its log exists. A later start then comes up. A failed ``ray.init``
    leaves the processes it started to nobody (``ray.shutdown`` knows only a Ray that came up), so the
    children of this process that the attempt started are killed here; after a short pause (a burst
    of load may pass) the next start begins, and the last failure is raised as it is.
    """
    for attempt in range(1, LOCAL_RAY_STARTS + 1):
        before = child_pids(os.getpid())
        try:
            with _ray_on_loopback(), _own_signal_handlers():
                ray.init(num_cpus=cpus, include_dashboard=False, **log_options)
            return
        except BaseException as e:  # an interruption too: the processes of the attempt go first
            ray.shutdown()
            for pid in child_pids(os.getpid()) - before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # our unreaped child: its pid is not reused
            if attempt == LOCAL_RAY_STARTS or not isinstance(e, Exception):
                raise
            progress(f"ray: the local Ray did not start ({_last_line(str(e))}); starting it again "
                     f"(start {attempt + 1} of {LOCAL_RAY_STARTS})")  # fmt: skip
            time.sleep(LOCAL_RAY_RETRY_PAUSE_S)


def start_local_ray(cpus: int, log_options: dict | None = None, progress: Callable[[str], None] = _log) -> None:
    """Start a Ray of this machine alone, of ``cpus`` logical CPUs, and connect this process to it:
    what ``pdserve up`` does without ``--ray-address``. Every Ray port on loopback and no dashboard
    (it runs jobs for anyone who reaches it); token authentication, the token file private; Ray's
    workers at nice 0. ``log_options``: more ``ray.init`` arguments (the log config)."""
    # Ray starts its workers at nice 15; serving workers must not yield to every other
    # process on the machine (unless the operator says otherwise).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Every request is a few Ray tasks whose events the GCS keeps (100,000 by default,
    # ~0.5 KB each, up to ~50 MB): keep a tenth, nobody reads them here.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", str(GCS_TASK_EVENTS))
    # Ray gives its GCS 30 s to bind its port: a busy machine gets more before the start
    # is given up and tried again (_init_local_ray).
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_PORT_WAIT_S))
    ensure_private_ray_token()  # before Ray writes one world-readable
    with _one_local_start_at_a_time():
        _init_local_ray(cpus, log_options or {}, progress)
    ensure_private_ray_token()  # one Ray wrote anyway (another Ray version, a race)


def _wait_names_free(names: list[str], timeout: float = 15.0) -> None:
    """Wait until no live actor has any of ``names`` (``ray.kill`` returns before Ray frees a name):
    a Ray that goes on after a service stops can take the next service of the same names at once."""
    deadline = time.monotonic() + timeout
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:  # no live actor of that name
                break
            time.sleep(0.05)
        else:
            _log(f"actor {name} is still alive {timeout:.0f} s after it was killed")
            return


def _last_line(message: str) -> str:
    """The line of a Ray error (an actor's creation, a start) that says what was raised: its last line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in message.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else message


class Service:
    """Owns what it started: a local Ray (unless joining one), an embedded Redis (unless a URL
    was given), the worker and router actors. ``stop`` is idempotent."""

    def __init__(self, config: ServiceConfig, progress: Callable[[str], None] = _log) -> None:
        self.config = config
        self.progress = progress
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.index.url
        self.model_dir = config.engine.model
        self.prefill: dict[str, ray.actor.ActorHandle] = {}
        self.decode: dict[str, ray.actor.ActorHandle] = {}
        self.router: ray.actor.ActorHandle | None = None
        self.port: int | None = None
        self.http_port: int | None = None  # the OpenAI-compatible API's, once started (None: off)
        self.metrics_port: int | None = None  # /metrics on its own port, once started (None: not asked)
        self._kv_blocks: int | None = None
        self._groups: list[ray.util.placement_group.PlacementGroup] = []  # tensor-parallel workers' (their ranks)
        self._started_ray = False
        self._tmp: tempfile.TemporaryDirectory | None = None
        # The KV-transfer plane always authenticates: without a configured secret, one for this run.
        transfer = config.transfer
        self.transfer = transfer if transfer.cluster_secret else replace(transfer, cluster_secret=secrets.token_hex(32))

    @property
    def _actor_log_level(self) -> str | None:
        """The level of the compact TEXT handler each actor installs (pdserve/logs.py); None with
        JSON logs, which Ray's ``LoggingConfig`` sets up in every process."""
        return None if self.config.log_json else self.config.log_level

    def _worker_config(self, wid: str, role: str) -> WorkerConfig:
        c = self.config
        local = c.host in ("127.0.0.1", "localhost") and not c.ray_address
        return WorkerConfig(
            worker_id=wid,
            role=role,
            engine=self.engine_config(role),
            index=self.index_config(),
            transfer=self.transfer,
            bind_host="127.0.0.1" if local else "0.0.0.0",
            share_idle_cpus=c.share_idle_cpus,
            core_reclaim_wait_s=c.core_reclaim_wait_s,
        )

    def engine_config(self, role: str | None = None) -> EngineConfig:
        """The workers' engine config: the service's, with the model and device settled at start
        (and, for a ``role``, that role's tensor-parallel size)."""
        device = "cuda" if self.config.gpus_per_worker > 0 else "cpu"
        engine = replace(self.config.engine, model=self.model_dir, device=device)
        if role is None:
            return engine
        tp = self.config.tensor_parallel_size(role)
        # A served worker's ranks are Ray actors in its placement group (cluster/placement.py).
        backend = "ray" if tp > 1 else engine.parallel.distributed_executor_backend
        return replace(engine, parallel=replace(engine.parallel, tensor_parallel_size=tp,
                                                distributed_executor_backend=backend))  # fmt: skip

    def index_config(self) -> IndexConfig:
        """The index config of every process: the service's, with the Redis URL settled at start."""
        return replace(self.config.index, url=self.redis_url)

    def _check_redis(self) -> None:
        """A Redis that refuses the URL's credentials never will: ValueError, before anything starts.
        One that does not answer may come back: serving starts without the index (a warning)."""
        index = self.index_config()
        client = index.client(retries=0, timeout_s=5.0)
        try:
            client.ping()
        except redis.AuthenticationError as e:  # also redis-py's AuthenticationWrongNumberOfArgsError
            raise ValueError(f"redis at {index.redacted_url} refused the credentials: {e}") from None
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e) or "HELLO" in str(e):
                raise ValueError(f"redis at {index.redacted_url} refused the credentials: {e}") from None
            # Any other refusal (an ACL without PING) is an answer: the server is there.
        except REDIS_ERRORS as e:
            self.progress(f"warning: redis at {index.redacted_url} does not answer ({e}); serving starts "
                          "without the index and uses it once it answers")  # fmt: skip
        finally:
            client.close()

    def start(self) -> tuple[str, str]:
        """Start everything; returns (router address, redis url). Stops what it started on failure."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> tuple[str, str]:
        c = self.config
        if self.model_dir is not None:
            check_model(self.model_dir)  # here, not as a worker actor dying during start-up
            config = ModelConfig.from_path(self.model_dir)
            for role in ("prefill", "decode"):
                try:
                    check_tensor_parallel(config, c.tensor_parallel_size(role))
                except ValueError as e:
                    raise ValueError(f"{role} workers: {e}") from None
        if self.model_dir is None:
            from pdserve.engine.model import make_tiny_model

            self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-model-")
            self.model_dir = str(make_tiny_model(self._tmp.name))
            self.progress(f"no --model given: wrote a tiny model to {self.model_dir}")
        if self.redis_url is None:
            if c.ray_address:
                self.progress(
                    "warning: the embedded redis-server listens on 127.0.0.1 only; workers on other nodes "
                    "cannot reach it. Pass --redis-url for a multi-node cluster."
                )
            self.redis = EmbeddedRedis().start()
            self.redis_url = self.redis.url
            self.progress(f"started embedded redis-server at {redact_url(self.redis_url)}")
        else:
            self._check_redis()
        workers = c.prefill + c.decode
        if not ray.is_initialized():
            # Every process of this job logs at the chosen level, in text or JSON, and its lines
            # are streamed to this driver's stderr (each also stays in its Ray log file). JSON is
            # Ray's encoding; text is pdserve's compact one, installed by each actor it starts
            # (their ``log_level``), because Ray's text encoding appends ~600 characters of ids
            # to every line (pdserve/logs.py).
            log_options: dict = {}
            if c.log_json:
                log_options = {"logging_config": ray.LoggingConfig(
                    encoding="JSON", log_level=c.log_level, additional_log_standard_attrs=["name"])}  # fmt: skip
            else:
                configure_text_logging(c.log_level)
            if c.ray_address:
                join_ray(c.ray_address, log_options)
            else:
                # Ray schedules by logical CPUs: what the workers ask for plus one spare, even on fewer cores.
                want = sum(n * c.tensor_parallel_size(role) * c.cpus_per_rank(role)
                           for role, n in (("prefill", c.prefill), ("decode", c.decode)))
                start_local_ray(max(os.cpu_count() or 1, math.ceil(want) + 1), log_options, self.progress)
            self._started_ray = True
        res = ray.cluster_resources()
        if self._started_ray and not c.ray_address:
            auth = "on" if os.environ.get("RAY_AUTH_MODE", "token") == "token" else "off"
            self.progress(f"ray: local cluster on 127.0.0.1, {res.get('CPU', 0):.0f} scheduling slots for {workers} "
                          f"workers on {os.cpu_count()} cores, token authentication {auth}")  # fmt: skip
        else:
            self.progress(f"ray: cluster with {res.get('CPU', 0):.0f} CPUs, {res.get('GPU', 0):.0f} GPUs")
        from pdserve.decode_worker.actor import DecodeWorker
        from pdserve.prefill_worker.actor import PrefillWorker

        # A tensor-parallel worker of N ranks is N actors in one placement group on one node: the worker's
        # own actor (rank 0) and the ranks it starts (cluster/placement.py).
        roles = {"prefill": c.prefill_resources, "decode": c.decode_resources}
        nodes = ray.nodes()
        for role, custom in roles.items():
            tp = c.tensor_parallel_size(role)
            need = {"CPU": c.cpus_per_rank(role) * tp, "GPU": c.gpus_per_worker * tp, **custom}
            if (problem := placement_problem(role, nodes, need)) is not None:
                raise WorkerStartError(problem)
        actors = {"prefill": (self.prefill, PrefillWorker, c.prefill), "decode": (self.decode, DecodeWorker, c.decode)}
        for role, (handles, cls, count) in actors.items():
            for i in range(count):
                wid = f"{role}-{i}"
                options, group = worker_placement(f"pdserve-{wid}", c.tensor_parallel_size(role), c.cpus_per_rank(role),
                                                  c.gpus_per_worker, roles[role])  # fmt: skip
                if group is not None:
                    self._groups.append(group)
                handles[wid] = ray.remote(cls).options(name=f"pdserve-{wid}", max_restarts=-1, max_task_retries=0,
                                                       **options).remote(self._worker_config(wid, role),
                                                                         self._actor_log_level)  # fmt: skip
        self.router = self._create_router()  # its process starts while the workers load the model
        pending = {h.ready.remote(): wid for wid, h in {**self.prefill, **self.decode}.items()}
        total, t0 = len(pending), time.monotonic()
        pool_blocks: list[int] = []
        while pending:
            done, _ = ray.wait(list(pending), timeout=5.0)
            for ref in done:
                wid = pending.pop(ref)
                try:
                    info = ray.get(ref)
                except ray.exceptions.RayActorError as exc:  # its __init__ raised: a message, not Ray's traceback
                    raise WorkerStartError(f"worker {wid} failed to start: {_last_line(str(exc))}") from None
                pool_blocks.append(info["num_blocks"])
                self.progress(
                    f"[{total - len(pending)}/{total}] {wid} loaded the model ({info['num_blocks']} KV blocks, "
                    f"transfer at {info['grpc_address']})"
                )
            if not done:
                self.progress(f"waiting for {len(pending)} worker(s) to load the model ({time.monotonic() - t0:.0f}s)")
        self._kv_blocks = min(pool_blocks)
        self.port, self.http_port, self.metrics_port = self._start_router(c.port, c.http_port, c.metrics_port)
        return f"{c.host}:{self.port}", self.redis_url

    @property
    def http_address(self) -> str | None:
        return None if self.http_port is None else f"{self.config.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes the whole cluster: the metrics port's, else the HTTP API's."""
        port = self.metrics_port if self.metrics_port is not None else self.http_port
        return None if port is None else f"http://{self.config.host}:{port}/metrics"

    def _create_router(self) -> ray.actor.ActorHandle:
        """The router actor, on this (the head) node, where users reach its port. Ray does not
        restart it (a restarted actor would not re-bind its port: ``start`` is a call);
        ``supervise`` does."""
        from pdserve.router.actor import Router

        c = self.config
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.remote(Router).options(
            name="pdserve-router", num_cpus=0, max_restarts=0, scheduling_strategy=here
        ).remote(c.router, self.engine_config(), self.index_config(), self.prefill, self.decode,
                 log_level=self._actor_log_level)  # fmt: skip

    def _start_router(self, port: int, http_port: int | None, metrics_port: int | None,
                      attempts: int = 1) -> tuple[int, int | None, int | None]:  # fmt: skip
        """Give the router (``_create_router``) the workers' pool size and serve gRPC on ``port``,
        HTTP on ``http_port`` and /metrics alone on ``metrics_port`` (None: not served); returns
        the bound ports."""
        c = self.config
        assert self.router is not None and self._kv_blocks is not None
        ray.get(self.router.set_kv_blocks.remote(self._kv_blocks))
        bound: int | None = None
        http: int | None = None
        for attempt in range(attempts):
            try:
                if bound is None:
                    bound = int(ray.get(self.router.start.remote(c.host, port)))
                if http is None and http_port is not None:
                    http = int(ray.get(self.router.start_http.remote(c.host, http_port)))
                if metrics_port is None:
                    return bound, http, None
                return bound, http, int(ray.get(self.router.start_metrics.remote(c.host, metrics_port)))
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, OSError):
                    raise
                if attempt == attempts - 1:  # the port is taken: say so without Ray's traceback
                    raise OSError(str(e.cause)) from None
                time.sleep(0.5)  # the old router's socket may linger a moment
        raise AssertionError("unreachable")

    def _router_alive(self, timeout_s: float = 10.0) -> bool:
        try:
            return bool(ray.get(self.router.ping.remote(), timeout=timeout_s))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def supervise(self) -> list[str]:
        """Restart what died: the router (on the same port) and the embedded Redis (same port and
        password; the workers republish the index into it). One line per restart, for the log."""
        notes: list[str] = []
        if self.redis is not None and not self.redis.running:
            self.redis.restart()
            notes.append(f"redis-server had stopped: restarted at {redact_url(self.redis.url)}")
        if self.router is not None and not self._router_alive():
            try:
                ray.kill(self.router, no_restart=True)  # a hung one; a dead one is already gone
            except Exception:  # noqa: BLE001
                pass
            assert self.port is not None
            self.router = self._create_router()
            self._start_router(self.port, self.http_port, self.metrics_port, attempts=20)
            notes.append(f"router had stopped: restarted, listening on {self.config.host}:{self.port}")
        return notes

    def drain(self, timeout_s: float | None = None) -> int:
        """The router stops taking requests and gives those in flight ``timeout_s`` (default
        ``router.drain_timeout_s``) to finish; returns how many were cut off."""
        if self.router is None:
            return 0
        wait = self.config.router.drain_timeout_s if timeout_s is None else timeout_s
        try:
            return int(ray.get(self.router.drain.remote(wait), timeout=wait + 30))
        except Exception:  # noqa: BLE001 - a dead router has nothing to drain
            return 0

    def stop(self) -> None:
        if ray.is_initialized():
            if self.router is not None:
                try:
                    ray.get(self.router.stop.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - it is going away either way
                    pass
            names = [f"pdserve-{wid}" for wid in [*self.prefill, *self.decode]]
            names += ["pdserve-router"] if self.router else []
            workers = [*self.prefill.values(), *self.decode.values()]
            try:  # a clean shutdown unregisters each worker and clears its block holders in Redis
                ray.get([h.shutdown.remote() for h in workers], timeout=20)
            except Exception:  # noqa: BLE001 - killed below either way
                _log("not every worker shut down cleanly; Redis may list it until it is replaced")
            for h in [*workers, *([self.router] if self.router else [])]:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            for group in self._groups:  # and with them the ranks in them
                try:
                    ray.util.remove_placement_group(group)
                except Exception:  # noqa: BLE001
                    pass
            if self._started_ray:
                ray.shutdown()
            else:
                _wait_names_free(names)
        self._groups.clear()
        self.prefill.clear()
        self.decode.clear()
        self.router = None
        self._started_ray = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
