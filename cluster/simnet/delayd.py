"""The NFQUEUE delay daemon: delays packets where the kernel lacks ``sch_netem``; it runs inside a node's
namespace (``python -m pdserve.cluster.simnet _delayd``), started and driven by ``delay.py``.

It installs nftables rules over netlink (no ``nft`` binary needed) that send every IPv4 packet arriving on
eth0 from peer i to NFQUEUE i; the daemon gets each packet's id only (the packet stays in the kernel) and
accepts it, in order, once the delay of its queue has passed: the sender's link delay plus this node's.
Delaying on arrival, not on departure, matters: a packet held on its way out still belongs to its TCP
socket, whose small-queue limit (about 1 ms of data below the socket) then throttles the flow to a
trickle; one that crossed a namespace is orphaned (netem orphans the packets it delays for the same
reason). Ids of a queue rise in arrival order and its packets all wait the same delay, so one batch
verdict ("accept every id up to N") releases all that are due. Without the daemon the rules drop the
node's incoming traffic: a dead daemon shows as a dead link, never as a silently undelayed one.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pdserve.cluster.simnet.netns import NODE_IFACE

_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_CREATE, _NLM_F_APPEND = 0x1, 0x4, 0x400, 0x800
_NLMSG_ERROR = 2
_NETLINK_NETFILTER = 12
_NFQ = 3 << 8  # NFNL_SUBSYS_QUEUE
_NFT = 10 << 8  # NFNL_SUBSYS_NFTABLES


def _nla(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _nest(kind: int, *attrs: bytes) -> bytes:
    return _nla(kind | 0x8000, b"".join(attrs))  # NLA_F_NESTED


def _str(text: str) -> bytes:
    return text.encode() + b"\0"


def _be32(value: int) -> bytes:
    return struct.pack(">i", value)


def _nfmsg(kind: int, flags: int, seq: int, family: int, res_id: int, attrs: bytes = b"") -> bytes:
    """A netfilter netlink message: nlmsghdr, nfgenmsg (res_id big-endian), attributes."""
    body = struct.pack(">BBH", family, 0, res_id) + attrs
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def _nl_messages(data: bytes) -> Iterable[tuple[int, int, bytes]]:
    """(type, seq, payload after nlmsghdr) of each message in a netlink datagram."""
    off = 0
    while off + 16 <= len(data):
        length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, off)
        yield kind, seq, data[off + 16 : off + length]
        off += (length + 3) & ~3


def _nl_acked(sock: socket.socket, seqs: set[int]) -> None:
    """Read acks until every message of ``seqs`` is acked; OSError with the kernel's errno otherwise."""
    while seqs:
        for kind, seq, payload in _nl_messages(sock.recv(65536)):
            if kind == _NLMSG_ERROR:
                err = struct.unpack_from("=i", payload)[0]
                if err:
                    raise OSError(-err, f"netlink message {seq}: {os.strerror(-err)}")
                seqs.discard(seq)


def _expr(name: str, *attrs: bytes) -> bytes:
    return _nest(1, _nla(1, _str(name)), _nest(2, *attrs))  # NFTA_LIST_ELEM: NFTA_EXPR_NAME, NFTA_EXPR_DATA


def _delay_rules(iface: str, peers: Sequence[tuple[int, str]]) -> tuple[bytes, set[int]]:
    """An nftables batch: table ip pdsim, chain ``arrive`` (hook prerouting) with one rule per (queue,
    source address): ``iifname IFACE ip saddr ADDR`` to NFQUEUE QUEUE (the xt target, rev 3, through
    nft_compat: kernels without nft_queue have it). Returns the batch and the sequence numbers to ack."""
    create = _NLM_F_REQUEST | _NLM_F_CREATE | _NLM_F_ACK
    ipv4, table, chain = 2, _str("pdsim"), _str("arrive")
    hook = _nest(4, _nla(1, _be32(0)), _nla(2, _be32(0)))  # NFTA_CHAIN_HOOK: NF_INET_PRE_ROUTING, priority 0
    msgs = [
        _nfmsg(_NFT | 0, create, 1, ipv4, 0, _nla(1, table)),  # NFT_MSG_NEWTABLE
        _nfmsg(_NFT | 3, create, 2, ipv4, 0, _nla(1, table) + _nla(3, chain) + hook + _nla(7, _str("filter"))),
    ]
    for queue, addr in peers:
        exprs = (
            _expr("meta", _nla(1, _be32(1)), _nla(2, _be32(6)))  # reg 1 := iifname
            + _expr("cmp", _nla(1, _be32(1)), _nla(2, _be32(0)), _nest(3, _nla(1, iface.encode().ljust(16, b"\0"))))
            + _expr("payload", _nla(1, _be32(1)), _nla(2, _be32(1)), _nla(3, _be32(12)), _nla(4, _be32(4)))  # saddr
            + _expr("cmp", _nla(1, _be32(1)), _nla(2, _be32(0)), _nest(3, _nla(1, socket.inet_aton(addr))))
            # xt_NFQ_info_v3: this queue, 1 queue, no flags (no bypass: fail closed)
            + _expr("target", _nla(1, _str("NFQUEUE")), _nla(2, _be32(3)), _nla(3, struct.pack("=HHHxx", queue, 1, 0)))
        )  # fmt: skip
        seq = len(msgs) + 1
        msgs.append(_nfmsg(_NFT | 6, create | _NLM_F_APPEND, seq, ipv4, 0,  # NFT_MSG_NEWRULE
                           _nla(1, table) + _nla(2, chain) + _nest(4, exprs)))  # fmt: skip
    begin, end = _nfmsg(16, _NLM_F_REQUEST, 0, 0, 10), _nfmsg(17, _NLM_F_REQUEST, len(msgs) + 1, 0, 10)
    return begin + b"".join(msgs) + end, set(range(1, len(msgs) + 1))


def _bind_queues(queues: Iterable[int]) -> socket.socket:
    """One netlink socket bound to each NFQUEUE of ``queues``: metadata only, GSO packets whole."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE (root): a lost message drops its packet
    sock.bind((0, 0))
    seq = 0
    for queue in queues:
        for attrs in (
            _nla(1, struct.pack(">BxH", 1, 0)),  # NFQA_CFG_CMD: bind
            _nla(2, struct.pack(">IB", 0, 1))  # NFQA_CFG_PARAMS: copy metadata only
            + _nla(3, struct.pack(">I", 1 << 20))  # NFQA_CFG_QUEUE_MAXLEN
            + _nla(5, struct.pack(">I", 4))
            + _nla(4, struct.pack(">I", 4)),  # NFQA_CFG_FLAGS/MASK: F_GSO
        ):
            seq += 1
            sock.send(_nfmsg(_NFQ | 2, _NLM_F_REQUEST | _NLM_F_ACK, seq, 0, queue, attrs))  # NFQNL_MSG_CONFIG
            _nl_acked(sock, {seq})
    return sock


def _queued_packets(data: bytes) -> Iterable[tuple[int, int]]:
    """(queue, packet id) of each queued packet (NFQNL_MSG_PACKET) in a datagram."""
    for kind, _, payload in _nl_messages(data):
        if kind != _NFQ | 0:
            continue
        queue = struct.unpack_from(">H", payload, 2)[0]  # nfgenmsg res_id
        off = 4
        while off + 4 <= len(payload):
            length, attr = struct.unpack_from("=HH", payload, off)
            if attr & 0x7FFF == 1:  # NFQA_PACKET_HDR: be32 packet id first
                yield queue, struct.unpack_from(">I", payload, off + 4)[0]
                break
            off += (length + 3) & ~3


def read_control(path: Path) -> tuple[int, dict[int, tuple[str, float]]]:
    """A delay daemon's control file: ``GEN`` on the first line, then ``QUEUE SOURCE_ADDR DELAY_MS`` lines.
    Returns (GEN, {queue: (address, delay in seconds)})."""
    first, *lines = path.read_text().splitlines()
    peers = {}
    for line in lines:
        queue, addr, ms = line.split()
        peers[int(queue)] = (addr, float(ms) / 1000.0)
    return int(first), peers


def delay_daemon(control: Path | None, iface: str = NODE_IFACE) -> int:
    """Delay the IPv4 packets arriving on ``iface`` (run inside the node's namespace; see the module's docstring).

    Reads its peers and their delays from ``control`` at start and the delays again on SIGHUP, printing
    ``applied GEN`` once the new delays hold (for packets queued from then on); prints ``ready`` once its
    rules are in place. With ``control`` None, only checks that the kernel supports this (exit 0: it does).
    """
    _, peers = read_control(control) if control else (0, {0: ("192.0.2.1", 0.0)})
    sock = _bind_queues(peers)  # before the rules: no packet meets a queue without a listener
    rules, seqs = _delay_rules(iface, [(q, addr) for q, (addr, _) in peers.items()])
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as nft:
        nft.bind((0, 0))
        nft.send(rules)
        _nl_acked(nft, seqs)
    if control is None:
        return 0
    delays = {q: d for q, (_, d) in peers.items()}

    def reload(signum: int, frame: Any) -> None:
        new_gen, new = read_control(control)
        delays.update({q: d for q, (_, d) in new.items() if q in delays})
        print(f"applied {new_gen}", flush=True)

    signal.signal(signal.SIGHUP, reload)
    print("ready", flush=True)
    sock.setblocking(False)
    pending: dict[int, deque[tuple[float, int]]] = {q: deque() for q in delays}  # (due, packet id), in order
    while True:
        heads = [p[0][0] for p in pending.values() if p]
        timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
        # select, not epoll: microsecond timeouts (epoll rounds up to milliseconds)
        if select.select([sock], [], [], timeout)[0]:
            now = time.monotonic()
            while True:
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    break
                except OSError as exc:  # ENOBUFS: the kernel dropped what it could not deliver
                    if exc.errno != errno.ENOBUFS:
                        raise
                    continue
                for queue, packet in _queued_packets(data):
                    pending[queue].append((now + delays[queue], packet))
        now = time.monotonic()
        for queue, waiting in pending.items():
            last = None
            while waiting and waiting[0][0] <= now:
                last = waiting.popleft()[1]
            if last is not None:  # NFQNL_MSG_VERDICT_BATCH: NFQA_VERDICT_HDR (NF_ACCEPT, every id up to last)
                sock.send(_nfmsg(_NFQ | 3, _NLM_F_REQUEST, 0, 0, queue, _nla(2, struct.pack(">II", 1, last))))


def delayd_main(argv: Sequence[str]) -> int:
    """``_delayd --control FILE`` (a node's delay daemon) or ``_delayd --probe`` (can this kernel?)."""
    ap = argparse.ArgumentParser(prog="simcluster _delayd")
    ap.add_argument("--control", type=Path)
    ap.add_argument("--probe", action="store_true")
    args = ap.parse_args(argv)
    try:
        return delay_daemon(None if args.probe else args.control)
    except OSError as exc:
        print(f"delay daemon: {exc}", file=sys.stderr, flush=True)
        return 1
