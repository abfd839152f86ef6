"""compute._time_ms: the statistic the caller asks for, on a known skewed set of timings."""

from __future__ import annotations

import statistics

import pytest

from kvbench.p2p import compute


class FakeClock:
    """perf_counter that advances by a scripted duration each time the timed fn runs."""

    def __init__(self, durations_ms):
        self.t, self.durations = 100.0, list(durations_ms)

    def perf_counter(self) -> float:
        return self.t

    def work(self) -> None:
        self.t += self.durations.pop(0) / 1e3


SKEWED = [9.0, 1.0, 1.5, 30.0, 2.0, 1.2, 12.0]  # a few busy moments inflate some runs


@pytest.mark.parametrize("stat,expected", [
    (min, 1.0),
    (statistics.median, 2.0),
    (max, 30.0),
    (statistics.mean, sum(SKEWED) / len(SKEWED)),
])
def test_time_ms_returns_the_requested_statistic(monkeypatch, stat, expected):
    clock = FakeClock(SKEWED)
    monkeypatch.setattr(compute.time, "perf_counter", clock.perf_counter)
    got = compute._time_ms(clock.work, "cpu", len(SKEWED), stat)
    assert got == pytest.approx(expected)
    assert clock.durations == []  # every rep ran once


def test_time_ms_defaults_to_the_median(monkeypatch):
    clock = FakeClock(SKEWED)
    monkeypatch.setattr(compute.time, "perf_counter", clock.perf_counter)
    assert compute._time_ms(clock.work, "cpu", len(SKEWED)) == pytest.approx(2.0)
