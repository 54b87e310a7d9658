"""The public gRPC API: proto <-> dataclasses at the edge, RouterCore inside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from concurrent.futures import Executor

import grpc
from google.protobuf import unknown_fields
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from pdserve.engine.limits import RequestLimits
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.engine.structured import ConstraintError, StructuredOutputsParams, check_tokenizer
from pdserve.engine.structured.request_fields import from_request
from pdserve.engine.tokenizer import ModelTokenizer
from pdserve.router.admission import Draining, Overloaded
from pdserve.router.core import RouterCore, WorkerUnavailableError
from pdserve.router.output import stream_output
from pdserve.router.requests import InvalidRequest, Prompt, prepare, sampling_params
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc
from pdserve.worker.messages import RequestSpec

logger = logging.getLogger(__name__)


MAX_REQUEST_ID_CHARS = 128  # echoed in every response message
_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 5: "32-bit"}


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


def to_spec(req: pb.GenerateRequest, tokenizer: ModelTokenizer, limits: RequestLimits) -> RequestSpec:
    """Validate a GenerateRequest and convert it; InvalidRequest names the bad field.

    Tokenizes: call it off the event loop.
    """
    _check_unknown(req, "GenerateRequest")
    s = req.sampling
    _check_unknown(s, "sampling")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: {len(req.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}")
    which = req.WhichOneof("prompt")
    add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
    if which == "text":
        prompt = Prompt(text=req.text, add_special_tokens=add_special, split_special_tokens=req.split_special_tokens)
    elif which == "token_ids":
        _check_unknown(req.token_ids, "token_ids")
        prompt = Prompt(token_ids=req.token_ids.ids)
    elif which == "chat":
        _check_unknown(req.chat, "chat")
        for i, m in enumerate(req.chat.messages):
            _check_unknown(m, f"chat.messages[{i}]")
        prompt = Prompt(messages=[{"role": m.role, "content": m.content} for m in req.chat.messages])
    else:
        raise InvalidRequest("prompt: set text, token_ids or chat")
    params = sampling_params(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        stop=tuple(s.stop),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        structured_outputs=_constraint(s.structured_outputs, tokenizer),
    )
    return prepare(prompt, params, req.cache_salt, tokenizer, limits)


def _constraint(text: str, tokenizer: ModelTokenizer) -> StructuredOutputsParams | None:
    """``SamplingOptions.structured_outputs`` (vLLM's object as JSON text) checked as the HTTP edge
    checks it; InvalidRequest names what is wrong."""
    if not text:
        return None
    if (why := check_tokenizer(tokenizer)) is not None:
        raise InvalidRequest(f"sampling.structured_outputs: {why}")
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"sampling.structured_outputs: not JSON ({e})") from None
    except RecursionError:  # the client's nesting, past the parser's recursion: its error, not the server's
        raise InvalidRequest("sampling.structured_outputs: not valid JSON here (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("sampling.structured_outputs: must be a JSON object, e.g. {\"regex\": \"[0-9]+\"}")
    try:
        found = from_request(None, obj, {})
    except ConstraintError as e:
        raise InvalidRequest(f"sampling.{e.kind}: {e.reason}") from None
    return None if found is None else found[1]


def _logprobs_pb(lps: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])  # fmt: skip
        for lp in lps
    ]


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


class ClientStalled(Exception):
    """A client took none of its stream's messages within the send deadline."""


class RouterServicer(pb_grpc.RouterServicer):
    """``executor`` tokenizes (None: asyncio's default executor). A client that takes none of its
    stream's messages for ``send_timeout_s`` is cut off (``DEADLINE_EXCEEDED``): its request ends."""

    def __init__(self, core: RouterCore, tokenizer: ModelTokenizer, limits: RequestLimits,
                 executor: Executor | None = None, send_timeout_s: float = 30.0) -> None:  # fmt: skip
        self.core = core
        self.tokenizer = tokenizer
        self.limits = limits
        self.executor = executor
        self.send_timeout_s = send_timeout_s

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Streams the request's responses with ``context.write``, each within the send deadline."""
        try:
            if isinstance(request, InvalidRequest):
                raise request
            # Tokenizing a long text takes a while: never on the loop that serves the other streams.
            loop = asyncio.get_running_loop()
            spec = await loop.run_in_executor(self.executor, to_spec, request, self.tokenizer, self.limits)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        try:
            # aclosing: a cancelled call closes the request's generators now (cancelling the
            # worker tasks, releasing leases, recording stats), not whenever they are collected.
            async with contextlib.aclosing(stream_output(self.core, spec, self.tokenizer)) as chunks:
                async for c in chunks:
                    u = c.usage
                    resp = pb.GenerateResponse(
                        request_id=request.request_id or spec.request_id,
                        token_ids=c.token_ids,
                        text=c.text,
                        finished=c.finished,
                        finish_reason=c.finish_reason or "",
                        usage=pb.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                                       transferred_tokens=u.transferred_tokens,
                                       completion_tokens=u.completion_tokens),  # fmt: skip
                        logprobs=_logprobs_pb(c.logprobs) if c.logprobs else None,
                    )
                    if c.ttft_ms is not None:
                        resp.ttft_ms = c.ttft_ms
                    try:
                        await asyncio.wait_for(context.write(resp), self.send_timeout_s)
                    except asyncio.TimeoutError:
                        stalled = f"the client took none of its stream for {self.send_timeout_s:g} s"
                        raise ClientStalled(stalled) from None
                    except Exception as e:  # noqa: BLE001 - the call is over (the client left): closing ends its request
                        logger.debug("request %s: its stream's write failed, the call is over (%r)", spec.request_id, e)
                        return
        except ClientStalled as e:  # its request is closed by now: slot and blocks are back
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (Draining, WorkerUnavailableError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:  # a worker refused the request (e.g. it needs more KV than a pool has)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception:  # noqa: BLE001 - a worker failed: say so, keep serving
            # Details (paths, hosts, tracebacks) go to the log, not to the client.
            logger.exception("request %s failed", spec.request_id)
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"request {spec.request_id} failed (the server log has the details)")
