"""The benchmarks run through ``pdserve bench`` and report what they claim (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_transfer_bench_moves_the_bytes_every_way() -> None:
    from pdserve.kvtransfer.nixl import nixl_installed

    nixl = nixl_installed()
    out = bench("transfer", "--total-mb", "4", "--layers", "4", "--chunk-mb", "0.5,1", "--repeats", "2")
    rows = out["results"]
    assert [r["chunk_bytes"] for r in rows] == [512 * 1024, 1024 * 1024]
    for r in rows:  # every pulled tensor was checked against the holder's digest inside the benchmark
        assert r["total_bytes"] == 16 * 256 * 1024 and r["num_chunks"] == r["total_bytes"] // r["chunk_bytes"]
        for method in ("raw_tcp", "grpc", "bare_grpc", "memcpy"):
            assert len(r[method]["seconds"]) == 2 and r[method]["gbps"] > 0
            assert r[method]["puller_cpu_s_per_gb"] >= 0 and r[method]["puller_page_faults_per_gb"] >= 0  # /proc ticks
        assert r["grpc_over_raw"] > 0 and r["bare_grpc_over_raw"] > 0 and r["grpc_over_bare"] > 0
        # The same holder and puller, by gRPC and shared memory, and by NIXL where the library loads.
        assert set(r["transports"]) == {"grpc", "shm"} | ({"nixl"} if nixl else set())
        for t in r["transports"].values():
            assert t["gbps"] > 0 and t["over_raw"] > 0 and t["over_memcpy"] > 0
        if nixl:  # ours against a bare NIXL read of the same blocks, both timed in every round
            assert len(r["nixl_bare"]["seconds"]) == 2 and r["nixl_bare"]["gbps"] > 0
            assert r["transports"]["nixl"]["over_bare_nixl"] > 0
        else:
            assert "nixl_bare" not in r


def test_overlap_bench_hands_over_with_and_without_prefetch(tmp_path: Path) -> None:
    from pdserve.engine.model import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tiny", seed=3))
    out = bench("overlap", "--model", model, "--prompt-tokens", "160", "--chunk", "32", "--repeats", "1")
    off, on = out["modes"]["off"], out["modes"]["on"]
    assert off["prefetched"] == 0 and off["pulled_after_prefill"] == 160  # the whole prompt by lease
    assert on["prefetched"] % 16 == 0 and on["prefetched"] + on["pulled_after_prefill"] == 160
    assert out["transport"] == "grpc" and out["handover_saved_ms"] == off["handover_ms"] - on["handover_ms"]


def test_serve_bench_tenant_salts_are_new_each_run_unless_fixed() -> None:
    """Two runs against one service: the same prompts under salts the cluster has not seen, so the
    second starts as cold as the first; a fixed --run-id reruns warm on purpose."""
    from pdserve.benchmarks.serve_load import WorkloadConfig, make_workload

    def workload(**kw: object) -> list:
        return make_workload(WorkloadConfig(num_requests=20, rate=2.0, tenants=3, system_len=(20, 30),
                                            question_len=(5, 10), max_tokens=4, seed=7, **kw))  # fmt: skip

    first, second = workload(), workload()
    assert [r.prompt for r in first] == [r.prompt for r in second]  # the seed alone fixes the tokens
    assert not {r.tenant for r in first} & {r.tenant for r in second}
    assert len({r.tenant.rpartition("/")[0] for r in first}) == 1  # one run id per run
    assert [r.tenant for r in workload(run_id="again")] == [r.tenant for r in workload(run_id="again")]
    assert {r.tenant for r in workload(run_id="")} <= {"tenant-0", "tenant-1", "tenant-2"}


def test_serve_bench_finds_redis_as_stats_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--router without --redis-url: the Redis of the `pdserve up` on this machine (its state file,
    as `pdserve stats` reads it), but only when that up serves the router being measured."""
    from pdserve.benchmarks.serve import router_redis
    from pdserve.cli.state import write_state

    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    monkeypatch.delenv("PDSERVE_REDIS_NAMESPACE", raising=False)
    assert router_redis("127.0.0.1:50051", None, None) == (None, "pdserve")  # no up on this machine
    url = "redis://pdserve:pw@127.0.0.1:6390/0"
    write_state({"pid": 1, "router": "127.0.0.1:50051", "http": "127.0.0.1:8000", "redis_url": url,
                 "namespace": "ns1"})  # fmt: skip
    assert router_redis("127.0.0.1:50051", None, None) == (url, "ns1")
    assert router_redis("localhost:50051", None, "other") == (url, "other")
    assert router_redis("localhost:8000", None, None, http=True) == (url, "ns1")
    assert router_redis("127.0.0.1:50052", None, None) == (None, "pdserve")  # another service
    assert router_redis("10.0.0.5:50051", None, None)[0] is None
    mine = "redis://:x@10.0.0.9:6379/0"
    assert router_redis("127.0.0.1:50052", mine, None) == (mine, "pdserve")  # the flag wins
    monkeypatch.setenv("PDSERVE_REDIS_URL", mine)
    assert router_redis("127.0.0.1:50051", None, None) == (mine, "pdserve")  # so does the environment


@pytest.mark.slow
def test_soak_bench_counts_outcomes_memory_and_what_stays_held() -> None:
    """One service soaked over both edges at once (every other client on each): requests complete on
    each edge and nothing errs or times out there, some are left mid-stream, and nothing stays held
    afterwards (the pools hold nothing within the bench's 10 s settle bound)."""
    out = bench("soak", "--duration", "6", "--concurrency", "4", "--cancel", "0.5", "--max-tokens", "24",
                "--edge", "both")  # fmt: skip
    assert out["edge"] == "both"
    by_edge = out["requests_by_edge"]
    assert set(by_edge) == {"grpc", "http"}
    for edge, counts in by_edge.items():
        assert counts.get("completed", 0) > 0, (edge, counts)
        assert set(counts) <= {"completed", "left"}, (edge, counts)  # no errors, no timeouts
    assert sum(c.get("left", 0) for c in by_edge.values()) > 0
    assert out["requests"] == {k: sum(c.get(k, 0) for c in by_edge.values()) for k in out["requests"]}
    for proc in ("router", "prefill-0", "decode-0", "gcs_server", "raylet", "redis-server"):
        assert set(out["rss_mb"][proc]) == {"start", "middle", "end"}, (proc, out["rss_mb"])
    assert out["settled_s"] is not None and 0 <= out["settled_s"] <= 10, out["held_at_end"]
    assert out["held_at_end"] == {w: {"blocks_in_use": 0, "leases": 0, "requests": 0, "registered": 0}
                                  for w in ("prefill-0", "decode-0")}  # fmt: skip


def test_soak_bench_clients_alternate_edges_and_refuses_both_with_one_client() -> None:
    from pdserve.benchmarks.soak import client_edges, main

    assert client_edges("both", 5) == ["grpc", "http", "grpc", "http", "grpc"]
    assert client_edges("http", 2) == ["http", "http"]
    with pytest.raises(SystemExit) as exc:
        main(["--edge", "both", "--concurrency", "1"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_links_bench_measures_every_policy_on_every_profile() -> None:
    """`bench links` at its smallest (one warm-up and two measured pairs, a fast and a thin link, no
    settling after the change) on a simulated 3-node cluster: the JSON's shape, every request completed,
    the fixed policies took their one path (no timing asserted)."""
    from pdserve.cluster.simnet import simnet_available

    if reason := simnet_available():
        pytest.skip(reason)
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "links", "--pairs", "2", "--warmup", "1",
                        "--profiles", "fast,thin", "--settle-s", "0", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    if "skipped" in out:  # e.g. no redis-server
        pytest.skip(out["skipped"])
    profiles, pairs = out["profiles"], out["workload"]["pairs"]
    assert profiles == ["fast", "thin"] and set(out["links"]) == set(profiles) and pairs > 0
    kinds = {"cold_64", "cold_768", "warm"}
    assert set(out["results"]) == {"pull", "recompute", "auto"}
    for policy, by_profile in out["results"].items():
        assert set(by_profile) == set(profiles)
        for profile, res in by_profile.items():
            assert len(res["requests"]) == 2 * pairs and all(q["completed"] for q in res["requests"])
            assert all(q["ttft_ms"] is not None and q["t2_ms"] is not None for q in res["requests"])
            s = res["summary"]
            assert set(s) == kinds and s["warm"]["n"] == s["cold_64"]["n"] + s["cold_768"]["n"] == pairs
            pulled = sum(k["pulled"] for k in s.values())
            if policy == "pull":
                assert pulled == 2 * pairs, (profile, s)
            if policy == "recompute":
                assert pulled == 0, (profile, s)
    assert out["requests"] == out["completed"] == 3 * len(profiles) * 2 * pairs
    for profile in profiles:
        assert set(out["verdict"][profile]) == kinds
        for v in out["verdict"][profile].values():
            assert v["best_fixed"] in ("pull", "recompute") and isinstance(v["auto_as_good"], bool)


@pytest.mark.parametrize("http", [True, False], ids=["http", "grpc"])
def test_serve_bench_load_sends_the_api_key(http: bool) -> None:
    """`bench serve --api-key` (or PDSERVE_API_KEY): the load client sends the key as the router asks
    for it, `Authorization: Bearer KEY` over HTTP (on /v1/models too) and the metadata `authorization:
    Bearer KEY` over gRPC; without a key, no such header. Against fakes of the two edges."""
    import asyncio
    import threading
    from concurrent import futures
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import grpc

    from pdserve.benchmarks.serve_load import BenchRequest, _run_load
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.v1 import router_pb2 as pb
    from pdserve.v1 import router_pb2_grpc as pb_grpc

    seen: list[str | None] = []

    class Http(BaseHTTPRequestHandler):
        def _reply(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            self._reply(json.dumps({"data": [{"id": "m"}]}).encode(), "application/json")

        def do_POST(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            chunk = {"choices": [{"text": "a", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip
            self._reply(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

        def log_message(self, *_: object) -> None:
            pass

    class Grpc(pb_grpc.RouterServicer):
        def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: N802
            seen.append(dict(context.invocation_metadata()).get("authorization"))
            yield pb.GenerateResponse(token_ids=[1], finished=True, finish_reason="length",
                                      usage=pb.Usage(prompt_tokens=3, completion_tokens=1))  # fmt: skip

    if http:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Http)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        address, stop = f"127.0.0.1:{server.server_address[1]}", server.shutdown
    else:
        gserver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RouterServicer_to_server(Grpc(), gserver)
        address = f"127.0.0.1:{gserver.add_insecure_port('127.0.0.1:0')}"
        gserver.start()
        stop = lambda: gserver.stop(None)  # noqa: E731
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        for key in ("k3y", None):
            seen.clear()
            records, _ = asyncio.run(_run_load(address, [BenchRequest(0, 0.0, "t", (1, 2, 3))], params, 10.0, None,
                                               http=http, api_key=key))  # fmt: skip
            assert records[0].error is None, records[0].error
            assert seen == [f"Bearer {key}" if key else None] * (2 if http else 1)
    finally:
        stop()


def test_nixl_designs_bench_times_every_design_on_checked_bytes() -> None:
    from pdserve.kvtransfer.nixl import nixl_installed

    if not nixl_installed():
        pytest.skip("NIXL is not installed (pip install 'pdserve[nixl]')")
    out = bench("nixl-designs", "--total-mb", "4", "--block-kb", "256", "--window-mb", "1", "--repeats", "1")
    (r,) = out["results"]  # every pull's bytes were compared with the holder's inside the benchmark
    assert r["total_bytes"] == 4 << 20 and r["block_nbytes"] == 256 << 10 and r["window_bytes"] == 1 << 20
    assert isinstance(r["streaming_zero"], bool)
    designs = {f"{d}/{s}" for d in ("read", "write") for s in ("none", "sealed", "both")}
    assert set(r["designs"]) == {"bare", "bare_write"} | designs
    assert r["designs"]["bare"]["over_bare"] == 1.0
    assert all(d["gbps"] > 0 and d["over_bare"] > 0 for d in r["designs"].values())


def test_nixl_designs_bench_without_the_library_says_so() -> None:
    script = ("import sys; import pdserve.kvtransfer.nixl as n; import pdserve.benchmarks.nixl_designs as b\n"
              "def off(): raise n.NixlUnavailable('NIXL is not installed (test)', permanent=True)\n"
              "b.load_nixl = off; sys.exit(b.main(['--repeats', '1']))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "NIXL is not installed (test)" in r.stderr and not r.stdout


def test_streams_bench_moves_every_token_both_ways() -> None:
    """Both ways deliver every token (the bench fails otherwise) and report each side's CPU."""
    out = bench("streams", "--streams", "3", "--tokens", "5", "--step-ms", "5", "--repeats", "1")
    assert (out["streams"], out["tokens"]) == (3, 5)
    for way in ("per_request", "channel"):
        assert out[way]["actor_us_per_token"] > 0 and out[way]["router_us_per_token"] > 0 and out[way]["wall_s"] > 0
    assert out["actor_us_per_token_ratio"] > 0 and out["router_us_per_token_ratio"] > 0
