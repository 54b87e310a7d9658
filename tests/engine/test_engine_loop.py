"""EngineLoop: outputs reach each request's callback; failures reach them too, never a hang."""

from __future__ import annotations

import queue
import threading

import pytest

from pdserve import SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm import LLM
from tests.support.polling import wait_until


@pytest.fixture()
def loop(tiny_model: str):
    llm = LLM(tiny_model, num_blocks=32, block_size=8)
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


def test_outputs_reach_callbacks_and_match_offline(loop, tiny_model: str) -> None:
    llm, lp = loop
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    prompts = [[1, 2, 3], [50, 60, 70, 80, 90]]
    # The reference runs on an engine of its own: the loop is the only driver of its engine.
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=32, block_size=8).generate(prompts, params)]
    queues = []
    for p in prompts:
        q: queue.Queue = queue.Queue()
        lp.submit(llm.engine.make_request(p, params), q.put)
        queues.append(q)
    got = [[t for out in drain(q) for t in out.new_token_ids] for q in queues]
    assert got == expected
    assert llm.engine.kv_manager.num_free_blocks() == llm.engine.kv_manager.num_blocks


def test_a_driven_engine_refuses_a_second_driver(loop) -> None:
    llm, lp = loop
    with pytest.raises(RuntimeError, match="EngineLoop"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="another driver"):
        EngineLoop(llm.engine)


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
    assert llm.engine.kv_manager.num_free_blocks() == llm.engine.kv_manager.num_blocks


def test_a_request_that_fails_after_its_forward_ends_alone(loop, tiny_model: str) -> None:
    """One request's output raises in a step (as a token its grammar refuses would): that request
    gets the error and gives its blocks back; the other, in the same batch, loses no token."""
    llm, lp = loop
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    expected = LLM(tiny_model, num_blocks=32, block_size=8).generate([[50, 60, 70, 80, 90]], params)[0].token_ids
    doomed = llm.engine.make_request([1, 2, 3], params)
    good = llm.engine.make_request([50, 60, 70, 80, 90], params)
    append = type(doomed).append_output_token

    def refuse_the_third(req, token: int) -> None:  # noqa: ANN001
        if req is doomed and len(req.output_token_ids) == 2:
            raise ValueError("the grammar refuses this token")
        append(req, token)

    queues: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(doomed), "append_output_token", refuse_the_third)
        for req, q in zip((doomed, good), queues):
            lp.submit(req, q.put)
        failed, done = drain(queues[0]), drain(queues[1])
    assert isinstance(failed[-1], ValueError) and "grammar refuses" in str(failed[-1])
    assert [t for out in failed[:-1] for t in out.new_token_ids] == doomed.output_token_ids[:2]
    assert [t for out in done for t in out.new_token_ids] == expected
    assert wait_until(lambda: not llm.engine.has_unfinished())
    assert llm.engine.kv_manager.num_free_blocks() == llm.engine.kv_manager.num_blocks


def test_duplicate_live_id_is_refused(loop) -> None:
    llm, lp = loop
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    q: queue.Queue = queue.Queue()
    first = llm.engine.make_request([1, 2, 3], params, request_id="same")
    second = llm.engine.make_request([4, 5, 6], params, request_id="same")  # made before the first is queued
    lp.submit(first, q.put)
    with pytest.raises(ValueError, match="already in use"):
        lp.submit(second, q.put)
    assert lp.abort("same")
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks() == kv.num_blocks


def test_id_reused_after_abort_gets_only_its_own_outputs(loop) -> None:
    """The loop thread is held between a step and delivering it (inside another request's
    callback) while the client aborts "X" and reuses the id: the new "X" must receive only
    its own tokens and its own finish."""
    llm, lp = loop
    engine = llm.engine
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    paused, resume, armed = threading.Event(), threading.Event(), threading.Event()

    def background(out) -> None:
        if armed.is_set():
            armed.clear()
            paused.set()
            resume.wait(10)

    old: queue.Queue = queue.Queue()
    first = threading.Event()

    def x_outputs(out) -> None:
        # Armed from the loop thread on X's first output (X has 3 tokens): bg's callback then pauses
        # in this step or the next, while X still runs, however late this test's thread runs.
        if not first.is_set():
            first.set()
            armed.set()
        old.put(out)

    with engine.lock:  # both join the same step
        lp.submit(engine.make_request([1] * 8, params, request_id="bg"), background)
        lp.submit(engine.make_request([9] * 20, SamplingParams(max_tokens=3, ignore_eos=True), request_id="X"),
                  x_outputs)
    old.get(timeout=30)  # X is running
    assert paused.wait(30)  # the loop thread now holds an undelivered step that includes X
    assert lp.abort("X")
    new = engine.make_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="X")
    mine: queue.Queue = queue.Queue()
    lp.submit(new, mine.put)
    resume.set()
    outs = drain(mine)
    assert [t for o in outs for t in o.new_token_ids] == new.output_token_ids
    assert len(new.output_token_ids) == 2 and outs[-1].finished and outs[-1].num_prompt_tokens == 3
    lp.abort("bg")


def test_the_idle_hook_runs_once_per_idle_period_after_the_work(tiny_model: str) -> None:
    """A worker gives memory back when its engine has been idle a while: the hook runs once after
    a request ends (not during its steps), and again only after the next busy stretch."""
    llm = LLM(tiny_model, num_blocks=32, block_size=8)
    calls: list[bool] = []
    lp = EngineLoop(llm.engine, idle_wait_s=0.01, on_idle=lambda: calls.append(llm.engine.has_unfinished()),
                    on_idle_after_s=0.05)  # fmt: skip
    try:
        for round_ in (1, 2):
            q: queue.Queue = queue.Queue()
            lp.submit(llm.engine.make_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)), q.put)
            assert drain(q)[-1].finished
            assert wait_until(lambda: len(calls) == round_, timeout=30)
        assert calls == [False, False]  # never while work was queued
    finally:
        lp.stop()


def test_the_cpu_share_hears_each_step_before_it_runs_and_each_wait(tiny_model: str) -> None:
    """A worker's CoreShare sets a step's threads on the loop thread before the step, and learns
    that the worker is idle (its CPUs lendable) when the loop waits for work."""
    llm = LLM(tiny_model, num_blocks=32, block_size=8)
    calls: list[tuple[str, str, bool]] = []

    class Recorder:
        def before_step(self) -> int:
            calls.append(("step", threading.current_thread().name, llm.engine.has_unfinished()))
            return 1

        def idle(self) -> None:
            calls.append(("idle", threading.current_thread().name, llm.engine.has_unfinished()))

    lp = EngineLoop(llm.engine, idle_wait_s=0.01, cpu_share=Recorder())
    try:
        q: queue.Queue = queue.Queue()
        lp.submit(llm.engine.make_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)), q.put)
        outputs = drain(q)
        assert outputs[-1].finished
        assert wait_until(lambda: calls and calls[-1][0] == "idle", timeout=30)
    finally:
        lp.stop()
    steps = [c for c in calls if c[0] == "step"]
    assert len(steps) >= len(outputs)  # one before every step that produced an output
    assert all(work for kind, _, work in calls if kind == "step")  # only when there is work
    assert all(not work for kind, _, work in calls if kind == "idle")
    assert {name for _, name, _ in calls} == {"engine-loop"}
