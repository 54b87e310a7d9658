"""Prefill and decode services over real WorkerRuntimes (real gRPC KV transfer, real Redis),
driven directly: the Ray actors are thin shells around these objects."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode_worker import staging
from pdserve.decode_worker.call import DecodeCall
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.stats import read_stats
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.nixl import nixl_installed
from pdserve.kvtransfer.pull import pull_kv
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.config import WorkerConfig
from pdserve.worker.messages import PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from tests.support.deepseek_models import make_deepseek_checkpoint
from tests.support.polling import wait_until, wait_until_async
from tests.support.redis import unique_namespace

SECRET = TransferConfig(cluster_secret="worker-services-test-secret")


def runtime(model: str, url: str, ns: str, wid: str, role: str, block_size: int = 16,
            transfer: TransferConfig = SECRET, kv_cache_dtype: str = "auto", num_blocks: int = 64,
            kv_offload_gb: float = 0.0, kv_offload_disk_gb: float = 0.0,
            share_idle_cpus: bool = False, core_reclaim_wait_s: float = 0.25) -> WorkerRuntime:  # fmt: skip
    cache = CacheConfig(block_size, num_blocks, kv_cache_dtype=kv_cache_dtype, kv_offload_gb=kv_offload_gb,
                        kv_offload_disk_gb=kv_offload_disk_gb)  # fmt: skip
    engine = EngineConfig(model, device="cpu", cache=cache)
    return WorkerRuntime(WorkerConfig(wid, role, engine, IndexConfig(url, namespace=ns), transfer,
                                      bind_host="127.0.0.1", share_idle_cpus=share_idle_cpus,
                                      core_reclaim_wait_s=core_reclaim_wait_s))  # fmt: skip


def metric(rt: WorkerRuntime, sample: str, **labels: str) -> float:
    return sum(s.value for f in rt.metrics.families() for s in f.samples
               if s.name == sample and labels.items() <= s.labels.items())  # fmt: skip


def test_transfer_servers_take_ports_from_the_configured_range(tiny_model: str, redis_server) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transfer = dataclasses.replace(SECRET, port_range=f"{port}-{port + 1}")
    ns = unique_namespace()
    a = runtime(tiny_model, redis_server.url, ns, "prefill-0", "prefill", transfer=transfer)
    b = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode", transfer=transfer)
    try:
        assert {a.address, b.address} == {f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"}
        with pytest.raises(OSError, match=f"no free KV-transfer port in {port}-{port + 1}"):
            runtime(tiny_model, redis_server.url, ns, "decode-1", "decode", transfer=transfer)
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="port_range must be LO-HI"):
        TransferConfig(port_range="50100-50000")


def counters(url: str, ns: str, wid: str) -> dict[str, int]:
    cfg = IndexConfig(url, namespace=ns)
    return read_stats(cfg.client(), cfg)["workers"].get(wid, {})


def test_failed_pull_releases_the_lease_at_once_and_counts_the_recompute(tiny_model: str, redis_server) -> None:
    """Block sizes differ, so the pull is refused (layout mismatch): the decode worker recomputes,
    gives the prefill worker's lease back before decoding on, and counts the prompt once."""
    ns = unique_namespace()
    prt = runtime(tiny_model, redis_server.url, ns, "prefill-0", "prefill", block_size=16)
    drt = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode", block_size=8)
    try:
        spec = RequestSpec("r", tuple(range(1, 41)), SamplingParams(max_tokens=200, ignore_eos=True))

        async def run() -> tuple[list, list[dict]]:
            pre = await PrefillService(prt).prefill(spec)
            assert pre.lease_id and prt.pool_state()["leases"] == 1
            events, states = [], []
            async for ev in DecodeService(drt).generate(spec, pre):
                events.append(ev)
                if len(events) == 1:  # the release runs beside the decode, not after it
                    assert await wait_until_async(lambda: prt.pool_state()["leases"] == 0)
                    states.append(prt.pool_state())
            return events, states

        events, states = asyncio.run(run())
        assert states[0]["leases"] == 0 and states[0]["free_blocks"] == states[0]["num_blocks"]
        assert events[-1].finished and events[-1].num_recomputed_tokens == 40
        assert drt.stats.flush(10) and prt.stats.flush(10)
        assert counters(redis_server.url, ns, "decode-0")["recomputed_tokens"] == 40
        assert counters(redis_server.url, ns, "decode-0")["prefill_computed_tokens"] == 0
        assert counters(redis_server.url, ns, "prefill-0")["prefill_computed_tokens"] == 40
        # The metrics say so too: one failed transfer, no bytes moved, the prompt computed twice.
        assert metric(drt, "pdserve_kv_transfer_failures_total") == 1
        assert metric(drt, "pdserve_kv_transfer_bytes_total") == 0
        # A request's prefix lookup counts once, at its first admission: the handed-over request's
        # prompt, as its pull is reserved; its recompute after the failed pull is no new query.
        assert metric(prt, "pdserve_prefix_cache_queries_total") == 40
        assert metric(drt, "pdserve_prefix_cache_queries_total") == 40
    finally:
        drt.close()
        prt.close()


def test_local_prefill_counts_what_it_computed_and_close_leaves_nothing(tiny_model: str, redis_server) -> None:
    ns = unique_namespace()
    drt = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode", share_idle_cpus=True,
                  core_reclaim_wait_s=0.1)
    assert drt.cores is not None  # a CPU worker takes its place among the host's workers
    assert drt.cores.reclaim_wait_s == 0.1
    prompt = tuple(range(1, 41))

    async def run(rid: str) -> list:
        spec = RequestSpec(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        return [ev async for ev in DecodeService(drt).generate(spec, None)]

    first, second = asyncio.run(run("a")), asyncio.run(run("b"))
    assert first[-1].num_local_hit_tokens == 0 and second[-1].num_local_hit_tokens == 32
    assert wait_until(lambda: drt.cores is not None and not drt.cores.busy)  # idle again: its CPUs lendable
    assert drt.stats.flush(10)
    assert counters(redis_server.url, ns, "decode-0")["prefill_computed_tokens"] == 40 + 8
    client = IndexConfig(redis_server.url, namespace=ns).client()
    assert wait_until(lambda: any(True for _ in client.scan_iter(f"{ns}:block:*")))
    drt.close()
    assert drt.cores.closed  # its slot in the host's table is free
    # A clean close unregisters the worker and removes it as a holder of every block.
    assert not client.hexists(f"{ns}:workers", "decode-0")
    assert not [k for k in client.scan_iter(f"{ns}:block:*") if client.hexists(k, "decode-0")]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_handover_between_services_matches_one_engine(tiny_model: str, redis_server, kv_cache_dtype: str) -> None:
    """Prefill on one runtime, pull by lease into another, decode there: the tokens a single engine
    produces, the transferred tokens counted, the lease released and both pools idle after. An
    FP8 block arrives as the bytes (and under the scales) it was written with: the same tokens as
    one engine with the same FP8 cache."""
    _handover_matches_one_engine(tiny_model, redis_server, kv_cache_dtype)


@pytest.mark.parametrize("mode", ["staged", "too_large", "stale_guess"])
def test_handed_over_kv_is_staged_before_registering_or_pulled_after(tiny_model: str, redis_server,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     mode: str) -> None:  # fmt: skip
    """Small enough, the handed-over KV is pulled before the request registers and copied into the
    pool as it registers (one fill). Over ``STAGE_MAX_BYTES`` it is pulled after registering; so too
    when the staged blocks do not cover the load (the guess of the cached prefix was stale: here it
    claimed a block the pool does not hold). Every way gives one engine's tokens and leaves both pools
    whole."""
    fills: list[bool] = []
    real_fill = staging.StagedKV.fill

    def spy(self: staging.StagedKV, kv_tensor, load) -> bool:  # noqa: ANN001
        fills.append(real_fill(self, kv_tensor, load))
        return fills[-1]

    monkeypatch.setattr(staging.StagedKV, "fill", spy)
    if mode == "too_large":
        monkeypatch.setattr(staging, "STAGE_MAX_BYTES", 0)
    if mode == "stale_guess":
        monkeypatch.setattr(LLMEngine, "cached_prefix_hint", lambda self, hashes: 1)
    _handover_matches_one_engine(tiny_model, redis_server, "auto")
    assert fills == {"staged": [True], "too_large": [], "stale_guess": [False]}[mode]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mla_latents_move_by_shared_memory_and_match_one_engine(tmp_path: Path, redis_server,
                                                                kv_cache_dtype: str) -> None:  # fmt: skip
    """The same handover with a DeepSeek-V3 (MLA) checkpoint: its latent blocks (and FP8 scales)
    cross between the two runtimes of this host through shared memory, bit for bit."""
    model = str(make_deepseek_checkpoint(tmp_path / "dsv3", "v3", seed=7))
    _handover_matches_one_engine(model, redis_server, kv_cache_dtype)


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install 'pdserve[nixl]')")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_blocks_latents_and_scales_move_by_nixl_and_match_one_engine(tmp_path: Path, tiny_model: str, redis_server,
                                                                     kind: str, kv_cache_dtype: str) -> None:  # fmt: skip
    """The same handover with NIXL on and shared memory off (as between hosts): K/V blocks or MLA
    latents, with their FP8 scales, come by NIXL bit for bit, and the decode worker's region is
    ended when idle."""
    model = tiny_model if kind == "llama" else str(make_deepseek_checkpoint(tmp_path / "dsv3", "v3", seed=7))
    transfer = dataclasses.replace(SECRET, shm=False, nixl=True, shm_region_idle_s=0.05)
    prt, drt = _handover_matches_one_engine(model, redis_server, kv_cache_dtype, transfer, close=False, transport="nixl")
    try:
        assert wait_until(lambda: not any(c.nixl.has_region for c in drt._clients.values()), timeout=30)  # noqa: SLF001
    finally:
        drt.close()
        prt.close()


def test_an_idle_decode_worker_ends_its_staging_regions(tiny_model: str, redis_server) -> None:
    """After the handover the decode worker's staging region, unused for ``shm_region_idle_s``,
    is ended by the worker, and the holder unmaps its side."""
    transfer = dataclasses.replace(SECRET, shm_region_idle_s=0.05)
    prt, drt = _handover_matches_one_engine(tiny_model, redis_server, "auto", transfer, close=False)
    try:
        assert prt.server.shm is not None
        assert wait_until(lambda: len(prt.server.shm) == 0, timeout=30)
        assert drt.trim_regions() == 0  # nothing left to end
    finally:
        drt.close()
        prt.close()


def _handover_matches_one_engine(model: str, redis_server, kv_cache_dtype: str, transfer: TransferConfig = SECRET,
                                 close: bool = True, transport: str = "shm") -> tuple[WorkerRuntime, WorkerRuntime]:  # fmt: skip
    ns = unique_namespace()
    prt = runtime(model, redis_server.url, ns, "prefill-0", "prefill", transfer=transfer, kv_cache_dtype=kv_cache_dtype)
    drt = runtime(model, redis_server.url, ns, "decode-0", "decode", transfer=transfer, kv_cache_dtype=kv_cache_dtype)
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=9)
        spec = RequestSpec("h", tuple(range(3, 40)), params)
        one = LLM(model, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
        expected = one.generate([list(spec.prompt_token_ids)], params)[0].token_ids

        async def run() -> tuple[int, list]:
            pre = await PrefillService(prt).prefill(spec)
            assert pre.lease_id and not pre.finished
            return pre.first_token, [ev async for ev in DecodeService(drt).generate(spec, pre)]

        first, events = asyncio.run(run())
        assert [first] + [t for ev in events for t in ev.token_ids] == expected
        assert events[-1].num_transferred_tokens == 37 and events[-1].num_recomputed_tokens == 0
        # Both workers run on this host: the bytes came through shared memory (or NIXL, where asked).
        assert metric(drt, "pdserve_kv_transfer_bytes_total", transport=transport) > 0
        assert metric(drt, "pdserve_kv_transfer_bytes_total", transport="grpc") == 0
        for rt in (prt, drt):
            assert wait_until(lambda rt=rt: rt.pool_state() == {**rt.pool_state(), "leases": 0, "requests": 0,
                                                                "free_blocks": rt.pool_state()["num_blocks"]})
    except BaseException:
        close = True
        raise
    finally:
        if close:
            drt.close()
            prt.close()
    return prt, drt


def test_a_peer_with_another_kv_cache_dtype_is_refused_and_the_prompt_recomputed(tiny_model: str,
                                                                                  redis_server) -> None:  # fmt: skip
    ns = unique_namespace()
    prt = runtime(tiny_model, redis_server.url, ns, "prefill-0", "prefill", kv_cache_dtype="fp8")
    drt = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode")
    try:
        assert drt.engine.layout.block_nbytes == 4 * prt.engine.layout.block_nbytes  # float32 vs one byte
        spec = RequestSpec("x", tuple(range(1, 41)), SamplingParams(max_tokens=4, ignore_eos=True))

        async def run() -> list:
            pre = await PrefillService(prt).prefill(spec)
            return [ev async for ev in DecodeService(drt).generate(spec, pre)]

        events = asyncio.run(run())
        assert events[-1].finished and events[-1].num_recomputed_tokens == 40  # refused, not misread
        assert metric(drt, "pdserve_kv_transfer_failures_total") == 1
        with pytest.raises(Exception, match="dtype: local 'float32' != remote 'float8_e4m3fn'"):
            drt.client(prt.address)
    finally:
        drt.close()
        prt.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_decode_worker_pulls_blocks_from_a_peers_offload_tier(tiny_model: str, redis_server, tier: str) -> None:
    """The holder's pool evicted a prefix into its offload tier (with ``disk``: a one-block host tier
    that spills into a disk tier); a pull by hash over gRPC restores it there (KV-handover API) and
    streams it; the puller decodes the tokens one engine does."""
    ns = unique_namespace()
    block_gb = LLM(tiny_model, num_blocks=1).engine.layout.block_nbytes / 1024**3
    sizes = {"kv_offload_gb": 0.01} if tier == "host" else {"kv_offload_gb": block_gb, "kv_offload_disk_gb": 0.01}
    holder = runtime(tiny_model, redis_server.url, ns, "prefill-0", "prefill", num_blocks=8, **sizes)
    puller = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode")
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        a, b = list(range(3, 100)), list(range(100, 197))  # 6 full blocks each, 8-block pool

        async def prefill(spec: RequestSpec) -> None:
            pre = await PrefillService(holder).prefill(spec)
            holder.source.release(pre.lease_id)

        asyncio.run(prefill(RequestSpec("a", tuple(a), params)))
        asyncio.run(prefill(RequestSpec("b", tuple(b), params)))  # pushes a's blocks into the tier
        engine = puller.engine
        req = engine.make_request(a, params, "a-decode")
        hashes = req.block_hashes[:6]
        pool = holder.engine.kv_manager.pool
        in_pool = [pool.get_cached_block(h) is not None for h in hashes]
        assert not all(in_pool) and all(h in holder.engine.tier for h, p in zip(hashes, in_pool) if not p)
        if tier == "disk":  # all but at most one of them only on disk
            disk = holder.engine.tier.spill
            evicted = [h for h, p in zip(hashes, in_pool) if not p]
            only_on_disk = [h for h in evicted if h in disk and h not in holder.engine.tier._slots]  # noqa: SLF001
            assert len(evicted) >= 2 and len(only_on_disk) >= len(evicted) - 1
        load = engine.handover.reserve(req, 96)
        assert load is not None and load.num_external_tokens == 96
        ok = False
        try:
            stats = pull_kv(puller.client(holder.address), engine.handover.kv_tensor, load)
            ok = True
        finally:
            engine.handover.complete(req, load, ok)
        assert stats.num_blocks == 6
        expected = LLM(tiny_model, num_blocks=64).generate([a], params)[0].token_ids
        # The pulled prefix is in the puller's cache now: a request for the same prompt runs from it.
        tokens, cached = decode_locally(puller, a, params)
        assert tokens == expected and cached == 96
        holder.engine.handover.check_invariants()
        assert wait_until(lambda: holder.pool_state()["free_blocks"] == 8 and holder.pool_state()["leases"] == 0)
    finally:
        puller.close()
        holder.close()


def decode_locally(rt: WorkerRuntime, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Run ``prompt`` on a decode runtime (no prefill worker): its tokens and local prefix hit."""

    async def run() -> list:
        return [ev async for ev in DecodeService(rt).generate(RequestSpec("again", tuple(prompt), params))]

    events = asyncio.run(run())
    return [t for ev in events for t in ev.token_ids], events[-1].num_local_hit_tokens


def test_prefill_cancelled_right_after_the_handoff_holds_nothing(tiny_model: str, redis_server) -> None:
    """The engine hands the request off (KV held) while the caller is being cancelled, before the
    output reaches it: the KV must be released, not left held with no lease."""
    prt = runtime(tiny_model, redis_server.url, unique_namespace(), "prefill-0", "prefill")
    try:
        spec = RequestSpec("r1", tuple(range(1, 41)), SamplingParams(max_tokens=20, ignore_eos=True))

        async def run() -> None:
            task = asyncio.ensure_future(PrefillService(prt).prefill(spec))
            await asyncio.sleep(0)  # the request is submitted
            # Hold the event loop until the engine has handed it off (its output not yet delivered).
            assert wait_until(lambda: prt.engine.kv_usage().held == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())
        assert prt.pool_state() == {**prt.pool_state(), "leases": 0, "requests": 0,
                                    "free_blocks": prt.pool_state()["num_blocks"]}  # fmt: skip
        prt.engine.make_request([1, 2, 3], SamplingParams(), "r1")  # the id is free again
    finally:
        prt.close()


@contextlib.contextmanager
def handed_over(tiny_model: str, redis_url: str) -> Iterator[tuple[WorkerRuntime, WorkerRuntime, DecodeService,
                                                                    RequestSpec]]:  # fmt: skip
    """A prefill and a decode runtime, the decode service, and a request's spec to hand over."""
    ns = unique_namespace()
    prt = runtime(tiny_model, redis_url, ns, "prefill-0", "prefill")
    drt = runtime(tiny_model, redis_url, ns, "decode-0", "decode")
    service = DecodeService(drt)
    try:
        yield prt, drt, service, RequestSpec("r", tuple(range(1, 41)), SamplingParams(max_tokens=5, ignore_eos=True))
    finally:
        service.close()
        drt.close()
        prt.close()


def all_back(prt: WorkerRuntime, drt: WorkerRuntime) -> None:
    """The prefill worker's lease released; every block back in the decode pool."""
    assert wait_until(lambda: prt.pool_state()["leases"] == 0)
    state = drt.pool_state()
    assert state["requests"] == 0 and state["free_blocks"] == state["num_blocks"], state


def test_a_load_claimed_at_registration_that_no_pull_took_is_ended_on_exit(tiny_model: str, redis_server) -> None:
    """Registering a handed-over request claims its KV load for writing (one wait for the engine's
    lock). A call that ends before a pull takes the claim (its body failed) ends it after the abort:
    every block back in the pool, the id free, the prefill worker's lease released."""
    with handed_over(tiny_model, redis_server.url) as (prt, drt, service, spec):

        async def run() -> None:
            pre = await PrefillService(prt).prefill(spec)
            with pytest.raises(RuntimeError, match="consumer gone"):
                async with DecodeCall(drt, spec, pre, service.threads) as call:
                    assert await call.register(lambda out: None) is not None
                    assert drt.engine.load_aborted("r") is False
                    assert drt.pool_state()["free_blocks"] < drt.pool_state()["num_blocks"]
                    raise RuntimeError("consumer gone")

        asyncio.run(run())
        service.close()
        all_back(prt, drt)
        drt.engine.make_request([1, 2, 3], SamplingParams(), "r")  # the id is free again


@contextlib.contextmanager
def a_step_holding_the_lock(rt: WorkerRuntime) -> Iterator[threading.Event]:
    """A thread holds ``rt``'s engine lock, as a long step would, until the event it yields is set;
    on exit, checks that the test set it (the loop turned meanwhile), not the thread's timeout."""
    held, let_go = threading.Event(), threading.Event()
    by_test = []

    def step() -> None:
        with rt.engine.lock:
            held.set()
            by_test.append(let_go.wait(30))

    stepper = threading.Thread(target=step)
    stepper.start()
    try:
        assert held.wait(30)
        yield let_go
        stepper.join(30)
        assert by_test == [True]
    finally:
        let_go.set()
        stepper.join(30)


def test_a_registration_waits_for_the_step_off_the_event_loop(tiny_model: str, redis_server) -> None:
    """While a step holds the engine's lock, a new request's registration waits for it on a thread:
    the decode worker's event loop (which streams every other request's tokens) runs meanwhile."""
    drt = runtime(tiny_model, redis_server.url, unique_namespace(), "decode-0", "decode")
    service = DecodeService(drt)

    async def run(let_go: threading.Event) -> list[int]:
        spec = RequestSpec("r", tuple(range(1, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
        gen = service.generate(spec, None)
        first = asyncio.ensure_future(anext(gen))
        for _ in range(5):  # the loop turns while the registration waits for the lock
            await asyncio.sleep(0.01)
        let_go.set()
        events = [await first] + [ev async for ev in gen]
        return [t for ev in events for t in ev.token_ids]

    try:
        with a_step_holding_the_lock(drt) as let_go:
            tokens = asyncio.run(run(let_go))
        assert len(tokens) == 3
        assert wait_until(lambda: drt.pool_state()["requests"] == 0)
    finally:
        service.close()
        drt.close()


def test_a_prefill_registration_waits_for_the_step_off_the_event_loop(tiny_model: str, redis_server) -> None:
    """The same on a prefill worker, whose event loop answers every other prefill (and drops and
    lease releases) meanwhile; a prefill cancelled while its registration waits still ends it."""
    prt = runtime(tiny_model, redis_server.url, unique_namespace(), "prefill-0", "prefill")
    service = PrefillService(prt)

    async def run(let_go: threading.Event) -> PrefillResult:
        spec = RequestSpec("r", tuple(range(1, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
        first = asyncio.ensure_future(service.prefill(spec))
        gone = asyncio.ensure_future(service.prefill(RequestSpec("gone", tuple(range(1, 30)), SamplingParams())))
        for _ in range(5):  # the loop turns while the registrations wait for the lock
            await asyncio.sleep(0.01)
        gone.cancel()
        let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await first

    try:
        with a_step_holding_the_lock(prt) as let_go:
            result = asyncio.run(run(let_go))
        assert result.lease_id and prt.source.release(result.lease_id)
        assert wait_until(lambda: prt.pool_state()["requests"] == prt.pool_state()["registered"] == 0)
        assert prt.pool_state()["free_blocks"] == prt.pool_state()["num_blocks"]
    finally:
        service.close()
        prt.close()


def test_a_pull_the_closing_service_cannot_run_leaves_its_claim_to_the_exit(tiny_model: str, redis_server) -> None:
    """The service's pull threads are shut down (it is closing) when a call's pull is due: the
    pull reports a recompute instead of raising, the claim stays the call's, and its exit ends it:
    every block back, the prefill worker's lease released."""
    with handed_over(tiny_model, redis_server.url) as (prt, drt, service, spec):

        async def run() -> None:
            pre = await PrefillService(prt).prefill(spec)
            async with DecodeCall(drt, spec, pre, service.threads) as call:
                load = await call.register(lambda out: None)
                assert load is not None
                service.threads.pulls.shutdown(wait=True)
                assert await call.pull(load) is False

        asyncio.run(run())
        all_back(prt, drt)


def test_steps_finished_while_the_consumer_waits_go_out_as_one_event(tiny_model: str, redis_server) -> None:
    """A slow consumer gets what the engine produced meanwhile in one event (one message to the
    router for many tokens), the same tokens as one engine alone."""
    drt = runtime(tiny_model, redis_server.url, unique_namespace(), "decode-0", "decode")
    prompt = tuple(range(1, 30))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    expected = LLM(tiny_model, num_blocks=64).generate([list(prompt)], params)[0].token_ids

    async def run() -> list:
        gen = DecodeService(drt).generate(RequestSpec("slow", prompt, params), None)
        events = [await anext(gen)]
        # The engine runs the request to its end, and hands over every output, while nobody reads the stream.
        assert await wait_until_async(lambda: drt.pool_state()["requests"] == 0 and drt.loop.quiescent(), timeout=60)
        events += [ev async for ev in gen]
        return events

    events = asyncio.run(run())
    assert [t for ev in events for t in ev.token_ids] == expected
    assert len(events) == 2 and events[-1].finished and len(events[-1].token_ids) == 12 - len(events[0].token_ids)
    assert all(len(ev.logprobs) == len(ev.token_ids) for ev in events)
    drt.close()
