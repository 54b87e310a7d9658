"""The puller's same-host path for one holder: ``ShmPuller`` (used by ``KVTransferClient``).

It keeps the client's ``RegionPool`` for the holder's current Unix socket (a new socket, a holder
restarted at the same address, ends the regions of the old one) and runs one pull through it:
a region from the pool (made on demand: AttachRegion for a ticket, then the region handed over the
socket), PullRegion for the pull's ticket, then the ring (``shm_ring.read_pull``) into the pull's
``BlockReceiver``. Both calls are made through the client's channel and signing, so they carry the
same credentials and deadline as a Pull; each wait for the holder (a call, the next slot) is also
bounded by ``holder_silence_s``.

Failure contract: ``ShmUnavailable`` before any byte is written (the caller pulls over gRPC; a
``RegionsBusy`` when every region carries a pull), else the call's ``grpc.RpcError`` or a
``TransferError``, the pull then failed. A region comes back to the pool after a pull that left it
intact (done, refused, or failed before the GO); one whose pull failed mid-way is ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import Message

from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.protoconv import pull_offer_from_proto
from pdserve.kvtransfer.receiver import BlockReceiver
from pdserve.kvtransfer.shm import PullOffer, ShmUnavailable, host_id
from pdserve.kvtransfer.shm_pool import Region, RegionPool
from pdserve.kvtransfer.shm_ring import read_pull
from pdserve.kvtransfer.wire import PullStats
from pdserve.v1 import kvtransfer_pb2 as pb

Signer = Callable[[str, Message], tuple[bytes, tuple[tuple[str, str], ...]]]


class RegionsBusy(ShmUnavailable):
    """Every region of the pool carries a pull: this one goes over gRPC (no failure, not logged as one)."""


class ShmPuller:
    """``signed(method, request)``: the request's bytes and the metadata that signs them for one
    call; ``channel``: the client's channel to the holder. Thread-safe; ``close()`` ends the regions
    (those in use as their pulls end)."""

    def __init__(self, config: TransferConfig, channel: grpc.Channel, signed: Signer, service: str) -> None:
        self.config = config
        self._signed = signed
        self._attach_region = channel.unary_unary(service + "AttachRegion",
                                                  response_deserializer=pb.AttachRegionResponse.FromString)  # fmt: skip
        self._pull_region = channel.unary_unary(service + "PullRegion",
                                                response_deserializer=pb.PullRegionResponse.FromString)  # fmt: skip
        self._lock = threading.Lock()
        self.pool: RegionPool | None = None  # the regions for the holder's current socket
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def trim(self) -> int:
        """End the regions unused for ``shm_region_idle_s``; how many."""
        with self._lock:
            pool = self.pool
        return pool.trim() if pool is not None else 0

    def pull(self, socket_path: str, request: pb.PullRequest, receiver: BlockReceiver, deadline: float) -> PullStats:
        """One pull through a region into ``receiver`` (module docstring for what it raises)."""
        pool = self.region_pool(socket_path)
        if pool is None:
            raise ShmUnavailable("the client is closed")
        silence = self.config.holder_silence_s  # each wait for the holder: a hung one is given up
        region = pool.take(min(deadline, time.monotonic() + silence))
        if region is None:
            raise RegionsBusy(f"all {self.config.shm_regions} staging regions for this holder are in use")
        try:
            offer = self._offer(request, region, min(deadline, time.monotonic() + silence))
        except BaseException:
            pool.give(region)  # nothing was written into it
            raise
        try:
            read_pull(region.sock, region.view, self._slot_bytes(region), offer, receiver, deadline,
                      self.config.max_blocks_per_chunk, silence)  # fmt: skip
        except ShmUnavailable:  # the GO was refused: the region is as it was
            pool.give(region)
            raise
        except BaseException:  # mid-pull: nobody can say which slot the holder still writes
            pool.discard(region)
            raise
        pool.give(region)
        stats = receiver.finish()
        stats.transport = "shm"
        return stats

    def region_pool(self, socket_path: str) -> RegionPool | None:
        """The regions for the holder at ``socket_path`` (those of an earlier socket are ended);
        None once closed."""
        with self._lock:
            if self._closed:
                return None
            old = self.pool
            if old is not None and old.socket_path == socket_path:
                return old
            c = self.config
            self.pool = pool = RegionPool(socket_path, c.shm_region_bytes, c.shm_regions, self._grant,
                                          c.shm_region_idle_s)  # fmt: skip
        if old is not None:
            old.close()
        return pool

    def _grant(self, nbytes: int, deadline: float) -> bytes:
        """AttachRegion: a ticket for handing the holder a region of ``nbytes``."""
        body, metadata = self._signed("AttachRegion", pb.AttachRegionRequest(host_id=host_id(), region_bytes=nbytes))
        try:
            msg = self._attach_region(body, timeout=_left(deadline), metadata=metadata)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ShmUnavailable("the holder takes no staging regions", permanent=True) from exc
            raise
        if msg.refused:
            raise ShmUnavailable(f"the holder refused a region: {msg.refused}")
        return msg.ticket

    def _offer(self, request: pb.PullRequest, region: Region, deadline: float) -> PullOffer:
        """PullRegion: the pull's blocks and ticket for ``region``; ``ShmUnavailable`` on a refusal."""
        msg = pb.PullRegionRequest(pull=request, host_id=host_id(), region_id=region.region_id,
                                   slot_bytes=self._slot_bytes(region))  # fmt: skip
        body, metadata = self._signed("PullRegion", msg)
        offer = pull_offer_from_proto(self._pull_region(body, timeout=_left(deadline), metadata=metadata))
        if offer.refused:
            raise ShmUnavailable(f"the holder refused the pull: {offer.refused}")
        return offer

    def _slot_bytes(self, region: Region) -> int:
        return min(self.config.shm_slot_bytes, region.nbytes)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
