"""Rotary position embeddings: inverse frequencies (plain, llama3, YaRN), cos/sin tables, rotation."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.model.config import Llama3RopeScaling, ModelConfig
from pdserve.engine.model.deepseek_config import YarnRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | YarnRopeScaling | None,
                  factors: tuple[float, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """float32 ``[head_dim // 2]`` inverse frequencies, with llama3 or YaRN scaling applied, as
    parameters (``scaling``) or as a GGUF file's per-frequency divisors (``factors``)."""
    # Same expression as HF so the float32 tables agree bit for bit. Explicit CPU:
    # the model may be built under a meta-device context, the tables never are.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if factors is not None:
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, y: YarnRopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, with a
    linear ramp between (the YaRN paper; the same float32 expression as transformers)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (y.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    """cos/sin tables up to ``max_position_embeddings``, stored half-width.

    HF's tables are ``cat(freqs, freqs)``; both halves are equal, so only
    ``head_dim // 2`` columns are kept (half the memory for 128k-context models).
    YaRN's attention factor is folded into both tables, as transformers does.
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        cos, sin = self._tables()
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_freq_factors)
        pos = torch.arange(c.max_position_embeddings, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(pos, inv_freq)  # float32 [max_pos, head_dim // 2]
        if isinstance(c.rope_scaling, YarnRopeScaling):
            factor = c.rope_scaling.cos_sin_factor
            return freqs.cos() * factor, freqs.sin() * factor
        return freqs.cos(), freqs.sin()

    @torch.no_grad()
    def rebuild(self) -> None:
        """Recompute the tables in place (``to_empty`` leaves them uninitialised)."""
        cos, sin = self._tables()
        self.cos_cache.copy_(cos)
        self.sin_cache.copy_(sin)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[num_tokens, 1, head_dim // 2]`` in ``dtype``.

        Positions must lie in ``[0, max_position_embeddings)``; not checked here
        (a host sync per step would cost more than a tiny model's whole step).
        """
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]``; equals HF's rotate_half form exactly."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` whose dims come in pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout).

    The result is de-interleaved (rotated evens, then rotated odds), as transformers' DeepSeek-V3
    returns it; applied to both q and k this permutation leaves every q·k unchanged, so it also
    serves V2, whose reference keeps the pairs interleaved.
    """
    return apply_rotary(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)
