"""Typed errors of the KV wire.

Every failure of a pull surfaces as a ``TransferError``; a decode worker catches that
one base class, frees the blocks it allocated and recomputes the prompt instead.
The subclasses say why, for logs and counters (``transfer_failures``).
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer failed. ``code`` is the gRPC status name when one was received."""

    def __init__(self, message: str, *, peer: str | None = None, code: str | None = None) -> None:
        super().__init__(message if peer is None else f"{message} (peer {peer})")
        self.peer = peer
        self.code = code


class ChecksumError(TransferError):
    """A piece's bytes do not match the checksum the holder sent with them."""


class PeerUnavailableError(TransferError):
    """The holder could not be reached, or went away mid-stream."""


class BlockNotFoundError(TransferError):
    """The holder does not have what was asked for: a missing block hash or lease.

    ``missing_hashes`` lists the hashes it lacks (empty for a lease); ``lease_id`` the lease.
    """

    def __init__(
        self,
        message: str,
        *,
        missing_hashes: list[bytes] | None = None,
        lease_id: str | None = None,
        peer: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, peer=peer, code=code)
        self.missing_hashes = list(missing_hashes or [])
        self.lease_id = lease_id


class LayoutMismatchError(TransferError):
    """The two workers' KV layouts (or models) differ; ``fields`` maps each differing
    field name to ``(local, remote)``."""

    def __init__(
        self,
        message: str,
        *,
        fields: dict[str, tuple[object, object]] | None = None,
        peer: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, peer=peer, code=code)
        self.fields = dict(fields or {})


class TransferTimeoutError(TransferError):
    """A call to the holder ran past its deadline."""


class AuthError(TransferError):
    """The holder refused this puller's credentials (another cluster's secret, or none)."""


class InvalidPullError(TransferError):
    """The pull was malformed (bad indices, wrong number of destination blocks, ...)."""
