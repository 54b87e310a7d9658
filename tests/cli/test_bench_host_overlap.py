"""``python -m pdserve.benchmarks.host_overlap`` runs a helper's Python work beside each forward of its
helper rounds, and only there (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO


def run_bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.benchmarks.host_overlap", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)  # fmt: skip


def test_the_helper_runs_beside_the_forwards_of_its_rounds(tiny_model: str) -> None:
    r = run_bench("--prompts", "4", "--max-tokens", "8", "--rounds", "2", "--dtype", "float32", "--model", tiny_model,
                  "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["host_work_ms"] > 0 and out["helper_work_ms"] == out["host_work_ms"]
    assert len(out["rounds_ms"]["without"]) == len(out["rounds_ms"]["with"]) == 2
    # 8 tokens: 7 decode steps per round, each forward kicking the helper in the 2 helper rounds only. A kick
    # that comes while the work still runs is taken by the run after it, so there may be fewer runs than kicks.
    assert out["helper_rounds_steps"] == 2 * 7
    assert 1 <= out["helper_runs"] <= out["helper_rounds_steps"] and out["helper_took_ms"] > 0
    assert out["step_ms_with"] > 0 and out["step_ms_without"] > 0
    assert abs(out["step_longer_by_ms"] - (out["step_ms_with"] - out["step_ms_without"])) < 0.02


def test_a_fixed_work_time_is_used_as_given(tiny_model: str) -> None:
    r = run_bench("--quick", "--dtype", "float32", "--model", tiny_model, "--work-ms", "0.5", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["helper_work_ms"] == 0.5


def test_bad_arguments_exit_2_with_a_message() -> None:
    for args in (["--rounds", "0"], ["--max-tokens", "1"], ["--work-ms", "0"]):
        r = run_bench(*args, timeout=120)
        assert r.returncode == 2 and "host-overlap:" in r.stderr, (args, r.stderr[-500:])


def test_the_helper_in_a_process_of_its_own_runs_too(tiny_model: str) -> None:
    r = run_bench("--quick", "--helper", "process", "--dtype", "float32", "--model", tiny_model, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["helper"] == "process" and 1 <= out["helper_runs"] <= out["helper_rounds_steps"] == 7
    assert abs(out["overlap_saves_ms"] - (out["helper_work_ms"] - out["step_longer_by_ms"])) < 0.02
