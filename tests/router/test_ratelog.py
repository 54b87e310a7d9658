"""RateLimitFilter: at most ``burst`` alike records per interval, then a count of those dropped."""

from __future__ import annotations

import logging

import pytest

from pdserve.ratelog import RateLimitFilter


def test_alike_records_are_limited_per_interval_and_the_next_one_counts_the_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = logging.getLogger("pdserve.test.ratelog")
    limiter = RateLimitFilter(burst=3, interval_s=10.0, clock=lambda: now[0])
    log.addFilter(limiter)
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.test.ratelog"):
            for i in range(50):
                log.error("request failed (%s)", f"ref-{i}")  # one kind, whatever the argument
            log.warning("another kind")
            assert [r.getMessage() for r in caplog.records] == [
                "request failed (ref-0)", "request failed (ref-1)", "request failed (ref-2)", "another kind"]
            caplog.clear()
            now[0] = 10.0  # the next interval
            log.error("request failed (%s)", "ref-x")
            assert [r.getMessage() for r in caplog.records] == [
                "request failed (ref-x) (47 similar messages suppressed in the last interval)"]
    finally:
        log.removeFilter(limiter)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        RateLimitFilter(burst=0)
