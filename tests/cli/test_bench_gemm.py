"""``python -m pdserve.benchmarks.gemm`` runs and reports what it claims (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.benchmarks.gemm import make_prompts
from pdserve.engine.model.config import ModelConfig
from tests.support import REPO


def test_gemm_bench_reports_every_shape_both_dtypes_and_the_engine(tiny_model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.gemm", "--quick", "--json", "--model", tiny_model],
                       capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    shapes = {(t["shape"], t["rows"]) for t in out["gemm"]}
    assert shapes == {(s, rows) for s in ("qkv", "o", "gate_up", "down", "lm_head") for rows in (1, 32)} | {
        ("large", 1024)}
    for t in out["gemm"]:
        keys = {"float32_engine", "bfloat16_engine"} | (set() if t["shape"] == "large" else
                                                        {"float32_f_linear", "bfloat16_f_linear"})  # fmt: skip
        assert set(t["tflops"]) == keys and all(v > 0 for v in t["tflops"].values())
    eng = out["engine"]
    assert eng["prompts"] == 4 and eng["max_tokens"] == 8 and eng["read_gb_per_s"] > 0
    for d in ("float32", "bfloat16"):
        e = eng[d]
        assert e["output_tok_per_s"] > 0 and e["median_step_ms"] > 0 and 0 < e["projection_share"] < 1
        assert e["weight_read_floor_ms"] > 0
    # Against the limit: the step's products timed alone beside the rounds; the ceiling, from every weight and the
    # K/V a mid-run decode step reads (every layer's K and V of each sequence's prompt and half its tokens).
    cfg = ModelConfig.from_path(tiny_model)
    positions = sum(len(p) + 8 // 2 for p in make_prompts(4, cfg.vocab_size, seed=0))
    for d, itemsize in (("float32", 4), ("bfloat16", 2)):
        e = eng[d]
        per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
        assert e["kv_read_bytes"] == per_token * positions
        floor, step, kv = e["compute_floor_ms"], e["median_step_ms"], e["kv_read_floor_ms"]
        assert floor > 0 and kv > 0 and abs(kv - per_token * positions / (eng["read_gb_per_s"] * 1e6)) < 0.01 * kv
        ceiling = floor / (e["weight_read_floor_ms"] + kv)  # from figures rounded to 4 digits
        assert abs(e["limit"] - floor / step) < 2e-3 + 2e-3 * floor / step
        assert abs(e["ceiling"] - ceiling) < 2e-3 + 3e-3 * ceiling and e["ceiling"] > 0
