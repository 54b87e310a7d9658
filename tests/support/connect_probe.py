"""A script for ``python -c`` inside a network namespace: can it open a TCP connection?

``argv``: host, port, timeout in seconds; prints ``connected``, ``timeout`` or ``error ERRNO``.
"""

from __future__ import annotations

CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close(); print("connected")
except TimeoutError:
    print("timeout")
except OSError as exc:
    print(f"error {exc.errno}")
"""
