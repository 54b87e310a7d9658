"""The puller's NIXL path for one holder: ``NixlPuller`` (used by ``KVTransferClient``).

It owns an agent and one staging region for this holder alone (``nixl_region_bytes``, registered
with the agent, made at the first pull). A pull goes in windows of as many blocks as half the region
holds, two in flight: for each, a PullNixl call names the window and its half and carries the agent's
partial metadata (the region and nothing else). While they run this thread progresses the agent, and a
window is taken once its answer has come and its write's notification (a fresh random tag) has landed.
Its blocks then go through the pull's ``BlockReceiver`` as one chunk per window (checksums, hashes and
token counts checked, each block copied once into the KV tensor) while the holder writes the next one.

Failure contract: ``NixlUnavailable`` when NIXL cannot carry the pull (not installed, refused by the
holder, the notification missing, the region busy with another pull, a block larger than the
region); the caller pulls again over gRPC with a fresh receiver. A call's ``grpc.RpcError`` or a
``TransferError`` (a checksum, a malformed answer, a ``TransferTimeoutError`` when a window's answer
does not come within ``holder_silence_s``) fails the pull. After any failure of a window the
region is ended (the next pull makes a new one), so a write still in flight cannot land in the next
pull's region; its memory is kept until such a write must have ended (``_end_region``). A region ends
with its agent (after a failure, when idle, at ``close``): a holder's copy of its metadata then reaches
nothing, and the memory that held it can go back to the process.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import Message

from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import InvalidPullError, TransferTimeoutError
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
        try:
            self.metadata = agent.partial_metadata(self.handle)
        except NixlUnavailable:
            agent.unregister(self.handle)
            raise
        self.last_used = time.monotonic()


def _drop(region: _Region) -> None:
    """A retired region's keeper ends: its memory goes with the last reference."""


@dataclass(frozen=True)
class _Plan:
    """How one pull uses the region: ``slots`` windows of ``per_window`` blocks, ``slot_bytes`` apart."""

    region: _Region
    slots: int
    slot_bytes: int
    per_window: int


@dataclass(frozen=True)
class _Window:
    """A window asked for: its call, notification tag and place in the region."""

    future: grpc.Future
    tag: bytes
    offset: int


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
            nb = receiver.block_nbytes
            slots = 2 if region.nbytes // nb >= 2 else 1  # two windows in flight where the region holds two
            per_window = region.nbytes // slots // nb
            if per_window == 0:
                raise NixlUnavailable(f"a block of {nb} bytes exceeds the NIXL region")
            try:
                return self._windows(_Plan(region, slots, per_window * nb, per_window), request, receiver, deadline)
            except BaseException:
                # A window asked for may still be written (a holder starts a write only before the call's
                # deadline, and a write ends within stall_timeout_s): the memory outlives it.
                self._end_region(keep_until=deadline + self.config.stall_timeout_s)
                raise
        finally:
            if self._region is not None:
                self._region.last_used = time.monotonic()
            self._busy.release()

    def _windows(self, plan: _Plan, request: pb.PullRequest, receiver: BlockReceiver, deadline: float) -> PullStats:
        """Windows in order, each in slot ``k % slots`` of the region: window k+slots is asked for as
        soon as window k has been taken, so the holder writes the next while this thread checks and
        copies the last. A prefix pull (``receiver.prefix``) asks for its first window alone: its
        answer says how many blocks the holder had, and the pull is those (every later window within
        them, under the first answer's totals)."""
        total = len(receiver.dest)
        in_flight: deque[_Window] = deque()
        landed: set[bytes] = set()
        totals: tuple[int, int] | None = None
        try:
            k = 0
            while k * plan.per_window < total:
                ahead = 1 if receiver.prefix and totals is None else plan.slots
                while len(in_flight) < ahead and (k + len(in_flight)) * plan.per_window < total:
                    j = k + len(in_flight)
                    in_flight.append(self._ask(plan, j % plan.slots, request, j * plan.per_window, total, deadline))
                window = in_flight.popleft()
                answer = self._wait(window, landed, deadline)
                if totals is None:
                    totals = (answer.total_blocks, answer.total_tokens)
                    total = min(total, answer.total_blocks) if receiver.prefix else total
                own = (answer.total_blocks, answer.total_tokens)  # a lease's or a whole hash list's never change
                self._take(plan, window, answer, k, k * plan.per_window, totals if receiver.prefix else own, receiver)
                k += 1
        finally:
            for window in in_flight:
                window.future.cancel()
        stats = receiver.finish()
        stats.transport = "nixl"
        return stats

    @staticmethod
    def _take(plan: _Plan, window: _Window, answer: pb.PullNixlResponse, seq: int, skip: int,
              totals: tuple[int, int], receiver: BlockReceiver) -> None:  # fmt: skip
        """Window ``seq``'s blocks, from the region's slot, through the receiver's checks into the KV."""
        if not answer.blocks or len(answer.blocks) > plan.per_window or answer.blocks[0].index < skip:
            raise InvalidPullError(f"a NIXL window of {len(answer.blocks)} blocks for {plan.per_window}")
        nb, view = answer.block_nbytes, plan.region.view[window.offset : window.offset + plan.slot_bytes]
        pieces = tuple(
            Piece(b.index, b.block_hash, b.num_tokens, 0, view[i * nb : (i + 1) * nb], b.checksum)
            for i, b in enumerate(answer.blocks)
        )
        receiver.accept(Chunk(seq, *totals, nb, pieces))

    def _ask(self, plan: _Plan, slot: int, request: pb.PullRequest, skip: int, total: int,
             deadline: float) -> _Window:  # fmt: skip
        """Ask the holder for the window from block ``skip``, into ``slot``."""
        tag = secrets.token_bytes(16)
        offset = slot * plan.slot_bytes
        message = pb.PullNixlRequest(pull=request, skip_blocks=skip, num_blocks=min(plan.per_window, total - skip),
                                     agent_metadata=plan.region.metadata, region_addr=plan.region.addr + offset,
                                     region_bytes=plan.slot_bytes, notif_tag=tag)  # fmt: skip
        body, metadata = self._signed("PullNixl", message)
        future = self._call.future(body, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata)
        return _Window(future, tag, offset)

    def _wait(self, window: _Window, landed: set[bytes], deadline: float) -> pb.PullNixlResponse:
        """The window's answer, once its notification has landed too; this thread progresses the agent
        meanwhile (the holder's writes need it for their wire-up)."""
        agent = self._agent
        assert agent is not None
        silent_until = min(deadline, time.monotonic() + self.config.holder_silence_s)
        while not window.future.done():
            if time.monotonic() > silent_until:  # a hung holder: the call may never answer
                window.future.cancel()
                raise TransferTimeoutError(f"no answer to a NIXL window in {self.config.holder_silence_s:g}s")
            landed.update(agent.poll_notifs())
            time.sleep(_POLL_S)
        answer = window.future.result()  # a failed call raises its grpc.RpcError
        if answer.refused:
            raise NixlUnavailable(f"the holder refused NIXL: {answer.refused}")
        limit = min(deadline, time.monotonic() + self.config.stall_timeout_s)
        while window.tag not in landed:  # on RDMA the answer may overtake the bytes; the notification follows them
            if time.monotonic() > limit:
                raise NixlUnavailable("the NIXL write's notification did not come")
            time.sleep(_POLL_S)
            landed.update(agent.poll_notifs())
        landed.discard(window.tag)
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
            if exc.permanent:  # no agent in this process: NIXL is off for this client
                self._off = exc
            raise
        return self._region

    def _end_region(self, keep_until: float | None = None) -> None:
        """End the region and the agent that registered it; free the region's memory now, or (``keep_until``,
        a monotonic time) only then. The next pull makes both afresh (an agent of another random name).

        Over UCX's TCP transport a holder's copy of the region's metadata still reaches the memory after
        it is deregistered, but nothing once the agent is gone (tested): memory that held the region goes
        back to the process only with the agent ended. Over cma a holder's ``process_vm_writev`` needs no
        agent at all: memory freed under a late write there would be another object's, hence ``keep_until``."""
        region, self._region = self._region, None
        agent, self._agent = self._agent, None
        if agent is not None:
            if region is not None:
                try:
                    agent.unregister(region.handle)
                except Exception as exc:  # noqa: BLE001 - the registration goes with the agent anyway
                    logger.debug("NIXL: ending a staging region: %s", exc)
            agent.end()
        if region is not None and keep_until is not None:
            keeper = threading.Timer(max(keep_until - time.monotonic(), 0.0), _drop, args=(region,))
            keeper.daemon = True
            keeper.start()

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
            self._off = NixlUnavailable("the client is closed")
