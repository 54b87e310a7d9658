"""The decode stack replayed as the C kernels' calls (``engine/model/decode_replay.py``) gives the
module path's results bit for bit, runs where a step qualifies and only there."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.kernels import cpu_amx_prefix, cpu_decode, cpu_ops, cpu_prefix, cpu_replay, labels
from pdserve.engine.kernels.cascade import MIN_SEQS
from pdserve.engine.model import ModelConfig, decode_replay
from pdserve.engine.model.gemm_paths import RowPaths
from pdserve.engine.model.tiny import make_tiny_model

T = TypeVar("T")

BS = 16
pytestmark = pytest.mark.skipif(cpu_decode.entry(torch.float32) is None or cpu_ops.entries(torch.float32) is None,
                                reason="the CPU kernels are not built here")  # fmt: skip


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama with 32-dim heads (what the AMX prefix kernel takes) and 3 layers."""
    return str(make_tiny_model(tmp_path_factory.mktemp("wide"), seed=5, hidden_size=128, num_layers=3,
                               num_heads=4, num_kv_heads=2, intermediate_size=256))  # fmt: skip


def _record_runs(monkeypatch: pytest.MonkeyPatch, what: Callable[[decode_replay.DecodeReplay], T]) -> list[T]:
    """A list that gets ``what(replay)`` of each step the replay runs."""
    seen: list[T] = []
    run = decode_replay.DecodeReplay.run

    def recorded(self: decode_replay.DecodeReplay, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(what(self))
        return run(self, *args)

    monkeypatch.setattr(decode_replay.DecodeReplay, "run", recorded)
    return seen


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A list that gets the row count of each step the replay runs."""
    yield _record_runs(monkeypatch, lambda r: r.rows)


@pytest.fixture
def native_prefixes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A list that gets the prefix kind (``cpu_replay.PREFIX_*``) of each step whose calls C makes."""
    seen: list[int] = []
    run = cpu_replay.run

    def counted(step: cpu_replay.Step, layers: object) -> None:
        seen.append(step.prefix)
        run(step, layers)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_replay, "run", counted)
    yield seen


NATIVE = [pytest.param(True, id="from-C"), pytest.param(False, id="from-Python")]


def _prompts(shared: int, count: int, seed: int = 3) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return prefix, [prefix + [rng.randrange(256) for _ in range(3 + i)] for i in range(count)]


def _generate(model: str, dtype: str, replay: bool, prefix: list[int], prompts: list[list[int]],
              native: bool = True) -> tuple[list[tuple[list[int], list]], bool]:  # fmt: skip
    """Every prompt's greedy tokens and top-5 log-probs, the prefix cached first, the replay on or off
    (its calls made from C or from Python); and whether the replay can run here (:func:`_replayable`)."""
    llm = LLM(model, dtype=dtype, num_blocks=256, block_size=BS)
    llm.engine.runner.model.replay_decode = replay
    llm.engine.runner.model.replay_native = native
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    llm.generate([prefix + [1]], SamplingParams(max_tokens=2, ignore_eos=True))
    outs = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    return outs, _replayable(llm, len(prompts))


def _replayable(llm: LLM, rows: int) -> bool:
    """Whether a decode step of ``rows`` sequences has what the replay needs on this machine: the in-place
    decode kernel, and C kernels for every projection at that row count (bfloat16's need AMX)."""
    runner = llm.engine.runner
    layer = runner.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    kernels = (attn.qkv_proj.kernel_for(rows), attn.o_proj.kernel_for(rows), mlp.fused_glu_for(rows),
               mlp.down_proj.kernel_for(rows))  # fmt: skip
    return runner.fused_decode and all(k is not None for k in kernels)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count", [3, MIN_SEQS])  # no cascade; a cascade over the cached prefix
def test_the_replay_equals_the_module_path_bit_for_bit(tiny_model: str, replays: list[int], dtype: str, count: int,
                                                       native: bool, native_prefixes: list[int]) -> None:  # fmt: skip
    prefix, prompts = _prompts(160, count)
    on, replayable = _generate(tiny_model, dtype, True, prefix, prompts, native)
    if not replayable:
        assert replays == []
        pytest.skip(f"no C kernel for every {dtype} projection here")
    assert len(replays) >= 7  # the decode steps (and the prompts' tails, row by row, where they join the cascade)
    assert max(replays) >= count
    if not native or not cpu_replay.available():
        assert native_prefixes == []
    elif count < MIN_SEQS:  # the decode steps, no cascade: their calls made from C
        assert native_prefixes.count(cpu_replay.PREFIX_NONE) >= 6
    replays.clear()
    off, _ = _generate(tiny_model, dtype, False, prefix, prompts)
    assert replays == []
    assert on == off


@pytest.mark.skipif(not cpu_amx_prefix.available(torch.bfloat16, 32), reason="no AMX here")
@pytest.mark.parametrize("native", NATIVE)
def test_the_replay_reads_the_prefix_through_the_amx_tiles(wide_model: str, replays: list[int], native: bool,
                                                           native_prefixes: list[int]) -> None:  # fmt: skip
    prefix, prompts = _prompts(160, MIN_SEQS, seed=4)
    on, replayable = _generate(wide_model, "bfloat16", True, prefix, prompts, native)
    if not replayable:
        pytest.skip("no C kernel for every bfloat16 projection here")
    assert len(replays) >= 7
    if native and cpu_replay.available():
        assert native_prefixes.count(cpu_replay.PREFIX_TILES) >= 7
    assert on == _generate(wide_model, "bfloat16", False, prefix, prompts)[0]


@pytest.mark.skipif(not cpu_prefix.available(torch.float32, 16), reason="the float32 prefix kernel is not built here")
@pytest.mark.parametrize("native", NATIVE)
def test_the_replay_reads_a_float32_prefix_through_its_kernel(tiny_model: str, replays: list[int], native: bool,
                                                              native_prefixes: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A float32 cascade's prefix part goes from the replay to ``cpu_prefix`` straight into the step's
    buffers, once a layer (from Python: ``_prefix32``; from C: the step's prefix kind), with the module
    path's results (which reach the same kernel through ``prefix_part``)."""
    calls: list[int] = []
    attend = decode_replay.DecodeReplay._prefix32

    def counted(self: decode_replay.DecodeReplay, i: int, *args: object) -> None:
        calls.append(i)
        attend(self, i, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_replay.DecodeReplay, "_prefix32", counted)
    prefix, prompts = _prompts(160, MIN_SEQS, seed=8)
    on, replayable = _generate(tiny_model, "float32", True, prefix, prompts, native)
    if not replayable:
        pytest.skip("no C kernel for every float32 projection here")
    if native and cpu_replay.available():
        assert not calls and native_prefixes.count(cpu_replay.PREFIX_F32) >= 7
    else:
        layers = ModelConfig.from_path(tiny_model).num_hidden_layers
        assert calls and len(calls) % layers == 0 and calls[:layers] == list(range(layers))
    assert on == _generate(tiny_model, "float32", False, prefix, prompts)[0]


def test_the_replay_equals_transformers(tiny_model: str, replays: list[int]) -> None:
    """float32 greedy decoding through the replay stays exact."""
    from tests.engine.test_engine import hf_greedy
    from tests.support.models import load_hf_reference

    prefix, prompts = _prompts(40, 4, seed=7)
    llm = LLM(tiny_model, num_blocks=64, block_size=BS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(replays) >= 9 or not _replayable(llm, len(prompts))
    hf = load_hf_reference(tiny_model)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 10)


def test_a_profiling_run_takes_the_module_path(tiny_model: str, replays: list[int]) -> None:
    """Inside ``labels.labelled`` the kernels' calls carry their names, which the replay's do not."""
    llm = LLM(tiny_model, num_blocks=64, block_size=BS)
    if not _replayable(llm, 1):
        pytest.skip("no C kernel for every float32 projection here")
    with labels.labelled():
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert replays == []
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert replays


def test_a_row_count_sent_to_torch_s_product_takes_the_module_path(tiny_model: str, replays: list[int]) -> None:
    """A projection whose ``gemm_paths`` choice sends one row to torch: one-sequence steps are not
    replayed, and their tokens are those of an engine with no replay."""
    llm = LLM(tiny_model, num_blocks=64, block_size=BS)
    proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj
    if proj.kernel_for(1) is None:
        pytest.skip("o_proj takes no C kernel here")
    proj.paths = RowPaths.every(True)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert replays == []
    llm.engine.runner.model.replay_decode = False
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids == out




def test_layer_entries_are_kept_until_a_row_path_changes(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's layer entries are made once per row count and kept from step to step; a projection
    whose row paths change after some steps takes the module path from the next step on, with the
    tokens of an engine without the replay."""
    layer_lists: list[object] = _record_runs(monkeypatch, lambda r: r.layers)
    llm = LLM(tiny_model, num_blocks=64, block_size=BS)
    proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj
    if proj.kernel_for(1) is None:
        pytest.skip("o_proj takes no C kernel here")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], params)[0].token_ids
    assert len(layer_lists) >= 5 and all(x is layer_lists[0] for x in layer_lists)
    layer_lists.clear()
    proj.paths = RowPaths.every(True)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == first
    assert layer_lists == []
    proj.paths = None  # back to the copy: replayed again, with entries made anew
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == first
    assert len(layer_lists) >= 5

def test_a_norm_weight_given_new_data_is_read_there(tiny_model: str, replays: list[int]) -> None:
    """A norm weight whose ``.data`` is replaced (the same Parameter over new memory) is read at its new
    address from the next step on: the replay's tokens stay the module path's."""
    llm = LLM(tiny_model, num_blocks=64, block_size=BS)
    model = llm.engine.runner.model
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)
    if not replays:
        pytest.skip("the replay does not run here")
    for layer in model.model.layers:
        weight = layer.input_layernorm.weight
        weight.data = weight.data * 3 - 1  # new memory; the old is freed
    replays.clear()
    replayed = llm.generate([[5, 6, 7]], params)[0].token_ids
    assert len(replays) >= 5
    model.replay_decode = False
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == replayed


def test_a_plan_of_another_block_size_is_refused_as_the_modules_refuse_it(tiny_model: str) -> None:
    """A step whose attention plan was made for another block size than the cache's is not replayed
    (the kernel would read the wrong blocks, or past a row's block table): the module path's
    ValueError reaches the caller, as without the replay."""
    from pdserve.engine.kernels.metadata import AttentionMetadata
    from pdserve.engine.kernels.torch_paged import plan_attention

    llm = LLM(tiny_model, num_blocks=16, block_size=BS)
    model = llm.engine.runner.model
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv = torch.randn(16, config.num_hidden_layers, 2, BS, config.num_key_value_heads, head_dim)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.tensor([BS + 3, 3 * BS + 3]), block_tables=tables,
                             seq_lens=torch.tensor([20, 20], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), max_query_len=1,
                             max_seq_len=20)  # fmt: skip
    meta.torch_plan = plan_attention(tables, meta.seq_lens, meta.query_start_loc, BS // 2, None, False, True)
    assert model.replay_decode
    with torch.inference_mode(), pytest.raises(ValueError, match=f"built for block_size {BS // 2}"):
        model(torch.tensor([5, 6]), torch.tensor([19, 19]), kv, meta)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["qwen2_bias", "mqa", "tied", "mistral_window"])
def test_model_variants_replay_bit_for_bit_or_take_the_modules(variant: str, dtype: str, replays: list[int],
                                                               tmp_path: Path) -> None:  # fmt: skip
    """Projection biases (Qwen2), tied embeddings: replayed, the module path's bits. A sliding window
    (Mistral), and heads the decode kernel does not take (this MQA model's 8 dims), are not replayed."""
    from tests.support.models import make_hf_checkpoint

    model = str(make_hf_checkpoint(tmp_path, variant, seed=3))
    config = ModelConfig.from_path(model)
    in_place = cpu_decode.supports(torch.float32, torch.float32, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim)  # fmt: skip
    prefix, prompts = _prompts(40, 3, seed=11)
    on, replayable = _generate(model, dtype, True, prefix, prompts)
    if variant == "mistral_window" or not in_place or not replayable:
        assert replays == []
    else:
        assert len(replays) >= 7
    assert in_place or variant == "mqa"
    assert on == _generate(model, dtype, False, prefix, prompts)[0]
