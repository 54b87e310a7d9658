"""The puller side of the KV wire: ``KVTransferClient``.

Every call carries a deadline (``TransferConfig.*_timeout_s`` unless overridden) and
every failure raises a ``TransferError`` subclass:

=============================  =======================================================
``PeerUnavailableError``       holder unreachable or gone mid-stream (UNAVAILABLE, CANCELLED)
``TransferTimeoutError``       deadline exceeded, or the holder silent for ``holder_silence_s``
``BlockNotFoundError``         unknown/released/expired lease, hash not cached (NOT_FOUND)
``LayoutMismatchError``        KV layout or model differs (FAILED_PRECONDITION, or ``check_compatible``)
``ChecksumError``              a piece's bytes do not match its checksum
``InvalidPullError``           bad arguments or a stream that breaks the chunking contract
``AuthError``                  the holder refused the credentials (UNAUTHENTICATED)
``TransferError``              any other gRPC status (RESOURCE_EXHAUSTED: the holder is at its limit)
=============================  =======================================================

A failed pull leaves the destination blocks partly written; the caller frees them
(the engine does, at ``finish_load(ok=False)``) and recomputes.

Transports: the bytes of a pull come over the gRPC stream, or, from a holder on this host, through
one of this client's staging regions for it (``kvtransfer.shm_pool``, ``kvtransfer.shm_ring``): used
when ``config.shm`` is on and the holder's last ``metadata()`` answer (``check_compatible`` fetches
it) names this host and a Unix socket that exists. A failure of that path before any byte is written
(socket refused, a region or ticket refused or expired, every region in use) falls back to the gRPC
stream for the same pull; one after (a checksum, a stall, the holder's failure) fails the pull and
ends the region it used. Otherwise, with ``config.nixl`` and a holder that offers it, the bytes come
by NIXL (``kvtransfer.nixl_client``), the pull redone over the gRPC stream where NIXL cannot carry
it. The returned ``PullStats.transport`` says which carried the bytes.
``close()`` ends the regions too (both processes unmap them).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence

import grpc
from google.protobuf.message import Message

from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import (
    AuthError,
    BlockNotFoundError,
    InvalidPullError,
    LayoutMismatchError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.kvtransfer.guard import PullGuard
from pdserve.kvtransfer.nixl import NixlUnavailable
from pdserve.kvtransfer.nixl_client import NixlPuller
from pdserve.kvtransfer.protoconv import WireFormatError, decode_chunk, layout_to_proto, metadata_from_proto
from pdserve.kvtransfer.receiver import BlockReceiver
from pdserve.kvtransfer.shm import ShmUnavailable, host_id
from pdserve.kvtransfer.shm_client import RegionsBusy, ShmPuller
from pdserve.kvtransfer.wire import (
    MISSING_HASHES_KEY,
    Chunk,
    LayoutSpec,
    PullStats,
    TransferMetadata,
    describe_mismatch,
)
from pdserve.ratelog import RateLimitFilter
from pdserve.security import ClusterAuth
from pdserve.v1 import kvtransfer_pb2 as pb

logger = logging.getLogger(__name__)
logger.addFilter(RateLimitFilter())  # a peer that keeps refusing must not flood the log

_SERVICE = "/pdserve.v1.KVTransfer/"


def _decode(data: bytes) -> Chunk:
    try:
        return decode_chunk(data)
    except WireFormatError as exc:  # a holder that does not speak the wire
        raise InvalidPullError(f"undecodable chunk: {exc}") from exc


class KVTransferClient:
    """A channel to one holder. Thread-safe; reuse one per peer address; ``close()`` when done.

    Calls are signed with the config's ``cluster_secret`` and go over TLS with its ``tls``: each
    call gets its own token, bound to its method and its request bytes, with a fresh nonce and
    ``caller`` as the signer's name (a worker passes its worker id; default ``<host>/<pid>``).
    At most ``max_pulls_per_peer`` pulls of this client stream at once (the holder's own limit
    per peer); further pulls wait for a slot within their deadline.
    """

    def __init__(self, address: str, config: TransferConfig | None = None, *, caller: str | None = None) -> None:
        self.address = address
        self.config = c = config or TransferConfig()
        options = c.channel_options() + (c.tls.channel_options() if c.tls else [])
        if c.tls is not None:
            self._channel = grpc.secure_channel(address, c.tls.channel_credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        # Requests go out as the bytes they were signed over (no request serializer: each call
        # serializes its message once, in _signed). Pull's messages arrive as bytes and are decoded
        # by protoconv.decode_chunk (zero copy), not upb (two copies of every payload).
        ch = self._channel
        self._get_metadata = ch.unary_unary(_SERVICE + "GetMetadata",
                                            response_deserializer=pb.GetMetadataResponse.FromString)  # fmt: skip
        self._release = ch.unary_unary(_SERVICE + "Release", response_deserializer=pb.ReleaseResponse.FromString)
        self._pull = ch.unary_stream(_SERVICE + "Pull")
        self._auth = ClusterAuth(c.cluster_secret, caller=caller) if c.cluster_secret else None
        self._pull_slots = threading.BoundedSemaphore(c.max_pulls_per_peer)
        self._holder: TransferMetadata | None = None  # the last metadata() answer
        self._dead_socket: str | None = None  # a holder socket that could not be used
        self._watch: PullGuard | None = None  # cancels a stream whose holder went silent
        self._watch_lock = threading.Lock()
        self._closed = False
        self.shm = ShmPuller(c, ch, self._signed, _SERVICE)  # the same-host path and its regions
        self.nixl = NixlPuller(c, ch, self._signed, _SERVICE)  # the NIXL path (its agent made at first use)

    def _signed(self, method: str, request: Message) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        """``request``'s bytes and the metadata signing exactly them for one call of ``method``."""
        body = request.SerializeToString()
        return body, (self._auth.metadata(_SERVICE + method, body) if self._auth else ())

    def close(self) -> None:
        """Close the channel and end the staging regions (in-use ones as their pulls end)."""
        self.shm.close()
        self.nixl.close()
        self._channel.close()
        with self._watch_lock:
            watch, self._watch, self._closed = self._watch, None, True
        if watch is not None:
            watch.close()

    def __enter__(self) -> KVTransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- unary calls ----------------------------------------------------------------------
    def metadata(self, timeout_s: float | None = None) -> TransferMetadata:
        """The holder's identity and KV layout."""
        try:
            body, metadata = self._signed("GetMetadata", pb.GetMetadataRequest())
            msg = self._get_metadata(body, timeout=timeout_s or self.config.metadata_timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        self._holder = meta = metadata_from_proto(msg)
        return meta

    def check_compatible(self, local_layout: KVLayout, fingerprint: str, timeout_s: float | None = None) -> TransferMetadata:
        """Fetch the holder's metadata; raise ``LayoutMismatchError`` naming every field
        (model fingerprint, dtype, block size, ...) in which it differs from the local worker."""
        meta = self.metadata(timeout_s)
        fields = meta.mismatches(local_layout, fingerprint)
        if fields:
            raise LayoutMismatchError(
                f"worker {meta.worker_id!r} is incompatible: {describe_mismatch(fields)}", fields=fields, peer=self.address
            )
        return meta

    def release(self, lease_id: str, timeout_s: float | None = None) -> bool:
        """Release a lease on the holder; False if it was unknown, already released or expired."""
        try:
            body, metadata = self._signed("Release", pb.ReleaseRequest(lease_id=lease_id))
            resp = self._release(body, timeout=timeout_s or self.config.release_timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return resp.released

    # -- pull -----------------------------------------------------------------------------
    def pull_into(
        self,
        kv_tensor: KVTensor,
        dest_block_ids: Sequence[int],
        lease_id: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
        *,
        first_block: int = 0,
        timeout_s: float | None = None,
        prefix_wait_s: float = 0.0,
    ) -> PullStats:
        """Pull blocks straight into ``kv_tensor``: block ``i`` of the pull lands in ``dest_block_ids[i]``.

        Name the blocks by ``lease_id`` (the lease's blocks from ``first_block`` on; the
        lease must have exactly ``len(dest_block_ids)`` of them left) or by
        ``block_hashes`` (one per destination block). The holder checks the local layout.
        ``prefix_wait_s`` (by hash only): pull the longest prefix of the hashes the holder has cached,
        waiting up to that long (capped by the holder) for the first (prompts still being prefilled);
        the stats then say how many blocks landed, in ``dest_block_ids``' first places.
        Returns the stats (``transport``: what carried the bytes); raises a ``TransferError`` on
        any failure (module docstring).
        """
        if (lease_id is None) == (block_hashes is None):
            raise InvalidPullError("pass exactly one of lease_id and block_hashes")
        if first_block and lease_id is None:
            raise InvalidPullError("first_block applies to lease pulls only")
        if prefix_wait_s and block_hashes is None:
            raise InvalidPullError("prefix_wait_s applies to pulls by hash only")
        hashes = [bytes(h) for h in block_hashes] if block_hashes is not None else None

        def receiver_for_pull() -> BlockReceiver:
            first = first_block if lease_id is not None else 0
            return BlockReceiver(kv_tensor, dest_block_ids, first, hashes, prefix=prefix_wait_s > 0)

        receiver = receiver_for_pull()
        request = pb.PullRequest(
            first_block=first_block,
            expected_layout=layout_to_proto(LayoutSpec.from_layout(kv_tensor.layout)),
            max_chunk_bytes=self.config.chunk_bytes,
            max_blocks_per_chunk=self.config.max_blocks_per_chunk,
            prefix_wait_ms=min(max(round(prefix_wait_s * 1000), 1), 1 << 31) if prefix_wait_s > 0 else 0,
        )
        if lease_id is not None:
            request.lease_id = lease_id
        else:
            request.block_hashes.hashes.extend(hashes or [])
        timeout = timeout_s or self.config.pull_timeout_s
        if not self._pull_slots.acquire(timeout=timeout):
            raise TransferTimeoutError(f"no pull slot to {self.address} within {timeout}s", peer=self.address)
        deadline = time.monotonic() + timeout  # both transports' tries together
        call = None
        try:
            socket_path = self._shm_socket()
            if socket_path is not None:
                try:
                    return self.shm.pull(socket_path, request, receiver, deadline)
                except ShmUnavailable as exc:  # nothing written yet: the same pull over gRPC
                    # The log gets the message, not the exception, whose frames may hold views of a region.
                    if exc.permanent:
                        self._dead_socket = socket_path
                        logger.warning("shared-memory pulls from %s off until it advertises another socket: %s",
                                       self.address, str(exc))  # fmt: skip
                    else:
                        level = logging.DEBUG if isinstance(exc, RegionsBusy) else logging.INFO
                        logger.log(level, "shared-memory pull from %s fell back to gRPC: %s", self.address, str(exc))
            elif self._nixl_offered():
                try:
                    return self.nixl.pull(request, receiver, deadline)
                except NixlUnavailable as exc:  # the same pull over gRPC, into blocks written afresh
                    level = logging.WARNING if exc.permanent else logging.INFO
                    logger.log(level, "NIXL pull from %s fell back to gRPC: %s", self.address, str(exc))
                    receiver = receiver_for_pull()
            body, metadata = self._signed("Pull", request)
            call = self._pull(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata)
            return self._stream(call, receiver)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        except TransferError as exc:
            exc.peer = exc.peer or self.address
            raise
        except ValueError as exc:  # grpc: "Cannot invoke RPC on closed channel"
            raise PeerUnavailableError(f"channel to {self.address} is closed: {exc}", peer=self.address) from exc
        finally:
            if call is not None:
                call.cancel()  # no-op once the stream completed; frees the holder's pins otherwise
            self._pull_slots.release()

    def _stream(self, call: grpc.Call, receiver: BlockReceiver) -> PullStats:
        """Every chunk of a Pull stream into ``receiver``, under the watch that cancels it when
        the holder is silent for ``holder_silence_s`` (then a ``TransferTimeoutError``)."""
        ticket = self._silence_watch().admit(self.address, call.cancel)
        assert ticket is not None, "the pull slots keep to the watch's limit"
        try:
            for data in call:
                ticket.progress()
                receiver.accept(_decode(data))
            return receiver.finish()
        except grpc.RpcError as exc:
            if ticket.cancelled is None:
                raise
            raise TransferTimeoutError(f"holder {self.address} sent nothing for "
                                       f"{self.config.holder_silence_s:g}s: {ticket.cancelled}",
                                       peer=self.address) from exc  # fmt: skip
        finally:
            ticket.close()

    def _silence_watch(self) -> PullGuard:
        """The watchdog of this client's streams, started with its first one."""
        with self._watch_lock:
            if self._closed:
                raise ValueError("the client is closed")
            if self._watch is None:
                c = self.config
                self._watch = PullGuard(c.max_pulls_per_peer, c.holder_silence_s, math.inf,
                                        what="a KV pull from holder")  # fmt: skip
                # A client dropped without close() (its last user let go) ends its watchdog too.
                weakref.finalize(self, self._watch.stop)
            return self._watch

    # -- same-host transport --------------------------------------------------------------
    def _shm_socket(self) -> str | None:
        """The holder's Unix socket when its bytes may come by shared memory (module docstring)."""
        holder = self._holder
        if not self.config.shm or holder is None or not holder.shm_socket or holder.shm_socket == self._dead_socket:
            return None
        if not holder.host_id or holder.host_id != host_id() or not os.path.exists(holder.shm_socket):
            return None
        return holder.shm_socket

    def _nixl_offered(self) -> bool:
        """Whether this pull's bytes may come by NIXL: on in the config and offered by the holder."""
        holder = self._holder
        return self.config.nixl and holder is not None and holder.nixl

    # -- errors ---------------------------------------------------------------------------
    def _error(self, exc: grpc.RpcError) -> TransferError:
        """The typed error for a failed call (``exc`` is also a ``grpc.Call``)."""
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
        name = code.name if code is not None else None
        kw = {"peer": self.address, "code": name}
        if code == grpc.StatusCode.NOT_FOUND:
            return BlockNotFoundError(details, missing_hashes=_missing_hashes(exc), **kw)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TransferTimeoutError(f"deadline exceeded: {details}", **kw)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return PeerUnavailableError(f"holder unavailable: {details}", **kw)
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return LayoutMismatchError(details, **kw)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidPullError(details, **kw)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthError(f"holder refused the credentials: {details}", **kw)
        return TransferError(f"{name}: {details}", **kw)


def _missing_hashes(exc: grpc.RpcError) -> list[bytes]:
    if not isinstance(exc, grpc.Call):
        return []
    for key, value in exc.trailing_metadata() or ():
        if key == MISSING_HASHES_KEY and value:
            return [bytes.fromhex(h) for h in str(value).split(",")]
    return []
