"""The dtype a model runs in when ``EngineConfig.dtype`` is auto (None).

The rule, as vLLM's CPU backend picks bfloat16 where the CPU multiplies it natively:

- an explicit ``dtype`` always wins;
- on CUDA: bfloat16;
- on a CPU with bfloat16 matrix units (AMX-BF16 or AVX512-BF16, ``engine/cpu_features.py``;
  ``PDSERVE_CPU_BF16`` overrides the detection): bfloat16 for a checkpoint stored in reduced
  precision, i.e. a ``config.json`` whose ``torch_dtype``/``dtype`` is bfloat16 or float16, or a
  GGUF file with any tensor in a type other than F32/F64 (F16, BF16 or a quantized type);
  float32 for a checkpoint stored in float32 (or that does not say);
- on any other CPU: float32.

Why these lines: a reduced-precision checkpoint loses nothing its author trained with when it
runs in bfloat16 on matrix units that are 3-5x faster than float32 ones (docs/performance.md, "The CPU's
matrix units"); float16 checkpoints run in bfloat16 too, because bfloat16 covers float16's
range and CPUs without AMX-FP16 have no fast float16 matmul. A float32 checkpoint keeps float32
(vLLM would cast it down): its author chose full precision, and the small float32 models this
project tests against transformers stay exact. Without bfloat16 units, bfloat16 is emulated
through float32 and only loses precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve import envs
from pdserve.engine.cpu_features import cpu_bf16_units
from pdserve.engine.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REDUCED = ("bfloat16", "float16")
FULL_GGUF_TYPES = frozenset({"F32", "F64"})


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype chosen and why, in words for the engine's start-up log line."""

    dtype: torch.dtype
    why: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def stored_precision(path: str | Path, config: ModelConfig) -> tuple[bool, str]:
    """``(reduced, what)``: whether the checkpoint at ``path`` is stored in reduced precision (see
    the module's rule), and how it is stored in words (``"bfloat16"``, ``"GGUF Q4_1, Q8_0"``...)."""
    if str(path).endswith(".gguf"):
        from pdserve.engine.model.gguf import tensor_types

        lower = sorted(tensor_types(path) - FULL_GGUF_TYPES)
        return bool(lower), "GGUF " + ", ".join(lower or sorted(tensor_types(path)))
    stored = (config.torch_dtype or "").removeprefix("torch.")
    return stored in REDUCED, stored or "an unstated dtype"


def cpu_bf16(units: tuple[str, ...] | None = None) -> tuple[bool, str]:
    """``(has, what)``: whether the CPU counts as having bfloat16 matrix units, and why in words.
    ``units``: the detected units (None: ``PDSERVE_CPU_BF16``, else ``cpu_bf16_units()``)."""
    if units is None:
        forced = envs.cpu_bf16()
        if forced is not None:
            return forced, f"PDSERVE_CPU_BF16={int(forced)}"
        units = cpu_bf16_units()
    return bool(units), " and ".join(units) if units else "no AMX-BF16 or AVX512-BF16"


def choose_dtype(requested: str | None, device: torch.device, reduced: bool, stored: str,
                 has_bf16: bool, cpu: str) -> DtypeChoice:  # fmt: skip
    """The rule (module docstring) on facts already gathered: ``requested`` (``EngineConfig.dtype``,
    None for auto), the checkpoint's ``reduced`` precision and ``stored`` dtype in words, and the
    CPU's ``has_bf16`` units with ``cpu`` in words."""
    if requested is not None:
        return DtypeChoice(DTYPES[requested], "as configured")
    if device.type != "cpu":
        return DtypeChoice(torch.bfloat16, f"auto on {device.type}")
    if has_bf16 and reduced:
        return DtypeChoice(torch.bfloat16, f"auto: checkpoint stored in {stored}, CPU has {cpu}")
    if has_bf16:
        return DtypeChoice(torch.float32, f"auto: checkpoint stored in {stored}, kept in float32")
    return DtypeChoice(torch.float32, f"auto: CPU has {cpu}")


def resolve_dtype(requested: str | None, path: str | Path, config: ModelConfig, device: torch.device,
                  units: tuple[str, ...] | None = None) -> DtypeChoice:  # fmt: skip
    """The dtype the engine loads ``path`` in. ``units`` injects the CPU's bfloat16 units (tests);
    None reads ``PDSERVE_CPU_BF16``, then the CPU. The checkpoint and the CPU are only read when
    the answer depends on them (auto on a CPU)."""
    if requested is not None or device.type != "cpu":
        return choose_dtype(requested, device, False, "", False, "")
    reduced, stored = stored_precision(path, config)
    has_bf16, cpu = cpu_bf16(units)
    return choose_dtype(None, device, reduced, stored, has_bf16, cpu)
