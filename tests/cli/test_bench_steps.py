"""``python -m pdserve.benchmarks.steps`` accounts for a decode step part by part, times prompts joining a
batch and the kernel-call replay against the modules (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO

PREFIX = 300  # the prompts' shared prefix (--prefix-tokens): its last block partial, as the default 221's


def test_steps_bench_parts_add_up_to_the_step(tiny_model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.steps", "--quick", "--joins", "2", "--replay-ab",
                        "--json", "--model", tiny_model, "--prefix-tokens", str(PREFIX)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    parts = out["parts_ms"]
    assert set(parts) == {"schedule", "prepare", "forward", "logits", "sample", "outputs and bookkeeping"}
    assert all(v >= 0 for v in parts.values()) and parts["forward"] > 0
    assert sum(parts.values()) >= out["mean_step_ms"] * 0.999  # the remainder closes the sum
    assert abs(sum(out["forward_op_share"].values()) - 1) < 1e-6
    join = out["join"]  # two prompts joined three decoding sequences, each prefilled past the shared prefix
    assert join["decoding"] == 3 and join["joins"] == 2 and join["join_step_ms"] > 0 and join["decode_step_ms"] > 0
    # Uncached: the prompt's own 44-64 tokens and the prefix's partial last block (16-token blocks).
    assert PREFIX % 16 + 44 <= join["join_uncached_tokens"] <= PREFIX % 16 + 64
    ab = out["replay_ab"]  # 7 decode steps of 4 prompts, alternating; each of the replay's qualified
    assert ab["steps_each"] == 3 and ab["replayed"] == 1.0 and ab["replay_ms"] > 0 and ab["modules_ms"] > 0


def test_a_prefix_of_no_tokens_is_refused(tiny_model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.steps", "--quick", "--model", tiny_model,
                        "--prefix-tokens", "0"], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 2 and "--prefix-tokens must be at least 1" in r.stderr
