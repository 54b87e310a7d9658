"""The public gRPC API: proto <-> dataclasses at the edge, RouterCore inside."""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from tokenizers import Tokenizer

from pdserve.engine.limits import RequestLimits
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.core import RouterCore, WorkerUnavailableError
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc
from pdserve.worker.messages import RequestSpec

logger = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    pass


def _check_unknown(msg: Message, where: str) -> None:
    if len(unknown_fields.UnknownFieldSet(msg)):
        raise InvalidRequest(f"{where}: unknown field(s) in the request (client built for a newer API?)")


def to_spec(req: pb.GenerateRequest, tokenizer: Tokenizer, limits: RequestLimits) -> RequestSpec:
    """Validate a GenerateRequest and convert it; InvalidRequest names the bad field."""
    _check_unknown(req, "GenerateRequest")
    s = req.sampling
    _check_unknown(s, "sampling")
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt: set text or token_ids")
    if which == "text":
        ids = tokenizer.encode(req.text, add_special_tokens=False).ids
    else:
        _check_unknown(req.token_ids, "token_ids")
        ids = list(req.token_ids.ids)
    for name in ("temperature", "top_p"):
        if s.HasField(name) and not math.isfinite(getattr(s, name)):
            raise InvalidRequest(f"sampling.{name}: must be finite")
    try:
        params = SamplingParams(
            max_tokens=s.max_tokens if s.HasField("max_tokens") else 16,
            temperature=s.temperature if s.HasField("temperature") else 0.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else 0,
            seed=s.seed if s.HasField("seed") else None,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        )
    except ValueError as e:
        raise InvalidRequest(f"sampling.{e}") from e
    try:
        limits.check(ids, params.max_tokens)  # the engines' own rule, before any worker spends work
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    # Workers always see a fresh id: a client reusing its own id (a retry) must never share
    # blocks or leases with an earlier request that is still held somewhere.
    return RequestSpec(uuid.uuid4().hex, tuple(ids), params, req.cache_salt or None)


def _parse_generate_request(data: bytes) -> pb.GenerateRequest | InvalidRequest:
    """Deserialize without raising: a malformed message (e.g. text that is not UTF-8) becomes
    an InvalidRequest for the handler to answer with INVALID_ARGUMENT, not an UNKNOWN error."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return InvalidRequest(f"request: not a valid GenerateRequest ({e}); text and cache_salt must be UTF-8")


def add_router_to_server(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Register ``pdserve.v1.Router`` like the generated helper, with the lenient deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Router", handlers),))


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, core: RouterCore, tokenizer: Tokenizer, limits: RequestLimits) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.limits = limits

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if isinstance(request, InvalidRequest):
                raise request
            spec = to_spec(request, self.tokenizer, self.limits)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        detok = IncrementalDetokenizer(self.tokenizer)
        try:
            # aclosing: a cancelled call closes the request's generators now (cancelling the
            # worker tasks, releasing leases, recording stats), not whenever they are collected.
            async with contextlib.aclosing(self.core.generate(spec)) as events:
                async for ev in events:
                    resp = pb.GenerateResponse(
                        request_id=request.request_id or spec.request_id,
                        token_ids=ev.token_ids,
                        text=detok.push(ev.token_ids, final=ev.finished),
                        finished=ev.finished,
                        finish_reason=ev.finish_reason or "",
                    )
                    if ev.usage:
                        resp.usage.CopyFrom(pb.Usage(**ev.usage))
                    if ev.ttft_ms is not None:
                        resp.ttft_ms = ev.ttft_ms
                    yield resp
        except WorkerUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:  # a worker refused the request (e.g. it needs more KV than a pool has)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - a worker failed: say so, keep serving
            logger.exception("request %s failed", spec.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {spec.request_id} failed: {e}")
