"""Round trip: a real prefill in one process, its KV pulled into another process's pool, decode there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_handover import RemotePrefill
from pdserve.engine.model import make_tiny_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.pull import pull_kv
from tests.support import REPO


@pytest.mark.parametrize("model,kv_cache_dtype", [("llama", "auto"), ("deepseek_v3", "auto"), ("deepseek_v3", "fp8")])
def test_pulled_kv_is_bit_exact_and_decodes_the_same(tmp_path: Path, model: str, kv_cache_dtype: str) -> None:
    """For K/V blocks (Llama) and latent blocks (DeepSeek's MLA, also quantized) alike."""
    if model == "llama":
        model_dir = str(make_tiny_model(tmp_path / "m", seed=5))
    else:
        pytest.importorskip("transformers")
        from tests.support.deepseek_models import make_deepseek_checkpoint

        model_dir = str(make_deepseek_checkpoint(tmp_path / "m", "v3", seed=5))
    prompt = [(i * 37) % 256 for i in range(29)]  # 3 full blocks of 8 + a partial block
    n = 16
    peer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.kv_engine_peer", model_dir, json.dumps(prompt), str(tmp_path), str(n),
         kv_cache_dtype],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert peer.stdout is not None
        info = json.loads(peer.stdout.readline())
        # Local engine: a different pool size, so block ids differ from the peer's.
        local = LLMEngine(EngineConfig(model_dir, cache=CacheConfig(block_size=8, num_blocks=40,
                                                                    kv_cache_dtype=kv_cache_dtype)))  # fmt: skip
        assert local.layout.kind == ("mla" if model != "llama" else "mha")
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        req = local.make_request(prompt, params, "pulled")
        load = local.add_remote(req, RemotePrefill(len(prompt), (info["first_token"],)))
        assert load is not None and load.num_external_tokens == 29 and load.first_block == 0
        with KVTransferClient(info["address"]) as client:
            client.check_compatible(local.layout, local.model_config.fingerprint)
            stats = pull_kv(client, local.kv_tensor, load, lease_id=info["lease_id"])
            assert stats.num_tokens == 29
            pulled = b"".join(local.kv_tensor.block_bytes(b).numpy().tobytes() for b in load.block_ids)
            assert pulled == Path(info["blocks_file"]).read_bytes()  # bit-exact, partial block included
        assert local.begin_load(req.request_id)
        local.finish_load(req.request_id, ok=True)
        outs = []
        while local.has_unfinished():
            outs.extend(local.step())
        assert [info["first_token"]] + [t for o in outs for t in o.new_token_ids] == info["continuation"]
        local.handover.check_invariants()
        assert local.kv_usage().free_blocks == local.kv_usage().num_blocks
    finally:
        peer.kill()
        peer.wait()
