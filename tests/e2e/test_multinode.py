"""Multi-node end to end: ``pdserve up`` across a 3-node simulated cluster (``pdserve.cluster.simnet``).

Started as an operator would: on the head, an external ``redis-server`` bound to the head's address with
a password (``requirepass``, as deploy/setup-head.sh configures it) and ``pdserve up --ray-address ...
--config FILE`` (router; the workers get a cluster secret from ``PDSERVE_CLUSTER_SECRET`` and fixed
KV-transfer ports); n1 offers the Ray resource ``prefill_node``, n2 ``decode_node``, so the prefill worker
lands on n1 and the decode worker on n2, and every KV pull crosses the simulated network.

The test process stays in the root namespace, which has no address on the bridge: what it asks the
service goes through a probe process in the head's namespace (gRPC to the router, Redis, and each
worker's pool state through Ray). Every check is against an independent reference: transformers'
greedy ``generate`` for the tokens, ``block_hashes`` computed here for the Redis index, the kernel's
own view of which namespace each worker process and listening socket lives in, and the node's link
counters for the bytes that crossed. Needs root and ``ip netns``; skips with the reason otherwise.

A fault between n1 and n2 only is made here with neighbour entries that point nowhere (frames to the
peer go to a MAC nobody has: silence, as with a firewall dropping them), because ``sim.partition``
cuts a node off from every node, the head's Ray, Redis and router included.
"""

from __future__ import annotations

import itertools
import json
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdserve.cluster.simnet import NODE_IFACE, NodeSpec, SimCluster, pids_in_netns, process_alive, simnet_available
from pdserve.cluster.simnet.service import HeadRedis, PdserveUp, Probe
from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.kvindex.embedded import find_redis_server
from tests.support.connect_probe import CONNECT
from tests.support.polling import wait_until
from tests.support.sim_models import greedy_reference, make_checkpoint

pytestmark = pytest.mark.slow

BLOCK = 16
ROUTER_PORT = 50051
REDIS_PORT = 6380  # the head's 6379 is Ray's GCS
TRANSFER_PORT = 50100  # transfer.port_range "50100-50101": the first free one on each node
PULL_TIMEOUT_S = 2.0  # transfer timeouts, low so that a pull into silence ends soon
LEASE_TTL_S = 5.0
IDLE_WITHIN_S = 2.0  # after the last request: no block held, no lease open, no request left
MAX_TOKENS = 8



@dataclass
class Cluster:
    sim: SimCluster
    probe: Probe
    router: str
    kv_bytes_per_token: int
    reference: Callable[[list[int], int], list[int]]  # transformers' greedy tokens
    redis_stop: Callable[[], None]  # the head's Redis: SIGTERM, wait
    redis_start: Callable[[], None]  # the same port, password and config (empty: no persistence)

    def idle(self) -> bool:
        pools = self.probe.quietly("pools")
        return bool(pools) and set(pools) == {"prefill-0", "decode-0"} and all(
            s["free_blocks"] == s["num_blocks"] and s["leases"] == s["requests"] == s["registered"] == 0
            for s in pools.values())  # fmt: skip

    def holders(self) -> dict[str, list[str]]:
        return self.probe.quietly("holders") or {}

    def counters(self, worker: str | None = None) -> dict[str, int]:
        s = self.probe.quietly("stats") or {}
        return (s.get("cluster") if worker is None else s.get("workers", {}).get(worker)) or {}


def prompt_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer, float32 (the CPU engine's dtype), from the checkpoint's config."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def leftovers(prefix: str) -> list[str]:
    """Lines of `ip netns list` and `ip link` (root namespace) that name the run."""
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"{prefix}-" in line]


@pytest.fixture(autouse=True, scope="module")  # module scope: before the module's other fixtures
def _needs_simnet() -> None:
    if reason := simnet_available():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    try:
        redis_bin = find_redis_server()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("multinode")
    tmp.chmod(0o700)
    model_dir = make_checkpoint(tmp / "model")
    reference = greedy_reference(model_dir)

    nodes = [
        NodeSpec("head", cpus=1),
        NodeSpec("n1", cpus=1, resources={"prefill_node": 1}),
        NodeSpec("n2", cpus=1, resources={"decode_node": 1}),
    ]
    with SimCluster(nodes, "fast") as sim:
        head = sim.address("head")
        redis = HeadRedis(sim, "head", tmp / "redis", redis_bin, port=REDIS_PORT)
        config = {
            "prefill": 1, "decode": 1, "host": head, "port": ROUTER_PORT, "http_port": None,
            "prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1},
            "engine": {"model": str(model_dir), "cache": {"block_size": BLOCK, "kv_cache_memory_bytes": 16 * 1024**2}},
            "index": {"url": redis.url},
            "transfer": {"port_range": f"{TRANSFER_PORT}-{TRANSFER_PORT + 1}", "lease_ttl_s": LEASE_TTL_S,
                         "pull_timeout_s": PULL_TIMEOUT_S, "metadata_timeout_s": PULL_TIMEOUT_S,
                         "release_timeout_s": PULL_TIMEOUT_S, "stall_timeout_s": PULL_TIMEOUT_S},
            # Every request is prefilled on n1 and pulled to n2 (no local prefill on the decode worker).
            "router": {"kv_policy": "pull", "local_prefill_threshold": 0, "drain_timeout_s": 5},
        }  # fmt: skip
        up: PdserveUp | None = None
        probe: Probe | None = None
        try:
            up = PdserveUp(sim, "head", config, tmp, {"PDSERVE_CLUSTER_SECRET": secrets.token_hex(32)})
            assert up.router == f"{head}:{ROUTER_PORT}"
            probe = Probe(sim, "head", up.router, redis.url)
            assert probe.workers == ["decode-0", "prefill-0"]
            yield Cluster(sim, probe, up.router, kv_bytes_per_token(model_dir), reference, redis.stop, redis.start)
            assert up.alive(), up.stderr()  # it served throughout
        finally:
            if probe is not None:
                probe.close()
            if up is not None:
                up.stop()  # drains, stops the workers and the router
            redis.stop()
        pids, prefix = sim.recorded_pids(), sim.prefix
    # The run left nothing: no namespace, no link, no process, no run directory.
    assert leftovers(prefix) == []
    assert [pid for pid, start in pids.items() if process_alive(pid, start)] == []
    assert not (Path("/tmp/pds-simnet") / prefix).exists()


def processes(sim: SimCluster, node: str, title: str) -> list[int]:
    """Processes in ``node``'s namespace whose command line starts with ``title`` (Ray sets an actor
    process's title to ``ray::ClassName``)."""
    found = []
    for pid in pids_in_netns(sim.node(node).netns):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith(title):
            found.append(pid)
    return found


def listening(sim: SimCluster, node: str, port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` in ``node``'s namespace, from its /proc/net."""
    addrs = set()
    for table in ("tcp", "tcp6"):
        text = sim.check_output(node, ["cat", f"/proc/net/{table}"], timeout=30)
        for row in text.splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            host, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            if len(host) == 8:
                addrs.add(".".join(str(b) for b in reversed(bytes.fromhex(host))))
            else:
                addrs.add("::" if int(host, 16) == 0 else host)
    return addrs


def cut_link(sim: SimCluster, a: str, b: str) -> None:
    """Silence between ``a`` and ``b`` only: each sends the other's frames to a MAC nobody has."""
    for x, y in ((a, b), (b, a)):
        subprocess.run(["ip", "-n", sim.node(x).netns, "neigh", "replace", sim.address(y), "lladdr",
                        "02:00:00:00:00:01", "dev", NODE_IFACE, "nud", "permanent"], check=True)  # fmt: skip


def mend_link(sim: SimCluster, a: str, b: str) -> None:
    for x, y in ((a, b), (b, a)):
        subprocess.run(["ip", "-n", sim.node(x).netns, "neigh", "del", sim.address(y), "dev", NODE_IFACE],
                       check=True)  # fmt: skip


def connects(sim: SimCluster, src: str, dst: str, port: int) -> str:
    return sim.check_output(src, [sys.executable, "-c", CONNECT, sim.address(dst), str(port), "1"], timeout=30).strip()


def assert_idle_soon(c: Cluster) -> None:
    """Within IDLE_WITHIN_S of the last request (which just returned): every block free, no lease, no
    request on either worker."""
    assert wait_until(c.idle, timeout=IDLE_WITHIN_S, interval=0.05), c.probe.quietly("pools")


def test_across_nodes_output_placement_hashes_and_bytes_on_the_link(cluster: Cluster) -> None:
    c, sim = cluster, cluster.sim
    n1, n2 = sim.address("n1"), sim.address("n2")
    # Placement, as Redis's registry says (each worker advertises its node's address and the fixed port) ...
    registry = c.probe.call("registry")
    assert registry["prefill-0"]["role"] == "prefill" and registry["decode-0"]["role"] == "decode"
    assert registry["prefill-0"]["grpc_address"] == f"{n1}:{TRANSFER_PORT}"
    assert registry["decode-0"]["grpc_address"] == f"{n2}:{TRANSFER_PORT}"
    # ... and as the kernel says: each actor's process is in its node's namespace, the router in the head's,
    assert len(processes(sim, "n1", "ray::PrefillWorker")) == 1
    assert len(processes(sim, "n2", "ray::DecodeWorker")) == 1
    assert processes(sim, "head", "ray::PrefillWorker") == processes(sim, "n2", "ray::PrefillWorker") == []
    assert processes(sim, "head", "ray::DecodeWorker") == processes(sim, "n1", "ray::DecodeWorker") == []
    assert len(processes(sim, "head", "ray::Router")) == 1
    # and each KV-transfer server listens there on an address other nodes reach (not loopback).
    for node, addr in (("n1", n1), ("n2", n2)):
        bound = listening(sim, node, TRANSFER_PORT)
        assert bound and bound <= {"0.0.0.0", "::", addr}, bound

    prompts = [prompt_ids(1, 20), prompt_ids(2, 37), prompt_ids(3, 64)]
    for p in prompts:
        r = c.probe.generate(p, MAX_TOKENS)
        assert r["token_ids"] == c.reference(p, MAX_TOKENS)
        assert r["finish_reason"] == "length" and r["usage"]["transferred_tokens"] == len(p)

    # A long prompt: its KV (prefilled on n1) crosses n2's link.
    long = prompt_ids(4, 600)
    rx = sim.link_bytes("n2").rx
    r = c.probe.generate(long, MAX_TOKENS)
    grown = sim.link_bytes("n2").rx - rx
    assert r["token_ids"] == c.reference(long, MAX_TOKENS)
    assert r["usage"]["transferred_tokens"] == len(long) and r["usage"]["cached_tokens"] == 0
    assert grown >= r["usage"]["transferred_tokens"] * c.kv_bytes_per_token, (grown, c.kv_bytes_per_token)
    prompts.append(long)

    # The index holds exactly the full blocks of the prompts on the prefill worker, and the decode
    # worker (which cached what it pulled) holds them too, under the hashes computed here.
    expected = {h.hex() for p in prompts for h in block_hashes(p, BLOCK)}

    def held_by(worker: str) -> set[str]:
        return {k for k, ws in c.holders().items() if worker in ws}

    assert wait_until(lambda: held_by("prefill-0") == expected, timeout=15), (len(held_by("prefill-0")), len(expected))
    assert wait_until(lambda: held_by("decode-0") >= expected, timeout=15)

    # The same prompt again: a prefix hit, same tokens.
    again = c.probe.generate(long, MAX_TOKENS)
    assert again["token_ids"] == r["token_ids"]
    assert again["usage"]["cached_tokens"] > 0
    assert_idle_soon(c)


def test_partition_between_prefill_and_decode_node_recomputes_then_heals(cluster: Cluster) -> None:
    c, sim = cluster, cluster.sim
    assert c.idle()
    before = c.counters("decode-0")
    cut_link(sim, "n1", "n2")
    try:
        assert connects(sim, "n2", "n1", TRANSFER_PORT) == "timeout"  # silence, not a refusal
        assert connects(sim, "head", "n1", TRANSFER_PORT) == "connected"  # only n1 <-> n2 is cut
        p = prompt_ids(20, 150)
        r = c.probe.generate(p, MAX_TOKENS)
        # The pull waited for its deadline and gave up; the decode worker computed the prompt itself.
        assert r["token_ids"] == c.reference(p, MAX_TOKENS) and r["finish_reason"] == "length"
        assert r["usage"]["transferred_tokens"] == 0
        assert PULL_TIMEOUT_S <= r["seconds"] < PULL_TIMEOUT_S + 15, r["seconds"]
    finally:
        mend_link(sim, "n1", "n2")

    def counted() -> bool:
        now = c.counters("decode-0")
        return (now.get("transfer_failures", 0) == before.get("transfer_failures", 0) + 1
                and now.get("recomputed_tokens", 0) == before.get("recomputed_tokens", 0) + len(p))

    assert wait_until(counted, timeout=15), c.counters("decode-0")
    assert connects(sim, "n2", "n1", TRANSFER_PORT) == "connected"

    # Healed: pulls work again (the first may still wait out TCP's retransmission backoff).
    seeds, last = itertools.count(30), {}

    def pulled() -> bool:
        nonlocal last
        q = prompt_ids(next(seeds), 90)
        last = c.probe.generate(q, MAX_TOKENS)
        assert last["token_ids"] == c.reference(q, MAX_TOKENS)
        return last["usage"]["transferred_tokens"] == len(q)

    assert wait_until(pulled, timeout=30, interval=0), last
    assert_idle_soon(c)


def test_redis_restart_while_both_nodes_serve(cluster: Cluster) -> None:
    c = cluster
    n1, n2 = c.sim.address("n1"), c.sim.address("n2")
    a = prompt_ids(40, 80)
    assert c.probe.generate(a, MAX_TOKENS)["token_ids"] == c.reference(a, MAX_TOKENS)
    a_blocks = {h.hex() for h in block_hashes(a, BLOCK)}
    assert wait_until(lambda: all("prefill-0" in c.holders().get(h, []) for h in a_blocks), timeout=15)

    c.redis_stop()
    try:
        assert c.probe.quietly("registry") is None  # Redis is down indeed
        b = prompt_ids(41, 70)
        rb = c.probe.generate(b, MAX_TOKENS)  # served with Redis down: routed without the index, pulled all the same
        assert rb["token_ids"] == c.reference(b, MAX_TOKENS) and rb["usage"]["transferred_tokens"] == len(b)
    finally:
        c.redis_start()  # an empty server: no persistence
    d = prompt_ids(42, 60)
    rd = c.probe.generate(d, MAX_TOKENS)
    assert rd["token_ids"] == c.reference(d, MAX_TOKENS)

    # The workers come back in the registry, republish what they hold, and the counters resume (the
    # increments made while Redis was down are written once it answers).
    def registered() -> bool:
        reg = c.probe.quietly("registry") or {}
        return ({w: reg.get(w, {}).get("grpc_address") for w in ("prefill-0", "decode-0")}
                == {"prefill-0": f"{n1}:{TRANSFER_PORT}", "decode-0": f"{n2}:{TRANSFER_PORT}"})

    assert wait_until(registered, timeout=15)
    expected = {h.hex() for p in (a, b, d) for h in block_hashes(p, BLOCK)}
    for worker in ("prefill-0", "decode-0"):
        assert wait_until(lambda: expected <= {k for k, ws in c.holders().items() if worker in ws}, timeout=20), worker
    assert wait_until(lambda: c.counters().get("requests", 0) >= 2
                      and c.counters().get("transferred_tokens", 0) >= len(b) + len(d), timeout=20), c.counters()
    last = c.probe.generate(a, MAX_TOKENS)  # still a prefix hit (the pools kept their blocks through the outage)
    assert last["usage"]["cached_tokens"] > 0 and last["token_ids"] == c.reference(a, MAX_TOKENS)
    assert_idle_soon(c)
