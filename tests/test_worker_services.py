"""Prefill and decode services over real WorkerRuntimes (real gRPC KV transfer, real Redis),
driven directly: the Ray actors are thin shells around these objects."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from decode_worker.service import DecodeService
from engine import SamplingParams
from engine.config import CacheConfig
from engine.model import make_tiny_model
from kvtransfer.handoff import RequestSpec
from kvtransfer.redis_index import RedisIndexConfig, read_stats
from kvtransfer.worker_runtime import WorkerConfig, WorkerRuntime
from prefill_worker.service import PrefillService
from tests.redis_utils import running_redis, unique_namespace, wait_until


def runtime(model_dir: Path, url: str, ns: str, wid: str, role: str, block_size: int = 16) -> WorkerRuntime:
    return WorkerRuntime(WorkerConfig(
        worker_id=wid, role=role, model_dir=str(model_dir), redis_url=url, namespace=ns,
        cache=CacheConfig(block_size, 64), bind_host="127.0.0.1", device="cpu",
    ))  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)


def counters(url: str, ns: str, wid: str) -> dict[str, int]:
    cfg = RedisIndexConfig(url, namespace=ns)
    return read_stats(cfg.client(), ns)["workers"].get(wid, {})


def test_failed_pull_releases_the_lease_at_once_and_counts_the_recompute(model_dir: Path) -> None:
    """Block sizes differ, so the pull is refused (layout mismatch): the decode worker recomputes,
    gives the prefill worker's lease back before decoding on, and counts the prompt once."""
    with running_redis() as server:
        ns = unique_namespace()
        prt = runtime(model_dir, server.url, ns, "prefill-0", "prefill", block_size=16)
        drt = runtime(model_dir, server.url, ns, "decode-0", "decode", block_size=8)
        try:
            spec = RequestSpec("r", tuple(range(1, 41)), SamplingParams(max_tokens=200, ignore_eos=True))

            async def run() -> tuple[list, list[dict]]:
                pre = await PrefillService(prt).prefill(spec)
                assert pre.lease_id and prt.pool_state()["leases"] == 1
                events, states = [], []
                async for ev in DecodeService(drt).generate(spec, pre):
                    events.append(ev)
                    if len(events) == 1:
                        await asyncio.sleep(0.2)  # the release runs beside the decode
                        states.append(prt.pool_state())
                return events, states

            events, states = asyncio.run(run())
            assert states[0]["leases"] == 0 and states[0]["free_blocks"] == states[0]["num_blocks"]
            assert events[-1].finished and events[-1].num_recomputed_tokens == 40
            assert drt.stats.flush(10) and prt.stats.flush(10)
            assert counters(server.url, ns, "decode-0")["recomputed_tokens"] == 40
            assert counters(server.url, ns, "decode-0")["prefill_computed_tokens"] == 0
            assert counters(server.url, ns, "prefill-0")["prefill_computed_tokens"] == 40
        finally:
            drt.close()
            prt.close()


def test_local_prefill_counts_what_it_computed_and_close_leaves_nothing(model_dir: Path) -> None:
    with running_redis() as server:
        ns = unique_namespace()
        drt = runtime(model_dir, server.url, ns, "decode-0", "decode")
        prompt = tuple(range(1, 41))

        async def run(rid: str) -> list:
            spec = RequestSpec(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
            return [ev async for ev in DecodeService(drt).generate(spec, None)]

        first, second = asyncio.run(run("a")), asyncio.run(run("b"))
        assert first[-1].num_local_hit_tokens == 0 and second[-1].num_local_hit_tokens == 32
        assert drt.stats.flush(10)
        assert counters(server.url, ns, "decode-0")["prefill_computed_tokens"] == 40 + 8
        client = RedisIndexConfig(server.url, namespace=ns).client()
        assert wait_until(lambda: any(True for _ in client.scan_iter(f"{ns}:block:*")))
        drt.close()
        # A clean close unregisters the worker and removes it as a holder of every block.
        assert not client.hexists(f"{ns}:workers", "decode-0")
        assert not [k for k in client.scan_iter(f"{ns}:block:*") if client.hexists(k, "decode-0")]
