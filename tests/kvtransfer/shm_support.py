"""The in-process holder and the checks that the same-host transport's tests share
(tests/kvtransfer/test_shm.py, test_shm_regions.py): a holder behind the KV-handover API whose servicer
a test can bend, and what a process maps and holds open of the regions. The puller's regions are small
here (4 KiB rings of 1.5 KiB slots, 1 KiB blocks), so pulls wrap around their ring and blocks are split
across slots."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np

from pdserve.engine.kv_handover import KVHandover
from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.server import KVTransferServicer, start_transfer_server
from pdserve.kvtransfer.shm import create_region, host_id
from pdserve.kvtransfer.shm_ring import HolderPull
from pdserve.kvtransfer.shm_server import HolderRegion
from pdserve.kvtransfer.shm_socket import attach_region
from pdserve.kvtransfer.source import BlockSource
from pdserve.kvtransfer.wire import PieceSpec
from pdserve.security import ClusterAuth
from pdserve.v1 import kvtransfer_pb2 as pb
from pdserve.v1 import kvtransfer_pb2_grpc as pb_grpc
from tests.kvtransfer.test_transfer import CHUNK, FP, LAYOUT, LOCAL_BLOCKS, expected
from tests.support.polling import wait_until

SECRET = "a-cluster-secret-for-shm-tests"
REGION, SLOT_BYTES = 4096, 1536
SHM = TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=20.0, shm_region_bytes=REGION, shm_slot_bytes=SLOT_BYTES)
GRPC = replace(SHM, shm=False)


def region_fds(pid: int | str = "self") -> list[str]:
    """The process's open descriptors that are our regions' memfds."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith("/memfd:pdserve-kv"):
            out.append(target)
    return out


def region_maps(pid: int | str = "self") -> int:
    """How many of the process's mappings are of our regions."""
    return sum("/memfd:pdserve-kv" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def nothing_mapped(pid: int | str = "self") -> bool:
    return region_maps(pid) == 0 and region_fds(pid) == []


class BentPull(HolderPull):
    """A region pull that corrupts a piece's checksum, or fails, in the slot a test names."""

    corrupt_slot = -1
    fail_slot = -1

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.slots = 0

    def fill(self, slot: np.ndarray, specs: list[PieceSpec]):  # type: ignore[no-untyped-def]
        entries = super().fill(slot, specs)
        k, self.slots = self.slots, self.slots + 1
        if k == self.fail_slot:
            raise RuntimeError("the holder's KV tensor cannot be read")
        if k == self.corrupt_slot:  # the bytes stay, the checksum no longer matches them
            entries[0] = replace(entries[0], checksum=entries[0].checksum ^ 1)
        return entries


class BentServicer(KVTransferServicer):
    """The real servicer, with what a test asks bent: the advertised host id or socket, or the
    slot its region pulls corrupt or fail. Counts AttachRegion and PullRegion calls."""

    def __init__(self, source: BlockSource) -> None:
        super().__init__(source)
        self.host_id: str | None = None
        self.socket: str | None = None
        self.corrupt_slot = self.fail_slot = -1
        self.attach_calls = self.pull_calls = 0

    def GetMetadata(self, request, context):  # type: ignore[override]
        msg = super().GetMetadata(request, context)
        if self.host_id is not None:
            msg.host_id = self.host_id
        if self.socket is not None:
            msg.shm_socket = self.socket
        return msg

    def AttachRegion(self, request, context):  # type: ignore[override]
        self.attach_calls += 1
        return super().AttachRegion(request, context)

    def PullRegion(self, request, context):  # type: ignore[override]
        self.pull_calls += 1
        return super().PullRegion(request, context)

    def _region_pull(self, region: HolderRegion, request: pb.PullRegionRequest) -> HolderPull:
        pull = super()._region_pull(region, request)
        bent = BentPull(pull.region_id, pull.slot_bytes, pull.max_pieces, pull.block_nbytes, pull.read,
                        region.end_pull)  # fmt: skip
        bent.corrupt_slot, bent.fail_slot = self.corrupt_slot, self.fail_slot
        return bent


class Holder:
    """An in-process holder (a pool behind the KV-handover API) with a ``BentServicer``."""

    def __init__(self, **config: object) -> None:
        defaults: dict[str, object] = {"chunk_bytes": CHUNK, "reap_interval_s": 0.05}
        self.config = TransferConfig(**{**defaults, **config})  # type: ignore[arg-type]
        self.manager = KVCacheManager(LOCAL_BLOCKS, LAYOUT.block_size)
        self.handover = KVHandover(self.manager, KVTensor(LAYOUT, LOCAL_BLOCKS))
        self.source = BlockSource(self.handover, model_fingerprint=FP, worker_id="inproc", config=self.config)
        self.servicer = BentServicer(self.source)
        self.server = start_transfer_server(self.source, self.config, servicer=self.servicer)
        assert self.server.shm is not None
        self.shm = self.server.shm
        self.address = self.server.address

    def lease(self, request_id: str, num_tokens: int) -> str:
        req = Request(request_id, list(range(num_tokens)), SamplingParams(), LAYOUT.block_size)
        assert self.manager.allocate_slots(req, num_tokens) is not None
        req.num_computed_tokens = num_tokens
        for j, block_id in enumerate(self.manager.get_block_ids(request_id)):
            self.handover.kv_tensor.block(block_id).copy_(expected(request_id, j))
        return self.source.lease(self.handover.hold(req, num_tokens))

    def call(self, method: str, request, secret: str | None = None):  # type: ignore[no-untyped-def]
        """An RPC by hand, as an attacker or a test would make it (signed with ``secret``)."""
        metadata = ClusterAuth(secret).metadata(f"/pdserve.v1.KVTransfer/{method}", request.SerializeToString()) \
            if secret else ()  # fmt: skip
        with grpc.insecure_channel(self.address) as channel:
            return getattr(pb_grpc.KVTransferStub(channel), method)(request, timeout=10, metadata=metadata)

    def attach(self, nbytes: int = REGION) -> tuple[socket.socket, bytes]:
        """A region attached by hand: its channel and id (the puller's mapping is not kept)."""
        grant = self.call("AttachRegion", pb.AttachRegionRequest(host_id=host_id(), region_bytes=nbytes))
        fd = create_region(nbytes)
        try:
            return attach_region(self.shm.socket_path, grant.ticket, fd, nbytes, 5)
        finally:
            os.close(fd)

    def pull_region(self, lease_id: str, region_id: bytes, host: str | None = None) -> pb.PullRegionResponse:
        request = pb.PullRegionRequest(pull=pb.PullRequest(lease_id=lease_id), region_id=region_id,
                                       host_id=host_id() if host is None else host, slot_bytes=SLOT_BYTES)  # fmt: skip
        return self.call("PullRegion", request)

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        directory = self.shm.server.directory
        self.server.stop()
        assert not os.path.exists(directory)  # the socket's private directory goes with the server
        assert wait_until(nothing_mapped), (region_maps(), region_fds())  # no region outlives it, on either end


def shm_client(address: str, config: TransferConfig = SHM) -> KVTransferClient:
    client = KVTransferClient(address, config)
    client.metadata()  # what negotiates the transport (a worker's check_compatible does it)
    return client


def pool_size(client: KVTransferClient) -> int:
    return client.shm.pool.size if client.shm.pool is not None else 0
