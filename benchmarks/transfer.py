"""KV transfer benchmark: pulling KV blocks over gRPC, shared memory and NIXL vs raw TCP, between two processes.

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

Where NIXL loads (``pdserve[nixl]``, ``kvtransfer.nixl``), the holder's transfer server serves PullNixl
too and each round adds two methods. ``nixl``: our pull by NIXL (shared memory off, as a puller on
another host has it): the holder writes windows of blocks into the puller's staging region, each block
checksummed on both sides and copied once into the tensor. ``nixl_bare``: the ceiling of any design
that moves the bytes by NIXL: one READ of the same blocks, a descriptor per block, from the holder's KV
tensor (registered with a second, bench-only agent, whose full metadata the holder prints) straight
into the puller's, agents and descriptors made before the timed region (no region, no checksum, no
lease). The holder progresses that agent every 10 ms while idle (about 1% of a core) and every 0.2 ms
from the reader's untimed wake-up notification to the read's completion.

``--json`` prints, per row, ``raw_tcp`` and ``memcpy`` and, per transport, ``transports.<name>``
with its ``gbps``, ``over_raw`` and ``over_memcpy`` (medians of per-round ratios); with NIXL,
``transports.nixl`` also has ``over_bare_nixl`` (the median of per-round bare/ours time ratios) and
the row a ``nixl_bare`` summary.

Across network namespaces (``--across-netns``, benchmarks/transfer_netns.py): the same pulls between
two nodes of a simulated cluster (``pdserve.cluster.simnet``, docs/simulated-cluster.md; needs root,
``ip`` and ``tc``, else it prints why and exits 0). The holder runs in node ``n1`` bound to n1's
address (``--serve --host``), the puller is a second process in node ``n2`` (``--pull-from``), and the
bytes cross both nodes' veths and the bridge between them, shaped by ``--link-profile`` (default
``fast``: 10 Gbit/s and 0.2 ms per link; where the kernel lacks netem the delay is each node's NFQUEUE
daemon, which sees every packet). Each node has its own ``PDSERVE_HOST_ID``, so the puller (shared
memory on, as a worker has it) must pull by gRPC: a pull by ``shm`` is an error, and so is n2's
``eth0`` receiving fewer bytes than were pulled. Rows: raw TCP, our gRPC pull and bare gRPC (no shm,
no memcpy: there is no same-host path across namespaces), and with NIXL our NIXL pull and the bare
NIXL read, both ends' UCX held to TCP on ``eth0`` (``transfer_netns.UCX_ENV``); each pull verified
against the holder's checksum. ``--json`` adds ``"across": "netns"``, ``link_profile`` and ``link`` (the run's prefix,
rate, delay, delay backend, the nodes' addresses, bytes pulled and received on n2, the delay daemons'
CPU seconds), and per row ``pulled_by`` (our pulls' transports), ``host_ids`` and ``pulled_bytes``.

Run: ``python -m benchmarks.transfer`` or ``pdserve bench transfer [--json]``; across namespaces
``pdserve bench transfer --across-netns [--link-profile fast] [--json]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
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
from pdserve.kvtransfer.nixl import NixlUnavailable, load_nixl, nixl_installed
from pdserve.kvtransfer.server import start_transfer_server
from pdserve.kvtransfer.shm import host_id
from pdserve.kvtransfer.source import BlockSource

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 8, 128  # float16: 64 KiB per layer per block
LOOPBACK = "127.0.0.1"
READY, ROWS = "READY ", "ROWS "  # the holder's and the netns puller's one line of JSON on stdout


def layout_for(num_layers: int) -> KVLayout:
    return KVLayout(num_layers, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, torch.float16)


def tensor_digest(kv: KVTensor) -> str:
    return xxhash.xxh3_64_hexdigest(kv.host_bytes())


# -- holder process -----------------------------------------------------------------------
def serve(num_layers: int, total_bytes: int, chunks: list[int], host: str = LOOPBACK) -> int:
    """Hold a KV tensor of at least ``total_bytes``, all of it leased, and serve it on ``host`` by the
    KV transfer server, the bare gRPC server and a raw TCP listener (each on a free port); print one
    ``READY`` line of JSON (ports, lease, block count, digest, ``host``, this process's ``pid`` and
    ``nixl_bare``: ``BareNixlHolder.info``, or None without NIXL), then serve until stdin closes.
    Where NIXL loads, the transfer server serves PullNixl too (``TransferConfig.nixl``)."""
    tune_malloc()  # as a worker does
    layout = layout_for(num_layers)
    num_blocks = -(-total_bytes // layout.block_nbytes)
    kv = KVTensor(layout, num_blocks)
    kv.tensor.reshape(-1).view(torch.int16).random_(generator=torch.Generator().manual_seed(0))
    manager = KVCacheManager(num_blocks, layout.block_size, enable_caching=False)
    req = Request("bench", [i % 32000 for i in range(num_blocks * layout.block_size)], SamplingParams(), layout.block_size)
    manager.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    config = TransferConfig(chunk_bytes=max(chunks), lease_ttl_s=3600.0, nixl=nixl_installed())
    handover = KVHandover(manager, kv)
    source = BlockSource(handover, model_fingerprint="bench", worker_id="holder", config=config)
    lease_id = source.lease(handover.hold(req, req.num_tokens))
    server = start_transfer_server(source, config, host=host)
    bare = _bare_grpc_server(kv, chunks, host)
    bare_nixl = _start_bare_nixl(kv) if config.nixl else None

    raw = socket.create_server((host, 0))
    payload = kv.host_bytes()

    def raw_loop() -> None:
        while True:
            conn, _ = raw.accept()
            with conn:
                conn.recv(1)  # the puller's "go"
                conn.sendall(payload)

    threading.Thread(target=raw_loop, daemon=True).start()
    ready = {"grpc_port": server.port, "raw_port": raw.getsockname()[1], "lease_id": lease_id,
             "num_blocks": num_blocks, "digest": tensor_digest(kv), "bare_port": bare[1], "host": host,
             "pid": os.getpid(), "nixl_bare": bare_nixl.info if bare_nixl else None}  # fmt: skip
    print(READY + json.dumps(ready), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    server.stop(0)
    bare[0].stop(0)
    if bare_nixl is not None:
        bare_nixl.close()
    return 0


_BARE_METHOD = "/bench.Bare/Stream"


def _bare_grpc_server(kv: KVTensor, chunks: list[int], host: str = LOOPBACK) -> tuple[grpc.Server, int]:
    """A raw-bytes streaming method on ``host``: the request names a chunk size (one of ``chunks``), the
    answer is the tensor in messages of that size, all built before the first call."""
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
    port = server.add_insecure_port(f"{host}:0")
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


# -- bare NIXL ------------------------------------------------------------------------------
# The bare holder agent's progress periods: while a read runs (over TCP the holder's side serves it),
# and otherwise (a reader's wire-up waits on it; an idle holder should cost next to nothing).
NIXL_POLL_S, NIXL_IDLE_POLL_S = 0.0002, 0.01
NIXL_WAKE_S = 120.0  # a woken holder polls fast until the read's notification, or this long at most
NIXL_WAKE, NIXL_DONE = b"bench-wake", b"bench-done"


def nixl_agent(role: str) -> Any:
    """A NIXL agent as the transport makes them (UCX, no progress thread: with it the library holds a core)."""
    make_agent, agent_config = load_nixl()
    return make_agent(f"bench-{role}-{uuid.uuid4().hex}", agent_config(enable_prog_thread=False, backends=["UCX"]))


def _nixl_descs(addr: int, n: int, nbytes: int) -> np.ndarray:
    """``n`` descriptors of ``nbytes`` each, back to back from ``addr`` (NIXL's Nx3: address, length, device 0)."""
    out = np.zeros((n, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(addr) + np.arange(n, dtype=np.uint64) * np.uint64(nbytes)
    out[:, 1] = nbytes
    return out


class BareNixlHolder:
    """The holder's bench-only NIXL agent with the whole of ``kv`` registered, progressed by a daemon
    thread (a reader's READ wires up only while this side progresses; with UCX's cma transport the
    bytes then move without it, over TCP this side serves them): every ``NIXL_IDLE_POLL_S``, and every
    ``NIXL_POLL_S`` from a reader's ``NIXL_WAKE`` notification to its read's ``NIXL_DONE`` (at most
    ``NIXL_WAKE_S``). ``info`` is what a reader needs: ``metadata``, the agent's full metadata
    (base64; whoever loads it can read and write the whole tensor: the transport never gives a
    holder's metadata away) and ``addr``, the tensor's base address. Raises ``NixlUnavailable`` where
    the agent cannot start; ``close()`` stops the thread and drops the registration."""

    def __init__(self, kv: KVTensor) -> None:
        try:
            self._agent: Any = nixl_agent("holder")
        except Exception as exc:  # noqa: BLE001 - the library raises its own types
            raise NixlUnavailable(f"cannot start a NIXL agent: {exc}") from None
        self._flat = kv.tensor.reshape(-1).view(torch.uint8)
        self._registration = self._agent.register_memory(self._flat)
        self.info = {"metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                     "addr": self._flat.data_ptr()}  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="bare-nixl", daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        fast_until = 0.0
        while not self._stop.wait(NIXL_POLL_S if time.monotonic() < fast_until else NIXL_IDLE_POLL_S):
            for msgs in self._agent.get_new_notifs().values():
                for msg in msgs:
                    if msg == NIXL_WAKE:
                        fast_until = time.monotonic() + NIXL_WAKE_S
                    elif msg == NIXL_DONE:
                        fast_until = 0.0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._agent.deregister_memory(self._registration)


def _start_bare_nixl(kv: KVTensor) -> BareNixlHolder | None:
    try:
        return BareNixlHolder(kv)
    except NixlUnavailable as exc:
        print(f"bench holder: no bare NIXL agent: {exc}", file=sys.stderr)
        return None


class BareNixlReader:
    """The bare NIXL pull: one READ of ``n`` blocks of ``block_nbytes`` from the holder's bench agent
    (``info``: its ``READY`` line's ``nixl_bare``) into ``dest``, block ``i`` into block ``i``, one
    descriptor per block. The agent (``dest`` registered, the holder's metadata loaded) and both
    descriptor lists are made here, outside the timed region; ``read`` is what NIXL itself costs:
    initialize the transfer, post it, wait for it (polling without pause), release it. ``wake``, untimed
    before each read, has the holder progress its agent often until the read is done."""

    def __init__(self, info: dict, dest: KVTensor, n: int) -> None:
        self._agent: Any = nixl_agent("reader")
        flat = dest.tensor.reshape(-1).view(torch.uint8)
        self._registration = self._agent.register_memory(flat)
        name = self._agent.add_remote_agent(base64.b64decode(info["metadata"]))
        self._peer = name.decode() if isinstance(name, bytes) else name
        nb = dest.layout.block_nbytes
        self._local = self._agent.get_xfer_descs(_nixl_descs(flat.data_ptr(), n, nb), "DRAM")
        self._remote = self._agent.get_xfer_descs(_nixl_descs(info["addr"], n, nb), "DRAM")

    def wake(self) -> None:
        """Tell the holder a read comes, and give it one idle period to notice."""
        self._agent.send_notif(self._peer, NIXL_WAKE)
        time.sleep(2 * NIXL_IDLE_POLL_S)

    def read(self, timeout_s: float = 600.0) -> None:
        """One READ of every block; RuntimeError if it fails or takes over ``timeout_s``."""
        agent = self._agent
        handle = agent.initialize_xfer("READ", self._local, self._remote, self._peer, NIXL_DONE)
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the bare NIXL read took over {timeout_s}s")
                state = agent.check_xfer_state(handle)
        finally:
            agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"the bare NIXL read ended in state {state}")

    def close(self) -> None:
        self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._registration)


# -- puller -------------------------------------------------------------------------------
def raw_pull(port: int, dest: KVTensor, host: str = LOOPBACK) -> None:
    """The holder's whole tensor from its raw TCP listener at ``host:port``, received into ``dest``."""
    view = dest.host_bytes()
    with socket.create_connection((host, port)) as sock:
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
    prepare: Callable[[], None] | None = None  # before each pull, untimed
    seconds: list[float] = field(default_factory=list)
    holder: list[tuple[float, int]] = field(default_factory=list)  # (CPU s, page faults) per pull
    puller: list[tuple[float, int]] = field(default_factory=list)

    def warm(self) -> None:
        """One untimed pull."""
        if self.prepare is not None:
            self.prepare()
        self.pull()

    def run(self, holder_pid: int) -> None:
        if self.prepare is not None:
            self.prepare()
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


def holder_argv(num_layers: int, total_bytes: int, chunks: list[int], host: str | None = None) -> list[str]:
    """The holder's command line (``serve``); ``host`` None: loopback."""
    return [sys.executable, "-m", "pdserve.benchmarks.transfer", "--serve", "--num-layers", str(num_layers),
            "--total-mb", str(total_bytes // MiB), "--chunk-bytes", ",".join(map(str, chunks)),
            *(["--host", host] if host else [])]  # fmt: skip


def read_ready(holder: subprocess.Popen[str]) -> dict:
    """The holder's ``READY`` line, parsed; RuntimeError if it printed anything else (or exited)."""
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if not line.startswith(READY):
        raise RuntimeError(f"holder failed to start: {line!r}")
    return json.loads(line[len(READY) :])


def stop_holder(holder: subprocess.Popen[str]) -> None:
    """Close the holder's stdin (its signal to stop) and wait for it; kill it after 30 s."""
    if holder.stdin:
        holder.stdin.close()
    try:
        holder.wait(30)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


def bench_layout(num_layers: int, chunks: list[int], total_bytes: int, repeats: int,
                 shm_config: TransferConfig | None = None) -> list[dict]:  # fmt: skip
    """For each chunk size: ``repeats`` rounds of raw TCP, our gRPC pull, bare gRPC, our shm pull
    and memcpy (and, with NIXL, our NIXL pull and the bare NIXL read), one after the other in each
    round, so that every ratio compares pulls made moments apart.
    ``shm_config``: the puller's ``shm_*`` settings (default: ``TransferConfig``'s)."""
    cmd = holder_argv(num_layers, total_bytes, chunks)
    holder = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = read_ready(holder)
        return pull_rows(info, num_layers, chunks, repeats, shm_config)
    finally:
        stop_holder(holder)


def pull_rows(info: dict, num_layers: int, chunks: list[int], repeats: int,
              shm_config: TransferConfig | None = None, across: bool = False) -> list[dict]:  # fmt: skip
    """Pull from the holder that printed ``info`` (its ``READY`` line), one row per chunk size.

    On one host (``across`` False): raw TCP, our gRPC pull (shared memory off), bare gRPC, our shm pull
    and memcpy. ``across`` (the holder is another host: another network namespace with its own
    ``PDSERVE_HOST_ID``): raw TCP, our gRPC pull with shared memory on, as a worker has it, which must
    still go by gRPC, and bare gRPC; each row also says how many bytes were pulled (``pulled_bytes``,
    the untimed round included), by which transports our pulls went (``pulled_by``) and both ends'
    host identities (``host_ids``). Where NIXL loads here and the holder offers it (``nixl_bare`` in
    ``info`` and ``nixl`` in its metadata), also our NIXL pull (``nixl``: shared memory off) and the
    bare NIXL read (``nixl_bare``, ``BareNixlReader``). Every pull is checked against the
    holder's digest; RuntimeError on a wrong or short pull, or on a pull by another transport than
    expected."""
    with ExitStack() as outer:
        return _pull_rows(outer, info, num_layers, chunks, repeats, shm_config, across)


def _pull_rows(outer: ExitStack, info: dict, num_layers: int, chunks: list[int], repeats: int,
               shm_config: TransferConfig | None, across: bool) -> list[dict]:  # fmt: skip
    layout = layout_for(num_layers)
    host, holder_pid = info.get("host", LOOPBACK), info["pid"]
    n = info["num_blocks"]
    dest = KVTensor(layout, n)
    nbytes = n * layout.block_nbytes
    source = None
    if not across:
        raw_pull(info["raw_port"], dest, host)
        source = KVTensor(layout, n)  # memcpy's source: the holder's bytes, in this process
        source.host_bytes()[:] = dest.host_bytes()
    reader = None
    if info.get("nixl_bare") and nixl_installed():
        reader = BareNixlReader(info["nixl_bare"], dest, n)  # an agent starts in ~0.5 s: once for all chunks
        outer.callback(reader.close)
    rows = []
    for chunk in chunks:
        config = replace(shm_config or TransferConfig(), chunk_bytes=chunk, pull_timeout_s=600.0)
        opts = [("grpc.max_receive_message_length", chunk + MiB)]
        address = f"{host}:{info['grpc_port']}"
        with ExitStack() as stack:
            client = stack.enter_context(KVTransferClient(address, config if across else replace(config, shm=False)))
            channel = stack.enter_context(grpc.insecure_channel(f"{host}:{info['bare_port']}", options=opts))
            meta = client.metadata()  # connect outside the timed region, as the raw socket's peer is listening
            if across and meta.host_id == host_id():
                raise RuntimeError(f"the holder shares this process's host identity {meta.host_id!r}: "
                                   "its pulls would not cross the link")  # fmt: skip
            chunk_counts: list[int] = []
            pulled_by: set[str] = set()

            def pull_with(c: KVTransferClient, transport: str) -> None:
                stats = c.pull_into(dest, list(range(n)), lease_id=info["lease_id"])
                pulled_by.add(stats.transport)
                if stats.num_bytes != nbytes or stats.transport != transport:
                    raise RuntimeError(f"{transport} pull delivered {stats.num_bytes} of {nbytes} bytes by "
                                       f"{stats.transport}")  # fmt: skip
                if transport == "grpc":
                    chunk_counts.append(stats.num_chunks)

            methods = {"raw": Method("raw", lambda: raw_pull(info["raw_port"], dest, host)),
                       "ours": Method("ours", lambda: pull_with(client, "grpc")),
                       "bare": Method("bare", lambda: bare_pull(channel, chunk, dest))}  # fmt: skip
            if not across:
                shm_client = stack.enter_context(KVTransferClient(address, config))
                if not shm_client.metadata().shm_socket:
                    raise RuntimeError("the holder offers no shared-memory transport")
                assert source is not None
                methods["shm"] = Method("shm", lambda: pull_with(shm_client, "shm"))
                methods["memcpy"] = Method("memcpy", lambda: memcpy(source, dest))
            if reader is not None:
                nixl_client = stack.enter_context(KVTransferClient(address, replace(config, shm=False, nixl=True)))
                if not nixl_client.metadata().nixl:
                    raise RuntimeError("the holder runs a bare NIXL agent but offers no NIXL transport")
                methods["nixl"] = Method("nixl", lambda: pull_with(nixl_client, "nixl"))
                methods["nixl_bare"] = Method("nixl_bare", reader.read, prepare=reader.wake)
            grpc.channel_ready_future(channel).result(timeout=30)
            for m in methods.values():  # one untimed round: connections, first-touch of buffers
                m.warm()
            for _ in range(repeats):
                for m in methods.values():
                    dest.tensor.zero_()
                    m.run(holder_pid)
                    if tensor_digest(dest) != info["digest"]:
                        raise RuntimeError(f"{m.name} delivered wrong bytes")
        row = _row(layout.block_nbytes, chunk, n, chunk_counts[-1], methods)
        if across:
            row["pulled_bytes"] = nbytes * sum(len(m.seconds) + 1 for m in methods.values())
            row["pulled_by"] = sorted(pulled_by)
            row["host_ids"] = {"holder": meta.host_id, "puller": host_id()}
        rows.append(row)
    return rows


def _over(a: Method, b: Method) -> float:
    """The median of the per-round ratios of ``a``'s time to ``b``'s (>1: ``b`` is faster)."""
    return statistics.median(x / y for x, y in zip(a.seconds, b.seconds))


def _row(block_nbytes: int, chunk: int, n: int, num_chunks: int, methods: dict[str, Method]) -> dict:
    """One chunk size's row from its measured ``methods`` (``raw``, ``ours``, ``bare`` and, on one host,
    ``shm`` and ``memcpy``; with NIXL ``nixl`` and ``nixl_bare``): only the keys of the methods that ran."""
    nbytes = n * block_nbytes
    raw, ours, bare, copy = methods["raw"], methods["ours"], methods["bare"], methods.get("memcpy")

    def transport(m: Method) -> dict:
        out = {**m.summary(nbytes), "over_raw": _over(raw, m)}
        if copy is not None:
            out["over_memcpy"] = _over(copy, m)
        return out

    transports = {"grpc": transport(ours)} | ({"shm": transport(methods["shm"])} if "shm" in methods else {})
    if "nixl" in methods:
        nixl, nixl_bare = methods["nixl"], methods["nixl_bare"]
        transports["nixl"] = transport(nixl) | {"over_bare_nixl": _over(nixl_bare, nixl)}
    row = {
        "block_nbytes": block_nbytes, "chunk_bytes": chunk, "num_blocks": n, "total_bytes": nbytes,
        "num_chunks": num_chunks, "raw_tcp": raw.summary(nbytes), "grpc": transports["grpc"],
        "bare_grpc": bare.summary(nbytes), "transports": transports,
        "grpc_over_raw": _over(raw, ours), "bare_grpc_over_raw": _over(raw, bare), "grpc_over_bare": _over(bare, ours),
    }  # fmt: skip
    if copy is not None:
        row["memcpy"] = copy.summary(nbytes)
    if "shm" in methods:
        row["shm_over_raw"] = _over(raw, methods["shm"])
    if "nixl" in methods:
        row["nixl_bare"] = transport(methods["nixl_bare"])
    return row


def pull_main(info_json: str, num_layers: int, chunks: list[int], repeats: int) -> int:
    """The puller across namespaces (``--pull-from``): ``pull_rows(across=True)`` from the holder whose
    ``READY`` JSON is ``info_json``; prints one ``ROWS`` line of JSON (``rows``, ``malloc_tuned``)."""
    malloc_tuned = tune_malloc()
    rows = pull_rows(json.loads(info_json), num_layers, chunks, repeats, across=True)
    print(ROWS + json.dumps({"rows": rows, "malloc_tuned": malloc_tuned}), flush=True)
    return 0


def _cpu(summary: dict) -> str:
    return "/".join("-" if summary[k] is None else f"{summary[k]:.2f}" for k in ("holder_cpu_s_per_gb", "puller_cpu_s_per_gb"))


def _nixl_text(row: dict) -> str:
    """The text line's NIXL part (empty for a row without NIXL)."""
    if "nixl" not in row["transports"]:
        return ""
    ours, bare = row["transports"]["nixl"], row["nixl_bare"]
    memcpy = f" nixl/memcpy {ours['over_memcpy']:.2f}" if "over_memcpy" in ours else ""
    return (f" | NIXL {ours['gbps']:.2f} GB/s | bare NIXL {bare['gbps']:.2f} | nixl/raw {ours['over_raw']:.2f}"
            f"{memcpy} nixl/bare {ours['over_bare_nixl']:.2f} | CPU s/GB holder/puller: nixl {_cpu(ours)}"
            f" bare {_cpu(bare)}")  # fmt: skip


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
    ap.add_argument("--across-netns", action="store_true",
                    help="holder and puller in two network namespaces of a simulated cluster (root): "
                         "raw TCP, gRPC and bare gRPC (and NIXL) over the link between them")  # fmt: skip
    ap.add_argument("--link-profile", default="fast",
                    help="with --across-netns: the link profile of both nodes (pdserve.cluster.simnet PROFILES)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--host", default=LOOPBACK, help=argparse.SUPPRESS)  # --serve: the address to bind
    ap.add_argument("--pull-from", default=None, help=argparse.SUPPRESS)  # the holder's READY JSON
    ap.add_argument("--num-layers", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-bytes", default=str(MiB), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    total = args.total_mb * MiB
    if args.serve:
        return serve(args.num_layers, total, [int(c) for c in args.chunk_bytes.split(",")], args.host)
    if args.pull_from is not None:
        return pull_main(args.pull_from, args.num_layers, [int(c) for c in args.chunk_bytes.split(",")], args.repeats)

    chunks = [int(float(c) * MiB) for c in args.chunk_mb.split(",")]
    if args.malloc_defaults:
        os.environ["PDSERVE_MALLOC_TUNING"] = "0"  # the holder inherits it
    if args.across_netns:
        from pdserve.benchmarks.transfer_netns import netns_main

        layers = [int(x) for x in args.layers.split(",")]
        return netns_main(layers, chunks, total, args.repeats, args.link_profile, args.json)
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
                f" shm {_cpu(r['transports']['shm'])} raw {_cpu(r['raw_tcp'])} bare {_cpu(r['bare_grpc'])}"
                + _nixl_text(r),
            )
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
