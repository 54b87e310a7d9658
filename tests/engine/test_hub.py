"""Models by Hub id (engine/model/hub.py), against a Hugging Face cache built here: these
machines reach no hub, so every lookup is offline (``HF_HUB_OFFLINE=1``) or fails to connect."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pdserve.engine.model import make_tiny_model
from pdserve.engine.model.hub import is_hub_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_snapshot(cache: Path, repo_id: str, src: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay ``src``'s files out in the Hub cache ``cache`` (``$HF_HOME/hub``) as huggingface_hub
    does: content-addressed ``blobs/``, ``snapshots/<commit>/`` of relative symlinks to them, and
    ``refs/<ref>`` naming the commit. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hub cache holding ``org/tiny`` (a tiny checkpoint), with ``HF_HUB_OFFLINE=1``."""
    cache = tmp_path / "hf" / "hub"
    fake_hub_snapshot(cache, "org/tiny", make_tiny_model(tmp_path / "tiny"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_the_cache_layout_is_huggingface_hubs_own(hub_cache: Path) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == "org/tiny" and {r.commit_hash for r in repo.revisions} == {COMMIT}
    assert {r.refs for r in repo.revisions} == {frozenset({"main"})}


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache: Path) -> None:
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert resolve_model("org/tiny", download_dir=str(hub_cache)) == str(snapshot)
    assert resolve_model("org/tiny", revision=COMMIT, download_dir=str(hub_cache)) == str(snapshot)
    assert (snapshot / "config.json").is_file()


def test_local_paths_are_not_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a relative directory shadows the id
    assert not is_hub_id("org/tiny") and resolve_model("org/tiny") == "org/tiny"
    for path in ("/abs/path", "./a/b", "../a/b", "model.gguf", "a/b/c", "a--b/c", "plain"):
        assert not is_hub_id(path) and resolve_model(path) == path


@pytest.mark.parametrize("model, revision", [("org/unknown", None), ("org/tiny", "no-such-branch")])
def test_what_the_cache_lacks_offline_is_one_line(hub_cache: Path, model: str, revision: str | None) -> None:
    with pytest.raises(ValueError) as e:
        resolve_model(model, revision=revision, download_dir=str(hub_cache))
    msg = str(e.value)
    assert "\n" not in msg and model in msg and "HF_HUB_OFFLINE" in msg


def test_a_gguf_only_snapshot_resolves_to_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model-Q8_0.gguf").write_bytes(b"GGUF")
    (src / "README.md").write_text("hi")
    snapshot = fake_hub_snapshot(tmp_path / "hub", "org/gguf", src)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/gguf", download_dir=str(tmp_path / "hub")) == str(snapshot / "model-Q8_0.gguf")
