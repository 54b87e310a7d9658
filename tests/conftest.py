"""Fixtures shared by the whole suite: a tiny real model and a real Redis server.

Everything here is real: models are checkpoints on disk read by the engine's own loader,
Redis is an embedded ``redis-server`` (never a mock).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

# Under pytest-xdist (pyproject's addopts) two workers share the machine's cores: each runs torch,
# and everything it starts (Ray workers, `pdserve up`), on one thread, set before torch is imported.
# Two workers with a thread per core each, spinning between ops, took 3x as long in CPU-bound tests.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
# Every engine a test starts (and every process it starts) runs float32 projections through the
# packed copy at every row count, as the parity tests were written against: "auto" would time the
# paths at each start and, on a loaded machine, two engines of one test could choose differently.
# tests/engine/test_gemm_paths.py runs "auto" and "torch".
os.environ.setdefault("PDSERVE_CPU_FP32_GEMM", "kernel")

import pytest  # noqa: E402

from pdserve.engine.model import make_tiny_model  # noqa: E402
from pdserve.kvindex.embedded import EmbeddedRedis  # noqa: E402
from tests.support.redis import running_redis  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A deterministic tiny Llama checkpoint (seed 1) with its byte-level tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One embedded Redis for the session; tests isolate themselves with ``unique_namespace()``.
    A test that stops or restarts Redis starts its own (``running_redis()``)."""
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_used(request: pytest.FixtureRequest) -> None:
    """The test process's shared Ray (``tests.support.service.shared_ray``) runs while consecutive
    modules use it (a module that imports ``shared_ray``) and is shut down before any other module:
    idle, its processes take about 0.08 of a core, more than a start costs over a few minutes."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and "shared_ray" not in vars(request.module):
        ray.shutdown()


# Under pytest-xdist (`--dist loadgroup`), a module's tests stay together on one worker (its
# module-scoped service starts once), and tests that share a machine-wide resource form one group
# so that they never run at the same time: network namespaces and their links, and the
# tensor-parallel rendezvous directories in the temp directory (a test asserts none is left).
_SHARED_GROUPS = {
    "netns": ("tests/cluster/test_simnet.py", "tests/e2e/test_multinode.py", "tests/e2e/test_multinode_faults.py",
              "tests/e2e/test_deploy_scripts.py", "tests/cli/test_bench_smoke.py::test_links_bench",
              "tests/cli/test_bench_transfer_netns.py"),
    "tp-rendezvous": ("tests/engine/test_tensor_parallel.py", "tests/engine/test_tensor_parallel_deepseek.py",
                      "tests/engine/test_rank_actors.py", "tests/e2e/test_service_tp.py", "tests/cli/test_bench_tp.py"),
}


# tryfirst: xdist reads the markers in its own modifyitems hook, which must see them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = next((name for name, prefixes in _SHARED_GROUPS.items()
                      if any(item.nodeid.startswith(p) for p in prefixes)), item.nodeid.split("::")[0])  # fmt: skip
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Stop the run where the groups did not take: xdist carries an item's group in its node id
    (``...@group``), and where a pytest release stops honouring that (pytest-xdist issue 1386, pytest
    9.2) the groups would silently run side by side (pyproject pins pytest below it)."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in nodeid.rsplit("]", 1)[-1] for nodeid in ids):
        pytest.exit(f"pytest-xdist's --dist loadgroup did not group the tests under pytest {pytest.__version__} "
                    f"(e.g. {ids[0]}): the suite's groups would run side by side", returncode=3)
