"""The holder side of the KV wire: ``KVTransferServicer`` and ``start_transfer_server``.

Why the synchronous gRPC server: serving a pull is blocking work (taking the owner's
``threading`` pool lock, copying block bytes, hashing them), which in ``grpc.aio`` would
need an executor hop per chunk anyway; the sync server runs each stream in its own
pool thread, writes one message at a time (natural back-pressure: the next chunk is
read from the KV tensor only when the previous one was sent, so a slow puller never
makes the holder buffer more than a chunk), and runs termination callbacks on cancel.
It is also independent of any event loop the hosting Ray actor may run.

Abuse bounds (``kvtransfer.guard``): calls beyond ``config.server_threads`` are refused at once,
one peer host streams at most ``config.max_pulls_per_peer`` pulls, and a stalled or overlong
stream is cancelled. With ``config.cluster_secret`` every call must carry a token of a cluster
member signed for that very call (method, request bytes, fresh nonce; ``pdserve.security``): the
``AuthInterceptor`` wraps every registered handler, so each is checked before its request is even
deserialized and no servicer method can skip it. With ``config.tls`` the port speaks TLS only.

Same-host pulls (``config.shm``): ``AttachRegion`` and ``PullRegion`` (``kvtransfer.shm_service``)
through the ``kvtransfer.shm_server.ShmExporter``, started and stopped with the server. NIXL pulls
(``config.nixl``, the library installed): ``PullNixl`` through the ``kvtransfer.nixl_server.NixlExporter``,
likewise.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace

import grpc

from pdserve.engine.cpu_threads import single_threaded_torch
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import InvalidPullError, TransferError
from pdserve.kvtransfer.guard import PullGuard
from pdserve.kvtransfer.nixl import NixlUnavailable
from pdserve.kvtransfer.nixl_server import NixlExporter, NixlServicer
from pdserve.kvtransfer.protoconv import encode_chunk, layout_from_proto, metadata_to_proto
from pdserve.kvtransfer.shm_server import ShmExporter
from pdserve.kvtransfer.shm_service import RegionServicer
from pdserve.kvtransfer.source import BlockSource, PinnedBlocks
from pdserve.kvtransfer.status import abort, clamp
from pdserve.kvtransfer.wire import Chunk
from pdserve.security import AuthInterceptor, ClusterAuth
from pdserve.v1 import kvtransfer_pb2 as pb
from pdserve.v1 import kvtransfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class KVTransferServicer(RegionServicer, NixlServicer, pb_grpc.KVTransferServicer):
    """Converts protos to calls on a ``BlockSource`` and its errors to status codes.

    ``Pull`` yields ``kvtransfer.wire.Chunk``s, not protos: ``add_servicer_to_server``
    registers ``protoconv.encode_chunk`` as its serializer (the PullChunk wire format,
    written with one copy of the payload; see there why not ``SerializeToString``).
    ``shm`` (set by ``start_transfer_server``; None: no same-host transport) serves AttachRegion and
    PullRegion; PullShm (a holder-made memfd per pull, superseded) answers UNIMPLEMENTED. ``nixl``
    (likewise; None: no NIXL transport) serves PullNixl.
    """

    def __init__(self, source: BlockSource, config: TransferConfig | None = None) -> None:
        self.source = source
        self.config = config or source.config
        c = self.config
        self.guard = PullGuard(c.max_pulls_per_peer, c.stall_timeout_s, c.pull_timeout_s)
        self.shm: ShmExporter | None = None
        self.nixl: NixlExporter | None = None

    def GetMetadata(self, request: pb.GetMetadataRequest, context: grpc.ServicerContext) -> pb.GetMetadataResponse:
        meta = self.source.metadata()
        if self.shm is not None:
            meta = replace(meta, host_id=self.shm.host_id, shm_socket=self.shm.socket_path)
        if self.nixl is not None:
            meta = replace(meta, nixl=True)
        return metadata_to_proto(meta)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.source.release(request.lease_id))

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[Chunk]:
        ticket = self.guard.admit(context.peer(), context.cancel)
        if ticket is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too many pulls from this peer at once (at most {self.guard.max_per_peer})")
        try:
            try:
                pinned = self._open(request)
            except TransferError as exc:
                abort(context, exc)
            # Unpin on cancel/deadline too: gRPC may never resume this generator then.
            if not context.add_callback(pinned.close):
                pinned.close()  # the RPC is already over
                return
            with pinned:
                chunk_bytes = clamp(request.max_chunk_bytes, self.config.chunk_bytes)
                max_pieces = clamp(request.max_blocks_per_chunk, self.config.max_blocks_per_chunk)
                for chunk in self.source.chunks(pinned, chunk_bytes, max_pieces):
                    if not context.is_active():
                        return
                    yield chunk
                    ticket.progress()  # the previous chunk was taken: the puller is reading
        finally:
            ticket.close()

    def _open(self, request: pb.PullRequest) -> PinnedBlocks:
        if request.HasField("expected_layout"):
            self.source.check_layout(layout_from_proto(request.expected_layout))
        which = request.WhichOneof("source")
        if which == "lease_id":
            if request.prefix_wait_ms:
                raise InvalidPullError("prefix_wait_ms applies to pulls by hash only")
            return self.source.open_lease(request.lease_id, request.first_block)
        if which == "block_hashes":
            if request.first_block:
                raise InvalidPullError("first_block applies to lease pulls only")
            # A prefix pull waits for blocks still being prefilled, well within the stall watchdog.
            wait_s = min(request.prefix_wait_ms / 1000, self.config.stall_timeout_s / 2)
            return self.source.open_hashes(list(request.block_hashes.hashes), wait_s)
        raise InvalidPullError("pull names no blocks: set lease_id or block_hashes")


def add_servicer_to_server(servicer: KVTransferServicer, server: grpc.Server) -> None:
    """Like the generated ``add_KVTransferServicer_to_server``, with ``encode_chunk`` for Pull."""
    service = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
    handlers = {
        "GetMetadata": grpc.unary_unary_rpc_method_handler(
            servicer.GetMetadata,
            request_deserializer=pb.GetMetadataRequest.FromString,
            response_serializer=pb.GetMetadataResponse.SerializeToString,
        ),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=pb.PullRequest.FromString, response_serializer=encode_chunk
        ),
        "AttachRegion": grpc.unary_unary_rpc_method_handler(
            servicer.AttachRegion,
            request_deserializer=pb.AttachRegionRequest.FromString,
            response_serializer=pb.AttachRegionResponse.SerializeToString,
        ),
        "PullRegion": grpc.unary_unary_rpc_method_handler(
            servicer.PullRegion,
            request_deserializer=pb.PullRegionRequest.FromString,
            response_serializer=pb.PullRegionResponse.SerializeToString,
        ),
        "PullNixl": grpc.unary_unary_rpc_method_handler(
            servicer.PullNixl,
            request_deserializer=pb.PullNixlRequest.FromString,
            response_serializer=pb.PullNixlResponse.SerializeToString,
        ),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release,
            request_deserializer=pb.ReleaseRequest.FromString,
            response_serializer=pb.ReleaseResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)  # as the generated code does (faster dispatch)


class TransferServer:
    """A running KV transfer server plus its reaper thread (leases, expired shm tickets)."""

    def __init__(
        self, server: grpc.Server, host: str, port: int, source: BlockSource, config: TransferConfig,
        servicer: KVTransferServicer, auth: ClusterAuth | None = None,
    ) -> None:  # fmt: skip
        self.server = server
        self.auth = auth  # None: calls are not authenticated (no cluster_secret)
        self.servicer = servicer
        self.host = host
        self.port = port
        self.source = source
        self.config = config
        self.shm = servicer.shm  # None: no same-host transport
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name=f"kv-lease-reaper:{port}", daemon=True)
        self._reaper.start()

    @property
    def address(self) -> str:
        """``host:port`` to give to a ``KVTransferClient`` (a wildcard host is shown as is)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _reap_loop(self) -> None:
        while not self._stopped.wait(self.config.reap_interval_s):
            try:
                self.source.leases.reap()
                if self.shm is not None:
                    self.shm.reap()  # ends the attach and pull tickets nobody redeemed in time
            except Exception:  # the reaper must outlive any one bad lease
                logger.exception("lease reaper failed")

    def stop(self, grace_s: float | None = None, release_leases: bool = True) -> None:
        """Stop serving (in-flight pulls get ``grace_s``), stop the reaper, close the shm socket
        (its directory goes, every region's channel ends and its mapping with it), and by default
        end every lease."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.server.stop(self.config.shutdown_grace_s if grace_s is None else grace_s).wait()
        self._reaper.join()
        self.servicer.guard.close()
        if self.shm is not None:
            self.shm.close()
        if self.servicer.nixl is not None:
            self.servicer.nixl.close()
        if release_leases:
            self.source.close()

    def __enter__(self) -> TransferServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_transfer_server(
    source: BlockSource,
    config: TransferConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    servicer: KVTransferServicer | None = None,
) -> TransferServer:
    """Serve ``source`` on ``host:port`` (``port=0``: any free port, see ``.port``).

    ``servicer`` replaces the default ``KVTransferServicer(source, config)`` (tests wrap it).
    With ``config.shm`` the same-host transport's socket starts too; where it cannot (no boot
    id, no usable directory) the server runs without it and says so in the log.
    Raises ``OSError`` if the address cannot be bound.
    """
    config = config or source.config
    servicer = servicer or KVTransferServicer(source, config)
    if config.shm and servicer.shm is None:
        servicer.shm = _start_shm(config)
    if config.nixl and servicer.nixl is None:
        servicer.nixl = _start_nixl(config, source)
    auth = ClusterAuth(config.cluster_secret, max_nonces=config.auth_max_nonces) if config.cluster_secret else None
    interceptors = [AuthInterceptor(auth)] if auth is not None else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.server_threads, thread_name_prefix="kv-transfer",
                                   initializer=single_threaded_torch),
        options=config.server_options(),
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.server_threads,
    )
    add_servicer_to_server(servicer, server)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if config.tls is not None:
            bound = server.add_secure_port(bind, config.tls.server_credentials())
        else:
            bound = server.add_insecure_port(bind)
    except RuntimeError as exc:  # grpcio raises instead of returning 0 in recent versions
        _close_unbound(servicer)
        raise OSError(f"cannot bind the KV transfer server to {bind}: {exc}") from exc
    if bound == 0:
        _close_unbound(servicer)
        raise OSError(f"cannot bind the KV transfer server to {bind}")
    server.start()
    return TransferServer(server, host, bound, source, config, servicer, auth)


def _start_shm(config: TransferConfig) -> ShmExporter | None:
    try:
        return ShmExporter(config)
    except OSError as exc:
        logger.warning("KV transfer without its same-host transport (gRPC only): %s", exc)
        return None


def _start_nixl(config: TransferConfig, source: BlockSource) -> NixlExporter | None:
    try:
        return NixlExporter(config, source.handover.kv_tensor.tensor, source.layout.block_nbytes)
    except NixlUnavailable as exc:
        logger.warning("KV transfer without its NIXL transport: %s", exc)
        return None


def _close_unbound(servicer: KVTransferServicer) -> None:
    servicer.guard.close()
    if servicer.shm is not None:
        servicer.shm.close()
        servicer.shm = None
    if servicer.nixl is not None:
        servicer.nixl.close()
        servicer.nixl = None
