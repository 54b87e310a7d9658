"""``pdserve bench gguf`` checks that both readers agree, then times them (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import REPO
from tests.support.gguf_files import write_gguf
from tests.support.models import make_hf_checkpoint


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "gguf", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip


def test_both_readers_agree_and_are_timed(tmp_path: Path) -> None:
    path = write_gguf(make_hf_checkpoint(tmp_path / "hf", "llama_gqa", seed=5), tmp_path / "tiny.gguf")
    r = _bench("--model", str(path), "--repeats", "3", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["model"] == str(path) and out["repeats"] == 3
    assert out["seconds"]["pdserve"] > 0 and out["seconds"]["gguf"] > 0 and out["speedup"] > 0


def test_a_file_that_is_not_gguf_is_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = _bench("--model", str(bad))
    assert r.returncode == 2 and "no GGUF magic" in r.stderr and "Traceback" not in r.stderr
    r = _bench("--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "is not a file" in r.stderr
