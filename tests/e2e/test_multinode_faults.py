"""Multi-node fleet and its faults: ``pdserve up`` across a 3-node simulated cluster with two decode
workers, mutual TLS on the KV-transfer plane with the operator's certificates, and the decode node
killed and brought back under load.

head: Ray's head, the router, an external Redis with a password, and one decode worker; n1: the
prefill worker; n2: the other decode worker (the Ray resource ``decode_node`` is on the head and on
n2, ``prefill_node`` on n1). Every request is prefilled on n1 and its KV pulled by a decode worker,
over TLS whose certificate names each node's address. The service is started as an operator starts
it (pdserve.cluster.simnet.service); tokens are checked against transformers' greedy ``generate``.
Needs root and ``ip netns``; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from pdserve.cluster.simnet import NodeSpec, SimCluster, process_alive, simnet_available
from pdserve.cluster.simnet.service import HeadRedis, PdserveUp, Probe
from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.kvindex.embedded import find_redis_server
from tests.support.polling import wait_until
from tests.support.sim_models import greedy_reference, make_checkpoint
from tests.support.tls_cluster import ClusterCerts, make_cluster_certs

pytestmark = pytest.mark.slow

BLOCK = 16
ROUTER_PORT = 50051
METRICS_PORT = 9400
REDIS_PORT = 6380  # the head's 6379 is Ray's GCS
TRANSFER_PORT = 50100
IDLE_WITHIN_S = 2.0
PREFILL, DECODES = "prefill-0", ("decode-0", "decode-1")

# A peer of the cluster reaching a node's KV-transfer port: TLS with the given CA and client
# certificate, the address checked against the server's certificate, then HTTP/2's preface; "ok" and
# the TLS version when the server answers with its own frames (it accepted the client's certificate:
# under TLS 1.3 a refused one shows only on the first read), else the error.
HANDSHAKE = r"""
import socket, ssl, sys
host, port, ca, cert, key = sys.argv[1:6]
ctx = ssl.create_default_context(cafile=ca)
if cert != "-":
    ctx.load_cert_chain(cert, key)
ctx.set_alpn_protocols(["h2"])
try:
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        print("ok " + s.version() if s.recv(9) else "closed")
except (ssl.SSLError, OSError) as exc:
    print(type(exc).__name__, exc)
"""


@dataclass
class Fleet:
    sim: SimCluster
    probe: Probe
    reference: Callable[[list[int], int], list[int]]
    certs: ClusterCerts
    other_certs: ClusterCerts  # a CA and node certificate the cluster does not trust
    redis_url: str
    state_dir: Path

    def node_of(self, worker: str) -> str:
        """The simulated node ``worker`` runs on, from the address it registered in Redis."""
        host = self.probe.call("registry")[worker]["grpc_address"].rsplit(":", 1)[0]
        return next(n for n in ("head", "n1", "n2") if self.sim.address(n) == host)

    def idle(self, workers: tuple[str, ...]) -> bool:
        pools = self.probe.quietly("pools", only=list(workers)) or {}
        return set(pools) == set(workers) and all(
            s["free_blocks"] == s["num_blocks"] and s["leases"] == s["requests"] == s["registered"] == 0
            for s in pools.values())  # fmt: skip

    def holders(self, prompt: list[int]) -> set[str]:
        """Workers Redis names as holders of every full block of ``prompt``."""
        held = self.probe.call("holders")
        sets = [set(held.get(h.hex(), [])) for h in block_hashes(prompt, BLOCK)]
        return set.intersection(*sets) if sets else set()


def prompt_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.fixture(autouse=True, scope="module")
def _needs_simnet() -> None:
    if reason := simnet_available():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    try:
        redis_bin = find_redis_server()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("fleet")
    tmp.chmod(0o700)
    model_dir = make_checkpoint(tmp / "model")
    reference = greedy_reference(model_dir)
    nodes = [
        NodeSpec("head", cpus=1, resources={"decode_node": 1}),
        NodeSpec("n1", cpus=1, resources={"prefill_node": 1}),
        NodeSpec("n2", cpus=1, resources={"decode_node": 1}),
    ]
    with SimCluster(nodes, "fast") as sim:
        (tmp / "certs").mkdir(mode=0o700)
        (tmp / "other").mkdir(mode=0o700)
        certs = make_cluster_certs(tmp / "certs", [sim.address(n) for n in ("head", "n1", "n2")])
        other = make_cluster_certs(tmp / "other", [sim.address(n) for n in ("head", "n1", "n2")])
        head = sim.address("head")
        redis = HeadRedis(sim, "head", tmp / "redis", redis_bin, port=REDIS_PORT)
        tls = {"cert_file": certs.cert, "key_file": certs.key, "ca_file": certs.ca}
        config = {
            "prefill": 1, "decode": 2, "host": head, "port": ROUTER_PORT, "http_port": None,
            "metrics_port": METRICS_PORT,
            "prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1},
            "engine": {"model": str(model_dir), "cache": {"block_size": BLOCK, "kv_cache_memory_bytes": 16 * 1024**2}},
            "index": {"url": redis.url},
            "transfer": {"port_range": f"{TRANSFER_PORT}-{TRANSFER_PORT + 1}", "lease_ttl_s": 5.0, "tls": tls,
                         "pull_timeout_s": 5.0, "metadata_timeout_s": 5.0},
            "router": {"kv_policy": "pull", "local_prefill_threshold": 0, "drain_timeout_s": 5,
                       "health_probe_interval_s": 0.5},
        }  # fmt: skip
        up: PdserveUp | None = None
        probe: Probe | None = None
        try:
            up = PdserveUp(sim, "head", config, tmp, {"PDSERVE_CLUSTER_SECRET": secrets.token_hex(32)})
            probe = Probe(sim, "head", up.router, redis.url)
            assert probe.workers == [*DECODES, PREFILL]
            yield Fleet(sim, probe, reference, certs, other, redis.url, tmp / "state")
            assert up.alive(), up.stderr()
        finally:
            if probe is not None:
                probe.close()
            if up is not None:
                up.stop()
            redis.stop()
        pids = sim.recorded_pids()
    assert [pid for pid, start in pids.items() if process_alive(pid, start)] == []


def handshake(f: Fleet, node: str, certs: ClusterCerts | None, ca: str) -> str:
    cert, key = (certs.cert, certs.key) if certs is not None else ("-", "-")
    args = [sys.executable, "-c", HANDSHAKE, f.sim.address(node), str(TRANSFER_PORT), ca, cert, key]
    return f.sim.check_output("head", args, timeout=60).strip()


def metrics_text(f: Fleet) -> str:
    url = f"http://{f.sim.address('head')}:{METRICS_PORT}/metrics"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=20).read().decode())"
    return f.sim.check_output("head", [sys.executable, "-c", code], timeout=60)


def test_tls_across_nodes_and_every_nodes_workers_in_stats_and_metrics(fleet: Fleet) -> None:
    f = fleet
    nodes = {w: f.node_of(w) for w in (PREFILL, *DECODES)}
    assert nodes[PREFILL] == "n1" and sorted(nodes[d] for d in DECODES) == ["head", "n2"]
    # The transfer ports speak TLS with the operator's certificate, checked against each node's
    # address; a peer with a certificate from another CA, or none, is turned away (mutual TLS).
    for node in ("n1", "n2"):
        assert handshake(f, node, f.certs, f.certs.ca).startswith("ok TLS"), node
        assert not handshake(f, node, f.other_certs, f.certs.ca).startswith("ok"), node  # client cert refused
        assert not handshake(f, node, None, f.certs.ca).startswith("ok"), node  # no client cert
        assert "CERTIFICATE_VERIFY_FAILED" in handshake(f, node, f.certs, f.other_certs.ca), node
    # Requests go to both decode workers (concurrent streams are spread by load) and pull over TLS.
    prompts = [prompt_ids(100 + i, 40 + 7 * i) for i in range(4)]
    sids = [f.probe.call("start_stream", prompt=p, max_tokens=24) for p in prompts]
    assert wait_until(lambda: all(s["done"] for s in f.probe.call("streams").values()), timeout=120)
    streams = f.probe.call("streams")
    for sid, p in zip(sids, prompts):
        s = streams[sid]
        assert s["error"] is None and s["token_ids"] == f.reference(p, 24), s
    served = {d for d in DECODES if any(d in f.holders(p) for p in prompts)}
    assert served == set(DECODES)
    stats = json.loads(f.sim.check_output("head", [str(Path(sys.executable).parent / "pdserve"), "stats", "--json",
                                                   "--redis-url", f.redis_url], timeout=60))  # fmt: skip
    assert {PREFILL, *DECODES} <= set(stats["workers"])
    assert sum(stats["workers"][d]["transferred_tokens"] for d in DECODES) >= sum(map(len, prompts))
    assert {w: r["node"] for w, r in stats["registry"].items()} == {w: f.sim.address(n) for w, n in nodes.items()}
    text = metrics_text(f)
    for w in (PREFILL, *DECODES):
        assert f'pdserve_worker_up{{worker="{w}"}} 1.0' in text, w
    assert wait_until(lambda: f.idle((PREFILL, *DECODES)), timeout=IDLE_WITHIN_S, interval=0.05)


def test_decode_node_dies_under_load_then_comes_back(fleet: Fleet) -> None:
    f = fleet
    victim = next(d for d in DECODES if f.node_of(d) == "n2")
    survivor = next(d for d in DECODES if d != victim)
    survivors = (PREFILL, survivor)
    # Long streams on both decode workers; the node is killed while every one is mid-stream.
    prompts = [prompt_ids(200 + i, 48) for i in range(4)]
    max_tokens = 900
    sids = [f.probe.call("start_stream", prompt=p, max_tokens=max_tokens) for p in prompts]

    def streaming() -> bool:
        s = f.probe.call("streams")
        return all(len(s[i]["token_ids"]) >= 3 for i in sids)

    assert wait_until(streaming, timeout=60)
    # The node goes at once: a stream decodes in seconds, so waiting first (for Redis to name each
    # stream's decode worker, say) could let the victim's streams finish before it dies. Which
    # streams it served is told afterwards by how they ended.
    f.sim.kill_node("n2")
    assert wait_until(lambda: all(f.probe.call("streams")[i]["done"] for i in sids), timeout=120)
    streams = f.probe.call("streams")
    failed = {i for i in sids if streams[i]["error"] is not None}
    ends = {i: (len(streams[i]["token_ids"]), streams[i]["error"]) for i in sids}
    assert failed and len(failed) < len(sids), ends  # both workers had streams (spread by load)
    for i, p in zip(sids, prompts):
        s = streams[i]
        want = f.reference(p, max_tokens)
        if i in failed:  # ended with a clear status, after the tokens it had sent, which were right
            assert s["error"]["code"] == "UNAVAILABLE", s["error"]
            assert f"decode worker {victim} failed after" in s["error"]["details"]
            assert s["token_ids"] == want[: len(s["token_ids"])]
        else:  # untouched
            assert s["token_ids"] == want
    # New requests: served by the survivor, none failed over the dead worker first.
    for k in range(3):
        q = prompt_ids(300 + k, 40)
        r = f.probe.generate(q, 8)
        assert r["token_ids"] == f.reference(q, 8)
        assert survivor in f.holders(q) and victim not in f.holders(q)
    assert wait_until(lambda: f.idle(survivors), timeout=IDLE_WITHIN_S, interval=0.05), f.probe.quietly("pools")

    # The node comes back: Ray restarts the victim's actor there, it registers again, the router
    # takes it back once it answers, and concurrent requests are spread over both again.
    f.sim.restart_node("n2")
    assert wait_until(lambda: f.idle((PREFILL, *DECODES)), timeout=120, interval=0.5)
    seeds = iter(range(400, 10_000, 4))

    def victim_serves() -> bool:
        s = next(seeds)
        batch = [prompt_ids(s + j, 40) for j in range(4)]
        ids = [f.probe.call("start_stream", prompt=p, max_tokens=16) for p in batch]
        assert wait_until(lambda: all(f.probe.call("streams")[i]["done"] for i in ids), timeout=60)
        got = f.probe.call("streams")
        assert all(got[i]["error"] is None and got[i]["token_ids"] == f.reference(p, 16) for i, p in zip(ids, batch))
        return any(victim in f.holders(p) for p in batch)

    assert wait_until(victim_serves, timeout=90, interval=0.5)
    assert f.node_of(victim) == "n2"
    assert wait_until(lambda: f.idle((PREFILL, *DECODES)), timeout=IDLE_WITHIN_S, interval=0.05)
