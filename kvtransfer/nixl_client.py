"""The puller's NIXL path for one holder: ``NixlPuller`` (used by ``KVTransferClient``).

It owns an agent and one staging region for this holder alone (``nixl_region_bytes``, registered
with the agent, made at the first pull; an agent starts in about half a second). A pull goes in
windows of as many blocks as the region holds: for each, a PullNixl call names the window and carries
the agent's partial metadata (the region and nothing else); while it runs, this thread progresses the
agent, and the window is taken once the answer has come and the write's notification (a fresh random
tag) has landed. Its blocks then go through the pull's ``BlockReceiver`` as one chunk per window:
checksums, hashes and token counts checked, each block copied once into the KV tensor.

Failure contract: ``NixlUnavailable`` when NIXL cannot carry the pull (not installed, refused by the
holder, the notification missing, the region busy with another pull, a block larger than the
region); the caller pulls again over gRPC with a fresh receiver. A call's ``grpc.RpcError`` or a
``TransferError`` (a checksum, a malformed answer) fails the pull. After any failure of a window the
region is ended, so a write still in flight cannot land in the next pull's region.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable

import grpc
import torch
from google.protobuf.message import Message

from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import InvalidPullError
from pdserve.kvtransfer.nixl import NixlAgent, NixlUnavailable
from pdserve.kvtransfer.receiver import BlockReceiver
from pdserve.kvtransfer.wire import Chunk, Piece, PullStats
from pdserve.v1 import kvtransfer_pb2 as pb

logger = logging.getLogger(__name__)
Signer = Callable[[str, Message], tuple[bytes, tuple[tuple[str, str], ...]]]
_POLL_S = 0.0002  # between progress calls while a window is written: the write's wire-up waits on them


class _Region:
    """A registered staging region: its tensor, registration and partial metadata."""

    def __init__(self, agent: NixlAgent, nbytes: int) -> None:
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: every page in before the first write
        self.view = memoryview(self.tensor.numpy())
        self.nbytes = nbytes
        self.addr = self.tensor.data_ptr()
        self.handle = agent.register(self.tensor)
        self.metadata = agent.partial_metadata(self.handle)
        self.last_used = time.monotonic()


class NixlPuller:
    """``signed(method, request)``: the request's bytes and the metadata that signs them for one call;
    ``channel``: the client's channel to the holder. Thread-safe (one pull at a time; another finds
    the region busy and goes over gRPC); ``close()`` ends the region and the agent."""

    def __init__(self, config: TransferConfig, channel: grpc.Channel, signed: Signer, service: str) -> None:
        self.config = config
        self._signed = signed
        self._call = channel.unary_unary(service + "PullNixl", response_deserializer=pb.PullNixlResponse.FromString)
        self._busy = threading.Lock()  # held by the pull using the region
        self._agent: NixlAgent | None = None
        self._region: _Region | None = None
        self._off: NixlUnavailable | None = None  # why NIXL cannot run in this process

    def pull(self, request: pb.PullRequest, receiver: BlockReceiver, deadline: float) -> PullStats:
        """One pull in windows into ``receiver`` (module docstring for what it raises)."""
        if not self._busy.acquire(blocking=False):
            raise NixlUnavailable("the NIXL staging region carries another pull")
        try:
            region = self._ensure_region()
            per_window = region.nbytes // receiver.block_nbytes
            if per_window == 0:
                raise NixlUnavailable(f"a block of {receiver.block_nbytes} bytes exceeds the NIXL region")
            try:
                return self._windows(region, per_window, request, receiver, deadline)
            except BaseException:
                self._end_region()  # a write of the failed window may still be on its way
                raise
        finally:
            if self._region is not None:
                self._region.last_used = time.monotonic()
            self._busy.release()

    def _windows(self, region: _Region, per_window: int, request: pb.PullRequest, receiver: BlockReceiver,
                 deadline: float) -> PullStats:  # fmt: skip
        total = len(receiver.dest)
        done = seq = 0
        while done < total:
            answer = self._window(region, request, done, min(per_window, total - done), deadline)
            if not answer.blocks or len(answer.blocks) > per_window:
                raise InvalidPullError(f"a NIXL window of {len(answer.blocks)} blocks for a region of {per_window}")
            nb = answer.block_nbytes
            pieces = tuple(
                Piece(b.index, b.block_hash, b.num_tokens, 0, region.view[i * nb : (i + 1) * nb], b.checksum)
                for i, b in enumerate(answer.blocks)
            )
            receiver.accept(Chunk(seq, answer.total_blocks, answer.total_tokens, nb, pieces))
            done += len(pieces)
            seq += 1
        stats = receiver.finish()
        stats.transport = "nixl"
        return stats

    def _window(
        self, region: _Region, request: pb.PullRequest, skip: int, n: int, deadline: float
    ) -> pb.PullNixlResponse:
        agent = self._agent
        assert agent is not None
        tag = secrets.token_bytes(16)
        message = pb.PullNixlRequest(pull=request, skip_blocks=skip, num_blocks=n, agent_metadata=region.metadata,
                                     region_addr=region.addr, region_bytes=region.nbytes, notif_tag=tag)  # fmt: skip
        body, metadata = self._signed("PullNixl", message)
        future = self._call.future(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata)
        landed = False
        try:
            while not future.done():  # the holder's write needs this side's progress (wire-up)
                landed = landed or tag in agent.poll_notifs()
                time.sleep(_POLL_S)
        finally:
            future.cancel()  # no-op once done; a failure here must not leave the call running
        answer = future.result()  # a failed call raises its grpc.RpcError
        if answer.refused:
            raise NixlUnavailable(f"the holder refused NIXL: {answer.refused}")
        limit = min(deadline, time.monotonic() + self.config.stall_timeout_s)
        while not landed:  # on RDMA the answer may overtake the bytes; the notification follows them
            landed = tag in agent.poll_notifs()
            if not landed and time.monotonic() > limit:
                raise NixlUnavailable("the NIXL write's notification did not come")
            time.sleep(0 if landed else _POLL_S)
        return answer

    # -- the agent and the region ------------------------------------------------------------
    def _ensure_region(self) -> _Region:
        if self._off is not None:
            raise self._off
        try:
            if self._agent is None:
                self._agent = NixlAgent(f"pdserve-puller-{uuid.uuid4().hex}")
            if self._region is None:
                self._region = _Region(self._agent, self.config.nixl_region_bytes)
        except NixlUnavailable as exc:
            self._off = exc
            raise
        return self._region

    def _end_region(self) -> None:
        region, self._region = self._region, None
        if region is not None and self._agent is not None:
            try:
                self._agent.unregister(region.handle)
            except Exception as exc:  # noqa: BLE001 - the registration goes with the agent anyway
                logger.debug("NIXL: ending a staging region: %s", exc)

    def trim(self) -> int:
        """End the region when unused for ``shm_region_idle_s`` (and no pull holds it); 1 if it was."""
        if not self._busy.acquire(blocking=False):
            return 0
        try:
            region = self._region
            if region is None or time.monotonic() - region.last_used < self.config.shm_region_idle_s:
                return 0
            self._end_region()
            return 1
        finally:
            self._busy.release()

    @property
    def has_region(self) -> bool:
        return self._region is not None

    def close(self) -> None:
        """End the region and the agent (a pull in progress ends first)."""
        with self._busy:
            self._end_region()
            agent, self._agent = self._agent, None
            self._off = NixlUnavailable("the client is closed")
        if agent is not None:
            agent.close()
