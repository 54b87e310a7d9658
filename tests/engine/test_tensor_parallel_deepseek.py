"""DeepSeek (MLA + MoE) under tensor parallelism on the CPU, against transformers and one rank.

Each rank holds its heads of ``q_b_proj`` / ``kv_b_proj`` / ``o_proj`` and its share of every
expert's intermediate columns; the latent projections, the router and the norms are whole on every
rank, and so is the cached latent row (the same bytes from every rank)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model import ModelConfig, load_model
from pdserve.engine.parallel.shard import TPShard, check_tensor_parallel
from tests.engine.test_engine import hf_greedy, prompts
from tests.engine.test_tensor_parallel import _run_ranks
from tests.support.deepseek_models import make_deepseek_checkpoint
from tests.support.models import hf_logits, load_hf_reference

pytest.importorskip("transformers")

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-tp")
    return {v: make_deepseek_checkpoint(root / v, v, seed=20 + i) for i, v in enumerate(("v2_lite", "v2", "v3"))}


@pytest.mark.parametrize(("variant", "size"), [("v2_lite", 2), ("v3", 2), ("v2", 4)])
def test_sharded_deepseek_matches_transformers_and_one_rank(variant: str, size: int, checkpoints: dict[str, Path],
                                                            tmp_path: Path) -> None:  # fmt: skip
    """A prefill of two prompts, a chunk over cached context (decompressed form), then two decode
    steps (absorbed form), with every rank in a thread over real gloo and one shared latent cache."""
    path = checkpoints[variant]
    a, b = prompts(7, [13, 6])
    chunks = [[(0, a[:9]), (1, b)], [(0, a[9:])], [(0, [3]), (1, [4])], [(0, [5]), (1, [6])]]
    split = _run_ranks(path, size, chunks, tmp_path)
    whole = _run_ranks(path, 1, chunks, tmp_path)
    for s, w in zip(split, whole):  # float32: only the order of the sums differs
        torch.testing.assert_close(s, w, **TOL)
    hf = load_hf_reference(path)
    full_a, full_b = hf_logits(hf, a + [3, 5]), hf_logits(hf, b + [4, 6])
    torch.testing.assert_close(torch.cat([split[0][:9], split[1]]), full_a[:13], **TOL)
    torch.testing.assert_close(split[0][9:], full_b[:6], **TOL)
    torch.testing.assert_close(split[2], torch.stack([full_a[13], full_b[6]]), **TOL)
    torch.testing.assert_close(split[3], torch.stack([full_a[14], full_b[7]]), **TOL)


def test_each_rank_holds_its_heads_and_its_share_of_every_expert(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["v3"]
    whole = load_model(path)
    half = load_model(path, shard=TPShard(1, 2))
    sizes = {n: p.numel() for n, p in half.named_parameters()}
    whole_parts = ("norm", "kv_a_proj_with_mqa", "q_a_proj", "mlp.gate.")
    for name, p in whole.named_parameters():
        if any(part in name for part in whole_parts):
            assert sizes[name] == p.numel(), name  # replicated: the latent, the router, the norms
        else:
            assert sizes[name] * 2 == p.numel(), name
    # Rank 1's share of expert 3: the second half of its gate rows and of its up rows.
    c = whole.config
    assert c.moe is not None
    inter = c.moe.moe_intermediate_size
    w, h = whole.model.layers[1].mlp.experts.gate_up_proj[3], half.model.layers[1].mlp.experts.gate_up_proj[3]
    assert torch.equal(h[: inter // 2], w[inter // 2 : inter])
    assert torch.equal(h[inter // 2 :], w[inter + inter // 2 :])


def test_engine_greedy_equals_transformers_with_prefix_hits(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["v3"]
    hf = load_hf_reference(path)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ps = prompts(5, [3, 11, 22])
    llm = LLM(str(path), num_blocks=64, block_size=4, tensor_parallel_size=2)
    try:
        outs = llm.generate(ps, params)
        again = llm.generate([ps[2][:20] + [7]], params)[0]  # a prefix hit on the shared latent cache
        assert again.num_cached_tokens == 20
        assert again.token_ids == hf_greedy(hf, ps[2][:20] + [7], 12)
        for p, o in zip(ps, outs):
            assert o.token_ids == hf_greedy(hf, p, 12)
        kv = llm.engine.kv_manager
        kv.check_invariants()
        assert kv.num_free_blocks() == kv.num_blocks
    finally:
        llm.close()


def test_expert_columns_that_do_not_split_are_refused_by_name(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    check_tensor_parallel(ModelConfig.from_path(checkpoints["v3"]), 4)
    odd = tmp_path / "odd"
    shutil.copytree(checkpoints["v3"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["moe_intermediate_size"] = 30
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="moe_intermediate_size=30 does not divide by tensor_parallel_size=4"):
        check_tensor_parallel(ModelConfig.from_path(odd), 4)
