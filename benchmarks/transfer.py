"""KV transfer benchmark: pulling KV blocks over gRPC vs a raw TCP socket, between two processes.

A holder process (this module with ``--serve``) fills a KV tensor of at least
``--total-mb`` MiB, leases all of its blocks and serves them over the KV wire, and also
sends the same bytes over a plain TCP socket (``sendall`` of the whole tensor). This
process pulls them with ``KVTransferClient.pull_into`` into its own KV tensor, and with
``recv_into`` straight into a tensor (the best a socket can do), over loopback. For each
(block size, chunk size) it reports the median GB/s (10**9 bytes/s) of ``--repeats`` runs
and the gRPC/raw ratio; every pulled tensor is verified against the holder's checksum.

The ``bare gRPC`` row is the ceiling of any design that keeps gRPC (Python) as the wire: a
server-streaming method of raw ``bytes`` messages, built once before the timed region, each
copied once into the tensor on arrival (no protobuf, no checksum, no lease): what grpcio itself
moves between two processes on this machine.

Run: ``python -m benchmarks.transfer`` or ``pdserve bench transfer [--json]``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch
import xxhash

from pdserve.benchmarks.common import emit
from pdserve.engine.kv_handover import KVHandover
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import MiB, TransferConfig
from pdserve.kvtransfer.server import start_transfer_server
from pdserve.kvtransfer.source import BlockSource

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 8, 128  # float16: 64 KiB per layer per block


def layout_for(num_layers: int) -> KVLayout:
    return KVLayout(num_layers, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, torch.float16)


def tensor_digest(kv: KVTensor) -> str:
    return xxhash.xxh3_64_hexdigest(kv.tensor.reshape(-1).view(torch.uint8).numpy())


# -- holder process -----------------------------------------------------------------------
def serve(num_layers: int, total_bytes: int, chunk_cap: int) -> int:
    layout = layout_for(num_layers)
    num_blocks = -(-total_bytes // layout.block_nbytes)
    kv = KVTensor(layout, num_blocks)
    kv.tensor.reshape(-1).view(torch.int16).random_(generator=torch.Generator().manual_seed(0))
    manager = KVCacheManager(num_blocks, layout.block_size, enable_caching=False)
    req = Request("bench", [i % 32000 for i in range(num_blocks * layout.block_size)], SamplingParams(), layout.block_size)
    manager.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    config = TransferConfig(chunk_bytes=chunk_cap, lease_ttl_s=3600.0)
    handover = KVHandover(manager, kv)
    source = BlockSource(handover, model_fingerprint="bench", worker_id="holder", config=config)
    lease_id = source.lease(handover.hold(req, req.num_tokens))
    server = start_transfer_server(source, config)
    bare = _bare_grpc_server(kv, chunk_cap)

    raw = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(kv.tensor.reshape(-1).view(torch.uint8).numpy())

    def raw_loop() -> None:
        while True:
            conn, _ = raw.accept()
            with conn:
                conn.recv(1)  # the puller's "go"
                conn.sendall(payload)

    threading.Thread(target=raw_loop, daemon=True).start()
    ready = {"grpc_port": server.port, "raw_port": raw.getsockname()[1], "lease_id": lease_id,
             "num_blocks": num_blocks, "digest": tensor_digest(kv), "bare_port": bare[1]}  # fmt: skip
    print("READY " + json.dumps(ready), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    server.stop(0)
    bare[0].stop(0)
    return 0


_BARE_METHOD = "/bench.Bare/Stream"


def _bare_grpc_server(kv: KVTensor, chunk_cap: int) -> tuple[grpc.Server, int]:
    """A raw-bytes streaming method: the request names a chunk size, the answer is the tensor in
    messages of that size, all built before the first call."""
    flat = kv.tensor.reshape(-1).view(torch.uint8).numpy()
    cache: dict[int, list[bytes]] = {}

    def stream(request: bytes, _context: grpc.ServicerContext):
        size = int(request.decode())
        if size not in cache:
            cache[size] = [flat[i : i + size].tobytes() for i in range(0, len(flat), size)]
        yield from cache[size]

    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),  # bytes in, bytes out: no serializers
    })  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
        ("grpc.max_send_message_length", chunk_cap + MiB), ("grpc.max_receive_message_length", chunk_cap + MiB)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for size in (MiB, 4 * MiB, 16 * MiB):  # build the messages outside every timed region
        if size <= chunk_cap:
            cache[size] = [flat[i : i + size].tobytes() for i in range(0, len(flat), size)]
    return server, port


def bare_pull(channel: grpc.Channel, chunk: int, dest: KVTensor) -> float:
    view = memoryview(dest.tensor.reshape(-1).view(torch.uint8).numpy())
    call = channel.unary_stream(_BARE_METHOD)
    t0 = time.perf_counter()
    offset = 0
    for message in call(str(chunk).encode()):
        view[offset : offset + len(message)] = message
        offset += len(message)
    elapsed = time.perf_counter() - t0
    if offset != len(view):
        raise RuntimeError(f"bare gRPC delivered {offset} of {len(view)} bytes")
    return elapsed


# -- puller -------------------------------------------------------------------------------
def raw_pull(port: int, dest: KVTensor) -> float:
    view = memoryview(dest.tensor.reshape(-1).view(torch.uint8).numpy())
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"g")
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"raw socket closed after {got} of {len(view)} bytes")
            got += n
    return time.perf_counter() - t0


def bench_layout(num_layers: int, chunks: list[int], total_bytes: int, repeats: int) -> list[dict]:
    layout = layout_for(num_layers)
    cmd = [sys.executable, "-m", "pdserve.benchmarks.transfer", "--serve", "--num-layers", str(num_layers),
           "--total-mb", str(total_bytes // MiB), "--chunk-cap", str(max(chunks))]  # fmt: skip
    holder = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"holder failed to start: {line!r}")
        info = json.loads(line[len("READY ") :])
        n = info["num_blocks"]
        dest = KVTensor(layout, n)
        nbytes = n * layout.block_nbytes

        raw_times = []
        for _ in range(repeats):
            dest.tensor.zero_()
            raw_times.append(raw_pull(info["raw_port"], dest))
            if tensor_digest(dest) != info["digest"]:
                raise RuntimeError("raw socket delivered wrong bytes")
        raw_gbps = nbytes / statistics.median(raw_times) / 1e9

        rows = []
        for chunk in chunks:
            config = TransferConfig(chunk_bytes=chunk, pull_timeout_s=600.0)
            with KVTransferClient(f"127.0.0.1:{info['grpc_port']}", config) as client:
                client.metadata()  # connect outside the timed region, as the raw socket's peer is listening
                times = []
                for _ in range(repeats):
                    dest.tensor.zero_()
                    t0 = time.perf_counter()
                    stats = client.pull_into(dest, list(range(n)), lease_id=info["lease_id"])
                    times.append(time.perf_counter() - t0)
                    if stats.num_bytes != nbytes or tensor_digest(dest) != info["digest"]:
                        raise RuntimeError("gRPC pull delivered wrong bytes")
            grpc_gbps = nbytes / statistics.median(times) / 1e9
            bare_times = []
            opts = [("grpc.max_receive_message_length", chunk + MiB)]
            with grpc.insecure_channel(f"127.0.0.1:{info['bare_port']}", options=opts) as channel:
                grpc.channel_ready_future(channel).result(timeout=30)
                for _ in range(repeats):
                    dest.tensor.zero_()
                    bare_times.append(bare_pull(channel, chunk, dest))
                    if tensor_digest(dest) != info["digest"]:
                        raise RuntimeError("bare gRPC delivered wrong bytes")
            bare_gbps = nbytes / statistics.median(bare_times) / 1e9
            rows.append({
                "bare_grpc_gbps": bare_gbps, "bare_grpc_over_raw": bare_gbps / raw_gbps,
                "block_nbytes": layout.block_nbytes, "chunk_bytes": chunk, "num_blocks": n, "total_bytes": nbytes,
                "num_chunks": stats.num_chunks, "grpc_gbps": grpc_gbps, "raw_tcp_gbps": raw_gbps,
                "grpc_over_raw": grpc_gbps / raw_gbps, "grpc_seconds": times, "raw_seconds": raw_times,
            })  # fmt: skip
        return rows
    finally:
        if holder.stdin:
            holder.stdin.close()
        try:
            holder.wait(30)
        except subprocess.TimeoutExpired:
            holder.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=256, help="MiB of KV blocks per pull (>= 256 for the report)")
    ap.add_argument("--layers", default="4,32", help="comma-separated num_layers; blocks are layers * 64 KiB")
    ap.add_argument("--chunk-mb", default="1,4,16", help="comma-separated chunk sizes in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--num-layers", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-cap", type=int, default=16 * MiB, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    total = args.total_mb * MiB
    if args.serve:
        return serve(args.num_layers, total, args.chunk_cap)

    chunks = [int(float(c) * MiB) for c in args.chunk_mb.split(",")]
    rows = [r for layers in (int(x) for x in args.layers.split(",")) for r in bench_layout(layers, chunks, total, args.repeats)]
    emit(
        {"benchmark": "transfer", "repeats": args.repeats, "results": rows},
        args.json,
        [
            (
                f"block {r['block_nbytes'] // 1024} KiB, chunk {r['chunk_bytes'] / MiB:g} MiB, {r['total_bytes'] / MiB:.0f} MiB",
                f"gRPC {r['grpc_gbps']:.2f} GB/s | raw TCP {r['raw_tcp_gbps']:.2f} GB/s | ratio {r['grpc_over_raw']:.2f}"
                f" | bare gRPC {r['bare_grpc_gbps']:.2f} GB/s, ratio {r['bare_grpc_over_raw']:.2f}",
            )
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
