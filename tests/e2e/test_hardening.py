"""Attacks and faults against a running service (real Ray, Redis and gRPC): reading KV without
the cluster's credentials, flooding, cancellation storms, a killed router, a killed Redis, and a
graceful drain. Each test performs the attack and checks it fails and the service keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import threading
from pathlib import Path

import grpc
import httpx
import pytest
import ray

from pdserve import SamplingParams
from pdserve.cli.client import build_request, generate
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import AuthError
from pdserve.v1 import kvtransfer_pb2 as kpb
from pdserve.v1 import kvtransfer_pb2_grpc as kpb_grpc
from tests.support.polling import wait_until
from tests.support.service import all_idle, raw_post, shared_ray, stub_for

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def service(tiny_model: str):
    config = ServiceConfig.load(
        port=0, http_port=0, metrics_port=0, engine__model=tiny_model,
        engine__cache__kv_cache_memory_bytes=16 * 1024**2, router__local_prefill_threshold=8, router__max_in_flight=4,
        router__max_in_flight_per_tenant=2, router__max_queued=4, transfer__lease_ttl_s=30.0,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    address, _ = svc.start()
    channel, stub = stub_for(address)
    yield svc, stub
    channel.close()
    svc.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_kv_blocks_cannot_be_read_without_the_clusters_secret(service) -> None:
    """The attacker reads block hashes and worker addresses from Redis, then asks a worker for the
    KV: refused (UNAUTHENTICATED), no bytes; the events stream carries no token ids."""
    svc, stub = service
    generate(stub, build_request(prompt(1, 64), GREEDY, cache_salt="tenant-with-a-secret"))
    redis = svc.index_config().client()
    keys = [k for k in redis.scan_iter(f"{svc.index_config().namespace}:block:*")]
    assert keys
    hashes = [bytes.fromhex(k.rsplit(":", 1)[1]) for k in keys]
    workers = svc.index_config().client().hgetall(f"{svc.index_config().namespace}:workers")

    address = json.loads(workers["prefill-0"])["grpc_address"]
    with KVTransferClient(address, TransferConfig(cluster_secret=None)) as outsider:
        with pytest.raises(AuthError):
            outsider.metadata()
    with grpc.insecure_channel(address) as channel:
        got = []
        with pytest.raises(grpc.RpcError) as err:
            got.extend(kpb_grpc.KVTransferStub(channel).Pull(
                kpb.PullRequest(block_hashes=kpb.BlockHashes(hashes=hashes[:1])), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and got == []
    for _, entry in redis.xrange(f"{svc.index_config().namespace}:events"):
        assert "token_ids" not in entry
    # The workers themselves authenticate with the secret `up` generated: transfers still work.
    r = generate(stub, build_request(prompt(2, 70), GREEDY))
    assert r.usage["transferred_tokens"] == 70


def test_a_flood_from_one_tenant_does_not_starve_another(service) -> None:
    svc, stub = service
    long_params = SamplingParams(max_tokens=400, ignore_eos=True)
    calls = [stub.Generate(build_request(prompt(10 + i, 20), long_params, cache_salt="flood"), timeout=120)
             for i in range(12)]  # fmt: skip
    codes: dict[int, grpc.StatusCode] = {}

    def drain(i: int) -> None:
        try:
            for _ in calls[i]:
                pass
            codes[i] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            codes[i] = e.code()

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    try:
        # 2 run (the tenant's share), 4 wait, the other 6 are refused at once.
        assert wait_until(lambda: sum(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in codes.values()) == 6,
                          timeout=60)  # fmt: skip
        # The HTTP edge shares the admission: the same tenant is refused there too (429, streaming or not).
        for stream in (False, True):
            r = httpx.post(f"http://{svc.http_address}/v1/completions", timeout=60, json={
                "model": Path(svc.model_dir).name, "prompt": "more", "max_tokens": 2, "cache_salt": "flood",
                "stream": stream})  # fmt: skip
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        quiet = generate(stub, build_request(prompt(99, 5), SamplingParams(max_tokens=5), cache_salt="quiet"), 60)
        assert quiet.finish_reason == "length"
        assert sum(c == grpc.StatusCode.OK for c in codes.values()) < 6  # done while the flood still ran
    finally:
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(60)
    assert wait_until(lambda: all_idle(svc), timeout=60)


def test_http_clients_that_leave_while_queued_give_their_places_back(service) -> None:
    """A tenant at its share (2 running) queues more requests; streaming HTTP clients that hang up
    while queued are dropped from the queue at once, not when a slot frees or the queue times out."""
    svc, stub = service
    long_params = SamplingParams(max_tokens=1500, ignore_eos=True)
    running = [stub.Generate(build_request(prompt(40 + i, 20), long_params, cache_salt="patient"), timeout=120)
               for i in range(2)]  # fmt: skip
    try:
        for call in running:
            next(call)  # both run: the tenant's share is used up
        body = {"model": Path(svc.model_dir).name, "prompt": "queued", "max_tokens": 4, "cache_salt": "patient",
                "stream": True}  # fmt: skip
        socks = [raw_post(svc.http_address, "/v1/completions", body) for _ in range(2)]
        state = lambda: ray.get(svc.router.admission_state.remote(), timeout=30)  # noqa: E731
        assert wait_until(lambda: state()["queued"] == 2, timeout=30)
        for sock in socks:
            sock.close()
        assert wait_until(lambda: state()["queued"] == 0, timeout=30)
        # ... while the two that hold the tenant's share still run: nothing else let them go.
        assert state()["in_flight"] == 2 and not any(call.done() for call in running)
    finally:
        for call in running:
            call.cancel()
    assert wait_until(lambda: all_idle(svc), timeout=60)


def test_cancellation_storm_leaves_no_lease_or_block_behind(service) -> None:
    """Clients give up around their first token: whatever a prefill worker already leased is
    released at once, not after the lease's 30 s TTL."""
    svc, stub = service
    rng = random.Random(7)
    ttft = generate(stub, build_request(prompt(99, 900), GREEDY)).ttft_ms / 1000
    prefill = svc.prefill["prefill-0"]

    def one(i: int, scale: float, completed: list[int]) -> None:
        try:
            # Deadlines around the time to first token: they land before the prefill, after the
            # prefill worker leased the KV and before the router passed it on, during the pull, and
            # in the decode.
            for _ in stub.Generate(build_request(prompt(100 + i, 900), GREEDY, cache_salt=f"t{i % 3}"),
                                   timeout=ttft * scale * rng.uniform(0.6, 3.0)):  # fmt: skip
                pass
            completed.append(i)
        except grpc.RpcError:
            pass

    # A loaded machine prefills four prompts at once far slower than the one timed above: a storm
    # whose deadlines all came before any lease is run again with deadlines twice as long.
    for storm, scale in enumerate((1.0, 2.0, 4.0)):
        before = ray.get(prefill.pool_state.remote())["leases_created"]
        completed: list[int] = []
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: one(i, scale, completed), range(40 * storm, 40 * storm + 40)))
        assert wait_until(lambda: all_idle(svc), timeout=15)  # well within the 30 s lease TTL
        # The storm reached past the lease: more leases than requests that ran to their end (each
        # took at most one), so some leased requests were given up (in the hand-over, the pull or
        # the decode). The narrowest window, leased and not yet passed on, is performed
        # deterministically by
        # tests/workers/test_worker_services.py::test_prefill_cancelled_right_after_the_handoff_holds_nothing.
        if ray.get(prefill.pool_state.remote())["leases_created"] - before > len(completed):
            return
    pytest.fail("no storm gave up a leased request")


def test_a_killed_router_is_restarted_on_its_port(service) -> None:
    svc, stub = service
    port = svc.port
    ray.kill(svc.router, no_restart=True)
    assert wait_until(lambda: not svc._router_alive(timeout_s=2), timeout=30)
    notes = svc.supervise()
    assert notes == [f"router had stopped: restarted, listening on 127.0.0.1:{port}"] and svc.port == port
    assert httpx.get(f"http://{svc.http_address}/health", timeout=30).status_code == 200  # HTTP is back too
    assert generate(stub, build_request("after a restart", GREEDY), 60).finish_reason == "length"
    # /metrics on its own port is back on that port, with the workers' series; nothing else is served there.
    assert svc.metrics_url == f"http://127.0.0.1:{svc.metrics_port}/metrics" and svc.metrics_port != svc.http_port
    text = httpx.get(svc.metrics_url, timeout=30).text
    assert 'pdserve_worker_up{worker="decode-0"} 1.0' in text and "pdserve_requests_total" in text
    assert httpx.post(svc.metrics_url.replace("/metrics", "/v1/completions"), json={}, timeout=30).status_code == 404


def test_a_killed_redis_is_restarted_and_the_index_republished(service) -> None:
    svc, stub = service
    p = prompt(3, 64)
    generate(stub, build_request(p, GREEDY))
    os.kill(svc.redis.pid, signal.SIGKILL)
    assert wait_until(lambda: not svc.redis.running, timeout=10)
    notes = svc.supervise()
    assert len(notes) == 1 and notes[0].startswith("redis-server had stopped: restarted at redis://pdserve:***@")
    from pdserve.engine.kvcache.hashing import block_hashes

    lookup = PrefixLookup(svc.index_config())
    chain = block_hashes(p, 16, svc.engine_config().cache.hash_seed)
    assert wait_until(lambda: lookup.longest_prefix(chain).get("prefill-0", 0) == 4, timeout=30)
    lookup.close()
    assert generate(stub, build_request(prompt(4, 30), GREEDY)).finish_reason == "length"


def test_drain_finishes_streams_in_flight_and_refuses_new_ones(service) -> None:
    """Last in the module: the router stays drained."""
    svc, stub = service
    call = stub.Generate(build_request(prompt(5, 40), SamplingParams(max_tokens=150, ignore_eos=True)), timeout=120)
    tokens: list[int] = []
    result: list[object] = []

    def consume() -> None:
        try:
            for resp in call:
                tokens.extend(resp.token_ids)
                if resp.finished:
                    result.append(resp.finish_reason)
        except grpc.RpcError as e:
            result.append(e.code())

    t = threading.Thread(target=consume)
    t.start()
    assert wait_until(lambda: len(tokens) >= 2, timeout=60)
    cut: list[int] = []
    drainer = threading.Thread(target=lambda: cut.append(svc.drain(timeout_s=90)))
    drainer.start()
    assert wait_until(lambda: _refused_unavailable(stub), timeout=30)
    base = f"http://{svc.http_address}"
    assert httpx.get(f"{base}/health", timeout=30).status_code == 503
    r = httpx.post(f"{base}/v1/completions", json={"model": Path(svc.model_dir).name, "prompt": "hi"}, timeout=30)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    t.join(120)
    drainer.join(120)
    assert result == ["length"] and len(tokens) == 150 and cut == [0]


def _refused_unavailable(stub) -> bool:  # noqa: ANN001
    try:
        generate(stub, build_request("during the drain", GREEDY), 30)
    except grpc.RpcError as e:
        return e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.details()
    return False
