"""End to end with tensor-parallel workers: each a placement group of real Ray actors (the
worker's own and its ranks') joined by gloo, real Redis, real gRPC. Prefill and decode workers of
different TP sizes exchange blocks (TP changes neither block ids, bytes nor hashes) and both sides
hit their prefix caches."""

from __future__ import annotations

import os

import pytest
import ray
import torch

from pdserve import SamplingParams
from pdserve.cli.client import build_request, generate
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from tests.support.polling import process_gone, wait_until
from tests.support.service import all_idle, shared_ray, stub_for

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def greedy(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    return greedy


def _start(model: str, prefill_tp: int, decode_tp: int) -> Service:
    config = ServiceConfig.load(
        port=0, http_port=0, engine__model=model, engine__cache__kv_cache_memory_bytes=8 * 1024**2,
        router__local_prefill_threshold=8, prefill_tensor_parallel_size=prefill_tp,
        decode_tensor_parallel_size=decode_tp,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    svc.start()
    return svc


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_pulls_between_tp_sizes_equal_transformers(tiny_model: str, reference, prefill_tp: int,
                                                   decode_tp: int) -> None:  # fmt: skip
    svc = _start(tiny_model, prefill_tp, decode_tp)
    rank_pids: list[int] = []
    try:
        assert svc.port is not None
        channel, stub = stub_for(f"127.0.0.1:{svc.port}")
        base = _prompt(100 + prefill_tp * 3 + decode_tp, 70)
        first = generate(stub, build_request(base, GREEDY))
        assert first.token_ids == reference(base)
        assert first.usage["transferred_tokens"] == 70  # every block pulled from the prefill worker
        tail = base[:64] + _prompt(7, 30)
        second = generate(stub, build_request(tail, GREEDY))
        assert second.token_ids == reference(tail)
        assert second.usage["cached_tokens"] == 64  # the prefill worker's prefix hit
        assert second.usage["transferred_tokens"] == 30  # the decode worker held the prefix: only the rest moves
        assert wait_until(lambda: all_idle(svc), timeout=30)
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            handles = svc.prefill if role == "prefill" else svc.decode
            if tp > 1:  # its ranks are Ray actors in its placement group, on its node
                ((_, handle),) = handles.items()
                loaded = _ranks(handle)[1]
                assert len(loaded) == tp - 1
                rank_pids.extend(r["pid"] for r in loaded)
        if decode_tp > 1 and prefill_tp == 1:  # on this service too: a decode rank dies
            rank_pids.append(_kill_a_decode_rank_and_recover(svc, stub, reference))
        channel.close()
    finally:
        svc.stop()
    assert wait_until(lambda: all(process_gone(pid) for pid in rank_pids), timeout=30)  # stop ends every rank


def _ranks(handle) -> tuple[int, list[dict]]:  # noqa: ANN001
    """A worker actor's process id and its ranks' reports (pid, node, placement group), after
    checking that its ranks are Ray actors in its own placement group on its own node."""

    def look(worker) -> tuple[int, list[dict], str | None, str]:  # noqa: ANN001
        context = ray.get_runtime_context()
        ranks = worker.rt.engine.ranks
        return os.getpid(), list(ranks.loaded), context.get_placement_group_id(), context.get_node_id()

    pid, loaded, group, node = ray.get(handle.__ray_call__.remote(look), timeout=30)
    assert group is not None
    assert loaded and all(r["placement_group_id"] == group and r["node_id"] == node for r in loaded)
    assert all(r["pid"] != pid for r in loaded)
    table = ray.util.placement_group_table()[group]
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == len(loaded) + 1
    return pid, loaded


def _kill_a_decode_rank_and_recover(svc: Service, stub, reference) -> int:  # noqa: ANN001
    """A decode worker's rank dies: the worker ends, Ray restarts it whole (a new rank with it),
    and the service serves the reference tokens again. Returns the new rank's pid."""
    p = _prompt(3, 40)
    (handle,) = svc.decode.values()
    worker_pid, loaded = _ranks(handle)
    (rank,) = [r["pid"] for r in loaded]
    os.kill(rank, 9)

    def restarted() -> bool:
        try:
            pid, loaded = _ranks(handle)
        except Exception:  # noqa: BLE001 - still restarting
            return False
        return pid != worker_pid and len(loaded) == 1 and loaded[0]["pid"] != rank

    assert wait_until(restarted, timeout=120, interval=0.5)

    def serves() -> bool:
        try:
            return generate(stub, build_request(p, GREEDY)).token_ids == reference(p)
        except Exception:  # noqa: BLE001 - the router has not seen it back yet
            return False

    assert wait_until(serves, timeout=60, interval=0.5)
    assert wait_until(lambda: all_idle(svc), timeout=30)
    assert process_gone(rank)
    return int(_ranks(handle)[1][0]["pid"])


def test_deepseek_mla_between_tensor_parallel_workers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSeek-V3 (MLA latents, MoE) with both roles at TP=2: the latent rows a prefill worker's
    ranks cached are pulled whole by the decode worker, whose ranks decode transformers' tokens."""
    from tests.engine.test_engine import hf_greedy
    from tests.support.deepseek_models import make_deepseek_checkpoint
    from tests.support.models import load_hf_reference

    path = make_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek") / "v3", "v3", seed=31)
    hf = load_hf_reference(path)
    svc = _start(str(path), 2, 2)
    try:
        assert svc.port is not None
        channel, stub = stub_for(f"127.0.0.1:{svc.port}")
        base = _prompt(41, 70)
        first = generate(stub, build_request(base, GREEDY))
        assert first.token_ids == hf_greedy(hf, base, 12)
        assert first.usage["transferred_tokens"] == 70
        tail = base[:64] + _prompt(8, 30)
        second = generate(stub, build_request(tail, GREEDY))
        assert second.token_ids == hf_greedy(hf, tail, 12)
        assert second.usage["cached_tokens"] == 64 and second.usage["transferred_tokens"] == 30
        assert wait_until(lambda: all_idle(svc), timeout=30)
        channel.close()
    finally:
        svc.stop()
