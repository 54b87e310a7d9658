"""The CPU decode-attention kernel that reads K/V in place (engine/kernels/cpu_decode.c), against
the float32 reference kernel, on caches whose unused slots are NaN (a read outside a sequence's
positions poisons its row); its build and fallbacks (engine/kernels/cpu_build.py); and the engine
with it against transformers."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.kernels import cpu_build, cpu_decode, paged_attention_ref
from pdserve.engine.kernels.torch_paged import paged_attention_torch, plan_attention

pytestmark = pytest.mark.skipif(not cpu_decode.supports(torch.float32, torch.float32, 2, 1, 64),
                                reason="no C compiler here: the kernel is not built")  # fmt: skip

BS = 16


def _batch(lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
           seed: int = 0, extra_heads: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Sequences of ``lens`` positions (the last ``q_lens`` of each are queries) in shuffled blocks
    of a cache whose unwritten slots are NaN. ``extra_heads``: the cache holds that many more KV heads
    and the returned K/V are the slice of the first ``kv_heads`` (a tensor-parallel rank's view).
    Returns (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BS) for n in lens]
    total = sum(counts) + 3
    ids = torch.randperm(total, generator=gen).tolist()
    table = torch.zeros(len(lens), max(counts) + 2, dtype=torch.int32)
    kv = torch.full((total, 2, BS, kv_heads + extra_heads, head_dim), float("nan"))
    taken = 0
    for s, (n, count) in enumerate(zip(lens, counts)):
        row = ids[taken : taken + count]
        taken += count
        table[s, :count] = torch.tensor(row, dtype=torch.int32)
        for p in range(n):
            kv[row[p // BS], :, p % BS] = torch.randn(2, kv_heads + extra_heads, head_dim, generator=gen)
    kv = kv.to(dtype)[:, :, :, :kv_heads]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return q, kv[:, 0], kv[:, 1], table, torch.tensor(lens, dtype=torch.int32), qsl


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (4, 4, 32), (9, 3, 64), (4, 2, 80), (6, 3, 96), (16, 2, 128),
                                                             (16, 1, 256)])  # fmt: skip
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_decodes_match_the_reference(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                     tol: float) -> None:  # fmt: skip
    """Lengths 1 to 300 (a tile of 8 or 16 keys ends mid-block and mid-sequence, after an odd or even
    number of keys), MHA, GQA and MQA."""
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 100, 300]
    q, k, v, table, seq_lens, qsl = _batch(lens, [1] * len(lens), heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    plan = plan_attention(table, seq_lens, qsl, BS, fused=True)
    assert plan.fused and len(plan.decode_groups) == 1
    got = paged_attention_torch(q, k, v, table, seq_lens, qsl, scale, plan)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), table, seq_lens, qsl, scale)
    assert got.dtype == dtype and not got.isnan().any()
    assert _rel(got, ref) < tol


def test_the_log_sum_exp_and_a_row_with_no_positions() -> None:
    q, k, v, table, _, _ = _batch([40, 7], [1, 1], 6, 2, 32, torch.float32, seed=1)
    blocks = table[:, :3].long().contiguous()
    starts = torch.tensor([5, 7], dtype=torch.int64)  # the second row reads nothing
    spans = torch.tensor([40, 7], dtype=torch.int64)
    out, lse = cpu_decode.decode_attention(q, k, v, blocks, starts, spans, 0.25)
    keys = k[blocks[0]].reshape(-1, 2, 32)[5:40].repeat_interleave(3, dim=1)  # [35, 6, 32]
    scores = torch.einsum("hd,thd->ht", q[0], keys) * 0.25
    assert torch.allclose(lse[0], torch.logsumexp(scores, dim=-1), atol=1e-5)
    assert torch.equal(out[1], torch.zeros(6, 32)) and bool((lse[1] == float("-inf")).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_partial_result_over_other_keys_is_merged_in(dtype: torch.dtype) -> None:
    """``prefix``: attention over positions [0, a) given as (out, lse), continued over [a, n) by the
    kernel, is attention over [0, n); a row whose prefix saw no key (lse -inf) reads only its own."""
    lens = [40, 100, 17, 64]
    q, k, v, table, _, _ = _batch(lens, [1] * 4, 8, 2, 64, dtype, seed=6)
    blocks = table.long().contiguous()
    spans = torch.tensor(lens, dtype=torch.int64)
    split = torch.tensor([16, 37, 0, 64], dtype=torch.int64)  # the third's prefix is empty
    whole, whole_lse = cpu_decode.decode_attention(q, k, v, blocks, torch.zeros(4, dtype=torch.int64), spans, 0.125)
    part = cpu_decode.decode_attention(q, k, v, blocks, torch.zeros(4, dtype=torch.int64), split, 0.125)
    assert part[1][2].isinf().all()
    shaped = (part[0].view(4, 2, 4, 64).to(dtype), part[1].view(4, 2, 4))  # any float dtype and shape
    out, lse = cpu_decode.decode_attention(q, k, v, blocks, split, spans, 0.125, shaped)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(out, whole) < tol and torch.allclose(lse, whole_lse, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_queries_and_a_prefix_read_where_it_lies(dtype: torch.dtype) -> None:
    """Queries at a row stride (a view of a q/k/v projection's rows) and a prefix part laid out as the
    flash operator leaves it (``[Hkv, B, G, D]`` of the queries' dtype, its log-sum-exp ``[B, G, Hkv]``)
    are read in place: the result is bit for bit that of contiguous float32 copies of them. The output
    has the queries' dtype."""
    lens = [40, 100, 17, 64]
    q, k, v, table, _, _ = _batch(lens, [1] * 4, 8, 2, 64, dtype, seed=7)
    blocks = table.long().contiguous()
    spans = torch.tensor(lens, dtype=torch.int64)
    split = torch.tensor([16, 37, 0, 64], dtype=torch.int64)
    rows = torch.cat([q, torch.randn(4, 3, 64).to(dtype)], dim=1)  # each row's 8 heads, then 3 heads more
    strided = rows[:, :8]
    assert strided.stride(0) == 11 * 64
    part, part_lse = cpu_decode.decode_attention(q, k, v, blocks, torch.zeros(4, dtype=torch.int64), split, 0.125)
    assert part.dtype == dtype and part_lse.dtype == torch.float32
    lying = part.view(4, 2, 4, 64).transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hkv, G, D], B not outermost
    lse_lying = part_lse.view(4, 2, 4).permute(0, 2, 1).contiguous().permute(0, 2, 1)
    got = cpu_decode.decode_attention(strided, k, v, blocks, split, spans, 0.125, (lying, lse_lying))
    want = cpu_decode.decode_attention(q, k, v, blocks, split, spans, 0.125,
                                       (part.float().contiguous(), part_lse.contiguous()))  # fmt: skip
    assert got[0].dtype == dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_window_a_cascade_and_prefills_in_one_step() -> None:
    """Mixed batch: decodes beside a prefill, under a sliding window; then twelve decodes sharing a
    prefix through the cascade, whose suffixes the kernel reads and merges by log-sum-exp."""
    q, k, v, table, seq_lens, qsl = _batch([90, 20, 200, 64], [1, 1, 30, 1], 9, 3, 64, torch.float32, seed=2)
    for window in (None, 24):
        plan = plan_attention(table, seq_lens, qsl, BS, sliding_window=window, fused=True)
        got = paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.125, plan, sliding_window=window)
        ref = paged_attention_ref(q, k, v, table, seq_lens, qsl, 0.125, sliding_window=window)
        assert _rel(got, ref) < 1e-6
    lens = [160 + n for n in (1, 5, 16, 17, 40, 90, 120, 200, 230, 260, 3, 9)]
    q, k, v, table, seq_lens, qsl = _batch(lens, [1] * len(lens), 9, 3, 64, torch.float32, seed=3)
    table[:, :10] = table[0, :10]  # every sequence starts with the first one's 10 blocks
    plan = plan_attention(table, seq_lens, qsl, BS, cascade=True, fused=True)
    assert plan.cascade is not None and plan.cascade.num_tokens == 160
    got = paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.125, plan)
    assert _rel(got, paged_attention_ref(q, k, v, table, seq_lens, qsl, 0.125)) < 1e-6


def test_a_tensor_parallel_rank_s_head_slice_on_two_threads() -> None:
    """K/V as a slice of a cache's heads (strided), the kernel's OpenMP loop on two threads."""
    q, k, v, table, seq_lens, qsl = _batch([50, 3, 129], [1, 1, 1], 4, 2, 64, torch.float32, seed=4, extra_heads=2)
    assert not k.is_contiguous()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.125, plan_attention(table, seq_lens, qsl, BS,
                                                                                         fused=True))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert _rel(got, paged_attention_ref(q, k, v, table, seq_lens, qsl, 0.125)) < 1e-6


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 8), (15, 5), (8, 8)])
def test_runs_of_heads_per_work_item(heads: int, kv_heads: int, threads: int) -> None:
    """A work item is a sequence and a run of its KV heads, shorter when the batch is small against
    the threads (down to one head, runs that do not divide the heads): 1, 3 and 8 sequences."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed, lens in enumerate(([70], [1, 33, 130], [5, 16, 17, 48, 49, 64, 100, 7])):
            q, k, v, table, seq_lens, qsl = _batch(lens, [1] * len(lens), heads, kv_heads, 32, torch.float32, seed)
            plan = plan_attention(table, seq_lens, qsl, BS, fused=True)
            got = paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.2, plan)
            assert _rel(got, paged_attention_ref(q, k, v, table, seq_lens, qsl, 0.2)) < 1e-6
    finally:
        torch.set_num_threads(saved)


def _has_avx2() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx2 " in cpuinfo.read_text() and cpu_build._compiler() is not None


@pytest.mark.skipif(not _has_avx2(), reason="the AVX2 build needs a CPU with AVX2 to run")
def test_the_avx2_build_agrees_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AVX-512 the kernel works in vectors and tiles of 8 floats: built here for x86-64-v3,
    it gives the reference's results in both dtypes."""
    flags = [f for f in cpu_build.FLAGS if f != "-march=native"]
    lib_path = tmp_path / "cpu_decode_avx2.so"
    subprocess.run([cpu_build._compiler(), *flags, "-march=x86-64-v3", "-Wno-psabi", str(cpu_decode._SOURCE), "-o",
                    str(lib_path)], check=True, capture_output=True, timeout=300)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    assert lib.pdserve_decode_lanes() == 8
    monkeypatch.setattr(cpu_decode, "_get", lambda: cpu_decode._Kernel(lib))
    lens = [1, 2, 7, 8, 9, 16, 17, 33, 100]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        q, k, v, table, seq_lens, qsl = _batch(lens, [1] * len(lens), 9, 3, 64, dtype, seed=5)
        plan = plan_attention(table, seq_lens, qsl, BS, fused=True)
        got = paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.125, plan)
        ref = paged_attention_ref(q.float(), k.float(), v.float(), table, seq_lens, qsl, 0.125)
        assert _rel(got, ref) < tol


def test_what_it_does_not_run() -> None:
    assert not cpu_decode.supports(torch.float32, torch.float8_e4m3fn, 8, 2, 64)  # an FP8 cache: torch path
    assert not cpu_decode.supports(torch.float16, torch.float16, 8, 2, 64)
    assert not cpu_decode.supports(torch.float32, torch.float32, 64, 2, 64)  # a group of 32 heads
    assert not cpu_decode.supports(torch.float32, torch.float32, 8, 2, 512)
    assert not cpu_decode.supports(torch.float32, torch.float32, 8, 2, 72)  # a head size with no instantiation
    assert not cpu_decode.supports(torch.float32, torch.float32, 8, 2, 60)  # not whole vectors
    q, k, v, table, seq_lens, _ = _batch([5], [1], 64, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="does not run"):
        cpu_decode.decode_attention(q, k, v, table.long(), torch.zeros(1, dtype=torch.int64), seq_lens.long(), 1.0)
    # A cache of another head size than the queries' would be read past its end: refused.
    q, k, v, table, seq_lens, _ = _batch([5], [1], 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="q's head size"):
        cpu_decode.decode_attention(torch.zeros(1, 4, 64), k, v, table.long(), torch.zeros(1, dtype=torch.int64),
                                    seq_lens.long(), 1.0)  # fmt: skip


def test_one_openmp_runtime_in_the_process() -> None:
    """The kernel's libgomp is the one torch loaded: one thread pool, not two competing for the cores."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps")
    gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(gomp) == 1, gomp


# cpu_build.py alone (by path: the kernels package would import torch, seconds per process).
_LOAD = """
import importlib.util, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[2])
cpu_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_build)
print("LOADED", cpu_build.load(Path(sys.argv[1])) is not None)
"""


def _load_in_a_process(source: Path, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", _LOAD, str(source), cpu_build.__file__], check=False,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_built_once_per_machine_and_the_fallbacks(tmp_path: Path) -> None:
    source, header = tmp_path / "k.c", tmp_path / "k.h"
    header.write_text("#define SEVEN 7\n")
    source.write_text('#include "k.h"\nint pdserve_k(void) { return SEVEN; }\n')
    env = {"PDSERVE_KERNEL_CACHE": str(tmp_path / "cache")}
    first = _load_in_a_process(source, env)
    assert "LOADED True" in first and "built k.c" in first
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    second = _load_in_a_process(source, env)
    assert "LOADED True" in second and "built" not in second  # the first process's library
    source.write_text("int pdserve_k(void) { return 8; }\n")  # a changed source is built again
    assert "built k.c" in _load_in_a_process(source, env)
    header.write_text("#define SEVEN 8\n")  # and so is one whose header beside it changed
    assert "built k.c" in _load_in_a_process(source, env)
    assert len(list((tmp_path / "cache").glob("k-*.so"))) == 3
    off = _load_in_a_process(source, {**env, "PDSERVE_CPU_KERNELS": "0"})
    assert "LOADED False" in off and "PDSERVE_CPU_KERNELS=0" in off
    missing = _load_in_a_process(source, {**env, "CC": "/nonexistent/cc"})
    assert "LOADED False" in missing and "no C compiler" in missing
    (tmp_path / "cache").chmod(0o777)  # a directory others may write: nothing is loaded from it
    shared = _load_in_a_process(source, env)
    assert "LOADED False" in shared and "not private" in shared
    (tmp_path / "cache").chmod(0o700)
    source.write_text("this is not C\n")
    broken = _load_in_a_process(source, env)
    assert "LOADED False" in broken and "could not be built" in broken and "error" in broken


def test_the_engine_with_the_kernel_equals_transformers(tiny_model: str) -> None:
    """Greedy decoding of a batch through the kernel equals transformers' token for token."""
    transformers = pytest.importorskip("transformers")
    from pdserve import LLM, SamplingParams

    llm = LLM(tiny_model, dtype="float32", block_size=BS)
    assert llm.engine.runner.fused_decode
    prompts = [[3 + i, 17, 40 + 2 * i, 5, 9] * (1 + 7 * i) for i in range(4)]
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(prompt) :].tolist()
        assert tokens == want
