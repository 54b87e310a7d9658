"""``pdserve bench prefix-cpu`` checks both paths of a cascade's prefix part (bfloat16 and float32) against
float64, then times them (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.kernels import cpu_amx_prefix, cpu_prefix
from tests.support import REPO


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.benchmarks.prefix_cpu", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.parametrize("dtype", [
    pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_amx_prefix.available(torch.bfloat16, 64),
                                                      reason="no AMX prefix kernel here")),
    pytest.param("float32", marks=pytest.mark.skipif(not cpu_prefix.available(torch.float32, 64),
                                                     reason="no float32 prefix kernel here")),
])  # fmt: skip
def test_both_paths_checked_and_timed(dtype: str) -> None:
    r = _bench("--dtype", dtype, "--batch", "5", "--prefix", "40", "--layers", "3", "--calls", "3", "--repeats", "2",
               "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["dtype"] == dtype and out["batch"] == 5 and out["prefix"] == 48 and out["layers"] == 3  # whole blocks
    for part in ("step_ms", "layer_us"):
        assert out[part]["flash"] > 0 and out[part]["kernel"] > 0
    assert out["layer_speedup"] > 0 and out["step_speedup"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_without_the_kernel_it_says_so_and_exits_0(dtype: str) -> None:
    r = _bench("--dtype", dtype, "--layers", "2", env={"PDSERVE_CPU_KERNELS": "0"})
    assert r.returncode == 0 and "prefix kernel runs here" in r.stderr


def test_bad_arguments_exit_2() -> None:
    r = _bench("--batch", "0")
    assert r.returncode == 2 and "must be positive" in r.stderr
