"""One soak request over HTTP (server-sent events, raw asyncio streams so that a client can hang
up with a FIN or a TCP reset at any point) or over gRPC (``grpc.aio``, cancelled by the client)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from dataclasses import dataclass

import grpc

from pdserve.cli.client import auth_metadata, build_request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import router_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class SoakResult:
    outcome: str  # completed | left | http_<status> | grpc_<CODE> | timeout | connection_error
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0


def _body(model: str, text: str, salt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "cache_salt": salt}).encode()  # fmt: skip


async def http_client(where: str, model: str, text: str, salt: str, max_tokens: int, leave_after: int | None,
                      rst: bool, timeout_s: float, api_key: str | None = None) -> SoakResult:  # fmt: skip
    """POST /v1/completions with ``stream``; ``leave_after``: hang up after that many events
    (``rst``: with a TCP reset); ``api_key``: sent as ``Authorization: Bearer KEY``."""
    host, port = where.rsplit(":", 1)
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return SoakResult("connection_error")
    try:
        body = _body(model, text, salt, max_tokens)
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {where}\r\nContent-Type: application/json\r\n{auth}"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)  # fmt: skip
        return await asyncio.wait_for(_read_events(reader, leave_after, t0), timeout_s)
    except asyncio.TimeoutError:
        return SoakResult("timeout")
    except OSError:
        return SoakResult("connection_error")
    finally:
        if rst:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()


async def _read_events(reader: asyncio.StreamReader, leave_after: int | None, t0: float) -> SoakResult:
    status = await reader.readline()
    code = status.split()[1].decode() if len(status.split()) > 1 else "?"
    if code != "200":
        return SoakResult(f"http_{code}")
    events = 0
    ttft = 0.0
    while True:
        if leave_after is not None and events >= leave_after:
            return SoakResult("left")
        line = await reader.readline()
        if not line:
            return SoakResult("connection_error")  # the server ended the stream without [DONE]
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            return SoakResult("completed", ttft, (time.perf_counter() - t0) * 1000)
        if b'"error"' in line:
            return SoakResult("stream_error")
        events += 1
        if events == 1:
            ttft = (time.perf_counter() - t0) * 1000


async def grpc_client(where: str, model: str, text: str, salt: str, max_tokens: int, leave_after: int | None,
                      rst: bool, timeout_s: float, api_key: str | None = None) -> SoakResult:  # fmt: skip
    """Router/Generate; ``leave_after``: cancel after that many messages (``rst`` has no gRPC
    meaning: a cancel is a RST_STREAM either way); ``api_key``: sent as ``authorization`` metadata."""
    del model, rst
    t0 = time.perf_counter()
    request = build_request(text, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)
    async with grpc.aio.insecure_channel(where) as channel:
        call = pb_grpc.RouterStub(channel).Generate(request, timeout=timeout_s, metadata=auth_metadata(api_key))
        events = 0
        ttft = 0.0
        if leave_after == 0:  # gone before the first token
            await asyncio.sleep(0.05)
            call.cancel()
            return SoakResult("left")
        try:
            async for _ in call:
                events += 1
                if events == 1:
                    ttft = (time.perf_counter() - t0) * 1000
                if leave_after is not None and events >= leave_after:
                    call.cancel()
                    return SoakResult("left")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return SoakResult("timeout")
            return SoakResult(f"grpc_{exc.code().name}")
        return SoakResult("completed", ttft, (time.perf_counter() - t0) * 1000)
