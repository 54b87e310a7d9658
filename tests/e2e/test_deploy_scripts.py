"""The head node's own scripts (deploy/), run for real in a 3-node simulated cluster (``pdserve.cluster.simnet``).

What ``ray up deploy/cluster-gpu.yaml`` does on the head, minus what needs apt, sudo or systemd:
Ray on the cluster file's ports (GCS 6380, object manager 8076, metrics 8080, on every node);
``make-secrets.sh`` writes ``secrets.env`` once, 0600; ``redis-conf.sh`` (the part of
``setup-head.sh`` that runs anywhere) makes the Redis config, which ``redis-server`` runs on 6379 in
the head's namespace (systemd's job on a VM); ``run-pdserve.sh`` runs with ``secrets.env`` loaded
as systemd's ``EnvironmentFile`` loads it and ``HOME`` a temporary home laid out like the head's
(``~/pdserve/{secrets.env,service.json,run-pdserve.sh,redis-conf.sh}``, ``~/pdserve-venv`` a link to
this interpreter's environment), and execs ``pdserve up --ray-address auto``, which finds the
cluster through ``RAY_ADDRESS`` (the cluster's environment; on a VM, the address file that ``ray
start`` writes). The service config is deploy/service.json with what a CPU-only simulation cannot
run replaced (a tiny model, one worker per role on n1 and n2, no GPU, float32, a small cache).

Checked: the secrets file's mode and that a second run keeps it; Redis bound to 127.0.0.1 and the
head's address and refusing a client without the password; the prefill worker on n1 and the decode
worker on n2 at the fixed KV-transfer port; greedy tokens through the router equal transformers'
``generate``, the KV pulled across the nodes (the cluster secret from ``secrets.env``
authenticates it) under block hashes seeded with ``secrets.env``'s hash seed; SIGTERM to the
script's process (what ``systemctl stop`` sends) drains and exits 0, the workers unregistered and
the state file removed; at the end no namespace, link or process is left. Needs root and ``ip
netns``, and a ``redis-server``; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

from pdserve.cluster.simnet import NodeSpec, SimCluster, process_alive, simnet_available
from pdserve.cluster.simnet.service import Lines, Probe, stop_pid, write_private
from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.kvindex.embedded import find_redis_server
from tests.support import REPO
from tests.support.polling import wait_until
from tests.support.sim_models import greedy_reference, make_checkpoint

pytestmark = pytest.mark.slow

DEPLOY = REPO / "deploy"
REDIS_PORT = 6379  # redis-conf.sh's
BLOCK = 16
MAX_TOKENS = 8
READY_TIMEOUT_S = 240.0
SECRET_KEYS = {"PDSERVE_HASH_SEED", "PDSERVE_CLUSTER_SECRET", "PDSERVE_REDIS_PASSWORD"}
# Runs in the head's namespace: Redis as a client without the password (on both bound addresses),
# then with it (from the environment, not argv), and the service's worker registry.
REDIS_ASK = r"""
import json, os, sys
import redis
host, port = sys.argv[1], int(sys.argv[2])
out = {}
for h in ("127.0.0.1", host):
    try:
        out[h] = str(redis.Redis(host=h, port=port, socket_timeout=5).ping())
    except redis.RedisError as exc:
        out[h] = f"{type(exc).__name__}: {exc}"
r = redis.Redis(host=host, port=port, password=os.environ["REDIS_PASSWORD"], socket_timeout=5, decode_responses=True)
out["ping"] = r.ping()
out["workers"] = r.hgetall("pdserve:workers")
print(json.dumps(out))
"""


def ray_port_flags() -> dict[str, int]:
    """The port flags of the cluster file's ``ray start --head`` (``--port`` and the others)."""
    cluster = yaml.safe_load((DEPLOY / "cluster-gpu.yaml").read_text())
    head = next(c for c in cluster["head_start_ray_commands"] if "ray start --head" in c)
    return {flag: int(port) for flag, port in re.findall(r"(--[a-z-]*port)=(\d+)", head)}


def environment_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as systemd's ``EnvironmentFile`` reads them: blank lines and ``#``/``;``
    comments skipped, whitespace around key and value dropped, one pair of surrounding quotes removed."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def read_until(lines: Lines, done: Callable[[str | None], bool], timeout: float) -> bool:
    """Read ``lines`` until ``done(line)`` (True; ``line`` None at the end of the stream) or the end of
    the stream or ``timeout`` seconds (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.next(deadline - time.monotonic())
        except queue.Empty:
            return False
        if done(line):
            return True
        if line is None:
            return False


def listening(sim: SimCluster, node: str) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``node``'s namespace, from its /proc/net."""
    found = set()
    for table in ("tcp", "tcp6"):
        for row in sim.check_output(node, ["cat", f"/proc/net/{table}"], timeout=30).splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state != "0A":  # LISTEN
                continue
            host, port = local.split(":")
            addr = ".".join(str(b) for b in reversed(bytes.fromhex(host))) if len(host) == 8 else "::"
            found.add((addr, int(port, 16)))
    return found


def leftovers(prefix: str) -> list[str]:
    """Lines of `ip netns list` and `ip link` (root namespace) that name the run."""
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"{prefix}-" in line]


def head_home(root: Path) -> Path:
    """A home laid out like the head's after ``ray up``'s file_mounts and setup (0700): the scripts in
    ``~/pdserve``, ``~/pdserve-venv`` this interpreter's environment (a link)."""
    home = root / "home"
    (home / "pdserve").mkdir(mode=0o700, parents=True)
    home.chmod(0o700)
    for script in ("run-pdserve.sh", "redis-conf.sh"):
        shutil.copy(DEPLOY / script, home / "pdserve" / script)
    (home / "pdserve-venv").symlink_to(sys.prefix)
    return home


def service_json(model_dir: Path) -> dict:
    """deploy/service.json with what a CPU-only simulation cannot run replaced: the tiny model in
    float32 with a small cache, one worker per role placed on n1 / n2, no GPU."""
    config = json.loads((DEPLOY / "service.json").read_text())
    config.update(prefill=1, decode=1, gpus_per_worker=0, prefill_resources={"prefill_node": 1},
                  decode_resources={"decode_node": 1})  # fmt: skip
    config["engine"].update(model=str(model_dir), dtype=None)
    config["engine"]["cache"].update(kv_cache_memory_bytes=16 * 1024**2)
    return config


@pytest.fixture(autouse=True, scope="module")  # module scope: before the module's other fixtures
def _needs_simnet() -> None:
    if reason := simnet_available():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def redis_bin() -> str:
    try:
        return find_redis_server()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Callable[[list[int], int], list[int]]]:
    model_dir = make_checkpoint(tmp_path_factory.mktemp("deploy-model") / "model")
    return model_dir, greedy_reference(model_dir)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimCluster]:
    """head, n1 (``prefill_node``), n2 (``decode_node``); Ray with the cluster file's ports on every node."""
    ports = ray_port_flags()
    extra = [f"{flag}={port}" for flag, port in ports.items() if flag != "--port"]
    nodes = [
        NodeSpec("head", cpus=1),
        NodeSpec("n1", cpus=1, resources={"prefill_node": 1}),
        NodeSpec("n2", cpus=1, resources={"decode_node": 1}),
    ]
    with SimCluster(nodes, "fast", ray_port=ports["--port"], ray_args=extra) as sim:
        yield sim
        pids, prefix = sim.recorded_pids(), sim.prefix
    # The run left nothing: no namespace, no link, no process, no run directory.
    assert leftovers(prefix) == []
    assert [pid for pid, start in pids.items() if process_alive(pid, start)] == []
    assert not (Path("/tmp/pds-simnet") / prefix).exists()


def test_the_head_scripts_start_redis_and_the_service_and_stop_it(
    sim: SimCluster, redis_bin: str, model: tuple[Path, Callable[[list[int], int], list[int]]], tmp_path: Path
) -> None:
    model_dir, reference = model
    head, n1, n2 = sim.address("head"), sim.address("n1"), sim.address("n2")
    ray_ports = ray_port_flags()
    assert ray_ports == {"--port": 6380, "--object-manager-port": 8076, "--metrics-export-port": 8080}
    config = service_json(model_dir)
    router_port, http_port = config["port"], config["http_port"]
    transfer_port = int(config["transfer"]["port_range"].split("-")[0])  # each node's first free one
    tmp_path.chmod(0o700)
    home = head_home(tmp_path)
    pdir = home / "pdserve"

    # make-secrets.sh (on the operator's machine; file_mounts then copy the file to ~/pdserve): once, 0600.
    secrets_env = pdir / "secrets.env"
    make = ["bash", str(DEPLOY / "make-secrets.sh"), str(secrets_env)]
    sim.check_output("head", make, timeout=30)
    first = secrets_env.read_text()
    assert stat.S_IMODE(secrets_env.stat().st_mode) == 0o600
    sim.check_output("head", make, timeout=30)
    assert secrets_env.read_text() == first  # kept, never rotated
    secret_env = environment_file(secrets_env)
    assert set(secret_env) == SECRET_KEYS
    password = secret_env["PDSERVE_REDIS_PASSWORD"]

    # setup-head.sh's Redis settings (redis-conf.sh) in the head's namespace; redis-server on them.
    conf_text = sim.check_output("head", ["bash", str(pdir / "redis-conf.sh"), str(pdir)], {"HOME": str(home)})
    conf = [line for line in conf_text.splitlines() if line and not line.startswith("#")]
    assert conf == [f"port {REDIS_PORT}", f"bind 127.0.0.1 {head}", "protected-mode yes", f"requirepass {password}",
                    'save ""', "appendonly no"]  # fmt: skip
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir(mode=0o700)
    redis_log = redis_dir / "redis.log"
    with open(redis_log, "wb") as log:
        redis = sim.run("head", [redis_bin, str(write_private(redis_dir / "pdserve.conf", conf_text))],
                        stdout=log, stderr=subprocess.STDOUT, cwd=redis_dir)  # fmt: skip
    up: subprocess.Popen[str] | None = None
    try:
        assert wait_until(lambda: "Ready to accept" in redis_log.read_text() or redis.poll() is not None, 30)
        assert redis.poll() is None, redis_log.read_text()
        ask = [sys.executable, "-c", REDIS_ASK, head, str(REDIS_PORT)]
        answer = json.loads(sim.check_output("head", ask, {"REDIS_PASSWORD": password}))
        # NOAUTH on both addresses (redis-py: AuthenticationError), PONG with the password.
        assert answer["127.0.0.1"].startswith("AuthenticationError") and answer[head] == answer["127.0.0.1"], answer
        assert answer["ping"] is True

        # run-pdserve.sh as pdserve.service runs it: secrets.env as the environment, HOME, cwd HOME.
        (pdir / "service.json").write_text(json.dumps(config))
        stderr = tmp_path / "up.stderr"
        with open(stderr, "wb") as err:
            up = sim.run("head", ["/bin/bash", str(pdir / "run-pdserve.sh")], secret_env | {"HOME": str(home)},
                         cwd=home, stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
        lines = Lines(up.stdout)
        ready = read_until(lines, lambda line: line is not None and line.startswith("state in "), READY_TIMEOUT_S)
        assert ready and up.poll() is None, f"{lines.seen}\n{stderr.read_text()[-4000:]}"
        assert f"router listening on 0.0.0.0:{router_port}" in lines.seen
        assert f"redis at redis://:***@{head}:{REDIS_PORT}/0" in lines.seen  # run-pdserve.sh's URL: this node's IP
        state_file = Path(lines.seen[-1].removeprefix("state in ").split(" (")[0])
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600

        # Every port where the cluster file and service.json put it, each node its own.
        on = {node: {port for _, port in listening(sim, node)} for node in ("head", "n1", "n2")}
        assert {("127.0.0.1", REDIS_PORT), (head, REDIS_PORT)} <= listening(sim, "head")
        assert set(ray_ports.values()) | {router_port, http_port} <= on["head"]
        every_node = {ray_ports["--object-manager-port"], ray_ports["--metrics-export-port"]}
        assert every_node | {transfer_port} <= on["n1"] and every_node | {transfer_port} <= on["n2"]

        probe = Probe(sim, "head", f"{head}:{router_port}", f"redis://:{password}@{head}:{REDIS_PORT}/0")
        try:
            assert probe.workers == ["decode-0", "prefill-0"]
            registry = probe.call("registry")
            assert registry["prefill-0"]["grpc_address"] == f"{n1}:{transfer_port}"
            assert registry["decode-0"]["grpc_address"] == f"{n2}:{transfer_port}"
            prompt = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(5)).tolist()
            r = probe.generate(prompt, MAX_TOKENS)
            assert r["token_ids"] == reference(prompt, MAX_TOKENS) and r["finish_reason"] == "length"
            assert r["usage"]["transferred_tokens"] == len(prompt)  # prefilled on n1, pulled by n2
            seeded = {h.hex() for h in block_hashes(prompt, BLOCK, secret_env["PDSERVE_HASH_SEED"])}
            unseeded = {h.hex() for h in block_hashes(prompt, BLOCK)}
            assert wait_until(lambda: seeded <= set(probe.call("holders")), timeout=15)
            assert not unseeded & set(probe.call("holders"))
        finally:
            probe.close()

        # `systemctl stop`: SIGTERM to the unit's process (the script, which exec'd pdserve up).
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0, stderr.read_text()[-4000:]
        assert read_until(lines, lambda line: line is None, timeout=30)  # its output, to the end
        assert any(line.startswith("draining: new requests refused") for line in lines.seen), lines.seen
        assert "stopping..." in lines.seen  # nothing cut off
        assert not state_file.exists()
        answer = json.loads(sim.check_output("head", ask, {"REDIS_PASSWORD": password}))
        assert answer["workers"] == {}  # each worker unregistered on its way out
    finally:
        if up is not None:
            stop_pid(up, timeout=60)
        stop_pid(redis, timeout=30)
