"""The holder's same-host calls, AttachRegion and PullRegion: ``RegionServicer``, a part of ``KVTransferServicer``.

AttachRegion grants a ticket for handing one of the puller's staging regions over the holder's Unix
socket (``ShmExporter``). PullRegion takes the path of Pull (authentication by the server's
interceptor, per-peer admission, layout, lease and hash checks, the same status codes), then files
the pinned blocks under a one-time ticket that the puller's GO on the region's channel redeems; the
blocks are copied into the region there, slot by slot (``kvtransfer.shm_ring``). The admission lasts
until that copy ends, so the per-peer limit and the stall watchdog cover it as they cover a stream.
Where the transport cannot serve (no exporter, another host, an unknown or busy region, too many
regions) the answer is ``refused`` and the puller uses Pull.
"""

from __future__ import annotations

import grpc

from pdserve.kvtransfer.errors import InvalidPullError, TransferError
from pdserve.kvtransfer.guard import peer_host
from pdserve.kvtransfer.protoconv import pull_offer_to_proto
from pdserve.kvtransfer.shm import MAX_REGION_BYTES, MIN_REGION_BYTES, PullOffer, RegionBlock
from pdserve.kvtransfer.shm_ring import HolderPull
from pdserve.kvtransfer.shm_server import HolderRegion, ShmExporter
from pdserve.kvtransfer.status import ServicerPart, abort, clamp
from pdserve.v1 import kvtransfer_pb2 as pb

# A puller asks for its next pull on a region once it has acknowledged the last slot of the one
# before, which the holder's channel thread may not have seen yet: the holder waits that long for it.
REGION_FREE_WAIT_S = 1.0


class RegionServicer(ServicerPart):
    """The two calls; the servicer also supplies ``shm`` (None: no same-host transport)."""

    shm: ShmExporter | None

    def AttachRegion(self, request: pb.AttachRegionRequest, context: grpc.ServicerContext) -> pb.AttachRegionResponse:
        shm, n = self.shm, request.region_bytes
        refused = self._shm_refusal(request.host_id)
        if not refused and not MIN_REGION_BYTES <= n <= MAX_REGION_BYTES:
            refused = f"a region must hold {MIN_REGION_BYTES} to {MAX_REGION_BYTES} bytes, not {n}"
        ticket = shm.grant_attach(peer_host(context.peer()), n) if shm is not None and not refused else None
        if ticket is None:
            return pb.AttachRegionResponse(refused=refused or "this holder maps all the regions it takes")
        return pb.AttachRegionResponse(ticket=ticket, ticket_ttl_ms=round(shm.attach_tickets.ttl_s * 1000))

    def PullRegion(self, request: pb.PullRegionRequest, context: grpc.ServicerContext) -> pb.PullRegionResponse:
        shm = self.shm
        refused = self._shm_refusal(request.host_id)
        region = shm.region(request.region_id) if shm is not None and not refused else None
        if region is not None and not 1 <= request.slot_bytes <= region.nbytes:
            abort(context, InvalidPullError(f"slot_bytes {request.slot_bytes} outside a region of {region.nbytes}"))
        if shm is None or region is None or not region.reserve(REGION_FREE_WAIT_S):
            refused = refused or ("unknown region" if region is None else "the region carries another pull")
            return pull_offer_to_proto(PullOffer(refused=refused))
        pull = self._region_pull(region, request)
        try:  # from here every way out but the answer gives the region, the admission and the pins back
            pull.guard = self.guard.admit(context.peer(), pull.cancel)
            if pull.guard is None:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many pulls from this peer at once (at most {self.guard.max_per_peer})",
                )
            pull.pinned = pinned = self._open(request.pull)
            ticket = shm.file_pull(pull, region, peer_host(context.peer()))
        except TransferError as exc:
            pull.close()
            abort(context, exc)
        except BaseException:
            pull.close()
            raise
        blocks = tuple(RegionBlock(i, h, t) for i, h, t in zip(pinned.indices, pinned.hashes, pinned.num_tokens))
        offer = PullOffer(ticket=ticket, ticket_ttl_s=shm.pull_tickets.ttl_s, block_nbytes=pull.block_nbytes,
                          total_tokens=pinned.total_tokens, blocks=blocks)  # fmt: skip
        return pull_offer_to_proto(offer)

    def _shm_refusal(self, puller_host_id: str) -> str:
        if self.shm is None:
            return "this holder offers no shared-memory transport"
        return "" if puller_host_id == self.shm.host_id else "the puller runs on another host"

    def _region_pull(self, region: HolderRegion, request: pb.PullRegionRequest) -> HolderPull:
        """The holder's state of one region pull (a test holder overrides it to corrupt a piece)."""
        max_pieces = clamp(request.pull.max_blocks_per_chunk, self.config.max_blocks_per_chunk)
        return HolderPull(region.region_id, request.slot_bytes, max_pieces, self.source.layout.block_nbytes,
                          self.source.read, region.end_pull)  # fmt: skip
