"""How the holder's servicer answers: a ``TransferError`` as a gRPC status, the puller's caps, and what
a transport's calls take from the servicer (``ServicerPart``).

Shared by the stream (``kvtransfer.server``) and the same-host calls (``kvtransfer.shm_service``), so
that a pull fails with the same status whichever transport was asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import grpc

from pdserve.kvtransfer.errors import BlockNotFoundError, InvalidPullError, LayoutMismatchError, TransferError
from pdserve.kvtransfer.wire import MISSING_HASHES_KEY

if TYPE_CHECKING:  # annotations only: the servicer's parts import this module
    from pdserve.kvtransfer.config import TransferConfig
    from pdserve.kvtransfer.guard import PullGuard
    from pdserve.kvtransfer.source import BlockSource, PinnedBlocks
    from pdserve.v1 import kvtransfer_pb2 as pb

_MAX_MISSING_IN_METADATA = 64  # keeps the trailer far below gRPC's header size limit


def clamp(requested: int, own: int) -> int:
    """A puller's cap (0: none) within the holder's own."""
    return min(requested, own) if requested > 0 else own


def abort(context: grpc.ServicerContext, exc: TransferError) -> NoReturn:
    """Abort the RPC with the status matching ``exc`` (raises)."""
    if isinstance(exc, BlockNotFoundError):
        if exc.missing_hashes:
            shown = exc.missing_hashes[:_MAX_MISSING_IN_METADATA]
            context.set_trailing_metadata(((MISSING_HASHES_KEY, ",".join(h.hex() for h in shown)),))
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, LayoutMismatchError):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, InvalidPullError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    else:
        code = grpc.StatusCode.INTERNAL
    context.abort(code, str(exc))
    raise AssertionError("unreachable: context.abort raises")


class ServicerPart:
    """What a transport's calls (``shm_service.RegionServicer``, ``nixl_server.NixlServicer``) take from
    the ``KVTransferServicer`` they are part of: its ``guard``, ``config`` and ``source``, and ``_open``
    (a PullRequest's checks and pinned blocks, as Pull has them)."""

    guard: PullGuard
    config: TransferConfig
    source: BlockSource

    def _open(self, request: pb.PullRequest) -> PinnedBlocks:
        """Supplied by the servicer (``KVTransferServicer._open``)."""
        raise NotImplementedError
