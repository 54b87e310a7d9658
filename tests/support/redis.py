"""Test helpers for a real Redis: tests never mock it (the session's server is the
``redis_server`` fixture of conftest; a test that stops Redis starts its own)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pdserve.kvindex.embedded import EmbeddedRedis, find_redis_server


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
