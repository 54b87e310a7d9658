"""KV transfer benchmark: pulling KV blocks over gRPC and shared memory vs a raw TCP socket, between two processes.

A holder process (this module with ``--serve``) fills a KV tensor of at least
``--total-mb`` MiB, leases all of its blocks and serves them over the KV wire, and also
sends the same bytes over a plain TCP socket (``sendall`` of the whole tensor). This
process pulls them with ``KVTransferClient.pull_into`` into its own KV tensor, once with the
gRPC stream and once by the same-host transport (``shm``: through the puller's staging region for
the holder, a ring of slots the holder fills while the puller checks and copies the previous one;
``--shm-region-mb`` and ``--shm-slot-mb`` size it), and with ``recv_into`` straight into a
tensor (the best a socket can do), over loopback; ``memcpy`` is one copy of the same bytes
between two tensors of this process (a single-threaded slice assignment: what no transport that
copies the bytes can beat). Each round
pulls once by every method, one after the other; for each (block size, chunk size) it reports
the median GB/s (10**9 bytes/s) of ``--repeats`` rounds, the median of the per-round ratios
(shared machines drift between rounds, less within one), and the CPU seconds each process spent
and minor page faults per GB (read from /proc, all threads, gRPC's included). Every pulled
tensor is verified against the holder's checksum.

The ``bare gRPC`` row is the ceiling of any design that keeps gRPC (Python) as the wire: a
server-streaming method of raw ``bytes`` messages, built once before the timed region, each
copied once into the tensor on arrival (no protobuf, no checksum, no lease): what grpcio itself
moves between two processes on this machine.

``--json`` prints, per row, ``raw_tcp`` and ``memcpy`` and, per transport, ``transports.<name>``
with its ``gbps``, ``over_raw`` and ``over_memcpy`` (medians of per-round ratios).

Run: ``python -m benchmarks.transfer`` or ``pdserve bench transfer [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
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
from pdserve.kvtransfer.allocator import tune_malloc
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import MiB, TransferConfig
from pdserve.kvtransfer.server import start_transfer_server
from pdserve.kvtransfer.source import BlockSource

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 8, 128  # float16: 64 KiB per layer per block


def layout_for(num_layers: int) -> KVLayout:
    return KVLayout(num_layers, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, torch.float16)


def tensor_digest(kv: KVTensor) -> str:
    return xxhash.xxh3_64_hexdigest(kv.host_bytes())


# -- holder process -----------------------------------------------------------------------
def serve(num_layers: int, total_bytes: int, chunks: list[int]) -> int:
    tune_malloc()  # as a worker does
    layout = layout_for(num_layers)
    num_blocks = -(-total_bytes // layout.block_nbytes)
    kv = KVTensor(layout, num_blocks)
    kv.tensor.reshape(-1).view(torch.int16).random_(generator=torch.Generator().manual_seed(0))
    manager = KVCacheManager(num_blocks, layout.block_size, enable_caching=False)
    req = Request("bench", [i % 32000 for i in range(num_blocks * layout.block_size)], SamplingParams(), layout.block_size)
    manager.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    config = TransferConfig(chunk_bytes=max(chunks), lease_ttl_s=3600.0)
    handover = KVHandover(manager, kv)
    source = BlockSource(handover, model_fingerprint="bench", worker_id="holder", config=config)
    lease_id = source.lease(handover.hold(req, req.num_tokens))
    server = start_transfer_server(source, config)
    bare = _bare_grpc_server(kv, chunks)

    raw = socket.create_server(("127.0.0.1", 0))
    payload = kv.host_bytes()

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


def _bare_grpc_server(kv: KVTensor, chunks: list[int]) -> tuple[grpc.Server, int]:
    """A raw-bytes streaming method: the request names a chunk size (one of ``chunks``), the answer
    is the tensor in messages of that size, all built before the first call."""
    flat = kv.host_bytes()
    cache = {size: [flat[i : i + size].tobytes() for i in range(0, len(flat), size)] for size in chunks}

    def stream(request: bytes, context: grpc.ServicerContext):
        messages = cache.get(int(request.decode()))
        if messages is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no messages built for chunk {request!r}")
        yield from messages

    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),  # bytes in, bytes out: no serializers
    })  # fmt: skip
    limit = max(chunks) + MiB
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
        ("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)])  # fmt: skip
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def bare_pull(channel: grpc.Channel, chunk: int, dest: KVTensor) -> None:
    view = dest.host_bytes()
    offset = 0
    for message in channel.unary_stream(_BARE_METHOD)(str(chunk).encode()):
        view[offset : offset + len(message)] = message
        offset += len(message)
    if offset != len(view):
        raise RuntimeError(f"bare gRPC delivered {offset} of {len(view)} bytes")


# -- puller -------------------------------------------------------------------------------
def raw_pull(port: int, dest: KVTensor) -> None:
    view = dest.host_bytes()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"g")
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"raw socket closed after {got} of {len(view)} bytes")
            got += n


def memcpy(source: KVTensor, dest: KVTensor) -> None:
    dest.host_bytes()[:] = source.host_bytes()  # one memcpy, one thread (as the receivers copy)


def process_usage(pid: int) -> tuple[float, int] | None:
    """CPU seconds (user + system, all threads) and minor page faults of a live process; None
    where /proc is absent."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


@dataclass
class Method:
    """One way of moving the bytes, timed with the CPU both processes spent on each pull."""

    name: str
    pull: Callable[[], None]
    seconds: list[float] = field(default_factory=list)
    holder: list[tuple[float, int]] = field(default_factory=list)  # (CPU s, page faults) per pull
    puller: list[tuple[float, int]] = field(default_factory=list)

    def run(self, holder_pid: int) -> None:
        h0, p0, t0 = process_usage(holder_pid), process_usage(os.getpid()), time.perf_counter()
        self.pull()
        self.seconds.append(time.perf_counter() - t0)
        h1, p1 = process_usage(holder_pid), process_usage(os.getpid())
        for before, after, into in ((h0, h1, self.holder), (p0, p1, self.puller)):
            if before is not None and after is not None:
                into.append((after[0] - before[0], after[1] - before[1]))

    def summary(self, nbytes: int) -> dict:
        gb = nbytes / 1e9
        out: dict = {"gbps": gb / statistics.median(self.seconds), "seconds": self.seconds}
        for name, usage in (("holder", self.holder), ("puller", self.puller)):
            out[f"{name}_cpu_s_per_gb"] = statistics.median(u[0] for u in usage) / gb if usage else None
            out[f"{name}_page_faults_per_gb"] = statistics.median(u[1] for u in usage) / gb if usage else None
        return out


def bench_layout(num_layers: int, chunks: list[int], total_bytes: int, repeats: int,
                 shm_config: TransferConfig | None = None) -> list[dict]:  # fmt: skip
    """For each chunk size: ``repeats`` rounds of raw TCP, our gRPC pull, bare gRPC, our shm pull
    and memcpy, one after the other in each round, so that every ratio compares pulls made moments apart.
    ``shm_config``: the puller's ``shm_*`` settings (default: ``TransferConfig``'s)."""
    layout = layout_for(num_layers)
    cmd = [sys.executable, "-m", "pdserve.benchmarks.transfer", "--serve", "--num-layers", str(num_layers),
           "--total-mb", str(total_bytes // MiB), "--chunk-bytes", ",".join(map(str, chunks))]  # fmt: skip
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
        raw_pull(info["raw_port"], dest)
        source = KVTensor(layout, n)  # memcpy's source: the holder's bytes, in this process
        source.host_bytes()[:] = dest.host_bytes()
        rows = []
        for chunk in chunks:
            config = replace(shm_config or TransferConfig(), chunk_bytes=chunk, pull_timeout_s=600.0)
            opts = [("grpc.max_receive_message_length", chunk + MiB)]
            address = f"127.0.0.1:{info['grpc_port']}"
            with KVTransferClient(address, replace(config, shm=False)) as client, \
                    KVTransferClient(address, config) as shm_client, \
                    grpc.insecure_channel(f"127.0.0.1:{info['bare_port']}", options=opts) as channel:  # fmt: skip
                client.metadata()  # connect outside the timed region, as the raw socket's peer is listening
                if not shm_client.metadata().shm_socket:
                    raise RuntimeError("the holder offers no shared-memory transport")
                grpc.channel_ready_future(channel).result(timeout=30)
                chunk_counts: list[int] = []

                def pull_with(c: KVTransferClient, transport: str) -> None:
                    stats = c.pull_into(dest, list(range(n)), lease_id=info["lease_id"])
                    if stats.num_bytes != nbytes or stats.transport != transport:
                        raise RuntimeError(f"{transport} pull delivered {stats.num_bytes} of {nbytes} bytes by "
                                           f"{stats.transport}")  # fmt: skip
                    if transport == "grpc":
                        chunk_counts.append(stats.num_chunks)

                methods = [Method("raw", lambda: raw_pull(info["raw_port"], dest)),
                           Method("ours", lambda: pull_with(client, "grpc")),
                           Method("bare", lambda: bare_pull(channel, chunk, dest)),
                           Method("shm", lambda: pull_with(shm_client, "shm")),
                           Method("memcpy", lambda: memcpy(source, dest))]  # fmt: skip
                for m in methods:  # one untimed round: connections, first-touch of buffers
                    m.pull()
                for _ in range(repeats):
                    for m in methods:
                        dest.tensor.zero_()
                        m.run(holder.pid)
                        if tensor_digest(dest) != info["digest"]:
                            raise RuntimeError(f"{m.name} delivered wrong bytes")
            raw, grpc_pull, bare, shm, copy = methods
            per_round = lambda a, b: statistics.median(x / y for x, y in zip(a.seconds, b.seconds))  # noqa: E731
            transports = {name: {**m.summary(nbytes), "over_raw": per_round(raw, m), "over_memcpy": per_round(copy, m)}
                          for name, m in (("grpc", grpc_pull), ("shm", shm))}  # fmt: skip
            rows.append({
                "block_nbytes": layout.block_nbytes, "chunk_bytes": chunk, "num_blocks": n, "total_bytes": nbytes,
                "num_chunks": chunk_counts[-1], "raw_tcp": raw.summary(nbytes), "grpc": transports["grpc"],
                "bare_grpc": bare.summary(nbytes), "memcpy": copy.summary(nbytes), "transports": transports,
                "grpc_over_raw": per_round(raw, grpc_pull), "bare_grpc_over_raw": per_round(raw, bare),
                "grpc_over_bare": per_round(bare, grpc_pull), "shm_over_raw": per_round(raw, shm),
            })  # fmt: skip
        return rows
    finally:
        if holder.stdin:
            holder.stdin.close()
        try:
            holder.wait(30)
        except subprocess.TimeoutExpired:
            holder.kill()


def _cpu(summary: dict) -> str:
    return "/".join("-" if summary[k] is None else f"{summary[k]:.2f}" for k in ("holder_cpu_s_per_gb", "puller_cpu_s_per_gb"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=256, help="MiB of KV blocks per pull (>= 256 for the report)")
    ap.add_argument("--layers", default="4,32", help="comma-separated num_layers; blocks are layers * 64 KiB")
    ap.add_argument("--chunk-mb", default="1,4,16", help="comma-separated chunk sizes in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shm-region-mb", type=float, default=TransferConfig.shm_region_bytes / MiB,
                    help="the puller's staging region per holder (transfer.shm_region_bytes)")
    ap.add_argument("--shm-slot-mb", type=float, default=TransferConfig.shm_slot_bytes / MiB,
                    help="the region's ring slots (transfer.shm_slot_bytes)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--malloc-defaults", action="store_true",
                    help="keep glibc's malloc defaults in both processes (workers raise its thresholds)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--num-layers", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-bytes", default=str(MiB), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    total = args.total_mb * MiB
    if args.serve:
        return serve(args.num_layers, total, [int(c) for c in args.chunk_bytes.split(",")])

    chunks = [int(float(c) * MiB) for c in args.chunk_mb.split(",")]
    if args.malloc_defaults:
        os.environ["PDSERVE_MALLOC_TUNING"] = "0"  # the holder inherits it
    malloc_tuned = tune_malloc()
    shm = TransferConfig(shm_region_bytes=int(args.shm_region_mb * MiB), shm_slot_bytes=int(args.shm_slot_mb * MiB))
    rows = [r for layers in (int(x) for x in args.layers.split(","))
            for r in bench_layout(layers, chunks, total, args.repeats, shm)]  # fmt: skip
    emit(
        {"benchmark": "transfer", "repeats": args.repeats, "malloc_tuned": malloc_tuned,
         "shm_region_bytes": shm.shm_region_bytes, "shm_slot_bytes": shm.shm_slot_bytes, "results": rows},
        args.json,
        [
            (
                f"block {r['block_nbytes'] // 1024} KiB, chunk {r['chunk_bytes'] / MiB:g} MiB, {r['total_bytes'] / MiB:.0f} MiB",
                f"gRPC {r['grpc']['gbps']:.2f} GB/s | shm {r['transports']['shm']['gbps']:.2f} | raw TCP"
                f" {r['raw_tcp']['gbps']:.2f} | bare gRPC {r['bare_grpc']['gbps']:.2f}"
                f" | memcpy {r['memcpy']['gbps']:.2f}"
                f" | ours/raw {r['grpc_over_raw']:.2f} shm/raw {r['shm_over_raw']:.2f}"
                f" shm/memcpy {r['transports']['shm']['over_memcpy']:.2f} bare/raw {r['bare_grpc_over_raw']:.2f}"
                f" ours/bare {r['grpc_over_bare']:.2f} | CPU s/GB holder/puller: ours {_cpu(r['grpc'])}"
                f" shm {_cpu(r['transports']['shm'])} raw {_cpu(r['raw_tcp'])} bare {_cpu(r['bare_grpc'])}",
            )
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
