"""The FP8 KV cache in the engine: more blocks at equal memory, the checkpoint's scales, the layout
peers compare, pool invariants, and SmolLM2's answers unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.kernels.quant import quantize
from pdserve.kvtransfer.wire import LayoutSpec
from tests.support.gguf_files import smollm2_path


def scaled_checkpoint(src: str, dst: Path, k_scale: float, v_scale: float, vary: bool = False) -> str:
    """``src`` with per-layer KV-cache scales added, named as FP8 checkpoints name them
    (``vary``: layer i's v_scale is ``v_scale * (i + 1)``)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    layers = {int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")}
    for i in layers:
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale * (i + 1 if vary else 1))
    save_file(weights, dst / "model.safetensors")
    return str(dst)


def test_kv_cache_dtype_names_and_pool_size(tiny_model: str) -> None:
    budget = 4 * 1024**2
    auto = LLM(tiny_model, kv_cache_memory_bytes=budget)
    fp8 = LLM(tiny_model, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    e5m2 = LLM(tiny_model, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8_e5m2")
    assert fp8.engine.layout.dtype == torch.float8_e4m3fn and e5m2.engine.layout.dtype == torch.float8_e5m2
    # One byte per value instead of four (float32 on the CPU): four times the blocks.
    assert fp8.engine.kv_tensor.num_blocks == 4 * auto.engine.kv_tensor.num_blocks
    assert fp8.engine.layout.kv_scales == (1.0,) * (2 * auto.engine.model_config.num_hidden_layers)
    assert auto.engine.layout.kv_scales == ()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        CacheConfig(kv_cache_dtype="int8")
    # Every block is back in the pool after a batch that preempts (a pool of 6 blocks).
    small = LLM(tiny_model, num_blocks=6, kv_cache_dtype="fp8", max_num_seqs=4)
    outs = small.generate([list(range(1, 30)), list(range(2, 31))], SamplingParams(max_tokens=40, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [40, 40]
    usage = small.engine.kv_usage()
    assert usage.free_blocks == usage.num_blocks and usage.requests == 0


def test_scales_come_from_the_checkpoint_and_are_part_of_the_layout(tiny_model: str, tmp_path: Path) -> None:
    scaled = scaled_checkpoint(tiny_model, tmp_path / "scaled", k_scale=0.5, v_scale=0.25, vary=True)
    llm = LLM(scaled, num_blocks=32, kv_cache_dtype="fp8")
    n = llm.engine.model_config.num_hidden_layers
    assert llm.engine.layout.kv_scales == tuple(x for i in range(n) for x in (0.5, 0.25 * (i + 1)))
    attn = llm.engine.model.model.layers[0].self_attn
    assert (attn.k_scale, attn.v_scale) == (0.5, 0.25)
    # The float cache ignores the scales (the checkpoint loads either way).
    plain = LLM(scaled, num_blocks=32)
    assert plain.engine.layout.kv_scales == () and plain.engine.model.model.layers[0].self_attn.k_scale == 1.0
    # Peers compare dtype and scales: blocks written under other scales are refused, not misread.
    other = LLM(tiny_model, num_blocks=32, kv_cache_dtype="fp8")
    diff = LayoutSpec.from_layout(llm.engine.layout).diff(LayoutSpec.from_layout(other.engine.layout))
    assert set(diff) == {"kv_scales"}
    diff = LayoutSpec.from_layout(plain.engine.layout).diff(LayoutSpec.from_layout(other.engine.layout))
    assert {"dtype", "block_nbytes", "kv_scales"} <= set(diff)


def test_a_scale_is_applied_on_write_and_on_read(tiny_model: str, tmp_path: Path) -> None:
    """Same checkpoint, scales 1 and 0.5: the stored bytes differ by the scale, the outputs agree
    (a power-of-two scale moves every value by one exponent step, so rounding is the same)."""
    scaled = scaled_checkpoint(tiny_model, tmp_path / "half", k_scale=0.5, v_scale=0.5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = list(range(3, 33))
    a = LLM(tiny_model, num_blocks=32, kv_cache_dtype="fp8")
    b = LLM(scaled, num_blocks=32, kv_cache_dtype="fp8")
    assert a.generate([prompt], params)[0].token_ids == b.generate([prompt], params)[0].token_ids
    blocks = a.engine.kv_tensor.tensor[:2, 0, 0].float()
    doubled = b.engine.kv_tensor.tensor[:2, 0, 0].float()
    # Normal values (subnormals share one step size, so they round differently), not clamped at 448.
    normal = (blocks.abs() >= 2**-6) & (blocks.abs() < 224)
    assert normal.sum() > 100 and torch.equal(doubled[normal], (blocks * 2)[normal])
    assert torch.equal(quantize(torch.tensor([3.3]), 0.5, torch.float8_e4m3fn).float(), torch.tensor([6.5]))


def test_smollm2_answers_the_same_with_an_fp8_cache() -> None:
    prompt = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    params = SamplingParams(max_tokens=8)
    answers = {kv: LLM(str(smollm2_path()), num_blocks=64, kv_cache_dtype=kv, dtype="float32").chat(
               [prompt], params)[0].text for kv in ("auto", "fp8", "fp8_e5m2")}  # fmt: skip
    assert all("Paris" in a for a in answers.values()), answers
