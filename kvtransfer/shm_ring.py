"""One pull through a region's ring of slots: the holder's writer and the puller's reader.

A pull into a region of ``R`` bytes with slots of ``slot_bytes`` uses the ring of
``S = R // slot_bytes`` slots: slot ``k`` is ``[k * slot_bytes, (k + 1) * slot_bytes)``. The pull's
blocks are cut as the gRPC stream cuts them into chunks (``wire.plan_chunks`` with ``slot_bytes`` as
the chunk size), and chunk ``seq`` goes into slot ``seq % S``, its pieces back to back from the slot's
start. Handshake on the region's channel (``kvtransfer.shm_frames``): the puller sends GO with the
pull's ticket; the holder copies chunk ``seq`` into its slot, checksums each piece from its own bytes
and sends SLOT; the puller checks and copies the pieces into its KV blocks (``BlockReceiver``, as the
stream's chunks) and sends ACK ``seq``. The holder writes slot ``seq % S`` again only after the ACK of
``seq - S``, so it fills one slot while the puller reads the one before: the two copies overlap.

Once the holder has the last ACK the pull is over on both ends and the region is free for the
puller's next pull. A pull that fails after GO (a checksum, a timeout, a FAILED frame, a lost
channel) ends the region on both ends: nobody can say which slot the other still touches.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from pdserve.kvtransfer.errors import InvalidPullError, PeerUnavailableError, TransferError, TransferTimeoutError
from pdserve.kvtransfer.guard import PullTicket
from pdserve.kvtransfer.receiver import BlockReceiver
from pdserve.kvtransfer.shm import PullOffer, ShmUnavailable
from pdserve.kvtransfer.shm_frames import (
    ACK,
    FAILED,
    GO,
    REFUSED,
    SLOT,
    FrameError,
    SlotEntry,
    decode_seq,
    decode_slot,
    encode_seq,
    encode_slot,
    recv_frame,
    send_frame,
)
from pdserve.kvtransfer.source import PinnedBlocks
from pdserve.kvtransfer.wire import Chunk, Piece, PieceSpec, checksum, plan_chunks


class HolderPull:
    """One PullRegion on the holder, from its answer until its last ACK, or its end.

    Owns the pins (``pinned``), the per-peer admission (``guard``) and the region's reservation
    (``on_end``): ``close()`` gives all three back, once, whoever calls it first (the run, the
    ticket table when nobody redeems it, the guard's watchdog through ``cancel``). ``read(block_id,
    offset, length)`` returns the holder's bytes of a block.
    """

    def __init__(self, region_id: bytes, slot_bytes: int, max_pieces: int, block_nbytes: int,
                 read: Callable[[int, int, int], memoryview], on_end: Callable[[], None]) -> None:  # fmt: skip
        self.region_id = region_id
        self.slot_bytes = slot_bytes
        self.max_pieces = max_pieces
        self.block_nbytes = block_nbytes
        self.read = read
        self.pinned: PinnedBlocks | None = None
        self.guard: PullTicket | None = None
        self._on_end = on_end
        self._abort: Callable[[], None] | None = None  # while running: ends the region's channel
        self._lock = threading.Lock()
        self.cancelled = False
        self.closed = False

    def cancel(self) -> None:
        """The guard's watchdog gave up on it: a pending pull ends, a running one loses its channel."""
        with self._lock:
            self.cancelled = True
            abort = self._abort
        if abort is not None:
            abort()
        else:
            self.close()

    def start(self, abort: Callable[[], None]) -> bool:
        """Mark it running (``abort`` ends it); False when it was cancelled or closed already."""
        with self._lock:
            if self.cancelled or self.closed:
                return False
            self._abort = abort
            return True

    def unpin(self) -> None:
        if self.pinned is not None:
            self.pinned.close()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.unpin()
        if self.guard is not None:
            self.guard.close()
        self._on_end()

    def fill(self, slot: np.ndarray, specs: list[PieceSpec]) -> list[SlotEntry]:
        """Copy ``specs`` back to back into ``slot``; each entry's checksum is of the holder's own
        bytes. (numpy copies without the GIL; a test holder overrides this to corrupt a piece.)"""
        assert self.pinned is not None
        entries, pos = [], 0
        for s in specs:
            data = self.read(self.pinned.block_ids[s.position], s.offset, s.length)
            slot[pos : pos + s.length] = np.frombuffer(data, dtype=np.uint8)
            entries.append(SlotEntry(s.position, s.offset, s.length, checksum(data)))
            pos += s.length
        return entries


def write_pull(conn: socket.socket, region: np.ndarray, pull: HolderPull, stall_timeout_s: float) -> None:
    """The holder's side of one pull on the region's channel ``conn`` (GO already taken): every
    slot written and announced, the pins dropped once the last is copied, every ACK received.

    Raises ``OSError`` (``FrameError``, ``TimeoutError``: no ACK within ``stall_timeout_s``) when
    the channel fails, ``TransferError`` when the puller breaks the handshake or the pull was
    cancelled, and whatever ``fill`` raises.
    """
    assert pull.pinned is not None
    num_slots = len(region) // pull.slot_bytes
    conn.settimeout(stall_timeout_s)
    sent = acked = 0
    plan = plan_chunks(len(pull.pinned.block_ids), pull.block_nbytes, pull.slot_bytes, pull.max_pieces)
    for seq, specs in enumerate(plan):
        if seq >= num_slots:
            _expect_ack(conn, acked, pull)
            acked += 1
        base = (seq % num_slots) * pull.slot_bytes
        entries = pull.fill(region[base : base + pull.slot_bytes], specs)
        send_frame(conn, SLOT, encode_slot(seq, seq % num_slots, entries))
        sent += 1
    pull.unpin()  # every byte is in the region: the blocks may go
    while acked < sent:
        _expect_ack(conn, acked, pull)
        acked += 1


def _expect_ack(conn: socket.socket, seq: int, pull: HolderPull) -> None:
    kind, payload, _ = recv_frame(conn)
    if kind != ACK or decode_seq(payload) != seq:
        raise TransferError(f"puller broke the handshake: frame {kind} where the ACK of slot {seq} was due")
    if pull.cancelled:
        raise TransferError("the pull was cancelled")
    if pull.guard is not None:
        pull.guard.progress()


def read_pull(sock: socket.socket, region: memoryview, slot_bytes: int, offer: PullOffer, receiver: BlockReceiver,
              deadline: float, max_pieces: int, silence_s: float = math.inf) -> None:  # fmt: skip
    """The puller's side of one pull on the region's channel ``sock``: GO, then every SLOT checked
    and copied into ``receiver`` and acknowledged, until all of the offer's blocks arrived.

    Raises ``ShmUnavailable`` when the holder refuses the GO (nothing written, the region is intact),
    else a ``TransferError``: ``ChecksumError``/``InvalidPullError`` from the checks,
    ``TransferTimeoutError`` past ``deadline`` or when the holder sends no frame for ``silence_s``,
    ``PeerUnavailableError`` when the channel fails,
    ``TransferError`` when the holder reports a failure.
    """
    num_slots = len(region) // slot_bytes
    total = len(offer.blocks) * offer.block_nbytes
    got = seq = 0
    try:
        _settimeout(sock, deadline)
        send_frame(sock, GO, offer.ticket)
        while got < total:
            _settimeout(sock, min(deadline, time.monotonic() + silence_s))
            kind, payload, _ = recv_frame(sock)
            if kind == REFUSED and seq == 0:
                raise ShmUnavailable(f"holder refused the pull: {payload.decode(errors='replace')}")
            if kind == FAILED:
                raise TransferError(f"holder failed the pull: {payload.decode(errors='replace')}")
            if kind != SLOT:
                raise InvalidPullError(f"unexpected frame {kind} on the region's channel")
            frame = decode_slot(payload)
            if frame.seq != seq or frame.slot != seq % num_slots:
                raise InvalidPullError(f"slot {frame.slot} of chunk {frame.seq} arrived, chunk {seq} in slot "
                                       f"{seq % num_slots} was due")  # fmt: skip
            got += _accept_slot(region, frame.slot * slot_bytes, slot_bytes, frame.entries, seq, offer, receiver,
                                max_pieces)  # fmt: skip
            try:
                send_frame(sock, ACK, encode_seq(seq))
            except OSError:  # the holder ended the channel: the next recv reads why (FAILED) or its end
                pass
            seq += 1
    except TimeoutError as exc:
        raise TransferTimeoutError(f"region pull stalled after {got} of {total} bytes: {exc}") from exc
    except FrameError as exc:
        raise PeerUnavailableError(f"holder's region channel failed after {got} of {total} bytes: {exc}") from exc
    except OSError as exc:
        raise PeerUnavailableError(f"holder's region channel failed: {exc}") from exc


def _accept_slot(region: memoryview, base: int, slot_bytes: int, entries: tuple[SlotEntry, ...], seq: int,
                 offer: PullOffer, receiver: BlockReceiver, max_pieces: int) -> int:  # fmt: skip
    """Hand one slot's pieces (views of the region, released after) to ``receiver``; its bytes."""
    if not entries or len(entries) > max_pieces:
        raise InvalidPullError(f"slot of chunk {seq} carries {len(entries)} pieces (1 to {max_pieces})")
    pieces: list[Piece] = []
    pos, end = base, base + slot_bytes
    try:
        for e in entries:
            if e.position >= len(offer.blocks) or e.length > end - pos:
                raise InvalidPullError(f"chunk {seq}: piece of block {e.position} ({e.length} bytes) outside "
                                       f"the pull or its slot")  # fmt: skip
            b = offer.blocks[e.position]
            pieces.append(Piece(b.index, b.block_hash, b.num_tokens, e.offset, region[pos : pos + e.length],
                                e.checksum))  # fmt: skip
            pos += e.length
        receiver.accept(Chunk(seq, len(offer.blocks), offer.total_tokens, offer.block_nbytes, tuple(pieces)))
    finally:
        for p in pieces:
            p.data.release()  # type: ignore[union-attr]
    return pos - base


def _settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
