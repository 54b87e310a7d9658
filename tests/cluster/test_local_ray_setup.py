"""What the launcher does around a local Ray without starting one: the auth token file's mode, the
loopback switch, and the compact text log lines its worker processes get (the e2e test in
tests/cli/test_cli.py checks the sockets and the token file of a real `pdserve up`)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from pdserve import logs
from pdserve.cluster.launcher import _is_loopback, _ray_on_loopback, ensure_private_ray_token


@pytest.fixture()
def token_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "dot-ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # Ray's default for a new local cluster: token
    return path


def test_a_new_token_file_is_private_from_the_start(token_path: Path) -> None:
    assert ensure_private_ray_token() == token_path
    assert token_path.stat().st_mode & 0o777 == 0o600 and token_path.parent.stat().st_mode & 0o777 == 0o700
    token = token_path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # what Ray generates: 32 random bytes in hex
    assert ensure_private_ray_token() == token_path and token_path.read_text() == token  # kept, not replaced


def test_a_world_readable_token_file_is_made_private(token_path: Path) -> None:
    token_path.parent.mkdir()
    token_path.write_text("t" * 64)
    token_path.chmod(0o644)  # as Ray writes it under umask 022
    ensure_private_ray_token()
    assert token_path.stat().st_mode & 0o777 == 0o600 and token_path.read_text() == "t" * 64


def test_no_token_file_without_token_auth(token_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ensure_private_ray_token() is None and not token_path.exists()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-the-environment")  # Ray reads no file then
    assert ensure_private_ray_token() is None and not token_path.exists()


def test_the_loopback_switch_holds_only_for_the_init() -> None:
    from ray._private import ray_constants, services

    before = ray_constants.ENABLE_RAY_CLUSTER
    with _ray_on_loopback():
        assert services.get_node_ip_address() == "127.0.0.1"  # what ray.init takes as the node address
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    with pytest.raises(RuntimeError), _ray_on_loopback():
        raise RuntimeError("ray.init failed")
    assert ray_constants.ENABLE_RAY_CLUSTER == before


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:6379", True), ("127.1.2.3:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("10.0.0.2:6379", False), ("head.cluster:6379", False), ("auto", False)])  # fmt: skip
def test_a_loopback_ray_address_is_told_apart(address: str, loopback: bool) -> None:
    """``up --ray-address`` joins a loopback address under the loopback switch (Ray would otherwise
    rewrite it to the routable address, where a loopback Ray does not listen: tests/cli's
    ``--ray-address`` tests hung on that)."""
    assert _is_loopback(address) is loopback


def test_text_log_lines_are_compact() -> None:
    """Time, level, logger, message and the record's own fields: never Ray's ids (which Ray's TEXT
    encoding appends to every line, ~600 characters)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.CompactFormatter())
    logger = logging.getLogger("pdserve.test-compact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        # What Ray's context filter puts on a record (its record factory adds _ray_timestamp_ns itself).
        ray_ids = {"job_id": "01000000", "worker_id": "5" * 56, "node_id": "f" * 56, "actor_id": "a" * 32,
                   "task_id": "c" * 48, "task_name": "Router.generate", "task_func_name": "router.actor.Router.x",
                   "timestamp_ns": 1}  # fmt: skip
        logger.warning("request %s %s", "r1", "stop", extra={"tenant": "-", "ttft_ms": 1.5, **ray_ids})
    finally:
        logger.removeHandler(handler)
    line = out.getvalue().rstrip("\n")
    assert line.endswith(" WARNING pdserve.test-compact: request r1 stop tenant=- ttft_ms=1.5"), line
    assert len(line) < 100 and not any(k in line for k in ray_ids)


def test_a_value_a_client_chose_cannot_forge_a_log_line() -> None:
    """A path or header with a newline, a carriage return or a terminal escape stays on its own
    record's line, escaped (as uvicorn decodes ``%0A`` in a path into a newline); only a
    traceback, which logging appends after the line, spans more."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.CompactFormatter())
    logger = logging.getLogger("pdserve.test-forge")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    forged = "/v1/x\n2026-12-01 16:32:05,682 INFO pdserve.access: request deadbeef stop\r\x1b[2J\u2028"
    try:
        logger.info("request %s (HTTP 401 GET %s)", "r1", forged, extra={"path": forged})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed at %s", forged)
    finally:
        logger.removeHandler(handler)
    first, second, *traceback = out.getvalue().rstrip("\n").split("\n")
    assert first.count("pdserve.access") == 2 and "\\n2026-12-01" in first and "\\x1b[2J" in first
    assert "\x1b" not in first and "\r" not in first and "\u2028" not in first
    assert second.startswith(first[:4]) and "failed at /v1/x\\n" in second
    assert traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "RuntimeError: boom"


def test_the_compact_handler_is_installed_once_and_its_level_passed_on() -> None:
    """``configure_text_logging`` (what each actor runs first, with the service's level) installs one
    handler however often it runs; ``text_log_level`` reads back the level an actor passes on to the
    actors it starts (a worker to its tensor-parallel ranks), None where none is installed."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        for h in [h for h in root.handlers if isinstance(h.formatter, logs.CompactFormatter)]:
            root.removeHandler(h)  # one an in-process service of an earlier test installed
        assert logs.text_log_level() is None
        logs.configure_text_logging("WARNING")
        logs.configure_text_logging("WARNING")  # idempotent: one handler, not two
        ours = [h for h in root.handlers if isinstance(h.formatter, logs.CompactFormatter)]
        assert len(ours) == 1 and root.level == logging.WARNING
        assert logs.text_log_level() == "WARNING"
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)