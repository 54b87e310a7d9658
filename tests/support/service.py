"""Helpers for the end-to-end tests: a real Service (local Ray, embedded Redis) and gRPC calls."""

from __future__ import annotations

import json
import socket
import sys

import grpc
import ray

from pdserve.cluster.launcher import Service, start_local_ray
from pdserve.v1 import router_pb2_grpc as pb_grpc

# Logical CPUs of the shared Ray: room for the largest service of the suite (TP workers, 2+2 workers).
SHARED_RAY_CPUS = 16


def shared_ray() -> None:
    """Connect this test process to its one local Ray, started at the first call as `pdserve up`
    starts one (``start_local_ray``). In-process services of the tests join it instead of each
    starting a Ray of its own (about 9 CPU-seconds and 6 s a start); a service's ``stop`` kills its
    actors and leaves the Ray running. tests/conftest.py shuts the Ray down before a module that
    does not import this function; a test of Ray's start itself calls ``ray.shutdown()`` first."""
    if not ray.is_initialized():
        # A failed start tried again is printed: pytest shows it beside a test that fails later.
        start_local_ray(SHARED_RAY_CPUS, progress=lambda m: print(m, file=sys.stderr))


def stub_for(address: str) -> tuple[grpc.Channel, pb_grpc.RouterStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.RouterStub(channel)


def pool_states(service: Service) -> dict[str, dict[str, int]]:
    handles = {**service.prefill, **service.decode}
    return {wid: ray.get(h.pool_state.remote(), timeout=60) for wid, h in handles.items()}


def all_idle(service: Service) -> bool:
    """Every worker's pool has all blocks free, no leases, no live and no registered requests."""
    try:
        states = pool_states(service)
    except Exception:  # noqa: BLE001 - a restarting worker is not idle yet
        return False
    return all(s["free_blocks"] == s["num_blocks"] and s["leases"] == s["requests"] == s["registered"] == 0
               for s in states.values())  # fmt: skip


def raw_post(address: str, path: str, body: dict) -> socket.socket:
    """Send a JSON POST over a plain socket and return it unread: closing it is a client that
    hangs up mid-request."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return sock
