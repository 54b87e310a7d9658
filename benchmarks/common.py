"""Shared benchmark helpers: timing medians and output formatting."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def emit(result: dict[str, Any], as_json: bool, rows: list[tuple[str, str]]) -> None:
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
