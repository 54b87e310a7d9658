"""Tensor parallelism on the CPU: sharded layers joined by real gloo, against transformers and TP=1.

The model-level tests run every rank in a thread of this process (one ``TPGroup`` each, real
gloo over loopback); the engine-level tests start real rank processes through ``LLMEngine``.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.model import ModelConfig, load_model
from pdserve.engine.parallel.group import TPGroup
from pdserve.engine.parallel.ranks import RankLost
from pdserve.engine.parallel.shard import TPShard, check_tensor_parallel
from pdserve.engine.parallel.step_plan import StepPlan
from tests.engine.test_engine import hf_greedy, prompts
from tests.support.models import PagedRunner, hf_logits, load_hf_reference, make_hf_checkpoint
from tests.support.polling import process_gone, wait_until

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: make_hf_checkpoint(tmp_path_factory.mktemp(v), v, seed=3)
            for v in ("llama_gqa", "qwen2_bias", "mqa", "tied", "mistral_window")}  # fmt: skip


# ----------------------------------------------------------------------------- the split itself
def test_shard_ranges_split_heads_and_replicate_kv() -> None:
    assert [TPShard(r, 4).split(8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # 2 KV heads over 4 ranks: each head on two consecutive ranks, the ranks whose query heads read it.
    assert [TPShard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TPShard(r, 2).kv_heads(2) for r in range(2)] == [(0, 1), (1, 1)]
    # 300 rows over 4 ranks: 75 each; 10 over 3: 4, 4, 2.
    assert [TPShard(r, 3).vocab(10) for r in range(3)] == [(0, 4), (4, 4), (8, 2)]
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        TPShard(2, 2)


def test_unsplittable_models_are_refused_with_the_sizes(checkpoints: dict[str, Path]) -> None:
    config = ModelConfig.from_path(checkpoints["llama_gqa"])  # 4 heads, 2 KV heads, intermediate 128
    check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by tensor_parallel_size=3"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by tensor_parallel_size=3"):
        LLM(str(checkpoints["llama_gqa"]), num_blocks=16, tensor_parallel_size=3)  # before any rank starts
    mqa = ModelConfig.from_path(checkpoints["mqa"])  # 8 heads, 1 KV head: replicated
    check_tensor_parallel(mqa, 8)


def test_step_plan_round_trips_and_refuses_a_malformed_frame() -> None:
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 6, 40], dtype=torch.int64),
        block_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([2, 20], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        max_query_len=2, max_seq_len=20,
    )  # fmt: skip
    plan = StepPlan(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 19]), meta, [1, 2])
    frame = plan.encode()
    back = StepPlan.decode(frame[8:])
    assert back.input_ids.tolist() == [7, 8, 9] and back.positions.tolist() == [0, 1, 19]
    assert back.sample_rows == [1, 2]
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(back.meta, name), getattr(meta, name))
        assert getattr(back.meta, name).dtype == getattr(meta, name).dtype
    assert (back.meta.max_query_len, back.meta.max_seq_len) == (2, 20)
    with pytest.raises(ValueError, match="do not match its length"):
        StepPlan.decode(frame[8:-8])
    with pytest.raises(ValueError, match="not a step plan"):
        StepPlan.decode(b"\0" * 64)


# ----------------------------------------------------------------------------- ranks in threads
def _run_ranks(path: Path, size: int, chunks: list[list[tuple[int, list[int]]]], tmp: Path) -> list[torch.Tensor]:
    """Every rank of a ``size``-way split in its own thread, each over a shared KV cache through its
    own ``PagedRunner`` copy of the block tables; rank 0's logits of each step."""
    models = [load_model(path, shard=TPShard(r, size)) for r in range(size)]
    runners = [PagedRunner(m, block_size=4) for m in models]
    for r in runners[1:]:
        r.kv_cache = runners[0].kv_cache  # one cache, every rank its heads' slice
    store = str(tmp / f"store-{size}")

    def rank(r: int) -> list[torch.Tensor]:
        if size > 1:
            models[r].join(TPGroup(store, r, size, timeout_s=60))
        return [runners[r].step(c) for c in chunks]

    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(rank, range(size)))
    for other in results[1:]:  # every rank ends with the same (gathered) logits
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    return results[0]


@pytest.mark.parametrize(("variant", "size"), [("llama_gqa", 2), ("qwen2_bias", 2), ("mqa", 4), ("tied", 2)])
def test_sharded_model_matches_transformers_and_one_rank(
    variant: str, size: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints[variant]
    a, b = prompts(7, [13, 6])
    # A prefill of both, then a chunk of a, then two decode steps: mixed batches over the paged cache.
    chunks = [[(0, a[:9]), (1, b)], [(0, a[9:])], [(0, [3]), (1, [4])], [(0, [5]), (1, [6])]]
    split = _run_ranks(path, size, chunks, tmp_path)
    whole = _run_ranks(path, 1, chunks, tmp_path)
    hf = load_hf_reference(path)
    for s, w in zip(split, whole):  # float32: only the order of the sums differs
        torch.testing.assert_close(s, w, rtol=1e-4, atol=1e-4)
    full_a, full_b = hf_logits(hf, a + [3, 5]), hf_logits(hf, b + [4, 6])
    torch.testing.assert_close(torch.cat([split[0][:9], split[1]]), full_a[:13], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(split[0][9:], full_b[:6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(split[2], torch.stack([full_a[13], full_b[6]]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(split[3], torch.stack([full_a[14], full_b[7]]), rtol=1e-4, atol=1e-4)


def test_each_rank_holds_only_its_share(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama_gqa"]
    whole = load_model(path)
    half = load_model(path, shard=TPShard(1, 2))
    sizes = {n: p.numel() for n, p in half.named_parameters()}
    for name, p in whole.named_parameters():
        if "norm" in name:
            assert sizes[name] == p.numel()  # replicated
        elif name.endswith("o_proj.bias"):
            assert name not in sizes  # rank 0 adds it
        else:
            assert sizes[name] * 2 == p.numel(), name
    # Rank 1's rows of q_proj are the checkpoint's heads 2..3.
    q_rows = 2 * whole.config.head_dim
    assert torch.equal(half.model.layers[0].self_attn.qkv_proj.weight[:q_rows],
                       whole.model.layers[0].self_attn.qkv_proj.weight[q_rows : 2 * q_rows])  # fmt: skip


# ----------------------------------------------------------------------------- the engine
def _assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks() == kv.num_blocks


@pytest.mark.parametrize(("variant", "size"), [("llama_gqa", 2), ("mqa", 4), ("mistral_window", 2)])
def test_engine_greedy_equals_transformers(variant: str, size: int, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[variant]
    ps = prompts(11, [1, 7, 17, 30])
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    hf = load_hf_reference(path)
    llm = LLM(str(path), num_blocks=64, block_size=4, tensor_parallel_size=size, max_num_batched_tokens=24)
    try:
        outs = llm.generate(ps, params)
        again = llm.generate([ps[2] + [9]], params)[0]  # a prefix hit on the shared cache
        assert again.num_cached_tokens == 16
        assert again.token_ids == hf_greedy(hf, ps[2] + [9], NEW_TOKENS)
        for p, o in zip(ps, outs):
            assert o.token_ids == hf_greedy(hf, p, NEW_TOKENS)
        _assert_idle(llm)
    finally:
        llm.close()


def test_a_rank_that_dies_fails_its_step_returns_every_block_and_ends_the_engine(
    checkpoints: dict[str, Path],
) -> None:
    lost: list[str] = []
    called = threading.Event()
    from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig
    from pdserve.engine.engine import LLMEngine

    def on_lost(why: str) -> None:
        lost.append(why)
        called.set()

    config = EngineConfig(str(checkpoints["llama_gqa"]), cache=CacheConfig(num_blocks=64, block_size=4),
                          parallel=ParallelConfig(tensor_parallel_size=2, collective_timeout_s=30))  # fmt: skip
    engine = LLMEngine(config, on_rank_lost=on_lost)
    try:
        for i, p in enumerate(prompts(5, [9, 14])):
            engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True), request_id=f"r{i}")
        engine.step()
        assert engine.ranks is not None
        (pid,) = engine.ranks.pids
        os.kill(pid, signal.SIGKILL)
        assert wait_until(called.is_set, timeout=30)  # the watcher reports the lost rank
        assert lost == ["tensor-parallel rank 1 exited with code -9"]
        with pytest.raises(RankLost, match="rank 1 exited with code -9"):
            engine.step()
        assert not engine.has_unfinished()  # the failed step aborted its batch
        assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks
        engine.kv_manager.check_invariants()
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="after")
        with pytest.raises(RankLost):
            engine.step()
        assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks
    finally:
        engine.close()


def test_close_ends_every_rank(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["tied"]), num_blocks=32, tensor_parallel_size=2)
    assert llm.engine.ranks is not None
    (pid,) = llm.engine.ranks.pids
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    llm.close()

    assert wait_until(lambda: process_gone(pid), timeout=10)


def test_close_kills_hung_ranks_after_one_grace_for_all(checkpoints: dict[str, Path]) -> None:
    """Ranks that stop reading their input (stopped here) are killed once one grace has passed for all
    of them, not one grace after another."""
    llm = LLM(str(checkpoints["mqa"]), num_blocks=32, tensor_parallel_size=4)
    assert llm.engine.ranks is not None
    pids = llm.engine.ranks.pids
    assert len(pids) == 3
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    grace = 3.0
    started = time.monotonic()
    llm.engine.ranks.close(grace_s=grace)
    elapsed = time.monotonic() - started
    llm.close()
    assert all(process_gone(pid) for pid in pids)
    assert grace <= elapsed < 2 * grace, elapsed  # one after another would take 3 graces


@pytest.mark.slow
def test_smollm2_three_ranks_equal_transformers(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: it splits 3 ways (not 2, refused by name). One rank
    equals transformers on it already (tests/engine/test_gguf.py)."""
    from tests.engine.test_gguf import CHATS
    from tests.engine.test_gguf import hf_greedy as hf_greedy_ids
    from tests.support.gguf_files import smollm2_path
    from tests.support.hf_gguf import hf_model

    src = smollm2_path()
    (tmp_path / src.name).symlink_to(src)
    path = str(tmp_path / src.name)
    with pytest.raises(ValueError, match="num_attention_heads=9 does not divide by tensor_parallel_size=2"):
        LLM(path, num_blocks=64, tensor_parallel_size=2)
    llm = LLM(path, num_blocks=256, block_size=16, dtype="float32", tensor_parallel_size=3)
    try:
        chats = CHATS[:2]  # three ranks on a 2-core machine: a short check
        outs = [o.token_ids for o in llm.chat(chats, SamplingParams(max_tokens=12))]
        _assert_idle(llm)
        prompts_ids = [llm.tokenizer.encode_chat(c) for c in chats]
    finally:
        llm.close()
    ref = hf_model(src, tmp_path_factory)
    for ids, got in zip(prompts_ids, outs):
        expected = hf_greedy_ids(ref, ids, 12)
        eos = expected.index(2) + 1 if 2 in expected else len(expected)
        assert got == expected[:eos]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_offload_tier_and_fp8_cache_under_two_ranks(tiny_model: str, kv_cache_dtype: str) -> None:
    """The tier keeps and restores whole blocks of the shared cache (every rank's heads), FP8 included:
    eight 6-block prefixes through a 12-block pool come back from it with TP=1's tokens."""
    from tests.engine.test_kv_offload import PARAMS, prefixes

    prompts = [p + [5] for p in prefixes(8)]
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=256, kv_cache_dtype=kv_cache_dtype).generate(
        prompts, PARAMS)]  # fmt: skip
    llm = LLM(tiny_model, num_blocks=12, kv_offload_gb=0.01, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=2)
    try:
        first = [llm.generate([p], PARAMS)[0] for p in prompts]
        again = [llm.generate([p], PARAMS)[0] for p in prompts]
        assert [o.num_cached_tokens for o in again] == [96] * 8  # restored from the tier, not recomputed
        assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
        assert llm.engine.num_tier_hit_tokens >= 7 * 96
        _assert_idle(llm)
    finally:
        llm.close()


def test_a_rank_that_cannot_load_its_shard_is_named_and_nothing_is_left(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from pdserve.engine.kv_tensor import KVLayout, KVTensor
    from pdserve.engine.parallel.rank_processes import ProcessLauncher
    from pdserve.engine.parallel.ranks import Ranks

    # The rendezvous directory this start makes (by name: a worker of another test, still ending
    # on a loaded machine, may make its own meanwhile).
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    kv = KVTensor(KVLayout(1, 2, 8, 4, torch.float32), 4, shared=True)
    spec = {"model": str(tmp_path / "missing"), "dtype": "float32", "onednn": False, "quantized": False,
            "threads": 1, "num_blocks": 4, "layout": {}}  # fmt: skip
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1: FileNotFoundError: .*missing"):
        Ranks(ProcessLauncher(), spec, kv, 2, collective_timeout_s=10, start_timeout_s=120)
    assert not list(tmp_path.iterdir())
    assert len(made) == 1 and Path(made[0]).name.startswith("pdserve-tp-") and not Path(made[0]).exists()


# ----------------------------------------------------------------------------- hardening
PLANTED = """import os
open(os.environ["PDSERVE_TEST_MARKER"], "a").write(f"imported in pid {os.getpid()}\\n")
raise SystemExit(3)
"""


def _plant_json(directory: Path, marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``json.py`` in ``directory`` (which becomes the current directory) that writes ``marker``
    and exits if any process imports it: a rank imports ``json`` before anything else."""
    (directory / "json.py").write_text(PLANTED)
    monkeypatch.setenv("PDSERVE_TEST_MARKER", str(marker))
    monkeypatch.chdir(directory)


@pytest.mark.parametrize("python", ["3.11", "3.10"])
def test_a_rank_command_ignores_modules_in_the_current_directory(
    python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both forms of the rank's command line (``-P`` and the fallback before Python 3.11) import
    nothing from the current directory: the rank starts, finds no spec on its input and returns 1."""
    import subprocess
    import sys

    from pdserve.engine.parallel import rank_processes

    marker = tmp_path / "marker"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    _plant_json(cwd, marker, monkeypatch)
    version = (3, 10) if python == "3.10" else sys.version_info[:2]
    command = rank_processes.rank_command(version)
    assert ("-P" in command) == (version >= (3, 11))
    done = subprocess.run(command, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert done.returncode == 1, done.stderr.decode()[-2000:]
    assert not marker.exists()


def test_ranks_started_from_a_directory_with_a_planted_module_do_not_import_it(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "marker"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    _plant_json(cwd, marker, monkeypatch)
    expected = LLM(tiny_model, num_blocks=32, block_size=4).generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    llm = LLM(tiny_model, num_blocks=32, block_size=4, tensor_parallel_size=2)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    finally:
        llm.close()
    assert not marker.exists(), marker.read_text()
    assert out[0].token_ids == expected[0].token_ids


def _rank_children() -> list[int]:
    """This process's children that run a tensor-parallel rank."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and b"rank_main" in command:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("offload", [{"kv_offload_gb": 1e-9},
                                     {"kv_offload_gb": 0.01, "kv_offload_disk_gb": 0.01,
                                      "kv_offload_disk_dir": "/nonexistent/pdserve-test"}])  # fmt: skip
def test_a_refused_offload_tier_starts_no_rank(tiny_model: str, offload: dict) -> None:
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="kv_offload_gb=1e-09 holds no block|cannot create the disk tier's file"):
        LLM(tiny_model, num_blocks=32, block_size=4, tensor_parallel_size=2, **offload)
    assert _rank_children() == []
    assert torch.get_num_threads() == threads


def test_a_build_that_fails_after_the_ranks_started_ends_them_and_gives_threads_back(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine import engine as engine_module

    threads = torch.get_num_threads()
    started: list[int] = []

    def failing_scheduler(*args: object, **kwargs: object) -> None:
        started.extend(_rank_children())
        assert torch.get_num_threads() < threads or threads == 1  # the ranks took their share
        raise RuntimeError("the scheduler could not be built")

    monkeypatch.setattr(engine_module, "Scheduler", failing_scheduler)
    with pytest.raises(RuntimeError, match="the scheduler could not be built"):
        LLM(tiny_model, num_blocks=32, block_size=4, tensor_parallel_size=2, kv_offload_gb=0.01)
    assert len(started) == 1
    assert wait_until(lambda: all(process_gone(pid) for pid in started), timeout=10)
    assert _rank_children() == []
    assert torch.get_num_threads() == threads


def test_a_hung_rank_is_reported_lost_once_and_every_rank_ended(tiny_model: str) -> None:
    """A rank that stops answering (stopped here) fails the step after the collective timeout; the
    worker is then reported lost (a served worker ends its process there, to be restarted) and its
    ranks are ended, the hung one killed."""
    from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig
    from pdserve.engine.engine import LLMEngine

    lost: list[str] = []
    config = EngineConfig(tiny_model, cache=CacheConfig(num_blocks=32, block_size=4),
                          parallel=ParallelConfig(tensor_parallel_size=2, collective_timeout_s=3))  # fmt: skip
    engine = LLMEngine(config, on_rank_lost=lost.append)
    assert engine.ranks is not None
    (pid,) = engine.ranks.pids
    try:
        engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True), request_id="r0")
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RankLost, match="a tensor-parallel step failed"):
            engine.step()
        failed = time.monotonic()
        assert wait_until(lambda: lost, timeout=10)
        assert time.monotonic() - failed < 5  # the watcher's poll and one grace, not a restart's wait
        assert wait_until(lambda: process_gone(pid), timeout=5)
        time.sleep(0.5)  # the watcher has returned: no second report
        assert len(lost) == 1 and lost[0] == engine.ranks.failure
        assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks
    finally:
        if not process_gone(pid):
            os.kill(pid, signal.SIGCONT)
        engine.close()
    assert len(lost) == 1
