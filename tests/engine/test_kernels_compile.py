"""The Triton kernels compile for real NVIDIA GPUs, checked without one.

The kernel tests run in Triton's interpreter, which accepts code the GPU compiler refuses
(a plain-float global read inside a kernel compiled there and failed on every GPU). This
runs ``scripts/compile_kernels.py --quick`` for sm_90 (H100/H200) in the default run, and for
sm_86 (A10G/L4-class, the tightest shared memory) with ``-m slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO


def _nvidia_backend_present() -> bool:
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return (Path(nv.__file__).parent / "bin" / "ptxas").exists()


def compile_check(arch: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compile_kernels.py"), "--quick", "--arch", arch],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    compiles = int(re.search(r"(\d+) compiles in", r.stdout)[1])
    assert "0 failed or over the limit" in r.stdout and r.stdout.count(" ok   ") == compiles
    # Float caches (bf16, fp32) and the FP8 caches: e5m2 everywhere, e4m3 from sm_89 on.
    assert compiles >= 24 and " kv-fp8e5 " in r.stdout
    assert (" kv-fp8e4nv " in r.stdout) == (int(arch) >= 89)


pytestmark = pytest.mark.skipif(not _nvidia_backend_present(), reason="triton without its NVIDIA backend (ptxas)")


def test_kernels_compile_for_sm90() -> None:
    compile_check("90")


@pytest.mark.slow
def test_kernels_compile_for_sm86() -> None:
    compile_check("86")
