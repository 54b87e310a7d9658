"""Listening TCP sockets of a process tree, read from /proc (Linux): which addresses a service exposes."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str  # /proc/PID/comm (Ray names its processes: gcs_server, raylet, ray::PrefillWorker, ...)
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        """Bound to a loopback address (an IPv4-mapped one included), not a wildcard or an interface's."""
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback


def descendants(root: int) -> set[int]:
    """``root`` and every process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # Fields after the command name (which may hold spaces or parentheses): state, ppid, ...
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _address(hexaddr: str) -> tuple[str, int]:
    """/proc/net/tcp's ``HEXIP:HEXPORT`` (the IP in host byte order per 32-bit word)."""
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port_hex, 16)


def listeners(pids: set[int]) -> list[Listener]:
    """The TCP sockets in LISTEN state held by any of ``pids`` (IPv4 and IPv6)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:[") : -1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A: LISTEN; field 9: the socket's inode
                pid = owner[fields[9]]
                try:
                    command = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    command = "?"
                out.append(Listener(pid, command, *_address(fields[1])))
    return out
