"""The offline API's contracts: input validation, sampling options end to end, block accounting."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model import make_tiny_model
from pdserve.engine.model.linear import Linear
from tests.support.polling import wait_until


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_model(tmp_path_factory.mktemp("api"), max_position_embeddings=128)
    return LLM(str(path), num_blocks=32, block_size=8)


def idle(llm: LLM) -> bool:
    kv = llm.engine.kv_manager
    kv.check_invariants()
    return kv.num_free_blocks() == kv.num_blocks and not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ([1] * 128, SamplingParams(), "max_model_len"),
        ([1, 2, 100000], SamplingParams(), "prompt_token_ids"),
        ([1, -3], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_prompts_name_the_field_and_leave_nothing(llm: LLM, prompt, params, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6], prompt], params)  # the good prompt is not queued either
    assert idle(llm)


def test_text_prompt_and_decode(llm: LLM) -> None:
    out = llm.generate("héllo wörld", SamplingParams(max_tokens=5))[0]
    assert out.prompt_token_ids == llm.encode("héllo wörld") and len(out.token_ids) == 5
    assert out.text == llm.decode(out.token_ids)
    assert idle(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = llm.generate([[10, 20, 30]], p)[0].token_ids
    batched = llm.generate([[1, 2, 3, 4], [10, 20, 30], [9] * 11], [SamplingParams(max_tokens=12, temperature=1.0), p, p])
    assert batched[1].token_ids == alone
    other_seed = llm.generate([[10, 20, 30]], SamplingParams(max_tokens=12, temperature=1.0, seed=8))[0].token_ids
    assert other_seed != alone
    assert idle(llm)


def test_max_model_len_caps_generation(llm: LLM) -> None:
    out = llm.generate([[3] * 120], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 128 - 120 and out.finish_reason == "length"
    assert idle(llm)


def test_abort_returns_blocks(llm: LLM) -> None:
    eng = llm.engine
    req = eng.add_request([4] * 20, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    assert eng.kv_manager.num_free_blocks() < eng.kv_manager.num_blocks
    assert eng.abort(req.request_id) and not eng.abort(req.request_id)
    assert idle(llm)


def test_request_larger_than_the_pool_is_refused(tmp_path) -> None:
    small = LLM(str(make_tiny_model(tmp_path / "m")), num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[1] * 30], SamplingParams(max_tokens=10))
    assert idle(small)


def test_unknown_option_is_an_error(tmp_path) -> None:
    with pytest.raises(TypeError, match="blok_size"):
        LLM(str(make_tiny_model(tmp_path / "m")), blok_size=16)


def test_failed_forward_uncaches_and_returns_blocks(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass that raises (e.g. out of memory) leaves no cached hash on blocks it never
    filled: a later identical prompt must recompute, and its output must be right."""
    prompt = list(range(40, 70))  # 3 full blocks of 8 + 6
    expected = llm.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids
    assert llm.engine.kv_manager.reset_prefix_cache()
    events: list = []
    llm.engine.kv_manager.pool.add_event_sink(events.append)
    model = llm.engine.runner.model
    real = model.forward

    def boom(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(model, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([prompt], SamplingParams(max_tokens=4))
    monkeypatch.setattr(model, "forward", real)
    assert idle(llm)
    assert llm.engine.kv_manager.pool.num_cached_hashes == 0  # the 3 blocks stored at scheduling were removed again
    stored = [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert len(stored) == 3 and sorted(stored) == sorted(removed)
    again = llm.generate([prompt], SamplingParams(max_tokens=4))[0]
    assert again.num_cached_tokens == 0 and again.token_ids == expected


def test_sliding_window_does_not_cap_context() -> None:
    from pdserve.engine.model import ModelConfig

    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}  # fmt: skip
    windowed = ModelConfig.from_dict({**base, "sliding_window": 1024})
    full = ModelConfig.from_dict({**base, "sliding_window": None})
    assert windowed.sliding_window == 1024 and windowed.max_context_len == full.max_context_len == 4096
    assert windowed.fingerprint != full.fingerprint  # a different forward pass: no KV exchange between them


def test_contention_loses_and_starves_nothing(tmp_path) -> None:
    """Random arrivals into a pool far too small for the load: every request finishes, with the
    same greedy tokens it gets alone, and the pool ends empty."""
    import random

    path = str(make_tiny_model(tmp_path / "m", seed=3))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in prompts]
    alone = LLM(path, num_blocks=64, block_size=8)
    expected = [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]

    tight = LLM(path, num_blocks=12, block_size=8, max_num_batched_tokens=24, max_num_seqs=6)
    eng = tight.engine
    pending = list(zip(range(len(prompts)), prompts, params))
    got: dict[str, list[int]] = {}
    ids: dict[str, int] = {}
    done: set[str] = set()
    steps = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 2)):  # arrivals between steps
            if pending:
                i, p, sp = pending.pop(0)
                rid = eng.add_request(p, sp).request_id
                ids[rid], got[rid] = i, []
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done.add(out.request_id)
        eng.kv_manager.check_invariants()
        steps += 1
        assert steps < 5000, "no progress"
    assert done == set(ids)
    assert eng.scheduler.num_preemptions > 0  # the pool really was contended
    for rid, i in ids.items():
        assert got[rid] == expected[i]
    assert eng.kv_manager.num_free_blocks() == eng.kv_manager.num_blocks


def test_cpu_onednn_option(tmp_path) -> None:
    """``cpu_onednn`` reaches the engine; off, no projection holds a oneDNN copy; not a bool: an error."""

    model_dir = str(make_tiny_model(tmp_path / "m"))
    off = LLM(model_dir, num_blocks=16, cpu_onednn=False)
    assert not off.engine.onednn
    assert not any(m.packed for m in off.engine.model.modules() if isinstance(m, Linear))
    on = LLM(model_dir, num_blocks=16)
    assert on.engine.onednn == torch.backends.mkldnn.is_available()
    prompts = [[7 + i] * (5 + i) for i in range(10)]  # 10 rows: the oneDNN path when on
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in on.generate(prompts, params)] == [o.token_ids for o in off.generate(prompts, params)]
    with pytest.raises(ValueError, match="cpu_onednn"):
        LLM(model_dir, cpu_onednn="yes")


def test_token_ids_of_any_integer_type(llm: LLM) -> None:
    import numpy as np

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0].token_ids
    for prompt in ([np.int64(5), np.int32(6), 7], torch.tensor([5, 6, 7])):
        assert llm.generate([prompt], params)[0].token_ids == expected
    with pytest.raises(ValueError, match="wrap a single tokenized prompt"):
        llm.generate([5, 6, 7], params)
    with pytest.raises(ValueError, match="not an integer token id"):
        llm.generate([[5, 6.5]], params)
    with pytest.raises(ValueError, match="not an integer token id"):
        llm.generate([[True, 5]], params)
    assert idle(llm)


def test_generate_returns_when_a_request_is_aborted_elsewhere(llm: LLM) -> None:
    engine = llm.engine
    result: list = []
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    worker = threading.Thread(target=lambda: result.extend(llm.generate([[1, 2, 3], [4, 5]], params)), daemon=True)
    worker.start()

    def abort_first_once_both_decode() -> bool:
        with engine.lock:  # no step runs meanwhile: the request is still live when aborted
            live = list(engine.requests.values())
            if len(live) == 2 and all(r.output_token_ids for r in live):
                return engine.abort(live[0].request_id)  # the other one runs on to max_model_len
        return False

    assert wait_until(abort_first_once_both_decode, timeout=30, interval=0.001)
    worker.join(30)
    assert not worker.is_alive()
    assert [o.finish_reason for o in result] == ["abort", "length"]
    assert all(o.token_ids for o in result)
    assert idle(llm)


def test_seeded_sampling_survives_preemption(tmp_path) -> None:
    """Seeded streams are the same whether or not a tiny pool forces preemption and recompute."""
    import random

    model_dir = str(make_tiny_model(tmp_path / "m"))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 30, 9, 40, 16)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=7 + i) for i in range(6)]
    roomy = LLM(model_dir, num_blocks=256, block_size=4)
    tight = LLM(model_dir, num_blocks=20, block_size=4, max_num_batched_tokens=13, enable_prefix_caching=False)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.engine.scheduler.num_preemptions > 0 and roomy.engine.scheduler.num_preemptions == 0
    assert idle(tight) and idle(roomy)


def test_small_token_budget_caps_the_running_set(tmp_path) -> None:
    """max_num_batched_tokens=4 < max_num_seqs: at most 4 requests run, every running decode
    progresses each step, and all requests finish with every block back."""
    engine = LLM(str(make_tiny_model(tmp_path / "m")), num_blocks=64, block_size=8, max_num_batched_tokens=4).engine
    reqs = [engine.add_request([10 + i, 20 + i], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(10)]
    while engine.has_unfinished():
        decoding = [r for r in engine.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
        before = {r.request_id: len(r.output_token_ids) for r in decoding}
        engine.step()
        assert len(engine.scheduler.running) <= 4
        assert all(len(r.output_token_ids) == before[r.request_id] + 1 for r in decoding)
    assert all(len(r.output_token_ids) == 5 for r in reqs)
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks


def test_a_stop_tokens_text_is_not_in_the_output(llm: LLM) -> None:
    """As in vLLM (and pdserve's router): the request ends on the stop token, whose id is output
    and is its stop_reason, and whose text is not."""
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    stop = free.token_ids[2]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(stop,)))[0]
    cut = free.token_ids.index(stop) + 1
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert free.stop_reason is None and free.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(free.token_ids[: cut - 1], skip_special_tokens=True)
    assert llm.tokenizer.decode([stop], skip_special_tokens=True)  # the token has text that was left out
