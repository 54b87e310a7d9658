"""The holder's side of the NIXL transport: ``NixlExporter`` (its agent, its KV registration, the
pullers it knows) and ``NixlServicer``, the PullNixl call of ``KVTransferServicer``.

PullNixl takes the path of Pull (authentication by the server's interceptor, per-peer admission,
layout, lease and hash checks, the same status codes), pins the whole pull, writes one window of its
blocks into the staging region the puller's partial metadata names (NIXL WRITE from the holder's
registered KV tensor, so no copy on this side) and answers the window's block checksums once the
write is done. Where NIXL cannot carry the window (no exporter, the puller's metadata unusable, the
write failing) the answer is ``refused`` and the puller pulls over gRPC.

Pullers are known by their agent names: random (122 bits), and sent only to the holders a puller
pulls from, over the authenticated call. NIXL refuses metadata that would give a loaded name other
connection details, so no caller can redirect another puller's writes to itself. At most
``nixl_max_peers`` are kept, the least recently used forgotten (its next window loads it again).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from pdserve.engine.cpu_threads import single_threaded_torch
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import InvalidPullError, TransferError
from pdserve.kvtransfer.guard import peer_host
from pdserve.kvtransfer.nixl import NixlAgent, NixlUnavailable, memory_of, split_ranges
from pdserve.kvtransfer.source import PinnedBlocks
from pdserve.kvtransfer.status import ServicerPart, abort
from pdserve.kvtransfer.wire import checksum
from pdserve.v1 import kvtransfer_pb2 as pb

logger = logging.getLogger(__name__)

MAX_NOTIF_TAG_BYTES = 64
# The most bytes one descriptor of a write carries; a larger block goes as several. Over UCX's TCP
# transport between two namespaces, 2 MiB blocks as 256 KiB descriptors moved at 0.86 of raw TCP
# against 0.76-0.80 as whole blocks, and 64 KiB ones were slower (docs/performance.md, "NIXL").
DESC_BYTES = 256 << 10


class NixlExporter:
    """The holder's agent with its whole KV tensor registered (never exported: no metadata of it
    leaves this process). Raises ``NixlUnavailable`` when NIXL cannot start; ``close()`` when done."""

    def __init__(self, config: TransferConfig, kv: torch.Tensor, block_nbytes: int) -> None:
        self.config = config
        self.agent = NixlAgent(f"pdserve-holder-{uuid.uuid4().hex}")
        self._flat = kv.reshape(-1).view(torch.uint8)
        self._registration = self.agent.register(self._flat)
        self._base = self._flat.data_ptr()
        self._memory = memory_of(self._flat)  # a GPU's KV is written from device memory (GPUDirect where UCX has it)
        self.block_nbytes = block_nbytes
        # A worker's helper threads run torch on their own thread only (engine/cpu_threads.py).
        self.checksums = ThreadPoolExecutor(2, thread_name_prefix="nixl-checksums", initializer=single_threaded_torch)
        self._lock = threading.Lock()
        # agent name -> its metadata and its turn (held while one of its windows is written), least recent first
        self._pullers: OrderedDict[str, tuple[bytes, threading.Lock]] = OrderedDict()
        self._by_metadata: dict[bytes, str] = {}

    def write(self, metadata: bytes, region_addr: int, block_ids: list[int], notif: bytes) -> None:
        """Write ``block_ids`` to ``region_addr``, ``region_addr + block_nbytes``, ... of the puller whose
        partial metadata is ``metadata``. Raises ``NixlUnavailable``.

        One puller's windows are written one at a time, another puller's beside them: two windows of
        one pull written at once share the holder's cores and both land late, while the puller waits
        for the first (on two cores, 0.59 -> 0.66 of a bare READ for 256 KiB blocks;
        docs/performance.md, "NIXL")."""
        peer, turn = self._load(metadata)
        nb = self.block_nbytes
        local = self._base + np.asarray(block_ids, dtype=np.uint64) * np.uint64(nb)
        remote = np.uint64(region_addr) + np.arange(len(block_ids), dtype=np.uint64) * np.uint64(nb)
        local, remote, lengths = split_ranges(local, remote, nb, DESC_BYTES)
        with turn:
            self.agent.write(local, remote, lengths, peer, notif, self.config.stall_timeout_s, self._memory)

    def _load(self, metadata: bytes) -> tuple[str, threading.Lock]:
        """The puller's agent name, its metadata loaded (again only when it changed), and its turn."""
        with self._lock:
            name = self._by_metadata.get(metadata)
            if name is not None:
                self._pullers.move_to_end(name)
                return name, self._pullers[name][1]
            try:
                name = self.agent.load(metadata)
            except Exception as exc:  # noqa: BLE001 - nixl's own types: malformed, a name taken, this agent's own
                raise NixlUnavailable(f"the puller's NIXL metadata is unusable: {type(exc).__name__}: {exc}") from None
            old = self._pullers.pop(name, None)
            if old is not None:
                del self._by_metadata[old[0]]
            turn = old[1] if old is not None else threading.Lock()
            self._pullers[name] = (metadata, turn)
            self._by_metadata[metadata] = name
            while len(self._pullers) > self.config.nixl_max_peers:
                gone, (gone_metadata, _) = self._pullers.popitem(last=False)  # a write holding its turn ends on its own
                del self._by_metadata[gone_metadata]
                self.agent.forget(gone)
            return name, turn

    def __len__(self) -> int:
        """Puller agents known."""
        with self._lock:
            return len(self._pullers)

    def close(self) -> None:
        self.checksums.shutdown()
        self.agent.close()
        self.agent.unregister(self._registration)


class NixlServicer(ServicerPart):
    """The PullNixl call; the servicer also supplies ``nixl`` (None: no NIXL transport)."""

    nixl: NixlExporter | None

    def PullNixl(self, request: pb.PullNixlRequest, context: grpc.ServicerContext) -> pb.PullNixlResponse:
        nixl = self.nixl
        if nixl is None:
            return pb.PullNixlResponse(refused="this holder offers no NIXL transport")
        nb = self.source.layout.block_nbytes
        n = request.num_blocks
        if not n or not request.agent_metadata or not 1 <= len(request.notif_tag) <= MAX_NOTIF_TAG_BYTES:
            abort(context, InvalidPullError("a NIXL window needs num_blocks, agent_metadata and a 1-64 byte notif_tag"))
        if request.region_bytes < n * nb or not request.region_addr:
            abort(context, InvalidPullError(f"{n} blocks of {nb} bytes do not fit a region of {request.region_bytes}"))
        ticket = self.guard.admit(context.peer(), context.cancel)
        if ticket is None:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many pulls from this peer at once (at most {self.guard.max_per_peer})",
            )
        try:
            try:
                pinned = self._open(request.pull)
            except TransferError as exc:
                abort(context, exc)
            with pinned:
                return self._write_window(nixl, pinned, request, peer_host(context.peer()), context)
        finally:
            ticket.close()

    def _write_window(self, nixl: NixlExporter, pinned: PinnedBlocks, request: pb.PullNixlRequest, host: str,
                      context: grpc.ServicerContext) -> pb.PullNixlResponse:  # fmt: skip
        start = request.skip_blocks
        if start >= len(pinned.block_ids):
            abort(context, InvalidPullError(f"skip_blocks {start} beyond a pull of {len(pinned.block_ids)} blocks"))
        window = range(start, min(start + request.num_blocks, len(pinned.block_ids)))
        ids = [pinned.block_ids[i] for i in window]
        remaining = context.time_remaining()
        if not context.is_active() or (remaining is not None and remaining <= 0):
            return pb.PullNixlResponse(refused="the call ended before the write")  # the puller may free the region
        nb = self.source.layout.block_nbytes
        # The checksums are read beside the write (xxhash lets go of the GIL): the blocks are pinned.
        sums = nixl.checksums.submit(lambda: [checksum(self.source.read(b, 0, nb)) for b in ids])
        try:
            nixl.write(request.agent_metadata, request.region_addr, ids, request.notif_tag)
        except NixlUnavailable as exc:
            logger.info("NIXL window for %s refused: %s", host, str(exc))
            return pb.PullNixlResponse(refused=str(exc))
        finally:
            sums.result()  # nothing of this call outlives it
        blocks = [
            pb.NixlBlock(index=pinned.indices[i], block_hash=pinned.hashes[i], num_tokens=pinned.num_tokens[i], checksum=c)
            for i, c in zip(window, sums.result())
        ]
        return pb.PullNixlResponse(total_blocks=len(pinned.block_ids), total_tokens=pinned.total_tokens,
                                   block_nbytes=nb, blocks=blocks)  # fmt: skip
