"""End to end: real Ray actors, real embedded Redis, real gRPC over loopback."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray
import torch

from pdserve import LLM, SamplingParams
from pdserve.cli.client import build_request, generate
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.kvindex.config import tenant_digest
from pdserve.kvindex.stats import read_stats
from pdserve.v1 import router_pb2 as pb
from pdserve.worker.messages import RequestSpec
from tests.support.polling import wait_until
from tests.support.service import all_idle, shared_ray, stub_for

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model: str) -> str:
    return tiny_model


@pytest.fixture(scope="module")
def service(model_dir: str):
    config = ServiceConfig.load(
        port=0, http_port=0, engine__model=model_dir, engine__cache__kv_cache_memory_bytes=8 * 1024**2,
        router__local_prefill_threshold=8, transfer__lease_ttl_s=10.0,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    address, _ = svc.start()
    channel, stub = stub_for(address)
    yield svc, stub
    channel.close()
    svc.stop()


def stats(svc: Service) -> dict:
    cfg = svc.index_config()
    return read_stats(cfg.client(), cfg)


def prompt_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_outputs_equal_offline_engine_and_transformers(service, model_dir) -> None:
    svc, stub = service
    prompts = [prompt_ids(i, n) for i, n in enumerate([5, 20, 37, 64])]
    results = [generate(stub, build_request(p, GREEDY)) for p in prompts]
    offline = LLM(model_dir, num_blocks=64).generate(prompts, GREEDY)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, r, o in zip(prompts, results, offline):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert r.token_ids == o.token_ids == ref
        assert r.finish_reason == "length"
        assert r.usage["prompt_tokens"] == len(p)
    assert wait_until(lambda: all_idle(svc), timeout=30)


def test_repeated_prompt_hits_cache_and_pulls_only_missing_blocks(service) -> None:
    svc, stub = service
    base = prompt_ids(100, 70)
    first = generate(stub, build_request(base, GREEDY))
    assert first.usage["cached_tokens"] == 0 and first.usage["transferred_tokens"] == 70
    # Same 64-token prefix (4 full blocks) + a new 30-token tail: above the local-prefill threshold.
    second = generate(stub, build_request(base[:64] + prompt_ids(101, 30), GREEDY))
    assert second.usage["cached_tokens"] == 64  # prefill worker computed only the tail
    # The decode worker holds the 4 prefix blocks from the first pull; only the rest moves.
    assert second.usage["transferred_tokens"] == 94 - 64
    assert wait_until(lambda: stats(svc)["cluster"]["prefix_hit_tokens"] >= 64, timeout=30)
    s = stats(svc)
    assert s["cluster"]["decode_local_hit_tokens"] >= 64
    assert s["hit_rate"] == pytest.approx(s["cluster"]["prefix_hit_tokens"] / s["cluster"]["prompt_tokens"])
    assert wait_until(lambda: all_idle(svc), timeout=30)


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: pb.GenerateRequest(text=""), "prompt"),
        (lambda: pb.GenerateRequest(), "prompt"),
        (lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), "token_ids"),
        (lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), "token_ids"),
        (lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 5000)), "prompt"),
        (lambda: pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=0)), "max_tokens"),
        (lambda: pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(temperature=-1)), "temperature"),
        (lambda: pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(top_p=1.5)), "top_p"),
        (lambda: pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(top_k=-2)), "top_k"),
    ],
)
def test_bad_input_is_invalid_argument(service, build, needle) -> None:
    _, stub = service
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build(), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()


@pytest.mark.parametrize(
    "raw, needle",
    [
        (pb.GenerateRequest(text="hello").SerializeToString() + b"\xa0\x06\x01", "unknown field"),  # field 100
        (pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe"), "UTF-8"),  # text
        (pb.GenerateRequest(text="hi", cache_salt="ab").SerializeToString().replace(b"ab", b"\xc3("), "UTF-8"),
    ],
    ids=["unknown-field", "text-not-utf8", "salt-not-utf8"],
)
def test_malformed_messages_rejected_and_service_keeps_serving(service, raw: bytes, needle: str) -> None:
    svc, stub = service
    # A raw-bytes call of the same method, so the bytes reach the server as they are.
    with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        call = channel.unary_stream(
            "/pdserve.v1.Router/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert generate(stub, build_request("still serving", SamplingParams(max_tokens=3))).finish_reason


def test_client_cancel_frees_blocks_on_both_workers(service) -> None:
    svc, stub = service
    call = stub.Generate(build_request(prompt_ids(7, 50), SamplingParams(max_tokens=400, ignore_eos=True)), timeout=60)
    got = 0
    for resp in call:
        got += len(resp.token_ids)
        if got >= 3:
            call.cancel()
            break
    assert wait_until(lambda: all_idle(svc), timeout=30)


def test_deadline_is_honoured(service) -> None:
    svc, stub = service
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build_request(prompt_ids(8, 40), SamplingParams(max_tokens=2000, ignore_eos=True)),
                           timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    assert wait_until(lambda: all_idle(svc), timeout=30)


def test_prefill_worker_killed_before_pull_decode_recomputes(service, model_dir) -> None:
    svc, _ = service
    p = prompt_ids(9, 45)
    spec = RequestSpec("kill-prefill", tuple(p), GREEDY)
    prefill = ray.get(svc.prefill["prefill-0"].prefill.remote(spec), timeout=60)
    ray.kill(svc.prefill["prefill-0"], no_restart=False)  # Ray restarts it; its leases are gone
    assert wait_until(lambda: _address(svc.prefill["prefill-0"]) not in (None, prefill.address), timeout=120)
    # The restarted worker's pool is empty, so it dropped the holder fields its predecessor published.
    key = f"pdserve:block:{block_hashes(p, 16)[0].hex()}"
    assert svc.index_config().client().hget(key, "prefill-0") is None
    events = [ray.get(r) for r in svc.decode["decode-0"].generate.options(num_returns="streaming").remote(spec, prefill)]
    tokens = [prefill.first_token] + [t for ev in events for t in ev.token_ids]
    assert events[-1].finished and events[-1].num_recomputed_tokens == 45
    assert tokens == LLM(model_dir, num_blocks=64).generate([p], GREEDY)[0].token_ids
    assert wait_until(lambda: stats(svc)["cluster"]["recomputed_tokens"] >= 45, timeout=30)
    assert wait_until(lambda: all_idle(svc), timeout=60)


def test_local_prefill_and_recompute_are_counted(service) -> None:
    """A short prompt prefilled on the decode worker counts as prefill_computed_tokens there; a
    recompute after a failed pull (here the lease was released first) counts only what it computed."""
    svc, stub = service
    tenant = "local-prefill-tenant"
    r = generate(stub, build_request(prompt_ids(31, 6), GREEDY, cache_salt=tenant))  # 6 < threshold 8
    assert r.finish_reason == "length" and r.usage["transferred_tokens"] == 0
    digest = tenant_digest(tenant)

    def tenant_counts() -> tuple[int, int, int]:
        t = stats(svc)["tenants"].get(digest, {})
        return t.get("prompt_tokens", 0), t.get("prefix_hit_tokens", 0), t.get("prefill_computed_tokens", 0)

    # Two processes write these (the router: prompt and hit tokens; the decode worker: what it
    # computed), each from its own background writer: wait for both, then check they add up.
    assert wait_until(lambda: tenant_counts()[0] == 6 and tenant_counts()[2] == 6, timeout=30)
    prompt, hit, computed = tenant_counts()
    assert prompt == hit + computed == 6

    p = prompt_ids(32, 40)
    spec = RequestSpec("released-then-recomputed", tuple(p), GREEDY)
    prefill = ray.get(svc.prefill["prefill-0"].prefill.remote(spec), timeout=60)
    ray.get(svc.prefill["prefill-0"].release.remote(prefill.lease_id), timeout=30)  # the pull will fail
    events = [ray.get(x) for x in svc.decode["decode-0"].generate.options(num_returns="streaming").remote(spec, prefill)]
    assert events[-1].finished and events[-1].num_recomputed_tokens == 40 - events[-1].num_local_hit_tokens
    assert wait_until(lambda: all_idle(svc), timeout=30)


def test_redis_outage_keeps_serving_and_counters_resume(service) -> None:
    svc, stub = service
    assert svc.redis is not None
    before = stats(svc)["cluster"]["requests"]
    svc.redis.stop()
    try:
        r = generate(stub, build_request(prompt_ids(11, 30), GREEDY))
        assert r.finish_reason == "length" and len(r.token_ids) == 12
    finally:
        svc.redis.restart()
    generate(stub, build_request(prompt_ids(12, 30), GREEDY))
    # The restarted server is empty; counting resumes (and lost increments are replayed).
    assert wait_until(lambda: stats(svc)["cluster"]["requests"] >= 1, timeout=30)
    assert before >= 0
    assert wait_until(lambda: all_idle(svc), timeout=30)


def test_decode_worker_killed_mid_generation(service) -> None:
    svc, stub = service
    call = stub.Generate(build_request(prompt_ids(13, 40), SamplingParams(max_tokens=3000, ignore_eos=True)),
                         timeout=120)
    err: list[grpc.RpcError] = []
    got = 0

    def consume() -> None:
        nonlocal got
        try:
            for resp in call:
                got += len(resp.token_ids)
        except grpc.RpcError as e:
            err.append(e)

    t = threading.Thread(target=consume)
    t.start()
    assert wait_until(lambda: got >= 3, timeout=60)
    ray.kill(svc.decode["decode-0"], no_restart=False)
    t.join(timeout=60)
    assert err and err[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "decode worker" in err[0].details()
    # Ray restarts the worker and the router keeps serving.
    assert wait_until(lambda: _serves(stub), timeout=120)
    assert wait_until(lambda: all_idle(svc), timeout=60)


def _address(handle) -> str | None:
    try:
        return ray.get(handle.ready.remote(), timeout=10)["grpc_address"]
    except Exception:  # noqa: BLE001 - dead or restarting
        return None


def _serves(stub) -> bool:
    try:
        return generate(stub, build_request("after restart", SamplingParams(max_tokens=2)), 30).finish_reason is not None
    except grpc.RpcError:
        return False


def test_seeded_sampling_and_streamed_text_match_offline(service, model_dir) -> None:
    svc, stub = service
    p = prompt_ids(21, 40)  # long enough to be prefilled on the prefill worker and handed over
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=5, ignore_eos=True)
    served = generate(stub, build_request(p, params))
    assert served.usage["transferred_tokens"] > 0
    offline = LLM(model_dir, num_blocks=64)
    ref = offline.generate([p], params)[0]
    assert served.token_ids == ref.token_ids  # the decode worker's generator continues after the first draw
    assert served.text == offline.decode(served.token_ids)  # deltas decoded incrementally, not per message


def test_reused_client_request_id_is_isolated(service) -> None:
    svc, stub = service
    a = prompt_ids(31, 40)
    b = prompt_ids(32, 40)
    # Concurrent requests under one client id (a client retrying) must not share blocks or leases.
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(generate, stub, build_request(x, GREEDY, request_id="same-id")) for x in (a, b, a, b)]
        got = [f.result() for f in futs]
    ref = LLM(svc.model_dir, num_blocks=64).generate([a, b], GREEDY)
    assert [g.token_ids for g in got] == [ref[0].token_ids, ref[1].token_ids] * 2
    assert wait_until(lambda: all_idle(svc), timeout=30)


def test_a_decode_actor_prefetches_a_prompt_its_prefill_actor_computed(service) -> None:
    """The Ray hop of the overlap (``DecodeWorker.prefetch``, as the router's ``RayWorkers`` sends it):
    a prompt prefilled on the prefill actor only is pulled by hash into the decode actor's cache."""
    svc, _ = service
    (p, prefill), (d, decode) = next(iter(svc.prefill.items())), next(iter(svc.decode.items()))
    spec = RequestSpec("prefetch-e2e", tuple(prompt_ids(300, 80)), SamplingParams(max_tokens=4), cache_salt="pf-e2e")
    result = ray.get(prefill.prefill.remote(spec), timeout=60)
    assert result.lease_id and result.worker_id == p

    def prefetched() -> float:
        families = ray.get(decode.metrics.remote(), timeout=30)
        return sum(s.value for f in families for s in f.samples if s.name == "pdserve_kv_prefetch_blocks_total")

    before = prefetched()
    assert ray.get(decode.prefetch.remote(spec, result.address), timeout=30)
    assert wait_until(lambda: prefetched() - before == 80 // 16, timeout=30), (d, prefetched() - before)
    ray.get(prefill.release.remote(result.lease_id), timeout=30)
    assert wait_until(lambda: all_idle(svc), timeout=30)
