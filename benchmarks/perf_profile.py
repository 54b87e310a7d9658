"""Where a process's CPU time goes while a piece of work runs, sampled by Linux ``perf``.

``torch.profiler`` sees the operators it wraps, so it cannot split a decode step that the engine replays
as the C kernels' calls (``engine/model/decode_replay.py``), nor see the OpenMP runtime's waits or the
Python between the calls. ``perf record -e cpu-clock`` samples every thread of the process wherever it
is: each kernel's shared object, ``libgomp``, the interpreter, torch.

Contract of :func:`sample`: ``work()`` runs exactly once, with ``perf record`` attached to this process
(every thread) for exactly its duration where ``perf`` is installed and allowed to record (recording
starts disabled and is switched on and off through perf's control descriptors, which acknowledge each
switch, so the work is neither cut short nor padded); returns the samples grouped by what they ran
(:data:`GROUPS`, shares of all samples, every thread together), the heaviest symbols, and the same
groups for the main thread (the one that runs Python) and the others (OpenMP's), what the main thread ran
while the others waited in the OpenMP runtime and the other way round (:func:`meanwhile`), or
``{"unavailable": reason}`` where perf is missing or failed (``work()`` then still runs, unrecorded).
"""

from __future__ import annotations

import bisect
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (group, the shared objects' names before their first "-" or "." (the kernel's "[kernel.kallsyms]" whole)),
# first match wins; the kernels' libraries are named ``cpu_<kernel>-<build hash>.so`` (engine/kernels/cpu_build.py).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("products (float32 panel kernel)", ("cpu_gemm",)),
    ("products (AMX tiles)", ("cpu_amx",)),
    ("decode attention", ("cpu_decode",)),
    ("shared-prefix attention", ("cpu_amx_prefix", "cpu_prefix")),
    ("norms, rotary, KV write, sampling", ("cpu_ops",)),
    ("OpenMP runtime (threads waiting)", ("libgomp",)),
    ("Python and ctypes", ("libpython3", "python3", "_ctypes", "libffi")),
    ("torch", ("libtorch_cpu", "libtorch_python", "libtorch", "libc10", "_C")),
    ("C library", ("libc", "libm", "libstdc++", "ld")),  # ld: the dynamic loader, ld-linux-*.so
    ("operating system", ("[kernel.kallsyms]",)),
)
OTHER = "other"
_SEP = "|"  # perf report -t: the columns split by it (the symbol, last, may hold it too)
_ACK_TIMEOUT_S = 30.0


def group_of(dso: str) -> str:
    """The :data:`GROUPS` name of a shared object as ``perf report`` names it, else :data:`OTHER`."""
    stem = dso if dso.startswith("[") else re.split(r"[-.]", dso, maxsplit=1)[0]
    return next((name for name, stems in GROUPS if stem in stems), OTHER)


def summarise(report: str, main_tid: int, top: int = 10) -> dict[str, Any]:
    """``perf report -n --no-children --sort pid,dso,sym --stdio -t "|"`` text (a row per thread, object
    and symbol) as its number of samples, their shares per group (summing to 1), the ``top`` heaviest
    symbols' shares (over all threads), and per thread, ``main`` (``main_tid``) and the ``others``
    together, the samples and their shares per group."""
    rows: list[tuple[int, int, str, str]] = []  # samples, thread, object, symbol
    for line in report.splitlines():
        cols = line.split(_SEP, 4)
        if line.startswith("#") or len(cols) != 5 or not cols[0].strip().endswith("%"):
            continue
        sym = re.sub(r"^\[[.kgu]\]\s*", "", cols[4].strip())
        # An object without symbols (libgomp's spin loops) reports addresses: one row for all of them.
        sym = "(no symbols)" if re.fullmatch(r"0x[0-9a-f]+", sym) else sym
        rows.append((int(cols[1]), int(cols[2].strip().split(":", 1)[0]), cols[3].strip(), sym))
    out = _shares([(n, dso) for n, _, dso, _ in rows])
    symbols: dict[tuple[str, str], int] = {}
    for n, _, dso, sym in rows:
        symbols[(dso, sym)] = symbols.get((dso, sym), 0) + n
    heaviest = sorted(symbols.items(), key=lambda kv: -kv[1])[:top]
    out["top"] = [{"share": n / out["samples"], "object": d, "symbol": y} for (d, y), n in heaviest]
    out["threads"] = {"main": _shares([(n, dso) for n, tid, dso, _ in rows if tid == main_tid]),
                      "others": _shares([(n, dso) for n, tid, dso, _ in rows if tid != main_tid])}  # fmt: skip
    return out


def meanwhile(script: str, main_tid: int, within_s: float) -> dict[str, Any]:
    """``perf script -F tid,time,ip,dso`` text as what one side ran while the other waited: for each sample of
    another thread in the OpenMP runtime (a thread with nothing to do: between parallel regions, or done with
    its share of one), the group of the main thread's sample nearest in time, if one lies within
    ``within_s``; and the same for the main thread's waits against the others' samples. Returns
    ``{"others_waiting": {"samples": n, "main_ran": shares}, "main_waiting": {"samples": n, "others_ran":
    shares}}`` (shares per :data:`GROUPS` group of the paired samples, largest first; unpaired samples
    counted in ``samples`` only)."""
    main: list[tuple[float, str]] = []
    others: list[tuple[float, str]] = []
    for line in script.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+\.\d+):\s+[0-9a-f]+\s+\((.*)\)\s*$", line)
        if m is None:
            continue
        dso = m[3] if m[3].startswith("[") else os.path.basename(m[3])
        (main if int(m[1]) == main_tid else others).append((float(m[2]), group_of(dso)))
    wait = next(name for name, stems in GROUPS if "libgomp" in stems)
    return {"others_waiting": _paired(others, main, wait, within_s, "main_ran"),
            "main_waiting": _paired(main, others, wait, within_s, "others_ran")}  # fmt: skip


def _paired(waiters: list[tuple[float, str]], runners: list[tuple[float, str]], wait: str, within_s: float,
            key: str) -> dict[str, Any]:  # fmt: skip
    """The :func:`meanwhile` entry of one side: its waiting samples and the runners' groups nearest them."""
    times = [t for t, _ in runners]  # perf script prints samples in time order
    counts: dict[str, int] = {}
    waiting = 0
    for t, group in waiters:
        if group != wait:
            continue
        waiting += 1
        i = bisect.bisect_left(times, t)
        near = min((j for j in (i - 1, i) if 0 <= j < len(times)), key=lambda j: abs(times[j] - t), default=None)
        if near is not None and abs(times[near] - t) <= within_s:
            counts[runners[near][1]] = counts.get(runners[near][1], 0) + 1
    paired = sum(counts.values())
    return {"samples": waiting,
            key: {g: n / paired for g, n in sorted(counts.items(), key=lambda kv: -kv[1])}}  # fmt: skip


def _shares(rows: list[tuple[int, str]]) -> dict[str, Any]:
    """The samples of ``(samples, object)`` rows and their shares per :data:`GROUPS` group, largest first."""
    counts: dict[str, int] = {}
    for n, dso in rows:
        group = group_of(dso)
        counts[group] = counts.get(group, 0) + n
    total = sum(counts.values())
    return {"samples": total, "groups": {g: n / total for g, n in sorted(counts.items(), key=lambda kv: -kv[1])}}


def sample(work: Callable[[], None], frequency: int = 999) -> dict[str, Any]:
    """Run ``work()`` once under ``perf record`` (the module docstring's contract)."""
    perf = shutil.which("perf")
    if perf is None:
        work()
        return {"unavailable": "perf not found (Debian/Ubuntu: linux-perf / linux-tools; Fedora: perf)"}
    with tempfile.TemporaryDirectory(prefix="pdserve-perf-") as tmp:
        data = Path(tmp) / "perf.data"
        ctl_r, ctl_w = os.pipe()
        ack_r, ack_w = os.pipe()
        cmd = [perf, "record", "-q", "-e", "cpu-clock", "-F", str(frequency), "-D", "-1",
               "--control", f"fd:{ctl_r},{ack_w}", "-p", str(os.getpid()), "-o", str(data)]  # fmt: skip
        proc = subprocess.Popen(cmd, pass_fds=(ctl_r, ack_w), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(ctl_r)
        os.close(ack_w)
        try:
            if not _switch(ctl_w, ack_r, b"enable"):
                work()
                return {"unavailable": _failure(proc)}
            try:
                work()
            finally:
                _switch(ctl_w, ack_r, b"disable")
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=120)
        finally:
            os.close(ctl_w)
            os.close(ack_r)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return _report(perf, data, proc, frequency)


def _switch(ctl: int, ack: int, command: bytes) -> bool:
    """Send ``command`` on perf's control descriptor; whether perf acknowledged it in time."""
    try:
        os.write(ctl, command + b"\n")
    except BrokenPipeError:  # perf already exited (it could not record)
        return False
    got = b""
    while b"ack\n" not in got:  # perf writes "ack\n\0"
        ready, _, _ = select.select([ack], [], [], _ACK_TIMEOUT_S)
        chunk = os.read(ack, 64) if ready else b""
        if not chunk:  # timed out, or perf exited
            return False
        got += chunk
    return True


def _failure(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    return "perf record failed: " + (lines[-1] if lines else f"exit {proc.returncode}")


def _report(perf: str, data: Path, proc: subprocess.Popen[bytes], frequency: int) -> dict[str, Any]:
    if not data.exists():
        return {"unavailable": _failure(proc)}
    cmd = [perf, "report", "-i", str(data), "-n", "--no-children", "--sort", "pid,dso,sym", "--stdio", "-t", _SEP,
           "--percent-limit", "0"]  # fmt: skip
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return {"unavailable": "perf report failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]}
    out = summarise(r.stdout, os.getpid())
    cmd = [perf, "script", "-i", str(data), "-F", "tid,time,ip,dso"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    if r.returncode == 0:  # pairs within half a sampling period: the nearest sample of the other side
        out["meanwhile"] = meanwhile(r.stdout, os.getpid(), 0.5 / frequency)
    return out
