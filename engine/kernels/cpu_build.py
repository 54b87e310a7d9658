"""Build a C kernel source into a shared library once per machine, and load it.

Contract of :func:`load`: returns a ``ctypes.CDLL`` of ``source`` compiled for this CPU, or None
(with one warning saying why) when kernels are turned off (``PDSERVE_CPU_KERNELS=0``), no C
compiler is found, the build fails or the cache directory is writable by anyone but this user;
callers then use their torch path. Libraries are kept in
:func:`pdserve.envs.kernel_cache_dir` (mode 0700) under a name that hashes the source and the
headers beside it (what it may include), the flags, the compiler's version and the CPU's feature
flags, so a changed source, header, compiler or machine (a home directory shared across a cluster's
nodes) never loads a stale build. Processes that build
the same library at once each write their own file and rename it into place (atomic), so a reader
never sees a partial one. Building takes a few seconds (about 3 for cpu_decode.c); it happens on first use.

``-march=native`` lets the compiler vectorise for this CPU (AVX2, AVX-512); ``-fopenmp`` links
``libgomp.so.1``, which resolves to the copy torch has already loaded, so the kernels' threads are
torch's intra-op threads (``torch.set_num_threads`` applies).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from pdserve import envs

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _compiler() -> str | None:
    explicit = envs.c_compiler()
    if explicit:
        return shutil.which(explicit) or None
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), part of the cache key because of ``-march=native``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _build_key(source: bytes, headers: list[bytes], cc: str) -> str:
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (source, *headers, " ".join(FLAGS).encode(), cc.encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _private(cache: Path) -> None:
    """Make ``cache`` (mode 0700) or check that it is this user's alone: a library loaded from a
    directory others can write would run their code. Raises ``RuntimeError`` otherwise."""
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = cache.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{cache} is not private to this user (owner {st.st_uid}, mode {st.st_mode & 0o777:o})")


def _build(source_path: Path, cc: str, cache: Path) -> Path:
    """The library's path in ``cache``, compiled there unless an earlier build is. Raises
    ``RuntimeError`` with the compiler's message when the build fails, or when ``cache`` is not private."""
    _private(cache)
    source = source_path.read_bytes()
    headers = [h.read_bytes() for h in sorted(source_path.parent.glob("*.h"))]
    target = cache / f"{source_path.stem}-{_build_key(source, headers, cc)}.so"
    if target.exists():
        return target
    started = time.monotonic()
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{source_path.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(source_path), "-o", tmp], check=False, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source_path.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s in %.1f s: %s", source_path.name, time.monotonic() - started, target)
    return target


def load(source_path: Path) -> ctypes.CDLL | None:
    """The compiled library of ``source_path`` (see the module docstring), loaded once per process."""
    name = str(source_path)
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        cc = _compiler()
        if not envs.cpu_kernels():
            log.info("CPU kernels are off (PDSERVE_CPU_KERNELS=0): %s is not used", source_path.name)
        elif cc is None:
            log.warning("no C compiler (cc, gcc or $CC) on the PATH: %s is not built; the torch path runs instead",
                        source_path.name)  # fmt: skip
        else:
            try:
                lib = ctypes.CDLL(str(_build(source_path, cc, Path(envs.kernel_cache_dir()))))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("%s could not be built or loaded (%s); the torch path runs instead", source_path.name, exc)
        _loaded[name] = lib
        return lib
