"""pdserve.engine.model against transformers (float32, eager attention) as the reference."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.model import LlamaForCausalLM, ModelConfig, load_model, load_tokenizer, make_tiny_model
from pdserve.engine.model.linear import Linear
from tests.support.models import (
    HF_VARIANTS,
    PagedRunner,
    hf_logits,
    load_hf_reference,
    make_hf_checkpoint,
    paged_prefill_logits,
)

pytest.importorskip("transformers")

TOL = dict(atol=1e-4, rtol=1e-4)
# Block sizes vary per variant so odd sizes, size 1 and multi-block prompts all run.
BLOCK_SIZES = {"llama_gqa": 16, "qwen2_bias": 4, "mqa": 1, "llama3_rope": 8, "sharded": 5, "tied": 3,
               "mistral_window": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {v: make_hf_checkpoint(root / v, v, seed=i) for i, v in enumerate(HF_VARIANTS)}


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, tuple[LlamaForCausalLM, torch.nn.Module]]:
    return {v: (load_model(d), load_hf_reference(d)) for v, d in checkpoints.items()}


def _prompt(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_prefill_logits_match_hf(variant: str, models: dict) -> None:
    ours, ref = models[variant]
    ids = _prompt(70, seed=1)  # > llama3 original context (32): all rope bands matter
    got = paged_prefill_logits(ours, ids, BLOCK_SIZES[variant], seed=3)
    torch.testing.assert_close(got, hf_logits(ref, ids), **TOL)
    assert got.dtype == torch.float32 and got.shape == (70, 300)


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias", "llama3_rope", "mistral_window"])
def test_chunked_prefill_then_decode_matches_hf(variant: str, models: dict) -> None:
    ours, ref = models[variant]
    ids = _prompt(45, seed=2)
    expected = hf_logits(ref, ids)
    runner = PagedRunner(ours, block_size=4, seed=5)
    parts = [ids[:17], ids[17:40]] + [[t] for t in ids[40:]]  # prefill, cached chunk, decodes
    got = torch.cat([runner.step([(0, p)]) for p in parts])
    torch.testing.assert_close(got, expected, **TOL)


def test_mixed_batch_matches_hf_per_sequence(models: dict) -> None:
    ours, ref = models["llama_gqa"]
    a, b, c = _prompt(23, seed=3), _prompt(11, seed=4), _prompt(30, seed=6)
    runner = PagedRunner(ours, block_size=4, seed=7)
    first = runner.step([(0, a[:20]), (1, b)])  # two prefills of different lengths
    # Mixed steps: a decode beside a fresh prefill, then two decodes beside a chunk.
    second = runner.step([(0, a[20:21]), (2, c)])
    third = runner.step([(2, [5]), (1, [9]), (0, a[21:])])
    ea, eb, ec = hf_logits(ref, a), hf_logits(ref, b + [9]), hf_logits(ref, c + [5])
    torch.testing.assert_close(first[:20], ea[:20], **TOL)
    torch.testing.assert_close(first[20:], eb[:11], **TOL)
    torch.testing.assert_close(second[:1], ea[20:21], **TOL)
    torch.testing.assert_close(second[1:], ec[:30], **TOL)
    torch.testing.assert_close(third[0], ec[30], **TOL)
    torch.testing.assert_close(third[1], eb[11], **TOL)
    torch.testing.assert_close(third[2:], ea[21:], **TOL)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias", "tied"])
def test_onednn_packed_model_matches_hf(variant: str, checkpoints: dict[str, Path], models: dict) -> None:
    """Projections and the (tied) head through oneDNN: prefill and a 9-row decode step match HF."""
    _, ref = models[variant]
    ours = load_model(checkpoints[variant])
    assert ours.pack_onednn()
    prompts = [_prompt(12 + 3 * i, seed=20 + i) for i in range(9)]
    runner = PagedRunner(ours, block_size=4, seed=9)
    first = runner.step([(i, p[:-1]) for i, p in enumerate(prompts)])
    last = runner.step([(i, p[-1:]) for i, p in enumerate(prompts)])  # 9 decode rows: the oneDNN path
    start = 0
    for i, p in enumerate(prompts):
        expected = hf_logits(ref, p)
        torch.testing.assert_close(first[start : start + len(p) - 1], expected[:-1], **TOL)
        torch.testing.assert_close(last[i], expected[-1], **TOL)
        start += len(p) - 1
    # Reloading weights drops the copies (they would be stale); bfloat16 is packed where oneDNN has
    # bfloat16 kernels for the CPU (tests/engine/test_bf16_cpu.py), float16 never.
    ours.load_weights(load_file(checkpoints[variant] / "model.safetensors").items())
    assert not any(m.packed for m in ours.modules() if isinstance(m, Linear))
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert load_model(checkpoints[variant], dtype=torch.bfloat16).pack_onednn() == bf16
    assert not load_model(checkpoints[variant], dtype=torch.float16).pack_onednn()


def test_tied_model_has_no_separate_head(models: dict) -> None:
    ours, _ = models["tied"]
    assert ours.lm_head is None
    assert "lm_head.weight" not in ours.checkpoint_weight_names()


# ------------------------------------------------------------------ config
def test_config_parsing_variants(checkpoints: dict[str, Path]) -> None:
    qwen = ModelConfig.from_dir(checkpoints["qwen2_bias"])
    assert qwen.attention_bias and not qwen.o_proj_bias
    assert qwen.eos_token_ids == (257, 256) and qwen.rope_theta == 1_000_000.0
    llama3 = ModelConfig.from_dir(checkpoints["llama3_rope"])
    assert llama3.rope_scaling is not None and llama3.rope_scaling.original_max_position_embeddings == 32
    mqa = ModelConfig.from_dir(checkpoints["mqa"])
    assert (mqa.num_key_value_heads, mqa.head_dim) == (1, 8)
    # v4 layout: top-level rope_theta / rope_scaling with "type", scalar eos, no head_dim.
    raw = json.loads((checkpoints["llama3_rope"] / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw.pop("head_dim")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    assert ModelConfig.from_dict(raw) == llama3
    assert ModelConfig.from_dict(raw).fingerprint == llama3.fingerprint
    assert llama3.fingerprint != ModelConfig.from_dir(checkpoints["llama_gqa"]).fingerprint
    assert len(llama3.fingerprint) == 32 and int(llama3.fingerprint, 16) >= 0


def test_config_validation(checkpoints: dict[str, Path]) -> None:
    raw = json.loads((checkpoints["llama_gqa"] / "config.json").read_text())
    with pytest.raises(ValueError, match="divisible by num_key_value_heads"):
        ModelConfig.from_dict({**raw, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}})
    yarn = {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="yarn rope scaling is supported for DeepSeek models only"):
        ModelConfig.from_dict({**raw, "rope_parameters": yarn})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**raw, "hidden_act": "gelu"})


# ------------------------------------------------------------------ loader errors
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loader_errors(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    d = _copy(checkpoints["llama_gqa"], tmp_path / "no_config")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found in model directory .*no_config"):
        load_model(d)
    d = _copy(checkpoints["llama_gqa"], tmp_path / "no_weights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_model(d)
    d = _copy(checkpoints["sharded"], tmp_path / "no_shard")
    (d / "model-00002-of-00009.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard model-00002-of-00009.safetensors"):
        load_model(d)
    d = _copy(checkpoints["llama_gqa"], tmp_path / "gemma")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match="'GemmaForCausalLM'.*supported: LlamaForCausalLM, Mistral"):
        load_model(d)
    d = _copy(checkpoints["llama_gqa"], tmp_path / "no_tok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        load_tokenizer(d)


def test_loader_missing_and_unexpected_tensors(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = _copy(checkpoints["llama_gqa"], tmp_path / "broken")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_model(d)
    msg = str(err.value)
    assert "missing 1 weight(s): model.layers.1.self_attn.k_proj.weight" in msg
    assert "unexpected 1 weight(s): model.layers.0.mlp.extra.weight" in msg
    tensors = load_file(checkpoints["llama_gqa"] / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(65,\), expected \(64,\)"):
        load_model(d)


# ------------------------------------------------------------------ tiny model
def test_make_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a, b = make_tiny_model(tmp_path / "a", seed=7), make_tiny_model(tmp_path / "b", seed=7)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = make_tiny_model(tmp_path / "c", seed=8)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert sum((a / n).stat().st_size for n in names) < 2_000_000


def test_tiny_tokenizer_round_trips_utf8(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "tiny", vocab_size=300)
    tok = load_tokenizer(d)
    cfg = ModelConfig.from_dir(d)
    assert tok.raw.get_vocab_size() == cfg.vocab_size == 300
    assert tok.raw.token_to_id("<s>") == cfg.bos_token_id and (tok.raw.token_to_id("</s>"),) == cfg.eos_token_ids
    for text in ["hello world", "  leading\tand\nnewlines ", "héllo wörld — 世界 🎉🚀", "\x00\x7f", ""]:
        plain = tok.encode(text, add_special_tokens=False)
        assert plain == list(text.encode("utf-8"))  # byte b is token id b
        assert tok.decode(plain) == text
        with_bos = tok.encode(text)
        assert with_bos == [cfg.bos_token_id, *plain]
        assert tok.decode(with_bos) == text  # specials skipped by default
    # Literal special-token text is matched as the special token (like HF tokenizers).
    ids = tok.encode("<s>x</s>", add_special_tokens=False)
    assert ids == [cfg.bos_token_id, ord("x"), cfg.eos_token_ids[0]]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>x</s>"


def test_hf_loads_tiny_model_and_agrees(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "tiny", seed=3)
    ours, ref = load_model(d), load_hf_reference(d)
    tok = load_tokenizer(d)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Ünïcödé!")
    got = paged_prefill_logits(ours, ids, block_size=16)
    torch.testing.assert_close(got, hf_logits(ref, ids), **TOL)
    # Greedy continuation is not degenerate: the random weights give varied tokens.
    runner = PagedRunner(ours, block_size=16)
    nxt = int(runner.step([(0, ids)])[-1].argmax())
    out = [nxt]
    for _ in range(15):
        nxt = int(runner.step([(0, [nxt])])[-1].argmax())
        out.append(nxt)
    assert len(set(out)) >= 4, out


# ------------------------------------------------------------------ dtypes / devices
def test_bfloat16_model_tracks_float32(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "tiny", seed=1)
    f32, bf16 = load_model(d), load_model(d, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in bf16.parameters())
    ids = list(range(40, 100))
    ref = paged_prefill_logits(f32, ids, block_size=8)
    got = paged_prefill_logits(bf16, ids, block_size=8)  # cache allocated in bf16 too
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.25 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_forward_rejects_wrong_cache_shape(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["mqa"])
    runner = PagedRunner(model, block_size=4)
    runner.kv_cache = runner.kv_cache[:, :1]  # one layer instead of two
    with pytest.raises(ValueError, match=r"kv_cache shape .* is not \[num_blocks, 2, 2, block_size, 1, 8\]"):
        runner.step([(0, [1, 2, 3])])


def test_empty_batch(checkpoints: dict[str, Path]) -> None:
    from pdserve.engine.kernels.metadata import AttentionMetadata

    model = load_model(checkpoints["llama_gqa"])
    i32 = torch.int32
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=i32), torch.zeros(0, dtype=i32),
        torch.zeros(1, dtype=i32), 0, 0,
    )
    empty = torch.zeros(0, dtype=torch.int64)
    with torch.inference_mode():
        hidden = model(empty, empty, PagedRunner(model, block_size=4).kv_cache, meta)
    assert model.compute_logits(hidden).shape == (0, 300)


def test_loading_a_model_imports_neither_dynamo_nor_sympy(checkpoints: dict[str, Path]) -> None:
    """Every worker and rank loads a model at its start; torch's compiler stack (torch._dynamo, ~2.5 s,
    reached from a random init on the meta device) and sympy (~0.5 s, reached from ``to_empty``) are
    not needed for it. Checked in a fresh interpreter, on a tied and an untied checkpoint."""
    code = (
        "import sys\n"
        "from pdserve.engine.model import load_model\n"
        "for path in sys.argv[1:]:\n"
        "    load_model(path)\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    paths = [str(checkpoints["llama_gqa"]), str(checkpoints["tied"])]
    r = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias", "llama3_rope", "mistral_window"])
def test_cuda_matches_hf(variant: str, checkpoints: dict[str, Path], models: dict) -> None:
    _, ref = models[variant]
    ids = _prompt(70, seed=9)
    expected = hf_logits(ref, ids)
    f32 = load_model(checkpoints[variant], dtype=torch.float32, device="cuda")
    got = paged_prefill_logits(f32, ids, block_size=16).cpu()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # TF32 matmuls may be on
    bf16 = load_model(checkpoints[variant], device="cuda")  # default dtype on CUDA
    assert next(bf16.parameters()).dtype == torch.bfloat16
    runner = PagedRunner(bf16, block_size=16)
    got16 = torch.cat([runner.step([(0, ids[:50])]), *(runner.step([(0, [t])]) for t in ids[50:])]).cpu()
    assert (got16.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
