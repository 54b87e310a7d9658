"""End to end with 2 prefill + 2 decode workers (slower: four model-loading actors)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.cli.client import build_request, generate
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.model import make_tiny_model
from pdserve.kvindex.stats import read_stats
from tests.support.polling import wait_until
from tests.support.service import all_idle, shared_ray, stub_for

pytestmark = pytest.mark.slow


def _assigned_cpus(_worker: object) -> float:
    """Runs inside a worker actor: the CPUs Ray assigned it."""
    return ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)


def test_two_plus_two_workers(tmp_path) -> None:
    model_dir = str(make_tiny_model(tmp_path / "tiny", seed=2))
    config = ServiceConfig.load(
        prefill=2, decode=2, port=0, http_port=0, cpus_per_worker=0.5, decode_cpus_per_worker=0.75,
        engine__model=model_dir,
        engine__cache__kv_cache_memory_bytes=8 * 1024**2, router__local_prefill_threshold=8,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    address, redis_url = svc.start()
    channel, stub = stub_for(address)
    try:
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        system = "A shared system prompt that every tenant user sends first. " * 2
        prompts = [system + f"question number {i} " * (1 + i % 3) for i in range(12)]
        with cf.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: generate(stub, build_request(p, params)), prompts))
        expected = LLM(model_dir, num_blocks=256).generate(prompts, params)
        assert [r.token_ids for r in results] == [e.token_ids for e in expected]
        cfg = svc.index_config()
        assert wait_until(lambda: read_stats(cfg.client(), cfg)["cluster"]["requests"] == 12, timeout=30)
        s = read_stats(cfg.client(), cfg)
        assert s["cluster"]["prefix_hit_tokens"] > 0
        workers = cfg.client().hgetall(f"{cfg.namespace}:workers")
        assert {w if isinstance(w, str) else w.decode() for w in workers} == {
            "prefill-0", "prefill-1", "decode-0", "decode-1"}
        assert wait_until(lambda: all_idle(svc), timeout=30)
        # Each role's workers hold the CPUs asked for that role.
        held = {wid: ray.get(h.__ray_call__.remote(_assigned_cpus)) for wid, h in {**svc.prefill, **svc.decode}.items()}
        assert held == {"prefill-0": 0.5, "prefill-1": 0.5, "decode-0": 0.75, "decode-1": 0.75}
    finally:
        channel.close()
        svc.stop()
