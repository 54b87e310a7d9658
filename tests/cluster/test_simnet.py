"""The simulated multi-node cluster (pdserve.cluster.simnet): nodes are network namespaces on a bridge.

What is checked is real: a Ray cluster across two namespaces scheduling on both, link delay and rate
measured with TCP between namespaces, a partition seen as a connect timeout, and teardown (normal exit,
exception, SIGTERM, a crashed owner cleaned up by `scripts/simcluster.sh down`) leaving no namespace, link
or process behind. Needs root and `ip netns`; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster.simnet import NodeSpec, SimCluster, SimnetError, process_alive, simnet_available
from tests.support import REPO
from tests.support.connect_probe import CONNECT
from tests.support.polling import wait_until

# Probes run inside the namespaces, as separate processes (the test process stays in the root namespace).
ECHO_SERVER = r"""
import socket, sys, threading
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
def echo(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (data := c.recv(65536)):
        c.sendall(data)
while True:
    threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()
"""
RTT_CLIENT = r"""
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(7):
    t = time.perf_counter(); s.sendall(b"x"); s.recv(1); rtts.append((time.perf_counter() - t) * 1000)
print(json.dumps(sorted(rtts)))
"""
SINK = r"""
import json, socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
conn, _ = srv.accept()
buf, n, first = bytearray(1 << 20), 0, None
while (k := conn.recv_into(buf)):
    first = first or time.perf_counter()
    n += k
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - first}), flush=True)
"""
SOURCE = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
chunk, sent, end = b"x" * (1 << 20), 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end and sent < 4 << 30:  # bounded in time and in bytes
    s.sendall(chunk); sent += len(chunk)
"""
DRIVER = r"""
import json, os, ray
ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ["SIMNET_NODE_IP"],
         log_to_driver=False, logging_level="ERROR")

@ray.remote
def where():
    # The addresses of the network namespace this worker process runs in, from the kernel itself.
    lines = open("/proc/net/fib_trie").read().splitlines()
    local = sorted({a.split()[-1] for a, b in zip(lines, lines[1:]) if "/32 host LOCAL" in b})
    return {"ip": ray.util.get_node_ip_address(), "local": local, "node_id": ray.get_runtime_context().get_node_id()}

names = json.loads(os.environ["NODE_NAMES"])
out = {n: ray.get(where.options(resources={f"node_{n}": 1}).remote(), timeout=90) for n in names}
print("@@" + json.dumps({"driver_ip": ray.util.get_node_ip_address(), "nodes": out}), flush=True)
"""


@pytest.fixture(autouse=True, scope="module")  # module scope: before the module's other fixtures
def _needs_simnet() -> None:
    if reason := simnet_available():
        pytest.skip(reason)


def leftovers(prefix: str) -> list[str]:
    """Lines of `ip netns list` and `ip link` (root namespace) that name the run."""
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"{prefix}-" in line]


def live(pids: dict[int, int]) -> list[int]:
    return [pid for pid, start in pids.items() if process_alive(pid, start)]


def assert_gone(prefix: str, pids: dict[int, int]) -> None:
    assert pids, "nothing was recorded"
    assert leftovers(prefix) == []
    assert live(pids) == []
    assert not (Path("/tmp/pds-simnet") / prefix).exists()


def serve(sim: SimCluster, node: str, script: str, *args: str) -> subprocess.Popen[str]:
    """Start a listening probe on ``node``; returns once it listens (it prints "ready")."""
    proc = sim.run(node, [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def probe(sim: SimCluster, node: str, script: str, *args: str) -> str:
    return sim.check_output(node, [sys.executable, "-c", script, *args], timeout=30).strip()


@pytest.fixture(scope="module")
def net() -> Iterator[SimCluster]:
    """Two nodes, network only (no Ray), with an echo server on b:7000."""
    with SimCluster([NodeSpec("a"), NodeSpec("b")], "fast", ray=False) as sim:
        serve(sim, "b", ECHO_SERVER, "7000")
        yield sim


def rtts(sim: SimCluster) -> list[float]:
    return json.loads(probe(sim, "a", RTT_CLIENT, sim.address("b"), "7000"))


def throughput_gbps(sim: SimCluster, seconds: float) -> float:
    """Bytes/s from a to b over one TCP connection, as b receives them; b's link counters agree."""
    rx_before = sim.link_bytes("b").rx
    sink = serve(sim, "b", SINK, "7001")
    probe(sim, "a", SOURCE, sim.address("b"), "7001", str(seconds))
    assert sink.stdout is not None
    got = json.loads(sink.stdout.readline())
    sink.wait(timeout=10)
    assert sim.link_bytes("b").rx - rx_before >= got["bytes"]  # the bytes crossed b's eth0
    return got["bytes"] * 8 / got["seconds"] / 1e9


def test_links_carry_their_profiles_delay_and_rate(net: SimCluster) -> None:
    for node in ("a", "b"):
        net.set_profile(node, "slow")
    slow_rtts, slow_gbps = rtts(net), throughput_gbps(net, 1.0)
    for node in ("a", "b"):
        net.set_profile(node, "fast")
    fast_rtts, fast_gbps = rtts(net), throughput_gbps(net, 1.0)
    # slow: 5 ms on each direction of each link, so 2 * (5 + 5) ms a round trip; fast: 0.8 ms. The least
    # round trip of each bounds the delay the links hold: a busy machine only adds to some of them (the
    # nfqueue backend's daemons wait for a CPU), so the fast profile is judged by its least too.
    assert slow_rtts[0] >= 10.0, slow_rtts
    assert fast_rtts[0] < 5.0, fast_rtts
    assert slow_gbps <= 1.1, slow_gbps  # tbf at 1 Gbit/s
    assert fast_gbps >= 2 * slow_gbps, (slow_gbps, fast_gbps)


def test_a_partitioned_node_is_silent_until_healed(net: SimCluster) -> None:
    b = net.address("b")
    assert probe(net, "a", CONNECT, b, "7000", "3") == "connected"
    net.partition("b")
    try:
        assert probe(net, "a", CONNECT, b, "7000", "1") == "timeout"  # silence, not a refusal
        assert probe(net, "b", CONNECT, net.address("a"), "7000", "1") == "timeout"  # both directions
    finally:
        net.heal("b")
    assert probe(net, "a", CONNECT, b, "7000", "3") == "connected"


def run_driver(sim: SimCluster) -> dict:
    """DRIVER on the head node; its report (the line marked ``@@``: Ray prints notices to a driver's
    stdout, such as a node declared dead, before and after it)."""
    env = {"NODE_NAMES": json.dumps(list(sim.nodes))}
    out = sim.check_output("head", [sys.executable, "-c", DRIVER], env, timeout=150)
    [report] = [line[2:] for line in out.splitlines() if line.startswith("@@")]
    return json.loads(report)


# The GCS declares a killed node dead after missing this many health checks (Ray's default: 5 of 3 s).
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}


@pytest.mark.slow
def test_two_namespaces_form_one_ray_cluster_that_schedules_on_both() -> None:
    nodes = [NodeSpec("head", cpus=1, resources={"node_head": 1}), NodeSpec("n1", cpus=1, resources={"node_n1": 1})]
    with SimCluster(nodes, "fast", ray_env=FAST_HEALTH_CHECKS) as sim:
        out = run_driver(sim)
        assert out["driver_ip"] == sim.address("head")
        for name in ("head", "n1"):
            assert out["nodes"][name]["ip"] == sim.address(name)
            # the task ran in that node's namespace, not merely on a Ray node claiming its address
            assert out["nodes"][name]["local"] == sorted([sim.address(name), "127.0.0.1"])
        head_ray = sim.node("head").ray
        killed = sim.kill_node("n1")
        assert killed and not any(process_alive(pid) for pid in killed)
        assert head_ray is not None and head_ray.poll() is None  # only n1's Ray went
        sim.restart_node("n1")
        again = run_driver(sim)
        assert again["nodes"]["n1"]["ip"] == sim.address("n1")
        assert again["nodes"]["n1"]["node_id"] != out["nodes"]["n1"]["node_id"]  # a new Ray node joined
        pids, prefix = sim.recorded_pids(), sim.prefix
    assert_gone(prefix, pids)


def test_teardown_after_an_exception_inside_the_block() -> None:
    sim = SimCluster([NodeSpec("a"), NodeSpec("b")], ray=False)
    with pytest.raises(RuntimeError, match="boom"), sim:
        sim.run("b", ["sleep", "600"])
        pids, prefix = sim.recorded_pids(), sim.prefix
        assert leftovers(prefix)
        raise RuntimeError("boom")
    assert_gone(prefix, pids)
    sim.close()  # idempotent


OWNER = r"""
import json, os, signal, sys
from pdserve.cluster.simnet import NodeSpec, SimCluster
sim = SimCluster([NodeSpec("a"), NodeSpec("b")], ray=False).start()
sim.run("b", ["sleep", "600"])
print(json.dumps({"prefix": sim.prefix, "pids": sim.recorded_pids()}), flush=True)
if sys.argv[1] == "crash":
    os.kill(os.getpid(), signal.SIGKILL)  # no teardown at all
signal.pause()
"""


def start_owner(mode: str) -> tuple[subprocess.Popen[str], str, dict[int, int]]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, mode], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, info["prefix"], {int(pid): start for pid, start in info["pids"].items()}


def test_sigterm_to_the_owner_tears_the_run_down() -> None:
    proc, prefix, pids = start_owner("wait")
    assert leftovers(prefix) and live(pids)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # then it dies of SIGTERM, as it would have
    assert_gone(prefix, pids)


def test_down_removes_what_a_crashed_run_left() -> None:
    proc, prefix, pids = start_owner("crash")
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert leftovers(prefix) and live(pids)  # the sleep and the delay daemons outlive their owner
    script = ["bash", str(REPO / "scripts" / "simcluster.sh")]
    status = json.loads(subprocess.run(script + ["status", "--json", prefix], capture_output=True, text=True,
                                       check=True).stdout)  # fmt: skip
    assert status[0]["prefix"] == prefix and status[0]["stale"]
    subprocess.run(script + ["down", prefix], check=True, capture_output=True)
    assert wait_until(lambda: not live(pids), timeout=10)
    assert_gone(prefix, pids)


def test_node_names_must_be_unique() -> None:
    with pytest.raises(SimnetError, match="unique"):
        SimCluster([NodeSpec("a"), NodeSpec("a")])


def test_extra_ray_flags_are_name_value_pairs_the_cluster_does_not_set_itself() -> None:
    sim = SimCluster([NodeSpec("a")], ray_port=6380, ray_args=["--object-manager-port=8076"])
    assert sim.ray_args == ("--object-manager-port=8076",) and sim.ray_port == 6380
    for bad in (["--port=6381"], ["--temp-dir=/tmp/x"], ["--object-manager-port", "8076"], ["8076"]):
        with pytest.raises(SimnetError, match="ray_args"):
            SimCluster([NodeSpec("a")], ray_args=bad)


def test_a_ray_start_that_fails_is_started_once_more_then_reported_and_nothing_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = SimCluster([NodeSpec("a", cpus=1)], ray_args=["--no-such-flag=1"])  # `ray start` exits at once
    with (
        caplog.at_level("WARNING", logger="pdserve.cluster.simnet.cluster"),
        pytest.raises(SimnetError, match="ray start on a exited"),
    ):
        sim.start()
    assert sum("starting Ray on every node again" in r.getMessage() for r in caplog.records) == 1
    assert leftovers(sim.prefix) == [] and live(sim.recorded_pids()) == []
    assert not (Path("/tmp/pds-simnet") / sim.prefix).exists()
