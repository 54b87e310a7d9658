"""bfloat16 on the CPU: the auto dtype rule (engine/model/dtype.py, the CPU's units injected), the
packed bfloat16 projections on AMX (the tile kernel of engine/kernels/cpu_amx.c, else oneDNN's), and
the engine in bfloat16 against transformers in bfloat16 on the same bfloat16 checkpoint.

Accuracy, stated (teacher-forced logits over 4 prompts, a batched chunked prefill then 4 batched
decode steps, against transformers' eager bfloat16 forward of each whole sequence):

- top-1 agreement with transformers-bf16 on at least ``TOP1_MIN`` (97%) of positions, and every
  disagreement a near tie: transformers' own logits for the two tokens within ``MAX_ERR`` of each
  other;
- max |logit error| at most ``MAX_ERR`` (2%) and mean at most ``MEAN_ERR`` (0.25%) of the largest
  |logit| (bfloat16 keeps 8 significant bits: one rounding is up to 0.4%);
- against transformers in float32, the engine's bfloat16 error is no larger than
  ``VS_F32_FACTOR`` (1.5) times transformers-bf16's own: the engine adds nothing to what
  bfloat16 itself costs.

float32 stays exact: every parity test elsewhere runs float32 (the tiny models are stored in
float32; the reduced-precision ones are pinned to ``dtype="float32"``), and
``test_float32_checkpoint_stays_float32_and_exact`` checks the rule keeps float32 here.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.cpu_features import BF16_FLAGS, cpu_bf16_units
from pdserve.engine.model import ModelConfig, make_tiny_model
from pdserve.engine.model.dtype import resolve_dtype, stored_precision
from pdserve.engine.kernels import cpu_amx
from pdserve.engine.model.linear import Linear, OneDNNWeights, onednn_supported
from tests.support.gguf_files import smollm2_path, write_gguf
from tests.support.models import PagedRunner, hf_logits, make_hf_checkpoint

pytest.importorskip("transformers")

TOP1_MIN = 0.97
MAX_ERR = 0.02
MEAN_ERR = 0.0025
VS_F32_FACTOR = 1.5
CPU = torch.device("cpu")
VARIANTS = ("llama_gqa", "qwen2_bias", "tied")


# ------------------------------------------------------------------ the rule
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    d = make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)
    return d, ModelConfig.from_path(d)


@pytest.mark.parametrize(("stored", "units", "device", "requested", "expected"), [
    ("bfloat16", ("amx_bf16",), "cpu", None, torch.bfloat16),
    ("float16", ("avx512_bf16",), "cpu", None, torch.bfloat16),  # bf16 covers fp16's range; no fast fp16 here
    ("float32", ("amx_bf16", "avx512_bf16"), "cpu", None, torch.float32),  # a float32 checkpoint stays float32
    (None, ("amx_bf16",), "cpu", None, torch.float32),  # a checkpoint that does not say counts as float32
    ("bfloat16", (), "cpu", None, torch.float32),  # no bf16 units: bf16 would be emulated
    ("bfloat16", ("amx_bf16",), "cpu", "float32", torch.float32),  # an explicit dtype wins
    ("float32", (), "cpu", "bfloat16", torch.bfloat16),
    ("float32", (), "cuda", None, torch.bfloat16),  # CUDA as before
    ("bfloat16", (), "cuda", "float16", torch.float16),
])  # fmt: skip
def test_auto_dtype_rule(tiny: tuple[Path, ModelConfig], stored: str | None, units: tuple[str, ...], device: str,
                         requested: str | None, expected: torch.dtype) -> None:  # fmt: skip
    path, config = tiny
    config = dataclasses.replace(config, torch_dtype=stored)
    choice = resolve_dtype(requested, path, config, torch.device(device), units=units)
    assert choice.dtype == expected, choice
    assert choice.why  # logged at engine start


def test_gguf_files_count_as_reduced_unless_all_f32(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", "llama_gqa", seed=5)
    quantized, full = write_gguf(hf, tmp_path / "q.gguf"), write_gguf(hf, tmp_path / "f.gguf", quantize=())
    assert stored_precision(quantized, ModelConfig.from_path(quantized)) == (True, "GGUF Q8_0")
    assert stored_precision(full, ModelConfig.from_path(full)) == (False, "GGUF F32")
    amx = ("amx_bf16",)
    assert resolve_dtype(None, quantized, ModelConfig.from_path(quantized), CPU, units=amx).dtype == torch.bfloat16
    assert resolve_dtype(None, full, ModelConfig.from_path(full), CPU, units=amx).dtype == torch.float32


def test_the_shipped_smollm2_file_runs_bf16_where_the_cpu_has_the_units() -> None:
    path = smollm2_path()
    config = ModelConfig.from_path(path)
    assert stored_precision(path, config) == (True, "GGUF Q4_1, Q8_0")
    assert resolve_dtype(None, path, config, CPU, units=("amx_bf16",)).dtype == torch.bfloat16
    assert resolve_dtype(None, path, config, CPU, units=()).dtype == torch.float32


def test_env_overrides_the_detection(tiny: tuple[Path, ModelConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    path, config = tiny
    bf16_config = dataclasses.replace(config, torch_dtype="bfloat16")
    monkeypatch.setenv("PDSERVE_CPU_BF16", "1")
    choice = resolve_dtype(None, path, bf16_config, CPU)
    assert choice.dtype == torch.bfloat16 and "PDSERVE_CPU_BF16=1" in choice.why
    monkeypatch.setenv("PDSERVE_CPU_BF16", "0")
    assert resolve_dtype(None, path, bf16_config, CPU).dtype == torch.float32
    monkeypatch.setenv("PDSERVE_CPU_BF16", "yes please")
    with pytest.raises(ValueError, match="PDSERVE_CPU_BF16"):
        resolve_dtype(None, path, bf16_config, CPU)
    assert resolve_dtype("float32", path, bf16_config, CPU).dtype == torch.float32  # not read when not needed


def test_detection_agrees_with_torchs_probe() -> None:
    units = cpu_bf16_units()
    assert set(units) <= set(BF16_FLAGS)
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None:
        assert ("avx512_bf16" in units) == probe()


# ------------------------------------------------------------------ AMX
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    return {v: make_hf_checkpoint(root / v, v, seed=11 + i, dtype=torch.bfloat16) for i, v in enumerate(VARIANTS)}


@pytest.mark.skipif("amx_bf16" not in cpu_bf16_units(), reason="this CPU has no AMX-BF16")
def test_auto_runs_a_bf16_checkpoint_on_amx(checkpoints: dict[str, Path], capfd: pytest.CaptureFixture[str]) -> None:
    """Auto picks bfloat16 here and packs every projection for AMX: this project's tile kernel where
    the inputs come in whole tile rows (engine/kernels/cpu_amx.c, the model's 64), else oneDNN,
    which runs them on AMX too."""
    engine = LLM(str(checkpoints["llama_gqa"]), num_blocks=32, block_size=8).engine
    assert engine.dtype == torch.bfloat16 and engine.onednn
    layer = engine.model.model.layers[0].self_attn.qkv_proj
    assert layer.packed
    if cpu_amx.available(layer.weight):
        assert isinstance(layer._packed, cpu_amx.AMXWeights)
    odd = Linear(72, 40, bias=False).to(torch.bfloat16)  # 72 inputs: not whole tile rows
    odd.pack()
    assert isinstance(odd._packed, OneDNNWeights)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        for rows in (1, 9, 300):  # a decode row, a decode batch, a prefill (bucketed)
            odd(torch.randn(rows, odd.in_features, dtype=torch.bfloat16))
    runs = [line for line in capfd.readouterr().out.splitlines() if ",exec," in line and "inner_product" in line]
    assert len(runs) == 3 and all("amx" in line for line in runs), runs


# ------------------------------------------------------------------ accuracy
def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in (20, 37, 64, 9)]


def _teacher_forced(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position: all prompts but their last 4 tokens prefilled in one step, then
    4 decode steps of one token each, all sequences batched (as the engine schedules them)."""
    runner = PagedRunner(model, block_size=8, num_blocks=64, seed=1)
    first = runner.step([(i, p[:-4]) for i, p in enumerate(prompts)])
    out = list(first.split([len(p) - 4 for p in prompts]))
    for j in range(4):
        step = runner.step([(i, [p[j - 4]]) for i, p in enumerate(prompts)])
        out = [torch.cat([o, step[i : i + 1]]) for i, o in enumerate(out)]
    return out


def _hf(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_bf16_logits_match_transformers_bf16(variant: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[variant]
    engine = LLM(str(path), dtype="bfloat16", num_blocks=32, block_size=8).engine  # bf16 on any CPU
    assert engine.dtype == torch.bfloat16
    assert engine.onednn == onednn_supported(torch.bfloat16, CPU)
    hf16, hf32 = _hf(path, torch.bfloat16), _hf(path, torch.float32)
    prompts = _prompts(seed=3)
    ours = _teacher_forced(engine.model, prompts)
    ref16 = [hf_logits(hf16, p) for p in prompts]
    ref32 = [hf_logits(hf32, p) for p in prompts]
    got, r16, r32 = torch.cat(ours), torch.cat(ref16), torch.cat(ref32)
    scale = r32.abs().max().item()
    err = (got - r16).abs()
    top1 = (got.argmax(-1) == r16.argmax(-1)).float().mean().item()
    ours_vs_f32, bf16_vs_f32 = (got - r32).abs().mean().item(), (r16 - r32).abs().mean().item()
    print(f"\n{variant}: top-1 {top1:.4f}, max err {err.max().item() / scale:.4%}, mean err "
          f"{err.mean().item() / scale:.4%} of max |logit| {scale:.2f}; mean err vs float32: ours "
          f"{ours_vs_f32:.5f}, transformers-bf16 {bf16_vs_f32:.5f}")  # fmt: skip
    assert top1 >= TOP1_MIN
    for row in (got.argmax(-1) != r16.argmax(-1)).nonzero().flatten().tolist():  # only near ties
        assert r16[row].max() - r16[row, got[row].argmax()] <= MAX_ERR * scale, row
    assert err.max().item() <= MAX_ERR * scale
    assert err.mean().item() <= MEAN_ERR * scale
    assert ours_vs_f32 <= VS_F32_FACTOR * bf16_vs_f32


def test_engine_bf16_greedy_tokens_are_transformers_top1(checkpoints: dict[str, Path]) -> None:
    """The engine's own greedy generation in bfloat16 (batched decode through the scheduler), each
    token checked against transformers-bf16 teacher-forced on the engine's sequence."""
    path = checkpoints["llama_gqa"]
    llm = LLM(str(path), dtype="bfloat16", num_blocks=64, block_size=8)
    prompts = _prompts(seed=4)
    check_greedy_bf16(path, prompts, llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True)))


def check_greedy_bf16(path: Path, prompts: list[list[int]], outs: list) -> None:
    """Every generated token of ``outs`` (the engine's greedy outputs for ``prompts``) is transformers-bf16's
    top-1 teacher-forced on the engine's own sequence, or a near tie (within ``MAX_ERR`` of the largest
    float32 |logit|), and at least ``TOP1_MIN`` of them are its top-1."""
    hf16, hf32 = _hf(path, torch.bfloat16), _hf(path, torch.float32)
    agree = total = 0
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        ref = hf_logits(hf16, seq)[len(p) - 1 : -1]
        scale = hf_logits(hf32, seq).abs().max().item()
        chosen = torch.tensor(o.token_ids)
        agree += (ref.argmax(-1) == chosen).sum().item()
        total += len(chosen)
        margin = ref.max(-1).values - ref.gather(1, chosen[:, None])[:, 0]
        assert (margin <= MAX_ERR * scale).all(), margin
    assert agree / total >= TOP1_MIN, agree / total


def test_float32_checkpoint_stays_float32_and_exact(tmp_path: Path) -> None:
    """The auto rule on this CPU, whatever its units: a float32 checkpoint runs in float32 and its
    greedy tokens equal transformers' float32 ones."""
    path = make_hf_checkpoint(tmp_path / "f32", "llama_gqa", seed=11)
    llm = LLM(str(path), num_blocks=64, block_size=8)
    assert llm.engine.dtype == torch.float32
    hf32 = _hf(path, torch.float32)
    for p, o in zip(_prompts(seed=5), llm.generate(_prompts(seed=5), SamplingParams(max_tokens=8, ignore_eos=True))):
        ids = torch.tensor([p])
        want = hf32.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert o.token_ids == want
