"""FP8 KV-cache quantization: the formats, and the plain-torch quantize/dequantize every backend matches.

A quantized cache stores ``clamp(x / scale, -max, max)`` rounded to the nearest FP8 value (ties
to even), one scale per tensor (per layer, K and V apart, as vLLM's ``k_scale``/``v_scale``); a
read returns ``stored * scale``. Clamping keeps an outlier finite (a plain cast of an
out-of-range float to ``float8_e4m3fn`` gives NaN). The relative error of a value in the normal
range is at most half a unit in the last place: 2**-4 for e4m3 (3 mantissa bits), 2**-3 for e5m2.
"""

from __future__ import annotations

import math

import torch

# vLLM's names; "fp8" is e4m3 (more precision, range +-448), e5m2 has range +-57344.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype: no quantization
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def fp8_grid(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, exponent of the smallest normal value) of an FP8 format."""
    return _MANTISSA_BITS[dtype], int(math.log2(torch.finfo(dtype).smallest_normal))


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (any float dtype) as ``dtype`` (FP8) with scale ``scale``: computed in float32."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp_(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 values back as ``dtype``: ``x * scale`` (FP8 converts to any wider float exactly)."""
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)
