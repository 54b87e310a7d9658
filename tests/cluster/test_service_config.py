"""ServiceConfig composes the components' configs: one definition per field, file and flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cluster.config import ServiceConfig
from pdserve.engine.config import EngineConfig
from pdserve.kvindex.config import IndexConfig


def test_types_are_checked_and_errors_name_the_field(tmp_path: Path) -> None:
    assert ServiceConfig.load(router__load_weight=2).router.load_weight == 2  # an int is a fine number
    for flags, needle in [
        ({"prefill": "2"}, "prefill must be an integer, got '2'"),
        ({"port": 1.5}, "port must be an integer"),
        ({"engine__cpu_onednn": 1}, "engine.cpu_onednn must be true or false"),
        ({"engine__model": 3}, "engine.model must be a string or null"),
        ({"router__load_weight": True}, "router.load_weight must be a number"),
        ({"engine__cache__block_size": 0}, "engine.cache.block_size must be in"),
        ({"transfer__lease_ttl_s": -1}, "transfer.lease_ttl_s must be"),
        ({"decode_cpus_per_worker": 0}, "decode_cpus_per_worker must be a finite number > 0"),
        ({"cpus_per_worker": float("inf")}, "cpus_per_worker must be a finite number >= 0, got inf"),
        ({"gpus_per_worker": float("nan")}, "gpus_per_worker must be a finite number >= 0, got nan"),
        ({"prefill_resources": {"accel": float("inf")}}, "a custom resource name"),
        ({"port": 9000, "metrics_port": 9000}, "port, http_port and metrics_port must differ"),
        ({"share_idle_cpus": "no"}, "share_idle_cpus must be true or false"),
        ({"core_reclaim_wait_s": -1}, r"core_reclaim_wait_s must be in \[0, 10\] seconds"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ServiceConfig.load(**flags)
    per_role = ServiceConfig.load(cpus_per_worker=0.5, decode_cpus_per_worker=2)
    assert (per_role.cpus_per_rank("prefill"), per_role.cpus_per_rank("decode")) == (0.5, 2)
    path = tmp_path / "c.json"
    path.write_text('"just a string"')
    with pytest.raises(ValueError, match="must be a JSON object"):
        ServiceConfig.load(path)
    path.write_text(json.dumps({"engine": {"cache": {"blok_size": 8}}}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) in .*c.json: engine.cache.blok_size"):
        ServiceConfig.load(path)
    path.write_text(json.dumps({"engine": 5}))
    with pytest.raises(ValueError, match="engine must be an object"):
        ServiceConfig.load(path)


def test_file_then_flags_then_nested_configs(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"prefill": 2, "engine": {"model": "/m", "cache": {"block_size": 32}},
                                "index": {"namespace": "prod"}, "transfer": {"lease_ttl_s": 12}}))  # fmt: skip
    c = ServiceConfig.load(path, engine__cache__block_size=8, index__url="redis://r:6379/0")
    assert (c.prefill, c.engine.model, c.engine.cache.block_size) == (2, "/m", 8)
    assert (c.index.namespace, c.index.url, c.transfer.lease_ttl_s) == ("prod", "redis://r:6379/0", 12)
    assert isinstance(c.engine, EngineConfig) and isinstance(c.index, IndexConfig)


def test_environment_defaults_reach_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` and `stats` read the namespace and the hash seed from the same place."""
    monkeypatch.setenv("PDSERVE_REDIS_NAMESPACE", "staging")
    monkeypatch.setenv("PDSERVE_HASH_SEED", "s3cret")
    c = ServiceConfig.load()
    assert c.index.namespace == "staging" == IndexConfig().namespace
    assert c.engine.cache.hash_seed == "s3cret"


def test_the_shipped_config_files_load() -> None:
    from tests.support import REPO

    gpu = ServiceConfig.load(REPO / "deploy" / "service.json")
    assert gpu.engine.dtype == "bfloat16" and gpu.prefill == 2 and gpu.transfer.port_range == "50100-50115"
    cpu = ServiceConfig.load(REPO / "deploy" / "service-cpu.json")
    assert cpu.engine.model is None and cpu.index.url is None
