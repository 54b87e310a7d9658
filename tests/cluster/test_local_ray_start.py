"""A local Ray that does not come up: `pdserve up` tries twice more, then fails with Ray's error, and
leaves none of the processes the failed starts made (real Ray; its GCS is given no time to bind its port)."""

from __future__ import annotations

import os

import pytest
import ray

from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.procstat import child_pids
from tests.support.polling import wait_until


def test_a_gcs_that_does_not_bind_its_port_is_started_again_and_nothing_is_left(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray.shutdown()  # the Ray of this test process the in-process services share (tests/support/service.py)
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "0")  # no GCS binds its port in 0 s
    lines: list[str] = []
    config = ServiceConfig.load(port=0, http_port=0, engine__model=tiny_model,
                                engine__cache__kv_cache_memory_bytes=8 * 1024**2)  # fmt: skip
    before = child_pids(os.getpid())
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        Service(config, progress=lines.append).start()
    again = [line for line in lines if "the local Ray did not start" in line and "starting it again" in line]
    assert len(again) == 2 and all("gcs_server_port" in line for line in again), lines
    assert "start 3 of 3" in again[-1], lines
    assert not ray.is_initialized()
    # Every start's GCS (and the embedded Redis) are gone: killed, not left to run beside the next start.
    assert wait_until(lambda: not child_pids(os.getpid()) - before), child_pids(os.getpid()) - before
