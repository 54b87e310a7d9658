"""The public gRPC API: proto <-> dataclasses at the edge, RouterCore inside."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf import unknown_fields
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from tokenizers import Tokenizer

from pdserve.engine.limits import RequestLimits
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.admission import Draining, Overloaded
from pdserve.router.core import RouterCore, WorkerUnavailableError
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc
from pdserve.worker.messages import RequestSpec

logger = logging.getLogger(__name__)


MAX_REQUEST_ID_CHARS = 128  # echoed in every response message
MAX_CACHE_SALT_CHARS = 256
_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 5: "32-bit"}


class InvalidRequest(ValueError):
    pass


def _wire_type(field: FieldDescriptor) -> int:
    if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE):
        return 2
    if field.is_repeated:
        return 2  # packed
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64):
        return 1
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32):
        return 5
    return 0


def _check_unknown(msg: Message, where: str) -> None:
    """Protobuf keeps a field whose wire type does not match the schema as an unknown field: say
    which field that is and what was wrong, else that the field is not in this API."""
    unknown = unknown_fields.UnknownFieldSet(msg)
    for item in unknown:
        field = msg.DESCRIPTOR.fields_by_number.get(item.field_number)
        if field is not None:
            raise InvalidRequest(
                f"{where}.{field.name}: wrong type on the wire ({_WIRE_TYPES.get(item.wire_type, item.wire_type)}, "
                f"expected {_WIRE_TYPES[_wire_type(field)]}); is the client's .proto the same as the server's?"
            )
    if len(unknown):
        numbers = ", ".join(str(item.field_number) for item in unknown)
        raise InvalidRequest(f"{where}: unknown field number(s) {numbers} (client built for a newer API?)")


def to_spec(req: pb.GenerateRequest, tokenizer: Tokenizer, limits: RequestLimits,
            text_tokenizer: Tokenizer | None = None) -> RequestSpec:  # fmt: skip
    """Validate a GenerateRequest and convert it; InvalidRequest names the bad field.

    Tokenizes: call it off the event loop. ``text_tokenizer`` reads special tokens in text as
    plain text (for ``split_special_tokens``).
    """
    _check_unknown(req, "GenerateRequest")
    s = req.sampling
    _check_unknown(s, "sampling")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: {len(req.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}")
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt: {len(req.cache_salt)} characters, at most {MAX_CACHE_SALT_CHARS}")
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt: set text or token_ids")
    if which == "text":
        tok = text_tokenizer if req.split_special_tokens and text_tokenizer is not None else tokenizer
        ids = tok.encode(req.text, add_special_tokens=False).ids
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
        # The same tokenizer, reading special tokens in text as plain text (split_special_tokens).
        self.text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.text_tokenizer.encode_special_tokens = True

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if isinstance(request, InvalidRequest):
                raise request
            # Tokenizing a long text takes a while: never on the loop that serves the other streams.
            spec = await asyncio.to_thread(to_spec, request, self.tokenizer, self.limits, self.text_tokenizer)
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
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (Draining, WorkerUnavailableError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:  # a worker refused the request (e.g. it needs more KV than a pool has)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - a worker failed: say so, keep serving
            logger.exception("request %s failed", spec.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {spec.request_id} failed: {e}")
