"""pdserve on a simulated cluster, started as an operator starts it on real machines (what the multi-node
tests and ``pdserve bench links`` share): ``HeadRedis``, an external ``redis-server`` with a password on
one node; ``PdserveUp``, ``pdserve up --ray-address ... --config FILE`` waited for until ready; ``Probe``,
a process in a node's namespace (the caller's may have no address on the bridge) that talks gRPC to the
router, reads Redis and asks the workers through Ray. Files holding a secret are written 0600. Every
process is started with ``SimCluster.run`` (tracked: the cluster's teardown stops it by pid anyway) and
stopped here by pid: never ``ray stop``, never by name.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.cluster.simnet.cluster import SimCluster
from pdserve.cluster.simnet.errors import SimnetError

REDIS_READY = "Ready to accept"
UP_READY_TIMEOUT_S = 240.0


def write_private(path: Path, text: str) -> Path:
    """Create ``path`` (it must not exist) with mode 0600 and write ``text``: a file holding a secret
    is never readable by others, not even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def stop_pid(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
    """Send ``sig`` to ``proc`` (by its pid) unless it has exited, wait up to ``timeout`` seconds, then
    SIGKILL it and reap it. Idempotent."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Lines:
    """A stream's lines, read by a daemon thread so that waiting for one has a timeout."""

    def __init__(self, stream: Any) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        try:
            for line in stream:
                self.q.put(line.rstrip("\n"))
        except (OSError, ValueError):  # closed under us at teardown
            pass
        self.q.put(None)

    def next(self, timeout: float) -> str | None:
        """The next line, None at EOF; ``queue.Empty`` after ``timeout`` seconds."""
        line = self.q.get(timeout=max(timeout, 0.01))
        if line is not None:
            self.seen.append(line)
        return line


class HeadRedis:
    """``redis-server`` on ``node`` at ``port``, bound to the node's address, with a random password
    (``url`` carries it). Files live in ``workdir`` (created 0700; it must not exist). Started by the
    constructor; ``start`` after ``stop`` is the same server, empty (no persistence)."""

    def __init__(self, sim: SimCluster, node: str, workdir: Path, redis_bin: str, port: int = 6380) -> None:
        self.sim, self.node, self.redis_bin = sim, node, redis_bin
        self.password = secrets.token_hex(16)
        self.url = f"redis://:{self.password}@{sim.address(node)}:{port}/0"
        workdir.mkdir(mode=0o700)
        self.conf = write_private(workdir / "redis.conf", (
            f"port {port}\nbind {sim.address(node)}\nprotected-mode yes\nrequirepass {self.password}\n"
            f'save ""\nappendonly no\ndir {workdir}\ndaemonize no\nloglevel notice\n'))  # fmt: skip
        self.log = workdir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until its log says it accepts connections; SimnetError otherwise."""
        starts = self._ready_count()
        with open(self.log, "ab") as log:
            self.proc = self.sim.run(self.node, [self.redis_bin, str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while self._ready_count() <= starts:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SimnetError(f"redis-server did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def _ready_count(self) -> int:
        return self.log.read_text(errors="replace").count(REDIS_READY) if self.log.exists() else 0

    def stop(self) -> None:
        """SIGTERM by pid, and wait. Idempotent."""
        if self.proc is not None:
            stop_pid(self.proc, timeout=30)


class PdserveUp:
    """``pdserve up --ray-address SIM --config FILE`` on ``node``, ``config`` (a ServiceConfig as JSON)
    written 0600 to ``workdir/service.json``, stderr to ``workdir/up.stderr``; ``env`` adds to the
    node's environment (e.g. ``PDSERVE_CLUSTER_SECRET``). Returns once ``up`` printed its last ready
    line ("state in ..."); ``router`` is its "router listening on" address. RuntimeError with its
    output when it exits or takes longer than ``ready_timeout`` seconds (it is stopped then).
    ``wait=False`` returns at once (to start several side by side); call ``wait_ready`` before use."""

    def __init__(self, sim: SimCluster, node: str, config: dict[str, Any], workdir: Path,
                 env: dict[str, str] | None = None, ready_timeout: float = UP_READY_TIMEOUT_S,
                 wait: bool = True) -> None:  # fmt: skip
        workdir.mkdir(mode=0o700, exist_ok=True)
        self.config_file = write_private(workdir / "service.json", json.dumps(config))
        self.log = workdir / "up.stderr"
        env = {"PDSERVE_STATE_DIR": str(workdir / "state")} | dict(env or {})
        pdserve = str(Path(sys.executable).parent / "pdserve")
        with open(self.log, "wb") as err:
            self.proc: subprocess.Popen[str] = sim.run(
                node, [pdserve, "up", "--ray-address", sim.ray_address, "--config", str(self.config_file)],
                env, stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
        self.lines = Lines(self.proc.stdout)
        self.router = ""
        if wait:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = UP_READY_TIMEOUT_S) -> None:
        """Blocks until the last ready line; stops the service and raises RuntimeError where it exits or
        ``timeout`` passes first."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.next(deadline - time.monotonic())
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"pdserve up did not get ready; stdout {self.lines.seen}, stderr:\n{self.stderr()}")
            if line.startswith("router listening on "):
                self.router = line.removeprefix("router listening on ")
            if line.startswith("state in "):
                return

    def stderr(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT (drain, stop the workers and the router), SIGKILL after ``timeout`` s. Idempotent."""
        stop_pid(self.proc, signal.SIGINT, timeout=timeout)

    @staticmethod
    def stop_all(ups: list[PdserveUp], timeout: float = 60.0) -> None:
        """``stop`` on each, side by side (each drains on its own)."""
        with ThreadPoolExecutor(max(1, len(ups))) as pool:
            list(pool.map(lambda up: up.stop(timeout), ups))


# Runs in a node's namespace: one JSON command a line on stdin, one JSON answer a line (prefixed, so that
# nothing else Ray may print is taken for one) on stdout. argv: router address, Redis URL, namespace.
PROBE = r"""
import json, os, sys, threading, time
import grpc, ray
from pdserve import SamplingParams, envs
from pdserve.cli.client import build_request
from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.stats import read_stats
from pdserve.v1 import router_pb2_grpc as pb_grpc
from pdserve.worker.messages import RequestSpec

router, redis_url, namespace = sys.argv[1:4]
ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ["SIMNET_NODE_IP"], log_to_driver=False,
         logging_level="ERROR")
stub = pb_grpc.RouterStub(grpc.insecure_channel(router))
index = IndexConfig(url=redis_url, namespace=namespace)
rds = index.client(timeout_s=2.0)
# `up`'s named actors live in its job's (anonymous) Ray namespace: find them across namespaces, and keep
# those this service's registry names, beating (other services on the cluster have workers of the same names).
deadline, workers = time.monotonic() + 60, {}
while True:
    entries = {wid: json.loads(v) for wid, v in rds.hgetall(f"{namespace}:workers").items()}
    registry = {w: e["grpc_address"] for w, e in entries.items() if e["heartbeat_ms"] > time.time() * 1000 - 10_000}
    workers = {w: h for w, h in workers.items() if w in registry}
    for a in ray.util.list_named_actors(all_namespaces=True):
        wid = a["name"].removeprefix("pdserve-")
        if a["name"].startswith(("pdserve-prefill-", "pdserve-decode-")) and wid in registry and wid not in workers:
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            if ray.get(handle.ready.remote(), timeout=30)["grpc_address"] == registry[wid]:
                workers[wid] = handle
    if workers.keys() == registry.keys() and {w.split("-")[0] for w in workers} == {"prefill", "decode"}:
        break
    if time.monotonic() > deadline:
        raise SystemExit(f"no workers of this service: registry {registry}, matched {sorted(workers)}")
    time.sleep(0.1)
primed = 0

def op_generate(prompt, max_tokens, cache_salt=None):
    t0, times, out = time.monotonic(), [], {"token_ids": [], "finish_reason": None, "usage": {}}
    req = build_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt)
    for resp in stub.Generate(req, timeout=120):
        times += [time.monotonic() - t0] * len(resp.token_ids)
        out["token_ids"] += list(resp.token_ids)
        if resp.HasField("usage"):
            u = resp.usage
            out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                            "cached_tokens": u.cached_tokens, "transferred_tokens": u.transferred_tokens}
        if resp.finished:
            out["finish_reason"] = resp.finish_reason
    return out | {"seconds": time.monotonic() - t0, "token_times": times}

def op_prefill_only(worker, prompt, block_size, hash_seed=None, timeout=10.0):
    # The prompt's KV into `worker`'s prefix cache alone (one token, no lease, no decode worker), and
    # wait until Redis names it as the holder of the prompt's last full block.
    global primed
    primed += 1
    spec = RequestSpec(f"probe-prime-{os.getpid()}-{primed}", tuple(prompt), SamplingParams(max_tokens=1))
    r = ray.get(workers[worker].prefill.remote(spec), timeout=60)
    key = f"{namespace}:block:" + block_hashes(prompt, block_size, hash_seed or envs.hash_seed())[-1].hex()
    deadline = time.monotonic() + timeout
    while rds.hget(key, worker) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis does not name {worker} as holder of {key}")
        time.sleep(0.005)
    return {"cached_tokens": r.num_cached_tokens}

def op_pools(only=None):
    return {wid: ray.get(h.pool_state.remote(), timeout=10) for wid, h in workers.items() if only is None or wid in only}

streams = {}

def _stream(sid, prompt, max_tokens):
    st = streams[sid]
    try:
        req = build_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)
        for resp in stub.Generate(req, timeout=120):
            st["token_ids"] += list(resp.token_ids)
            if resp.finished:
                st["finish_reason"] = resp.finish_reason
    except grpc.RpcError as exc:
        st["error"] = {"code": exc.code().name, "details": exc.details()}
    st["done"] = True

def op_start_stream(prompt, max_tokens):
    # A streamed request in a thread of its own; `streams` says how far each got.
    sid = str(len(streams))
    streams[sid] = {"token_ids": [], "finish_reason": None, "error": None, "done": False}
    threading.Thread(target=_stream, args=(sid, prompt, max_tokens), daemon=True).start()
    return sid

def op_streams():
    return {sid: dict(st, token_ids=list(st["token_ids"])) for sid, st in streams.items()}

def op_registry():
    return {wid: json.loads(v) for wid, v in rds.hgetall(f"{namespace}:workers").items()}

def op_holders():
    return {k.rsplit(":", 1)[1]: sorted(rds.hkeys(k)) for k in rds.scan_iter(match=f"{namespace}:block:*", count=1000)}

def op_stats():
    return read_stats(rds, index)

print("@@" + json.dumps({"ok": sorted(workers)}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        out = {"ok": globals()["op_" + cmd["op"]](**cmd.get("args", {}))}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print("@@" + json.dumps(out), flush=True)
"""


class ProbeError(RuntimeError):
    """The probe answered with an error (Redis down, a worker not answering, ...)."""


class Probe:
    """``PROBE`` on ``node``, for the service whose router is at ``router`` and whose index is
    ``redis_url`` under ``namespace``. ``workers``: the ids of that service's workers (``prefill-0``,
    ...): the Ray actors whose KV-transfer address is the one the service's registry holds, so
    several services may share a Ray cluster.
    ``call(op, **args)`` returns the op's answer; ops: ``generate(prompt, max_tokens, cache_salt)``
    -> token_ids, finish_reason, usage, seconds, token_times (seconds from the call to each token);
    ``prefill_only(worker, prompt, block_size, hash_seed)`` (the prompt's KV into that worker's prefix
    cache only, returned once Redis names it holder of the last full block); ``pools(only)`` (pool
    state of every worker, or of those listed); ``start_stream(prompt, max_tokens)`` -> a stream id
    (a streamed request run in the background), ``streams`` -> id -> token_ids, finish_reason, error
    (gRPC code and details), done; ``registry``; ``holders``
    (block hex -> holder ids); ``stats`` (``read_stats``). ``close`` ends it (stdin closed, then by pid)."""

    def __init__(self, sim: SimCluster, node: str, router: str, redis_url: str, namespace: str = "pdserve",
                 timeout: float = 120.0) -> None:  # fmt: skip
        self.proc: subprocess.Popen[str] = sim.run(
            node, [sys.executable, "-c", PROBE, router, redis_url, namespace], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.lines = Lines(self.proc.stdout)
        try:
            self.workers: list[str] = self._answer(timeout)
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.next(deadline - time.monotonic())
            except queue.Empty:
                raise RuntimeError(f"the probe did not answer within {timeout} s") from None
            if line is None:
                raise RuntimeError(f"the probe exited ({self.proc.poll()}); its output: {self.lines.seen[-20:]}")
            if line.startswith("@@"):
                out = json.loads(line[2:])
                if "error" in out:
                    raise ProbeError(out["error"])
                return out["ok"]

    def call(self, op: str, timeout: float = 150.0, **args: Any) -> Any:
        """The answer of ``op``; ProbeError when the probe reports one, RuntimeError when it is silent."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def generate(self, prompt: list[int], max_tokens: int, cache_salt: str | None = None) -> dict[str, Any]:
        return self.call("generate", prompt=prompt, max_tokens=max_tokens, cache_salt=cache_salt)

    def quietly(self, op: str, **args: Any) -> Any:
        """``call``, None when the probe reports an error (for conditions polled through an outage)."""
        try:
            return self.call(op, **args)
        except ProbeError:
            return None

    def close(self, grace: float = 10.0) -> None:
        """Close its stdin (its loop ends and it exits), SIGTERM by pid if it still runs after
        ``grace`` s (SIGKILL 20 s later). Idempotent."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            stop_pid(self.proc, signal.SIGTERM, timeout=20)
