"""The region channel's frames and the puller's checks of a holder that breaks the ring's handshake:
a real region (memfd mapped by both ends) and a connected Unix socket pair, a scripted holder on the
other end. (The well-behaved holder is tests/kvtransfer/test_shm.py's, over real gRPC.)"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from pdserve.engine.kv_tensor import KVTensor
from pdserve.kvtransfer.errors import ChecksumError, InvalidPullError, PeerUnavailableError, TransferError
from pdserve.kvtransfer.receiver import BlockReceiver
from pdserve.kvtransfer.shm import PullOffer, RegionBlock, ShmUnavailable, create_region, map_region
from pdserve.kvtransfer.shm_frames import (
    ACK,
    FAILED,
    GO,
    MAX_PAYLOAD,
    REFUSED,
    SLOT,
    FrameError,
    SlotEntry,
    decode_seq,
    decode_slot,
    encode_slot,
    recv_frame,
    send_frame,
)
from pdserve.kvtransfer.shm_ring import read_pull
from pdserve.kvtransfer.wire import checksum
from tests.kvtransfer.test_transfer import LAYOUT, LOCAL_BLOCKS

BLOCK = LAYOUT.block_nbytes  # 1 KiB
REGION, SLOT_BYTES = 4096, 2048  # two slots of two blocks


Ring = tuple[socket.socket, socket.socket, np.ndarray, memoryview]


@pytest.fixture
def ring() -> Iterator[Ring]:
    """(puller's end, holder's end, the holder's writable view, the puller's read-only view)."""
    fd = create_region(REGION)
    writable, readable = map_region(fd, REGION, writable=True), map_region(fd, REGION, writable=False)
    os.close(fd)
    puller, holder = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    view = memoryview(readable)
    try:
        yield puller, holder, np.frombuffer(writable, dtype=np.uint8), view
    finally:
        puller.close()
        holder.close()
        view.release()


def offer(num_blocks: int) -> PullOffer:
    blocks = tuple(RegionBlock(i, bytes([i]) * 16, LAYOUT.block_size) for i in range(num_blocks))
    return PullOffer(ticket=b"t" * 32, block_nbytes=BLOCK, total_tokens=num_blocks * LAYOUT.block_size, blocks=blocks)


def put(region: np.ndarray, slot: int, pieces: list[tuple[int, int]], seed: int = 0) -> list[SlotEntry]:
    """Write whole blocks ``(position, fill byte)`` back to back into ``slot``; their entries."""
    entries, pos = [], slot * SLOT_BYTES
    for position, fill in pieces:
        region[pos : pos + BLOCK] = fill
        entries.append(SlotEntry(position, 0, BLOCK, checksum(bytes([fill]) * BLOCK)))
        pos += BLOCK
    return entries


def pull(puller: socket.socket, view: memoryview, num_blocks: int) -> KVTensor:
    kv = KVTensor(LAYOUT, LOCAL_BLOCKS)
    receiver = BlockReceiver(kv, list(range(num_blocks)))
    read_pull(puller, view, SLOT_BYTES, offer(num_blocks), receiver, time.monotonic() + 10, 1024)
    receiver.finish()
    return kv


def test_frames_round_trip_and_refuse_what_is_not_a_frame() -> None:
    entries = [SlotEntry(3, 512, 1024, 2**64 - 1), SlotEntry(0, 0, 7, 5)]
    frame = decode_slot(encode_slot(9, 1, entries))
    assert (frame.seq, frame.slot, list(frame.entries)) == (9, 1, entries)
    with pytest.raises(FrameError, match="SLOT of 67 bytes announces 2 pieces"):
        decode_slot(encode_slot(9, 1, entries)[:-1])
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, ACK, b"\x01\x00\x00\x00")
        kind, payload, fds = recv_frame(b)
        assert (kind, decode_seq(payload), fds) == (ACK, 1, [])
        a.sendall(bytes([SLOT]) + (MAX_PAYLOAD + 1).to_bytes(4, "little"))
        with pytest.raises(FrameError, match="at most"):
            recv_frame(b)
        a.sendall(bytes([SLOT]) + (10).to_bytes(4, "little") + b"short")
        a.close()
        with pytest.raises(FrameError, match="closed after 5 of 10 bytes"):
            recv_frame(b)


def test_the_puller_lands_a_pull_that_goes_round_the_ring(ring: Ring) -> None:
    puller, holder, region, view = ring
    holder.settimeout(10)
    with ThreadPoolExecutor(1) as pool:
        landed = pool.submit(pull, puller, view, 6)
        assert recv_frame(holder)[0] == GO
        for seq in range(3):  # what a holder does, scripted: 3 chunks of 2 blocks through 2 slots
            if seq >= 2:  # slot 0 again: only after its ACK
                kind, payload, _ = recv_frame(holder)
                assert (kind, decode_seq(payload)) == (ACK, seq - 2)
            entries = put(region, seq % 2, [(2 * seq, 10 + 2 * seq), (2 * seq + 1, 11 + 2 * seq)])
            send_frame(holder, SLOT, encode_slot(seq, seq % 2, entries))
        assert [decode_seq(recv_frame(holder)[1]) for _ in range(2)] == [1, 2]
        kv = landed.result(10)
    for j in range(6):
        assert torch.equal(kv.block_bytes(j), torch.full((BLOCK,), 10 + j, dtype=torch.uint8))


@pytest.mark.parametrize("fault", ["refused", "failed", "wrong_seq", "wrong_slot", "past_the_slot", "checksum",
                                   "hang_up"])  # fmt: skip
def test_the_puller_refuses_a_holder_that_breaks_the_handshake(ring: Ring, fault: str) -> None:
    puller, holder, region, view = ring
    expected: type[BaseException] = InvalidPullError
    entries = put(region, 0, [(0, 1), (1, 2)])
    frame: tuple[int, bytes] = (SLOT, encode_slot(0, 0, entries))
    if fault == "refused":
        frame, expected = (REFUSED, b"unknown, used or expired pull ticket"), ShmUnavailable
    elif fault == "failed":
        frame, expected = (FAILED, b"the holder's KV tensor cannot be read"), TransferError
    elif fault == "wrong_seq":
        frame = (SLOT, encode_slot(1, 1, entries))
    elif fault == "wrong_slot":
        frame = (SLOT, encode_slot(0, 1, entries))
    elif fault == "past_the_slot":  # three blocks announced in a slot of two: the third would lie in the next
        frame = (SLOT, encode_slot(0, 0, [*entries, SlotEntry(2, 0, BLOCK, 0)]))
    elif fault == "checksum":
        frame, expected = (SLOT, encode_slot(0, 0, [entries[0], SlotEntry(1, 0, BLOCK, entries[1].checksum ^ 1)])), \
            ChecksumError  # fmt: skip
    send_frame(holder, *frame)
    if fault == "hang_up":  # after the first of two slots: the puller takes it, then finds the channel gone
        holder.close()
        expected = PeerUnavailableError
    with pytest.raises(expected):
        pull(puller, view, 4)
