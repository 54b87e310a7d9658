"""The router as a Ray actor: serves the public gRPC API (grpc.aio) and the OpenAI-compatible HTTP
API (uvicorn) on the actor's event loop, both over one RouterCore; with ``router.api_key``, both
require it (``router/auth.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from pdserve.engine.config import EngineConfig
from pdserve.engine.limits import RequestLimits
from pdserve.engine.model.checkpoint import load_tokenizer
from pdserve.engine.model.config import ModelConfig
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.logs import configure_text_logging
from pdserve.metrics import merge_families, redis_outages, render
from pdserve.ratelog import RateLimitFilter
from pdserve.router.auth import ApiKeyInterceptor
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.http import OpenAIServer, ServedModel, build_app, build_metrics_app
from pdserve.router.http_limits import EdgeState, HttpLimits, guarded_protocol
from pdserve.router.openai_protocol import MAX_PROMPTS
from pdserve.router.ray_workers import RayWorkers
from pdserve.router.servicer import RouterServicer, add_router_to_server
from pdserve.v1 import router_pb2

# A scrape waits this long for the workers; Prometheus' default scrape timeout is 10 s.
METRICS_SCRAPE_TIMEOUT_S = 3.0

_SERVICES = (
    router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)

# uvicorn logs a line per malformed request or failed app call: a client must not flood the log.
_uvicorn_log = logging.getLogger("uvicorn.error")
if not any(isinstance(f, RateLimitFilter) for f in _uvicorn_log.filters):
    _uvicorn_log.addFilter(RateLimitFilter(burst=5, interval_s=60.0))


class Router:
    """``engine`` is the workers' engine config (model, cache, scheduler limits); ``kv_blocks``
    the smallest worker pool, when known, so oversize requests are refused before any work.

    A launcher may create the router before its workers have reported their pools (its process
    then starts while they load the model) and give the pool size with ``set_kv_blocks``
    before ``start``.

    ``log_level``: this process logs compact TEXT lines at that level (pdserve/logs.py); None
    leaves its logging as it is."""

    def __init__(
        self,
        config: RouterConfig,
        engine: EngineConfig,
        index: IndexConfig,
        prefill: dict,
        decode: dict,
        kv_blocks: int | None = None,
        log_level: str | None = None,
    ) -> None:
        if log_level is not None:
            configure_text_logging(log_level)
        assert engine.model is not None
        self._model_config = ModelConfig.from_path(engine.model)
        self._engine = engine
        self.tokenizer = load_tokenizer(engine.model, engine.chat_template)
        _ = self.tokenizer.token_bound  # computed once, now, rather than in the first request
        self.workers = RayWorkers(prefill, decode, config.decode_channel_ttl_s)
        self.core = RouterCore(config, engine.cache, self.workers, PrefixLookup(index), StatsRecorder(index))
        # Tokenization (and chat rendering) of both edges runs here: bounded, and apart from the
        # default executor that serves the prefix lookups, so long prompts cannot delay those.
        self.tokenize_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="pdserve-tokenize")
        self.config = config
        self._build_apis(kv_blocks)
        http_limits = HttpLimits(config.max_request_bytes, config.http_header_timeout_s, config.http_body_timeout_s,
                                 config.http_max_connections, config.http_max_buffered_bytes,
                                 config.send_timeout_s)  # fmt: skip
        self.http_edge = EdgeState(http_limits, config.access_log)  # the HTTP API's connections and bodies
        self.metrics_edge = EdgeState(http_limits, config.access_log)  # those of /metrics on a port of its own
        self.server: grpc.aio.Server | None = None
        self.health: health.aio.HealthServicer | None = None
        # Uvicorn servers: the HTTP API, and /metrics alone on a port of its own when asked for.
        self._servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    def _build_apis(self, kv_blocks: int | None) -> None:
        """The gRPC servicer and the HTTP API over the request limits ``kv_blocks`` implies."""
        config, engine = self.config, self._engine
        assert engine.model is not None
        limits = RequestLimits.for_engine(self._model_config, engine, kv_blocks)
        self.servicer = RouterServicer(self.core, self.tokenizer, limits, self.tokenize_pool, config.send_timeout_s)
        model = ServedModel(config.served_model_name or served_name(engine.model), frozenset({engine.model}),
                            limits.usable_len)  # fmt: skip
        self.openai = OpenAIServer(self.core, self.tokenizer, limits, model, lambda: not self.core.admission.draining,
                                   self.tokenize_pool, min(MAX_PROMPTS, config.max_in_flight_per_tenant))  # fmt: skip

    async def set_kv_blocks(self, kv_blocks: int) -> None:
        """The smallest worker pool, known once the workers are up. Must come before any ``start``."""
        if self.server is not None or self._servers:
            raise RuntimeError("set_kv_blocks after the router started serving")
        self._build_apis(kv_blocks)

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0 = any free port); returns the bound port."""
        options = [
            ("grpc.so_reuseport", 0),  # no SO_REUSEPORT: a taken port must fail to bind, not be shared
            ("grpc.max_receive_message_length", self.config.max_request_bytes),  # refused before it is read
        ]
        # With an API key, every call but health checking must carry it (router/auth.py).
        interceptors = [ApiKeyInterceptor(self.config.api_key)] if self.config.api_key else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        add_router_to_server(self.servicer, server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*_SERVICES, reflection.SERVICE_NAME), server)
        try:
            if self.config.tls is not None:
                bound = server.add_secure_port(f"{host}:{port}", self.config.tls.server_credentials())
            else:
                bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:  # recent grpcio raises instead of returning 0
            raise OSError(f"cannot bind the router to {host}:{port}: {exc}") from exc
        if bound == 0:
            raise OSError(f"cannot bind the router to {host}:{port}")
        await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        return bound

    async def start_http(self, host: str, port: int) -> int:
        """Serve the OpenAI-compatible API (and ``/metrics``) on ``host:port`` (0 = any free port),
        with the router's TLS settings; returns the bound port."""
        app = build_app(self.openai, self.http_edge, self.metrics_text, self.config.api_key)
        return await self._start_uvicorn(app, self.http_edge, host, port, "the HTTP API")

    async def start_metrics(self, host: str, port: int) -> int:
        """Serve ``/metrics`` alone on ``host:port`` (for a router without the HTTP API, or to keep
        scrapes apart from it), with the router's TLS settings; returns the bound port."""
        return await self._start_uvicorn(build_metrics_app(self.metrics_text), self.metrics_edge, host, port,
                                         "/metrics")  # fmt: skip

    async def _start_uvicorn(self, app: object, edge: EdgeState, host: str, port: int, what: str) -> int:
        # IPPROTO_TCP spelled out: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
        # whose proto says TCP, and with it on, each streamed event after the headers would wait for
        # the client's delayed ACK (40 ms).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted router re-binds at once
        try:
            sock.bind((host, port))  # here, so a taken port fails now and port 0 reports its pick
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind {what} to {host}:{port}: {exc}") from exc
        try:
            return await self._serve(app, edge, sock, host, port, what)
        except BaseException:
            sock.close()
            raise

    async def _serve(self, app: object, edge: EdgeState, sock: socket.socket, host: str, port: int, what: str) -> int:
        tls = self.config.tls
        config = uvicorn.Config(
            app,
            # h11, with a cap on connections and a deadline on request heads (router/http_limits.py)
            http=guarded_protocol(edge),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.ca_file if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.ca_file else ssl.CERT_NONE,
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        self._servers.append((server, task))
        while not server.started:  # started, or failed and gone
            if task.done():
                task.result()
                raise OSError(f"{what} on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def _set_health(self, status: int) -> None:
        assert self.health is not None
        for name in (*_SERVICES, ""):
            await self.health.set(name, status)

    async def ping(self) -> bool:
        return self.server is not None

    async def metrics_families(self) -> list[Metric]:
        """The whole cluster's metric families: the router's own and every worker's (asked over
        Ray at once), with ``pdserve_worker_up`` saying which workers answered."""
        scraped = await self.workers.scrape(METRICS_SCRAPE_TIMEOUT_S)
        up = GaugeMetricFamily("pdserve_worker_up", "1 when the worker answered this scrape.", labels=["worker"])
        for wid, fams in scraped.items():
            up.add_metric([wid], 0.0 if fams is None else 1.0)
        own = [*self.core.metrics.families(), redis_outages("router", self.core.redis_outages()), up,
               *self.http_edge.families()]
        return merge_families([own, *(f for f in scraped.values() if f is not None)])

    async def metrics_text(self) -> bytes:
        """``metrics_families`` in the Prometheus text format (``GET /metrics``)."""
        return render(await self.metrics_families())

    async def http_state(self) -> dict:
        """The HTTP API's open connections, request body bytes held and refusals by reason."""
        return self.http_edge.snapshot()

    async def admission_state(self) -> dict[str, int]:
        """Requests running and waiting for a slot (both edges together)."""
        return {"in_flight": self.core.admission.in_flight, "queued": self.core.admission.queued}

    async def drain(self, timeout_s: float | None = None) -> int:
        """Graceful stop, first half: health says NOT_SERVING, new requests are refused
        (UNAVAILABLE), and those in flight get ``timeout_s`` (default ``drain_timeout_s``) to
        finish. Returns how many were still running when the time was up."""
        if self.health is not None:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        admission = self.core.admission
        admission.drain()
        await admission.wait_idle(self.config.drain_timeout_s if timeout_s is None else timeout_s)
        return admission.in_flight

    async def stop(self) -> None:
        """Stop serving, then write the counters still queued and close the index clients."""
        try:
            servers, self._servers = self._servers, []
            for server, _ in servers:
                server.should_exit = True
            for _, task in servers:
                with contextlib.suppress(Exception):  # a server that failed has nothing left to stop
                    await task
        finally:
            await self._stop_grpc()

    async def _stop_grpc(self) -> None:
        try:
            if self.server is not None:
                await self.server.stop(grace=1.0)
                self.server = None
        finally:
            self.core.close()
            self.workers.close()
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


def served_name(model: str) -> str:
    """The name the HTTP API serves a model as, by default: its directory's or file's name."""
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name
