"""Round trip: a real prefill in one process, its KV pulled into another process's pool, decode there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.model import make_tiny_model
from engine.sampling_params import SamplingParams
from kvtransfer.client import KVTransferClient
from kvtransfer.pull import pull_request_kv

REPO = Path(__file__).resolve().parent.parent


def test_pulled_kv_is_bit_exact_and_decodes_the_same(tmp_path: Path) -> None:
    model_dir = str(make_tiny_model(tmp_path / "m", seed=5))
    prompt = [(i * 37) % 256 for i in range(29)]  # 3 full blocks of 8 + a partial block
    n = 16
    env = dict(os.environ, PYTHONPATH=str(REPO))
    peer = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "kv_engine_peer.py"), model_dir, json.dumps(prompt), str(tmp_path), str(n)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert peer.stdout is not None
        info = json.loads(peer.stdout.readline())
        # Local engine: a different pool size, so block ids differ from the peer's.
        local = LLMEngine(EngineConfig(model_dir, cache=CacheConfig(block_size=8, num_blocks=40)))
        req = local.make_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), "pulled")
        with KVTransferClient(info["address"]) as client:
            client.check_compatible(local.layout, local.model_config.fingerprint)
            result = pull_request_kv(local.kv, local.kv_cache, req, client, len(prompt), lease_id=info["lease_id"],
                                     lock=local.lock)  # fmt: skip
            assert result is not None and result.num_external_tokens == 29
            pulled = b"".join(local.kv_cache.block_bytes(b).numpy().tobytes() for b in result.block_ids)
            assert pulled == Path(info["blocks_file"]).read_bytes()  # bit-exact, partial block included
        req.append_output_token(info["first_token"])
        local.add_running(req)
        while local.has_unfinished():
            local.step()
        assert req.output_token_ids == info["continuation"]
        local.kv.check_invariants()
        assert local.kv.num_free_blocks() == local.kv.num_blocks
    finally:
        peer.kill()
        peer.wait()
