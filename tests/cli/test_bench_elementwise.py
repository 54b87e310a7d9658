"""``pdserve bench elementwise`` checks each kernel against its torch expression, then times both (no
timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.kernels import cpu_ops
from tests.support import REPO


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "elementwise", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.skipif(not cpu_ops.supports(torch.zeros(1)), reason="the kernels are not built here")
def test_each_kernel_checked_and_timed() -> None:
    r = _bench("--rows", "1,5", "--widths", "64,96,3,16,1000", "--calls", "2", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)["results"]
    ops = {"add + rms_norm", "silu(gate) * up", "rotary", "greedy argmax"}
    assert {(x["op"], x["dtype"], x["rows"]) for x in out} == {
        (o, d, n) for o in ops for d in ("float32", "bfloat16") for n in (1, 5)}
    assert all(x["kernel_us"] > 0 and x["torch_us"] > 0 and x["speedup"] > 0 for x in out)


def test_a_kernel_that_disagrees_fails_the_run() -> None:
    from pdserve.benchmarks import elementwise

    with pytest.raises(SystemExit, match="greedy argmax"):
        elementwise.check("greedy argmax", lambda: torch.tensor([1, 2]), lambda: torch.tensor([1, 3]), torch.bfloat16)


def test_without_the_kernels_it_says_so_and_exits_0() -> None:
    r = _bench("--rows", "1", env={"PDSERVE_CPU_KERNELS": "0"})
    assert r.returncode == 0 and "not built here" in r.stderr
