"""``pdserve bench attention-cpu`` checks both decode-attention paths against the reference, then times them
(no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.kernels import cpu_decode
from tests.support import REPO


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.benchmarks.attention_cpu", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.skipif(not cpu_decode.supports(torch.float32, torch.float32, 9, 3, 64), reason="the kernel is not built here")
def test_both_paths_checked_and_timed() -> None:
    r = _bench("--shapes", "3x40,2x70", "--calls", "2", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    got = {(x["dtype"], x["batch"], x["context"]) for x in out["results"]}
    assert got == {(d, b, c) for d in ("float32", "bfloat16") for b, c in ((3, 40), (2, 70))}
    for x in out["results"]:
        assert x["torch"]["ms"] > 0 and x["kernel"]["ms"] > 0 and x["speedup"] > 0 and x["kernel"]["gbps"] > 0
        assert x["call"]["ms"] > 0 and x["call"]["gbps"] > 0  # the entry point alone, checked equal first


@pytest.mark.skipif(not cpu_decode.supports(torch.float32, torch.float32, 9, 3, 64), reason="the kernel is not built here")
def test_layers_taken_in_turn() -> None:
    r = _bench("--shapes", "2x40", "--dtypes", "bfloat16", "--layers", "3", "--calls", "3", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["layers"] == 3 and out["results"][0]["kernel"]["ms"] > 0
    r = _bench("--layers", "0")
    assert r.returncode == 2 and "--layers, --calls and --repeats must be positive" in r.stderr


def test_without_the_kernel_it_says_so_and_exits_0() -> None:
    r = _bench("--shapes", "2x20", env={"PDSERVE_CPU_KERNELS": "0"})
    assert r.returncode == 0 and "does not run here" in r.stderr
