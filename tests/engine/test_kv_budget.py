"""The KV pool's size from a memory budget, and the start-time refusal of a pool that cannot hold one
request of max_model_len (engine/kv_budget.py), on real engines (the tiny model and the shipped
SmolLM2) and as the rules alone."""

from __future__ import annotations

import re

import pytest

from pdserve.engine.kv_budget import (
    CPU_DEFAULT_MIN_BYTES,
    DeviceMemory,
    KVBudgetError,
    check_max_model_len,
    plan_kv_pool,
)
from pdserve.engine.llm import LLM
from tests.support.gguf_files import smollm2_path

MiB = 1024**2


def test_rules_in_order() -> None:
    gpu = lambda: DeviceMemory(free=70 * 1024 * MiB, total=80 * 1024 * MiB)  # noqa: E731 - 10 GiB in use
    # An exact block count wins over everything, and is never refused.
    exact = plan_kv_pool(7, 1 << 30, 0.9, 1000, 100, gpu)
    assert (exact.num_blocks, exact.budget_bytes) == (7, None)
    check_max_model_len(exact, 1600, 100, 112, 16, 1000)
    # A budget in bytes, on any device.
    given = plan_kv_pool(None, 50_500, 0.9, 1000, 100, gpu)
    assert given.num_blocks == 50 and "kv_cache_memory_bytes=50500" in given.source
    # GPU default: utilisation of the total, less what is in use and the activation reserve.
    on_gpu = plan_kv_pool(None, None, 0.9, MiB, 100, gpu, activation_reserve_bytes=2 * 1024 * MiB)
    assert on_gpu.num_blocks == 70 * 1024 - 8 * 1024 - 2 * 1024  # free - 10% of total - reserve, in MiB
    # CPU default: one request of max_model_len, at least CPU_DEFAULT_MIN_BYTES.
    small = plan_kv_pool(None, None, 0.9, MiB, 100, None)
    big = plan_kv_pool(None, None, 0.9, MiB, 1000, None)
    assert small.num_blocks == CPU_DEFAULT_MIN_BYTES // MiB and big.num_blocks == 1000
    # A GPU too full for its share gets no blocks (and is refused below), not a negative count.
    full = plan_kv_pool(None, None, 0.1, MiB, 100, gpu)  # 10 GiB in use, 8 GiB allowed
    assert full.num_blocks == 0
    with pytest.raises(KVBudgetError, match="max_model_len=1600"):
        check_max_model_len(full, 1600, 100, 1, 16, MiB)


def test_a_budget_too_small_for_max_model_len_is_refused_with_the_way_out(tiny_model: str) -> None:
    roomy = LLM(tiny_model, block_size=16).engine  # CPU default: one request of the model's 2048 tokens fits
    block_nbytes = roomy.kv_tensor.layout.block_nbytes
    assert roomy.limits.usable_len == roomy.max_model_len == 2048
    assert roomy.kv_manager.num_blocks * 16 >= 2048
    budget = 40 * block_nbytes  # 640 tokens
    with pytest.raises(KVBudgetError) as refused:
        LLM(tiny_model, block_size=16, kv_cache_memory_bytes=budget)
    msg = str(refused.value)
    assert "max_model_len=2048" in msg and "needs 128 blocks of 16 tokens" in msg and "gives 40 blocks" in msg
    assert f"at least {128 * block_nbytes} bytes" in msg
    # Following the message: the largest max_model_len it names fits that budget, and is what the API advertises.
    at_most = int(re.search(r"--max-model-len to at most (\d+)", msg).group(1))
    assert at_most == 640
    lowered = LLM(tiny_model, block_size=16, kv_cache_memory_bytes=budget, max_model_len=at_most).engine
    assert lowered.limits.usable_len == lowered.max_model_len == at_most
    # An exact block count is the expert's choice: served as far as it goes, advertised as such.
    exact = LLM(tiny_model, block_size=16, num_blocks=40).engine
    assert exact.max_model_len == 2048 and exact.limits.usable_len == 640


def test_the_shipped_model_gets_room_for_its_whole_context_by_default() -> None:
    engine = LLM(str(smollm2_path()), dtype="float32").engine  # the sizes below are float32 KV
    assert engine.max_model_len == 8192
    assert engine.limits.usable_len == 8192  # what /v1/models advertises: all of it
    with pytest.raises(KVBudgetError, match=r"max_model_len=8192 .*--kv-cache-memory-bytes 360MiB"):
        LLM(str(smollm2_path()), kv_cache_memory_bytes=256 * MiB, dtype="float32")
