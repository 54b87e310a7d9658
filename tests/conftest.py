"""Fixtures shared by the whole suite: a tiny real model and a real Redis server.

Everything here is real: models are checkpoints on disk read by the engine's own loader,
Redis is an embedded ``redis-server`` (never a mock).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.engine.model import make_tiny_model
from pdserve.kvindex.embedded import EmbeddedRedis
from tests.support.redis import running_redis


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A deterministic tiny Llama checkpoint (seed 1) with its byte-level tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One embedded Redis for the session; tests isolate themselves with ``unique_namespace()``.
    A test that stops or restarts Redis starts its own (``running_redis()``)."""
    with running_redis() as server:
        yield server
