#!/usr/bin/env python
"""Generate the Python code of every ``.proto`` under ``proto/`` (and check it in CI).

    python scripts/gen_proto.py           # regenerate into the repository root
    python scripts/gen_proto.py --check   # exit 1 if the committed generated files differ

For ``proto/pdserve/v1/x.proto`` this runs, once for all protos together::

    python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/pdserve/v1/x.proto ...

which writes ``pdserve/v1/x_pb2.py``, ``x_pb2_grpc.py`` and ``x_pb2.pyi``, and adds an
``__init__.py`` to each directory of generated code (``pdserve/v1/``; ``pdserve/`` itself is
the hand-written root package of the project).
Generated files whose ``.proto`` is gone are deleted (reported as stale by ``--check``).
The output depends on the grpcio-tools version: CI must use the pinned one.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
INIT_TEXT = '"""Generated protobuf/gRPC code (scripts/gen_proto.py); do not edit."""\n'


def find_protos(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Every ``.proto`` under ``proto_dir``, relative to it, sorted (stable output)."""
    return sorted(p.relative_to(proto_dir) for p in proto_dir.rglob("*.proto"))


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on every proto into ``out_dir``; return the files written, relative to it."""
    protos = find_protos(proto_dir)
    if not protos:
        return []
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}",
        *(str(proto_dir / p) for p in protos),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
    written = {p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file()}
    # Each directory holding generated code is a regular package. Its parents (``pdserve/``)
    # are the project's own hand-written packages and are left alone.
    for parent in {rel.parent for rel in written}:
        init = parent / "__init__.py"
        if init not in written:
            (out_dir / init).write_text(INIT_TEXT)
            written.add(init)
    return sorted(written)


def package_roots(files: list[Path]) -> set[str]:
    """Top-level output directories (e.g. ``pdserve``): where stale generated files are looked for."""
    return {f.parts[0] for f in files if len(f.parts) > 1}


def stale_files(root: Path, generated: list[Path]) -> list[Path]:
    """Generated-looking files under the output packages that no proto produces any more."""
    fresh = set(generated)
    stale: list[Path] = []
    for top in sorted(package_roots(generated)):
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root)
            if path.is_file() and path.name.endswith(GENERATED_SUFFIXES) and rel not in fresh:
                stale.append(rel)
    return sorted(stale)


def differences(root: Path, tmp: Path, generated: list[Path]) -> list[str]:
    """Human-readable list of committed files that are missing, different or stale."""
    problems: list[str] = []
    for rel in generated:
        target = root / rel
        if not target.exists():
            problems.append(f"missing: {rel}")
        elif not filecmp.cmp(target, tmp / rel, shallow=False):
            problems.append(f"differs: {rel}")
    problems.extend(f"stale:   {rel}" for rel in stale_files(root, generated))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if anything differs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-proto-") as tmp_name:
        tmp = Path(tmp_name)
        generated = generate(tmp)
        problems = differences(ROOT, tmp, generated)
        if args.check:
            if problems:
                print("generated protobuf code is out of date; run: python scripts/gen_proto.py", file=sys.stderr)
                for line in problems:
                    print(f"  {line}", file=sys.stderr)
                return 1
            print(f"generated code up to date ({len(generated)} files from {len(find_protos())} protos)")
            return 0
        for rel in generated:
            target = ROOT / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists() or not filecmp.cmp(target, tmp / rel, shallow=False):
                shutil.copyfile(tmp / rel, target)
                print(f"wrote {rel}")
        for rel in stale_files(ROOT, generated):
            (ROOT / rel).unlink()
            print(f"removed stale {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
