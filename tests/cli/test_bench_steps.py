"""``python -m pdserve.benchmarks.steps`` accounts for a decode step part by part, times prompts joining a
batch and the kernel-call replay (from C and from Python) against the modules, and samples the decode
steps under ``perf`` (no timing asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from pdserve.benchmarks.perf_profile import OTHER, group_of, meanwhile, summarise
from tests.support import REPO

PREFIX = 300  # the prompts' shared prefix (--prefix-tokens): its last block partial, as the default 221's


def test_steps_bench_parts_add_up_to_the_step(tiny_model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.steps", "--quick", "--joins", "2", "--replay-ab",
                        "--perf", "--json", "--model", tiny_model, "--prefix-tokens", str(PREFIX)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    parts = out["parts_ms"]
    assert set(parts) == {"schedule", "prepare", "forward", "logits", "sample", "outputs and bookkeeping"}
    assert all(v >= 0 for v in parts.values()) and parts["forward"] > 0
    assert sum(parts.values()) >= out["mean_step_ms"] * 0.999  # the remainder closes the sum
    assert abs(sum(out["forward_op_share"].values()) - 1) < 1e-6
    join = out["join"]  # two prompts joined three decoding sequences, each prefilled past the shared prefix
    assert join["decoding"] == 3 and join["joins"] == 2 and join["join_step_ms"] > 0 and join["decode_step_ms"] > 0
    # Uncached: the prompt's own 44-64 tokens and the prefix's partial last block (16-token blocks).
    assert PREFIX % 16 + 44 <= join["join_uncached_tokens"] <= PREFIX % 16 + 64
    ab = out["replay_ab"]  # 7 decode steps of 4 prompts, three ways in turn; each of the replay's qualified
    assert ab["steps_each"] == 2 and ab["replayed"] == 1.0
    assert ab["replay_ms"] > 0 and ab["python_replay_ms"] > 0 and ab["modules_ms"] > 0
    perf = out["perf"]  # the decode steps of a pass of their own, sampled on every thread
    if not _perf_records():
        assert set(perf) == {"unavailable"} and perf["unavailable"].startswith("perf ")
        return
    assert perf["samples"] > 0 and abs(sum(perf["groups"].values()) - 1) < 1e-9, perf
    assert perf["top"] and all(0 < t["share"] <= 1 for t in perf["top"])
    threads = perf["threads"]  # the main thread ran Python; with torch on one thread here, no others may have run
    assert threads["main"]["samples"] + threads["others"]["samples"] == perf["samples"]
    assert "Python and ctypes" in threads["main"]["groups"]
    both = perf["meanwhile"]  # waits paired with the other side's samples (none paired where no other thread ran)
    for side, ran in (("others_waiting", "main_ran"), ("main_waiting", "others_ran")):
        assert both[side]["samples"] >= 0 and all(0 < v <= 1 for v in both[side][ran].values())
        assert not both[side][ran] or abs(sum(both[side][ran].values()) - 1) < 1e-9


def _perf_records() -> bool:
    """Whether ``perf record`` works on this machine (installed, and allowed to open its events)."""
    perf = shutil.which("perf")
    if perf is None:
        return False
    cmd = [perf, "record", "-q", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"]
    return subprocess.run(cmd, check=False, capture_output=True, timeout=60).returncode == 0


# `perf report -n --no-children --sort pid,dso,sym --stdio -t "|"` as perf 6.1 prints it (thread 10451 the main one).
REPORT = """# Samples: 26K of event 'cpu-clock'
#
# Overhead|Samples|  Pid:Command|Shared Object|Symbol
#
 25.59% | 7371       |  10451:python |cpu_amx-d0246eb9a4530faea946f367.so       |[.] amx_product._omp_fn.0
 22.87% | 6586       |  10454:python |cpu_amx-d0246eb9a4530faea946f367.so       |[.] amx_product._omp_fn.0
 8.82%  | 2541       |  10454:python |cpu_decode-977c067133c74d59e6e12335.so    |[.] decode_bf16_4._omp_fn.0
 6.85%  | 1972       |  10454:python |libgomp.so.1                              |[.] 0x000000000001de62
 5.08%  | 1369       |  10451:python |cpu_amx_prefix-b9a15589aaf6a7a8bbbeb823.so|[.] pdserve_amx_prefix_attention._omp_fn.0
 3.83%  | 1032       |  10454:python |libgomp.so.1                              |[.] 0x000000000001e02a
 1.54%  | 415        |  10451:python |libpython3.11.so.1.0                      |[.] _PyEval_EvalFrameDefault
 1.25%  | 337        |  10451:python |libtorch_cpu.so                           |[.] at::operator|(c10::Foo, long)
 0.11%  | 30         |  10451:python |[kernel.kallsyms]                         |[k] do_syscall_64
 0.10%  | 27         |  10451:python |tokenizers.abi3.so                        |[.] 0x0000000000123456
"""


def test_perf_samples_are_grouped_by_what_ran_and_by_thread() -> None:
    out = summarise(REPORT, main_tid=10451, top=3)
    main, others = 7371 + 1369 + 415 + 337 + 30 + 27, 6586 + 2541 + 1972 + 1032
    total = main + others
    assert out["samples"] == total
    groups = out["groups"]
    assert groups["products (AMX tiles)"] == (7371 + 6586) / total and groups["decode attention"] == 2541 / total
    assert groups["shared-prefix attention"] == 1369 / total  # not the AMX products, whose name it starts with
    assert groups["OpenMP runtime (threads waiting)"] == (1972 + 1032) / total
    assert groups["torch"] == 337 / total and groups["operating system"] == 30 / total and groups[OTHER] == 27 / total
    assert abs(sum(groups.values()) - 1) < 1e-12 and list(groups.values()) == sorted(groups.values(), reverse=True)
    # The heaviest symbols over every thread; an object's unnamed addresses are one row.
    assert [(t["object"], t["symbol"], t["share"]) for t in out["top"]] == [
        ("cpu_amx-d0246eb9a4530faea946f367.so", "amx_product._omp_fn.0", (7371 + 6586) / total),
        ("libgomp.so.1", "(no symbols)", (1972 + 1032) / total),
        ("cpu_decode-977c067133c74d59e6e12335.so", "decode_bf16_4._omp_fn.0", 2541 / total)]  # fmt: skip
    threads = out["threads"]
    assert threads["main"]["samples"] == main and threads["others"]["samples"] == others
    assert threads["others"]["groups"]["OpenMP runtime (threads waiting)"] == (1972 + 1032) / others
    assert threads["main"]["groups"]["Python and ctypes"] == 415 / main
    assert "OpenMP runtime (threads waiting)" not in threads["main"]["groups"]
    empty = {"samples": 0, "groups": {}}
    assert summarise("# Samples: 0\n", main_tid=1) == {**empty, "top": [], "threads": {"main": empty, "others": empty}}
    assert group_of("cpu_gemm-0123abcd.so") == "products (float32 panel kernel)" and group_of("libfoo.so") == OTHER


# `perf script -F tid,time,ip,dso` as perf 6.1 prints it (thread 10451 the main one, 10454 an OpenMP thread).
SCRIPT = """\
   10454 100.000100:      7f385ec1de62 (/venv/torch/lib/libgomp.so.1)
   10451 100.000150:      7f38500ba02f (/usr/lib/libpython3.11.so.1.0)
   10454 100.000300:      7f385ec1de62 (/venv/torch/lib/libgomp.so.1)
   10451 100.000320:      7f3856158948 (/cache/cpu_amx-d0246eb9a4530faea946f367.so)
   10454 100.000500:      7f385ec1de62 (/venv/torch/lib/libgomp.so.1)
   10451 100.000700:      7f3856158948 (/cache/cpu_amx-d0246eb9a4530faea946f367.so)
   10454 100.000710:      7f385ec1de62 (/cache/cpu_amx-d0246eb9a4530faea946f367.so)
   10451 100.000900:      7f385ec1de62 (/venv/torch/lib/libgomp.so.1)
   10454 100.000910:      7f3856158948 (/cache/cpu_decode-611b80f8a618b52e077d15c0.so)
   10454 100.002000:      ffffffff8100 ([kernel.kallsyms])
"""


def test_waits_are_paired_with_what_the_other_side_ran_meanwhile() -> None:
    out = meanwhile(SCRIPT, main_tid=10451, within_s=0.0001)
    # The OpenMP thread waited 3 times: beside Python (50 us away) and the AMX products (20 us); its wait at
    # .000500 has no main-thread sample within 100 us (the nearest, .000320 and .000700, are 180 and 200 away).
    assert out["others_waiting"] == {"samples": 3, "main_ran": {"Python and ctypes": 0.5, "products (AMX tiles)": 0.5}}
    # The main thread waited once, while the other thread ran decode attention (10 us away).
    assert out["main_waiting"] == {"samples": 1, "others_ran": {"decode attention": 1.0}}
    assert meanwhile("", main_tid=1, within_s=1.0) == {"others_waiting": {"samples": 0, "main_ran": {}},
                                                      "main_waiting": {"samples": 0, "others_ran": {}}}  # fmt: skip


def test_a_prefix_of_no_tokens_is_refused(tiny_model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.steps", "--quick", "--model", tiny_model,
                        "--prefix-tokens", "0"], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 2 and "--prefix-tokens must be at least 1" in r.stderr
