"""End to end with an MLA model: a tiny DeepSeek-V3 checkpoint on 1 prefill + 1 decode worker
(real Ray, embedded Redis, gRPC), its latent blocks pulled between the workers."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cli.client import build_request, generate
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.kvcache.hashing import block_hashes
from tests.engine.test_engine import hf_greedy
from tests.support.deepseek_models import make_deepseek_checkpoint
from tests.support.models import load_hf_reference
from tests.support.polling import wait_until
from tests.support.service import all_idle, shared_ray, stub_for

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_deepseek_checkpoint(tmp_path_factory.mktemp("dsv3"), "v3", seed=7))


@pytest.fixture(scope="module")
def service(model_dir: str):
    config = ServiceConfig.load(port=0, http_port=0, engine__model=model_dir,
                                engine__cache__kv_cache_memory_bytes=2 * 1024**2,
                                router__local_prefill_threshold=8)  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    address, _ = svc.start()
    channel, stub = stub_for(address)
    yield svc, stub
    channel.close()
    svc.stop()


def test_1p1d_matches_transformers_and_moves_latent_blocks(service, model_dir: str) -> None:
    svc, stub = service
    hf = load_hf_reference(model_dir)
    prompts = [[(i * 31 + k * 7) % 256 for i in range(n)] for k, n in enumerate([20, 37, 50])]
    results = [generate(stub, build_request(p, GREEDY)) for p in prompts]
    offline = LLM(model_dir, num_blocks=64).generate(prompts, GREEDY)
    for p, r, o in zip(prompts, results, offline):
        assert r.token_ids == o.token_ids == hf_greedy(hf, p, NEW)
        assert r.usage["transferred_tokens"] == len(p)  # the whole prompt's latents came over the wire
    # A shared 48-token prefix: the prefill worker reuses its cached latent blocks, the decode worker
    # its pulled ones, and Redis names both as holders of the prefix's blocks.
    again = prompts[2][:48] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    second = generate(stub, build_request(again, GREEDY))
    assert second.usage["cached_tokens"] == 48 and second.usage["transferred_tokens"] == len(again) - 48
    assert second.token_ids == hf_greedy(hf, again, NEW)
    cfg = svc.index_config()
    client = cfg.client()
    hashes = block_hashes(prompts[2][:48], 16, seed=svc.config.engine.cache.hash_seed)
    assert all(len(client.hgetall(cfg.block_key(h))) == 2 for h in hashes)
    assert wait_until(lambda: all_idle(svc), timeout=30)
