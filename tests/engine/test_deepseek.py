"""DeepSeek-V2/V3 (MLA + MoE + YaRN) against transformers on tiny random checkpoints it built."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.engine.model import ModelConfig, load_model
from pdserve.engine.model.deepseek import DeepseekForCausalLM
from tests.engine.test_engine import assert_idle, hf_greedy
from tests.support.deepseek_models import DEEPSEEK_VARIANTS, make_deepseek_checkpoint
from tests.support.models import PagedRunner, hf_logits, load_hf_reference, paged_prefill_logits

pytest.importorskip("transformers")

TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK_SIZES = {"v2_lite": 16, "v2": 4, "v3": 5, "v3_halves": 1}
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: make_deepseek_checkpoint(root / v, v, seed=10 + i) for i, v in enumerate(DEEPSEEK_VARIANTS)}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {v: load_hf_reference(d) for v, d in checkpoints.items()}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("variant", DEEPSEEK_VARIANTS)
def test_prefill_logits_match_hf(variant: str, checkpoints: dict, references: dict) -> None:
    ours = load_model(checkpoints[variant])
    assert isinstance(ours, DeepseekForCausalLM)
    ids = _prompt(70, seed=1)
    got = paged_prefill_logits(ours, ids, BLOCK_SIZES[variant], seed=3)
    torch.testing.assert_close(got, hf_logits(references[variant], ids), **TOL)


@pytest.mark.parametrize("form", ["auto", "absorbed", "naive"])
@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_chunks_and_decodes_match_hf_in_every_form(variant: str, form: str, checkpoints: dict,
                                                   references: dict) -> None:  # fmt: skip
    """Prefill, a chunk over cached context, then decodes: each attention form gives HF's logits."""
    ours = load_model(checkpoints[variant])
    ours.set_mla_form(form)
    ids = _prompt(45, seed=2)
    runner = PagedRunner(ours, block_size=4, seed=5)
    parts = [ids[:17], ids[17:40]] + [[t] for t in ids[40:]]
    got = torch.cat([runner.step([(0, p)]) for p in parts])
    torch.testing.assert_close(got, hf_logits(references[variant], ids), **TOL)


def test_mixed_batch_matches_hf(checkpoints: dict, references: dict) -> None:
    ours, ref = load_model(checkpoints["v2"]), references["v2"]
    a, b = _prompt(23, seed=3), _prompt(11, seed=4)
    runner = PagedRunner(ours, block_size=4, seed=7)
    first = runner.step([(0, a[:20]), (1, b)])
    second = runner.step([(0, a[20:21]), (1, [9])])  # a decode-only step: the absorbed form
    third = runner.step([(1, [5]), (0, a[21:])])  # a decode beside a chunk
    ea, eb = hf_logits(ref, a), hf_logits(ref, b + [9, 5])
    torch.testing.assert_close(first, torch.cat([ea[:20], eb[:11]]), **TOL)
    torch.testing.assert_close(second, torch.stack([ea[20], eb[11]]), **TOL)
    torch.testing.assert_close(third, torch.cat([eb[12:13], ea[21:]]), **TOL)


def test_set_mla_form_rejects_unknown(checkpoints: dict) -> None:
    with pytest.raises(ValueError, match="MLA form"):
        load_model(checkpoints["v3"]).set_mla_form("fast")


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_engine_greedy_matches_transformers(variant: str, checkpoints: dict, references: dict) -> None:
    """Prompt lengths across block boundaries, batched; the pool holds latents, not K/V."""
    llm = LLM(str(checkpoints[variant]), num_blocks=64, block_size=16)
    layout = llm.engine.layout
    assert (layout.kind, layout.planes, layout.num_kv_heads, layout.head_dim, layout.rope_dim) == ("mla", 1, 1, 40, 8)
    ps = [_prompt(n, seed=n) for n in (1, 7, 16, 17, 33)]
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(references[variant], p, NEW_TOKENS)
    assert_idle(llm)


def test_prefix_hits_and_preemption_match(checkpoints: dict, references: dict) -> None:
    path, ref = checkpoints["v2"], references["v2"]
    llm = LLM(str(path), num_blocks=64, block_size=16)
    prefix = _prompt(40, seed=8)
    a, b = prefix + [1, 2, 3], prefix + [9, 8, 7, 6]
    assert llm.generate([a], GREEDY)[0].token_ids == hf_greedy(ref, a, NEW_TOKENS)
    second = llm.generate([b], GREEDY)[0]
    assert second.num_cached_tokens == 32 and second.token_ids == hf_greedy(ref, b, NEW_TOKENS)
    assert_idle(llm)
    # 4 requests of ~20 + 24 tokens need 3 blocks of 16 each; 7 blocks force preemption.
    tight = LLM(str(path), num_blocks=7, block_size=16, enable_prefix_caching=False)
    ps = [_prompt(n, seed=20 + n) for n in (20, 18, 21, 19)]
    outs = tight.generate(ps, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(ref, p, NEW_TOKENS)
    assert_idle(tight)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_latent_cache_with_checkpoint_scales(fp8: torch.dtype, checkpoints: dict, references: dict,
                                                 tmp_path: Path) -> None:  # fmt: skip
    """Latent rows stored in FP8 under the checkpoint's per-layer ``self_attn.k_scale`` (0.5 here):
    every attention form reads the same values back, and the logits stay near transformers'."""
    src = checkpoints["v3"]
    weights = load_file(src / "model.safetensors")
    weights.update({f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.5) for i in range(3)})
    out = tmp_path / "scaled"
    out.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (out / f).write_bytes((src / f).read_bytes())
    save_file(weights, out / "model.safetensors")
    model = load_model(out)
    assert model.kv_scales(quantized=True) == (0.5, 0.5, 0.5)
    ids = _prompt(45, seed=2)
    expected = hf_logits(references["v3"], ids)
    got = {}
    for form in ("absorbed", "naive", "auto"):
        model.set_mla_form(form)
        runner = PagedRunner(model, block_size=4, seed=5)
        runner.kv_cache = torch.zeros(runner.kv_cache.shape, dtype=fp8)
        got[form] = torch.cat([runner.step([(0, p)]) for p in [ids[:17], ids[17:40]] + [[t] for t in ids[40:]]])
    for form in ("absorbed", "naive"):
        torch.testing.assert_close(got[form], got["auto"], **TOL)
    # Quantization moves the logits of this unit-scale random model by about 11% (mean, both
    # formats); latents written or read wrongly (zeros, the wrong rows) move them by far more.
    err = (got["auto"] - expected).abs().mean().item() / expected.abs().mean().item()
    top1 = (got["auto"].argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert err < 0.25 and top1 >= 0.7, (err, top1)
    llm = LLM(str(out), num_blocks=16, block_size=16, kv_cache_dtype="fp8" if fp8 == torch.float8_e4m3fn
              else "fp8_e5m2")  # fmt: skip
    layout = llm.engine.layout
    assert (layout.dtype, layout.kv_scales, layout.block_nbytes) == (fp8, (0.5, 0.5, 0.5), 3 * 16 * 40)
    llm.generate([ids], GREEDY)
    assert_idle(llm)


def test_router_gate_stays_float32_in_a_bf16_model(checkpoints: dict) -> None:
    """Rounded to bf16 the router's weight and correction bias would pick other experts."""
    model = load_model(checkpoints["v3"], dtype=torch.bfloat16)
    weights = load_file(checkpoints["v3"] / "model.safetensors")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert gate.weight.equal(weights["model.layers.1.mlp.gate.weight"])
    assert gate.e_score_correction_bias.equal(weights["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_cuda_engine_matches_transformers(variant: str, checkpoints: dict, references: dict) -> None:
    """The engine on the GPU (Triton MLA kernels, float32): HF's greedy tokens on the CPU."""
    llm = LLM(str(checkpoints[variant]), num_blocks=64, block_size=16, device="cuda", dtype="float32",
              max_num_batched_tokens=24)  # fmt: skip
    ps = [_prompt(n, seed=n) for n in (1, 7, 17, 33, 50)]
    outs = llm.generate(ps, GREEDY)
    same = sum(o.token_ids == hf_greedy(references[variant], p, NEW_TOKENS) for p, o in zip(ps, outs))
    assert same >= len(ps) - 1  # TF32 or reduction order may flip one near-tie
    assert_idle(llm)


# ------------------------------------------------------------------ config and weights
def test_config_fields(checkpoints: dict) -> None:
    v2 = ModelConfig.from_dir(checkpoints["v2"])
    assert v2.mla is not None and v2.moe is not None
    assert (v2.mla.q_lora_rank, v2.mla.kv_lora_rank, v2.mla.cache_dim, v2.mla.v_head_dim) == (24, 32, 40, 12)
    assert (v2.moe.topk_method, v2.moe.scoring, v2.moe.n_group, v2.moe.topk_group) == ("group_limited_greedy",
                                                                                      "softmax", 4, 2)
    assert v2.rope_scaling is not None and v2.rope_scaling.factor == 4.0
    assert (v2.kv_cache_kind, v2.kv_cache_heads, v2.kv_cache_head_dim) == ("mla", 1, 40)
    v3 = ModelConfig.from_dir(checkpoints["v3"])
    assert (v3.moe.topk_method, v3.moe.scoring, v3.moe.norm_topk_prob) == ("noaux_tc", "sigmoid", True)
    assert v3.mla.rope_interleave and not ModelConfig.from_dir(checkpoints["v3_halves"]).mla.rope_interleave
    assert ModelConfig.from_dir(checkpoints["v2_lite"]).mla.q_lora_rank is None
    assert len({ModelConfig.from_dir(d).fingerprint for d in checkpoints.values()}) == 4


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"topk_method": "noaux_tc"}, "DeepSeek-V2 routes"),
        ({"n_group": 3}, "divisible by n_group"),
        ({"qk_rope_head_dim": 7}, "even"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "missing key 'original_max"),
        ({"kv_lora_rank": None, "q_lora_rank": "x"}, "q_lora_rank must be a number"),
        ({"routed_scaling_factor": "big"}, "routed_scaling_factor must be a number"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints are not supported"),
    ],
)
def test_bad_v2_configs_fail_at_load(edit: dict, message: str, checkpoints: dict) -> None:
    raw = json.loads((checkpoints["v2"] / "config.json").read_text())
    raw.update(edit)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_stacked_experts_and_mtp_layers_load(checkpoints: dict, tmp_path: Path, references: dict) -> None:
    """Experts stacked as transformers holds them in memory load the same; a V3 multi-token-
    prediction layer (model.layers.<num_hidden_layers>.*) is skipped; a missing expert is named."""
    src = checkpoints["v3"]
    weights = load_file(src / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if ".mlp.experts." not in name:
            stacked[name] = t
    for layer in (1, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        stacked[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{pre}.{e}.gate_proj.weight"], weights[f"{pre}.{e}.up_proj.weight"]]) for e in range(8)])
        stacked[f"{pre}.down_proj"] = torch.stack([weights[f"{pre}.{e}.down_proj.weight"] for e in range(8)])
    stacked["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(40, 64)  # the MTP layer
    out = tmp_path / "stacked"
    out.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (out / f).write_bytes((src / f).read_bytes())
    save_file(stacked, out / "model.safetensors")
    ids = _prompt(20, seed=4)
    torch.testing.assert_close(paged_prefill_logits(load_model(out), ids, 4), hf_logits(references["v3"], ids), **TOL)
    # Past the one MTP layer (num_nextn_predict_layers: 1) a layer is not skipped but reported.
    stacked["model.layers.4.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(40, 64)
    save_file(stacked, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected 1 weight\(s\): model\.layers\.4\."):
        load_model(out)
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        load_model(out)


def test_v3_routing_defaults_follow_transformers(checkpoints: dict) -> None:
    """Keys a V3 config may leave out take transformers' defaults; a missing yarn factor is
    max_position_embeddings / original_max_position_embeddings."""
    raw = json.loads((checkpoints["v3"] / "config.json").read_text())
    for key in ("n_group", "topk_group", "routed_scaling_factor"):
        raw.pop(key)
    raw["n_routed_experts"] = 16
    raw["rope_parameters"].pop("factor")
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == (8, 4, 2.5)
    assert cfg.rope_scaling.factor == raw["max_position_embeddings"] / 128
    assert cfg.num_mtp_layers == 1


def test_latent_blocks_go_through_the_offload_tier(checkpoints: dict, references: dict) -> None:
    """Four 3-block prefixes through a 6-block pool: the second round restores each prefix's latent
    blocks from the host tier and still gives transformers' tokens."""
    path, ref = checkpoints["v2_lite"], references["v2_lite"]
    prompts = [_prompt(48, seed=40 + i) + [5] for i in range(4)]
    llm = LLM(str(path), num_blocks=6, block_size=16, kv_offload_gb=0.001)
    first = [llm.generate([p], GREEDY)[0] for p in prompts]
    again = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.num_cached_tokens for o in again] == [48] * 4
    assert llm.engine.num_tier_hit_tokens >= 3 * 48
    for p, a, b in zip(prompts, first, again):
        assert a.token_ids == b.token_ids == hf_greedy(ref, p, NEW_TOKENS)
    llm.engine.tier.check_invariants()
    assert_idle(llm)


def test_an_absent_q_lora_rank_is_transformers_default_and_null_is_none(checkpoints: dict) -> None:
    from transformers import DeepseekV2Config

    raw = json.loads((checkpoints["v2"] / "config.json").read_text())
    del raw["q_lora_rank"]
    assert ModelConfig.from_dict(raw).mla.q_lora_rank == DeepseekV2Config().q_lora_rank == 1536
    raw["q_lora_rank"] = None
    assert ModelConfig.from_dict(raw).mla.q_lora_rank is None
