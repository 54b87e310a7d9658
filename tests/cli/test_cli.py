"""The ``pdserve`` command line, run as a user would (subprocesses, real Redis, real Ray)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM, SamplingParams
from pdserve.engine.model import make_tiny_model
from pdserve.kvindex.config import IndexConfig, tenant_digest
from pdserve.kvindex.embedded import EmbeddedRedis
from pdserve.kvindex.registry import WorkerRegistry
from pdserve.kvindex.stats import StatsRecorder
from tests.support import REPO
from tests.support.polling import wait_until
from tests.support.redis import unique_namespace
from tests.support.service import shared_ray
from tests.support.sockets import descendants, listeners


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def ray_address() -> str:
    """The address of the test process's shared Ray, for an ``up`` whose test is not about starting
    a Ray (``--ray-address``: it joins that cluster as it would a user's)."""
    import ray

    shared_ray()
    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    r = pdserve("make-tiny-model", str(out))
    assert r.returncode == 0, r.stderr
    return str(out)


def test_make_tiny_model_is_deterministic(model_dir: str, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(model_dir) / name).read_bytes() == (again / name).read_bytes()


def test_generate_offline_json_matches_engine(model_dir: str) -> None:
    r = pdserve("generate", "--model", model_dir, "--prompt-ids", "5,6,7,8,9", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"token_ids", "text", "finish_reason", "usage", "ttft_ms"}
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens", "transferred_tokens"}
    ref = LLM(model_dir, num_blocks=16).generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6))[0]
    assert out["token_ids"] == ref.token_ids and out["usage"]["prompt_tokens"] == 5
    assert out["usage"]["completion_tokens"] == 6
    # Without --json: the text, then a line with the token ids (a random model's text says little).
    r = pdserve("generate", "--model", model_dir, "--prompt-ids", "5,6,7,8,9", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n").splitlines()[-1] == (
        f"[length; 6 tokens: {','.join(map(str, ref.token_ids))}; prompt 5, cached 0, transferred 0]"
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "--model", "/nonexistent", "--prompt", "hi"], "config.json"),
        (["generate", "--model", "MODEL", "--prompt", ""], "prompt"),
        (["generate", "--model", "MODEL", "--prompt-ids", "1,x"], "--prompt-ids"),
        (["generate", "--model", "MODEL", "--prompt-ids", "99999"], "vocabulary"),
        (["generate", "--model", "MODEL", "--prompt", "hi", "--top-p", "2"], "top_p"),
        (["generate", "--model", "MODEL", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["stats", "--redis-url", "redis://127.0.0.1:1/0"], "cannot read stats"),
        # TLS flags that would be ignored (the call going out in plaintext) are refused.
        (["generate", "--router", "127.0.0.1:1", "--tls-key", "k.pem", "--prompt", "hi"], "without --tls-ca"),
        (["generate", "--model", "MODEL", "--tls-ca", "ca.pem", "--prompt", "hi"], "--tls-ca goes with --router"),
        # Values no service can run with, refused before anything starts.
        (["up", "--prefill-cpus", "inf"], "must be a finite number > 0, got inf"),
        (["up", "--port", "47301", "--http-port", "47301"], "must differ"),
        (["up", "--ray-address", "127.0.0.1:1", "--model", "MODEL"], "no Ray at 127.0.0.1:1"),
    ],
)
def test_errors_are_messages_with_nonzero_exit(model_dir: str, args: list[str], needle: str) -> None:
    r = pdserve(*[model_dir if a == "MODEL" else a for a in args])
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_stats_reads_ratio_of_sums_from_redis(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    ns = unique_namespace()
    cfg = IndexConfig(redis_server.url, namespace=ns)
    rec = StatsRecorder(cfg, "w1")
    rec.record({"requests": 1, "prompt_tokens": 100, "prefix_hit_tokens": 90}, cache_salt="a")
    rec.record({"requests": 1, "prompt_tokens": 300, "prefix_hit_tokens": 0}, cache_salt="b")
    assert rec.flush(10)
    rec.close()
    with WorkerRegistry(cfg) as registry:  # where w1 runs, as a worker registers itself
        assert registry.register("w1", {"role": "decode", "grpc_address": "10.0.0.7:50100"})
    r = pdserve("stats", "--redis-url", redis_server.url, "--namespace", ns, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["hit_rate"] == pytest.approx(90 / 400)  # not the mean of 0.9 and 0.0
    assert stats["workers"]["w1"]["prompt_tokens"] == 400 and len(stats["tenants"]) == 2
    w1 = stats["registry"]["w1"]
    assert (w1["role"], w1["node"], w1["address"]) == ("decode", "10.0.0.7", "10.0.0.7:50100")
    assert 0 <= w1["heartbeat_age_s"] < 60
    text = pdserve("stats", "--redis-url", redis_server.url, "--namespace", ns, "--tenant", "acme=a")
    assert "worker w1 (decode on 10.0.0.7)" in text.stdout
    assert "hit_rate=22.5%" in text.stdout
    # Rates over the last minute and five minutes follow each row's totals; a tenant whose salt
    # was given is shown by name (the other by its digest).
    assert "tenant acme " in text.stdout and f"tenant {tenant_digest('b')} " in text.stdout
    assert text.stdout.count("last 60s:") == 4 and text.stdout.count("last 300s:") == 4
    w = json.loads(pdserve("stats", "--redis-url", redis_server.url, "--namespace", ns, "--json", "--window",
                           "30").stdout)["windows"]["30"]  # fmt: skip
    assert w["cluster"]["prompt_tokens"] == 400 and w["hit_rate"] == pytest.approx(90 / 400)
    # A tenant file: comments and blank lines skipped; a bad line is named, its content (maybe a
    # salt) never shown.
    tenants = tmp_path / "tenants.txt"
    tenants.write_text("# names\n\n   # indented comment\nacme=a\n")
    r = pdserve("stats", "--redis-url", redis_server.url, "--namespace", ns, "--tenant-file", str(tenants))
    assert r.returncode == 0 and "tenant acme " in r.stdout
    tenants.write_text("acme=a\nvery-secret-salt\n")
    r = pdserve("stats", "--redis-url", redis_server.url, "--namespace", ns, "--tenant-file", str(tenants))
    assert r.returncode == 2 and f"{tenants} line 2: a tenant is NAME=SALT" in r.stderr
    assert "very-secret-salt" not in r.stderr + r.stdout
    r = pdserve("stats", "--redis-url", redis_server.url, "--namespace", ns, "--window", "7200")
    assert r.returncode == 2 and "between 1 and 3600 seconds" in r.stderr
    # The namespace can come from the environment, as it does for `pdserve up`.
    env = dict(os.environ, PDSERVE_REDIS_NAMESPACE=ns, PDSERVE_REDIS_URL=redis_server.url)
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "stats", "--json"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=REPO)  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["hit_rate"] == pytest.approx(90 / 400)


@pytest.mark.slow
def test_up_prints_ready_lines_serves_and_drains_on_sigterm(model_dir: str, tmp_path: Path) -> None:
    # Ray's token file as Ray itself leaves it (umask 022): world-readable. `up` must make it private.
    token = tmp_path / "ray" / "auth_token"
    token.parent.mkdir()
    token.write_text(secrets.token_hex(32))
    token.chmod(0o644)
    env = dict(os.environ, PDSERVE_STATE_DIR=str(tmp_path / "state"), RAY_AUTH_TOKEN_PATH=str(token))
    env.pop("RAY_AUTH_TOKEN", None)
    log = tmp_path / "stderr.log"  # a file, not a pipe: the log stream must never block the service
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli.main", "up", "--model", model_dir, "--port", "0", "--http-port", "0",
         "--log-json"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        router_line = proc.stdout.readline().strip()
        http_line = proc.stdout.readline().strip()
        metrics_line = proc.stdout.readline().strip()
        redis_line = proc.stdout.readline().strip()
        state_line = proc.stdout.readline().strip()
        assert router_line.startswith("router listening on "), router_line
        assert redis_line.startswith("redis at redis://pdserve:***@127.0.0.1:"), redis_line  # password redacted
        state = tmp_path / "state" / "up.json"
        assert state_line == f"state in {state} (pdserve stats reads the Redis URL there)"
        assert state.stat().st_mode & 0o777 == 0o600
        # A local cluster exposes nothing beyond this machine: every listening socket of `up` and
        # the processes below it (GCS, raylet, Ray's agents and metrics export port, the workers'
        # gRPC and KV-transfer ports, the router, redis-server) is bound to loopback.
        sockets = listeners(descendants(proc.pid))
        commands = {s.command for s in sockets}
        assert "gcs_server" in commands and "raylet" in commands, sockets
        exposed = [s for s in sockets if not s.loopback]
        assert not exposed, f"listening beyond loopback: {exposed}"
        assert token.stat().st_mode & 0o777 == 0o600
        address = router_line.removeprefix("router listening on ")
        r = pdserve("generate", "--router", address, "--prompt", "hello router", "--max-tokens", "4", "--json")
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)["token_ids"]) == 4
        assert http_line.startswith("http listening on 127.0.0.1:"), http_line
        # curl on the SSE stream of the OpenAI-compatible API: chunks, then "data: [DONE]".
        http = http_line.removeprefix("http listening on ")
        body = json.dumps({"model": Path(model_dir).name, "prompt": "hello http", "max_tokens": 3, "stream": True})
        r = subprocess.run(["curl", "-sN", f"http://{http}/v1/completions", "-H", "Content-Type: application/json",
                            "-d", body], capture_output=True, text=True, timeout=60)  # fmt: skip
        events = [line.removeprefix("data: ") for line in r.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.stdout
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "text_completion" for c in chunks)
        # One scrape shows the router's and both workers' metrics.
        assert metrics_line == f"metrics at http://{http}/metrics", metrics_line
        scrape = subprocess.run(["curl", "-s", f"http://{http}/metrics"], capture_output=True, text=True, timeout=60)
        fams = {f.name: f for f in text_string_to_metric_families(scrape.stdout)}
        assert sum(s.value for s in fams["pdserve_requests"].samples if s.name == "pdserve_requests_total") == 2
        assert {s.labels["worker"] for s in fams["pdserve_num_requests_running"].samples} == {"prefill-0", "decode-0"}
        # `stats` finds the embedded Redis (and its password) through the state file alone.
        r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "stats", "--json"], capture_output=True,
                           text=True, timeout=120, cwd=REPO, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["cluster"]["prompt_tokens"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        out = proc.stdout.read()
        assert "draining: new requests refused" in out and "stopping" in out
        assert not state.exists()
        # --log-json: every process logs JSON lines to up's stderr, one access-log line per request.
        records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        access = [r for r in records if r.get("name") == "pdserve.access"]
        assert len(access) == 2, log.read_text()[-3000:]
        assert {a["status"] for a in access} == {"length"} and {a["generated_tokens"] for a in access} == {4, 3}
        assert all(a["tenant"] == "-" and a["ttft_ms"] > 0 and "request_id" in a for a in access)
        assert any(r.get("name", "").startswith("pdserve.worker") for r in records)  # the workers' lines too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_sigterm_while_up_starts_stops_what_it_started(model_dir: str, tmp_path: Path) -> None:
    """A service manager stopping `up` while its workers load: the start is given up and everything
    it started stops (Ray, redis-server and its directory, the workers), exit 130; not Ray's own
    handler ending the process on the spot (a C++ stack dump, exit 134, everything left behind)."""
    env = dict(os.environ, PDSERVE_STATE_DIR=str(tmp_path / "state"))
    log = tmp_path / "stderr.log"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli.main", "up", "--model", model_dir, "--port", "0",
                             "--http-port", "off"], stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO,
                            env=env)  # fmt: skip
    try:
        assert wait_until(lambda: "ray: local cluster" in log.read_text() or proc.poll() is not None, timeout=120)
        started = descendants(proc.pid)
        assert len(started) > 3, log.read_text()  # Ray's processes, redis-server
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
        assert "SIGTERM received" not in log.read_text()
        assert wait_until(lambda: _all_ended(started - {proc.pid}), timeout=60), log.read_text()[-3000:]
        owned = [d for d in Path(tempfile.gettempdir()).glob("pdserve-redis-*")
                 if (d / "owner").exists() and (d / "owner").read_text().split()[0] == str(proc.pid)]  # fmt: skip
        assert owned == [] and not (tmp_path / "state" / "up.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_while_up_stops_skips_the_drain_and_still_cleans_up(model_dir: str, tmp_path: Path) -> None:
    """The operator presses Ctrl-C twice: the drain is skipped, the stop runs to its end (a third
    signal cannot cut it short) and the state file, which holds the Redis password, goes."""
    env = dict(os.environ, PDSERVE_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli.main", "up", "--model", model_dir, "--port", "0",
                             "--http-port", "off"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=REPO, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        assert any(line.startswith("state in ") for line in lines)
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert any(line.startswith("draining") for line in lines)
        proc.send_signal(signal.SIGINT)  # no more draining (130), unless the drain had nothing to wait for (0)
        proc.send_signal(signal.SIGINT)  # while it stops: ignored
        assert proc.wait(timeout=120) in (0, 130)
        assert not (tmp_path / "state" / "up.json").exists()
        assert wait_until(lambda: _all_ended(started - {proc.pid}), timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _all_ended(pids: set[int]) -> bool:
    """No process of ``pids`` runs (gone, or a zombie)."""
    return not any(_proc_state(p) not in ("", "Z") for p in pids)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


@pytest.mark.slow
def test_demo_runs_and_reports_hit_rates() -> None:
    r = pdserve("demo", "--max-tokens", "24", timeout=600)  # answers cut short: the hits are what is tested
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cluster hit rate:" in r.stdout
    rate = float(r.stdout.split("cluster hit rate:")[1].split("%")[0])
    assert rate > 20.0  # users share system prompts, second turns extend first ones: a cold cache would be 0
    assert "tenant " in r.stdout and "ttft_ms" in r.stdout and "cached = prompt tokens served from" in r.stdout
    assert "Paris" in r.stdout  # the real model answers
    assert "second turns hit the prefix cache: 6/6" in r.stdout
    assert "cached tokens although school-a had just sent the same system prompt and question: nothing shared" \
        in " ".join(r.stdout.split())


def test_bad_config_and_paths_are_messages_not_tracebacks(tmp_path: Path) -> None:
    not_object = tmp_path / "list.json"
    not_object.write_text("[1]")
    wrong_type = tmp_path / "prefill.json"
    wrong_type.write_text('{"prefill": "2"}')
    empty_model = tmp_path / "empty"
    empty_model.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["up", "--config", str(not_object)], "must be a JSON object"),
        (["up", "--config", str(wrong_type)], "prefill must be an integer, got '2'"),
        (["up", "--model", str(empty_model)], "config.json not found"),
        (["make-tiny-model", str(a_file / "tiny")], "Not a directory"),
        (["demo", "--max-tokens", "0"], "a positive integer, got '0'"),
    ]
    for args, needle in cases:
        r = pdserve(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_redis_url_that_cannot_work_stops_up_in_one_line(redis_server: EmbeddedRedis, model_dir: str) -> None:
    """Credentials the server refuses, or a URL that does not parse, end `up` before anything starts,
    in one line that hides the password: not 'ready' with an index that never works."""
    port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
    cases = [
        (f"redis://pdserve:wrong-secret@127.0.0.1:{port}/0", "refused the credentials"),
        (f"redis://127.0.0.1:{port}/0", "refused the credentials"),  # no password at all
        ("redis://pdserve:wrong-secret@127.0.0.1:notaport/0", "bad Redis URL"),
    ]
    for url, needle in cases:
        r = pdserve("up", "--model", model_dir, "--redis-url", url)
        assert r.returncode == 2, (url, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr and "wrong-secret" not in r.stderr, (url, r.stderr)


def test_bench_help_lists_the_benchmarks() -> None:
    r = pdserve("bench", "--help")
    assert r.returncode == 0, r.stderr
    for name in ("kvcache", "engine", "transfer", "prefix", "serve"):
        assert f"  {name} " in r.stdout
    r = pdserve("bench")  # no name: the same listing, and a listing is not an error
    assert r.returncode == 0, r.stderr
    assert "  serve " in r.stdout and r.stderr == ""
    r = pdserve("bench", "serve", "--help")
    assert r.returncode == 0 and "--http" in r.stdout


@pytest.mark.slow
def test_a_worker_that_cannot_start_is_named_in_one_line(model_dir: str, ray_address: str, tmp_path: Path) -> None:
    """A worker's start-up failure (here its disk tier's directory is missing) ends ``up`` with a
    message naming the worker and the cause, not the driver's traceback."""
    r = pdserve("up", "--model", model_dir, "--prefill", "1", "--decode", "1", "--port", "0", "--http-port", "off",
                "--ray-address", ray_address, "--namespace", unique_namespace(), "--kv-offload-gb", "0.01", "--kv-offload-disk-gb", "0.01",
                "--kv-offload-disk-dir", str(tmp_path / "missing"), timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve: error: worker ") and "failed to start: ValueError: cannot create the disk tier" in last
    assert 'launcher.py", line' not in r.stderr and 'up.py", line' not in r.stderr  # no driver traceback


@pytest.mark.slow
def test_workers_that_fit_no_node_are_refused_with_what_the_nodes_offer(model_dir: str, ray_address: str) -> None:
    """--decode-resources names a resource no node offers: ``up`` says so at once, with what the
    nodes do offer, instead of waiting for Ray to place the worker (it never would)."""
    r = pdserve("up", "--model", model_dir, "--port", "0", "--http-port", "off", "--namespace", unique_namespace(),
                "--ray-address", ray_address, "--decode-resources", '{"decode_node": 1}', timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve: error: no node of the Ray cluster can host a decode worker: it needs "
                           "CPU=1, decode_node=1; the nodes offer 127.0.0.1: CPU="), last  # fmt: skip
    assert 'launcher.py", line' not in r.stderr


@pytest.mark.parametrize("args", [["stats", "--json"], ["bench"]], ids=["stats", "bench-listing"])
def test_a_reader_that_leaves_early_ends_the_command_quietly(redis_server: EmbeddedRedis, args: list[str]) -> None:
    """`pdserve stats --json | head -1`: the reader is gone before the output is written. The
    command ends as a process killed by SIGPIPE would (141), without a traceback or an error line."""
    if args[0] == "stats":
        args = [*args, "--redis-url", redis_server.url, "--namespace", unique_namespace()]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left: every write to the pipe fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)  # fmt: skip
    finally:
        os.close(write_end)
    assert r.returncode == 141, r.stderr
    assert r.stderr == ""  # no "Broken pipe", no "Exception ignored ... BrokenPipeError"
    # The same through a shell's pipe into `head -1`, as the report had it: exit 0 or 141 (whether
    # head left before the write is a race), never 2 or 120, and nothing on stderr.
    shell = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -1 >/dev/null; echo "status=$?" >&2', "sh",
                            sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True,
                           timeout=120, cwd=REPO)  # fmt: skip
    assert shell.stderr.strip() in ("status=0", "status=141"), shell.stderr
