"""RouterCore across a fleet: it routes around workers that fail as unavailable and takes them back
once they answer (router/health.py), and spreads requests that arrive together; over workers scripted in plain Python (Redis is the real embedded server;
the same path over Ray and a killed node is tests/e2e/test_multinode_faults.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from pdserve.engine.config import CacheConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore, WorkerUnavailableError
from pdserve.router.health import WorkerHealth
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from tests.support.redis import unique_namespace


class Fleet:
    """One prefill worker, decode workers d0 and d1. A worker in ``dead`` fails every call (as a
    dead Ray actor does: WorkerUnavailableError); ``die_after_first`` makes d0 fail after sending
    one decode token. Calls, pings and lease releases are recorded."""

    prefill_ids = ["p0"]
    decode_ids = ["d0", "d1"]

    def __init__(self, prefill_gate: asyncio.Event | None = None) -> None:
        self.prefill_gate = prefill_gate
        self.dead: set[str] = set()
        self.die_after_first = False
        self.decode_calls: Counter[str] = Counter()
        self.pings: Counter[str] = Counter()
        self.released: list[tuple[str, str]] = []

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        if worker_id in self.dead:
            raise WorkerUnavailableError(f"prefill worker {worker_id} is unavailable")
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        return PrefillResult(spec.request_id, 7, False, None, f"lease-{spec.request_id}", "127.0.0.1:1", worker_id,
                             len(spec.prompt_token_ids), 0)  # fmt: skip

    async def decode(self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]:
        self.decode_calls[worker_id] += 1
        if worker_id in self.dead:
            raise WorkerUnavailableError(f"decode worker {worker_id} is unavailable")
        yield DecodeEvent(spec.request_id, (8,), False, None, 0, 0)
        if self.die_after_first and worker_id == "d0":
            self.dead.add("d0")
            raise WorkerUnavailableError("decode worker d0 is unavailable")
        yield DecodeEvent(spec.request_id, (9,), True, "length", 0, 0)

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        pass  # no KV moves between these scripted workers

    def release(self, worker_id: str, lease_id: str) -> None:
        self.released.append((worker_id, lease_id))

    async def ping(self, worker_id: str) -> object:
        self.pings[worker_id] += 1
        if worker_id in self.dead:
            raise WorkerUnavailableError(f"{worker_id} is unavailable")
        return {}


def make_core(redis_server, fleet: Fleet) -> RouterCore:  # noqa: ANN001
    index = IndexConfig(redis_server.url, namespace=unique_namespace())
    config = RouterConfig(kv_policy="pull", health_probe_interval_s=0.01, health_probe_timeout_s=1.0)
    return RouterCore(config, CacheConfig(block_size=16), fleet, PrefixLookup(index), StatsRecorder(index))


def spec(rid: str) -> RequestSpec:
    return RequestSpec(rid, tuple(range(1, 41)), SamplingParams(max_tokens=3, ignore_eos=True))


async def tokens_of(core: RouterCore, s: RequestSpec) -> list[int]:
    out: list[int] = []
    async for ev in core.generate(s):
        out += ev.token_ids
    return out


async def until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


def test_a_dead_decode_worker_is_routed_around_then_taken_back(redis_server) -> None:  # noqa: ANN001
    async def run() -> None:
        fleet = Fleet()
        core = make_core(redis_server, fleet)
        fleet.dead.add("d0")
        # d0 is picked first (equal scores: the first listed); it fails before any token: retried on d1.
        assert await tokens_of(core, spec("r0")) == [7, 8, 9]
        assert fleet.decode_calls == {"d0": 1, "d1": 1}
        assert core.health.down() == {"d0"}
        # While d0 is down, requests go to d1 without trying d0 first.
        for i in range(5):
            assert await tokens_of(core, spec(f"r{i + 1}")) == [7, 8, 9]
        assert fleet.decode_calls == {"d0": 1, "d1": 6}
        await until(lambda: fleet.pings["d0"] >= 2)  # probed meanwhile, still down
        assert core.health.down() == {"d0"}
        # It answers again: routed to once more.
        fleet.dead.clear()
        await until(lambda: core.health.is_up("d0"))
        assert core.health.recoveries == 1
        assert await tokens_of(core, spec("r-back")) == [7, 8, 9]
        assert fleet.decode_calls["d0"] == 2
        core.close()

    asyncio.run(run())


def test_every_decode_worker_down_is_a_clear_error_and_a_dead_prefill_worker_is_skipped(redis_server) -> None:  # noqa: ANN001
    async def run() -> None:
        fleet = Fleet()
        core = make_core(redis_server, fleet)
        fleet.dead |= {"d0", "d1", "p0"}
        with pytest.raises(WorkerUnavailableError, match="decode worker d1 failed"):
            await tokens_of(core, spec("r0"))
        assert core.health.down() == {"p0", "d0", "d1"}
        with pytest.raises(WorkerUnavailableError, match="no decode worker is available: d0, d1 down"):
            await tokens_of(core, spec("r1"))
        assert fleet.decode_calls == {"d0": 1, "d1": 1}  # r1 called nobody
        # d1 comes back, p0 stays down: the decode worker prefills (no prefill call, no lease).
        fleet.dead.discard("d1")
        await until(lambda: core.health.is_up("d1"))
        assert await tokens_of(core, spec("r2")) == [8, 9]
        core.close()

    asyncio.run(run())


def test_a_decode_worker_that_dies_mid_stream_fails_the_request_and_its_lease_is_released(redis_server) -> None:  # noqa: ANN001
    async def run() -> None:
        fleet = Fleet()
        fleet.die_after_first = True
        core = make_core(redis_server, fleet)
        got: list[int] = []
        with pytest.raises(WorkerUnavailableError, match=r"decode worker d0 failed after 2 token\(s\) of request r0"):
            async for ev in core.generate(spec("r0")):
                got += ev.token_ids
        assert got == [7, 8]  # not retried: tokens were sent (another worker would repeat them)
        # d0 had taken the lease over, then died with it unsettled: the router releases it.
        assert fleet.released == [("p0", "lease-r0")]
        assert core.health.down() == {"d0"}
        assert await tokens_of(core, spec("r1")) == [7, 8, 9]
        assert fleet.decode_calls == {"d0": 1, "d1": 1}
        core.close()

    asyncio.run(run())


def test_requests_arriving_together_are_spread_over_decode_workers_while_they_prefill(redis_server) -> None:  # noqa: ANN001
    async def run() -> None:
        gate = asyncio.Event()
        fleet = Fleet(prefill_gate=gate)
        core = make_core(redis_server, fleet)
        tasks = [asyncio.create_task(tokens_of(core, spec(f"r{i}"))) for i in range(4)]
        await until(lambda: sum(core.decode_load.queued.values()) == 4 * (40 + 3))  # all four routed
        gate.set()
        assert await asyncio.gather(*tasks) == [[7, 8, 9]] * 4
        assert fleet.decode_calls == {"d0": 2, "d1": 2}
        assert sum(core.decode_load.queued.values()) == 0
        core.close()

    asyncio.run(run())


def test_health_probe_config_is_checked() -> None:
    with pytest.raises(ValueError, match="health_probe_interval_s"):
        RouterConfig(health_probe_interval_s=0)
    with pytest.raises(ValueError, match="interval"):
        WorkerHealth(lambda w: asyncio.sleep(0), interval_s=0)
