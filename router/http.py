"""The OpenAI-compatible HTTP edge (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, vLLM's
/tokenize, /detokenize, /version and /ping, /health (and /metrics).

Like the gRPC edge it converts at the edge and iterates the router core (``stream_output``);
neither edge knows the other. A request with ``n`` choices (or several prompts) runs as that many
router requests, merged into one response (each body and chunk names the served model, and one
``created`` time per request). Errors are OpenAI error objects: 400 bad input (also a POST body
not declared ``application/json``, as vLLM answers it), 404 an unknown model, 408 a body that does
not arrive in time, 413 a body over ``max_request_bytes``, 429 overload, 503 draining, no worker,
or the edge's own limits (``router/http_limits.py``, ``router/body_limit.py``). A client that
disconnects cancels its requests (streaming or not): their KV is released at once. Every refusal
writes an access-log line; repeated error logs are rate-limited (``pdserve.ratelog``). With an API
key every path but /health, /ping and /metrics needs ``Authorization: Bearer KEY``
(``router/auth.py``: 401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pdserve.engine.limits import RequestLimits
from pdserve.engine.structured import check_tokenizer
from pdserve.engine.tokenizer import ModelTokenizer
from pdserve.kvindex.config import tenant_digest
from pdserve.metrics import CONTENT_TYPE_LATEST
from pdserve.ratelog import RateLimitFilter
from pdserve.router.admission import Draining, Overloaded
from pdserve.router.auth import ApiKeyAuth
from pdserve.router.body_limit import BodyLimit
from pdserve.router.core import RouterCore, WorkerUnavailableError
from pdserve.router.http_limits import CORE_HAS_IT, TENANT, EdgeState, RejectionLog
from pdserve.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
)  # fmt: skip
from pdserve.router.openai_responses import (
    ChoiceState,
    LogprobFormat,
    ResponseHead,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    error_body,
    new_id,
    now,
    request_usage,
    role_chunk,
    usage_body,
    usage_chunk,
)  # fmt: skip
from pdserve.router.output import Chunk, stream_output
from pdserve.router.requests import InvalidRequest, Prompt, make_spec, tokenize
from pdserve.worker.messages import RequestSpec

logger = logging.getLogger(__name__)
# A client decides how often a request fails: at most 5 alike (tracebacks included) a minute.
logger.addFilter(RateLimitFilter(burst=5, interval_s=60.0))


def _error(status: int, message: str, type_: str, code: int | str | None = None, param: str | None = None) -> Response:
    return JSONResponse(error_body(message, type_, code if code is not None else status, param), status_code=status)


_FIELD = re.compile(r"^([A-Za-z_\\][\w.\[\]\\]*)(?::| must | has )")  # \ of a key named escaped


# vLLM's answer to a POST body that is not declared JSON (a 400, as vLLM sends it).
JSON_ONLY = "Unsupported Media Type: Only 'application/json' is allowed"


async def _json_body(request: Request) -> None:
    """A request body's ``Content-Type`` is ``application/json`` (parameters such as ``charset``
    aside), as vLLM requires; InvalidRequest (400) otherwise, before the body is validated."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise InvalidRequest(JSON_ONLY)


def _validation_error(errors: Sequence[Any]) -> Response:
    """The 400 of a body FastAPI could not take: its first error, ``param`` the field it names (a
    check of the whole body names its field first in its message; JSON that does not parse
    names none, and says where in the message)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        where = [p for p in first.get("loc", ()) if p != "body"]
        why = (first.get("ctx") or {}).get("error", "")
        at = f" at character {where[0]}" if where else ""
        return _error(400, f"The body is not valid JSON{at}: {why or first.get('msg')}", "invalid_request_error", 400)
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if not loc:  # a check of the whole body: its message starts with the field
        return _bad_request(str(first.get("msg", "invalid request")))
    return _error(400, f"{loc}: {first.get('msg', 'invalid request')}", "invalid_request_error", 400,
                  loc)  # not FastAPI's 422  # fmt: skip


def _bad_request(message: str) -> Response:
    field = _FIELD.match(message)
    return _error(400, message, "invalid_request_error", 400, field.group(1) if field else None)


def _error_for(exc: BaseException) -> Response:
    if isinstance(exc, InvalidRequest):
        return _bad_request(str(exc))
    if isinstance(exc, Overloaded):
        return _error(429, str(exc), "rate_limit_error", "rate_limit_exceeded")
    if isinstance(exc, (Draining, WorkerUnavailableError)):
        return _error(503, str(exc), "service_unavailable_error", 503)
    if isinstance(exc, ValueError):  # a worker refused the request: its message, not a remote traceback
        return _bad_request(str(exc).strip().splitlines()[-1])
    # Details (paths, hosts, tracebacks) go to the log, not to the client.
    ref = new_id("err")
    logger.error("request failed (%s)", ref, exc_info=exc)
    return _error(500, f"internal error ({ref}; the server log has the details)", "internal_error", 500)


JSON_ONLY_BODY = Depends(_json_body)


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients send as "model"
    aliases: frozenset[str]  # also accepted (the path the model was loaded from)
    max_model_len: int


CHUNKS_AHEAD = 16  # chunks of one stream read ahead of the client (_merged)


async def _merged(streams: list[AsyncIterator[Chunk]], leaders: list[int | None]) -> AsyncIterator[tuple[int, Chunk]]:
    """Chunks of several streams as they come, tagged with the stream's index. Stream ``i`` starts
    once stream ``leaders[i]`` sent its first chunk (None: at once): the n choices of one prompt
    wait for the first one's prefill and find its blocks cached instead of computing them n times.
    The first failure ends it (raised here); closing it cancels every stream still running. A stream
    is read at most ``CHUNKS_AHEAD`` chunks ahead of the consumer: what a slow client has not taken
    waits where its request's events come in (``router/decode_channel.py``), which bounds it."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()
    started = [asyncio.Event() for _ in streams]
    room = [asyncio.Semaphore(CHUNKS_AHEAD) for _ in streams]

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        end: BaseException | None = None
        try:
            if (leader := leaders[i]) is not None:
                await started[leader].wait()
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for chunk in stream:
                    started[i].set()
                    await room[i].acquire()
                    queue.put_nowait((i, chunk))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, whatever it is
            end = e
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            started[i].set()  # a failed leader must not leave its followers waiting
            queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item if isinstance(item, Exception) else RuntimeError(f"choice {i} ended: {item!r}")
            else:
                room[i].release()
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class OpenAIServer:
    """``executor`` tokenizes (off the event loop, in bounded threads of its own); ``max_choices``
    caps prompts x n of one request (each choice is a request that takes an admission slot)."""

    def __init__(self, core: RouterCore, tokenizer: ModelTokenizer, limits: RequestLimits, model: ServedModel,
                 is_serving: Callable[[], bool], executor: Executor, max_choices: int) -> None:  # fmt: skip
        self.core = core
        self.executor = executor
        self.max_choices = max_choices
        self.tokenizer = tokenizer
        self.limits = limits
        self.model = model
        self.is_serving = is_serving
        self.fmt = LogprobFormat(tokenizer)

    def _check_model(self, name: str) -> Response | None:
        if name == self.model.name or name in self.model.aliases:
            return None
        return _error(404, f"The model `{name}` does not exist; this server serves `{self.model.name}`",
                      "invalid_request_error", "model_not_found", "model")  # fmt: skip

    def _specs(self, req: _Common, prompts: list[Prompt], max_tokens: int | None, logprobs: int | None) -> list[RequestSpec]:
        """Tokenize and check every choice of every prompt (runs off the event loop)."""
        if (constraint := req.constraint()) is not None and (why := check_tokenizer(self.tokenizer)) is not None:
            raise InvalidRequest(f"{constraint[0]}: {why}")
        specs = []
        for prompt in prompts:
            ids = tokenize(prompt, self.tokenizer, self.limits.max_model_len)
            mt = max_tokens if max_tokens is not None else self.limits.max_tokens_for(len(ids))
            specs += [make_spec(ids, req.params(mt, logprobs, j), req.cache_salt, self.limits) for j in range(req.n)]
        return specs

    async def models(self) -> dict:
        card = {"id": self.model.name, "object": "model", "created": now(), "owned_by": "pdserve",
                "root": self.model.name, "max_model_len": self.model.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def tokenize(self, req: TokenizeRequest) -> Response:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``, the ids a
        completion or chat of the same prompt would get, tokenized as theirs are (the same pool of
        threads, the same refusal of a prompt that leaves no room to generate within
        ``max_model_len``)."""
        if req.model is not None and (bad := self._check_model(req.model)) is not None:
            return bad
        try:
            prompt = req.to_prompt()
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self.executor, tokenize, prompt, self.tokenizer, self.limits.max_model_len)
        except InvalidRequest as e:
            return _error_for(e)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids,
                                "token_strs": None}  # fmt: skip
        if req.return_token_strs:
            body["token_strs"] = [self.tokenizer.raw.id_to_token(t) for t in ids]
        return JSONResponse(body)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """vLLM's ``/detokenize``: ``{"prompt": text}`` of at most ``max_model_len`` ids of the
        vocabulary, special tokens included (decoded in the tokenizer's threads)."""
        if req.model is not None and (bad := self._check_model(req.model)) is not None:
            return bad
        limit, vocab = self.limits.max_model_len, self.limits.vocab_size
        if len(req.tokens) > limit:
            return _bad_request(f"tokens: {len(req.tokens)} ids, at most max_model_len={limit}")
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                return _bad_request(f"tokens[{i}]: {t} is outside the vocabulary [0, {vocab})")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self.executor, lambda: self.tokenizer.decode(req.tokens, False))
        return JSONResponse({"prompt": text})

    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        return await self._serve(req, http, lambda: req.prompts(), req.max_tokens, req.logprobs, chat=False)

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        return await self._serve(req, http, lambda: [req.prompt()], req.requested_max_tokens, req.num_logprobs,
                                 chat=True)  # fmt: skip

    async def _serve(self, req: _Common, http: Request, prompts: Callable[[], list[Prompt]], max_tokens: int | None,
                     logprobs: int | None, chat: bool) -> Response:  # fmt: skip
        if req.cache_salt is not None:  # for the access log, should the edge refuse it
            http.scope[TENANT] = tenant_digest(req.cache_salt)
        if (bad := self._check_model(req.model)) is not None:
            return bad
        try:
            plist = prompts()
            if len(plist) * req.n > self.max_choices:
                raise InvalidRequest(f"n: {len(plist)} prompt(s) x n={req.n} choices, at most {self.max_choices} "
                                     "in one request")  # fmt: skip
            loop = asyncio.get_running_loop()
            specs = await loop.run_in_executor(self.executor, self._specs, req, plist, max_tokens, logprobs)
        except InvalidRequest as e:
            return _error_for(e)
        http.scope[CORE_HAS_IT] = True  # from here the core writes each request's access-log line
        # The served name, whichever alias the request used (as vLLM answers); one time for every chunk.
        head = ResponseHead(new_id("chatcmpl" if chat else "cmpl"), self.model.name)
        leaders = [None if i % req.n == 0 else i - i % req.n for i in range(len(specs))]
        merged = _merged([stream_output(self.core, s, self.tokenizer) for s in specs], leaders)
        states = [ChoiceState(keep=not req.stream) for _ in specs]
        if req.stream:
            return await self._stream(req, http, head, merged, states, logprobs is not None, chat)
        return await self._collect(req, http, head, merged, states, logprobs is not None, chat)

    async def _collect(self, req: _Common, http: Request, head: ResponseHead, merged: AsyncIterator[tuple[int, Chunk]],
                       states: list[ChoiceState], logprobs: bool, chat: bool) -> Response:  # fmt: skip
        async def run() -> None:
            async with contextlib.aclosing(merged):  # type: ignore[type-var]
                async for i, chunk in merged:
                    states[i].add(chunk)

        try:
            done, _ = await _unless_disconnected(http, run())
            if not done:
                return Response(status_code=499)  # nobody is there to read it
        except Exception as e:  # noqa: BLE001 - answered as an error object
            return _error_for(e)
        # Off the event loop: a body of many choices with logprobs takes a while to build and encode.
        build = chat_body if chat else completion_body
        return await asyncio.to_thread(lambda: JSONResponse(build(head, states, req.n, self.fmt, logprobs)))

    async def _stream(self, req: _Common, http: Request, head: ResponseHead, merged: AsyncIterator[tuple[int, Chunk]],
                      states: list[ChoiceState], logprobs: bool, chat: bool) -> Response:  # fmt: skip
        # The first chunk decides the status: a request refused before it started (overload,
        # no worker) gets a proper 4xx/5xx, not a 200 stream that carries an error.
        try:
            done, first = await _unless_disconnected(http, anext(merged, None))
        except Exception as e:  # noqa: BLE001
            await merged.aclose()  # type: ignore[attr-defined]
            return _error_for(e)
        if not done:  # gone while it waited for a slot or its prefill: end the request now
            await merged.aclose()  # type: ignore[attr-defined]
            return Response(status_code=499)
        make = chat_chunk if chat else completion_chunk
        obj = "chat.completion.chunk" if chat else "text_completion"
        continuous = req.continuous_usage

        async def events() -> AsyncIterator[str]:
            async with contextlib.aclosing(merged):  # type: ignore[type-var]
                try:
                    pending = [first] if first is not None else []
                    async for item in _chain(pending, merged):
                        i, chunk = item
                        if chat and not states[i].started:  # the role alone, then the text
                            states[i].started = True
                            yield _sse(role_chunk(head, i, usage_body([chunk.usage], 0) if continuous else None))
                        states[i].add(chunk)
                        if continuous and chunk.token_ids:  # vLLM's: this choice's usage so far
                            body = make(head, i, states[i], chunk, self.fmt, logprobs)
                            yield _sse({**body, "usage": usage_body([chunk.usage], chunk.usage.completion_tokens)})
                        elif chunk.text or chunk.finished or chunk.logprobs:
                            yield _sse(make(head, i, states[i], chunk, self.fmt, logprobs))
                    if req.include_usage:
                        yield _sse(usage_chunk(head, obj, request_usage(states, req.n)))
                except Exception as e:  # noqa: BLE001 - the status is sent: report it in the stream
                    logger.warning("stream %s failed: %s", head.id, e)
                    yield _sse(json.loads(_error_for(e).body))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for x in first:
        yield x
    async for x in rest:
        yield x


async def _unless_disconnected(http: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """``(True, result)`` once ``work`` is done (its exception propagates), or ``(False, None)``
    with ``work`` cancelled when the client goes away first: its requests end, their KV is freed."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


def package_version() -> str:
    """pdserve's version as installed (``GET /version``)."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_app(server: OpenAIServer, state: EdgeState, metrics: Callable[[], Awaitable[bytes]] | None = None,
              api_key: str | None = None) -> FastAPI:  # fmt: skip
    """The HTTP API, within ``state``'s limits on request bodies (``BodyLimit``), writing an
    access-log line for each refusal; with ``metrics`` (the Prometheus exposition of the cluster)
    also ``GET /metrics``; with ``api_key`` every path but /health, /ping and /metrics needs it
    (``ApiKeyAuth``, checked before the body is read)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc.errors())

    @app.exception_handler(InvalidRequest)
    async def refused(_request: Request, exc: InvalidRequest) -> Response:  # a dependency's: _json_body
        return _error_for(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:  # unknown route, wrong method
        response = _error(exc.status_code, str(exc.detail), "invalid_request_error", exc.status_code)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> Response:
        return _error_for(exc)

    # vLLM's /ping (GET and POST) is /health under another name.
    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        return Response(status_code=200 if server.is_serving() else 503)

    if metrics is not None:
        _add_metrics_route(app, metrics)

    @app.get("/v1/models")
    async def models() -> dict:
        return await server.models()

    @app.post("/v1/completions", dependencies=[JSON_ONLY_BODY])
    async def completions(req: CompletionRequest, http: Request) -> Response:
        return await server.completions(req, http)

    @app.post("/v1/chat/completions", dependencies=[JSON_ONLY_BODY])
    async def chat(req: ChatCompletionRequest, http: Request) -> Response:
        return await server.chat(req, http)

    _add_vllm_routes(app, server)
    inner: Any = BodyLimit(app, state)
    if api_key is not None:
        inner = ApiKeyAuth(inner, api_key, state)
    return RejectionLog(inner, state)  # type: ignore[return-value]


def _add_vllm_routes(app: FastAPI, server: OpenAIServer) -> None:
    """vLLM's routes beside the OpenAI API: /tokenize, /detokenize, /version."""
    version = {"version": package_version()}

    @app.post("/tokenize", dependencies=[JSON_ONLY_BODY])
    async def tokenize_route(req: TokenizeRequest) -> Response:
        return await server.tokenize(req)

    @app.post("/detokenize", dependencies=[JSON_ONLY_BODY])
    async def detokenize_route(req: DetokenizeRequest) -> Response:
        return await server.detokenize(req)

    @app.get("/version")
    async def version_route() -> dict:
        return version


def build_metrics_app(metrics: Callable[[], Awaitable[bytes]]) -> FastAPI:
    """``GET /metrics`` alone (and ``/health``); every other path is an OpenAI-style 404."""
    app = FastAPI(title="pdserve metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", exc.status_code)

    _add_metrics_route(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def _add_metrics_route(app: FastAPI, metrics: Callable[[], Awaitable[bytes]]) -> None:
    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await metrics(), media_type=CONTENT_TYPE_LATEST)
