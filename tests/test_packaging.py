"""The installed package: one ``pdserve`` namespace, dependencies pointing one way, a pure kvcache."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO

# Repository folder -> installed package (pyproject's package-dir).
FOLDERS = {
    "pdserve": "pdserve",
    "engine": "pdserve.engine",
    "kvtransfer": "pdserve.kvtransfer",
    "kvindex": "pdserve.kvindex",
    "worker": "pdserve.worker",
    "prefill_worker": "pdserve.prefill_worker",
    "decode_worker": "pdserve.decode_worker",
    "router": "pdserve.router",
    "cluster": "pdserve.cluster",
    "cli": "pdserve.cli",
    "benchmarks": "pdserve.benchmarks",
}
# What each layer may import (besides itself and the root package's envs and generated code):
# engine <- kvtransfer / kvindex <- workers <- router <- cluster <- cli.
ALLOWED = {
    "engine": set(),
    "kvtransfer": {"engine"},
    "kvindex": {"engine"},
    "worker": {"engine", "kvtransfer", "kvindex"},
    "prefill_worker": {"engine", "kvtransfer", "kvindex", "worker"},
    "decode_worker": {"engine", "kvtransfer", "kvindex", "worker"},
    "router": {"engine", "kvindex", "worker"},
    "cluster": {"engine", "kvtransfer", "kvindex", "worker", "prefill_worker", "decode_worker", "router"},
    "cli": {"engine", "kvtransfer", "kvindex", "worker", "router", "cluster"},
    "benchmarks": set(FOLDERS) - {"pdserve"},
}


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names if node.module == "pdserve")
    return names


def test_every_package_folder_is_installed() -> None:
    """pyproject lists each package explicitly; a new sub-folder must be added there."""
    text = (REPO / "pyproject.toml").read_text()
    for folder, package in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(REPO / folder).parts
            assert f'"{".".join((package, *sub))}"' in text, f"{init.parent} is not in pyproject's packages"


def test_dependencies_point_one_way_and_nothing_imports_a_bare_folder_name() -> None:
    bad: list[str] = []
    for folder, allowed in ALLOWED.items():
        for path in (REPO / folder).rglob("*.py"):
            for name in imported_modules(path):
                top = name.split(".")[0]
                if top in FOLDERS and top != "pdserve":
                    bad.append(f"{path.relative_to(REPO)} imports {name} (not under pdserve.)")
                parts = name.split(".")
                if top == "pdserve" and len(parts) > 1 and parts[1] in FOLDERS and parts[1] != folder:
                    if parts[1] not in allowed:
                        bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_kvcache_is_pure_python() -> None:
    code = "import sys, pdserve.engine.kvcache; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


@pytest.mark.parametrize("module", ["pdserve.router.actor", "pdserve.cluster.launcher", "pdserve.engine.model"])
def test_what_runs_no_model_imports_no_torch(module: str) -> None:
    """The router and ``pdserve up``'s driver read model configs and tokenizers but run no model:
    importing them must not import torch (over a second of every start)."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


@pytest.mark.slow
def test_wheel_installs_everything_under_pdserve_only(tmp_path: Path) -> None:
    """A non-editable build: site-packages gains ``pdserve/`` and its dist-info, nothing generic."""
    src = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    for name in [*FOLDERS, "proto"]:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    [wheel] = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pdserve", next(n.split("/")[0] for n in names if ".dist-info/" in n)}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            installed = "/".join((*package.split("."), *path.relative_to(REPO / folder).parts))
            assert installed in names, f"{path.relative_to(REPO)} is missing from the wheel"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
