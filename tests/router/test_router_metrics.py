"""RouterCore's request metrics and access log, over scripted workers (plain Python objects that
stand for the worker fleet; Redis is the real embedded server)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineStats
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvindex.config import IndexConfig, tenant_digest
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.metrics import merge_families, redis_outages, render
from pdserve.router.admission import Overloaded
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore, WorkerUnavailableError
from pdserve.router.metrics import RouterMetrics
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from pdserve.worker.metrics import WorkerMetrics
from tests.support.redis import unique_namespace


class ScriptedWorkers:
    """One prefill and one decode worker: the prefill returns token 7, the decode stream sends
    ``batches`` (the last one finishes with ``length``), or fails after them with ``fail``."""

    prefill_ids = ["p0"]
    decode_ids = ["d0"]

    def __init__(self, batches: list[tuple[int, ...]], fail: bool = False, gate: asyncio.Event | None = None) -> None:
        self.batches, self.fail, self.gate = batches, fail, gate

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        return PrefillResult(spec.request_id, 7, False, None, "lease-1", "127.0.0.1:1", worker_id,
                             len(spec.prompt_token_ids), 16)  # fmt: skip

    async def decode(self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]:
        for i, batch in enumerate(self.batches):
            if self.gate is not None:
                await self.gate.wait()
            last = i == len(self.batches) - 1 and not self.fail
            yield DecodeEvent(spec.request_id, batch, last, "length" if last else None, 0, 32)
        if self.fail:
            raise WorkerUnavailableError("decode worker d0 died")

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        pass  # no KV moves between these scripted workers

    def release(self, worker_id: str, lease_id: str) -> None:
        pass


def make_core(redis_server, workers: ScriptedWorkers, **router: object) -> RouterCore:  # noqa: ANN001
    index = IndexConfig(redis_server.url, namespace=unique_namespace())
    return RouterCore(RouterConfig(local_prefill_threshold=0, **router), CacheConfig(block_size=16), workers,
                      PrefixLookup(index), StatsRecorder(index))  # fmt: skip


def spec(rid: str, salt: str | None = "tenant-secret-salt") -> RequestSpec:
    return RequestSpec(rid, tuple(range(1, 41)), SamplingParams(max_tokens=5, ignore_eos=True), salt)


async def drain(core: RouterCore, s: RequestSpec) -> list[int]:
    tokens: list[int] = []
    async for ev in core.generate(s):
        tokens += ev.token_ids
    return tokens


def samples(core: RouterCore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = render(core.metrics.families()).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def test_a_finished_request_is_timed_counted_and_logged_once(redis_server, caplog) -> None:  # noqa: ANN001
    core = make_core(redis_server, ScriptedWorkers([(8,), (9, 10), (11,)]))
    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        tokens = asyncio.run(drain(core, spec("r-1")))
    core.close()
    assert tokens == [7, 8, 9, 10, 11]
    m = samples(core)
    assert m[("pdserve_time_to_first_token_seconds_count", ())] == 1
    # Every token after the first is one inter-token latency (a two-token event gives two).
    assert m[("pdserve_inter_token_latency_seconds_count", ())] == 4
    assert m[("pdserve_e2e_request_latency_seconds_count", ())] == 1
    assert m[("pdserve_request_queue_time_seconds_count", ())] == 1
    assert m[("pdserve_requests_total", (("finish_reason", "length"),))] == 1
    assert m[("pdserve_requests_total", (("finish_reason", "stop"),))] == 0
    assert m[("pdserve_prompt_tokens_total", ())] == 40
    assert m[("pdserve_generation_tokens_total", ())] == 5
    assert m[("pdserve_request_cached_tokens_total", ())] == 16
    assert m[("pdserve_request_transferred_tokens_total", ())] == 32
    assert m[("pdserve_router_requests_in_flight", ())] == 0

    [rec] = [r for r in caplog.records if r.name == "pdserve.access"]
    assert (rec.request_id, rec.status, rec.prompt_tokens, rec.cached_tokens, rec.transferred_tokens,
            rec.generated_tokens) == ("r-1", "length", 40, 16, 32, 5)  # fmt: skip
    assert rec.tenant == tenant_digest("tenant-secret-salt") and rec.ttft_ms is not None and rec.ttft_ms >= 0
    # The tenant's salt and prompt never reach the log.
    everything = rec.getMessage() + repr(vars(rec))
    assert "tenant-secret-salt" not in everything and "1, 2, 3" not in everything


def test_failed_cancelled_and_refused_requests_have_their_status(redis_server, caplog) -> None:  # noqa: ANN001
    async def run() -> None:
        failing = make_core(redis_server, ScriptedWorkers([(8,)], fail=True))
        with pytest.raises(WorkerUnavailableError):
            await drain(failing, spec("r-err"))
        failing.close()
        assert samples(failing)[("pdserve_requests_total", (("finish_reason", "error"),))] == 1

        gate = asyncio.Event()
        core = make_core(redis_server, ScriptedWorkers([(8,), (9,)], gate=gate), max_in_flight=1, max_queued=0)
        stream = core.generate(spec("r-cancel", salt=None))
        first = await stream.__anext__()  # the prefill's token; the decode stream waits on the gate
        assert first.token_ids == [7]
        with pytest.raises(Overloaded):  # the only slot is taken and nothing may queue
            await drain(core, spec("r-refused"))
        await stream.aclose()  # the client leaves
        core.close()
        m = samples(core)
        assert m[("pdserve_requests_total", (("finish_reason", "abort"),))] == 1
        assert m[("pdserve_requests_rejected_total", (("reason", "overloaded"),))] == 1

    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        asyncio.run(run())
    status = {r.request_id: r.status for r in caplog.records if r.name == "pdserve.access"}
    assert status == {"r-err": "error", "r-cancel": "abort", "r-refused": "rejected:overloaded"}
    assert [r.tenant for r in caplog.records if r.name == "pdserve.access" and r.request_id == "r-cancel"] == ["-"]


def test_access_log_can_be_turned_off(redis_server, caplog) -> None:  # noqa: ANN001
    core = make_core(redis_server, ScriptedWorkers([(8,)]), access_log=False)
    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        asyncio.run(drain(core, spec("r-quiet")))
    core.close()
    assert not [r for r in caplog.records if r.name == "pdserve.access"]


def test_families_of_several_processes_merge_into_one_valid_exposition(redis_server) -> None:  # noqa: ANN001
    a, b = make_core(redis_server, ScriptedWorkers([(8,)])), make_core(redis_server, ScriptedWorkers([(8,)]))
    a.close()
    b.close()
    merged = merge_families([[redis_outages("router", [("stats", 2)])], [redis_outages("decode-0", [("events", 1)])]])
    [fam] = list(text_string_to_metric_families(render(merged).decode()))
    assert {(s.labels["process"], s.value) for s in fam.samples if s.name.endswith("_total")} == {
        ("router", 2), ("decode-0", 1)
    }
    # One name with two types cannot be exposed: a bug, refused loudly.
    gauge_twin = [f for f in a.metrics.families() if f.name == "pdserve_router_requests_in_flight"]
    renamed = [type(f)(f.name, f.documentation, f.type) for f in gauge_twin]
    renamed[0].name = "pdserve_requests"
    with pytest.raises(ValueError, match="pdserve_requests"):
        merge_families([a.metrics.families(), renamed])


def test_the_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    from tests.support import REPO

    stats = EngineStats(num_blocks=10, free_blocks=4, running=2, waiting=1, num_preemptions=0,
                        prefix_cache_queries=100, prefix_cache_hits=40)  # fmt: skip
    worker = WorkerMetrics("decode-0", "decode", lambda: stats, lambda: [("events", 0)])
    worker.transfer_done(1 << 20, 2, 0.01)
    families = [*RouterMetrics().families(), *worker.families(),
                GaugeMetricFamily("pdserve_worker_up", "", labels=["worker"])]  # as the router actor adds it
    exposed = {s.name for f in text_string_to_metric_families(render(families).decode()) for s in f.samples}
    exposed |= {f.name for f in families}  # gauges without samples yet (pdserve_worker_up here)
    by_name = {f.name: f for f in families}
    assert by_name["pdserve_kv_cache_usage_ratio"].samples[0].value == pytest.approx(0.6)
    dashboard = json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bpdserve_\w+", e)}
    assert used and used <= exposed, sorted(used - exposed)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    assert all(w in titles for w in ("first token", "inter-token", "hit rate", "kv-cache usage", "transfer throughput"))
