"""``pdserve bench nixl-designs``: how close any design of a checked NIXL pull can come to a bare NIXL READ
of the same bytes on this host, with the control plane for free.

Two processes: this one pulls, a holder started by multiprocessing (spawn) holds ``--total-mb`` of random
blocks, and a pipe between them carries what the transport's gRPC calls would (so every figure here is an
upper bound for a design that pays for those calls). The pull's blocks go to scattered destination blocks.
Each round times, on the same blocks, one after another:

- ``bare``: one READ of every block (a descriptor each) from the holder's whole registered tensor. Nothing
  is checked or scoped: the reference of ``pdserve bench transfer``'s ``over_bare_nixl``.
- ``bare_write``: the same the other way, one WRITE by the holder into the puller's whole registered tensor
  (nothing zeroed, checked or scoped): the ceiling of any design in which the holder writes.
- ``read``: the holder registers exactly the pull's blocks and sends partial metadata of them; the puller
  READs them window by window straight into its destination blocks. The puller may read what the pull
  grants, nothing else; nothing of the puller's is registered for the holder.
- ``write``: the puller zeroes each window's destination blocks (their stale bytes are another request's),
  registers them and sends their partial metadata, every window asked for at once; the holder WRITEs each
  in turn and notifies. No copy on either side, and no staging region.

each with checksums ``none``; ``sealed`` (the holder's xxh3 of every block computed before the round, as if
taken when the block was sealed; the puller checks every block after it lands, on a helper thread); or
``both`` (the holder computes them beside the transfer too). Every pull's bytes are compared with the
holder's after its round, untimed. The report: each design's median GB/s and the median over rounds of
its speed over the bare READ's in that round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pdserve.benchmarks.common import emit
from pdserve.benchmarks.transfer import nixl_agent
from pdserve.engine.kernels.stream_copy import available as stream_copy_built, stream_copy
from pdserve.kvtransfer.nixl import NixlUnavailable, descriptors, load_nixl
from pdserve.kvtransfer.wire import checksum

MiB = 1 << 20
DESIGNS = [(d, s) for d in ("read", "write") for s in ("none", "sealed", "both")]
_POLL_S = 0.0002
TIMEOUT_S = 60.0  # a transfer still going after this fails the benchmark


def _blocks(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _move(agent: Any, op: str, local: list[int], remote: list[int], nb: int, peer: str, notif: bytes = b"") -> None:
    """One NIXL ``op`` ("READ" or "WRITE") of ``nb`` bytes between each local and remote address; waits for it."""
    ends = [agent.get_xfer_descs(descriptors(np.asarray(a, dtype=np.uint64), nb), "DRAM") for a in (local, remote)]
    handle = agent.initialize_xfer(op, *ends, peer, notif)
    state, deadline = agent.transfer(handle), time.monotonic() + TIMEOUT_S
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"a NIXL {op} ended in state {state}")


def _sums(view: memoryview, addrs: list[int], base: int, nb: int) -> list[int]:
    return [checksum(view[a - base : a - base + nb]) for a in addrs]


class _Holder:
    """The holder process's side: its tensor registered whole for ``bare``, scoped registrations per pull."""

    def __init__(self, conn: Connection, seed: int, nbytes: int, nb: int) -> None:
        torch.set_num_threads(1)
        self.conn, self.nb = conn, nb
        self.agent = nixl_agent("holder")
        self.kv = _blocks(seed, nbytes)
        self.base, self.view = self.kv.data_ptr(), memoryview(self.kv.numpy())
        self.whole = self.agent.register_memory(self.kv)
        self.side = ThreadPoolExecutor(1)
        self.sealed = _sums(self.view, [self.base + i * nb for i in range(nbytes // nb)], self.base, nb)

    def recv(self) -> Any:
        while not self.conn.poll(_POLL_S):  # progress meanwhile: a peer's wire-up (and TCP's serving) needs it
            self.agent.get_new_notifs()
        return self.conn.recv()

    def serve(self) -> None:
        self.conn.send((self.agent.get_agent_metadata(), self.base))
        while (msg := self.recv()) is not None:
            getattr(self, msg[0])(*msg[1:])

    def window_sums(self, ids: list[int], mode: str) -> Callable[[], list[int]]:
        """The window's checksums, as a call: computed beside the transfer (``both``) or sealed before."""
        if mode == "both":
            return self.side.submit(_sums, self.view, [self.base + i * self.nb for i in ids], self.base, self.nb).result
        return lambda: [self.sealed[i] for i in ids]

    def read(self, ids: list[int], per: int, mode: str) -> None:
        """Register exactly ``ids``, send their metadata, then each window's checksums; deregister at "done"."""
        reg = self.agent.register_memory([(self.base + i * self.nb, self.nb, 0, "") for i in ids], "DRAM")
        self.conn.send(self.agent.get_partial_agent_metadata(reg, True))
        for k in range(0, len(ids), per):
            window = ids[k : k + per]
            self.conn.send(self.window_sums(window, mode)())
        if self.recv() != "done":
            raise RuntimeError("the puller did not end its read")
        self.agent.deregister_memory(reg)

    def bare_write(self, ids: list[int], metadata: bytes, dest: list[int]) -> None:
        """One WRITE of every block of ``ids`` to ``dest`` (the puller's whole tensor registered), then "done"."""
        peer = self.agent.add_remote_agent(metadata)
        _move(self.agent, "WRITE", [self.base + i * self.nb for i in ids], dest, self.nb, peer)
        self.conn.send("done")

    def write(self, ids: list[int], per: int, mode: str, windows: int) -> None:
        """Write each asked-for window (metadata, destination addresses) in turn, notifying its index."""
        for _ in range(windows):
            k, metadata, dest = self.recv()
            peer = self.agent.add_remote_agent(metadata)
            window = ids[k : k + per]
            sums = self.window_sums(window, mode)
            _move(self.agent, "WRITE", [self.base + i * self.nb for i in window], dest, self.nb, peer, str(k).encode())
            self.conn.send((k, sums()))


def _holder_main(conn: Connection, seed: int, nbytes: int, nb: int) -> None:
    _Holder(conn, seed, nbytes, nb).serve()


class _Puller:
    """This process's side: its tensor (registered for its own READs only), the pull's scattered
    destination blocks, and one method per design that moves the pull's blocks there."""

    def __init__(self, conn: Connection, nbytes: int, nb: int, per: int, seed: int) -> None:
        self.conn, self.nb, self.per = conn, nb, per
        self.agent = nixl_agent("puller")
        self.kv = torch.ones(nbytes, dtype=torch.uint8)
        self.base, self.view = self.kv.data_ptr(), memoryview(self.kv.numpy())
        self.whole = self.agent.register_memory(self.kv)
        self.whole_metadata: bytes | None = None
        self.zeros = memoryview(torch.zeros(nb, dtype=torch.uint8).numpy())
        self.check = ThreadPoolExecutor(1)
        rng = np.random.default_rng(seed)
        n = nbytes // nb
        self.src = [int(i) for i in rng.permutation(n)]  # the holder's blocks of the pull, in order
        self.dest = [self.base + int(i) * nb for i in rng.permutation(n)]  # where each goes here
        metadata, self.holder_base = conn.recv()
        self.holder = self.agent.add_remote_agent(metadata)

    def bare(self) -> None:
        _move(self.agent, "READ", self.dest, [self.holder_base + i * self.nb for i in self.src], self.nb, self.holder)

    def bare_write(self) -> None:
        if self.whole_metadata is None:  # once: the holder keeps it loaded, as a peer would
            self.whole_metadata = self.agent.get_partial_agent_metadata(self.whole, True)
        self.conn.send(("bare_write", self.src, self.whole_metadata, self.dest))
        while not self.conn.poll(_POLL_S):  # the holder's wire-up to this agent needs its progress
            self.agent.get_new_notifs()
        if self.conn.recv() != "done":
            raise RuntimeError("the holder did not end its write")

    def verify(self, dest: list[int], sums: list[int]) -> None:
        if _sums(self.view, dest, self.base, self.nb) != sums:
            raise RuntimeError("a block landed with a wrong checksum")

    def read(self, mode: str) -> None:
        self.conn.send(("read", self.src, self.per, mode))
        self.agent.add_remote_agent(self.conn.recv())
        checks = []
        for k in range(0, len(self.src), self.per):
            dest, src = self.dest[k : k + self.per], self.src[k : k + self.per]
            _move(self.agent, "READ", dest, [self.holder_base + i * self.nb for i in src], self.nb, self.holder)
            sums = self.conn.recv()
            if mode != "none":
                checks.append(self.check.submit(self.verify, dest, sums))
        for c in checks:
            c.result()
        self.conn.send("done")

    def write(self, mode: str) -> None:
        starts = list(range(0, len(self.src), self.per))
        self.conn.send(("write", self.src, self.per, mode, len(starts)))
        regs = []
        for k in starts:
            dest = self.dest[k : k + self.per]
            for a in dest:  # zeroed with streaming stores where the C kernel is built, as the receiver copies
                stream_copy(self.view[a - self.base : a - self.base + self.nb], self.zeros)
            regs.append(self.agent.register_memory([(a, self.nb, 0, "") for a in dest], "DRAM"))
            self.conn.send((k, self.agent.get_partial_agent_metadata(regs[-1], True), dest))
        landed: set[bytes] = set()

        def take_notifs() -> None:
            for msgs in self.agent.get_new_notifs().values():
                landed.update(msgs)

        checks = []
        for k in starts:
            while not self.conn.poll(_POLL_S):
                take_notifs()
            k_done, sums = self.conn.recv()
            while str(k_done).encode() not in landed:  # the notification follows the bytes
                take_notifs()
            if mode != "none":
                checks.append(self.check.submit(self.verify, self.dest[k_done : k_done + self.per], sums))
        for c in checks:
            c.result()
        for reg in regs:
            self.agent.deregister_memory(reg)

    def matches(self, expected: torch.Tensor) -> bool:
        got = [self.kv[a - self.base : a - self.base + self.nb] for a in self.dest]
        want = [expected[i * self.nb : (i + 1) * self.nb] for i in self.src]
        ok = all(torch.equal(g, w) for g, w in zip(got, want))
        self.kv.fill_(1)
        return ok


def run(total_mb: int, block_kb: int, window_mb: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    nb, nbytes = block_kb << 10, total_mb * MiB
    per = max(1, window_mb * MiB // nb)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    holder = ctx.Process(target=_holder_main, args=(there, seed, nbytes, nb), daemon=True)
    holder.start()
    torch.set_num_threads(1)
    stream_copy_built()  # built (once per machine) before anything is timed
    times: dict[str, list[float]] = {"bare": [], "bare_write": [], **{f"{d}/{s}": [] for d, s in DESIGNS}}
    try:
        puller = _Puller(here, nbytes, nb, per, seed)
        expected = _blocks(seed, nbytes)
        designs = {f"{d}/{s}": (lambda d=d, s=s: getattr(puller, d)(s)) for d, s in DESIGNS}
        methods = {"bare": puller.bare, "bare_write": puller.bare_write, **designs}
        for r in range(repeats + 1):  # round 0 warms every path up (agents' wire-up, page faults)
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                if r:
                    times[name].append(time.perf_counter() - t0)
                if not puller.matches(expected):
                    raise RuntimeError(f"{name}: the pulled blocks differ from the holder's")
        here.send(None)
    finally:
        holder.join(10)
        if holder.is_alive():
            holder.kill()
    bare = times["bare"]
    return {
        "total_bytes": nbytes, "block_nbytes": nb, "window_bytes": per * nb, "repeats": repeats,
        "streaming_zero": stream_copy_built(),
        "designs": {name: {"gbps": nbytes / statistics.median(ts) / 1e9,
                           "over_bare": statistics.median(b / t for b, t in zip(bare, ts))}
                    for name, ts in times.items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench nixl-designs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--block-kb", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--window-mb", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.total_mb < 1 or args.window_mb < 1 or args.repeats < 1 or min(args.block_kb) < 1:
        ap.error("--total-mb, --block-kb, --window-mb and --repeats must be positive")
    if any(args.total_mb * 1024 % kb for kb in args.block_kb):
        ap.error("--total-mb must be a whole number of every --block-kb")
    try:
        load_nixl()
    except NixlUnavailable as exc:
        print(f"pdserve bench nixl-designs: {exc}; nothing to measure", file=sys.stderr)
        return 0
    try:
        results = [run(args.total_mb, kb, args.window_mb, args.repeats) for kb in args.block_kb]
    except RuntimeError as exc:  # a transfer failed, or bytes landed wrong
        print(f"pdserve bench nixl-designs: {exc}", file=sys.stderr)
        return 1
    rows = [(f"{r['block_nbytes'] >> 10} KiB blocks, {name}", f"{d['gbps']:.2f} GB/s, {d['over_bare']:.2f} of bare")
            for r in results for name, d in r["designs"].items()]  # fmt: skip
    emit({"results": results}, args.json, rows)
    return 0
