"""The engine's greedy output equals transformers' greedy ``generate`` on the same checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.support.models import load_hf_reference, make_hf_checkpoint

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_bias", "mistral_window"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return path, load_hf_reference(path)


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else token 0 (= pad_token_id) would be masked as padding
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,  # generate exactly n tokens, like ignore_eos below
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 7, 16, 17, 31, 45, 50]  # 1 to several blocks of 16, mostly not multiples


def assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks() == kv.num_blocks
    assert not llm.engine.has_unfinished()


# Ten prompts: decode steps run 10 rows, enough for the oneDNN projections (>= 8 rows).
BATCH_LENGTHS = [*LENGTHS, 3, 24, 33]


@pytest.mark.parametrize(
    ("cpu_onednn", "fp32_gemm"),
    [(True, "kernel"), (True, "auto"), (True, "torch"), (False, "kernel")],
    ids=["packed", "packed-or-torch-timed", "torch-products", "torch-linear"],
)
def test_batch_matches_transformers(checkpoint, cpu_onednn: bool, fp32_gemm: str) -> None:
    """Every float32 projection path (engine/model/gemm_paths.py): the packed copy at every row count,
    the faster of it and torch's per row count as timed at load, torch's products only."""
    path, hf = checkpoint
    llm = LLM(str(path), num_blocks=128, block_size=16, cpu_onednn=cpu_onednn, cpu_fp32_gemm=fp32_gemm)
    packed = cpu_onednn and fp32_gemm != "torch" and torch.backends.mkldnn.is_available()
    assert llm.engine.onednn == packed
    ps = prompts(0, BATCH_LENGTHS)
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p)
        assert o.finish_reason == "length"
    assert_idle(llm)


def test_shared_prefix_hits_cache_and_matches(checkpoint) -> None:
    path, hf = checkpoint
    llm = LLM(str(path), num_blocks=128, block_size=16)
    prefix = prompts(1, [40])[0]
    a, b = prefix + [1, 2, 3], prefix + [9, 8, 7, 6, 5]
    first = llm.generate([a], GREEDY)[0]
    second = llm.generate([b], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full blocks of the shared 40-token prefix
    assert first.token_ids == hf_greedy(hf, a)
    assert second.token_ids == hf_greedy(hf, b)
    stats = llm.engine.kv_manager.stats
    assert stats.hits == 32 and stats.queries == len(a) + len(b)
    assert_idle(llm)


def test_chunked_prefill_matches(checkpoint) -> None:
    path, hf = checkpoint
    llm = LLM(str(path), num_blocks=128, block_size=16, max_num_batched_tokens=12)
    ps = prompts(2, [45, 30, 5])
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p)
    assert_idle(llm)


def test_preemption_matches(checkpoint) -> None:
    path, hf = checkpoint
    # 4 requests of 20+32 tokens need 4 blocks of 16 each; 9 blocks force preemption while decoding.
    # With a sliding window (11) a request needs 2 at a time (older ones are freed): 4 blocks do.
    windowed = getattr(hf.config, "sliding_window", None) is not None
    llm = LLM(str(path), num_blocks=4 if windowed else 9, block_size=16, enable_prefix_caching=False)
    ps = prompts(3, [20, 18, 21, 19])
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p)
    assert_idle(llm)


def test_eos_stops_and_text_decodes(checkpoint) -> None:
    path, hf = checkpoint
    llm = LLM(str(path), num_blocks=64, block_size=16)
    p = prompts(4, [12])[0]
    ref = hf_greedy(hf, p)
    stop_tok = ref[5]
    out = llm.generate([p], SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == ref[: ref.index(stop_tok) + 1] and out.finish_reason == "stop"
    assert isinstance(out.text, str)
    assert_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_transformers(checkpoint) -> None:
    """The whole engine on the GPU (Triton kernels, float32): same greedy tokens as HF on the CPU."""
    path, hf = checkpoint
    llm = LLM(str(path), num_blocks=128, block_size=16, device="cuda", dtype="float32", max_num_batched_tokens=40)
    ps = prompts(0, BATCH_LENGTHS)
    outs = llm.generate(ps, GREEDY)
    same = sum(o.token_ids == hf_greedy(hf, p) for p, o in zip(ps, outs))
    assert same >= len(ps) - 1  # TF32 or reduction order may flip one near-tie
    assert_idle(llm)


def test_sliding_window_frees_blocks_as_it_slides_and_matches() -> None:
    """Mistral, window 11, block size 4: a request never holds more than the blocks its window
    spans (plus the one being filled), and the tokens still equal HF's."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = make_hf_checkpoint(Path(tmp), "mistral_window", seed=3)
        hf = load_hf_reference(path)
        llm = LLM(str(path), num_blocks=64, block_size=4, max_num_batched_tokens=16)
        engine = llm.engine
        p = prompts(5, [40])[0]
        req = engine.add_request(p, GREEDY)
        tokens: list[int] = []
        most_held = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            held = [b for b in engine.kv_manager.get_block_ids(req.request_id) if b >= 0]
            most_held = max(most_held, len(held))
        assert tokens == hf_greedy(hf, p)
        # Window 11 spans at most 4 blocks of 4 (positions p-10..p), plus a block for the next token
        # and, in a 16-token prefill chunk, the chunk's own blocks.
        assert most_held <= 8 < (40 + NEW_TOKENS) // 4
        assert_idle(llm)
