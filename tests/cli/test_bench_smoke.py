"""The benchmarks run through ``pdserve bench`` and report what they claim (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO


def bench(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", *args, "--json"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_kvcache_bench_reports_both_sides() -> None:
    out = bench("kvcache", "--blocks", "4000", "--repeats", "1")
    h = out["hashing"]
    assert h["blocks"] == 4000 and h["ours_blocks_per_s"] > 0 and h["raw_xxh3_blocks_per_s"] > 0
    assert out["pool"]["block_ops"] == 4000 * 4  # allocate, free, hit, free of every block


@pytest.mark.slow
def test_prefix_bench_warm_request_hits_the_whole_prefix() -> None:
    out = bench("prefix", "--quick")
    full_blocks = out["prefix_tokens"] // out["block_size"] * out["block_size"]
    assert out["warm_cached_tokens"] == [full_blocks] * out["repeats"]  # every full block of the prefix
    assert out["cold_cached_tokens"] == [0] * out["repeats"]


def test_mla_bench_reports_bytes_and_both_forms() -> None:
    out = bench("mla", "--quick", "--heads", "4", "--rank", "64", "--batch", "2")
    tiny = out["kv_bytes_per_token"]["tiny"]
    # 3 layers of float32: MLA caches 32 + 8 values per layer, MHA 2 * 4 heads * 16, GQA-2 2 * 2 * 16.
    assert tiny == {"mla": 3 * 40 * 4, "gqa2": 3 * 64 * 4, "mha": 3 * 128 * 4}
    v3 = out["kv_bytes_per_token"]["deepseek_v3"]
    assert v3["mla"] == 61 * 576 * 2 and v3["mha"] == 61 * 2 * 128 * 128 * 2
    assert set(out["decode_ms"]) == {"128", "512"}
    for d in out["decode_ms"].values():
        assert min(d["step_absorbed"], d["step_naive"], d["attn_absorbed"], d["attn_naive"]) > 0


def test_transfer_bench_moves_the_bytes_three_ways() -> None:
    out = bench("transfer", "--total-mb", "4", "--layers", "4", "--chunk-mb", "0.5,1", "--repeats", "2")
    rows = out["results"]
    assert [r["chunk_bytes"] for r in rows] == [512 * 1024, 1024 * 1024]
    for r in rows:  # every pulled tensor was checked against the holder's digest inside the benchmark
        assert r["total_bytes"] == 16 * 256 * 1024 and r["num_chunks"] == r["total_bytes"] // r["chunk_bytes"]
        for method in ("raw_tcp", "grpc", "bare_grpc"):
            assert len(r[method]["seconds"]) == 2 and r[method]["gbps"] > 0
            assert r[method]["puller_cpu_s_per_gb"] >= 0 and r[method]["puller_page_faults_per_gb"] >= 0  # /proc ticks
        assert r["grpc_over_raw"] > 0 and r["bare_grpc_over_raw"] > 0 and r["grpc_over_bare"] > 0
