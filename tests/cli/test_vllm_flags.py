"""``pdserve up`` speaks ``vllm serve``'s flags (docs/cli.md, "vLLM's flags"); ``generate`` gains
``--chat`` and ``--stop``; models by Hub id. Subprocesses as a user runs them, and the config
``up`` would run with, built in-process by the very function ``up`` uses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cli.main import build_parser
from pdserve.cli.up import build_config
from pdserve.cluster.config import ServiceConfig
from pdserve.engine.model import make_tiny_model
from tests.engine.test_hub import COMMIT, fake_hub_snapshot
from tests.support import REPO

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def pdserve(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)  # fmt: skip


def up_config(*flags: str) -> ServiceConfig:
    """What ``pdserve up FLAGS`` would run with (``build_config``, the function ``up`` calls)."""
    return build_config(build_parser().parse_args(["up", *flags]))


def field_at(config: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        config = getattr(config, name)
    return config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-flags") / "tiny")


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, str]:
    """An environment whose Hub cache ($HF_HOME/hub) holds ``org/tiny``, offline."""
    home = tmp_path_factory.mktemp("hf-home")
    fake_hub_snapshot(home / "hub", "org/tiny", model_dir)
    return dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")


# flag(s) -> (the config field it sets, the value there); the JSON file's field of the same path.
FLAGS = [
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--served-model-name", "x"], "router.served_model_name", "x"),
    (["--dtype", "bfloat16"], "engine.dtype", "bfloat16"),
    (["--dtype", "half"], "engine.dtype", "float16"),
    (["--dtype", "float"], "engine.dtype", "float32"),
    (["--dtype", "auto"], "engine.dtype", None),
    (["--max-model-len", "256"], "engine.scheduler.max_model_len", 256),
    (["--max-model-len", "4k"], "engine.scheduler.max_model_len", 4000),
    (["--max-model-len", "4K"], "engine.scheduler.max_model_len", 4096),
    (["--max-num-seqs", "4"], "engine.scheduler.max_num_seqs", 4),
    (["--max-num-batched-tokens", "512"], "engine.scheduler.max_num_batched_tokens", 512),
    (["--kv-cache-memory-bytes", "1GiB"], "engine.cache.kv_cache_memory_bytes", 1 << 30),
    (["--kv-cache-memory", "512MiB"], "engine.cache.kv_cache_memory_bytes", 512 << 20),
    (["--kv-cache-memory", "2GB"], "engine.cache.kv_cache_memory_bytes", 2 * 10**9),
    (["--kv-cache-memory", "123456"], "engine.cache.kv_cache_memory_bytes", 123456),
    (["--gpu-memory-utilization", "0.8"], "engine.cache.gpu_memory_utilization", 0.8),
    (["--seed", "7"], "engine.seed", 7),
    (["--chat-template", TEMPLATE], "engine.chat_template", TEMPLATE),
    (["--revision", "v1.0"], "engine.revision", "v1.0"),
    (["--download-dir", "/data/hf"], "engine.download_dir", "/data/hf"),
    (["--disable-cascade-attn"], "engine.disable_cascade_attn", True),
    (["--cpu-fp32-gemm", "torch"], "engine.cpu_fp32_gemm", "torch"),
]


@pytest.mark.parametrize("flags, path, value", FLAGS, ids=[" ".join(f) for f, _, _ in FLAGS])
def test_each_flag_sets_its_field(flags: list[str], path: str, value: Any) -> None:
    assert field_at(up_config(*flags), path) == value
    assert field_at(up_config(), path) != value or value is None  # not the default already


def test_the_json_file_and_the_flags_map_one_to_one_and_flags_win(tmp_path: Path) -> None:
    flags = ["--host", "0.0.0.0", "--served-model-name", "x", "--dtype", "float16", "--max-model-len", "256",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", "1048576",
             "--seed", "3", "--chat-template", TEMPLATE, "--revision", "main", "--download-dir", "/d"]  # fmt: skip
    file = {"host": "0.0.0.0", "router": {"served_model_name": "x"},
            "engine": {"dtype": "float16", "seed": 3, "chat_template": TEMPLATE, "revision": "main",
                       "download_dir": "/d", "cache": {"kv_cache_memory_bytes": 1048576},
                       "scheduler": {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 512}}}  # fmt: skip
    path = tmp_path / "service.json"
    path.write_text(json.dumps(file))
    assert up_config("--config", str(path)) == up_config(*flags) != up_config()
    # vLLM's spelling in the file too; a flag overrides the file.
    path.write_text(json.dumps({"engine": {"dtype": "half", "scheduler": {"max_num_seqs": 8}}}))
    cfg = up_config("--config", str(path), "--max-num-seqs", "2", "--dtype", "auto")
    assert cfg.engine.dtype is None and cfg.engine.scheduler.max_num_seqs == 2
    assert up_config("--config", str(path)).engine.dtype == "float16"


def test_a_chat_template_file_is_read_into_the_config(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert up_config("--chat-template", str(path)).engine.chat_template == TEMPLATE
    (tmp_path / "service.json").write_text(json.dumps({"engine": {"chat_template": str(path)}}))
    assert up_config("--config", str(tmp_path / "service.json")).engine.chat_template == TEMPLATE


def test_a_chat_template_replaces_the_checkpoints(model_dir: Path) -> None:
    from pdserve.engine.model import load_tokenizer

    own = load_tokenizer(model_dir)
    assert own.chat_template and own.chat_template != TEMPLATE
    tok = load_tokenizer(model_dir, TEMPLATE)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_print_config_shows_the_flags_and_hides_secrets(hub_env: dict[str, str]) -> None:
    r = pdserve("up", "--print-config", "--model", "org/tiny", "--host", "0.0.0.0", "--max-model-len", "2K",
                "--api-key", "sekrit-key", "--redis-url", "redis://:pw@10.0.0.1:6379/0", "--decode-cpus", "2",
                "--no-share-idle-cpus", "--core-reclaim-wait-s", "0", env=hub_env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    snapshot = Path(hub_env["HF_HOME"]) / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert out["engine"]["model"] == str(snapshot)  # every process loads the resolved directory
    assert out["router"]["served_model_name"] == "org/tiny"  # served by its id, as vLLM does
    assert out["host"] == "0.0.0.0" and out["engine"]["scheduler"]["max_model_len"] == 2048
    assert (out["prefill_cpus_per_worker"], out["decode_cpus_per_worker"]) == (None, 2.0)
    assert out["share_idle_cpus"] is False  # on by default
    assert out["core_reclaim_wait_s"] == 0.0  # 0.25 by default
    assert out["router"]["api_key"] == "***" and "sekrit-key" not in r.stdout and ":pw@" not in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--host", ""], "host must be"),
        (["--served-model-name", "a", "b"], "one name"),
        (["--served-model-name", ""], "served_model_name"),
        (["--dtype", "int8"], "--dtype"),
        (["--max-model-len", "lots"], "--max-model-len"),
        (["--max-model-len", "1"], "max_model_len must be >= 2"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["--max-num-batched-tokens", "-5"], "--max-num-batched-tokens"),
        (["--kv-cache-memory", "1.5"], "whole number"),
        (["--kv-cache-memory", "8XB"], "--kv-cache-memory"),
        (["--kv-cache-memory-bytes", "0"], "kv_cache_memory_bytes must be > 0"),
        (["--seed", "x"], "--seed"),
        (["--seed", str(2**64)], "seed must be an integer"),
        (["--chat-template", "/no/such/template.jinja"], "cannot read the file"),
        (["--chat-template", "{% if %}"], "Jinja syntax error"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be a fraction in (0, 1]"),
        (["--model", "org/unknown"], "HF_HUB_OFFLINE"),
        (["--decode-cpus", "0"], "decode_cpus_per_worker must be a finite number > 0"),
        (["--prefill-cpus", "x"], "--prefill-cpus"),
    ],
)
def test_bad_values_are_one_line_errors(hub_env: dict[str, str], args: list[str], needle: str) -> None:
    r = pdserve("up", "--print-config", *args, env=hub_env)
    assert r.returncode == 2, r.stdout
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_every_option_has_help() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name in ("up", "generate"):
        for action in subs.choices[name]._actions:
            assert action.help, f"pdserve {name} {'/'.join(action.option_strings)} has no help"


def test_generate_by_hub_id_matches_the_directory(hub_env: dict[str, str], model_dir: Path) -> None:
    args = ["--prompt", "hello hub", "--max-tokens", "5", "--json"]
    by_id = pdserve("generate", "--model", "org/tiny", *args, env=hub_env)
    assert by_id.returncode == 0, by_id.stderr
    by_dir = pdserve("generate", "--model", str(model_dir), *args)
    assert by_dir.returncode == 0, by_dir.stderr
    a, b = json.loads(by_id.stdout), json.loads(by_dir.stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"] and len(a["token_ids"]) == 5
    r = pdserve("generate", "--model", "org/tiny", "--revision", COMMIT, *args, env=hub_env)
    assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == a["token_ids"], r.stderr
    # An id the cache lacks, offline: one line, no traceback.
    r = pdserve("generate", "--model", "org/unknown", *args, env=hub_env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("pdserve: error: model 'org/unknown'") and len(r.stderr.splitlines()) == 1


def _stop_case(model_dir: Path) -> tuple[str, Any]:
    """A stop string that the greedy continuation of the chat prompt reaches, and the reference."""
    llm = LLM(str(model_dir))
    messages = [{"role": "user", "content": "hi there"}]
    full = llm.chat(messages, SamplingParams(max_tokens=12))[0]
    text = full.text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() and text.find(
        text[i:i + 2]) == i), None)  # fmt: skip
    assert stop is not None, f"no stop string in {text!r}"
    ref = llm.chat(messages, SamplingParams(max_tokens=12, stop=(stop, "never-appears")))[0]
    assert ref.finish_reason == "stop" and ref.text == text[: text.find(stop)]
    return stop, ref


def test_generate_chat_and_stop_offline(model_dir: Path) -> None:
    stop, ref = _stop_case(model_dir)
    r = pdserve("generate", "--model", str(model_dir), "--prompt", "hi there", "--chat", "--max-tokens", "12",
                "--stop", stop, "--stop", "never-appears", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == ref.text and out["finish_reason"] == "stop"
    assert out["token_ids"] == ref.token_ids[: len(out["token_ids"])]
    assert out["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


@pytest.mark.slow
def test_up_with_vllm_flags_serves_the_name_and_length(hub_env: dict[str, str], model_dir: Path,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """``pdserve up`` as a vLLM user writes it, on a model given by Hub id: /v1/models shows the
    served name and max_model_len; --chat/--stop through the router equal the offline run."""
    env = dict(hub_env, PDSERVE_STATE_DIR=str(tmp_path / "state"))
    log = tmp_path / "stderr.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli.main", "up", "--model", "org/tiny", "--host", "127.0.0.1",
         "--served-model-name", "x", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens",
         "512", "--kv-cache-memory", "64MiB", "--seed", "1", "--dtype", "float32", "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        router_line = proc.stdout.readline().strip()
        http_line = proc.stdout.readline().strip()
        assert router_line.startswith("router listening on 127.0.0.1:"), (router_line, log.read_text()[-3000:])
        assert http_line.startswith("http listening on 127.0.0.1:"), http_line
        http = http_line.removeprefix("http listening on ")
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=30) as resp:
            models = json.load(resp)["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("x", 256)]
        stop, ref = _stop_case(model_dir)
        address = router_line.removeprefix("router listening on ")
        r = pdserve("generate", "--router", address, "--prompt", "hi there", "--chat", "--max-tokens", "12",
                    "--stop", stop, "--json", env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == ref.text and out["finish_reason"] == "stop"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_engine_uses_the_configured_chat_template(model_dir: Path) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(str(model_dir), chat_template=TEMPLATE))
    assert engine.tokenizer.chat_template == TEMPLATE


def test_the_engine_seed_makes_unseeded_sampling_reproducible(model_dir: Path) -> None:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.llm import LLM as Offline

    def run(seed: int, before: int) -> list[int]:
        torch.manual_seed(before)  # what ran before must not matter: the engine seeds at start
        llm = Offline.__new__(Offline)
        llm.engine = LLMEngine(EngineConfig(str(model_dir), seed=seed))
        llm.tokenizer = llm.engine.tokenizer
        return llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=2.0))[0].token_ids

    assert run(1, before=11) == run(1, before=22)
