"""The Triton kernels compile for real NVIDIA GPUs, checked without one.

The kernel tests run in Triton's interpreter, which accepts code the GPU compiler refuses
(a plain-float global read inside a kernel compiled there and failed on every GPU). This
runs ``scripts/compile_kernels.py`` for sm_86 (A10G/L4-class shared memory) and sm_90.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _nvidia_backend_present() -> bool:
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return (Path(nv.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton without its NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm86_and_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--quick", "--arch", "86,90"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "0 failed or over the limit" in r.stdout
    assert r.stdout.count(" ok   ") == 56  # 28 configs x 2 architectures
