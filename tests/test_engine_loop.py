"""EngineLoop: outputs reach each request's callback; failures reach them too, never a hang."""

from __future__ import annotations

import queue

import pytest

from engine import SamplingParams
from engine.engine_loop import EngineLoop
from engine.llm import LLM
from engine.model import make_tiny_model


@pytest.fixture()
def loop(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path / "m")), num_blocks=32, block_size=8)
    lp = EngineLoop(llm.engine, idle_wait_s=0.01)
    yield llm, lp
    lp.stop()


def drain(q: queue.Queue, timeout: float = 30.0) -> list:
    items = []
    while True:
        item = q.get(timeout=timeout)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def test_outputs_reach_callbacks_and_match_offline(loop) -> None:
    llm, lp = loop
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    prompts = [[1, 2, 3], [50, 60, 70, 80, 90]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    queues = []
    for p in prompts:
        q: queue.Queue = queue.Queue()
        lp.submit(llm.engine.make_request(p, params), q.put)
        queues.append(q)
    got = [[t for out in drain(q) for t in out.new_token_ids] for q in queues]
    assert got == expected
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_persistent_engine_failure_fails_requests_instead_of_hanging(loop, monkeypatch) -> None:
    llm, lp = loop
    def broken() -> None:
        raise RuntimeError("scheduler broke")

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken)
    q: queue.Queue = queue.Queue()
    lp.submit(llm.engine.make_request([5, 6, 7], SamplingParams(max_tokens=5)), q.put)
    items = drain(q)
    assert isinstance(items[-1], RuntimeError) and "scheduler broke" in str(items[-1])
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks
