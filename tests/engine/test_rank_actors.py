"""Tensor-parallel ranks as Ray actors (``distributed_executor_backend="ray"``), on a real local Ray:
an engine in bundle 0 of a placement group starts its other ranks in the other bundles, their
tokens equal one rank's, and every rank actor ends with the engine or with a failed start."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve import LLM, SamplingParams
from tests.support.polling import process_gone, wait_until
from tests.support.service import shared_ray

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray() -> None:
    shared_ray()


@pytest.fixture
def two_bundles(local_ray: None) -> Iterator[Any]:
    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    try:
        yield group
    finally:
        remove_placement_group(group)


def _in_bundle(group: Any, index: int) -> dict[str, Any]:
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
    return {"num_cpus": 1, "scheduling_strategy": strategy}


class _Driver:
    """Rank 0: an engine whose other rank is a Ray actor in this actor's placement group."""

    def generate(self, model: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict[str, Any]], str]:
        llm = LLM(model, num_blocks=64, tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            assert llm.engine.ranks is not None
            loaded = list(llm.engine.ranks.loaded)
            outs = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        finally:
            llm.close()
        return outs, loaded, ray.get_runtime_context().get_placement_group_id()

    def start_failing(self) -> str:
        from pdserve.engine.kv_tensor import KVLayout, KVTensor
        from pdserve.engine.parallel.rank_actors import ActorLauncher
        from pdserve.engine.parallel.ranks import Ranks

        kv = KVTensor(KVLayout(1, 2, 8, 4, torch.float32), 4, shared=True)
        spec = {"model": "/nonexistent/model", "dtype": "float32", "onednn": False, "quantized": False,
                "threads": 1, "num_blocks": 4, "layout": {}}  # fmt: skip
        try:
            Ranks(ActorLauncher(), spec, kv, 2, collective_timeout_s=10, start_timeout_s=120)
        except RuntimeError as e:
            return str(e)
        return "started"


def test_rank_actors_in_the_placement_group_equal_one_rank(tiny_model: str, two_bundles: Any) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 23)]
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=64).generate(prompts, PARAMS)]
    driver = ray.remote(_Driver).options(**_in_bundle(two_bundles, 0)).remote()
    try:
        outs, loaded, group_id = ray.get(driver.generate.remote(tiny_model, prompts), timeout=300)
    finally:
        ray.kill(driver)
    assert outs == expected
    (rank,) = loaded
    assert rank["placement_group_id"] == group_id == two_bundles.id.hex()
    assert wait_until(lambda: process_gone(rank["pid"]), timeout=30)  # close() ended the rank's actor


def test_a_rank_actor_that_cannot_load_is_named_and_its_bundle_freed(two_bundles: Any) -> None:
    driver = ray.remote(_Driver).options(**_in_bundle(two_bundles, 0)).remote()
    try:
        why = ray.get(driver.start_failing.remote(), timeout=300)
    finally:
        ray.kill(driver)
    assert why.startswith("tensor-parallel rank 1: FileNotFoundError") and "/nonexistent/model" in why

    # The failed rank's actor was ended: its bundle takes another actor.
    @ray.remote(num_cpus=1)
    def where() -> str:
        return ray.get_runtime_context().get_placement_group_id() or ""

    ref = where.options(**_in_bundle(two_bundles, 1)).remote()
    assert ray.get(ref, timeout=60) == two_bundles.id.hex()


def test_outside_a_placement_group_ray_ranks_are_refused(tiny_model: str, local_ray: None) -> None:
    with pytest.raises(RuntimeError, match="not in a placement group"):
        LLM(tiny_model, num_blocks=16, tensor_parallel_size=2, distributed_executor_backend="ray")
