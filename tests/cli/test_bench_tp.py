"""``python -m pdserve.benchmarks.tp`` runs both sizes and reports what it claims (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO


def test_tp_bench_reports_each_size_and_equal_outputs(tiny_model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.tp", "--quick", "--json", "--model", tiny_model],
                       capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out["sizes"]) == {"1", "2"}
    one, two = out["sizes"]["1"], out["sizes"]["2"]
    assert one["step_over_tp1"] == 1.0 and one["collective_share"] == 0.0
    assert 0 < two["collective_share"] < 1 and two["median_decode_step_ms"] > 0
    assert one["greedy_equal_tp1"] and two["greedy_equal_tp1"]
    # The tiny model's 2 KV heads split 2 ways: each rank's attention reads half of a block.
    assert two["kv_bytes_per_rank_slice"] * 2 == out["kv_bytes_per_block"]
