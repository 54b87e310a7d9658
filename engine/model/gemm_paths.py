"""Which product a float32 projection runs on this machine: its packed copy or torch's, per row count.

Neither wins everywhere. On an AMD machine the panel kernel (``engine/kernels/cpu_gemm.c``) read the
weights faster than any torch path at every row count; on a Xeon with AMX, torch's products (MKL) are
faster at one row and from about 32 rows up, the kernel at 2-16 rows (``pdserve bench projections``,
docs/performance.md). So with ``EngineConfig.cpu_fp32_gemm="auto"`` (the default) the engine times
both when it packs the model: for every distinct weight shape, at one row count per class of
:data:`ROW_CLASSES`, on the threads it runs with. An input then takes the faster path of its class.
``"kernel"`` keeps the packed copy for every row count (no timing), ``"torch"`` keeps torch's products
(``linear.project`` without a copy) and builds no float32 copy.

Both paths compute ``x @ weight.T + bias`` in float32; they differ only in summation order, so
outputs agree to float32 rounding whichever is taken. A near tie keeps the packed copy
(:data:`MARGIN`); a class whose paths differ by about the margin (or a machine under load) can still
choose differently from one load to the next, and two processes may then take different paths for the
same class, each one's outputs within float32 rounding of the other's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.config import CPU_FP32_GEMM_CHOICES as GEMM_CHOICES

logger = logging.getLogger(__name__)

# Row-count classes (first, last; None: no bound) and the row count each is timed at. Decode batches
# fall in the first five, prefill chunks in the last. A decode batch of about 32 has a class of its own:
# timed at 64 rows, where the paths tie on some machines, it took torch's product in some loads although
# the kernel ran its projections 1.25x faster (docs/performance.md, "Reads in flight in the panel kernel").
ROW_CLASSES: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 7), (8, 23), (24, 47), (48, 127), (128, None))
CLASS_ROWS = (1, 4, 16, 32, 64, 256)
MARGIN = 0.05  # torch's path is taken only where it is at least this much faster
SAMPLES = 3  # timed samples per path and class (the fastest counts: a busy machine only adds time)
SAMPLE_S = 0.001  # a sample repeats the call until it lasts about this long


def row_class(rows: int) -> int:
    """The index in :data:`ROW_CLASSES` of an input of ``rows`` (>= 1) rows."""
    for i, (_, last) in enumerate(ROW_CLASSES):
        if last is None or rows <= last:
            return i
    raise AssertionError("the last class is unbounded")


@dataclass(frozen=True)
class RowPaths:
    """Per class of :data:`ROW_CLASSES`: True where torch's product is taken instead of the packed copy."""

    torch: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.torch) != len(ROW_CLASSES):
            raise ValueError(f"RowPaths needs {len(ROW_CLASSES)} classes, got {len(self.torch)}")

    @classmethod
    def every(cls, use_torch: bool) -> RowPaths:
        return cls((use_torch,) * len(ROW_CLASSES))

    def use_torch(self, rows: int) -> bool:
        return self.torch[row_class(rows)]

    def describe(self) -> str:
        """E.g. "torch at 1, 128+ rows; packed at 2-127"."""

        def spans(flag: bool) -> str:
            out = []
            for (first, last), t in zip(ROW_CLASSES, self.torch):
                if t != flag:
                    continue
                if out and out[-1][1] is not None and out[-1][1] + 1 == first:
                    out[-1] = (out[-1][0], last)
                else:
                    out.append((first, last))
            return ", ".join(f"{a}+" if b is None else (f"{a}" if a == b else f"{a}-{b}") for a, b in out) or "none"

        return f"torch at {spans(True)} rows; packed at {spans(False)}"


def faster_is_torch(packed_s: float, torch_s: float, margin: float = MARGIN) -> bool:
    """Whether torch's time beats the packed copy's by at least ``margin`` (a tie keeps the copy)."""
    return torch_s < packed_s * (1.0 - margin)


def _per_call(fn: Callable[[], object], repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def time_paths(packed: Callable[[torch.Tensor], torch.Tensor], unpacked: Callable[[torch.Tensor], torch.Tensor],
               in_features: int, rows: int, samples: int = SAMPLES) -> tuple[float, float]:  # fmt: skip
    """Seconds per call of ``packed`` and of ``unpacked`` on a random float32 ``[rows, in]`` input: the
    fastest of samples taken alternately (each repeats the call to last about ``SAMPLE_S``). The
    minimum, not the median: a sample that another process preempted is only slower, and on a loaded
    machine two of three can be."""
    x = torch.randn(rows, in_features, dtype=torch.float32)
    warm = min(_per_call(lambda: packed(x), 1), _per_call(lambda: unpacked(x), 1))
    repeats = max(1, min(1000, round(SAMPLE_S / max(warm, 1e-7))))
    a: list[float] = []
    b: list[float] = []
    for _ in range(samples):
        a.append(_per_call(lambda: packed(x), repeats))
        b.append(_per_call(lambda: unpacked(x), repeats))
    return min(a), min(b)


def measure(packed: Callable[[torch.Tensor], torch.Tensor], unpacked: Callable[[torch.Tensor], torch.Tensor],
            in_features: int, max_rows: int | None = None) -> RowPaths:  # fmt: skip
    """Time both paths at each class's row count (up to ``max_rows``: the classes past it take the
    last timed class's choice) and choose per class (:func:`faster_is_torch`)."""
    choice: list[bool] = []
    for rows in CLASS_ROWS:
        if max_rows is not None and rows > max_rows and choice:
            choice.append(choice[-1])
            continue
        choice.append(faster_is_torch(*time_paths(packed, unpacked, in_features, rows)))
    return RowPaths(tuple(choice))


@dataclass(frozen=True)
class Projection:
    """One projection to choose for: its dense weight and bias, its packed copy, and the most rows
    it will see (None: any; the LM head sees a batch's last positions only)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: Callable[[torch.Tensor], torch.Tensor]
    max_rows: int | None = None


def choose(projections: Sequence[Projection],
           unpacked: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]) -> list[RowPaths]:  # fmt: skip
    """A choice per projection, timed once per distinct (shape, bias, max_rows): ``unpacked(x, weight,
    bias)`` is torch's path. Logs what was chosen and how long the timing took."""
    t0 = time.perf_counter()
    by_key: dict[tuple, RowPaths] = {}
    out = []
    for p in projections:
        key = (tuple(p.weight.shape), p.bias is not None, p.max_rows)
        if key not in by_key:
            with torch.inference_mode():
                by_key[key] = measure(p.packed, lambda x, p=p: unpacked(x, p.weight, p.bias),
                                      p.weight.shape[1], p.max_rows)  # fmt: skip
        out.append(by_key[key])
    if by_key:
        shapes = "; ".join(f"{k[0][1]}x{k[0][0]}: {v.describe()}" for k, v in by_key.items())
        logger.info("float32 projections, timed in %.2f s on %d threads: %s", time.perf_counter() - t0,
                    torch.get_num_threads(), shapes)  # fmt: skip
    return out
