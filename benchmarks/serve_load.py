"""Open-loop load for ``pdserve bench serve``: the seeded multi-tenant workload, a client that sends
each request at its scheduled time and timestamps every streamed message, and the latency summary.

With an API key (``api_key``), every request carries it as the router requires it: the HTTP header
``Authorization: Bearer KEY`` (also on ``/v1/models``) or the gRPC metadata ``authorization: Bearer
KEY``; without one, neither is sent."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from pdserve.cli.client import auth_metadata, build_request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc

NUM_BYTE_TOKENS = 256  # prompts are byte token ids (no special tokens)


def log(msg: str) -> None:
    """Progress line on stderr (stdout stays clean for ``--json``)."""
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------
def new_run_id() -> str:
    """A fresh run id: 8 random hex digits (the default prefix of a run's tenant salts)."""
    return secrets.token_hex(4)


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes and seed of the open-loop multi-tenant workload.

    ``run_id`` prefixes every tenant's ``cache_salt`` (``<run_id>/tenant-<t>``; ``""``: bare
    ``tenant-<t>``). The prompts depend on ``seed`` alone, so two runs with different ids send
    the same tokens under salts the cluster has never seen: each run starts cold against a
    service that is still warm from the last one. Reusing an id reruns warm on purpose.
    """

    num_requests: int
    rate: float  # requests/s (Poisson arrivals)
    tenants: int
    system_len: tuple[int, int]
    question_len: tuple[int, int]
    max_tokens: int
    seed: int = 0
    run_id: str = field(default_factory=new_run_id)

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.tenants < 1 or self.max_tokens < 1:
            raise ValueError("num_requests, tenants and max_tokens must be >= 1")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number, got {self.rate}")


@dataclass(frozen=True)
class BenchRequest:
    """One scheduled request of the workload."""

    index: int
    arrival_s: float  # offset from the start of the run
    tenant: str  # its cache_salt
    prompt: tuple[int, ...]


def make_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The seeded request list: Poisson arrival offsets, tenant, system prompt + question."""
    rng = random.Random(cfg.seed)
    prefix = f"{cfg.run_id}/" if cfg.run_id else ""
    systems = {
        f"{prefix}tenant-{t}": [rng.randrange(NUM_BYTE_TOKENS) for _ in range(rng.randint(*cfg.system_len))]
        for t in range(cfg.tenants)
    }
    names = list(systems)
    arrivals = random.Random(cfg.seed + 1)
    out, t = [], 0.0
    for i in range(cfg.num_requests):
        tenant = rng.choice(names)
        question = [rng.randrange(NUM_BYTE_TOKENS) for _ in range(rng.randint(*cfg.question_len))]
        out.append(BenchRequest(i, t, tenant, tuple(systems[tenant] + question)))
        t += arrivals.expovariate(cfg.rate)
    return out


# ---------------------------------------------------------------------------------------
# Load generation (grpc.aio: arrivals never wait on responses)
# ---------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds since the run's start)."""

    index: int
    tenant: str
    scheduled_s: float
    sent_s: float = 0.0
    message_times: list[float] = field(default_factory=list)  # receipt of each message with tokens
    message_tokens: list[int] = field(default_factory=list)  # tokens in each of those messages
    done_s: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.message_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.message_times[0] - self.sent_s if self.message_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.done_s - self.sent_s if self.done_s is not None else None

    def itls_s(self) -> list[float]:
        """Per output token after the first: the gap before its message, split over the message's tokens."""
        out: list[float] = []
        for k in range(1, len(self.message_times)):
            gap = self.message_times[k] - self.message_times[k - 1]
            n = self.message_tokens[k]
            out.extend([gap / n] * n)
        return out


class ProgressBar:
    """A text bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, total, width
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def update(self, done: int, errors: int) -> None:
        filled = int(self.width * done / self.total)
        text = (f"[bench serve] {self.label:<10} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{self.total} done, {errors} errors")
        if self.tty:
            sys.stderr.write("\r" + text + ("\n" if done == self.total else ""))
            sys.stderr.flush()
        else:
            decile = 10 * done // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                print(text, file=sys.stderr, flush=True)


async def _send(
    stub: pb_grpc.RouterStub, req: BenchRequest, params: SamplingParams, t0: float, timeout_s: float,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> RequestRecord:
    """Stream one request (with the call ``metadata``: the API key), timestamping every message;
    errors are recorded, not raised."""
    rec = RequestRecord(req.index, req.tenant, req.arrival_s)
    request = build_request(list(req.prompt), params, cache_salt=req.tenant, request_id=f"bench-{req.index}")
    rec.sent_s = time.perf_counter() - t0
    try:
        resp: pb.GenerateResponse
        async for resp in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            now = time.perf_counter() - t0
            if resp.token_ids:
                rec.message_times.append(now)
                rec.message_tokens.append(len(resp.token_ids))
            if resp.HasField("usage"):
                u = resp.usage
                rec.usage = {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                             "transferred_tokens": u.transferred_tokens}
            if resp.finished:
                rec.finish_reason = resp.finish_reason
        rec.done_s = time.perf_counter() - t0
        if rec.finish_reason is None:
            rec.error = "stream ended without a finished message"
        elif rec.output_tokens != params.max_tokens:
            rec.error = f"{rec.output_tokens} tokens, expected {params.max_tokens} (ignore_eos)"
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001 - one failed request must not stop the run
        rec.error = repr(e)
    return rec


async def _send_http(
    client: httpx.AsyncClient, model: str, req: BenchRequest, params: SamplingParams, t0: float, timeout_s: float
) -> RequestRecord:
    """``_send`` through the OpenAI-compatible API: a streamed completion of the same token ids.
    vLLM's ``continuous_usage_stats`` puts the token count in every chunk (a chunk may carry
    several tokens: text waits for whole characters)."""
    rec = RequestRecord(req.index, req.tenant, req.arrival_s)
    body = {"model": model, "prompt": list(req.prompt), "max_tokens": params.max_tokens,
            "temperature": params.temperature, "ignore_eos": params.ignore_eos, "cache_salt": req.tenant,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    rec.sent_s = time.perf_counter() - t0
    seen = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"]["message"]
                    return rec
                usage = chunk.get("usage") or {}
                count = usage.get("completion_tokens", seen)
                if count > seen:
                    rec.message_times.append(now)
                    rec.message_tokens.append(count - seen)
                    seen = count
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    rec.usage = {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": details.get("cached_tokens", 0),
                                 "transferred_tokens": details.get("transferred_tokens", 0)}  # fmt: skip
                for choice in chunk.get("choices", ()):
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
        rec.done_s = time.perf_counter() - t0
        if rec.finish_reason is None:
            rec.error = "stream ended without a finish reason"
        elif rec.output_tokens != params.max_tokens:
            rec.error = f"{rec.output_tokens} tokens, expected {params.max_tokens} (ignore_eos)"
    except Exception as e:  # noqa: BLE001 - one failed request must not stop the run
        rec.error = repr(e)
    return rec


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers that carry the router's API key (empty: no key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _model_name(client: httpx.AsyncClient) -> str:
    """The served model's name from ``/v1/models``; RuntimeError naming the status when it is refused
    (a 401 there means the API key is missing or wrong)."""
    resp = await client.get("/v1/models", timeout=30)
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {resp.status_code}: {resp.text[:200]}")
    return str(resp.json()["data"][0]["id"])


async def _run_load(
    address: str, workload: list[BenchRequest], params: SamplingParams, timeout_s: float,
    on_done: Callable[[RequestRecord], None] | None, http: bool = False, api_key: str | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time, over gRPC or (``http``) the OpenAI-compatible API
    at ``address``, each with ``api_key`` when given; returns the records and the wall time."""
    async with contextlib.AsyncExitStack() as stack:
        if http:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=f"http://{address}", limits=limits, headers=auth_headers(api_key)))
            send = functools.partial(_send_http, client, await _model_name(client))
        else:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
            await asyncio.wait_for(channel.channel_ready(), timeout=30)
            send = functools.partial(_send, pb_grpc.RouterStub(channel), metadata=auth_metadata(api_key))
        t0 = time.perf_counter()
        tasks = []
        for req in workload:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(req, params, t0, timeout_s))
            if on_done is not None:
                task.add_done_callback(lambda t: on_done(t.result()))
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
        wall = max((r.done_s for r in records if r.done_s is not None), default=time.perf_counter() - t0)
    return records, wall


def run_load(
    address: str, workload: list[BenchRequest], params: SamplingParams, timeout_s: float, label: str,
    http: bool = False, api_key: str | None = None,
) -> tuple[list[RequestRecord], float]:
    """``_run_load`` with a progress bar on stderr."""
    bar = ProgressBar(label, len(workload))
    state = {"done": 0, "errors": 0}

    def on_done(rec: RequestRecord) -> None:
        state["done"] += 1
        state["errors"] += rec.error is not None
        bar.update(state["done"], state["errors"])

    return asyncio.run(_run_load(address, workload, params, timeout_s, on_done, http, api_key))


def warm_up(address: str, params: SamplingParams, prompt_len: int, n: int, salt: str, timeout_s: float,
            http: bool = False, api_key: str | None = None) -> int:  # fmt: skip
    """``n`` sequential requests under a salt of their own; returns how many failed."""
    rng = random.Random(12345)
    reqs = [BenchRequest(i, 0.0, salt, tuple(rng.randrange(NUM_BYTE_TOKENS) for _ in range(prompt_len)))
            for i in range(n)]

    async def go() -> int:
        failed = 0
        for r in reqs:
            records, _ = await _run_load(address, [r], params, timeout_s, None, http, api_key)
            failed += records[0].error is not None
        return failed

    return asyncio.run(go())


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Latency percentiles, throughput, errors and usage-based hit rate of one run."""
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [x for r in ok for x in r.itls_s()]
    prompt = sum(r.usage.get("prompt_tokens", 0) for r in ok)
    cached = sum(r.usage.get("cached_tokens", 0) for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    lags = [r.sent_s - r.scheduled_s for r in records]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "request_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "ttft_ms_mean": _ms(statistics.fmean(ttft)) if ttft else None,
        "itl_ms_p50": _ms(percentile(itl, 50)),
        "itl_ms_p99": _ms(percentile(itl, 99)),
        "itl_ms_mean": _ms(statistics.fmean(itl)) if itl else None,
        "e2e_ms_p50": _ms(percentile(e2e, 50)),
        "e2e_ms_p99": _ms(percentile(e2e, 99)),
        "multi_token_messages": sum(1 for r in ok for n in r.message_tokens if n > 1),
        "max_send_lag_ms": _ms(max(lags)) if lags else None,
        "max_in_flight": _max_in_flight(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "transferred_tokens": sum(r.usage.get("transferred_tokens", 0) for r in ok),
        "requests_with_transfer": sum(1 for r in ok if r.usage.get("transferred_tokens", 0) > 0),
        "usage_hit_rate": cached / prompt if prompt else 0.0,
    }


def _max_in_flight(records: list[RequestRecord]) -> int:
    """Most requests outstanding at once (sent, not yet answered)."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.done_s, -1) for r in records if r.done_s is not None])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
