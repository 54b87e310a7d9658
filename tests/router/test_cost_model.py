"""CostModel: fits recover the lines they are fed, and the choice follows the measured costs."""

from __future__ import annotations

import random

import pytest

from pdserve.router.cost_model import MIN_SAMPLES, CostModel, LineFit

KV = 46_080  # bytes of KV per token (SmolLM2, float32)


def test_a_line_fit_recovers_the_line_and_forgets_the_past() -> None:
    fit = LineFit(half_life=8)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 2000)
        fit.add(n, 0.02 + 1e-4 * n * rng.uniform(0.95, 1.05))
    a, b = fit.coefficients()
    assert a == pytest.approx(0.02, abs=0.01) and b == pytest.approx(1e-4, rel=0.05)
    for _ in range(60):  # the worker got 3x slower: the fit follows within a few half-lives
        n = rng.randrange(1, 2000)
        fit.add(n, 0.02 + 3e-4 * n)
    assert fit.coefficients()[1] == pytest.approx(3e-4, rel=0.05)


def test_a_fit_of_one_size_goes_through_the_origin() -> None:
    fit = LineFit()
    for _ in range(5):
        fit.add(100, 0.5)
    assert fit.coefficients() == (0.0, pytest.approx(0.005)) and fit.predict(200) == pytest.approx(1.0)


def _measured(model: CostModel, decode_s_per_token: float, prefill_s_per_token: float, link_gbps: float,
              latency_s: float) -> None:  # fmt: skip
    for n in (64, 256, 1024, 2048):
        model.observe_prefill("d", n, 0.005 + decode_s_per_token * n)
        model.observe_prefill("p", n, 0.005 + prefill_s_per_token * n)
        model.observe_pull("p", "d", n * KV, n, latency_s + n * KV * 8 / (link_gbps * 1e9))


def test_before_measurements_the_fixed_threshold_decides_and_the_unmeasured_side_is_tried() -> None:
    model = CostModel(fallback_threshold=32)
    for n in (100, 200, 400):  # the pull side is measured, local prefills are not
        model.observe_prefill("p", n, 0.001 * n)
        model.observe_pull("p", "d", n * KV, n, 0.01)
    assert not model.choose("d", 32, "p", 32).pull and model.choose("d", 33, "p", 33).pull
    assert model.choose("d", 500, "p", 500).pull
    explored = model.choose("d", 500, "p", 500)  # every 4th: the side without measurements
    assert explored.reason.startswith("exploring") and not explored.pull
    model.observe_prefill("d", 100, 0.1)  # one side alone is not enough
    assert "not measured" in model.choose("d", 500, "p", 500).reason
    model = CostModel(explore_every=10**9)
    assert not model.choose("d", 0, "p", 500).pull  # nothing missing: nothing to pull


def test_a_fast_link_pulls_and_a_slow_one_recomputes() -> None:
    fast = CostModel(explore_every=10**9)
    _measured(fast, decode_s_per_token=2e-4, prefill_s_per_token=2e-4, link_gbps=10, latency_s=0.0002)
    assert fast.link_gbps("p", "d") == pytest.approx(10, rel=0.01) and fast.kv_bytes_per_token == KV
    # The prefill worker holds 900 of the 1,000 tokens the decode worker lacks: it computes 100,
    # and the link moves 1,000 tokens' KV (46 MB) in 37 ms, against 0.2 s to recompute them.
    c = fast.choose("d", 1000, "p", 100)
    assert c.pull and c.reason == "measured" and c.pull_s is not None and c.local_s is not None
    assert c.pull_s < c.local_s / 2
    # With nothing cached anywhere and equal compute, pulling adds the link to the same prefill.
    assert not fast.choose("d", 1000, "p", 1000).pull
    slow = CostModel(explore_every=10**9)
    # A prefill worker 4x faster (a bigger GPU), but a link of 0.1 Gbit/s: 1,000 tokens of KV are
    # 46 MB, 3.7 s on the wire, against 0.2 s to recompute.
    _measured(slow, decode_s_per_token=2e-4, prefill_s_per_token=5e-5, link_gbps=0.1, latency_s=0.005)
    assert not slow.choose("d", 1000, "p", 100).pull
    # Short prompts on a fast link with a slow decode worker still pull: the cost is measured, not a threshold.
    busy = CostModel(explore_every=10**9)
    _measured(busy, decode_s_per_token=2e-3, prefill_s_per_token=1e-4, link_gbps=10, latency_s=0.0002)
    assert busy.choose("d", 24, "p", 24).pull


def test_bad_samples_are_ignored() -> None:
    fit = LineFit()
    for x, y in ((float("nan"), 1.0), (1.0, float("inf")), (-1.0, 1.0), (1.0, -1.0)):
        fit.add(x, y)
    assert fit.samples == 0 and not fit.ready
    for _ in range(MIN_SAMPLES):
        fit.add(10, 1)
    assert fit.ready


def test_the_losing_side_is_explored_now_and_then() -> None:
    model = CostModel(explore_every=8)
    _measured(model, decode_s_per_token=2e-4, prefill_s_per_token=5e-5, link_gbps=0.1, latency_s=0.005)
    choices = [model.choose("d", 1000, "p", 100) for _ in range(32)]
    assert [c.pull for c in choices].count(True) == 4 and all(c.reason == "exploring" for c in choices if c.pull)
