"""tune_malloc: glibc thresholds raised for the KV wire's chunk buffers, or nothing where it cannot."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tests.support import REPO

# Chunk-sized buffers made and freed in a thread (as grpcio's threads do), sizes varying as messages do;
# prints the minor page faults the loop took.
_CHURN = """
import resource, threading
from pdserve.kvtransfer.allocator import tune_malloc
tuned = tune_malloc()
src = bytes(8 << 20)
def churn(rounds):
    for i in range(rounds):  # a few messages alive at once, then all freed
        keep = [b"h".join([memoryview(src)[: (2 << 20) + (i + k) % 7 * 65536], b""]) for k in range(3)]
        del keep
def measured():
    churn(5)  # the first touches of this thread's heap are not what is measured
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    churn(100)
    print(tuned, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=measured)
t.start()
t.join()
"""


def _churn(env_value: str) -> tuple[bool, int]:
    env = {"PDSERVE_MALLOC_TUNING": env_value, "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", _CHURN], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    tuned, faults = r.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tuned_process_reuses_chunk_buffers_instead_of_faulting_them_in() -> None:
    tuned, tuned_faults = _churn("1")
    untuned, default_faults = _churn("0")
    assert tuned and not untuned
    # 300 buffers of 2-2.4 MiB: glibc's defaults give the freed ones back and fault them in again.
    assert default_faults > 20 * max(tuned_faults, 100), (default_faults, tuned_faults)


def test_thresholds_are_checked() -> None:
    from pdserve.kvtransfer.allocator import tune_malloc

    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_malloc(mmap_threshold=0)
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_malloc(mmap_threshold=2 << 20, trim_threshold=1 << 20)


# A burst of heap allocations (as a busy worker makes), freed but for one block above them: the
# heap cannot shrink from its top by itself, so the freed pages stay resident until a trim.
_BURST = """
import psutil
from pdserve.kvtransfer.allocator import HeapTrimmer, tune_malloc
tune_malloc()
rss = lambda: psutil.Process().memory_info().rss
burst = [bytearray(1 << 20) for _ in range(200)]  # 200 MiB below the raised mmap threshold
pin = bytearray(1 << 20)
del burst
before = rss()
trimmer = HeapTrimmer(min_interval_s=60)
first, second = trimmer.maybe_trim(), trimmer.maybe_trim()
print(first, second, before, rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_an_idle_trim_gives_a_bursts_heap_back_and_is_rate_limited() -> None:
    """With the raised thresholds a freed burst stays resident; the trim hands it back to the
    kernel, and a second trim within the interval does nothing."""
    r = subprocess.run([sys.executable, "-c", _BURST], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    first, second, before, after = r.stdout.split()
    assert (first, second) == ("True", "False")
    assert int(before) - int(after) > 150 << 20, (int(before) >> 20, int(after) >> 20)
