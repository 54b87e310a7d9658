"""``pdserve bench fp32-paths``: every mode runs the same workload and reports against the first (no
timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "fp32-paths", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ))  # fmt: skip


def test_each_mode_runs_and_auto_says_what_it_chose(tiny_model: str) -> None:
    r = _bench("--model", tiny_model, "--rounds", "1", "--prompts", "2", "--prompt-tokens", "40",
               "--decode-seqs", "2", "--decode-tokens", "4", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out["modes"]) == {"kernel", "auto", "torch"} and out["baseline"] == "kernel"
    for v in out["modes"].values():
        assert v["prefill_s"] > 0 and v["decode_s"] > 0
        assert v["same_tokens_as_kernel"].endswith("/2")
    assert out["modes"]["kernel"]["prefill_speedup"] == 1.0
    assert out["auto_choice"].startswith("layers: torch at ")


def test_bad_modes_are_refused() -> None:
    r = _bench("--modes", "kernel,fastest")
    assert r.returncode == 2 and "--modes" in r.stderr
