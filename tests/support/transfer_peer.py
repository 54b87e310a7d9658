#!/usr/bin/env python
"""A KV-block holder in its own process, for tests of the KV wire.

    python -m tests.support.transfer_peer --lease-tokens 10,7 --cached-tokens 16 [--corrupt-chunk 1] ...

Builds a KVCacheManager and a KVTensor with the given layout behind the KV-handover API; for
each ``--lease-tokens`` entry allocates a request (``lease-<k>``), fills its blocks with
deterministic data (``block_data``), caches its full blocks, holds them and puts them under a lease;
for each ``--cached-tokens`` entry (``cached-<k>``) does the same but frees the request,
leaving its full blocks in the prefix cache only. Then it serves them and prints one
ready line, ``READY {json}``, with the port, the layout, and per request its id, token
ids, block hashes (hex; "" for a partial block) and lease id. It serves until killed
(SIGTERM, or its parent gone: clean stop).

Faults: ``--corrupt-chunk N`` flips a byte of chunk N of every pull (the checksum is left
as it was); ``--stall-after-chunk N --stall-s S`` prints ``STALL <lease or hash pull>``
after sending chunk N and sleeps S seconds before the next. ``--nixl`` serves PullNixl too;
``--stall-nixl-from-block B --stall-s S`` prints ``STALL nixl`` and sleeps S seconds before writing a
NIXL window that starts at block B or later.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import xxhash

from pdserve.engine.kv_handover import KVHandover
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.server import KVTransferServicer, start_transfer_server
from pdserve.kvtransfer.source import BlockSource
from pdserve.kvtransfer.wire import Chunk


def token_ids(request_id: str, num_tokens: int) -> list[int]:
    """Deterministic, request-specific prompt tokens."""
    return [xxhash.xxh32_intdigest(f"{request_id}/{i}".encode()) % 32000 for i in range(num_tokens)]


def block_data(layout: KVLayout, seed: int, request_id: str, index: int) -> torch.Tensor:
    """The content of block ``index`` of ``request_id``: one block's tensor, seeded torch randn."""
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    gen = torch.Generator().manual_seed(xxhash.xxh64_intdigest(f"{seed}/{request_id}/{index}".encode()) >> 1)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype)


class FaultyServicer(KVTransferServicer):
    """The real servicer, with the faults the command line asks for injected into its stream."""

    def __init__(self, source: BlockSource, corrupt_chunk: int, stall_after_chunk: int, stall_s: float,
                 stall_nixl_from_block: int = -1) -> None:  # fmt: skip
        super().__init__(source)
        self.corrupt_chunk = corrupt_chunk
        self.stall_after_chunk = stall_after_chunk
        self.stall_s = stall_s
        self.stall_nixl_from_block = stall_nixl_from_block

    def PullNixl(self, request, context):  # type: ignore[override]
        if 0 <= self.stall_nixl_from_block <= request.skip_blocks:  # a later window: earlier ones landed
            print("STALL nixl", flush=True)
            time.sleep(self.stall_s)
        return super().PullNixl(request, context)

    def Pull(self, request, context) -> Iterator[Chunk]:  # type: ignore[override]
        for chunk in super().Pull(request, context):
            if chunk.seq == self.corrupt_chunk and chunk.pieces:
                first = chunk.pieces[0]
                data = bytearray(first.data)
                data[len(data) // 2] ^= 0xFF  # the checksum stays that of the true bytes
                chunk = replace(chunk, pieces=(replace(first, data=bytes(data)), *chunk.pieces[1:]))
            yield chunk
            if chunk.seq == self.stall_after_chunk:
                print(f"STALL {request.WhichOneof('source')}", flush=True)
                time.sleep(self.stall_s)


def build(args: argparse.Namespace) -> tuple[BlockSource, dict]:
    layout = KVLayout(args.num_layers, args.kv_heads, args.head_dim, args.block_size, getattr(torch, args.dtype))
    config = TransferConfig(chunk_bytes=args.chunk_bytes, lease_ttl_s=args.lease_ttl_s, nixl=args.nixl)
    manager = KVCacheManager(args.num_blocks, args.block_size)
    kv = KVTensor(layout, args.num_blocks, device=args.device)
    handover = KVHandover(manager, kv)
    source = BlockSource(handover, model_fingerprint=args.fingerprint, worker_id=args.worker_id, config=config)
    info: dict = {"worker_id": args.worker_id, "seed": args.seed, "block_nbytes": layout.block_nbytes, "requests": []}
    specs = [("lease", n) for n in _ints(args.lease_tokens)] + [("cached", n) for n in _ints(args.cached_tokens)]
    counters = {"lease": 0, "cached": 0}
    for kind, n in specs:
        rid = f"{kind}-{counters[kind]}"
        counters[kind] += 1
        req = Request(rid, token_ids(rid, n), SamplingParams(), args.block_size)
        if manager.allocate_slots(req, n) is None:
            raise SystemExit(f"--num-blocks {args.num_blocks} too small")
        req.num_computed_tokens = n
        for j, block_id in enumerate(manager.get_block_ids(rid)):
            kv.block(block_id).copy_(block_data(layout, args.seed, rid, j))
        hashes = [h.hex() for h in req.block_hashes] + ([""] if n % args.block_size else [])
        entry = {"request_id": rid, "num_tokens": n, "token_ids": req.all_token_ids, "block_hashes": hashes}
        if kind == "lease":
            entry["lease_id"] = source.lease(handover.hold(req, n))
        else:
            manager.free(req)
        info["requests"].append(entry)
    return source, info


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fingerprint", default="test-model")
    p.add_argument("--worker-id", default="peer")
    p.add_argument("--chunk-bytes", type=int, default=4 << 20)
    p.add_argument("--lease-ttl-s", type=float, default=300.0)
    p.add_argument("--lease-tokens", default="", help="comma-separated prompt lengths, one lease each")
    p.add_argument("--cached-tokens", default="", help="comma-separated prompt lengths, cached then freed")
    p.add_argument("--corrupt-chunk", type=int, default=-1)
    p.add_argument("--stall-after-chunk", type=int, default=-1)
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--device", default="cpu", help="where the KV tensor lives")
    p.add_argument("--nixl", action="store_true", help="serve PullNixl too (the NIXL library installed)")
    p.add_argument("--stall-nixl-from-block", type=int, default=-1, help="stall NIXL windows from this block on")
    args = p.parse_args(argv)

    source, info = build(args)
    servicer = FaultyServicer(source, args.corrupt_chunk, args.stall_after_chunk, args.stall_s,
                              args.stall_nixl_from_block)  # fmt: skip
    server = start_transfer_server(source, port=args.port, servicer=servicer)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=_stop_when_orphaned, args=(stop,), daemon=True).start()
    print("READY " + json.dumps({"port": server.port, **info}), flush=True)
    stop.wait()
    server.stop(0)
    return 0


def _stop_when_orphaned(stop: threading.Event) -> None:
    """A test process that dies without killing its peers (a crash) leaves none behind."""
    parent = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != parent:
            stop.set()


if __name__ == "__main__":
    sys.exit(main())
