"""CostModel: pull a prompt's KV from a prefill worker, or recompute it on the decode worker?

Both costs are learnt from what the service does, not set by hand:

* **Compute**, per worker: the seconds a prefill takes as a line in the tokens it computes,
  ``t = a + b * n``, fitted to every prefill the router sees (a prefill worker's call; a decode
  worker's local prefill, its time to first token), with exponential forgetting so that a
  worker that slows down (load, another model) is seen as slow soon.
* **Link**, per (prefill worker, decode worker) pair: ``t = c + bytes / bandwidth``, fitted to
  every pull the decode worker reports (bytes and seconds).

``choose`` compares, for the decode worker the router picked: recomputing the tokens it lacks
there, against prefilling on the prefill worker (what that one lacks) and pulling the missing KV
over the pair's link: the time until the decode worker holds the prompt's KV. Until a side has
measurements it falls back to the fixed threshold (``fallback_threshold`` tokens, the old
policy), so a fresh cluster behaves as before and learns within its first requests. A path that
is never taken is never measured: every ``explore_every``-th choice takes the other one (every
4th while a side still lacks measurements), so both estimates stay current. Pure Python, no
clock: callers pass what they measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_SAMPLES = 3  # measurements before a fit is trusted


@dataclass
class LineFit:
    """Least squares of ``y = a + b x`` over exponentially weighted samples (``half_life`` samples)."""

    half_life: float = 32.0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    samples: int = 0

    def add(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return
        keep = 0.5 ** (1.0 / self.half_life)
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``, both >= 0. With too little spread in ``x``, the line through the origin."""
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1.0):
            return 0.0, (my / mx if mx > 0 else 0.0)
        b = max((self._xy / self._w - mx * my) / var, 0.0)
        return max(my - b * mx, 0.0), b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


@dataclass(frozen=True)
class Choice:
    """The decision and what it rested on (seconds; None where a side was not measured yet)."""

    pull: bool
    local_s: float | None = None
    pull_s: float | None = None
    reason: str = ""


@dataclass
class CostModel:
    """``kv_bytes_per_token``: what one token's KV weighs on the wire; learnt from the pulls
    (bytes over tokens) when not given."""

    kv_bytes_per_token: float = 0.0
    fallback_threshold: int = 32
    half_life: float = 32.0
    explore_every: int = 32
    _choices: int = 0
    _compute: dict[str, LineFit] = field(default_factory=dict)
    _links: dict[tuple[str, str], LineFit] = field(default_factory=dict)

    def observe_prefill(self, worker: str, computed_tokens: int, seconds: float) -> None:
        """A prefill of ``computed_tokens`` tokens (not found in a cache) took ``seconds`` on ``worker``."""
        if computed_tokens > 0:
            self._compute.setdefault(worker, LineFit(self.half_life)).add(computed_tokens, seconds)

    def observe_pull(self, src: str, dst: str, num_bytes: int, num_tokens: int, seconds: float) -> None:
        """``dst`` pulled ``num_bytes`` of KV (``num_tokens`` tokens') from ``src`` in ``seconds``."""
        if num_bytes > 0:
            self._links.setdefault((src, dst), LineFit(self.half_life)).add(num_bytes, seconds)
            if num_tokens > 0:
                self.kv_bytes_per_token = num_bytes / num_tokens

    def link_gbps(self, src: str, dst: str) -> float | None:
        fit = self._links.get((src, dst))
        if fit is None or not fit.ready:
            return None
        b = fit.coefficients()[1]
        return None if b <= 0 else 8 / b / 1e9

    def choose(self, decode: str, missing_on_decode: int, prefill: str, computed_on_prefill: int) -> Choice:
        """Pull (prefill on ``prefill``, then move ``missing_on_decode`` tokens' KV) or recompute
        the ``missing_on_decode`` tokens on ``decode``?"""
        if missing_on_decode <= 0:
            return Choice(False, 0.0, None, "the decode worker holds the whole prompt")
        self._choices += 1
        local, remote, link = self._compute.get(decode), self._compute.get(prefill), self._links.get((prefill, decode))
        local_ready = bool(local and local.ready)
        pull_ready = bool(remote and remote.ready and link and link.ready and self.kv_bytes_per_token > 0)
        if not (local_ready and pull_ready):
            if self._choices % 4 == 0:  # measure the side that lacks measurements
                return Choice(not pull_ready, reason="exploring: a side is not measured yet")
            pull = missing_on_decode > self.fallback_threshold
            return Choice(pull, reason=f"not measured yet: fixed threshold of {self.fallback_threshold} tokens")
        assert local is not None and remote is not None and link is not None
        local_s = local.predict(missing_on_decode)
        pull_s = remote.predict(computed_on_prefill) + link.predict(missing_on_decode * self.kv_bytes_per_token)
        if self._choices % self.explore_every == 0:  # keep the losing side's estimate current
            return Choice(not pull_s < local_s, local_s, pull_s, "exploring")
        return Choice(pull_s < local_s, local_s, pull_s, "measured")
