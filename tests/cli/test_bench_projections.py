"""``pdserve bench projections`` checks every path against float64 (and the fused SwiGLU against the product then
silu_mul, bit for bit), then times them (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.engine.kernels import cpu_gemm
from tests.support import REPO


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "projections", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.skipif(cpu_gemm.panel() == 0, reason="the kernel is not built here")
def test_every_path_checked_and_timed() -> None:
    r = _bench("--rows", "3,17", "--layers", "1", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out["rows"]) == {"3", "17"}
    for by in out["rows"].values():
        assert set(by) == {"kernel", "w_xt", "f_linear", "onednn", "read"}
        assert all(v["ms"] > 0 and v["gbps"] > 0 for v in by.values())
        assert all(v["gflops"] > 0 for k, v in by.items() if k != "read")
    assert set(out["swiglu"]) == {"3", "17"}
    assert all(set(glu) == {"fused", "unfused"} and min(glu.values()) > 0 for glu in out["swiglu"].values())


def test_without_the_kernel_it_says_so_and_exits_0() -> None:
    r = _bench("--layers", "1", env={"PDSERVE_CPU_KERNELS": "0"})
    assert r.returncode == 0 and "not built here" in r.stdout, (r.stdout, r.stderr[-1000:])


def test_bad_rows_are_refused() -> None:
    r = _bench("--rows", "0")
    assert r.returncode == 2 and "--rows >= 1" in r.stderr
