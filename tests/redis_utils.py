"""Test helpers for a real Redis: tests never mock it.

Use from a test module (not conftest, so only modules that need Redis start one)::

    from tests.redis_utils import running_redis

    @pytest.fixture(scope="module")
    def redis_server():
        with running_redis() as server:
            yield server
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvtransfer.redis_server import EmbeddedRedis, find_redis_server


@contextmanager
def running_redis(**kwargs: object) -> Iterator[EmbeddedRedis]:
    """A started ``EmbeddedRedis`` (kwargs go to its constructor), stopped on exit.

    Skips the test if no ``redis-server`` binary exists at all.
    """
    try:
        find_redis_server()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server = EmbeddedRedis(**kwargs).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


def unique_namespace(prefix: str = "t") -> str:
    """A namespace no other test uses, so tests can share one server without FLUSHALL."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def wait_until(cond: Callable[[], object], timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``cond`` until it is truthy; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())
