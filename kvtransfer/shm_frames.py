"""The messages of a region's channel (the Unix socket connection that handed the region over).

Framing: one kind byte, the payload's length (u32, little-endian), the payload. A stream socket
keeps no message boundaries, so every frame is read whole (``recv_frame``), and a payload longer
than ``MAX_PAYLOAD`` is refused before it is read.

=============  ==============  ===============================================================
kind           direction       payload
=============  ==============  ===============================================================
``ATTACH``     puller→holder   attach ticket (``TICKET_BYTES``), region size (u64); the memfd rides
                               along (SCM_RIGHTS)
``ATTACHED``   holder→puller   the region id (``REGION_ID_BYTES``) that PullRegion names
``REFUSED``    holder→puller   a reason (UTF-8): the ATTACH or GO was refused, nothing was written
``GO``         puller→holder   a pull ticket from PullRegion: the holder starts that pull
``SLOT``       holder→puller   seq (u32), slot (u32), piece count (u32), then per piece: position
                               in the pull (u32), offset in the block (u64), length (u64), xxh3_64
                               of the bytes (u64); the pieces lie back to back from the slot's start
``ACK``        puller→holder   seq (u32): that slot is read, the holder may write it again
``FAILED``     holder→puller   a reason (UTF-8): the pull ended mid-way on the holder
=============  ==============  ===============================================================
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

ATTACH, ATTACHED, REFUSED, GO, SLOT, ACK, FAILED = range(1, 8)
MAX_PAYLOAD = 1 << 20  # a SLOT of max_blocks_per_chunk (at most 2**20 / 28 = 37,449) pieces fits
_HEADER = struct.Struct("<BI")
_SLOT = struct.Struct("<III")
_ENTRY = struct.Struct("<IQQQ")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class FrameError(ConnectionError):
    """The other end sent something that is not a frame of this protocol, or hung up mid-frame."""


@dataclass(frozen=True)
class SlotEntry:
    """One piece in a slot: bytes ``[offset, offset + length)`` of the pull's block ``position``."""

    position: int
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True)
class SlotFrame:
    seq: int
    slot: int
    entries: tuple[SlotEntry, ...]


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"", fds: tuple[int, ...] = ()) -> None:
    """Send one frame (``fds`` ride along with its first byte)."""
    data = _HEADER.pack(kind, len(payload)) + payload
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket, max_fds: int = 0) -> tuple[int, bytes, list[int]]:
    """One whole frame: ``(kind, payload, received descriptors)``; the caller owns (closes) the
    descriptors. Raises ``FrameError`` on EOF, a short frame, or a payload over ``MAX_PAYLOAD``
    (closing any descriptor received), ``OSError`` (``TimeoutError`` included) from the socket."""
    fds: list[int] = []
    try:
        if max_fds:
            head, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, max_fds, socket.MSG_CMSG_CLOEXEC)
            if flags & socket.MSG_CTRUNC:
                raise FrameError("descriptors were truncated")
            if not head:
                raise FrameError("connection closed")
            head += _recv_exact(sock, _HEADER.size - len(head))
        else:
            head = _recv_exact(sock, _HEADER.size)
        kind, length = _HEADER.unpack(head)
        if length > MAX_PAYLOAD:
            raise FrameError(f"frame of {length} bytes (at most {MAX_PAYLOAD})")
        return kind, _recv_exact(sock, length), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise FrameError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def encode_attach(ticket: bytes, nbytes: int) -> bytes:
    return ticket + _U64.pack(nbytes)


def decode_attach(payload: bytes, ticket_bytes: int) -> tuple[bytes, int]:
    if len(payload) != ticket_bytes + _U64.size:
        raise FrameError(f"ATTACH of {len(payload)} bytes")
    return payload[:ticket_bytes], _U64.unpack_from(payload, ticket_bytes)[0]


def encode_slot(seq: int, slot: int, entries: list[SlotEntry]) -> bytes:
    parts = [_SLOT.pack(seq, slot, len(entries))]
    parts += [_ENTRY.pack(e.position, e.offset, e.length, e.checksum) for e in entries]
    return b"".join(parts)


def decode_slot(payload: bytes) -> SlotFrame:
    """Raises ``FrameError`` for a payload whose length does not match its piece count."""
    if len(payload) < _SLOT.size:
        raise FrameError(f"SLOT of {len(payload)} bytes")
    seq, slot, n = _SLOT.unpack_from(payload)
    if len(payload) != _SLOT.size + n * _ENTRY.size:
        raise FrameError(f"SLOT of {len(payload)} bytes announces {n} pieces")
    entries = tuple(SlotEntry(*e) for e in _ENTRY.iter_unpack(memoryview(payload)[_SLOT.size :]))
    return SlotFrame(seq, slot, entries)


def encode_seq(seq: int) -> bytes:
    return _U32.pack(seq)


def decode_seq(payload: bytes) -> int:
    if len(payload) != _U32.size:
        raise FrameError(f"ACK of {len(payload)} bytes")
    return _U32.unpack(payload)[0]
