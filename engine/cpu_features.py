"""Which bfloat16 matrix units this CPU has: the one fact the automatic dtype needs from the hardware.

AMX-BF16 (Sapphire Rapids and later: tile multiply units) and AVX512-BF16 (Cooper Lake, Zen 4:
``vdpbf16ps``) let oneDNN multiply bfloat16 matrices natively; without either, bfloat16 matmuls
are emulated through float32 conversions and are no faster than float32 ones.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# /proc/cpuinfo flag names, best first.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")


@functools.lru_cache(maxsize=1)
def cpu_bf16_units() -> tuple[str, ...]:
    """The bfloat16 matrix units of this CPU, as /proc/cpuinfo names them: a subset of
    ``("amx_bf16", "avx512_bf16")``, empty when it has neither.

    On Linux the kernel's flags are read (a flag the kernel does not enable, such as AMX on a
    kernel without its state support, is absent there). Elsewhere torch's own CPU probes answer
    (``torch.cpu._is_amx_tile_supported``, ``_is_avx512_bf16_supported``; AMX tiles stand for
    AMX-BF16, which every CPU with tiles so far has). Cached: the CPU does not change.
    """
    try:
        text = CPUINFO.read_text(encoding="ascii", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return tuple(f for f in BF16_FLAGS if f in flags)
    probes = (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    return tuple(name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)())
