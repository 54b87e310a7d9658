"""Transfer overlapped with prefill: a decode worker pulls a prompt's blocks while its prefill worker is
still prefilling it (``decode_worker/prefetch.py``). Real runtimes (engines, gRPC, Redis), in-process."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kvindex.config import IndexConfig
from pdserve.kvtransfer.nixl import nixl_installed
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.config import WorkerConfig
from pdserve.worker.messages import RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from tests.support.polling import wait_until
from tests.support.redis import unique_namespace
from tests.workers.test_worker_services import SECRET, metric

BLOCK, CHUNK = 16, 32  # the prefill worker computes a prompt 32 tokens (two blocks) per step


TRANSFERS = {"shm": SECRET, "grpc": dataclasses.replace(SECRET, shm=False),
             "nixl": dataclasses.replace(SECRET, shm=False, nixl=True)}  # fmt: skip


def runtime(model: str, url: str, ns: str, wid: str, role: str, transport: str = "shm") -> WorkerRuntime:
    engine = EngineConfig(model, device="cpu", cache=CacheConfig(BLOCK, 64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))  # fmt: skip
    return WorkerRuntime(WorkerConfig(wid, role, engine, IndexConfig(url, namespace=ns), TRANSFERS[transport],
                                      bind_host="127.0.0.1"))  # fmt: skip


def idle(rt: WorkerRuntime) -> bool:
    state = rt.pool_state()
    return state["leases"] == 0 and state["requests"] == 0 and state["free_blocks"] == state["num_blocks"]


class SteppingGate:
    """Holds a runtime's engine loop between two steps, after ``after`` steps, until ``open``: at the
    top of its next round, where the loop holds no lock (it steps under the engine's lock), so readers
    can pin blocks meanwhile."""

    def __init__(self, rt: WorkerRuntime, after: int) -> None:
        engine = rt.engine
        self._step, self._has_unfinished, self._after = engine.step, engine.has_unfinished, after
        self.steps = 0
        self.held = threading.Event()
        self._open = threading.Event()
        engine.step = self._counted  # type: ignore[method-assign]
        engine.has_unfinished = self._gated  # type: ignore[method-assign]

    def _counted(self):  # type: ignore[no-untyped-def]
        out = self._step()
        self.steps += 1
        return out

    def _gated(self) -> bool:
        if self.steps == self._after and not self._open.is_set():
            self.held.set()
            assert self._open.wait(60), "the test never opened the gate"
        return self._has_unfinished()

    def open(self) -> None:
        self._open.set()


@pytest.mark.parametrize("transport", ["shm", "grpc", "nixl"])
def test_blocks_cross_while_the_prompt_is_prefilled_and_the_lease_pull_takes_the_rest(tiny_model: str, redis_server,
                                                                                      transport: str) -> None:  # fmt: skip
    """The prefill worker is held after 3 of its 7 steps (96 of 200 tokens computed): the decode
    worker's prefetch has those 6 blocks meanwhile, by each transport. After the prefill, the lease pull
    moves only the rest, the tokens are one engine's, and both pools end idle."""
    if transport == "nixl" and not nixl_installed():
        pytest.skip("NIXL is not installed (pip install 'pdserve[nixl]')")
    ns = unique_namespace()
    prt = runtime(tiny_model, redis_server.url, ns, "prefill-0", "prefill", transport)
    drt = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode", transport)
    decode = DecodeService(drt)
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        spec = RequestSpec("long", tuple(range(5, 205)), params)
        expected = LLM(tiny_model, num_blocks=64).generate([list(spec.prompt_token_ids)], params)[0].token_ids
        gate = SteppingGate(prt, after=3)

        async def run() -> tuple[int, list]:
            prefill = asyncio.ensure_future(PrefillService(prt).prefill(spec))
            assert await asyncio.to_thread(gate.held.wait, 30)
            assert decode.prefetch(spec, prt.address)
            def landed() -> bool:
                return metric(drt, "pdserve_kv_prefetch_blocks_total") >= 6

            assert await asyncio.to_thread(wait_until, landed, 30), "the first chunks did not cross"
            assert not prefill.done() and gate.steps == 3  # still prefilling: the blocks crossed beside it
            gate.open()
            pre = await prefill
            return pre.first_token, [ev async for ev in decode.generate(spec, pre)]

        first, events = asyncio.run(run())
        assert [first] + [t for ev in events for t in ev.token_ids] == expected
        hit, moved = events[-1].num_local_hit_tokens, events[-1].num_transferred_tokens
        assert hit >= 96 and hit % BLOCK == 0 and hit + moved == 200 and events[-1].num_recomputed_tokens == 0
        assert wait_until(lambda: decode.prefetches.running() == 0)
        assert metric(drt, "pdserve_kv_prefetch_blocks_total") * BLOCK >= hit  # every local hit was prefetched
        assert metric(drt, "pdserve_kv_transfer_blocks_total", transport=transport) >= 6 + moved // BLOCK
        assert wait_until(lambda: idle(prt)) and wait_until(lambda: idle(drt))
        drt.engine.handover.check_invariants()
    finally:
        decode.close()
        drt.close()
        prt.close()


def test_a_prefetch_ends_when_its_prefill_never_comes_and_returns_every_block(tiny_model: str, redis_server,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Nothing to pull (the prompt was never prefilled there): the prefetch gives up after its idle
    time with every block back; one for a request that is already running is declined."""
    monkeypatch.setattr("pdserve.decode_worker.prefetch.IDLE_S", 0.3)
    monkeypatch.setattr("pdserve.decode_worker.prefetch.PREFIX_WAIT_S", 0.1)
    ns = unique_namespace()
    prt = runtime(tiny_model, redis_server.url, ns, "prefill-0", "prefill")
    drt = runtime(tiny_model, redis_server.url, ns, "decode-0", "decode")
    decode = DecodeService(drt)
    try:
        spec = RequestSpec("never", tuple(range(300, 400)), SamplingParams(max_tokens=2))
        assert decode.prefetch(spec, prt.address)
        assert not decode.prefetch(spec, prt.address)  # one per request
        assert wait_until(lambda: decode.prefetches.running() == 0, timeout=30)
        assert idle(drt) and metric(drt, "pdserve_kv_transfer_blocks_total") == 0
        drt.engine.handover.check_invariants()
    finally:
        decode.close()
        drt.close()
        prt.close()
