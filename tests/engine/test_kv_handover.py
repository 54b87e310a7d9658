"""The engine's KV-handover API: producer (handoff, held KV, pinned reads) and consumer (loads,
local prefix reuse, failure and abort during a load), against a single engine's output."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_handover import BlocksNotCachedError, KVHandover, RemotePrefill
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache import KVCacheManager, block_hashes
from pdserve.engine.model import make_tiny_model
from pdserve.engine.request import Request
from tests.support import kvcache as kv_support

BS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("handover"), seed=4))


def engine(model: str, **options: object) -> LLMEngine:
    return LLM(model, num_blocks=32, block_size=BS, **options).engine


def run(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    return outs


def assert_idle(eng: LLMEngine) -> None:
    eng.handover.check_invariants()
    usage = eng.kv_usage()
    assert usage.free_blocks == usage.num_blocks and usage.requests == 0 and usage.held == 0


def hand_over(src: LLMEngine, dst: LLMEngine, prompt: list[int], params: SamplingParams) -> Request:
    """Prefill ``prompt`` on ``src`` (handoff), copy its held blocks into the blocks ``dst`` reserved
    (what a pull does), continue it on ``dst``. Only the KV-handover API is used."""
    first = src.make_request(prompt, params, handoff=True)
    src.enqueue(first)
    outs = []
    while src.has_unfinished():
        outs.extend(src.step())
    done = outs[-1]
    assert done.finished and done.finish_reason == "handoff" and done.kv_handoff is not None
    held = done.kv_handoff
    assert held.num_tokens == len(prompt) and len(held.block_ids) == -(-len(prompt) // src.layout.block_size)
    req = dst.make_request(prompt, params)
    load = dst.add_remote(req, RemotePrefill(len(prompt), tuple(done.new_token_ids)))
    assert load is not None and load.num_tokens == len(prompt)
    for s_id, d_id in zip(held.block_ids[load.first_block :], load.block_ids):
        dst.kv_tensor.block(d_id).copy_(src.kv_tensor.block(s_id))
    assert src.handover.release(held.request_id) and not src.handover.release(held.request_id)
    assert dst.begin_load(req.request_id)
    dst.finish_load(req.request_id, ok=True)
    return req


def test_handed_over_requests_match_and_respect_max_num_seqs(model: str) -> None:
    """Requests continued from handed-over KV produce the tokens a single engine does, and wait for
    a running slot (max_num_seqs) like any other."""
    path = model
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=11)
    prompts = [[7, 8, 9, 10, 11] * 3, [20, 21, 22]]
    expected = [o.token_ids for o in LLM(path, num_blocks=32, block_size=8).generate(prompts, params)]
    src = LLM(path, num_blocks=32, block_size=8).engine
    dst = LLM(path, num_blocks=32, block_size=8, max_num_seqs=1).engine
    handed = [hand_over(src, dst, p, params) for p in prompts]
    assert src.kv_manager.num_free_blocks() == src.kv_manager.num_blocks  # released: nothing held
    while dst.has_unfinished():
        dst.step()
        assert len(dst.scheduler.running) <= 1
    assert [r.output_token_ids for r in handed] == expected  # the seeded stream continued after draw 1
    assert dst.kv_manager.num_free_blocks() == dst.kv_manager.num_blocks


def test_request_at_max_model_len_is_finished_not_handed_over(model: str) -> None:
    """The producer judges its first token with the request's own limits: at max_model_len the
    request finishes there (no KV held), and a consumer refuses to continue it."""
    model_dir = model
    prefill = LLM(model_dir, num_blocks=16, block_size=8, max_model_len=24).engine
    decode = LLM(model_dir, num_blocks=16, block_size=8, max_model_len=24).engine
    prompt = list(range(30, 53))  # 23 tokens: the longest prompt max_model_len=24 accepts
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prefill.enqueue(prefill.make_request(prompt, params, handoff=True))
    outs = []
    while prefill.has_unfinished():
        outs.extend(prefill.step())
    assert outs[-1].finish_reason == "length" and outs[-1].kv_handoff is None
    assert prefill.kv_usage().free_blocks == 16
    handed = decode.make_request(prompt, params, request_id="h")
    with pytest.raises(ValueError, match="already finished"):
        decode.add_remote(handed, RemotePrefill(len(prompt), tuple(outs[-1].new_token_ids)))
    assert not decode.has_unfinished() and decode.kv_usage().free_blocks == 16


def prefill_handoff(src: LLMEngine, prompt: list[int], params: SamplingParams):
    src.enqueue(src.make_request(prompt, params, handoff=True))
    out = run(src)[-1]
    assert out.kv_handoff is not None
    return out


def test_consumer_reuses_its_own_prefix_and_loads_only_the_rest(model: str) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prefix = list(range(100, 124))  # 3 blocks
    prompt = prefix + [1, 2, 3, 4, 5]
    expected = LLM(model, num_blocks=32, block_size=BS).generate([prompt], params)[0].token_ids
    src, dst = engine(model), engine(model)
    dst.add_request(prefix + [9], params)  # the consumer has the 3 prefix blocks cached
    run(dst)
    out = prefill_handoff(src, prompt, params)
    req = dst.make_request(prompt, params)
    load = dst.add_remote(req, RemotePrefill(len(prompt), tuple(out.new_token_ids)))
    assert load is not None
    assert (load.num_local_hit_tokens, load.num_external_tokens, load.first_block) == (24, 5, 3)
    assert load.block_hashes == (b"",)  # the partial last block
    held = out.kv_handoff
    for s_id, d_id in zip(held.block_ids[load.first_block :], load.block_ids):
        dst.kv_tensor.block(d_id).copy_(src.kv_tensor.block(s_id))
    src.handover.release(held.request_id)
    assert dst.begin_load(req.request_id)
    dst.finish_load(req.request_id, ok=True)
    outs = run(dst)
    assert out.new_token_ids + [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].num_cached_tokens == 24
    assert_idle(src)
    assert_idle(dst)


def test_failed_load_recomputes_and_no_room_recomputes(model: str) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
    prompt = list(range(40, 61))
    expected = LLM(model, num_blocks=32, block_size=BS).generate([prompt], params)[0].token_ids
    src = engine(model)
    out = prefill_handoff(src, prompt, params)
    src.handover.release(out.kv_handoff.request_id)
    # The bytes never arrive: finish_load(ok=False) frees the blocks and the prompt is recomputed.
    dst = engine(model)
    req = dst.make_request(prompt, params)
    load = dst.add_remote(req, RemotePrefill(len(prompt), tuple(out.new_token_ids)))
    assert load is not None
    assert dst.begin_load(req.request_id)
    dst.finish_load(req.request_id, ok=False)
    assert out.new_token_ids + [t for o in run(dst) for t in o.new_token_ids] == expected
    assert_idle(dst)
    # No room: add_remote queues a recompute at once (None), with the same seeded stream.
    tiny = LLM(model, num_blocks=4, block_size=BS).engine
    blocker = tiny.add_request(list(range(1, 20)), SamplingParams(max_tokens=8, ignore_eos=True))
    tiny.step()  # the blocker holds 3 of the 4 blocks
    req = tiny.make_request(prompt, params)
    assert tiny.add_remote(req, RemotePrefill(len(prompt), tuple(out.new_token_ids))) is None
    got = [t for o in run(tiny) if o.request_id == req.request_id for t in o.new_token_ids]
    assert out.new_token_ids + got == expected and blocker.status.finished
    assert_idle(tiny)


def test_abort_during_a_load_frees_only_when_the_load_ends(model: str) -> None:
    """A load's blocks may be being written: an abort must not hand them to anyone before
    finish_load, and must free them then."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    dst = engine(model)
    req = dst.make_request(list(range(50)), params)
    load = dst.add_remote(req, RemotePrefill(50, (7,)))
    assert load is not None and dst.kv_usage().free_blocks == 32 - len(load.block_ids)
    assert dst.begin_load(req.request_id)  # a writer claimed it
    assert dst.abort(req.request_id)
    assert dst.kv_usage().free_blocks == 32 - len(load.block_ids)  # still reserved for the writer
    with pytest.raises(ValueError, match="already in use"):
        dst.make_request(list(range(50)), params, request_id=req.request_id)
    dst.finish_load(req.request_id, ok=True)
    assert not dst.has_unfinished()
    assert_idle(dst)
    with pytest.raises(ValueError, match="no KV load"):
        dst.finish_load(req.request_id, ok=True)


def test_abort_before_any_writer_claimed_the_load_frees_at_once(model: str) -> None:
    """A request aborted before its pull started (a cancelled task whose pull never ran) gives
    its blocks back at once; the writer that comes later is told not to write."""
    dst = engine(model)
    req = dst.make_request(list(range(50)), SamplingParams(max_tokens=4, ignore_eos=True))
    load = dst.add_remote(req, RemotePrefill(50, (7,)))
    assert load is not None and dst.kv_usage().free_blocks < 32
    assert dst.abort(req.request_id)
    assert not dst.begin_load(req.request_id)
    assert not dst.has_unfinished()
    assert_idle(dst)


def test_pinned_reads_of_cached_blocks(model: str) -> None:
    eng = engine(model)
    prompt = list(range(60, 84))
    eng.add_request(prompt, SamplingParams(max_tokens=1))
    run(eng)
    hashes = block_hashes(prompt, BS, eng.config.cache.hash_seed)
    pinned = eng.handover.pin_cached(hashes[:2])
    assert len(pinned.block_ids) == 2 and eng.kv_usage().free_blocks == 30
    eng.handover.check_invariants()  # the pins are accounted for
    unknown = b"\x01" * 16
    with pytest.raises(BlocksNotCachedError) as e:
        eng.handover.pin_cached([hashes[0], unknown])
    assert e.value.missing == [unknown] and eng.kv_usage().free_blocks == 30  # nothing pinned
    eng.handover.unpin(pinned)
    assert_idle(eng)


def test_handoff_blocks_are_held_until_released(model: str) -> None:
    eng = engine(model)
    out = prefill_handoff(eng, list(range(20)), SamplingParams(max_tokens=9))
    assert eng.kv_usage().held == 1 and eng.kv_usage().free_blocks == 32 - 3
    with pytest.raises(ValueError, match="already in use"):
        eng.make_request([1, 2], SamplingParams(), request_id=out.request_id)
    assert not eng.abort(out.request_id)  # finished here: only a release frees it
    assert eng.handover.release(out.request_id)
    assert_idle(eng)


def test_a_reader_takes_a_prompts_blocks_chunk_by_chunk_while_it_is_prefilled(model: str) -> None:
    """With a 16-token step, a 40-token prompt's blocks are cached two per step: a prefix pin takes
    what is cached, waits (woken by the step) for the first block not yet there, and gives up after
    its wait when none comes."""
    src = LLM(model, num_blocks=32, block_size=BS, max_num_batched_tokens=16).engine
    prompt = list(range(3, 43))
    hashes = block_hashes(prompt, BS, src.config.cache.hash_seed)
    with pytest.raises(BlocksNotCachedError):
        src.handover.pin_cached_prefix(hashes, 0.01)  # nothing computed yet
    req = src.make_request(prompt, SamplingParams(max_tokens=4), handoff=True)
    src.enqueue(req)
    src.step()  # tokens 0-15: blocks 0 and 1
    pinned = src.handover.pin_cached_prefix(hashes, 0.0)
    assert pinned.block_hashes == tuple(hashes[:2])
    src.handover.unpin(pinned)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(src.handover.pin_cached_prefix(hashes[2:], 30.0)))
    waiter.start()
    src.step()  # tokens 16-31: blocks 2 and 3, and the waiter wakes
    waiter.join(30)
    assert not waiter.is_alive() and got[0].block_hashes == tuple(hashes[2:4])
    src.handover.unpin(got[0])
    assert run(src)[-1].finish_reason == "handoff" and src.handover.release(req.request_id)
    assert_idle(src)


def test_prefetched_blocks_are_cached_and_a_request_finds_them_as_its_prefix(model: str) -> None:
    """A prefetch takes free blocks for the hashes the pool lacks; what landed is cached (the next
    load finds it as a local hit and reserves only the rest), the rest is freed; nothing leaks."""
    src, dst = engine(model), engine(model)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(7, 43))  # 36 tokens: 4 full blocks and a partial one
    done = prefill_handoff(src, prompt, params)
    held = done.kv_handoff
    hashes = list(held.block_hashes)
    prefetch = dst.handover.begin_prefetch(hashes, 3)
    assert prefetch is not None and prefetch.block_hashes == tuple(hashes[:3])
    for i, block_id in enumerate(prefetch.block_ids[:2]):  # two of the three land
        dst.kv_tensor.block(block_id).copy_(src.kv_tensor.block(held.block_ids[i]))
    dst.handover.end_prefetch(prefetch, 2)
    dst.handover.check_invariants()
    assert dst.kv_usage().free_blocks == dst.kv_usage().num_blocks  # cached, but free
    again = dst.handover.begin_prefetch(hashes, 8)
    assert again is not None and again.block_hashes == tuple(hashes[2:])  # from the first one missing
    dst.handover.end_prefetch(again, 0)
    req = dst.make_request(prompt, params)
    load = dst.add_remote(req, RemotePrefill(len(prompt), tuple(done.new_token_ids)))
    assert load is not None and load.num_local_hit_tokens == 2 * BS and load.first_block == 2
    for s_id, d_id in zip(held.block_ids[2:], load.block_ids):
        dst.kv_tensor.block(d_id).copy_(src.kv_tensor.block(s_id))
    assert dst.begin_load(req.request_id)
    dst.finish_load(req.request_id, ok=True)
    outs = run(dst)
    one = LLM(model, num_blocks=32, block_size=BS).generate([prompt], params)[0].token_ids
    assert list(done.new_token_ids) + [t for o in outs for t in o.new_token_ids] == one
    assert src.handover.release(held.request_id)
    assert dst.handover.begin_prefetch(hashes[:4], 8) is None  # all four cached now
    assert_idle(src)
    assert_idle(dst)


def test_a_prefetch_does_not_evict_the_prefix_it_extends() -> None:
    """Every free block is cached, the prefix a prefetch extends the least recently used: the
    prefetch takes its blocks from the others, and the prefix stays cached for the request."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=kv_support.BS, dtype=torch.float32)
    manager = KVCacheManager(8, kv_support.BS)
    handover = KVHandover(manager, KVTensor(layout, 8))
    prefix = kv_support.req("p", list(range(8)))  # two full blocks
    kv_support.admit(manager, prefix)
    manager.free(prefix)  # cached and free, evicted first
    others = kv_support.req("o", list(range(100, 124)))  # the pool's six other blocks
    kv_support.admit(manager, others)
    manager.free(others)
    longer = kv_support.req("l", list(range(8)) + list(range(50, 66)))  # the prefix, then four blocks
    hashes = list(longer.block_hashes)
    prefetch = handover.begin_prefetch(hashes, 8)
    assert prefetch is not None and prefetch.block_hashes == tuple(hashes[2 : 2 + len(prefetch.block_ids)])
    assert manager.num_cached_prefix(tuple(hashes)) == 2  # still cached
    handover.end_prefetch(prefetch, 0)
    handover.check_invariants()
    assert manager.num_cached_prefix(tuple(hashes)) == 2 and manager.num_free_blocks() == 8
