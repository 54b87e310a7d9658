"""Tenants share an engine's running slots fairly: a flood from one tenant (more requests than
``max_num_seqs``) cannot make another tenant's request wait for the flood's streams to end, and
the flood's requests, preempted to make room, still finish with transformers' greedy tokens."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.engine.test_engine import hf_greedy, prompts
from tests.support.models import load_hf_reference, make_hf_checkpoint

FLOOD = SamplingParams(max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("fair"), "llama_gqa", seed=3)
    return path, load_hf_reference(path)


def _running_by_tenant(llm: LLM) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in llm.engine.scheduler.running:
        counts[r.cache_salt or ""] = counts.get(r.cache_salt or "", 0) + 1
    return counts


def test_a_flooding_tenant_cannot_starve_another(checkpoint) -> None:
    path, hf = checkpoint
    llm = LLM(str(path), num_blocks=256, block_size=16, max_num_seqs=4)
    engine = llm.engine
    flood = prompts(11, [9, 14, 20, 11, 17, 23])
    for i, p in enumerate(flood):
        engine.add_request(p, FLOOD, request_id=f"a{i}", cache_salt="A")
    tokens: dict[str, list[int]] = {f"a{i}": [] for i in range(len(flood))}

    def step() -> set[str]:
        done = set()
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done.add(out.request_id)
        return done

    for _ in range(3):
        assert not step()
    assert _running_by_tenant(llm) == {"A": 4}  # A alone uses every slot

    quiet = prompts(12, [10])[0]
    engine.add_request(quiet, SHORT, request_id="b", cache_salt="B")
    finished = step()
    # B got a slot in the very next step: one of A's requests was preempted for it.
    assert _running_by_tenant(llm) == {"A": 3, "B": 1}
    steps = 1
    while "b" not in finished:
        finished |= step()
        steps += 1
    assert finished == {"b"}, "B waited for a flood stream to end"
    assert steps == SHORT.max_tokens  # its prefill (first token), then one decode step per token
    assert engine.scheduler.num_preemptions >= 1

    while engine.has_unfinished():
        step()
    assert tokens["b"] == hf_greedy(hf, quiet, SHORT.max_tokens)
    for i, p in enumerate(flood):  # preempted and recomputed: still the same tokens
        assert tokens[f"a{i}"] == hf_greedy(hf, p, FLOOD.max_tokens)
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks


def test_free_slots_go_to_the_tenant_with_the_fewest_running(checkpoint) -> None:
    """A queue of A's requests then one of B's: when a slot frees, B's request (0 running) goes
    before A's earlier arrivals."""
    path, _ = checkpoint
    llm = LLM(str(path), num_blocks=256, block_size=16, max_num_seqs=2)
    engine = llm.engine
    for i, p in enumerate(prompts(13, [8, 8, 8, 8])):
        engine.add_request(p, SamplingParams(max_tokens=2 + 10 * i, ignore_eos=True), request_id=f"a{i}",
                           cache_salt="A")  # fmt: skip
    engine.add_request(prompts(14, [8])[0], SHORT, request_id="b", cache_salt="B")
    engine.step()
    # Two slots: B (0 running) takes one of them at once, A the other (share 1 each).
    assert sorted(_running_by_tenant(llm).items()) == [("A", 1), ("B", 1)]
    while engine.has_unfinished():
        engine.step()
    engine.kv_manager.check_invariants()
