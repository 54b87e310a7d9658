"""deploy/: the `ray up` file as an operator runs it. Ray's own schema and config checks, the flags
of every command it runs (pdserve's CLI, `ray start`), pinned versions, secrets made once, and
the start script run for real against a stand-in `pdserve`."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import cli as ray_cli

from pdserve.cli.main import build_parser
from pdserve.cluster.config import ServiceConfig
from tests.support import REPO

DEPLOY = REPO / "deploy"
COMMAND_LISTS = ("setup_commands", "head_setup_commands", "worker_setup_commands", "head_start_ray_commands",
                 "worker_start_ray_commands")  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((DEPLOY / "cluster-gpu.yaml").read_text())


def commands(cluster: dict) -> list[str]:
    """Every shell command the cluster file runs, and those of the scripts it runs on the head."""
    out = [c for key in COMMAND_LISTS for c in cluster.get(key) or []]
    for script in ("run-pdserve.sh", "setup-head.sh"):
        text = (DEPLOY / script).read_text().replace("\\\n", " ")
        out += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return out


def invocations(command: str, program: str) -> list[list[str]]:
    """The argument lists of ``program`` (a bare name or a path ending in it) in a shell command."""
    found = []
    for part in re.split(r"&&|\|\||;|\|", command):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        while words and (words[0] in ("exec", "sudo", "nohup") or re.match(r"^\w+=", words[0])):
            words = words[1:]  # the program comes after these
        if words and (words[0] == program or words[0].endswith("/" + program)):
            found.append(words[1:])
    return found


def test_the_file_passes_rays_schema_and_config_checks(cluster: dict) -> None:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(cluster)]
    assert errors == []
    validate_config(prepare_config(copy.deepcopy(cluster)))


def test_every_pdserve_and_ray_start_command_names_flags_that_exist(cluster: dict) -> None:
    parser = build_parser()
    pdserve_calls = [args for c in commands(cluster) for args in invocations(c, "pdserve")]
    assert any(a[:1] == ["up"] for a in pdserve_calls)  # the service is started somewhere
    for args in pdserve_calls:
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"`pdserve {' '.join(args)}` does not parse with pdserve's CLI")
    ray_flags = {opt for p in ray_cli.commands["start"].params for opt in p.opts}
    starts = [args[1:] for c in commands(cluster) for args in invocations(c, "ray") if args[:1] == ["start"]]
    assert len(starts) == 2
    for args in starts:
        flags = {a.split("=")[0] for a in args if a.startswith("--")}
        assert flags <= ray_flags, f"ray start has no {flags - ray_flags}"


def test_versions_are_pinned_once_and_every_install_uses_the_pins(cluster: dict) -> None:
    pins = dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)==(\S+)$", (DEPLOY / "constraints.txt").read_text(), re.M))
    assert {"ray[default]", "torch"} <= set(pins)
    installs = [c for key in COMMAND_LISTS for c in cluster.get(key) or [] if "pip install" in c]
    assert installs and all("-c ~/pdserve/constraints.txt" in c for c in installs)
    assert not [c for c in installs if re.search(r"\s-U\b|--upgrade", c)]  # nothing floats to the newest
    assert cluster["file_mounts"]["~/pdserve/constraints.txt"] == "./deploy/constraints.txt"


def test_images_secrets_ports_and_the_supervisor(cluster: dict) -> None:
    for name, node in cluster["available_node_types"].items():
        assert "22.04" in node["node_config"]["ImageId"], name  # Python 3.10, Redis 6 (streams)
    # Nothing is filled in on the node at setup time, so --restart-only cannot start a half-made config.
    for f in DEPLOY.iterdir():
        if f.suffix in (".yaml", ".json", ".sh", ".service", ".txt"):
            assert "HEAD_IP" not in f.read_text().replace("$RAY_HEAD_IP", ""), f.name
            assert "CHANGE-ME" not in f.read_text(), f.name
    service = ServiceConfig.load(DEPLOY / "service.json")
    assert service.transfer.ports() == range(50100, 50116) and service.ray_address == "auto"
    assert service.engine.cache.hash_seed != "0" or "PDSERVE_HASH_SEED" in (DEPLOY / "run-pdserve.sh").read_text()
    # systemd runs the service on the head; Ray's (re)start stops it first and starts it after.
    start = cluster["head_start_ray_commands"]
    assert start[0].startswith("sudo systemctl stop pdserve") and start[-1] == "sudo systemctl start pdserve"
    unit = (DEPLOY / "pdserve.service").read_text()
    assert "Restart=on-failure" in unit and "EnvironmentFile=@HOME@/pdserve/secrets.env" in unit
    assert "ExecStart=/bin/bash @HOME@/pdserve/run-pdserve.sh" in unit
    mounts = cluster["file_mounts"]
    for name in ("run-pdserve.sh", "pdserve.service", "setup-head.sh", "redis-conf.sh", "secrets.env", "service.json"):
        assert mounts[f"~/pdserve/{name}"] == f"./deploy/{name}"
    assert "deploy/secrets.env" in (REPO / ".gitignore").read_text().splitlines()
    # The GPU nodes get the secrets from the service; their copy goes after every sync (a
    # --restart-only syncs files but runs only the start commands).
    rm = "rm -f ~/pdserve/secrets.env"
    assert rm in cluster["worker_setup_commands"] and rm in cluster["worker_start_ray_commands"]
    for script in ("make-secrets.sh", "run-pdserve.sh", "setup-head.sh", "redis-conf.sh"):
        subprocess.run(["bash", "-n", str(DEPLOY / script)], check=True)


def test_secrets_are_made_once_and_private(tmp_path: Path) -> None:
    out = tmp_path / "secrets.env"
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(out)], check=True, capture_output=True)
    first = out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    values = dict(re.findall(r"^(PDSERVE_\w+)=([0-9a-f]+)$", first, re.M))
    assert set(values) == {"PDSERVE_HASH_SEED", "PDSERVE_CLUSTER_SECRET", "PDSERVE_REDIS_PASSWORD"}
    assert len(set(values.values())) == 3 and all(len(v) >= 48 for v in values.values())
    subprocess.run(["bash", str(DEPLOY / "make-secrets.sh"), str(out)], check=True, capture_output=True)
    assert out.read_text() == first  # never rotated behind the operator's back


def test_the_start_script_hands_pdserve_its_config_and_a_redis_url_of_this_node(tmp_path: Path) -> None:
    fake = tmp_path / "pdserve-venv" / "bin" / "pdserve"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$PDSERVE_REDIS_URL" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PDSERVE_REDIS_PASSWORD": "pw0123456789abcdef",
           "PDSERVE_CLUSTER_SECRET": "c" * 64, "PDSERVE_HASH_SEED": "s" * 64}  # fmt: skip
    r = subprocess.run(["bash", str(DEPLOY / "run-pdserve.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    url, *args = r.stdout.splitlines()
    assert re.fullmatch(r"redis://:pw0123456789abcdef@\d+\.\d+\.\d+\.\d+:6379/0", url), url
    assert args[:5] == ["up", "--config", f"{tmp_path}/pdserve/service.json", "--ray-address", "auto"]
    assert "pw0123456789abcdef" not in " ".join(args)  # the password is not on the command line
    missing = subprocess.run(["bash", str(DEPLOY / "run-pdserve.sh")], env={**env, "PDSERVE_REDIS_PASSWORD": ""},
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode != 0 and "make-secrets.sh" in missing.stderr


def test_the_redis_config_binds_this_node_with_the_password_and_refuses_a_weak_one(tmp_path: Path) -> None:
    # setup-head.sh installs what redis-conf.sh prints (tests/e2e/test_deploy_scripts.py runs Redis on it).
    password = "pw0123456789abcdef"
    (tmp_path / "secrets.env").write_text(f"# comment\nPDSERVE_REDIS_PASSWORD={password}\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    r = subprocess.run(["bash", str(DEPLOY / "redis-conf.sh")], env={**env, "HOME": str(tmp_path / "nobody")},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "make-secrets.sh" in r.stderr and r.stdout == ""  # no ~/pdserve/secrets.env
    r = subprocess.run(["bash", str(DEPLOY / "redis-conf.sh"), str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    conf = [ln for ln in r.stdout.splitlines() if ln and not ln.startswith("#")]
    assert conf[0] == "port 6379" and re.fullmatch(r"bind 127\.0\.0\.1 \d+\.\d+\.\d+\.\d+", conf[1]), conf
    assert conf[2:] == ["protected-mode yes", f"requirepass {password}", 'save ""', "appendonly no"]
    (tmp_path / "secrets.env").write_text("PDSERVE_REDIS_PASSWORD=short pw\n")
    r = subprocess.run(["bash", str(DEPLOY / "redis-conf.sh"), str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "16+" in r.stderr and r.stdout == ""
